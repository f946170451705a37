# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
# pylint: disable=bad-builtin
"""A training iteration of a GPT model of over 1B parameters on one GPU, the optimizer kept on
the GPU beside it offloaded, upstream 0.19.2 beside the fork, in one run.

What users run: megatron-core's ``GPTModel`` (24 layers, hidden 2048, 16 heads, FFN 8192,
vocabulary 50304, sequence 2048: 1.3B parameters by default) in bf16, megatron-core's DDP with
the distributed optimizer, ``overlap_grad_reduce`` and ``overlap_param_gather``, trained through
megatron-core's forward-backward schedule and ``optimizer.step()`` as Megatron-LM's
``train_step`` does (``offload_iteration_worker`` builds and runs it). Variants:

- ``gpu``: no offload (the fork's modules): the iteration the others are held against;
- ``upstream@F``: megatron-core 0.19.2's own modules (``MEGATRON_OPTIMIZER_FORK=0``) with
  ``--optimizer-cpu-offload`` at offload fraction F;
- ``fork@F``: the fork's modules, the same flags;
- ``fork-overlap@F``: the fork with its opt-in host step behind the next forward
  (``overlap_cpu_optimizer_step_with_forward`` set on the ``OptimizerConfig`` and
  ``MEGATRON_HDO_OVERLAP_STEP_WITH_FORWARD=1`` in its process).

Each variant runs in a process of its own (the implementation is chosen at import), ``--rounds``
processes a variant, started in turn. A process takes ``--warmup`` iterations, then times
``--iterations`` back to back with one synchronize at either end (the steady state: a step that
returns early is paid for by the next forward), takes a digest of the parameters, runs one more
iteration, then times ``--breakdown-iterations`` phase by phase with a synchronize around each
phase.

Without CUDA there is nothing to offload to: the benchmark says so and exits, unless
``--smoke`` asks for a tiny host-only pass that checks the machinery (no figure of it means
anything).
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from importlib import metadata
from typing import Dict, List, Optional

import torch
from hdo_step import host_processor, positive_int
from offload_iteration_worker import PHASES, progress, run

GPU = "gpu"
KINDS = (GPU, "upstream", "fork", "fork-overlap")
"""The implementations a variant runs; all but ``gpu`` offload at a fraction (``KIND@F``)."""

FORK_SWITCH = "MEGATRON_OPTIMIZER_FORK"
OVERLAP_SWITCH = "MEGATRON_HDO_OVERLAP_STEP_WITH_FORWARD"
KIND_ENVIRONMENT = {
    GPU: {FORK_SWITCH: None, OVERLAP_SWITCH: None},
    "upstream": {FORK_SWITCH: "0", OVERLAP_SWITCH: None},
    "fork": {FORK_SWITCH: None, OVERLAP_SWITCH: None},
    "fork-overlap": {FORK_SWITCH: None, OVERLAP_SWITCH: "1"},
}
"""The environment variables each kind's process gets (None: removed)."""

REFERENCE = {"fork": "upstream", "fork-overlap": "fork"}
"""The kind whose parameters each kind's must equal bit for bit, at the same fraction."""

MIXED = "mixed"
"""The digest of a variant whose processes ended with different parameters."""

WORKER_OPTIONS = (
    "layers",
    "hidden",
    "heads",
    "ffn",
    "vocab",
    "seq_length",
    "micro_batch_size",
    "micro_batches",
    "bucket_size",
    "lr",
    "seed",
    "warmup",
    "iterations",
    "breakdown_iterations",
    "deterministic",
    "recompute",
)
"""The options a worker process is handed."""

SMOKE_OPTIONS = {
    "layers": 2,
    "hidden": 64,
    "heads": 4,
    "ffn": 256,
    "vocab": 512,
    "seq_length": 64,
    "micro_batch_size": 1,
    "micro_batches": 2,
    "bucket_size": 4000,
    "warmup": 1,
    "iterations": 2,
    "breakdown_iterations": 1,
    "rounds": 1,
}
"""What ``--smoke`` sets, whatever the command line says."""


SIZE_OPTIONS = {
    "--layers": (24, "transformer layers"),
    "--hidden": (2048, "hidden size"),
    "--heads": (16, "attention heads"),
    "--ffn": (8192, "MLP hidden size"),
    "--vocab": (50304, "vocabulary size"),
    "--seq-length": (2048, "tokens a sample"),
    "--micro-batch-size": (1, "samples a micro-batch"),
    "--micro-batches": (4, "micro-batches an iteration"),
    "--bucket-size": (
        40_000_000,
        "DDP bucket size in elements (Megatron-LM's default at one data-parallel rank: "
        "max(40M, 1M x DP))",
    ),
}
"""The model's and the data's sizes on the command line: default and help."""

