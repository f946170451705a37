# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
# pylint: disable=bad-builtin
"""GPU memory and time of a DistributedOptimizer checkpoint load, upstream 0.19.2 beside the fork.

Each row is a configuration people resume in: a precision mode (fp32 or bf16 parameters, TE
FusedAdam with fp32 moments, Megatron's precision-aware optimizer with bf16 or fp16 moments,
the HybridDeviceOptimizer with offloaded state) and a dist-checkpoint format. For each row
and implementation, ``tools/distopt_resume.py`` trains a DDP model, saves, and resumes a
fresh model and optimizer from the checkpoint, measuring around every phase of the load:

``is_loading``
    the first pass, ``optimizer.sharded_state_dict(..., is_loading=True)``;
``read``
    ``dist_checkpointing.load``;
``load_state_dict``
    the second pass.

It reports each phase's peak GPU memory and what stays allocated after it, above the memory
allocated before the load, in MiB and in state sets: one state set is the bytes of
``exp_avg`` + ``exp_avg_sq`` of the rank's shard in their stored dtype on the GPU, and "state"
is everything the optimizer keeps per parameter there (master copies or remainders too), the
least any load must allocate. Offloaded state lives on the host; where no state is on the GPU
only MiB are shown. It also reports the whole load's wall time, each phase's (``phases s``:
up to its last kernel, in the order above), and whether the resumed run is bit-exact. Each
implementation resumes its own checkpoint, one job at a time; by default each load job reads
its checkpoint's files into the page cache before it is timed (``--page-cache``), so that the
times compare the two loads rather than what the disk happened to have cached for each.

Needs CUDA and Transformer Engine (rows needing TE are reported as skipped without it)."""

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

import megatron_optimizer_fork as overlay

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import resume_harness as distopt_resume  # noqa: E402  pylint: disable=wrong-import-position

ROWS = {
    "fp32-dp_reshardable": "fp32-off0-dp_reshardable-fused_adam",
    "bf16-dp_reshardable": "bf16-off0-dp_reshardable-fused_adam",
    "bf16-dp_zero_gather_scatter": "bf16-off0-dp_zero_gather_scatter-fused_adam",
    "fp32-fully_reshardable": "fp32-off0-fully_reshardable-fused_adam",
    "precision_aware-dp_reshardable": "bf16-off0-dp_reshardable-precision_aware_remainders",
    "precision_aware-fully_reshardable": "bf16-off0-fully_reshardable-precision_aware_remainders",
    "precision_aware_fp16-dp_reshardable": "bf16-off0-dp_reshardable-precision_aware_fp16",
    "hdo_offload0.5-dp_reshardable": "bf16-off0.5-dp_reshardable",
    "hdo_offload1-dp_reshardable": "bf16-off1-dp_reshardable",
}
"""Row name -> ``distopt_resume`` case: the issue's table, fp16 moments, and the HDO."""

PHASES = ("is_loading", "read", "load_state_dict")
IMPLEMENTATIONS = ("upstream", "fork")
TREE_PREFIX = "fork@"
"""Sides of ``--fork-tree``: ``fork@PATH`` loads with the fork's modules of the checkout at PATH."""


def figures(result):
    """A result's load figures in state sets (None where no state set is on the GPU) and MiB.

    Returns:
        dict: ``state_set_mib``, ``state_sets`` (everything kept per parameter on the GPU, in
        state sets), then ``<phase>_peak`` / ``<phase>_after`` in state sets and
        ``<phase>_peak_mib`` / ``<phase>_after_mib``, ``<phase>_s`` (its wall time), ``peak``,
        ``load_s`` and ``exact``.
    """
    state = result.get("optimizer_state_bytes") or {}
    unit = state.get("gpu_moments") or 0
    sets = (lambda value: value / unit) if unit else (lambda value: None)
    out = {
        "state_set_mib": unit / 2**20,
        "state_sets": sets(state.get("gpu_all", 0)),
        "peak": sets(result.get("load_peak_gpu_extra_bytes") or 0),
        "load_s": result.get("load_seconds"),
        "exact": bool(result.get("exact")),
        "error": result.get("error"),
    }
    for phase in PHASES:
        for kind, key in (("peak", "load_phase_peak_gpu_extra_bytes"), ("after", None)):
            key = key or "load_phase_after_gpu_extra_bytes"
            value = (result.get(key) or {}).get(phase)
            out[f"{phase}_{kind}_mib"] = None if value is None else value / 2**20
            out[f"{phase}_{kind}"] = None if value is None else sets(value)
        out[f"{phase}_s"] = (result.get("load_phase_seconds") or {}).get(phase)
    return out


