# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The HybridDeviceOptimizer's host plan: buckets, their cap, the gradient ring and the pins.

Made before anything is allocated, from the host sub-optimizers and the map from each host copy
to its accelerator parameter, so it runs the same over meta tensors (``benchmarks/hdo_pin_plan.py``
plans the benchmark's cases on a machine without a GPU with these very functions; a meta
parameter stands for one on the accelerator). Each way to bucket the copies, one per cap, is
planned in full and the one that leaves the fewest bytes of host copies pageable is kept. The
budget is what megatron-core 0.19.2 keeps pinned for the same parameters; within it the ring
gets its slots first, then host copies are pinned in upload order.
"""

import dataclasses
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_buckets import (
    HostBucket,
    make_buckets,
    on_accelerator,
)
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_kernels import tensor_nbytes
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_ring import pack_slots

# Each staged gradient starts at a multiple of this many bytes (vector loads stay aligned).
GRAD_ALIGN = 64


def staged_offset(end: int) -> int:
    """The first ``GRAD_ALIGN`` boundary at or after ``end``."""
    return -(-end // GRAD_ALIGN) * GRAD_ALIGN


def packed_ring_bytes(slot_bytes: Sequence[int]) -> int:
    """What :func:`pack_slots`' blocks hold for these slots."""
    block, places = pack_slots(slot_bytes)
    return block * len({index for index, _ in places})


