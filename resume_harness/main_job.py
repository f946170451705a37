# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
# pylint: disable=bad-builtin
"""The main job's DistributedOptimizer part and its verdict: DDP + DistributedOptimizer resumes,
upstream 0.19.2 beside the fork, each resuming its own checkpoint, on the cases the table
names for the main job."""

import importlib
import json
import os

import torch

from . import table
from .distopt_report import side_by_side

# Both implementations run the main job's model in bf16, as Megatron-LM trains with offload.
DTYPE = "bf16"
# A rank left waiting by another rank's error gives up after this long.
COLLECTIVE_TIMEOUT_S = 120


def formats():
    """The main job's formats: what each Megatron-LM ``--ckpt-format`` writes by default."""
    return [row.name for row in table.FORMAT_ROWS if row.default_of]


def te_formats():
    """The format the TE kinds are measured on: Megatron-LM's default dist checkpoint."""
    return [row.name for row in table.FORMAT_ROWS if row.default_of == "torch_dist"]


def te_kinds():
    """The TE FusedAdam kinds the main job measures: those of the resume matrix."""
    return table.kind_names(te=True, resume_matrix=True)


def distributed_check(args, device, json_path=None, tool=None):
    """DDP + DistributedOptimizer resume, upstream 0.19.2 beside the fork, each resuming its own
    checkpoint (:func:`resume_harness.drive.drive`: torchrun jobs, one per side).

    The fork's side runs first and is printed, and written to ``json_path``, as soon as it is
    done, so a run cut short (a time limit, upstream's load job dying again and again) still
    shows the fork's figures; the table of both sides follows at the end.

    Args:
        args: the parsed command line.
        device: ``"cuda"`` or ``"cpu"``.
        json_path: where the results so far are written after each side, if given.
        tool: what drives the jobs: ``product``, ``te_unavailable``, ``Shape``, ``drive`` and
            ``report`` as :mod:`resume_harness` has them (the package when not given).

    Returns:
        dict or None: the results by case id, or None where it cannot run here.
    """
    if args.distributed == "off":
        return None
    tool = tool or importlib.import_module(__package__)
    te_cases = tool.product([DTYPE], [0.0], te_formats(), te_kinds())
    missing = tool.te_unavailable(te_cases[0])
    if missing:
        print(f"\n{missing}; no TE FusedAdam or precision-aware figures are measured")
    if device != "cuda":
        print(
            "\ndistributed optimizer: skipped, megatron-core's DDP buffers need a CUDA device "
            "(this host has none); no figures are invented for it"
        )
        return None
    cases = tool.product([DTYPE], sorted({0.0, args.offload_fraction}), formats())
    if not missing:
        # A variant this TE cannot give (e.g. remainders on TE < 2.1) is listed as skipped.
        cases += te_cases
    nproc = min(torch.cuda.device_count(), 2)
    shape = tool.Shape(args.dist_hidden, args.dist_ffn)
    print(
        f"\ndistributed optimizer: DDP world size {nproc}, {DTYPE}, {shape.numel / 1e6:.1f}M "
        "parameters, offload on and off"
        + ("" if missing else f"; TE FusedAdam variants {', '.join(te_kinds())}")
    )
    results = {}
    for side in ("fork", "upstream"):
        # One job at a time: the load times of the two implementations are compared.
        done = tool.drive(
            cases,
            [(side, side)],
            nproc,
            side_by_side=False,
            shape=shape,
            collective_timeout=COLLECTIVE_TIMEOUT_S,
            log_dir=json_path and os.path.join(os.path.dirname(json_path), f"logs_{side}"),
        )
        results.update(done)
        if json_path:
            with open(json_path, "w", encoding="utf-8") as out:
                json.dump(results, out, indent=1, default=str)
        if side == "fork":
            print("\nfork, resuming its own checkpoints:")
            tool.report(done)
    print("\nupstream 0.19.2 beside the fork, each resuming its own checkpoints:")
    tool.report(results)
    side_by_side(results)
    return results


def verdict(results, distributed):
    """``(passed, why)``: the fork resumed exactly in the single-process check and in every
    distributed case it ran."""
    fork = results.get("fork", {})
    if "error" in fork:
        return False, f"the fork's resume check failed: {fork['error'][:200]}"
    if not fork.get("exact"):
        return (
            False,
            f"the fork's resumed parameters differ (max |diff| {fork.get('max_abs_diff')})",
        )
    ran = {
        k: r for k, r in (distributed or {}).items() if "fork2fork" in k and not r.get("skipped")
    }
    inexact = sorted(k for k, r in ran.items() if not r.get("exact"))
    if inexact:
        return (
            False,
            f"the fork did not resume exactly in {len(inexact)} distributed cases: {inexact}",
        )
    upstream = results.get("upstream 0.19.2", {})
    beside = (
        "upstream could not run"
        if "error" in upstream
        else (
            "upstream "
            + ("resumed exactly too" if upstream.get("exact") else "did not resume exactly")
        )
    )
    scope = f" and in {len(ran)} distributed cases" if ran else ""
    return True, f"the fork resumed bit-exactly in the single-process check{scope}; {beside}"
