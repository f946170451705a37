# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Large host copies stepped and moved in parts, each part a bucket of the step's pipeline.

A parameter larger than a bucket has a host sub-optimizer of its own, and as one bucket it
costs the pipeline twice: its gradient slot sets the size of a ring slot (so fewer host copies
fit in the pinned budget and more go up from pageable memory), and nothing overlaps its step,
its upload and, for the last bucket, the end of the step. Cut into parts of a fixed size, each
part comes down into a slot of its own, is stepped as soon as it has landed and goes up at
once, like any other bucket.

Adam is elementwise, so a part is stepped by torch's fused kernel over slices of the copy, its
gradient and its moments, with the copy's one step counter counted once per step. The kernel
runs a vector loop and a scalar loop over the last partial vector of each tensor, which may
round differently, so part bounds are multiples of :data:`PART_ALIGN_BYTES`: every element then
gets the operations the whole-tensor call gives it. Where that kernel is not the sub-optimizer's
step (hooks, a gradient scaler, settings the fused kernel does not take, state it did not
create), the parts' gradients are gathered into one pageable buffer and the sub-optimizer steps
the whole copy once the last part has landed; the parts then go up together. A copy moved in
parts has no whole gradient view in a slot: it has no ``cpu_copy_map_grad`` entry, and its
``grad`` is None outside such a gathered step.
"""

from typing import Any, List, Optional, Tuple

import torch

from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_kernels import (
    adam_kernel,
    fused_kernel_settings,
    hooked,
    scaled,
    share_memory,
)
from megatron.core.optimizer.inner_optimizer_state import MOMENT_NAMES

# Part sizes and bounds are multiples of this many bytes (a multiple of any vector width).
PART_ALIGN_BYTES = 64 << 10


def copy_part_bytes(part_bytes: int, bucket_cap: Optional[int] = None) -> int:
    """The size of the parts a copy larger than it moves in: ``part_bytes`` (0: every copy
    whole), or a sized ``bucket_cap`` where that is smaller and a multiple of
    ``PART_ALIGN_BYTES``, so that no copy makes a bucket larger than the others."""
    if part_bytes and bucket_cap and bucket_cap % PART_ALIGN_BYTES == 0:
        return min(part_bytes, bucket_cap)
    return part_bytes


def part_ranges(numel: int, element_size: int, part_bytes: int) -> List[Tuple[int, int]]:
    """``(start, stop)`` element ranges that cut ``numel`` elements into parts of
    ``part_bytes`` (the last one shorter)."""
    size = part_bytes // element_size
    return [(start, min(start + size, numel)) for start in range(0, numel, size)]


def _part_settings(optimizer: torch.optim.Optimizer, host: torch.Tensor) -> Optional[dict]:
    """The fused kernel's arguments where ``host``, the only parameter of ``optimizer``, may be
    stepped in parts (torch's own fused Adam or AdamW over one dense floating-point host
    tensor), else None."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return None
    groups = optimizer.param_groups
    if len(groups) != 1 or len(groups[0]["params"]) != 1 or groups[0]["params"][0] is not host:
        return None
    if not host.is_floating_point() or host.is_complex() or not host.is_contiguous():
        return None
    return fused_kernel_settings(groups[0])


def can_part(optimizer: torch.optim.Optimizer, host: torch.Tensor) -> bool:
    """Whether ``host``, the only parameter of ``optimizer``, may be stepped in parts."""
    return _part_settings(optimizer, host) is not None


class PartedCopy:
    """The step of one host copy that moves in parts.

    Each step's first part decides how the copy is stepped (:meth:`begin`); each part then
    hands its landed gradient to :meth:`step_part`, which says which parts may go up.

    Args:
        optimizer: the copy's sub-optimizer (:func:`can_part` it).
        entry: the copy's state entry.
        ranges: the parts' element ranges, in order.
    """

    def __init__(self, optimizer, entry, ranges: List[Tuple[int, int]]):
        self.optimizer = optimizer
        self.entry = entry
        self.ranges = ranges
        self.buckets: List[Any] = []  # the pipeline's bucket of each part, set by the HDO
        self._settings: Optional[dict] = None  # this step's kernel arguments; None: gather
        self._gathered: Optional[torch.Tensor] = None

    @property
    def host(self) -> torch.Tensor:
        """The host copy (looked up each time: pinning or a client may swap its ``.data``)."""
        return self.optimizer.param_groups[0]["params"][0]

    @torch.no_grad()
    def begin(self):
        """Choose this step's way: the fused kernel part by part (counting the step now), or
        the sub-optimizer's own step over the gathered gradient."""
        self._settings = self._kernel_settings()
        self._gathered = None
        if self._settings is None:
            self._gathered = torch.empty(self.host.numel(), dtype=self.host.dtype)
            return
        if not self.entry:
            self._create_state()
        self.entry["step"].add_(1)

    @torch.no_grad()
    def step_part(self, index: int, grad: torch.Tensor) -> List[int]:
        """Step part ``index`` with its landed gradient ``grad`` (1-D, the part's elements).

        Returns:
            The parts that may go up now: this one, or every part once the last has landed
            (while gathering), or none.
        """
        start, stop = self.ranges[index]
        if self._gathered is not None:
            self._gathered[start:stop].copy_(grad)
            if index + 1 < len(self.ranges):
                return []
            host = self.host
            host.grad = self._gathered.view_as(host)
            try:
                self.optimizer.step()
            finally:
                host.grad = None
                self._gathered = None
            return list(range(len(self.ranges)))
        settings = dict(self._settings)
        kernel = adam_kernel(settings)
        moments = [self.entry[key].view(-1)[start:stop] for key in MOMENT_NAMES]
        kernel(
            [self.host.view(-1)[start:stop]],
            [grad],
            [moments[0]],
            [moments[1]],
            [],
            [self.entry["step"]],
            **settings,
        )
        return [index]

    def _kernel_settings(self) -> Optional[dict]:
        """The fused kernel's arguments for this step, or None where its step is not that
        kernel over the entry's state as it is."""
        optimizer = self.optimizer
        if hooked(optimizer) or scaled(optimizer):
            return None
        if self.entry and not self._stepped_as_created():
            return None
        return _part_settings(optimizer, self.host)

    def _stepped_as_created(self) -> bool:
        """Whether the entry holds what torch's fused step creates and uses: a host fp32
        counter of its own and dense host moments in the copy's dtype and size."""
        host = self.host
        step = self.entry.get("step")
        if not isinstance(step, torch.Tensor) or step.dim() != 0 or step.device.type != "cpu":
            return False
        if step.dtype != torch.float32:
            return False
        moments = [self.entry.get(key) for key in MOMENT_NAMES]
        for value in moments:
            if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
                return False
            if value.dtype != host.dtype or value.numel() != host.numel():
                return False
            if not value.is_contiguous():
                return False
        # No two of them may share memory: the kernel would step it twice.
        return not share_memory((step, *moments, host))

    def _create_state(self):
        """The state torch's fused Adam creates on its first step: a zero host fp32 counter
        and zero moments shaped like the copy."""
        host = self.host
        self.entry["step"] = torch.zeros((), dtype=torch.float32)
        for key in MOMENT_NAMES:
            self.entry[key] = torch.zeros_like(host, memory_format=torch.preserve_format)