def _cell(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}"


def _phase_times(item):
    """Each phase's wall time, in the order of :data:`PHASES`, as ``a/b/c``."""
    return "/".join(_cell(item.get(f"{phase}_s")) for phase in PHASES)


def _spread(times):
    """`` (n runs, min-max s)`` after the median load time, when there are several runs."""
    if len(times) < 2:
        return ""
    return f"  ({len(times)} runs, {min(times):.3f}-{max(times):.3f} s)"


def report(table, out=sys.stdout):
    """Print one block per row: upstream and fork, each phase's peak and what stays after it."""
    for row, by_side in table.items():
        print(f"\n{row}  ({ROWS[row]})", file=out)
        print(
            f"  {'':9} {'set MiB':>8} {'state':>6} | "
            + " | ".join(f"{p + ' peak/after':>27}" for p in PHASES)
            + f" | {'peak':>5} {'load s':>7} {'phases s':>14} exact",
            file=out,
        )
        for side in [*IMPLEMENTATIONS, *(side for side in by_side if side not in IMPLEMENTATIONS)]:
            item = by_side.get(side)
            if item is None:
                print(f"  {side:9} not run", file=out)
                continue
            if item.get("skipped"):
                print(f"  {side:9} skipped: {item['skipped'][:200]}", file=out)
                continue
            cells = []
            for phase in PHASES:
                peak, after = item[f"{phase}_peak"], item[f"{phase}_after"]
                cells.append(
                    f"{_cell(peak)}/{_cell(after)} sets "
                    f"{_cell(item[f'{phase}_peak_mib'], 0)}/{_cell(item[f'{phase}_after_mib'], 0)}"
                    if peak is not None or item[f"{phase}_peak_mib"] is None
                    else f"{_cell(item[f'{phase}_peak_mib'], 0)}/"
                    f"{_cell(item[f'{phase}_after_mib'], 0)} MiB"
                )
            print(
                f"  {side:9} {item['state_set_mib']:8.0f} {_cell(item['state_sets']):>6} | "
                + " | ".join(f"{c:>27}" for c in cells)
                + f" | {_cell(item['peak']):>5} {_cell(item['load_s'], 3):>7} "
                + f"{_phase_times(item):>14} "
                + ("yes" if item["exact"] else "NO")
                + _spread(item.get("load_s_all") or []),
                file=out,
            )
            if item.get("error"):
                print(f"  {'':9} error: {item['error'][:300]}", file=out)
    print(file=out)
    for side, folders in module_folders(table).items():
        print(f"{side} modules from: {', '.join(folders) or 'not reported'}", file=out)


def module_folders(table):
    """The folders of the ``distrib_optimizer`` modules each implementation's jobs saved and
    loaded with, over every row: what a run measured, whichever tree or site it ran from.

    Returns:
        dict: implementation -> sorted folders (empty where no job reported one).
    """
    folders = {}
    for by_side in table.values():
        for side, item in by_side.items():
            files = (item.get("raw") or {}).get("module_files") or {}
            found = folders.setdefault(side, set())
            found.update(os.path.dirname(path) for path in files.values() if path)
    return {side: sorted(found) for side, found in folders.items()}


def progress_line(row, side, repeat, result):
    """One job's outcome as soon as it ends, so that a run cut short still shows what ran."""
    head = f"  run {repeat + 1} {side:8} {row}:"
    if result.get("skipped"):
        return f"{head} skipped"
    error = f"error: {result['error'][:200]}" if result.get("error") else None
    if result.get("load_seconds") is None:
        return f"{head} {error or 'no load time'}"
    item = figures(result)
    peaks = "/".join(_cell(item[f"{phase}_peak"]) for phase in PHASES)
    return (
        f"{head} load {_cell(item['load_s'], 3)} s (phases {_phase_times(item)} s), "
        f"peaks {peaks} sets, "
        + (f"then {error}" if error else f"exact {'yes' if result.get('exact') else 'NO'}")
    )


