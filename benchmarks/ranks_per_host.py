# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
# pylint: disable=bad-builtin
"""The HDO's host step with several ranks on one host, upstream 0.19.2 beside the fork.

A node runs several data-parallel ranks, each stepping its own HDO over its shard of the
model on the same cores, memory bandwidth and PCIe. For N ranks (``--ranks``) this starts N
processes on this host (sharing its one GPU, where there is one), each with an HDO over its
1/N of the case's parameters (``hdo_cases.rank_shards``: the shards a DistributedOptimizer
hands data-parallel rank r), built as Megatron's factory builds it for ``optimizer_cpu_offload``
with the precision-aware optimizer (bf16 parameters, fp32 masters, fp32 ``decoupled_grad``
gradients: ``hdo_step.build_hdo`` and ``hdo_step.shard_tensors``). No collective runs: the
ranks wait at a barrier before every step, so they step together, and a step's time is the
slowest rank's. Each row reports the median of those per-step times over ``--repeats`` steps
and their min-max.

Ranks start as ``torchrun`` starts them when it runs more than one a node: with
``OMP_NUM_THREADS=1``, ``LOCAL_WORLD_SIZE=N`` and their ``LOCAL_RANK`` (the rank's
``MEGATRON_HDO_HOST_STEP_THREADS`` is removed, so the policy is what is timed). Each HDO is
stepped under two thread settings, in turn, step by step:

- ``omp=1``: the rank's threads as ``torchrun`` leaves them (one); for the fork, its policy
  switched off (``host_step_threads = 0``). At N = 1 this is for reference only: ``torchrun``
  leaves a lone rank's threads alone.
- ``policy``: the fork's policy (the host step on this process's cores divided by N,
  ``host_step_threads``); for upstream, which has none, torch's own default (one thread per
  core, as a rank started without ``OMP_NUM_THREADS`` gets: probed once in a fresh process,
  then set with ``torch.set_num_threads``).

Upstream's ranks run with ``MEGATRON_OPTIMIZER_FORK=0`` (megatron-core's own modules); both
implementations take the same steps, so their parameters are compared bit for bit, rank by
rank (``equal``). Upstream's HDO needs CUDA: without it only the fork runs, host-only (every
parameter is then stepped on the host and nothing is copied).

The limit is what the host's memory must move for a step of all N ranks, at its bandwidth:
``limit = (28 B x host elements + 4 B x offloaded elements) / bandwidth``. Host AdamW over an
fp32 master with an fp32 gradient reads the master, the gradient and both moments (16 B) and
writes the master and both moments (12 B) per element; every element stepped on the host
counts (with CUDA the offloaded ones, without it all). The copies' DMA crosses host memory
once per byte: a bf16 gradient down and a bf16 parameter up per offloaded element (4 B), the
least a step must move (the fork moves fp32 both ways, 8 B). The bandwidth is measured in the
same run by the same N processes at the policy's threads each: ``a.add_(b)`` over fp32 buffers
of ``--bandwidth-mib`` MiB shared out among the ranks, which like AdamW reads two streams and
writes one of them back (3 x the buffer's bytes a call), the ranks starting together at a
barrier; the aggregate of the slowest rank's time, median over ``--repeats``, the best of the
row's processes. ``/limit`` is the fork's step over that limit.

The header also reports what the fork's switch of the thread count around a host step costs:
a parallel ``add_`` switched from one thread to every usable core and back, less the same
call with the count set throughout (waking the OpenMP runtime's threads included).
"""

import argparse
import gc
import json
import multiprocessing
import os
import queue
import statistics
import subprocess
import sys
import time
import traceback
from typing import Dict, List

import torch
from hdo_cases import CASES, case_numels
from hdo_step import (
    GRADIENT_ATTRIBUTES,
    build_hdo,
    host_processor,
    params_digest,
    positive_int,
    shard_tensors,
    sync,
)

ADAM_BYTES = 28
"""Bytes of host memory one fp32 AdamW step moves per element (16 read, 12 written)."""

DMA_BYTES = 4
"""Bytes of host memory the copies move per offloaded element: bf16 gradient and parameter."""

SETTINGS = ("omp=1", "policy")
"""The thread settings each HDO is stepped under, in turn (see the module docstring)."""

IMPLEMENTATIONS = {"upstream 0.19.2": "0", "fork": "1"}
"""Each implementation and the ``MEGATRON_OPTIMIZER_FORK`` its ranks run with."""

