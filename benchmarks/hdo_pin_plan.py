# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
# pylint: disable=bad-builtin
"""Where the HDO's pinned budget goes for the step benchmark's cases, without a GPU.

For each case and offload fraction of ``hdo_step.py``, with ``param_update_in_fp32`` (fp32 host
copies), torch's fused AdamW on the host and the overlap on: the HDO's own plan of its first step
(``hybrid_optimizer_plan.plan_host`` over meta tensors, so nothing is allocated), that is the host
buckets, the ring of gradient slots, the host copies pinned within upstream's pinned bytes and
what stays pageable, with copies moved whole, in parts of the HDO's default ``host_part_bytes``
and in parts of ``--part-mib``. Prints one line per case, fraction and way (also the HDO's
default, ``size_host_buckets``: buckets sized to the offloaded bytes, the copies above that cap
in parts of it, unless the fixed cap leaves fewer bytes pageable); no timing.
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
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_kernels import (  # noqa: E402
    tensor_nbytes,
)
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_plan import plan_host  # noqa: E402


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
    fixed cap leaves fewer bytes pageable. Made by the HDO's own planner
    (``hybrid_optimizer_plan.plan_host``) over meta tensors, as it plans its first step."""
    chosen = host_numels(numels, fraction)
    copies = [torch.empty(n, dtype=torch.float32, device="meta") for n in chosen]
    params = [torch.empty(n, dtype=torch.bfloat16, device="meta") for n in chosen]
    fixed = hdo._HOST_BUCKET_BYTES
    caps = [(fixed, part_bytes)]
    if sized:
        cap = hdo.sized_bucket_bytes(
            sum(map(tensor_nbytes, copies)), fixed, least=hdo._LEAST_SIZED_BUCKET_BYTES
        )
        caps = [(each, hdo.copy_part_bytes(part_bytes, each)) for each in sorted({cap, fixed})]
    host_plan = plan_host(
        lambda cap: hdo.HybridDeviceOptimizer.build_cpu_optimizer_list(
            torch.optim.AdamW, [{"params": copies, "fused": True}], cap
        ),
        caps,
        dict(zip(copies, params)),
        hdo._RING_SLOTS,
        pin_grads=True,
        pin_copies=True,
    )
    mib = 1 << 20
    return {
        "cap": host_plan.cap / mib,
        "buckets": len(host_plan.staged),
        "budget": host_plan.budget / mib,
        "ring": host_plan.ring_held_bytes / mib,
        "pinned": host_plan.pinned_bytes / mib,
        "pageable copies": host_plan.pinned.count(False),
        "pageable": host_plan.pageable_bytes / mib,
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
