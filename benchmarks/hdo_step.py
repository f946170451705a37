# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
# pylint: disable=bad-builtin
"""HDO step time against its hardware floor, upstream 0.19.2 beside the fork, in one run.

The floor of an offloaded step is what the hardware must do for the offloaded parameters:
a fused host AdamW step over them, their gradients down (D2H) and their parameters up (H2D)
in the model's dtype at the pinned bandwidth. All three are measured here, on the spot, with
the same tensor sizes; the HDO steps are then timed for each offload fraction and reported
as a ratio to that floor. Both implementations run the configuration Megatron builds for
``optimizer_cpu_offload`` (bf16 parameters, fp32 master copies, torch AdamW with
``fused=True``), and their parameters after the timed steps are compared bit for bit.

Without CUDA there is nothing to offload to: the figures are then host-only and labelled so.
"""

import argparse
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from megatron_optimizer_fork import load_upstream_module
from megatron_optimizer_fork.memory import pinned_bytes_held, pinned_bytes_in_use


def fork_class():
    """The fork's HybridDeviceOptimizer as ``megatron.core`` resolves it."""
    # pylint: disable=import-outside-toplevel
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    assert getattr(hybrid_optimizer, "FORK_IMPLEMENTATION", False), "overlay is off"
    return hybrid_optimizer.HybridDeviceOptimizer


def upstream_class():
    """megatron-core 0.19.2's HybridDeviceOptimizer from its own file."""
    return load_upstream_module("optimizer.cpu_offloading.hybrid_optimizer").HybridDeviceOptimizer


def sync(device):
    """Wait for the accelerator, if any."""
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats, warmup=1):
    """Median wall time of ``fn`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sizes(args):
    """Element counts of the model's tensors (all equal, as in the reported run)."""
    per_tensor = int(args.numel) // args.tensors
    return [per_tensor] * args.tensors


def offloaded_sizes(args, fraction):
    """The tensors the HDO offloads at ``fraction`` (it fills the share in order)."""
    chosen, total, budget = [], 0, fraction * sum(sizes(args))
    for numel in sizes(args):
        if total < budget:
            chosen.append(numel)
            total += numel
    return chosen


def measure_floor(args, device, fraction):
    """Host AdamW time and pinned copy times for the offloaded tensors, measured now."""
    chosen = offloaded_sizes(args, fraction)
    if not chosen:
        return {"adam": 0.0, "d2h": 0.0, "h2d": 0.0}
    params = [torch.randn(n) for n in chosen]
    for p in params:
        p.grad = torch.randn(p.numel()).mul_(1e-3)
    adam = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    adam_time = timed(adam.step, "cpu", args.repeats)
    del adam, params
    gc.collect()
    if device != "cuda":
        return {"adam": adam_time, "d2h": 0.0, "h2d": 0.0}
    dtype = torch.bfloat16
    gpu = [torch.randn(n, device="cuda").to(dtype) for n in chosen]
    host = [torch.empty(n, dtype=dtype, pin_memory=True) for n in chosen]

    def down():
        for h, g in zip(host, gpu):
            h.copy_(g, non_blocking=True)

    def up():
        for h, g in zip(host, gpu):
            g.copy_(h, non_blocking=True)

    result = {"adam": adam_time, "d2h": timed(down, device, args.repeats)}
    result["h2d"] = timed(up, device, args.repeats)
    nbytes = sum(chosen) * 2
    result["d2h_gbps"] = nbytes / result["d2h"] / 1e9
    result["h2d_gbps"] = nbytes / result["h2d"] / 1e9
    del gpu, host
    gc.collect()
    return result


def time_hdo(hdo_class, args, device, fraction, overlap):
    """Median step time of one HDO, the pinned memory it needs, a digest of its parameters.

    Run in a process of its own (see ``run_worker``), so that the pinned memory the process
    holds is this optimizer's alone.
    """
    generator = torch.Generator().manual_seed(0)
    params, grads = [], []
    for numel in sizes(args):
        value = torch.randn(numel, generator=generator).to(device, torch.bfloat16)
        params.append(torch.nn.Parameter(value))
        grads.append(torch.randn(numel, generator=generator).mul_(1e-2).to(device, torch.bfloat16))
    optimizer = hdo_class(
        [{"params": params}],
        offload_fraction=fraction,
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.AdamW,
        param_update_in_fp32=True,
        overlap_cpu_optimizer_d2h_h2d=overlap,
        lr=1e-4,
        weight_decay=0.01,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
    )

    def step():
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()

    seconds = timed(step, device, args.repeats, warmup=args.warmup)
    digest = hashlib.sha256()
    for param in params:
        digest.update(param.detach().cpu().view(torch.int16).numpy().tobytes())
    result = {
        "step": seconds,
        "pinned_held": pinned_bytes_held(),
        "pinned_live": pinned_bytes_in_use(),
        "digest": digest.hexdigest(),
    }
    del optimizer, params, grads
    gc.collect()
    return result