BARRIER_S = 300
"""Seconds a rank waits for the others at a barrier before it gives up (one of them died)."""

GRADIENTS = "decoupled"
"""The precision-aware optimizer's gradients: fp32 ``decoupled_grad`` views of one buffer."""

MPS_PIPE_DEFAULT = "/tmp/nvidia-mps"
"""Where the NVIDIA Multi-Process Service's daemon keeps its control pipe unless
``CUDA_MPS_PIPE_DIRECTORY`` says otherwise."""


def gpu_sharing(device: str) -> str:
    """How the ranks' processes share the one GPU: ``MPS`` where the Multi-Process Service's
    daemon runs (its control pipe exists; their kernels then run side by side, nearer a GPU per
    rank), ``time-sliced`` otherwise (the GPU runs one process's work at a time), ``none``
    without CUDA."""
    if device != "cuda":
        return "none"
    pipes = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", MPS_PIPE_DEFAULT)
    return "MPS" if os.path.exists(os.path.join(pipes, "control")) else "time-sliced"


def torch_default_threads() -> int:
    """Intra-op threads torch gives a process started without ``OMP_NUM_THREADS``."""
    environ = {
        k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
    }
    probe = "import torch; print(torch.get_num_threads())"
    done = subprocess.run(
        [sys.executable, "-c", probe], env=environ, capture_output=True, text=True, check=True
    )
    return int(done.stdout.strip().splitlines()[-1])


def set_restore_cost_us(threads: int, repeats: int = 200) -> float:
    """Microseconds the fork's switch of the thread count adds to a step: a parallel
    ``add_`` over 1M elements on ``threads`` threads, switched to them from one thread and
    back around each call (as around a host step under ``torchrun``), less the same with
    ``threads`` set throughout; medians over ``repeats`` calls. It includes waking the OpenMP
    runtime's threads after the caller ran on one."""
    # pylint: disable-next=import-outside-toplevel
    from megatron.core.optimizer.cpu_offloading.host_step_threads import threads_for_host_step

    added, streamed = torch.ones(1 << 20), torch.ones(1 << 20)
    before, times = torch.get_num_threads(), {1: [], threads: []}
    for _ in range(repeats):
        for caller_threads, noted in times.items():  # interleaved, so that drift hits both
            torch.set_num_threads(caller_threads)
            start = time.perf_counter()
            with threads_for_host_step(threads):
                streamed.add_(added)
            noted.append(time.perf_counter() - start)
    torch.set_num_threads(before)
    return (statistics.median(times[1]) - statistics.median(times[threads])) * 1e6


def policy_threads_for(ranks: int) -> int:
    """The fork policy's threads for each of ``ranks`` ranks on this host."""
    # pylint: disable-next=import-outside-toplevel
    from megatron.core.optimizer.cpu_offloading.host_step_threads import policy_threads

    return policy_threads(ranks=ranks)


