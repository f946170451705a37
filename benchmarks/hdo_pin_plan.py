# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
# pylint: disable=bad-builtin
"""Where the HDO's pinned budget goes for the step benchmark's cases, without a GPU.

For each case and offload fraction of ``hdo_step.py``, with ``param_update_in_fp32`` (fp32 host
copies) and the overlap on: the host buckets as the HDO builds them (``build_cpu_optimizer_list``
over meta tensors, so nothing is allocated), the ring of gradient slots and the host copies pinned
within upstream's pinned bytes as ``plan_pinned_host_memory`` chooses them, and what stays
pageable, with copies moved whole, in parts of the HDO's default ``host_part_bytes`` and in parts
of ``--part-mib`` (as the HDO parts them under torch's fused AdamW). Prints one line per case,
fraction and way (also the HDO's default, ``size_host_buckets``: buckets sized to the
offloaded bytes, the copies above that cap in parts of it, unless the fixed cap leaves fewer
bytes pageable); no timing.
"""

import argparse
import sys
from pathlib import Path
from typing import List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # hdo_cases, as hdo_step.py does

# pylint: disable=wrong-import-position
from hdo_cases import CASES, case_numels  # noqa: E402

from megatron.core.optimizer.cpu_offloading import hybrid_optimizer as hdo  # noqa: E402


def host_numels(numels: List[int], fraction: float) -> List[int]:
    """The shards the HDO offloads: the first ones, by element count, up to ``fraction``."""
    budget, offloaded, chosen = fraction * sum(numels), 0, []
    for numel in numels:
        if offloaded < budget:
            chosen.append(numel)
            offloaded += numel
    return chosen


def plan(numels: List[int], fraction: float, part_bytes: int, sized: bool = False):
    """The ring and pinning plan for these shards: MiB of ring, pinned and pageable copies, with
    the fixed bucket cap or, if ``sized``, the cap the HDO's ``size_host_buckets`` chooses: the
    cap sized to the offloaded bytes (copies above it then move in parts of it, or of
    ``part_bytes`` where that is smaller; ``part_bytes`` 0 moves every copy whole) unless the
    fixed cap leaves fewer bytes pageable."""
    copies = [
        torch.empty(n, dtype=torch.float32, device="meta") for n in host_numels(numels, fraction)
    ]
    params = [
        torch.empty(n, dtype=torch.bfloat16, device="meta") for n in host_numels(numels, fraction)
    ]
    fixed = hdo._HOST_BUCKET_BYTES
    if not sized:
        return plan_with_cap(copies, params, fixed, part_bytes)
    cap = hdo.sized_bucket_bytes(
        sum(map(hdo._nbytes, copies)), fixed, least=hdo._LEAST_SIZED_BUCKET_BYTES
    )
    plans = [
        plan_with_cap(copies, params, each, hdo.copy_part_bytes(part_bytes, each))
        for each in sorted({cap, fixed})
    ]
    return min(plans, key=lambda figures: figures["pageable"])  # the smaller cap on a tie


def plan_with_cap(copies, params, cap: int, part_bytes: int):
    """:func:`plan`'s figures for host buckets of at most ``cap`` bytes and copies larger than
    ``part_bytes`` moved in parts of it (0: whole)."""
    optimizers = hdo.HybridDeviceOptimizer.build_cpu_optimizer_list(
        torch.optim.AdamW, [{"params": copies}], cap
    )
    staged, units = [], []  # slot bytes of each bucket (or part); bytes of each pinnable unit
    for optimizer in optimizers:
        hosts = optimizer.param_groups[0]["params"]
        end = 0
        for host in hosts:
            end = hdo._staged_offset(end) + hdo._nbytes(host)
        units.append(end)
        if part_bytes and len(hosts) == 1 and end > part_bytes:
            staged += [min(part_bytes, end - start) for start in range(0, end, part_bytes)]
        else:
            staged.append(end)
    budget = hdo.upstream_pinned_bytes(list(zip(copies, params)), True, held=True)
    slots, pinned = hdo.plan_pinned_host_memory(
        staged, units, budget, hdo._RING_SLOTS, True, hdo.pinned_block_bytes
    )
    ring = sum(hdo.pinned_block_bytes(n) for n in hdo.slot_sizes(staged, slots))
    mib = 1 << 20
    return {
        "cap": cap / mib,
        "buckets": len(staged),
        "budget": budget / mib,
        "ring": ring / mib,
        "pinned": sum(hdo.pinned_block_bytes(u) for u, p in zip(units, pinned) if p) / mib,
        "pageable copies": pinned.count(False),
        "pageable": sum(u for u, p in zip(units, pinned) if not p) / mib,
    }


def parse_args(argv=None):
    """The command line (``--help`` lists it)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", maxsplit=1)[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--case",
        nargs="+",
        choices=sorted(CASES),
        default=sorted(CASES),
        help="parameter lists (see hdo_cases.py)",
    )
    parser.add_argument(
        "--fractions", nargs="+", type=float, default=[0.5, 1.0], help="offload fractions"
    )
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size of the shards")
    parser.add_argument(
        "--part-mib", type=int, default=16, help="part size of host_part_bytes, in MiB"
    )
    return parser.parse_args(argv)


def main(argv=None):
    """Print the plan of every case and fraction: copies whole, in parts, and in buckets sized
    to the offloaded bytes (the copies above that cap in parts of it)."""
    args = parse_args(argv)
    print("MiB; cap = bucket cap; budget = upstream 0.19.2's pinned blocks; pinned = host copies'")
    default = hdo.HybridDeviceOptimizer.host_part_bytes
    ways = {
        "fixed buckets, whole copies": (0, False),
        f"fixed buckets, parts of {default >> 20} MiB": (default, False),
        f"fixed buckets, parts of {args.part_mib} MiB": (args.part_mib << 20, False),
        "default (size_host_buckets)": (default, True),
    }
    for case in args.case:
        numels = case_numels(case, args.dp)
        for fraction in args.fractions:
            for way, (part_bytes, sized) in ways.items():
                figures = plan(numels, fraction, part_bytes, sized)
                cells = ", ".join(
                    f"{key} {value:.0f}" if isinstance(value, float) else f"{key} {value}"
                    for key, value in figures.items()
                )
                print(f"{case} {fraction} {way}: {cells}")


if __name__ == "__main__":
    main()
