# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The HybridDeviceOptimizer's host buckets, one type per way a bucket's copies move.

A bucket is one host sub-optimizer (or one part of one) and the gradients of its offloaded
parameters; each step it downloads them into its ring slot, steps, and uploads the stepped
copies (:class:`~hybrid_optimizer_ring.Ring` holds the streams, events and slots they share):

- :class:`WholeCopies`: each copy moves as it is (one copy, or copies on several devices);
  a bucket of one dense copy is stepped by one fused kernel call where it can be.
- :class:`PackedCopies`: several small copies on one device, views into one flat block laid out
  as their slot, so each direction is one copy and one multi-tensor kernel, and the bucket is
  stepped by one fused call over its runs (:mod:`hybrid_optimizer_flat_step`).
- :class:`CopyPart`: one part of a copy larger than a bucket (:mod:`hybrid_optimizer_parts`).
"""

from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_flat_step import FlatAdamStep, suits
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_kernels import (
    grad_of,
    tensor_nbytes,
    typed_view,
)
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_parts import (
    PartedCopy,
    can_part,
    part_ranges,
)
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_ring import Ring

# A staged gradient: (host copy, public parameter, byte offset in the slot).
Staged = Tuple[torch.Tensor, torch.Tensor, int]


def on_accelerator(param: torch.Tensor) -> bool:
    """Whether ``param`` lives where the copies cross a bus: CUDA, or meta in a plan alone."""
    return param.is_cuda or param.is_meta


class HostBucket:
    """A host sub-optimizer and where the gradients of its offloaded parameters land.

    Args:
        optimizer: the host sub-optimizer.
        grads: ``(host copy, public parameter, byte offset in the slot)`` per offloaded
            parameter, packed in the optimizer's order.
        nbytes: bytes of a slot these gradients fill.

    Attributes:
        slot: the ring slot they are staged in.
        follower: the bucket whose download reuses that slot once this one has stepped.
        hosts: the host copies of ``grads``, in order.
        params: their public parameters, in order.
        views: the slot view each host copy has as its gradient (first step on).
        master_ptrs: where each host copy started when its layout was noted, to notice one
            that a client re-pointed (``.data`` replaced).
        pinned: whether each host copy's memory is pinned.
        keep: indices of the copies that have a gradient in this step; None for all.
        landed: the CUDA event its download records, made once and recorded again by each
            download (the host step waits for it before stepping the bucket).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, grads: List[Staged], nbytes: int):
        self.optimizer = optimizer
        self.grads = grads
        self.nbytes = nbytes
        self.slot = 0
        self.follower: Optional[int] = None
        self.hosts = [host for host, _, _ in grads]
        self.params = [param for _, param, _ in grads]
        self.views: List[torch.Tensor] = []
        self.master_ptrs: List[int] = []
        self.pinned: List[bool] = []
        self.keep: Optional[List[int]] = None
        self.landed: Any = None

    @property
    def event_key(self) -> Any:
        """Its key in the HDO's map of D2H events: the sub-optimizer, as upstream keys it."""
        return self.optimizer

    def kept(self, items: List[Any]) -> List[Any]:
        """The entries of ``items`` (one per copy) whose copy has a gradient this step."""
        return items if self.keep is None else [items[i] for i in self.keep]

    def sliced(self, tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``tensor`` (a copy, its parameter or a dense gradient) as this bucket moves it."""
        return tensor

    def pinnable_units(self, index: int) -> List[Tuple[Any, int]]:
        """What of this bucket (the ``index``-th) may be pinned, with its bytes: each host copy
        of an accelerator parameter (see ``HostPlan.units``)."""
        return [(host, tensor_nbytes(host)) for host in self._crossing()]

    def _crossing(self) -> List[torch.Tensor]:
        """The host copies of parameters on the accelerator (meta in a plan alone)."""
        return [host for host, param, _ in self.grads if on_accelerator(param)]

    # ------------------------------------------------------------------ first step

    def take_slot(self, ring: Ring, grad_views: Dict[torch.Tensor, torch.Tensor]):
        """View each gradient into the bucket's slot (noted in ``grad_views``, the HDO's
        ``cpu_copy_map_grad``)."""
        slot = ring.slots[self.slot] if self.grads else None
        for host, _, offset in self.grads:
            grad_views[host] = typed_view(slot, offset, host)
        self.views = [grad_views[host] for host in self.hosts]

    def pack(self, ring: Ring, pin: bool, flat_steps: bool, entry_of):
        """Lay the copies out as they stay (only packed copies move into a block)."""

    def settle_layout(self, ring: Ring, flat_steps: bool, entry_of):
        """Once the copies are where they stay: make the one-call step, note the layout."""
        if self.grads:
            self.note_layout()

    def stages_on_device(self) -> bool:
        """Whether its copies go through the ring's device staging buffers."""
        return False

    def note_layout(self):
        """Note where the copies live and whether their memory is pinned, so that an upload
        need not ask the driver; :meth:`download` notices a copy re-pointed since."""
        self.master_ptrs = [host.data_ptr() for host in self.hosts]
        self.pinned = [host.is_pinned() for host in self.hosts]

    def relayout(self, ring: Ring):
        """Lay out again around copies a client re-pointed."""
        self.note_layout()

    # ------------------------------------------------------------------ each step

    def download(self, ring: Ring):
        """Queue the D2H of the gradients into the slot and note the event (where CUDA exists).

        Each host copy keeps its slot view as its gradient, or None while its parameter has
        none (its step is then skipped).
        """
        if self.master_ptrs and [h.data_ptr() for h in self.hosts] != self.master_ptrs:
            self.relayout(ring)  # a copy was re-pointed: its block or step views old memory
        grads = [grad_of(param) for param in self.params]
        self.keep = None
        if any(grad is None for grad in grads):
            self.keep = [i for i, grad in enumerate(grads) if grad is not None]
        self.lend_grads(grads)
        grads = self.kept(grads)
        with ring.down():
            ring.wait_for_slot(self.slot)  # the slot may still hold a copy on its way up
            self.move_down(ring, grads)
            self.landed = ring.note_landing(self.event_key, self.landed)

    def lend_grads(self, grads: List[Optional[torch.Tensor]]):
        """Give each host copy its slot view as its gradient (None where it has none)."""
        for host, view, grad in zip(self.hosts, self.views, grads):
            lent = None if grad is None else view
            if host.grad is not lent:
                host.grad = lent

    def move_down(self, ring: Ring, grads: List[torch.Tensor]):
        """Copy the kept gradients into their slot views (on the D2H stream)."""
        for staged, grad in zip(self.kept(self.views), grads):
            if grad.is_cuda and grad.dtype != staged.dtype:
                grad = grad.to(staged.dtype)  # widen on the device, where it is cheap
            staged.copy_(grad.view_as(staged), non_blocking=ring.plan.pin_slots)

    def step(self, ring: Ring) -> List["HostBucket"]:
        """Step once the gradients have landed.

        Returns:
            The buckets that may go up now.
        """
        ring.wait_for_landing(self.event_key)
        self.optimizer.step()
        return [self]

    def stage_upload(self, ring: Ring, staged_in_slot: bool) -> Tuple[list, bool]:
        """Get the host copies just stepped ready to go up: where the slot is the bucket's own
        now (``staged_in_slot``: its gradients are stepped), pageable copies are copied into
        it on the host, since an upload from pageable memory blocks the host until it is done,
        holding up the next host step, while a host copy into the pinned slot is faster and
        lets the upload run behind it.

        Returns:
            What each upload reads (each stepped copy, in order) and whether any of it is in
            the slot.
        """
        if not self.kept(self.params):
            return [], False
        stage = staged_in_slot and ring.plan.pin_slots
        sources, staged = [], False
        for host, slot_view, pinned in zip(
            self.kept(self.hosts), self.kept(self.views), self.kept(self.pinned)
        ):
            host = self.sliced(host)
            if stage and not pinned:
                host = slot_view.copy_(host)
                staged = True
            sources.append(host)
        return sources, staged

    def queue_upload(self, ring: Ring, sources: list, staged: bool):
        """Queue the H2D of the stepped copies (``sources``, ``staged``: from
        :meth:`stage_upload`) into their parameters; where a copy went up through the slot,
        the download that reuses the slot waits for the upload."""
        params = self.kept(self.params)
        if not params:
            return
        with ring.up():
            self.move_up(ring, params, sources)
            if staged and self.follower is not None:
                ring.note_slot_upload(self.slot)

    def move_up(self, ring: Ring, params: List[torch.Tensor], sources: list):
        """Copy each source into its parameter (on the H2D stream)."""
        for param, source in zip(params, sources):
            param = self.sliced(param.data)
            if param.is_cuda and source.dtype != param.dtype:
                # Narrow on the device. The staging tensor is allocated on this stream, so the
                # caching allocator hands its memory out again only in this stream's order,
                # after the narrowing copy has read it.
                narrowed = torch.empty_like(source, device=param.device)
                source = narrowed.copy_(source, non_blocking=True)
            param.copy_(source.view_as(param), non_blocking=param.is_cuda)