def bandwidth_times(job: dict, barrier) -> List[float]:
    """This rank's times of ``a.add_(b)`` over its share of the bandwidth buffers, each call
    started with the other ranks at the barrier, at the policy's threads."""
    numel = max(1, (job["bandwidth_mib"] << 20) // 4 // job["ranks"])
    streamed, added = torch.ones(numel), torch.ones(numel)
    before = torch.get_num_threads()
    torch.set_num_threads(job["policy_threads"])
    try:
        streamed.add_(added)
        times = []
        for _ in range(job["repeats"]):
            barrier.wait()
            start = time.perf_counter()
            streamed.add_(added)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return times


def hdo_class(implementation: str):
    """The HybridDeviceOptimizer this process imports, checked to be ``implementation``'s."""
    # pylint: disable-next=import-outside-toplevel
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    fork = getattr(hybrid_optimizer, "FORK_IMPLEMENTATION", False)
    if fork != (implementation == "fork"):
        raise RuntimeError(f"{implementation}'s rank imported {hybrid_optimizer.__file__}")
    return hybrid_optimizer.HybridDeviceOptimizer


def apply_setting(optimizer, job: dict, setting: str, started_on: int) -> int:
    """Set up ``setting`` for the next step; the threads its host step runs on."""
    if job["implementation"] == "fork":
        # pylint: disable-next=import-outside-toplevel
        from megatron.core.optimizer.cpu_offloading.host_step_threads import host_step_threads

        torch.set_num_threads(started_on)
        optimizer.host_step_threads = 0 if setting == "omp=1" else None
        return host_step_threads(optimizer.host_step_threads) or started_on
    threads = started_on if setting == "omp=1" else job["default_threads"]
    torch.set_num_threads(threads)
    return threads


def host_elements(optimizer, params, device: str):
    """``(elements stepped on the host, elements copied to and from it)`` of ``optimizer``."""
    if device != "cuda":
        return sum(p.numel() for p in params), 0
    offloaded = sum(p.numel() for p in optimizer.gpu_params_map_cpu_copy)
    return offloaded, offloaded


def time_fraction(job: dict, rank: int, fraction: float, barrier) -> dict:
    """This rank's step times under each setting at ``fraction``, and what it stepped."""
    device = job["device"]
    numels = case_numels(job["case"], job["ranks"], job["scale"], rank=rank)
    params, grads = shard_tensors(numels, GRADIENTS, device)
    optimizer = build_hdo(hdo_class(job["implementation"]), params, fraction, True, "factory")
    started_on, times, threads = torch.get_num_threads(), {s: [] for s in SETTINGS}, {}
    for index in range(job["warmup"] + job["repeats"]):
        if index == job["warmup"]:
            gc.collect()  # not inside a timed step: the first steps created the state
        for setting in SETTINGS:
            threads[setting] = apply_setting(optimizer, job, setting, started_on)
            for param, grad in zip(params, grads):
                setattr(param, GRADIENT_ATTRIBUTES[GRADIENTS], grad)
            sync(device)
            barrier.wait()
            start = time.perf_counter()
            optimizer.step()
            sync(device)
            if index >= job["warmup"]:
                times[setting].append(time.perf_counter() - start)
    torch.set_num_threads(started_on)
    on_host, copied = host_elements(optimizer, params, device)
    result = {"times": times, "threads": threads, "host_elements": on_host, "dma_elements": copied}
    result["digest"] = params_digest(params)
    del optimizer, params, grads
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def rank_main(job: dict, rank: int, barrier, results):
    """One rank: the bandwidth, then each fraction's steps; its figures (or its error) go to
    ``results``. A failing rank breaks the barrier, so that the others stop too."""
    try:
        result = {"bandwidth_times": bandwidth_times(job, barrier), "fractions": {}}
        for fraction in job["fractions"]:
            result["fractions"][str(fraction)] = time_fraction(job, rank, fraction, barrier)
    except BaseException:  # pylint: disable=broad-except
        barrier.abort()
        results.put((rank, {"error": traceback.format_exc()}))
        return
    results.put((rank, result))


def rank_environment(implementation: str, ranks: int, rank: int) -> Dict[str, str]:
    """The environment a rank starts with: as ``torchrun`` sets it, and the implementation."""
    environ = {k: v for k, v in os.environ.items() if k != "MEGATRON_HDO_HOST_STEP_THREADS"}
    environ.update(OMP_NUM_THREADS="1", LOCAL_WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank))
    environ.update(RANK=str(rank), MEGATRON_OPTIMIZER_FORK=IMPLEMENTATIONS[implementation])
    return environ


def start_ranks(job: dict, context, barrier, results) -> list:
    """Start ``job["ranks"]`` spawned processes, each with its own environment."""
    processes, saved = [], dict(os.environ)
    try:
        for rank in range(job["ranks"]):
            os.environ.clear()
            os.environ.update(rank_environment(job["implementation"], job["ranks"], rank))
            process = context.Process(target=rank_main, args=(job, rank, barrier, results))
            process.start()
            processes.append(process)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return processes


def run_ranks(job: dict) -> List[dict]:
    """Each rank's figures, by rank, from ``job["ranks"]`` processes stepping together.

    Raises:
        RuntimeError: a rank failed or ended without reporting.
    """
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(job["ranks"], timeout=BARRIER_S), context.Queue()
    processes = start_ranks(job, context, barrier, results)
    collected = {}
    while len(collected) < job["ranks"]:
        try:
            rank, result = results.get(timeout=5)
            collected[rank] = result
        except queue.Empty:
            if not any(process.is_alive() for process in processes):
                break
    for process in processes:
        process.join()
    errors = [r["error"] for r in collected.values() if "error" in r]
    if errors or len(collected) < job["ranks"]:
        missing = sorted(set(range(job["ranks"])) - set(collected))
        raise RuntimeError(
            f"{job['implementation']}, {job['ranks']} ranks: ranks {missing} "
            f"did not report; " + "\n".join(errors)[-4000:]
        )
    return [collected[rank] for rank in range(job["ranks"])]