COUNT_OPTIONS = {
    "--iterations": (8, "iterations timed back to back"),
    "--breakdown-iterations": (3, "iterations timed phase by phase afterwards"),
    "--rounds": (2, "processes a variant, started in turn"),
}
"""Counts of the timing on the command line (at least one each): default and help."""


def variant_name(kind: str, fraction: float) -> str:
    """``gpu``, or ``KIND@F`` with F as Python writes the float (``fork@1.0``)."""
    return GPU if kind == GPU else f"{kind}@{float(fraction)}"


def parse_variant(name: str):
    """``(kind, fraction)`` of a variant name; ValueError for one that names none."""
    if name == GPU:
        return GPU, 0.0
    kind, _, fraction = name.partition("@")
    if kind not in KINDS[1:] or not fraction:
        raise ValueError(f"{name!r}: a variant is gpu or KIND@FRACTION, KIND one of {KINDS[1:]}")
    value = float(fraction)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name!r}: an offload fraction is above 0 and at most 1")
    return kind, value


def variant_names(selection: List[str], fractions: List[float]) -> List[str]:
    """The variants ``--variants`` and ``--fractions`` select: ``gpu`` first, then by fraction,
    the kinds in the order of :data:`KINDS` within one."""
    names = set()
    for item in selection:
        if item == GPU or "@" in item:
            names.add(variant_name(*parse_variant(item)))
        else:
            names.update(variant_name(*parse_variant(f"{item}@{f}")) for f in fractions)
    order = {kind: index for index, kind in enumerate(KINDS)}

    def place(name):
        kind, fraction = parse_variant(name)
        return fraction, order[kind]

    return sorted(names, key=place)