IMPLEMENTATIONS = {"upstream 0.19.2": upstream_class, "fork": fork_class}


def run_worker(args, name, fraction, overlap):
    """Time one implementation in a fresh interpreter; its figures as a dict."""
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        json.dumps([name, fraction, overlap]),
        "--numel",
        str(args.numel),
        "--tensors",
        str(args.tensors),
        "--repeats",
        str(args.repeats),
        "--warmup",
        str(args.warmup),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name} at {fraction} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    """Measure the floor and both implementations for each fraction; print and save a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=float, default=536e6)
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5, 1.0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--overlap",
        choices=["on", "off", "both"],
        default="both",
        help="overlap_cpu_optimizer_d2h_h2d: on is the HDO's default and what Megatron's "
        "offload guide enables (--overlap-cpu-optimizer-d2h-h2d); off is OptimizerConfig's "
        "default",
    )
    parser.add_argument("--skip-upstream", action="store_true")
    parser.add_argument("--out", default="results")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:
        name, fraction, overlap = json.loads(args.worker)
        print(json.dumps(time_hdo(IMPLEMENTATIONS[name](), args, device, fraction, overlap)))
        return
    label = torch.cuda.get_device_name() if device == "cuda" else "CPU only (host figures)"
    print(
        f"HDO step benchmark on {label}; {args.numel / 1e6:.0f}M bf16 params in {args.tensors} "
        f"tensors; torch {torch.__version__}; host threads {torch.get_num_threads()} "
        f"(of {os.cpu_count()} cores)"
    )
    implementations = ["fork"]
    if device == "cuda" and not args.skip_upstream:
        implementations.insert(0, "upstream 0.19.2")
    overlaps = {"on": [True], "off": [False], "both": [True, False]}[args.overlap]
    columns = [
        ("fraction", 8, lambda r: f"{r['fraction']}"),
        ("overlap", 7, lambda r: str(r["overlap"])),
        ("implementation", 16, lambda r: r["implementation"]),
        ("step s", 8, lambda r: f"{r['step_s']:.3f}"),
        ("floor s", 8, lambda r: f"{r['floor_s']:.3f}"),
        ("ratio", 6, lambda r: f"{r['ratio']:.2f}"),
        ("pinned MiB", 10, lambda r: f"{r['pinned_held_mib']:.1f}"),
        ("live MiB", 8, lambda r: f"{r['pinned_live_mib']:.1f}"),
        ("adam s", 7, lambda r: f"{r['floor']['adam']:.3f}"),
        ("d2h s", 6, lambda r: f"{r['floor']['d2h']:.3f}"),
        ("h2d s", 6, lambda r: f"{r['floor']['h2d']:.3f}"),
        ("d2h GB/s", 8, lambda r: f"{r['floor'].get('d2h_gbps', 0):.1f}"),
        ("h2d GB/s", 8, lambda r: f"{r['floor'].get('h2d_gbps', 0):.1f}"),
        ("equal", 5, lambda r: str(r["params_equal_across_implementations"])),
    ]
    print("\n" + " ".join(f"{name:>{width}}" for name, width, _ in columns), flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"hdo_step_{device}.json")
    rows = []
    for fraction in args.fractions:
        floor = measure_floor(args, device, fraction)
        floor_total = floor["adam"] + floor["d2h"] + floor["h2d"]
        for overlap in overlaps:
            results = {name: run_worker(args, name, fraction, overlap) for name in implementations}
            exact = len({result["digest"] for result in results.values()}) == 1
            for name, result in results.items():
                rows.append(
                    {
                        "fraction": fraction,
                        "overlap": overlap,
                        "implementation": name,
                        "step_s": result["step"],
                        "floor_s": floor_total,
                        "ratio": result["step"] / floor_total if floor_total else float("nan"),
                        "pinned_held_mib": result["pinned_held"] / 2**20,
                        "pinned_live_mib": result["pinned_live"] / 2**20,
                        "floor": floor,
                        "params_equal_across_implementations": exact,
                    }
                )
                # Each row as soon as it is known, so a run cut short keeps what it measured.
                print(" ".join(f"{cell(rows[-1]):>{width}}" for _, width, cell in columns))
            sys.stdout.flush()
            with open(path, "w", encoding="utf-8") as out:
                json.dump({"device": label, "args": vars(args), "rows": rows}, out, indent=1)
    print(
        "\nfloor = fused host AdamW + bf16 D2H + bf16 H2D for the offloaded tensors; pinned = "
        "pinned host memory the process holds after the timed steps (one process per row, "
        "allocator rounding and cache included); live = pinned storage its tensors use; "
        f"equal = identical parameters (sha256) across implementations; {path}"
    )


if __name__ == "__main__":
    main()