def slowest(per_rank: List[List[float]]) -> List[float]:
    """Each step's slowest rank's time."""
    return [max(step) for step in zip(*per_rank)]


def spread(times: List[float]) -> dict:
    """Median, min and max of ``times``."""
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def bandwidth_gbps(per_rank: List[dict], bandwidth_mib: int) -> float:
    """The ranks' aggregate bandwidth: 3 x the buffers' bytes a call over the slowest rank's
    time, median over the calls (GB/s)."""
    numel = max(1, (bandwidth_mib << 20) // 4 // len(per_rank))
    moved = 3 * 4 * numel * len(per_rank)
    return (
        statistics.median(moved / t for t in slowest([r["bandwidth_times"] for r in per_rank]))
        / 1e9
    )


def row_of(case: str, ranks: int, fraction: float, setting: str, runs: dict, gbps: float) -> dict:
    """One row: the slowest rank's steps of each implementation under ``setting``, the limit."""
    row = {"case": case, "ranks": ranks, "fraction": fraction, "setting": setting}
    key, digests = str(fraction), {}
    for name, per_rank in runs.items():
        stepped = [r["fractions"][key] for r in per_rank]
        steps = slowest([s["times"][setting] for s in stepped])
        prefix = "fork" if name == "fork" else "upstream"
        row.update({f"{prefix}_{k}_s": v for k, v in spread(steps).items()})
        row[f"{prefix}_steps_s"] = steps
        row[f"{prefix}_threads"] = stepped[0]["threads"][setting]
        digests[name] = [s["digest"] for s in stepped]
    forked = [r["fractions"][key] for r in runs["fork"]]  # the limit is the fork's
    row["host_elements"] = sum(s["host_elements"] for s in forked)
    row["dma_elements"] = sum(s["dma_elements"] for s in forked)
    row["host_bytes"] = ADAM_BYTES * row["host_elements"]
    row["dma_bytes"] = DMA_BYTES * row["dma_elements"]
    row["bandwidth_gbps"] = gbps
    row["limit_s"] = (row["host_bytes"] + row["dma_bytes"]) / (gbps * 1e9)
    row["ratio_limit"] = row["fork_median_s"] / row["limit_s"]
    row["params_equal"] = (
        len({tuple(d) for d in digests.values()}) == 1 if len(digests) > 1 else None
    )
    return row


def seconds(row: dict, prefix: str) -> str:
    """``median (min-max)`` of ``prefix``'s steps, or ``-`` where it did not run."""
    if f"{prefix}_median_s" not in row:
        return "-"
    median, low, high = (row[f"{prefix}_{key}_s"] for key in ("median", "min", "max"))
    return f"{median:.3f} ({low:.3f}-{high:.3f})"


COLUMNS = [
    ("case", 5, lambda r: r["case"]),
    ("N", 2, lambda r: str(r["ranks"])),
    ("fraction", 8, lambda r: str(r["fraction"])),
    ("setting", 7, lambda r: r["setting"]),
    ("threads up/fork", 15, lambda r: f"{r.get('upstream_threads', '-')}/{r['fork_threads']}"),
    ("upstream s", 21, lambda r: seconds(r, "upstream")),
    ("fork s", 21, lambda r: seconds(r, "fork")),
    ("limit s", 7, lambda r: f"{r['limit_s']:.3f}"),
    ("/limit", 6, lambda r: f"{r['ratio_limit']:.2f}"),
    ("GB/s", 6, lambda r: f"{r['bandwidth_gbps']:.1f}"),
    ("equal", 5, lambda r: "-" if r["params_equal"] is None else str(r["params_equal"])),
]


def print_row(row: dict):
    """One table line."""
    print(" ".join(f"{cell(row):>{width}}" for _, width, cell in COLUMNS), flush=True)


OPTIONS = {
    "--case": dict(
        nargs="+",
        choices=sorted(CASES),
        default=["gpt"],
        help="parameter lists to shard among the ranks (see hdo_cases.py; default: gpt, 757M)",
    ),
    "--ranks": dict(
        nargs="+",
        type=positive_int,
        default=[1, 2, 4, 8],
        help="numbers of ranks on the host to time (default: 1 2 4 8)",
    ),
    "--fractions": dict(
        nargs="+", type=float, default=[0.5, 1.0], help="offload fractions (default: 0.5 1.0)"
    ),
    "--repeats": dict(
        type=positive_int,
        default=5,
        help="timed steps per setting and fraction, and timed calls of the bandwidth "
        "measurement (default: 5)",
    ),
    "--warmup": dict(
        type=int, default=1, help="untimed steps per setting before them (default: 1)"
    ),
    "--scale": dict(
        type=float,
        default=1.0,
        help="multiply every shard's size, to run small on a CPU-only host (default: 1.0)",
    ),
    "--bandwidth-mib": dict(
        type=positive_int,
        default=1024,
        help="MiB of each of the two fp32 buffers the bandwidth measurement streams, shared out "
        "among the ranks; keep it well above the host's last-level cache (default: 1024)",
    ),
    "--skip-upstream": dict(action="store_true", help="time the fork alone (default: off)"),
    "--out": dict(
        default="results",
        help="folder of the JSON file ranks_per_host_<device>.json, rewritten after each N "
        "(default: results)",
    ),
}
"""The command line's options and what each does."""


def parse_args(argv=None):
    """The command line (``--help`` shows every option and the module's docstring)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", maxsplit=1)[0],
        epilog=__doc__.split("\n\n", maxsplit=1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flag, settings in OPTIONS.items():
        parser.add_argument(flag, **settings)
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    """Time every case, N, fraction and setting; print the table, write and return the JSON."""
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = ["fork"]
    if device == "cuda" and not args.skip_upstream:
        names.insert(0, "upstream 0.19.2")
    label = torch.cuda.get_device_name() if device == "cuda" else "CPU only (host figures)"
    report = {"device": f"{label}, host {host_processor()}", "device_kind": device}
    report.update(args=vars(args), rows=[])
    report["default_threads"] = torch_default_threads()
    report["usable_cores"] = policy_threads_for(1)
    report["set_restore_us"] = set_restore_cost_us(report["usable_cores"])
    report["gpu_sharing"] = gpu_sharing(device)
    print(
        f"Ranks per host on {report['device']} (GPU sharing: {report['gpu_sharing']}); "
        f"torch {torch.__version__}; "
        f"{report['usable_cores']} usable cores; torch's default threads "
        f"{report['default_threads']}; switching one thread to {report['usable_cores']} for a "
        f"host step and back adds {report['set_restore_us']:.1f} us"
    )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"ranks_per_host_{device}.json")
    for case in args.case:
        print(f"\n{case}: {sum(case_numels(case, scale=args.scale)) / 1e6:.1f}M bf16 params")
        print(" ".join(f"{name:>{width}}" for name, width, _ in COLUMNS), flush=True)
        for ranks in args.ranks:
            job = dict(vars(args), case=case, ranks=ranks, device=device)
            job.update(
                policy_threads=policy_threads_for(ranks), default_threads=report["default_threads"]
            )
            runs, run_s = {}, {}
            for name in names:
                started = time.perf_counter()
                runs[name] = run_ranks(dict(job, implementation=name))
                run_s[name] = time.perf_counter() - started
            each = {name: bandwidth_gbps(r, args.bandwidth_mib) for name, r in runs.items()}
            for fraction in args.fractions:
                for setting in SETTINGS:
                    row = row_of(case, ranks, fraction, setting, runs, max(each.values()))
                    row.update(bandwidth_gbps_each=each, run_s=run_s)
                    report["rows"].append(row)
                    print_row(row)
            with open(path, "w", encoding="utf-8") as out:
                json.dump(report, out, indent=1)
    print(
        f"\nstep = the slowest rank's step() per step, median (min-max) over --repeats; "
        f"omp=1 = one thread a rank as torchrun starts them (the fork's policy off); policy = "
        f"the fork's share of the cores (cores / N), upstream's own default threads; limit = "
        f"({ADAM_BYTES} B x host-stepped + {DMA_BYTES} B x offloaded elements, all ranks) / "
        f"the bandwidth N ranks reach together (GB/s, the best of the row's processes); /limit = "
        f"fork / limit; equal = the same parameters (sha256) on every rank in both "
        f"implementations; JSON: each row's steps, element counts, bytes and the seconds its "
        f"processes ran (run_s), {path}"
    )
    return report


if __name__ == "__main__":
    main()