def worker_environment(kind: str, environ: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """``environ`` (this process's by default) with the switches of ``kind`` set or removed."""
    environment = dict(os.environ if environ is None else environ)
    for name, value in KIND_ENVIRONMENT[kind].items():
        if value is None:
            environment.pop(name, None)
        else:
            environment[name] = value
    return environment


def worker_spec(args, variant: str, round_: int) -> dict:
    """What the worker of ``variant``'s ``round_``-th process is told."""
    kind, fraction = parse_variant(variant)
    profile_path = None
    if args.profile and round_ == 0:
        profile_path = os.path.join(args.profile, f"{variant}.json")
    spec = {name: getattr(args, name) for name in WORKER_OPTIONS}
    spec.update(variant=variant, kind=kind, fraction=fraction, round=round_)
    spec.update(overlap_step=kind == "fork-overlap", profile_path=profile_path)
    return spec


def run_worker(args, variant: str, round_: int) -> dict:
    """One process of ``variant``: its figures (with ``exit_code`` where it failed after
    printing them), or ``{"error": ...}`` where it printed none. Its stderr, progress and
    errors alike, goes to this process's."""
    spec = worker_spec(args, variant, round_)
    command = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    done = subprocess.run(
        command,
        env=worker_environment(spec["kind"]),
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        result = None
    if not isinstance(result, dict):
        error = f"exit code {done.returncode}, no figures (its stderr is above)"
        return {"variant": variant, "round": round_, "error": error}
    if done.returncode != 0:  # after it printed its figures: kept, and reported
        result["exit_code"] = done.returncode
    return result


def measure(args, variants: List[str]) -> Dict[str, List[dict]]:
    """Every variant's processes, round by round, each round in a rotated order (so that no
    variant always runs first, on a cold host): ``{variant: [result of each process]}``."""
    results = {variant: [] for variant in variants}
    for round_ in range(args.rounds):
        turn = round_ % len(variants)
        for variant in variants[turn:] + variants[:turn]:
            progress(f"round {round_ + 1} of {args.rounds}: {variant}")
            results[variant].append(run_worker(args, variant, round_))
    return results


def combined(processes: List[dict]) -> dict:
    """One variant's figures over its processes: the median iteration and its extremes over
    the processes, each phase's median per process and the median of those (backward is a
    process's forward+backward less its forward, ``step in forward`` its first forward after
    a step less its second), the highest memory peaks, the digest if all processes agree."""
    measured = [p for p in processes if "error" not in p]
    errors = [p["error"] for p in processes if "error" in p]
    if not measured:
        return {"errors": errors}
    iterations = [p["iteration_s"] for p in measured]
    phases = {
        phase: [statistics.median(p["breakdown"][phase]) for p in measured] for phase in PHASES
    }
    backward = [b - f for b, f in zip(phases["forward_backward"], phases["forward"])]
    waited = [a - f for a, f in zip(phases["forward_after_step"], phases["forward"])]
    digests = {p["digest"] for p in measured}
    return {
        "iteration_s": statistics.median(iterations),
        "iteration_min_s": min(iterations),
        "iteration_max_s": max(iterations),
        "iteration_per_process_s": iterations,
        "iteration_by_round": {p["round"]: p["iteration_s"] for p in measured},
        "forward_s": statistics.median(phases["forward"]),
        "backward_s": statistics.median(backward),
        "step_s": statistics.median(phases["step"]),
        "step_in_forward_s": statistics.median(waited),
        "pinned_peak": max(p["pinned_peak"] for p in measured),
        "gpu_peak": max(p["gpu_peak"] for p in measured),
        "gpu_reserved_peak": max(p["gpu_reserved_peak"] for p in measured),
        "loss": statistics.median(p["loss"] for p in measured),
        "steps_succeeded": all(p["steps_succeeded"] for p in measured),
        "digest": digests.pop() if len(digests) == 1 else MIXED,
        "errors": errors,
        "exit_codes": [p["exit_code"] for p in measured if "exit_code" in p],
    }


def exposure(figures: dict, gpu: Optional[dict]) -> dict:
    """What offloading adds to an iteration against the ``gpu`` variant of the same run: the
    difference of the medians, its extremes over rounds (each process less the ``gpu``
    process of its round), and the ratio of the medians. None where either is missing."""
    missing = {"exposed_s": None, "exposed_min_s": None, "exposed_max_s": None, "vs_gpu": None}
    if "iteration_s" not in figures or gpu is None or "iteration_s" not in gpu:
        return missing
    by_round = [
        seconds - gpu["iteration_by_round"][round_]
        for round_, seconds in figures["iteration_by_round"].items()
        if round_ in gpu["iteration_by_round"]
    ]
    return {
        "exposed_s": figures["iteration_s"] - gpu["iteration_s"],
        "exposed_min_s": min(by_round) if by_round else None,
        "exposed_max_s": max(by_round) if by_round else None,
        "vs_gpu": figures["iteration_s"] / gpu["iteration_s"],
    }


def summarize(results: Dict[str, List[dict]]) -> List[dict]:
    """The table's rows, one a variant: :func:`combined`, :func:`exposure`, the exposed time
    over the non-overlapped fork's at the same fraction (``vs_fork_exposed``, where the fork's
    is above zero), and whether the parameters equal those of the variant's reference kind
    (:data:`REFERENCE`) at the same fraction (``equal``: None where there is nothing to
    compare)."""
    figures = {variant: combined(processes) for variant, processes in results.items()}
    rows = []
    for variant, own in figures.items():
        kind, fraction = parse_variant(variant)
        row = {"variant": variant, "kind": kind, "fraction": fraction, **own}
        row.update(exposure(own, figures.get(GPU)))
        fork = exposure(figures.get(variant_name("fork", fraction), {}), figures.get(GPU))
        exposed, fork_exposed = row["exposed_s"], fork["exposed_s"]
        usable = kind != GPU and exposed is not None and fork_exposed is not None
        row["vs_fork_exposed"] = exposed / fork_exposed if usable and fork_exposed > 0 else None
        reference = variant_name(REFERENCE[kind], fraction) if kind in REFERENCE else None
        theirs = figures.get(reference, {}).get("digest")
        row["equal_to"] = reference
        row["equal"] = None
        if own.get("digest") not in (None, MIXED) and theirs not in (None, MIXED):
            row["equal"] = own["digest"] == theirs
        rows.append(row)
    return rows


def number(value, spec: str) -> str:
    """``value`` in format ``spec``, or ``-`` for None."""
    return "-" if value is None else format(value, spec)


def gib(nbytes) -> str:
    """Bytes in GiB, or ``-`` for None."""
    return number(None if nbytes is None else nbytes / (1 << 30), ".2f")


COLUMNS = [
    ("variant", lambda r: r["variant"]),
    ("iteration s", lambda r: number(r.get("iteration_s"), ".3f")),
    (
        "min-max s",
        lambda r: (
            "-"
            if "iteration_s" not in r
            else f"{r['iteration_min_s']:.3f}-{r['iteration_max_s']:.3f}"
        ),
    ),
    (
        "per process s",
        lambda r: "/".join(f"{s:.3f}" for s in r.get("iteration_per_process_s", [])) or "-",
    ),
    ("/ gpu", lambda r: number(r.get("vs_gpu"), ".2f")),
    ("exposed s", lambda r: number(r.get("exposed_s"), ".3f")),
    (
        "exposed range s",
        lambda r: (
            "-"
            if r.get("exposed_min_s") is None
            else f"{r['exposed_min_s']:.3f} to {r['exposed_max_s']:.3f}"
        ),
    ),
    ("/ fork exposed", lambda r: number(r.get("vs_fork_exposed"), ".2f")),
    ("forward s", lambda r: number(r.get("forward_s"), ".3f")),
    ("backward s", lambda r: number(r.get("backward_s"), ".3f")),
    ("step s", lambda r: number(r.get("step_s"), ".3f")),
    ("step in fwd s", lambda r: number(r.get("step_in_forward_s"), ".3f")),
    ("pinned peak GiB", lambda r: gib(r.get("pinned_peak"))),
    ("GPU peak GiB", lambda r: gib(r.get("gpu_peak"))),
    ("loss", lambda r: number(r.get("loss"), ".4f")),
    ("digest", lambda r: (r.get("digest") or "-")[:10]),
    ("equal", lambda r: {None: "-", True: "yes", False: "NO"}[r.get("equal")]),
]
"""The table's columns: header and cell of a row."""

LEGEND = (
    "iteration = seconds an iteration over --iterations timed back to back (the median over "
    "the variant's processes; min-max and per process: each process's); / gpu = iteration "
    "over the gpu variant's; exposed = iteration less the gpu variant's (range: each "
    "process less the gpu process of its round); / fork exposed = exposed over that of "
    "fork@F at the same fraction; forward = a forward-only pass of every micro-batch; "
    "backward = the training passes (forward and backward) less that forward; step = "
    "optimizer.step(), the GPU synchronized after it; step in fwd = the first forward after a "
    "step less a second one (what of the step the next forward waited for); phases are the "
    "medians over --breakdown-iterations, then over processes; pinned peak = the most pinned "
    "host memory the process held; GPU peak = torch.cuda.max_memory_allocated; loss = the last "
    "timed iteration's mean token loss; digest = sha256 of the parameters after the warm-up "
    "and timed iterations (mixed: the processes differ); equal = the digest is that of "
    "upstream@F (for fork@F) or of fork@F (for fork-overlap@F)"
)


def markdown_table(rows: List[dict]) -> str:
    """The rows as a markdown table; a failed variant's errors on lines below it."""
    lines = ["| " + " | ".join(name for name, _ in COLUMNS) + " |"]
    lines.append("|" + "|".join("---" for _ in COLUMNS) + "|")
    notes = []
    for row in rows:
        lines.append("| " + " | ".join(cell(row) for _, cell in COLUMNS) + " |")
        notes += [f"- {row['variant']} failed: {error}" for error in row.get("errors", [])]
        for code in row.get("exit_codes", []):
            notes.append(f"- {row['variant']}: a process exited with {code} after its figures")
        if row.get("steps_succeeded") is False:
            notes.append(f"- {row['variant']}: an optimizer step reported failure")
    return "\n".join(lines + ([""] + notes if notes else []))


def machine(results: Dict[str, List[dict]]) -> dict:
    """The device, the host and the software versions, as the workers saw them."""
    measured = [p for processes in results.values() for p in processes if "error" not in p]
    first = measured[0] if measured else {}
    return {
        "device": first.get("device_name", "unknown (no process finished)"),
        "host": host_processor(),
        "host_threads": first.get("host_threads"),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "megatron_core": metadata.version("megatron-core"),
        "layer_spec": first.get("layer_spec"),
        "parameters": first.get("parameters"),
    }


def header(report: dict) -> str:
    """The lines above the table: machine, model and the command line."""
    host, args = report["machine"], report["args"]
    size = "?" if host["parameters"] is None else f"{host['parameters']:,}"
    return "\n".join(
        [
            f"Offload iteration benchmark on {host['device']}; host {host['host']}, "
            f"{host['host_threads']} threads of {host['cores']} cores; torch {host['torch']}; "
            f"megatron-core {host['megatron_core']}",
            f"GPTModel {size} parameters ({args['layers']} layers, hidden {args['hidden']}, "
            f"{args['heads']} heads, FFN {args['ffn']}, vocabulary {args['vocab']}, "
            f"{host['layer_spec']} layer spec), sequence {args['seq_length']}, "
            f"{args['micro_batches']} micro-batches of {args['micro_batch_size']}; "
            f"{args['iterations']} timed iterations after {args['warmup']}; rounds "
            f"{args['rounds']}; deterministic {args['deterministic']}; full recompute "
            f"{args['recompute']}",
            f"Command: {report['command']}",
        ]
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line; every option says what it does and shows its default."""
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n", 1)[0].split()),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Output: a markdown table on stdout (machine and command line above it, the "
        "columns explained below it), progress on stderr, and with --json all figures. Exit "
        "code 0 (a failed variant is reported in the table).",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(KINDS),
        metavar="VARIANT",
        help=f"what to run: kinds ({', '.join(KINDS)}; each but gpu at every --fractions) or "
        "single variants such as fork@0.5",
    )
    parser.add_argument(
        "--fractions",
        type=float,
        nargs="+",
        default=[0.5, 1.0],
        help="offload fractions of the kinds named in --variants",
    )
    model = parser.add_argument_group("model and data")
    for option, (default, text) in SIZE_OPTIONS.items():
        model.add_argument(option, type=positive_int, default=default, help=text)
    model.add_argument("--lr", type=float, default=1e-4, help="constant learning rate")
    model.add_argument("--seed", type=int, default=1234, help="seed of the weights and data")
    model.add_argument(
        "--recompute",
        action="store_true",
        help="recompute every layer in the backward (Megatron-LM's --recompute-granularity full "
        "--recompute-method uniform --recompute-num-layers 1), so that a micro-batch of many "
        "tokens fits, as RL clients with dynamic batch sizes run it",
    )
    model.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="deterministic algorithms (torch, cuBLAS, TE, megatron-core's deterministic_mode), "
        "so that equal digests mean equal optimizers; --no-deterministic times the library "
        "defaults, whose digests may differ between processes",
    )
    timing = parser.add_argument_group("timing")
    timing.add_argument("--warmup", type=int, default=3, help="untimed iterations first")
    for option, (default, text) in COUNT_OPTIONS.items():
        timing.add_argument(option, type=positive_int, default=default, help=text)
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="write DIR/VARIANT.json, a chrome trace (CPU and CUDA) of 3 more iterations of "
        "each variant's first process",
    )
    parser.add_argument("--json", metavar="PATH", help="write every figure to PATH as JSON")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny model, to check the machinery in seconds (without CUDA: on the host, "
        f"upstream left out); sets {', '.join(f'{k}={v}' for k, v in SMOKE_OPTIONS.items())}",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


def parse_args(argv=None):
    """The options of ``argv`` (the command line's by default), the variants checked."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        variant_names(args.variants, args.fractions)
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv=None) -> Optional[dict]:
    """Run the selected variants, print the table; the report (None when nothing ran)."""
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run(json.loads(args.worker))))
        return None
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("offload_iteration measures offloading to a GPU: no CUDA here, nothing measured")
        return None
    variants = variant_names(args.variants, args.fractions)
    if args.smoke:
        vars(args).update(SMOKE_OPTIONS)
    if not cuda:  # upstream's HybridDeviceOptimizer needs CUDA
        args.recompute = False  # megatron-core's recompute saves the CUDA generator's state
        variants = [name for name in variants if parse_variant(name)[0] != "upstream"]
    results = measure(args, variants)
    command = argv if argv is not None else sys.argv[1:]
    report = {
        "machine": machine(results),
        "command": shlex.join(["python", "benchmarks/offload_iteration.py", *command]),
        "args": {k: v for k, v in vars(args).items() if k != "worker"},
        "rows": summarize(results),
        "processes": results,
    }
    print(header(report) + "\n\n" + markdown_table(report["rows"]) + "\n\n" + LEGEND)
    for result in (process for processes in results.values() for process in processes):
        if result.get("profile_s"):
            seconds = ", ".join(f"{k} {v:.3f}" for k, v in result["profile_s"].items())
            print(f"profile of {result['variant']}, s an iteration: {seconds}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=1)
    return report


if __name__ == "__main__":
    main()