def run(
    rows,
    shape,
    nproc,
    steps_before,
    steps_after,
    log_dir=None,
    repeats=1,
    out=None,
    sides=IMPLEMENTATIONS,
):
    """Measure ``rows`` for each implementation of ``sides``; returns ``{row: {side: figures}}``.

    With ``repeats`` above 1 each implementation loads again, the order of the two
    alternating, so that a slower machine phase does not fall on one side only (see
    :func:`summarise` for how the runs are folded into one row). Each implementation trains
    and saves once; its later runs load the same checkpoint again in a fresh load job. With
    ``out`` a stream, each job's :func:`progress_line` is written to it as the job ends.
    """
    cases = [distopt_resume.Case.parse(ROWS[row]) for row in rows]
    runs = {row: {side: [] for side in sides} for row in rows}
    with tempfile.TemporaryDirectory(prefix="load_memory_") as workdir:
        for repeat in range(repeats):
            order = sides if repeat % 2 == 0 else sides[::-1]
            for side in order:
                implementation, tree = implementation_of(side)
                # A tree's path is no folder name.
                folder = side if tree is None else f"fork_tree{sides.index(side)}"
                logs = log_dir and str(Path(log_dir) / f"logs_{folder}_{repeat}")
                with fork_tree_environment(tree):
                    results = distopt_resume.drive(
                        cases,
                        [(implementation, implementation)],
                        nproc,
                        steps_before,
                        steps_after,
                        workdir=str(Path(workdir) / folder),
                        side_by_side=False,
                        shape=shape,
                        log_dir=logs,
                        reuse_saves=True,
                    )
                for row, case in zip(rows, cases):
                    key = case.key(nproc, implementation, implementation)
                    result = results.get(key, {"error": "no result"})
                    runs[row][side].append(result)
                    if out is not None:
                        print(progress_line(row, side, repeat, result), file=out, flush=True)
    return {row: {side: summarise(runs[row][side]) for side in sides} for row in rows}


def implementation_of(side):
    """``(implementation, tree)`` of a side: ``fork@PATH`` is the fork from checkout PATH."""
    if side.startswith(TREE_PREFIX):
        return "fork", side[len(TREE_PREFIX) :]
    return side, None


@contextlib.contextmanager
def fork_tree_environment(tree):
    """Inside, the jobs started (they inherit the environment) take the fork's modules from
    ``tree``'s ``megatron/`` folder; with ``tree`` None, from wherever the overlay serves them."""
    before = os.environ.pop(distopt_resume.FORK_TREE_ENV, None)
    if tree is not None:
        os.environ[distopt_resume.FORK_TREE_ENV] = os.path.abspath(tree)
    try:
        yield
    finally:
        os.environ.pop(distopt_resume.FORK_TREE_ENV, None)
        if before is not None:
            os.environ[distopt_resume.FORK_TREE_ENV] = before


def summarise(results):
    """One row and implementation over its runs: the memory figures of the first run that
    loaded, exact only if every run was, every failed run's error, and the median load time
    of the runs that loaded (``load_s_all`` lists them). A run loaded when its load finished:
    one whose resumed steps failed after it still has a load time, and its error."""
    if results[0].get("skipped"):
        return {"skipped": results[0]["skipped"], "raw": results[0]}
    loaded = [result for result in results if result.get("load_seconds") is not None]
    item = figures((loaded or results)[0])
    item["raw"] = (loaded or results)[0]
    item["exact"] = all(result.get("exact") and not result.get("error") for result in results)
    errors = [f"run {n + 1}: {r['error']}" for n, r in enumerate(results) if r.get("error")]
    item["error"] = "; ".join(errors) if errors else None
    item["load_s_all"] = [r["load_seconds"] for r in loaded]
    item["load_s"] = statistics.median(item["load_s_all"]) if item["load_s_all"] else None
    for phase in PHASES:
        times = [
            r["load_phase_seconds"][phase]
            for r in loaded
            if phase in r.get("load_phase_seconds", {})
        ]
        item[f"{phase}_s"] = statistics.median(times) if times else None
    return item