def pinned_block_bytes(nbytes: int) -> int:
    """Bytes the caching host allocator holds for a pinned allocation of ``nbytes``: it asks
    CUDA for blocks of a power of two."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def upstream_pins_widened_copies() -> bool:
    """Whether the megatron-core around the fork pins an offloaded parameter's widened fp32
    copy with ``pin_cpu_params``, as Megatron-LM main does after 0.19 (0.20 on); 0.19.2 pins
    only the 16-bit copy it then widens into pageable memory."""
    try:
        from megatron.core import package_info  # pylint: disable=import-outside-toplevel
    except ImportError:
        return False
    return (int(package_info.MAJOR), int(package_info.MINOR)) >= (0, 20)


def upstream_pinned_bytes(
    copies: List[Tuple[torch.Tensor, torch.Tensor]],
    pin_grads: bool,
    held: bool = False,
    pins_widened: bool = False,
) -> int:
    """Pinned bytes megatron-core's HDO keeps for these offloaded parameters.

    It keeps a gradient buffer in the host copy's dtype (pinned if ``pin_grads``) and pins
    a copy of each parameter, which stays only when it is the host copy itself (no fp32
    update); a widened copy replaces it with pageable fp32 in 0.19.2, and with pinned fp32
    where the release pins widened copies (``pins_widened``: see
    :func:`upstream_pins_widened_copies`).

    Args:
        copies: ``(host copy, accelerator parameter)`` per offloaded parameter.
        pin_grads: upstream's ``pin_cpu_grads``.
        held: count each allocation as the block the host allocator holds for it
            (:func:`pinned_block_bytes`), what the process pins, rather than its bytes.
        pins_widened: count the widened fp32 copies as pinned (``pin_cpu_params`` on a
            release that pins them).
    """
    size = pinned_block_bytes if held else int
    total = 0
    for host, param in copies:
        if pin_grads:
            total += size(tensor_nbytes(host))
        if host.dtype == param.dtype:
            total += size(tensor_nbytes(param))
        elif pins_widened:
            total += size(tensor_nbytes(host))
    return total


def plan_pinned_host_memory(
    bucket_nbytes: List[int],
    master_nbytes: List[int],
    budget: int,
    max_slots: int,
    pin_slots: bool = True,
    block: Callable[[int], int] = int,
    keep_slots: bool = False,
) -> Tuple[int, List[bool]]:
    """How many gradient slots the ring gets and which host copies are pinned.

    The ring comes first, since every download needs a slot: up to ``max_slots`` slots, each
    as large as the largest bucket staged in it (:func:`slot_sizes`), fewer if they would
    exceed ``budget``, but at least one; and down to two while one slot fewer lets more host
    copies be pinned. A ring never holds more than all buckets together, since each slot is
    one of them. Host copies are then pinned in upload order, each one that still fits within
    ``budget``; those left pageable go up through their bucket's slot.

    Args:
        bucket_nbytes: bytes of each bucket's staged gradients (buckets with any).
        master_nbytes: bytes of each host copy that may be pinned, in upload order.
        budget: the most pinned bytes allowed (what upstream keeps pinned).
        max_slots: ring slots wanted.
        pin_slots: whether the slots are pinned (count against ``budget``).
        block: what a pinned allocation of so many bytes costs against ``budget`` (e.g.
            :func:`pinned_block_bytes`, with a budget counted the same way).
        keep_slots: give ``max_slots`` slots whatever they cost (a step behind the forward
            queues every download at once), packed into shared blocks (:func:`pack_slots`);
            host copies are pinned within what is left.

    Returns:
        ``(slots, pinned)``: the slot count (0 without buckets) and a flag per host copy.
    """
    if not bucket_nbytes:
        return 0, [False] * len(master_nbytes)

    def ring(slots):
        if keep_slots:
            return packed_ring_bytes(slot_sizes(bucket_nbytes, slots))
        return sum(block(nbytes) for nbytes in slot_sizes(bucket_nbytes, slots))

    def pins(slots):
        used = ring(slots) if pin_slots else 0
        pinned = []
        for nbytes in master_nbytes:
            pinned.append(used + block(nbytes) <= budget)
            used += block(nbytes) if pinned[-1] else 0
        return pinned, sum(block(n) for n, pin in zip(master_nbytes, pinned) if pin)

    slots = min(max_slots, len(bucket_nbytes))
    if keep_slots:
        return slots, pins(slots)[0]
    while pin_slots and slots > 1 and ring(slots) > budget:
        slots -= 1
    pinned, pinned_bytes = pins(slots)
    # Two slots already keep each download a whole host step ahead (a bucket comes down
    # faster than the host steps it); a slot beyond them is not worth a host copy left
    # pageable, whose upload is staged on the calling thread at every step.
    while pin_slots and slots > 2:
        fewer, fewer_bytes = pins(slots - 1)
        if fewer_bytes <= pinned_bytes:
            break
        slots, pinned, pinned_bytes = slots - 1, fewer, fewer_bytes
    return slots, pinned


def sized_bucket_bytes(
    staged_bytes: int, most: int, buckets: int = 8, least: int = 16 << 20
) -> int:
    """A bucket cap for ``staged_bytes`` of offloaded copies: the largest power of two at most
    ``staged_bytes / buckets``, within ``least`` and ``most`` (copies larger than the cap still
    make a bucket each).

    The pipeline's ends (the first download, the last upload) and each ring slot are a bucket
    long, so where few buckets hold everything (a data-parallel rank's shards of a small model)
    a fixed cap leaves those ends a large part of the step and the ring most of the pinned
    budget; below ``least`` the calling thread's work per bucket would outweigh that.
    """
    if staged_bytes <= 0:
        return most
    share = max(staged_bytes // buckets, 1)
    return max(min(1 << (share.bit_length() - 1), most), min(least, most))


def slot_sizes(bucket_nbytes: List[int], slots: int) -> List[int]:
    """Bytes of each ring slot when the k-th bucket stages in slot ``k % slots``: the largest
    of its own buckets (one large embedding then takes one large slot, not all of them)."""
    return [max(bucket_nbytes[first::slots]) for first in range(slots)]


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
        packed_slots: whether the slots are packed into shared blocks (:func:`pack_slots`).
    """

    cap: int
    optimizers: List[torch.optim.Optimizer]
    buckets: List[HostBucket]
    staged: List[int]
    units: List[Tuple[Any, int]]
    slots: int
    pin_slots: bool
    pinned: List[bool]
    budget: int
    packed_slots: bool = False

    @property
    def staged_bytes(self) -> List[int]:
        """Bytes each staging bucket fills in its slot, in step order."""
        return [self.buckets[i].nbytes for i in self.staged]

    @property
    def ring_bytes(self) -> List[int]:
        """Bytes of each ring slot."""
        return slot_sizes(self.staged_bytes, self.slots) if self.slots else []

    @property
    def ring_held_bytes(self) -> int:
        """What the ring's slots hold, as the host allocator's blocks."""
        if self.packed_slots:
            return packed_ring_bytes(self.ring_bytes)
        return sum(map(pinned_block_bytes, self.ring_bytes))

    @property
    def pinned_bytes(self) -> int:
        """What the pinned units hold, as the host allocator's blocks (the ring apart)."""
        return sum(pinned_block_bytes(n) for (_, n), pin in zip(self.units, self.pinned) if pin)

    @property
    def pageable_bytes(self) -> int:
        """Bytes of host copies left pageable: each step copies them into a slot to upload."""
        return sum(nbytes for (_, nbytes), pin in zip(self.units, self.pinned) if not pin)


def bucket_optimizers(
    optimizer_cls: type, param_groups: Sequence[Dict[str, Any]], bucket_bytes: int = 0
) -> List[torch.optim.Optimizer]:
    """The host sub-optimizers: one for each run of consecutive parameters of a group that,
    laid out as their gradients are staged (each at a ``GRAD_ALIGN`` boundary), fit in
    ``bucket_bytes``, so that each can start once its gradients have landed while small
    parameters share one call. Parameters already on the host count too, though they stage
    nothing, so a bucket's staged bytes never exceed the cap; a parameter larger than the cap
    gets an optimizer of its own, and so does every parameter with ``bucket_bytes`` 0 (as
    upstream builds them). In group and parameter order."""
    optimizers = []
    for group in param_groups:
        params = group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        settings = {k: v for k, v in group.items() if k != "params"}
        bucket, end = [], 0
        for param in params:
            offset = staged_offset(end)
            if bucket and (bucket_bytes <= 0 or offset + tensor_nbytes(param) > bucket_bytes):
                optimizers.append(optimizer_cls([{**settings, "params": bucket}]))
                bucket, offset = [], 0
            bucket.append(param)
            end = offset + tensor_nbytes(param)
        if bucket:
            optimizers.append(optimizer_cls([{**settings, "params": bucket}]))
    return optimizers


def lay_out_buckets(
    optimizers: Iterable[torch.optim.Optimizer],
    param_of: Dict[torch.Tensor, torch.Tensor],
    part_bytes: int,
) -> List[HostBucket]:
    """The pipeline's buckets for these host sub-optimizers, in step order, each offloaded
    copy's gradient at its offset in a slot; a sub-optimizer's only copy larger than
    ``part_bytes`` (0: none) makes one bucket per part where it can be stepped in parts.
    ``param_of`` maps each offloaded host copy to its parameter; other host parameters stage
    nothing."""
    buckets: List[HostBucket] = []
    for optimizer in optimizers:
        grads, end = [], 0
        for group in optimizer.param_groups:
            for host in group["params"]:
                param = param_of.get(host)
                if param is not None:
                    offset = staged_offset(end)
                    grads.append((host, param, offset))
                    end = offset + tensor_nbytes(host)
        buckets.extend(make_buckets(optimizer, grads, end, part_bytes))
    return buckets


def pinnable_units(buckets: Sequence[HostBucket]) -> List[Tuple[Any, int]]:
    """What of these buckets' host copies may be pinned, in upload order (see
    :attr:`HostPlan.units`): copies of accelerator parameters only."""
    units: List[Tuple[Any, int]] = []
    for index, bucket in enumerate(buckets):
        units.extend(bucket.pinnable_units(index))
    return units


def plan_host(
    build: Callable[[int], List[torch.optim.Optimizer]],
    caps: Sequence[Tuple[int, int]],
    param_of: Dict[torch.Tensor, torch.Tensor],
    max_slots: int,
    pin_grads: bool,
    pin_copies: bool,
    keep_slots: bool = False,
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
        keep_slots: a slot for each of ``max_slots`` buckets, whatever it costs (see
            :func:`plan_pinned_host_memory`).
    """
    crossing = [(host, param) for host, param in param_of.items() if on_accelerator(param)]
    # What upstream's pins hold, block by block, against the fork's counted alike.
    widened = pin_copies and upstream_pins_widened_copies()
    budget = upstream_pinned_bytes(crossing, pin_grads, held=True, pins_widened=widened)
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
            keep_slots,
        )
        plan = HostPlan(
            cap, optimizers, buckets, staged, units, slots, pin_slots, pinned, budget, keep_slots
        )
        if best is None or plan.pageable_bytes < best.pageable_bytes:
            best = plan
    return best
