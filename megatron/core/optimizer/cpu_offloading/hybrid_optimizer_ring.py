# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The ring the HybridDeviceOptimizer's host buckets move through: streams, events, slots.

One object holds what every bucket's copies share during a step: the D2H and H2D side streams
(none on a host without CUDA), the stream current when the step began, the events the
downloads record for the host steps, the ring of host staging slots that gradients land in and
pageable copies go up through, the events of those staged uploads, and the two device staging
buffers of the packed buckets. Each bucket queues its own copies on it
(:mod:`hybrid_optimizer_buckets`).
"""

import contextlib
import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

# Each ring slot packed into a shared block starts at a multiple of this many bytes (a page).
SLOT_ALIGN = 4096

# Packed slots share blocks of up to 2**this times the largest slot's next power of two.
PACKED_BLOCK_GROWTH = 5


def pack_slots(slot_bytes: Sequence[int]) -> Tuple[int, List[Tuple[int, int]]]:
    """Pack slots into equal blocks of a power of two, first fit from the largest slot: a ring
    of a slot per bucket then costs about its bytes, where a block per slot would cost each
    slot's next power of two. Of the block sizes from the largest slot's next power of two up
    to :data:`PACKED_BLOCK_GROWTH` doublings of it, the one holding the fewest bytes in all
    (the smallest on a tie).

    Returns:
        ``(block bytes, places)``: each slot's ``(block index, byte offset)``.
    """
    if not slot_bytes:
        return 0, []
    least = 1 << (max(slot_bytes) - 1).bit_length()
    packings = [_first_fit(slot_bytes, least << k) for k in range(PACKED_BLOCK_GROWTH + 1)]
    return min(packings, key=lambda packing: packing[0] * (1 + max(i for i, _ in packing[1])))


def _first_fit(slot_bytes: Sequence[int], block: int) -> Tuple[int, List[Tuple[int, int]]]:
    ends: List[int] = []
    places: List[Tuple[int, int]] = [(0, 0)] * len(slot_bytes)
    for index in sorted(range(len(slot_bytes)), key=lambda i: -slot_bytes[i]):
        nbytes = slot_bytes[index]
        chosen = next((b for b, end in enumerate(ends) if end + nbytes <= block), None)
        if chosen is None:
            chosen = len(ends)
            ends.append(0)
        places[index] = (chosen, ends[chosen])
        ends[chosen] = -(-(ends[chosen] + nbytes) // SLOT_ALIGN) * SLOT_ALIGN
    return block, places


@dataclasses.dataclass
class RingPlan:
    """What the first step allocates and pins (see ``HybridDeviceOptimizer._plan_grad_ring``).

    Attributes:
        slots: the ring's slot count.
        slot_bytes: bytes of each slot.
        pin_slots: whether the slots are pinned (their copies then run without blocking).
        first_downloads: the buckets whose downloads start the step, one per slot.
        masters_to_pin: host copies pinned in place on the first step.
        blocks_to_pin: indices of the packed buckets whose block is pinned.
        packed_slots: carve the slots out of shared blocks (``pack_slots``) rather than
            allocate each.
    """

    slots: int
    slot_bytes: List[int]
    pin_slots: bool
    first_downloads: List[int]
    masters_to_pin: List[torch.Tensor]
    blocks_to_pin: List[int] = dataclasses.field(default_factory=list)
    packed_slots: bool = False


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


def on_stream(stream, current=None):
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


def recorded(event: Optional[Any], stream) -> Any:
    """``event`` (made here the first time) recorded on ``stream``: a step records the same
    events again rather than making and freeing one per copy."""
    if event is None:
        event = torch.cuda.Event()
    event.record(stream)
    return event


class Ring:
    """The streams, events and staging slots of the host buckets' copies.

    Args:
        d2h_stream: the side stream gradients come down on (None without CUDA).
        h2d_stream: the side stream stepped copies go up on (None without CUDA).
        data_events: the D2H event of each bucket whose gradients are on their way, by its
            ``event_key`` (the HDO's ``_cpu_optimizer_map_data_event``, shared).
        plan: what the first step allocates and pins.
    """

    def __init__(self, d2h_stream, h2d_stream, data_events: Dict[Any, Any], plan: RingPlan):
        self.d2h_stream, self.h2d_stream = d2h_stream, h2d_stream
        self.data_events = data_events
        self.plan = plan
        # The host staging slots (raw bytes), allocated by the first step.
        self.slots: List[torch.Tensor] = []
        # Two device buffers of the largest packed bucket: gradients gather in the first (on
        # the D2H stream), stepped blocks land in the second (on the H2D stream).
        self.device_staging: List[torch.Tensor] = []
        # H2D event of each slot that a pageable copy is going up through (in a step).
        self.slot_uploads: Dict[int, Any] = {}
        # The event each slot records its staged uploads with, made once.
        self.slot_upload_events: Dict[int, Any] = {}
        # The stream current on the side streams' device when the step began, to come back to
        # from them (None outside a step, or where the caller's current device is another).
        self.step_stream = None

    def allocate_slots(self) -> bool:
        """Allocate the slots (pinned as planned) unless they exist or none are planned;
        whether they were allocated now."""
        plan = self.plan
        if self.slots or not plan.slots:
            return False
        if not plan.packed_slots:
            self.slots = [
                torch.empty(nbytes, dtype=torch.uint8, pin_memory=plan.pin_slots)
                for nbytes in plan.slot_bytes
            ]
            return True
        block, places = pack_slots(plan.slot_bytes)
        blocks = [
            torch.empty(block, dtype=torch.uint8, pin_memory=plan.pin_slots)
            for _ in range(1 + max(index for index, _ in places))
        ]
        self.slots = [
            blocks[index][offset : offset + nbytes]
            for (index, offset), nbytes in zip(places, plan.slot_bytes)
        ]
        return True

    def allocate_device_staging(self, nbytes: int, device: torch.device):
        """Make the two device staging buffers, of ``nbytes`` each: each stream reuses its
        own in order, so one of each serves every packed bucket."""
        self.device_staging = [
            torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)
        ]

    def down(self):
        """Queue on the D2H stream (nothing on a host without CUDA)."""
        return on_stream(self.d2h_stream, self.step_stream)

    def up(self):
        """Queue on the H2D stream (nothing on a host without CUDA)."""
        return on_stream(self.h2d_stream, self.step_stream)

    def wait_for_slot(self, slot: int):
        """On the D2H stream: wait for a copy still going up through ``slot``, if any."""
        staged_upload = self.slot_uploads.pop(slot, None)
        if staged_upload is not None:
            self.d2h_stream.wait_event(staged_upload)

    def note_landing(self, key: Any, event: Optional[Any]) -> Optional[Any]:
        """Record ``event`` (made the first time) on the D2H stream for the bucket keyed
        ``key``, whose host step waits for it; returns the event (None without CUDA)."""
        if self.d2h_stream is None:
            return event
        event = recorded(event, self.d2h_stream)
        self.data_events[key] = event
        return event

    def wait_for_landing(self, key: Any):
        """Wait on the host for the download of the bucket keyed ``key``, if one is queued."""
        event = self.data_events.pop(key, None)
        if event is not None:
            event.synchronize()

    def order_after_downloads(self):
        """Make the stream current on the copies' device wait for the downloads queued so
        far, on the device: a step that returns before its host part is done leaves nothing
        the caller queues next (zeroing or freeing the gradients) to race them."""
        if self.d2h_stream is not None:
            torch.cuda.current_stream(self.d2h_stream.device).wait_stream(self.d2h_stream)

    def note_slot_upload(self, slot: int):
        """Keep the event of an upload that went through ``slot``, for the download that
        reuses the slot (:meth:`wait_for_slot`)."""
        event = recorded(self.slot_upload_events.get(slot), self.h2d_stream)
        self.slot_upload_events[slot] = self.slot_uploads[slot] = event

    def begin_step(self):
        """Make the copy streams wait for the stream current on their device, whose gradients
        and parameters they move, whichever device is current, and keep that stream for the
        copies to switch back to, where it is also the current device's."""
        self.step_stream = None
        if self.d2h_stream is None:
            return
        device = self.d2h_stream.device
        current = torch.cuda.current_stream(device)
        for stream in (self.d2h_stream, self.h2d_stream):
            stream.wait_stream(current)
        # Switching streams also makes their device current; coming back to ``current`` would
        # then leave the caller on another device than it was.
        same = torch.cuda.current_device() == device.index and self.h2d_stream.device == device
        self.step_stream = current if same else None

    def end_step(self):
        """Wait for the uploads, which read the host copies until they finish: even after a
        failed step, nothing on the host (a checkpoint load, the next step) may write a copy
        still being read."""
        if self.h2d_stream is not None:
            self.h2d_stream.synchronize()
        self.slot_uploads.clear()
        self.step_stream = None