class WholeCopies(HostBucket):
    """A bucket whose copies move one by one, each as it is.

    Attributes:
        flat: the one-call step of a bucket of one dense copy (first step on), or None.
    """

    def __init__(self, optimizer, grads, nbytes):
        super().__init__(optimizer, grads, nbytes)
        self.flat: Optional[FlatAdamStep] = None
        self._flat_steps = False
        self._entry_of = None

    def make_flat(self, ring: Ring, flat_steps: bool, entry_of):
        """Give the bucket its one-call step (``FlatAdamStep``) where its sub-optimizer is
        torch's fused Adam or AdamW over one dense copy (a kernel call instead of the
        optimizer's Python)."""
        self._flat_steps, self._entry_of = flat_steps, entry_of
        self.flat = None
        if len(self.hosts) != 1 or not self.hosts[0].is_contiguous():
            return
        self.flat = self._flat_step(ring, None)

    def _flat_step(self, ring: Ring, master: Optional[torch.Tensor]) -> Optional[FlatAdamStep]:
        if not self._flat_steps or not suits(self.optimizer, self.hosts):
            return None
        return FlatAdamStep(
            self.optimizer,
            [self._entry_of(host) for host in self.hosts],
            [(offset, tensor_nbytes(host)) for host, _, offset in self.grads],
            master,
            ring.slots[self.slot],
        )

    def settle_layout(self, ring: Ring, flat_steps: bool, entry_of):
        if self.grads:
            self.make_flat(ring, flat_steps, entry_of)
        super().settle_layout(ring, flat_steps, entry_of)

    def relayout(self, ring: Ring):
        self.make_flat(ring, self._flat_steps, self._entry_of)
        self.note_layout()

    def step(self, ring: Ring) -> List[HostBucket]:
        """Step once the gradients have landed: by the one-call step where it can be."""
        ring.wait_for_landing(self.event_key)
        if self.flat is None or self.keep is not None or not self.flat.step():
            self.optimizer.step()
            if self.flat is not None:
                self.flat.lay_out()  # so that the next step can be flat
        return [self]


