# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""How the HybridDeviceOptimizer's offloaded copies travel: buckets, the gradient ring, pinning.

Pure planning and layout helpers of :mod:`hybrid_optimizer`: what megatron-core 0.19.2 keeps
pinned for the same parameters (the budget), how many gradient slots the ring gets and which
host copies are pinned within that budget, the bucket record each host sub-optimizer's
gradients and uploads are staged through, and the packing of a bucket of small host copies
into one flat block so that each direction is one copy.
"""

import contextlib
import dataclasses
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch._utils import _unflatten_dense_tensors

from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_kernels import (
    tensor_nbytes,
    typed_view,
)


def pinned_block_bytes(nbytes: int) -> int:
    """Bytes the caching host allocator holds for a pinned allocation of ``nbytes``: it asks
    CUDA for blocks of a power of two."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def upstream_pinned_bytes(
    copies: List[Tuple[torch.Tensor, torch.Tensor]], pin_grads: bool, held: bool = False
) -> int:
    """Pinned bytes megatron-core 0.19.2's HDO keeps for these offloaded parameters.

    It keeps a gradient buffer in the host copy's dtype (pinned if ``pin_grads``) and pins
    a copy of each parameter, which stays only when it is the host copy itself (no fp32
    update); a widened copy replaces it with pageable fp32.

    Args:
        copies: ``(host copy, accelerator parameter)`` per offloaded parameter.
        pin_grads: upstream's ``pin_cpu_grads``.
        held: count each allocation as the block the host allocator holds for it
            (:func:`pinned_block_bytes`), what the process pins, rather than its bytes.
    """
    size = pinned_block_bytes if held else int
    total = 0
    for host, param in copies:
        if pin_grads:
            total += size(tensor_nbytes(host))
        if host.dtype == param.dtype:
            total += size(tensor_nbytes(param))
    return total


def plan_pinned_host_memory(
    bucket_nbytes: List[int],
    master_nbytes: List[int],
    budget: int,
    max_slots: int,
    pin_slots: bool = True,
    block: Callable[[int], int] = int,
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

    Returns:
        ``(slots, pinned)``: the slot count (0 without buckets) and a flag per host copy.
    """
    if not bucket_nbytes:
        return 0, [False] * len(master_nbytes)

    def ring(slots):
        return sum(block(nbytes) for nbytes in slot_sizes(bucket_nbytes, slots))

    def pins(slots):
        used = ring(slots) if pin_slots else 0
        pinned = []
        for nbytes in master_nbytes:
            pinned.append(used + block(nbytes) <= budget)
            used += block(nbytes) if pinned[-1] else 0
        return pinned, sum(block(n) for n, pin in zip(master_nbytes, pinned) if pin)

    slots = min(max_slots, len(bucket_nbytes))
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
class _Bucket:
    """A host sub-optimizer and where the gradients of its offloaded parameters land.

    Attributes:
        optimizer: the host sub-optimizer.
        grads: ``(host copy, public parameter, byte offset in the slot)`` per offloaded
            parameter, packed in the optimizer's order.
        nbytes: bytes of a slot these gradients fill.
        slot: the ring slot they are staged in.
        follower: the bucket whose download reuses that slot once this one has stepped.
        hosts: the host copies of ``grads``, in order.
        params: their public parameters, in order.
        packed: the copies move as one block each way (several of them, on one device).
        views: the slot view each host copy has as its gradient (first step on).
        master: the flat block the packed host copies are views into (first step on).
        master_ptrs: where each host copy started when its block, one-call step and
            ``pinned`` were made, to notice one that a client re-pointed (``.data`` replaced).
        pinned: whether each host copy's memory is pinned (a packed block's, for its copies).
        down: device views the gradients are gathered and widened into (packed, on CUDA).
        up: device views the uploaded block lands in, narrowed from there (packed, on CUDA).
        keep: indices of the copies that have a gradient in this step; None for all.
        flat: the one-call step of a packed bucket or of one copy (first step on), or None.
        part: the element range of its one host copy that this bucket moves, where the copy
            moves in parts (``hybrid_optimizer_parts``); None for the whole copy.
        parted: the step shared by the parts of that copy (``PartedCopy``), or None.
        landed: the CUDA event its download records, made once and recorded again by each
            download (the host step waits for it before stepping the bucket).
    """

    optimizer: torch.optim.Optimizer
    grads: List[Tuple[torch.Tensor, torch.Tensor, int]]
    nbytes: int
    slot: int = 0
    follower: Optional[int] = None
    hosts: List[torch.Tensor] = dataclasses.field(default_factory=list)
    params: List[torch.Tensor] = dataclasses.field(default_factory=list)
    packed: bool = False
    views: List[torch.Tensor] = dataclasses.field(default_factory=list)
    master: Optional[torch.Tensor] = None
    master_ptrs: List[int] = dataclasses.field(default_factory=list)
    pinned: List[bool] = dataclasses.field(default_factory=list)
    down: List[torch.Tensor] = dataclasses.field(default_factory=list)
    up: List[torch.Tensor] = dataclasses.field(default_factory=list)
    keep: Optional[List[int]] = None
    flat: Any = None
    part: Optional[Tuple[int, int]] = None
    parted: Any = None
    landed: Any = None

    @property
    def event_key(self) -> Any:
        """Its key in the HDO's map of D2H events: the sub-optimizer, as upstream keys it,
        or with its range for one part of a copy (its parts share the sub-optimizer)."""
        return self.optimizer if self.part is None else (self.optimizer, self.part)

    def kept(self, items: List[Any]) -> List[Any]:
        """The entries of ``items`` (one per copy) whose copy has a gradient this step."""
        return items if self.keep is None else [items[i] for i in self.keep]

    def sliced(self, tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``tensor`` (a copy, its parameter or a dense gradient) as this bucket moves it:
        whole, or the 1-D slice of its part (a view, so a strided tensor is refused rather than
        copied and written in vain)."""
        if tensor is None or self.part is None:
            return tensor
        return tensor.view(-1)[self.part[0] : self.part[1]]


