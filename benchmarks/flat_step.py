# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
# pylint: disable=bad-builtin
"""Host bucket steps alone: the fork's flat step beside its sub-optimizers' own, one run.

Times only the host side of an offloaded step, with no copies: the HDO's packed host buckets
of ``--copies`` parameters of ``--numel`` fp32 elements each, stepped by
:class:`~megatron.core.optimizer.cpu_offloading.hybrid_optimizer_flat_step.FlatAdamStep`
(one fused AdamW call per bucket) and, in a second HDO over the same values, by each bucket's
torch AdamW (``fused=True``, one parallel region per copy), as ``flat_host_steps = False``
steps them. Small copies show the bookkeeping per copy, large ones the kernel. Upstream
0.19.2 has neither (its host optimizer steps each parameter alone, with its copies: see
``hdo_step.py``). Runs on the CPU; no accelerator is needed.
"""

import argparse
import statistics
import time

import torch

from megatron.core.optimizer.cpu_offloading import hybrid_optimizer


def build(copies: int, numel: int, flat: bool):
    """An HDO with every parameter on the host, stepped twice (buckets and state built)."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, generator=generator)) for _ in range(copies)]
    grads = [torch.randn(numel, generator=generator).mul_(1e-2) for _ in range(copies)]
    optimizer = hybrid_optimizer.HybridDeviceOptimizer(
        [{"params": params}],
        offload_fraction=1.0,
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.AdamW,
        lr=1e-4,
        weight_decay=0.01,
        fused=True,
    )
    optimizer.flat_host_steps = flat
    for _ in range(2):
        for param, grad in zip(params, grads):
            param.grad = grad
        optimizer.step()
    return optimizer


def host_steps(optimizer, flat: bool):
    """The callable that steps every host bucket once, as the HDO's step would."""
    buckets = optimizer._buckets  # pylint: disable=protected-access
    if flat:
        flat_steps = [getattr(bucket, "flat", None) for bucket in buckets]
        flat_steps = [flat_step for flat_step in flat_steps if flat_step is not None]
        assert len(flat_steps) == len(buckets), "a bucket is not stepped flat"

        def step():
            for flat_step in flat_steps:
                assert flat_step.step(), "a flat step fell back"

    else:
        assert all(getattr(bucket, "flat", None) is None for bucket in buckets)
        optimizers = [bucket.optimizer for bucket in buckets]

        def step():
            for sub in optimizers:
                sub.step()

    return step


def timed_ms(step, repeats: int):
    """Median and extremes of ``repeats`` calls, in ms."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times), max(times)


def parse_args(argv=None):
    """The command line; every option says what it does and shows its default."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--copies", type=int, nargs="+", default=[4096, 2048, 128], help="parameters per run"
    )
    parser.add_argument(
        "--numel",
        type=int,
        nargs="+",
        default=[16, 4096, 65536],
        help="elements of each parameter, one per --copies entry",
    )
    parser.add_argument("--repeats", type=int, default=30, help="timed host steps per row")
    return parser.parse_args(argv)


def main():
    """One row per size: flat and per-copy host steps, ms."""
    args = parse_args()
    if len(args.copies) != len(args.numel):
        raise SystemExit("--copies and --numel need one entry each per row")
    threads = torch.get_num_threads()
    print(f"host bucket steps on the CPU; torch {torch.__version__}, {threads} threads")
    print(
        f"{'copies':>7} {'elements':>9} {'buckets':>7} {'flat ms (min-max)':>22} "
        f"{'per-copy ms (min-max)':>24}"
    )
    for copies, numel in zip(args.copies, args.numel):
        cells = []
        for flat in (True, False):
            optimizer = build(copies, numel, flat)
            median, low, high = timed_ms(host_steps(optimizer, flat), args.repeats)
            cells.append(f"{median:.2f} ({low:.2f}-{high:.2f})")
            buckets = len(optimizer._buckets)  # pylint: disable=protected-access
        print(f"{copies:>7} {numel:>9} {buckets:>7} {cells[0]:>22} {cells[1]:>24}", flush=True)


if __name__ == "__main__":
    main()