class PackedCopies(WholeCopies):
    """Several small copies on one device that move as one block each way.

    Their host copies are views into one flat block laid out as their slot; on CUDA their
    gradients are gathered (and widened) into a device staging buffer laid out alike, and
    the uploaded block is narrowed from the other one.

    Attributes:
        master: the flat block the host copies are views into (first step on).
        down: device views the gradients are gathered and widened into (on CUDA).
        up: device views the uploaded block lands in, narrowed from there (on CUDA).
    """

    def __init__(self, optimizer, grads, nbytes):
        super().__init__(optimizer, grads, nbytes)
        self.master: Optional[torch.Tensor] = None
        self.down: List[torch.Tensor] = []
        self.up: List[torch.Tensor] = []

    def pinnable_units(self, index: int) -> List[Tuple[Any, int]]:
        """The block as a whole, by the bucket's index, where any copy crosses the bus."""
        return [(index, self.nbytes)] if self._crossing() else []

    def pack(self, ring: Ring, pin: bool, flat_steps: bool, entry_of):
        """Make the host copies views into one flat block, laid out as the slot, so that it
        uploads in one copy (their values and tensor objects stay); step it flat where it can
        be."""
        block = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        for host, _, offset in self.grads:
            view = typed_view(block, offset, host)
            view.copy_(host)
            host.data = view
        self.master = block
        self.master_ptrs = [host.data_ptr() for host in self.hosts]
        self.make_flat(ring, flat_steps, entry_of)

    def make_flat(self, ring: Ring, flat_steps: bool, entry_of):
        """Give the bucket its one-call step over its block, where it can be."""
        self._flat_steps, self._entry_of = flat_steps, entry_of
        self.flat = self._flat_step(ring, self.master)

    def settle_layout(self, ring: Ring, flat_steps: bool, entry_of):
        self.note_layout()  # made flat when packed

    def note_layout(self):
        self.master_ptrs = [host.data_ptr() for host in self.hosts]
        self.pinned = [self.master.is_pinned()] * len(self.hosts)

    def relayout(self, ring: Ring):
        self.pack(ring, self.pinned[0], self._flat_steps, self._entry_of)
        self.note_layout()

    def stages_on_device(self) -> bool:
        return self.params[0].is_cuda

    def take_device_staging(self, ring: Ring):
        """View the gradients and the uploaded block into the device staging buffers."""
        down, up = ring.device_staging
        self.down = [typed_view(down, offset, host) for host, _, offset in self.grads]
        self.up = [typed_view(up, offset, host) for host, _, offset in self.grads]

    def move_down(self, ring: Ring, grads: List[torch.Tensor]):
        if self.down and grads:
            torch._foreach_copy_(self.kept(self.down), grads)  # widens on the device
            raw = ring.device_staging[0][: self.nbytes]
            ring.slots[self.slot][: self.nbytes].copy_(raw, non_blocking=ring.plan.pin_slots)
        elif grads:
            torch._foreach_copy_(self.kept(self.views), grads)

    def stage_upload(self, ring: Ring, staged_in_slot: bool) -> Tuple[list, bool]:
        """The block goes up as one: from the slot where it is pageable and the slot is the
        bucket's own now (see :meth:`HostBucket.stage_upload`)."""
        if not self.kept(self.params):
            return [], False
        if staged_in_slot and ring.plan.pin_slots and not self.pinned[0]:
            return [ring.slots[self.slot][: self.nbytes].copy_(self.master)], True
        return [self.master], False

    def move_up(self, ring: Ring, params: List[torch.Tensor], sources: list):
        """The block into the device staging buffer, narrowed from there into the parameters
        by one multi-tensor copy."""
        if self.up:
            ring.device_staging[1][: self.nbytes].copy_(sources[0], non_blocking=True)
            torch._foreach_copy_(params, self.kept(self.up))  # narrows on the device
        else:
            torch._foreach_copy_(params, self.kept(self.hosts))