@dataclasses.dataclass
class _RingPlan:
    """What the first step allocates and pins (see ``_plan_grad_ring``)."""

    slots: int
    slot_bytes: List[int]
    pin_slots: bool
    first_downloads: List[int]
    masters_to_pin: List[torch.Tensor]
    blocks_to_pin: List[int] = dataclasses.field(default_factory=list)


def pack_host_copies(bucket: "_Bucket", pin: bool) -> None:
    """Make the bucket's host copies views into one flat block, laid out as its slot, so
    that it uploads in one copy; their values and tensor objects stay."""
    block = torch.empty(bucket.nbytes, dtype=torch.uint8, pin_memory=pin)
    for host, _, offset in bucket.grads:
        view = typed_view(block, offset, host)
        view.copy_(host)
        host.data = view
    bucket.master = block
    bucket.master_ptrs = [host.data_ptr() for host in bucket.hosts]


def _widened(grads: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
    """fp32 copies of ``grads`` (None stays None): views into one buffer per device, filled by
    one multi-tensor copy, instead of a cast and an allocation per tensor."""
    present = [grad for grad in grads if grad is not None]
    if not present or len({grad.device for grad in present}) != 1:
        return [None if grad is None else grad.to(torch.float32) for grad in grads]
    flat = torch.empty(
        sum(g.numel() for g in present), dtype=torch.float32, device=present[0].device
    )
    # One C++ loop cuts the views (a Python split and view per tensor costs several times
    # more with thousands of gradients).
    views = _unflatten_dense_tensors(flat, present)
    torch._foreach_copy_(views, present)  # pylint: disable=protected-access
    widened = iter(views)
    return [None if grad is None else next(widened) for grad in grads]


class _SwitchStream:
    """Queue work on ``stream``, then make ``back`` current again.

    ``torch.cuda.stream`` asks which stream is current on every entry; a step enters a side
    stream twice a bucket, so it reads the current stream once and hands it in here. Leaving
    makes that stream current again, whatever was current on entry: nothing the step calls
    between its copies may change the current stream and expect the change to last.
    """

    __slots__ = ("stream", "back")

    def __init__(self, stream, back):
        self.stream, self.back = stream, back

    def __enter__(self):
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc):
        torch.cuda.set_stream(self.back)


def _on_stream(stream, current=None):
    """``torch.cuda.stream(stream)``, or nothing on a host without CUDA.

    Args:
        stream: the side stream, or None.
        current: the stream current on ``stream``'s device when the caller read it, to come
            back to without asking again; None to ask.
    """
    if stream is None:
        return contextlib.nullcontext()
    if current is None:
        return torch.cuda.stream(stream)
    return _SwitchStream(stream, current)
