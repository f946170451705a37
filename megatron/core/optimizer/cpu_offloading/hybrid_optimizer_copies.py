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
from torch.optim import optimizer as _torch_optimizer

from megatron.core.optimizer.inner_optimizer_state import STATE_BY_EXAMPLE


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _typed_view(raw: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The bytes of ``raw`` from ``offset`` on, seen as a tensor of ``like``'s dtype and shape."""
    return raw[offset : offset + _nbytes(like)].view(like.dtype).view(like.shape)


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
            total += size(_nbytes(host))
        if host.dtype == param.dtype:
            total += size(_nbytes(param))
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
    exceed ``budget``, but at least one. A ring never holds more than all buckets together,
    since each slot is one of them. Host copies are then pinned in order while the total stays
    within ``budget``, so those left pageable are the last to upload, when nothing waits
    behind them.

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

    slots = min(max_slots, len(bucket_nbytes))
    while pin_slots and slots > 1 and ring(slots) > budget:
        slots -= 1
    used = ring(slots) if pin_slots else 0
    pinned = []
    for nbytes in master_nbytes:
        pinned.append(used + block(nbytes) <= budget)
        used += block(nbytes) if pinned[-1] else 0
    return slots, pinned


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
        master_ptrs: where each packed host copy starts in ``master``, to notice one that a
            client re-pointed (its ``.data`` replaced).
        down: device views the gradients are gathered and widened into (packed, on CUDA).
        up: device views the uploaded block lands in, narrowed from there (packed, on CUDA).
        keep: indices of the copies that have a gradient in this step; None for all.
        flat: how the bucket is stepped as one block, where it can be (:class:`FlatStep`).
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
    down: List[torch.Tensor] = dataclasses.field(default_factory=list)
    up: List[torch.Tensor] = dataclasses.field(default_factory=list)
    keep: Optional[List[int]] = None
    flat: Optional["FlatStep"] = None

    def kept(self, items: List[Any]) -> List[Any]:
        """The entries of ``items`` (one per copy) whose copy has a gradient this step."""
        return items if self.keep is None else [items[i] for i in self.keep]


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
        view = _typed_view(block, offset, host)
        view.copy_(host)
        host.data = view
    bucket.master = block
    bucket.master_ptrs = [host.data_ptr() for host in bucket.hosts]


_MOMENTS = ("exp_avg", "exp_avg_sq")

_VECTOR_BYTES = 64
"""Widest vector torch's host kernels step at once (AVX-512). A kernel steps each tensor's
elements in vectors and its last ``numel % width`` elements one at a time, which may round
differently; a run of copies stepped as one tensor therefore gets exactly their own results
when each of them starts at a multiple of this many bytes and holds a multiple of it."""


class FlatStep:
    """One step over a packed bucket's blocks in place of one step per host copy.

    The host copies of a packed bucket are views into one block, laid out as the gradients
    in their slot (see :func:`pack_host_copies`). Once their moments are views into blocks
    laid out alike, the sub-optimizer's class steps runs of consecutive copies as single
    tensors: one segment per run of copies whose size is a multiple of ``_VECTOR_BYTES``
    (their padding is then none), and each other copy as a segment of its own, so that every
    element gets exactly the operations the per-copy step gives it, without the per-tensor
    work (a Python pass and a parallel region per copy) that dominates buckets of thousands
    of small copies.

    The moments stay the entries' own tensors: where they are not laid out so (after the
    first step, a load, a client's assignment or ``.data`` swap), they are copied into a new
    block and re-pointed there (``.data``), so that references clients hold stay the state.
    The entries' tensors are the blocks' only owners. A step goes through the sub-optimizer
    as usual where some copy has no gradient, the copies' counters differ, two entries share
    a tensor, or step hooks are registered (they run as they would); so does the first step,
    which creates the state.

    Args:
        bucket: a packed bucket whose sub-optimizer :meth:`suits` this.
        slot: the ring slot (raw bytes) its gradients are staged in.
        entries: the state entry of each of ``bucket.hosts``.
    """

    def __init__(self, bucket: "_Bucket", slot: torch.Tensor, entries: List[dict]):
        self.entries = entries
        self._bucket = bucket
        self._dtype = bucket.hosts[0].dtype
        self._offsets = [offset for _, _, offset in bucket.grads]
        self._segments = _segments(bucket.grads)
        params = []
        for start, end in self._segments:
            params.append(bucket.master[start:end].view(self._dtype))
            params[-1].grad = slot[start:end].view(self._dtype)
        settings = {k: v for k, v in bucket.optimizer.param_groups[0].items() if k != "params"}
        self.optimizer = type(bucket.optimizer)([{**settings, "params": params}])
        self._seen: Optional[tuple] = None  # the state as the last step left it (_look)

    @staticmethod
    def suits(bucket: "_Bucket") -> bool:
        """Whether ``bucket`` can be stepped by segments: packed, all its sub-optimizer's
        parameters offloaded copies of one dtype, an elementwise optimizer without amsgrad."""
        optimizer = bucket.optimizer
        # torch's own Adam and AdamW: an elementwise update, state of moments and a counter.
        if not bucket.packed or bucket.master is None or type(optimizer) not in STATE_BY_EXAMPLE:
            return False
        if len(optimizer.param_groups) != 1:
            return False
        group = optimizer.param_groups[0]
        if group.get("amsgrad") or group.get("differentiable"):
            return False
        params = group["params"]
        if len(params) != len(bucket.hosts) or any(
            a is not b for a, b in zip(params, bucket.hosts)
        ):
            return False
        dtypes = {host.dtype for host in bucket.hosts}
        return len(dtypes) == 1 and next(iter(dtypes)).is_floating_point

    @torch.no_grad()
    def step(self) -> bool:
        """Step the bucket by segments; False (nothing done) where its state does not allow
        it, and the sub-optimizer must step it."""
        bucket = self._bucket
        if bucket.keep is not None or _hooked(bucket.optimizer):
            return False
        entries = self.entries
        counters = [entry.get("step") for entry in entries]
        moments = [[entry.get(key) for entry in entries] for key in _MOMENTS]
        if self._seen is not None and self._seen == self._look(entries, counters, moments):
            # As the last step left them: laid out, where _block_of put them.
            blocks = [_whole_block(values[0]) for values in moments]
        else:
            self._seen = None
            if not self._can_step(entries, counters, moments):
                return False
            blocks = [self._block_of(values) for values in moments]
        group = self.optimizer.param_groups[0]
        group.update((k, v) for k, v in bucket.optimizer.param_groups[0].items() if k != "params")
        states = [self.optimizer.state[param] for param in group["params"]]
        for state, (start, end) in zip(states, self._segments):
            for key, raw in zip(_MOMENTS, blocks):
                state[key] = raw[start:end].view(self._dtype)
            if state.get("step") is None or state["step"].dtype != counters[0].dtype:
                state["step"] = counters[0].clone()
        own = [state["step"] for state in states]
        # pylint: disable=protected-access
        torch._foreach_copy_(own, [counters[0]] * len(own))
        self.optimizer.step()
        torch._foreach_copy_(counters, [own[0]] * len(counters))
        for state in states:  # the entries' tensors stay the blocks' only owners
            for key in _MOMENTS:
                del state[key]
        self._seen = self._look(entries, counters, moments)
        return True

    @staticmethod
    def _look(entries, counters, moments) -> Optional[tuple]:
        """What the next step compares to see that nothing changed since this one: the
        entries' sizes, which counters they hold and whether those were written in place
        (their versions), and where each moment's memory is (a ``.data`` swap moves it).
        Numbers only, so that it keeps no tensor alive; None where some value is no tensor."""
        try:
            return (
                list(map(len, entries)),
                list(map(id, counters)),
                [counter._version for counter in counters],  # pylint: disable=protected-access
                [list(map(torch.Tensor.data_ptr, values)) for values in moments],
            )
        except (AttributeError, TypeError):
            return None

    def _can_step(self, entries, counters, moments) -> bool:
        """Whether the entries can be stepped by segments: each a counter and the moments
        (and the master), counters equal and of one value, moments host tensors of their
        copy's dtype and size, no tensor in two places."""
        for entry, counter in zip(entries, counters):
            if not isinstance(counter, torch.Tensor) or counter.dim() != 0:
                return False
            if len(entry) != 1 + len(_MOMENTS) + ("master_param" in entry):
                return False
        if not all(self._fits(values) for values in moments):
            return False
        tensors = [*counters, *(value for values in moments for value in values)]
        if len({id(t) for t in tensors}) != len(tensors):
            return False  # a tensor stepped twice per step, copy by copy
        stacked = torch.stack(counters)
        return bool((stacked == stacked[0]).all())

    def _fits(self, values: List[Any]) -> bool:
        """Whether these tensors (one per copy) can be stepped in a block: host tensors of
        their copy's dtype and size."""
        return all(
            isinstance(value, torch.Tensor)
            and value.device.type == "cpu"
            and value.dtype == host.dtype
            and value.numel() == host.numel()
            for value, host in zip(values, self._bucket.hosts)
        )

    def _block_of(self, values: List[torch.Tensor]) -> torch.Tensor:
        """The raw block these tensors (one per copy) are views into, laid out like the
        copies; where they are not, a new one they are copied into and re-pointed at."""
        base = values[0].untyped_storage()
        if base.nbytes() >= self._bucket.nbytes and all(
            value.data_ptr() - base.data_ptr() == offset and value.is_contiguous()
            for value, offset in zip(values, self._offsets)
        ):
            return _whole_block(values[0])
        # A new block: tensors laid out in the old one (swapped, say) are read before any is
        # re-pointed.
        raw = torch.zeros(self._bucket.nbytes, dtype=torch.uint8)
        views = [_typed_view(raw, offset, value) for value, offset in zip(values, self._offsets)]
        for value, view in zip(values, views):
            view.copy_(value)
        for value, view in zip(values, views):
            value.data = view
        return raw


def _whole_block(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of the whole storage ``tensor`` views."""
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())


def _hooked(optimizer: torch.optim.Optimizer) -> bool:
    """Whether step hooks would see ``optimizer``'s step (its own, or every optimizer's)."""
    # pylint: disable=protected-access
    own = optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
    every = _torch_optimizer._global_optimizer_pre_hooks
    return bool(own or every or _torch_optimizer._global_optimizer_post_hooks)


def _segments(grads: List[Tuple[torch.Tensor, torch.Tensor, int]]) -> List[Tuple[int, int]]:
    """Byte ranges of a packed bucket stepped as single tensors (see :class:`FlatStep`):
    runs of adjacent copies that start and end at multiples of ``_VECTOR_BYTES``, and each
    other copy alone."""
    segments: List[List[int]] = []
    extendable = False
    for host, _, offset in grads:
        end = offset + _nbytes(host)
        whole = offset % _VECTOR_BYTES == 0 and end % _VECTOR_BYTES == 0
        if whole and extendable and segments[-1][1] == offset:
            segments[-1][1] = end
        else:
            segments.append([offset, end])
        extendable = whole
    return [(start, end) for start, end in segments]


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


def _on_stream(stream):
    """``torch.cuda.stream(stream)``, or nothing on a host without CUDA."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)
