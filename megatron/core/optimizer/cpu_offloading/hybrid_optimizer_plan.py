# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The HybridDeviceOptimizer's host plan: buckets, their cap, the gradient ring and the pins.

Made before anything is allocated, from the host sub-optimizers and the map from each host copy
to its accelerator parameter, so it runs the same over meta tensors (``benchmarks/hdo_pin_plan.py``
plans the benchmark's cases on a machine without a GPU with these very functions; a meta
parameter stands for one on the accelerator). Each way to bucket the copies, one per cap, is
planned in full and the one that leaves the fewest bytes of host copies pageable is kept.
"""

import dataclasses
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_copies import (
    _Bucket,
    pinned_block_bytes,
    plan_pinned_host_memory,
    slot_sizes,
    upstream_pinned_bytes,
)
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_kernels import tensor_nbytes
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_parts import can_part, part_ranges

# Each staged gradient starts at a multiple of this many bytes (vector loads stay aligned).
GRAD_ALIGN = 64


def staged_offset(end: int) -> int:
    """The first ``GRAD_ALIGN`` boundary at or after ``end``."""
    return -(-end // GRAD_ALIGN) * GRAD_ALIGN


def on_accelerator(param: torch.Tensor) -> bool:
    """Whether ``param`` lives where the copies cross a bus: CUDA, or meta in a plan alone."""
    return param.is_cuda or param.is_meta


@dataclasses.dataclass
class HostPlan:
    """One way to bucket the host copies, and what its ring and pins would be.

    Attributes:
        cap: the most staged bytes of a bucket.
        optimizers: the host sub-optimizers, one a bucket, in step order.
        buckets: the pipeline's buckets (a copy in parts is a run of them), in step order.
        staged: indices of the buckets that stage gradients.
        units: what may be pinned, in upload order, with its bytes: a packed bucket's block
            by the bucket's index, any other host copy as itself (a copy in parts once).
        slots: the ring's slot count.
        pin_slots: whether the ring's slots are pinned.
        pinned: whether each unit is pinned.
        budget: the most pinned bytes, as the host allocator's blocks (upstream's).
    """

    cap: int
    optimizers: List[torch.optim.Optimizer]
    buckets: List[_Bucket]
    staged: List[int]
    units: List[Tuple[Any, int]]
    slots: int
    pin_slots: bool
    pinned: List[bool]
    budget: int

    @property
    def staged_bytes(self) -> List[int]:
        """Bytes each staging bucket fills in its slot, in step order."""
        return [self.buckets[i].nbytes for i in self.staged]

    @property
    def ring_bytes(self) -> List[int]:
        """Bytes of each ring slot."""
        return slot_sizes(self.staged_bytes, self.slots) if self.slots else []

    @property
    def pinned_bytes(self) -> int:
        """What the pinned units hold, as the host allocator's blocks (the ring apart)."""
        return sum(pinned_block_bytes(n) for (_, n), pin in zip(self.units, self.pinned) if pin)

    @property
    def pageable_bytes(self) -> int:
        """Bytes of host copies left pageable: each step copies them into a slot to upload."""
        return sum(nbytes for (_, nbytes), pin in zip(self.units, self.pinned) if not pin)


def lay_out_buckets(
    optimizers: Iterable[torch.optim.Optimizer],
    param_of: Dict[torch.Tensor, torch.Tensor],
    part_bytes: int,
) -> List[_Bucket]:
    """The pipeline's buckets for these host sub-optimizers, in step order, each offloaded
    copy's gradient at its offset in a slot; a sub-optimizer's only copy larger than
    ``part_bytes`` (0: none) makes one bucket per part where it can be stepped in parts.
    ``param_of`` maps each offloaded host copy to its parameter; other host parameters stage
    nothing."""
    buckets: List[_Bucket] = []
    for optimizer in optimizers:
        grads, end = [], 0
        for group in optimizer.param_groups:
            for host in group["params"]:
                param = param_of.get(host)
                if param is not None:
                    offset = staged_offset(end)
                    grads.append((host, param, offset))
                    end = offset + tensor_nbytes(host)
        buckets.extend(_buckets_of(optimizer, grads, end, part_bytes))
    return buckets


def _buckets_of(optimizer, grads, nbytes: int, part_bytes: int) -> List[_Bucket]:
    if len(grads) == 1 and part_bytes and nbytes > part_bytes:
        host, param, _ = grads[0]
        if param.is_contiguous() and can_part(optimizer, host):
            size = host.element_size()
            return [
                _Bucket(
                    optimizer,
                    grads,
                    (stop - start) * size,
                    hosts=[host],
                    params=[param],
                    part=(start, stop),
                )
                for start, stop in part_ranges(host.numel(), size, part_bytes)
            ]
    bucket = _Bucket(optimizer, grads, nbytes)
    bucket.hosts = [host for host, _, _ in grads]
    bucket.params = [param for _, param, _ in grads]
    bucket.packed = len(grads) > 1 and len({p.device for p in bucket.params}) == 1
    return [bucket]


def pinnable_units(buckets: Sequence[_Bucket]) -> List[Tuple[Any, int]]:
    """What of these buckets' host copies may be pinned, in upload order (see
    :attr:`HostPlan.units`): copies of accelerator parameters only."""
    units: List[Tuple[Any, int]] = []
    for index, bucket in enumerate(buckets):
        crossing = [host for host, param, _ in bucket.grads if on_accelerator(param)]
        if bucket.packed and crossing:
            units.append((index, bucket.nbytes))
        elif bucket.part is None or bucket.part[0] == 0:
            units.extend((host, tensor_nbytes(host)) for host in crossing)
    return units


def plan_host(
    build: Callable[[int], List[torch.optim.Optimizer]],
    caps: Sequence[Tuple[int, int]],
    param_of: Dict[torch.Tensor, torch.Tensor],
    max_slots: int,
    pin_grads: bool,
    pin_copies: bool,
) -> HostPlan:
    """The plan, of one per ``(cap, part_bytes)`` in ``caps``, that leaves the fewest bytes of
    host copies pageable within what upstream keeps pinned for the same copies (the first on
    a tie, so list the smaller cap first).

    Args:
        build: the host sub-optimizers for buckets of at most so many staged bytes.
        caps: each bucket cap to weigh, with the part size of copies larger than it.
        param_of: each offloaded host copy's parameter.
        max_slots: ring slots wanted.
        pin_grads: ``pin_cpu_grads``: the ring is pinned where any copy crosses the bus, and
            upstream pins its gradient buffers.
        pin_copies: ``pin_cpu_params``: whether host copies may be pinned at all.
    """
    crossing = [(host, param) for host, param in param_of.items() if on_accelerator(param)]
    # What upstream's pins hold, block by block, against the fork's counted alike.
    budget = upstream_pinned_bytes(crossing, pin_grads, held=True)
    pin_slots = pin_grads and bool(crossing)
    best: Optional[HostPlan] = None
    for cap, part_bytes in caps:
        optimizers = build(cap)
        buckets = lay_out_buckets(optimizers, param_of, part_bytes)
        staged = [index for index, bucket in enumerate(buckets) if bucket.grads]
        units = pinnable_units(buckets) if pin_copies else []
        slots, pinned = plan_pinned_host_memory(
            [buckets[i].nbytes for i in staged],
            [nbytes for _, nbytes in units],
            budget,
            max_slots,
            pin_slots,
            pinned_block_bytes,
        )
        plan = HostPlan(cap, optimizers, buckets, staged, units, slots, pin_slots, pinned, budget)
        if best is None or plan.pageable_bytes < best.pageable_bytes:
            best = plan
    return best