class CopyPart(HostBucket):
    """One part of a host copy that moves in parts (:mod:`hybrid_optimizer_parts`).

    A part's gradient is a slice, so the copy has no whole gradient view in a slot.

    Attributes:
        part: the element range of the copy that this bucket moves.
        parted: the step shared by the parts of that copy.
    """

    def __init__(self, optimizer, grads, nbytes, part: Tuple[int, int]):
        super().__init__(optimizer, grads, nbytes)
        self.part = part
        self.parted: Optional[PartedCopy] = None

    @property
    def event_key(self) -> Any:
        """The sub-optimizer with the part's range (the parts share the sub-optimizer)."""
        return (self.optimizer, self.part)

    def sliced(self, tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The 1-D slice of the part (a view, so a strided tensor is refused rather than
        copied and written in vain)."""
        if tensor is None:
            return tensor
        return tensor.view(-1)[self.part[0] : self.part[1]]

    def pinnable_units(self, index: int) -> List[Tuple[Any, int]]:
        """The copy, once: by its first part."""
        return super().pinnable_units(index) if self.part[0] == 0 else []

    def take_slot(self, ring: Ring, grad_views: Dict[torch.Tensor, torch.Tensor]):
        self.views = [ring.slots[self.slot][: self.nbytes].view(self.hosts[0].dtype)]

    def lend_grads(self, grads: List[Optional[torch.Tensor]]):
        """Nothing: a part lends no whole view."""

    def move_down(self, ring: Ring, grads: List[torch.Tensor]):
        # A strided gradient is made dense here, on this stream.
        super().move_down(ring, [self.sliced(grad.contiguous()) for grad in grads])

    def step(self, ring: Ring) -> List[HostBucket]:
        """Step this part (see :class:`PartedCopy`).

        Returns:
            The buckets that may go up now: this part, or those its step released (a copy
            whose parts are gathered goes up once its last part has landed).
        """
        ring.wait_for_landing(self.event_key)
        if self.keep is not None:  # no gradient this step: no part is stepped
            return []
        parted = self.parted
        index = parted.ranges.index(self.part)
        if index == 0:
            parted.begin()
        return [parted.buckets[i] for i in parted.step_part(index, self.views[0])]


def make_buckets(optimizer, grads: List[Staged], nbytes: int, part_bytes: int) -> List[HostBucket]:
    """The buckets of one host sub-optimizer: a part each where its only copy is larger than
    ``part_bytes`` (0: never) and can be stepped in parts; one packed bucket for several copies
    on one device; else one of whole copies."""
    if len(grads) == 1 and part_bytes and nbytes > part_bytes:
        host, param, _ = grads[0]
        if param.is_contiguous() and can_part(optimizer, host):
            size = host.element_size()
            return [
                CopyPart(optimizer, grads, (stop - start) * size, (start, stop))
                for start, stop in part_ranges(host.numel(), size, part_bytes)
            ]
    packed = len(grads) > 1 and len({param.device for _, param, _ in grads}) == 1
    return [(PackedCopies if packed else WholeCopies)(optimizer, grads, nbytes)]


def share_parted_steps(buckets: List[HostBucket], entry_of):
    """Give each run of parts of one host copy the step its parts share."""
    runs: Dict[Any, List[CopyPart]] = {}
    for bucket in buckets:
        if isinstance(bucket, CopyPart):
            runs.setdefault(bucket.optimizer, []).append(bucket)
    for optimizer, parts in runs.items():
        parted = PartedCopy(optimizer, entry_of(parts[0].hosts[0]), [p.part for p in parts])
        parted.buckets = parts
        for bucket in parts:
            bucket.parted = parted