def build_parser():
    """The command line (``--help`` lists every option)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", maxsplit=1)[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Exit status: 0 when every row ran for the fork (and each --fork-tree), "
        "1 otherwise, 2 without CUDA.",
    )
    parser.add_argument(
        "--rows",
        nargs="+",
        choices=sorted(ROWS),
        default=list(ROWS),
        metavar="ROW",
        help=f"rows to measure, from {', '.join(ROWS)}",
    )
    parser.add_argument(
        "--hidden", type=int, default=4096, help="probe model width (134M parameters by default)"
    )
    parser.add_argument("--ffn", type=int, default=8192, help="probe model inner width")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="data-parallel ranks")
    parser.add_argument("--steps-before", type=int, default=2, help="steps before the save")
    parser.add_argument("--steps-after", type=int, default=2, help="steps after the resume")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="load jobs per implementation (each saves once), alternating which goes first; "
        "load time is the median",
    )
    parser.add_argument(
        "--out",
        help="write the figures (and each raw result) as JSON to this file, or to "
        "load_memory.json in it if it is a folder",
    )
    parser.add_argument("--log-dir", help="keep the torchrun jobs' logs here")
    parser.add_argument(
        "--fork-tree",
        nargs="+",
        default=[],
        metavar="PATH",
        help="also load with the fork's modules from the megatron/ folder of each checkout PATH "
        "(another commit: scripts/fork_tree.sh COMMIT writes it to .ab/COMMIT), in the same run "
        "and in turn with the others, as sides fork@PATH; the installed megatron-core and "
        "overlay serve everything else",
    )
    parser.add_argument(
        "--skip-upstream",
        action="store_true",
        help="measure the fork alone (its table rows then say upstream was not run)",
    )
    parser.add_argument(
        "--page-cache",
        choices=("warm", "as-left"),
        default="warm",
        help="warm: each load job reads its checkpoint's files once before it is timed, so that "
        "upstream and the fork are timed on the same page cache; as-left: time them on whatever "
        "the save and the earlier jobs left cached",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run each load phase under torch.profiler and cProfile and print, per row and "
        "implementation, what the phases spent their time on (from the first run that loaded); "
        "the times measured then include the profilers' overhead",
    )
    return parser


def report_profiles(table, out=sys.stdout):
    """Print the profile tables of each row, implementation and phase (``--profile``)."""
    for row, by_side in table.items():
        for side, item in by_side.items():
            profiles = item.get("raw", {}).get("load_phase_profiles") or {}
            for phase, tables in profiles.items():
                print(f"\n=== profile {row} {side} {phase}", file=out)
                print(tables["ops"], file=out)
                print(tables["python"], file=out)


def json_file(out: str) -> Path:
    """Where ``--out`` puts the JSON: the path itself, or ``load_memory.json`` in it if it is a
    folder or ends with a separator; the folders it needs are made."""
    path = Path(out)
    if path.is_dir() or out.endswith(("/", os.sep)):
        path = path / "load_memory.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def main(argv=None):
    """Measure, print the table, write the JSON."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for tree in args.fork_tree:
        try:
            overlay.fork_checkout(tree)
        except ValueError as error:
            parser.error(f"--fork-tree {error}")
    # Both read by every load job (they inherit this environment).
    os.environ[distopt_resume.PAGE_CACHE_ENV] = "1" if args.page_cache == "warm" else "0"
    if args.profile:
        os.environ[distopt_resume.PROFILE_ENV] = "1"
    if not torch.cuda.is_available():
        print("load_memory: needs a CUDA device (DDP buffers and GPU memory); nothing measured")
        return 2
    shape = distopt_resume.Shape(args.hidden, args.ffn)
    print(
        f"model: {shape.numel / 1e6:.1f}M parameters (hidden {args.hidden}, ffn {args.ffn}), "
        f"world size {args.nproc_per_node}, {torch.cuda.get_device_name()}, "
        f"page cache {args.page_cache}",
        flush=True,
    )
    table = run(
        args.rows,
        shape,
        args.nproc_per_node,
        args.steps_before,
        args.steps_after,
        args.log_dir,
        max(1, args.repeats),
        out=sys.stdout,
        sides=(("fork",) if args.skip_upstream else IMPLEMENTATIONS)
        + tuple(TREE_PREFIX + tree for tree in args.fork_tree),
    )
    report(table)
    if args.out:
        json_file(args.out).write_text(json.dumps(table, indent=1, default=str), encoding="utf-8")
    if args.profile:
        report_profiles(table)
    ran = all(
        "raw" in item and not item.get("error")
        for by_side in table.values()
        for side, item in by_side.items()
        if side != "upstream"
    )
    return 0 if ran else 1


if __name__ == "__main__":
    raise SystemExit(main())
