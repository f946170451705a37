# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""One fused AdamW call per host bucket instead of the sub-optimizer's step.

Torch's fused host Adam visits the tensors of its list one by one, each in a parallel region
of its own, and gathers them in Python first; with thousands of small shards (a GPT or MoE
model under the distributed optimizer) that per-tensor cost is a large part of the step. A
packed bucket's host copies are already views into one block laid out as their gradients are
staged (:meth:`~.hybrid_optimizer_buckets.PackedCopies.pack`); once their moments are laid out
alike, a run of adjacent copies is one tensor for the kernel, and the bucket is one call. A
bucket of one copy (a parameter larger than the bucket cap) is stepped the same way over the
copy itself: the kernel call alone, without the sub-optimizer's Python around it (gathering
the state, grouping by device and dtype, counting the step in a call of its own).

Every element gets the operations the per-copy step gives it. The kernel runs a vector loop
over each tensor and a scalar loop over its last partial vector, and the two may round
differently (fused multiply-add), so a run only continues past a copy that fills whole
64-byte lines: a copy of another size ends its run, and its partial vector stays last.

The step counters are one vector per bucket, so that one add counts the step and one compare
finds a counter that went its own way (which its run could not share). Counters and moments
stay the entries' own tensors, so what clients read, hold or assign is the state.
Where they are not laid out (a first step that falls back creates them one by one; a load,
``dummy_step`` or a client may put other tensors there), :meth:`FlatAdamStep.lay_out` copies
them into a block and re-points each tensor there with ``.data``; the entries' tensors are the
blocks' only owners. What re-pointing cannot carry along: a view a client took of a moment
before it was laid out still shows the old memory, and one moment saved or deep-copied alone
takes its whole block along (a whole state dict takes each block once). Whatever the kernel's
single call cannot reproduce (a copy without a gradient, counters that differ, moments that
share memory, step hooks, amsgrad, ``foreach``, a learning rate on an accelerator, another
class than torch's own Adam or AdamW) is left to the sub-optimizer's own step.
"""

import operator
from itertools import repeat
from typing import List, Optional, Tuple

import torch

from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_kernels import (
    adam_kernel,
    fused_kernel_settings,
    hooked,
    scaled,
    share_memory,
    tensor_marks,
    typed_view,
)
from megatron.core.optimizer.inner_optimizer_state import MOMENT_NAMES

# Bytes of one cache line: the kernel's unit of work and, at most, its vector width.
_LINE_BYTES = 64


def flat_runs(layout: List[Tuple[int, int]]) -> List[Tuple[int, int, int]]:
    """Runs of copies stepped as one tensor each.

    Args:
        layout: ``(byte offset, byte size)`` of each copy in its block, in order; offsets are
            multiples of ``_LINE_BYTES``.

    Returns:
        ``(first copy, start byte, end byte)`` per run: a run goes on while the copy before
        fills whole lines and the next one starts where it ends.
    """
    runs: List[List[int]] = []
    extends = False  # whether the next copy may join the last run
    for index, (offset, nbytes) in enumerate(layout):
        if extends and runs[-1][2] == offset:
            runs[-1][2] = offset + nbytes
        else:
            runs.append([index, offset, offset + nbytes])
        extends = offset % _LINE_BYTES == 0 and nbytes % _LINE_BYTES == 0
    return [(first, start, end) for first, start, end in runs]


def suits(optimizer: torch.optim.Optimizer, hosts: List[torch.Tensor]) -> bool:
    """Whether a bucket of these host copies can be stepped flat by ``optimizer``: torch's
    own fused Adam or AdamW over exactly these copies, all of one floating-point dtype."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    if len(optimizer.param_groups) != 1 or not hosts:
        return False
    params = optimizer.param_groups[0]["params"]
    if len(params) != len(hosts) or not all(map(operator.is_, params, hosts)):
        return False
    dtypes = {host.dtype for host in hosts}
    return len(dtypes) == 1 and hosts[0].is_floating_point() and not hosts[0].is_complex()


class FlatAdamStep:
    """Steps a host bucket's runs of copies in one fused Adam call.

    A bucket of one copy is stepped over the copy and its state tensors as they are: nothing
    is laid out or re-pointed, and the copy is the kernel's tensor itself, so a ``.data`` a
    client assigns to it is what the next call steps (and no old memory is held here).

    Args:
        optimizer: the bucket's sub-optimizer (:func:`suits` it).
        entries: the state entry of each host copy, in the bucket's order.
        layout: ``(byte offset, byte size)`` of each copy in the bucket's blocks.
        master: the block the host copies are views into; None for a bucket of one copy.
        grads: the ring slot their gradients are staged in (raw bytes).
    """

    def __init__(self, optimizer, entries, layout, master, grads: torch.Tensor):
        self.optimizer = optimizer
        self.entries = entries
        self._one = master is None
        self._offsets = [offset for offset, _ in layout]
        self._nbytes = layout[-1][0] + layout[-1][1]
        self._runs = flat_runs(layout)
        ends = [first for first, _, _ in self._runs[1:]] + [len(layout)]
        # A run of one copy is stepped as the copy's own tensors, in its shape.
        self._single = [end - first == 1 for (first, _, _), end in zip(self._runs, ends)]
        hosts = optimizer.param_groups[0]["params"]
        self._params, self._grads = [], []
        for (first, start, end), single in zip(self._runs, self._single):
            for views, raw in ((self._params, master), (self._grads, grads)):
                if raw is None:
                    views.append(hosts[first])
                elif single:
                    views.append(typed_view(raw, start, hosts[first]))
                else:
                    views.append(raw[start:end].view(hosts[first].dtype))
        self._numels = [p.numel() for p in self._params]
        self._seen: Optional[tuple] = None  # the state as the last flat step left it

    # ------------------------------------------------------------------ stepping

    def applies(self) -> bool:
        """Whether the sub-optimizer's settings make its step one fused kernel call, with no
        hook or gradient scaler to see it."""
        if fused_kernel_settings(self.optimizer.param_groups[0]) is None:
            return False
        return not hooked(self.optimizer) and not scaled(self.optimizer)

    @torch.no_grad()
    def step(self) -> bool:
        """Step the bucket flat, if its state allows; False (nothing done) if not, and the
        sub-optimizer must step it. Every copy must have its slot view as its gradient."""
        group = self.optimizer.param_groups[0]
        settings = fused_kernel_settings(group)
        if settings is None or hooked(self.optimizer) or scaled(self.optimizer):
            return False
        counters, moments = self._state()
        if not any(self.entries):
            counters, moments = self.create_state()
        seen = _look(counters, moments)
        if seen is None or (seen != self._seen and not self._laid_out(counters, moments)):
            self._seen = None
            return False
        # One counter serves its whole run, so all must agree. Their values are read on every
        # step: a write through ``.data`` or a collective leaves no trace on the tensors.
        steps = counters[0].as_strided((len(counters),), (1,))
        if len(counters) > 1 and not bool((steps == steps[0]).all()):
            self._seen = None
            return False
        steps.add_(1)
        adam_kernel(settings)(
            self._params,
            self._grads,
            *(self._run_views(values) for values in moments),
            [],
            [counters[first] for first, _, _ in self._runs],
            **settings,
        )
        self._seen = seen
        return True

    def _state(self):
        """Each entry's counter and moments, as lists (None where one is missing)."""
        counters = list(map(dict.get, self.entries, repeat("step")))
        moments = [list(map(dict.get, self.entries, repeat(key))) for key in MOMENT_NAMES]
        return counters, moments

    def create_state(self):
        """Give every copy the state torch's fused Adam creates on its first step (a zero
        host counter in fp32, zero moments), laid out: the counters in one vector, the
        moments in one block per key.

        Returns:
            The counters and moments, as the step reads them.
        """
        hosts = self.optimizer.param_groups[0]["params"]
        steps = torch.zeros(len(self.entries), dtype=torch.float32)
        blocks = [torch.zeros(self._nbytes, dtype=torch.uint8) for _ in MOMENT_NAMES]
        for index, (entry, host, offset) in enumerate(zip(self.entries, hosts, self._offsets)):
            entry["step"] = steps[index]
            for key, block in zip(MOMENT_NAMES, blocks):
                entry[key] = typed_view(block, offset, host)
        return self._state()

    def _run_views(self, values: List[torch.Tensor]) -> List[torch.Tensor]:
        """One tensor per run over laid-out ``values``: a run of one copy is its own tensor;
        a longer one is seen from its first copy's tensor on, as long as the run (the copies
        after it lie there, as :meth:`_laid_out` checked)."""
        return [
            values[first] if single else values[first].as_strided((numel,), (1,))
            for (first, _, _), numel, single in zip(self._runs, self._numels, self._single)
        ]

    # ------------------------------------------------------------------ layout

    def _laid_out(self, counters, moments) -> bool:
        """Whether the state can be stepped flat as it is: the counters one vector in the
        copies' order, each moment key's tensors laid out like the copies in one storage."""
        if not _movable_counters(counters) or not self._movable(moments):
            return False
        if self._one:  # its own tensors, wherever they lie
            return True
        if not _in_one_block(counters, *_counter_layout(counters)):
            return False
        return all(_in_one_block(values, self._offsets, self._nbytes) for values in moments)

    def _movable(self, moments) -> bool:
        """Whether every moment is a dense host tensor of its copy's dtype and size, and no two
        share memory (the sub-optimizer would step shared memory once per entry, and laying
        them out would part them)."""
        hosts = self.optimizer.param_groups[0]["params"]
        if not all(_fits(value, host) for values in moments for value, host in zip(values, hosts)):
            return False
        return not share_memory(value for values in moments for value in values)

    @torch.no_grad()
    def lay_out(self):
        """Move counters and moments that are not laid out into a new vector or block each,
        where the state is one the flat step could take (after the sub-optimizer's own step,
        a load, a client)."""
        counters, moments = self._state()
        if self._one or _look(counters, moments) is None:
            return
        if not _movable_counters(counters) or not self._movable(moments):
            return
        layouts = [(counters, *_counter_layout(counters))]
        layouts += [(values, self._offsets, self._nbytes) for values in moments]
        for values, offsets, nbytes in layouts:
            if _in_one_block(values, offsets, nbytes):
                continue
            block = torch.empty(nbytes, dtype=torch.uint8)
            views = [typed_view(block, offset, value) for value, offset in zip(values, offsets)]
            torch._foreach_copy_(views, values)  # pylint: disable=protected-access
            for value, view in zip(values, views):
                value.data = view


def _fits(value, host: torch.Tensor) -> bool:
    """Whether ``value`` is a dense host tensor of ``host``'s dtype and size."""
    return (
        isinstance(value, torch.Tensor)
        and value.device.type == "cpu"
        and value.dtype == host.dtype
        and value.numel() == host.numel()
        and value.is_contiguous()
    )


def _look(counters, moments) -> Optional[tuple]:
    """What tells the next step that the layout is as this one left it: which tensors the
    entries hold and where their memory is (a ``.data`` swap moves it). Numbers only, so it
    keeps no tensor alive; None where a value is missing or no tensor."""
    tensors = counters + [value for values in moments for value in values]
    try:
        return tensor_marks(tensors)
    except TypeError:  # data_ptr of something else
        return None


def _movable_counters(counters) -> bool:
    """Whether the counters are host scalars of one floating dtype, each its own memory."""
    if not all(
        isinstance(c, torch.Tensor) and c.dim() == 0 and c.device.type == "cpu" for c in counters
    ):
        return False
    if len({c.dtype for c in counters}) != 1 or not counters[0].is_floating_point():
        return False
    return len(set(map(torch.Tensor.data_ptr, counters))) == len(counters)


def _counter_layout(counters) -> Tuple[List[int], int]:
    """Byte offsets of the counters in one vector, in the copies' order, and its bytes."""
    size = counters[0].element_size()
    return [index * size for index in range(len(counters))], len(counters) * size


def _in_one_block(values: List[torch.Tensor], offsets: List[int], nbytes: int) -> bool:
    """Whether ``values`` lie in one storage of at least ``nbytes`` at ``offsets``."""
    storage = values[0].untyped_storage()
    base = storage.data_ptr()
    if values[0].data_ptr() - base != offsets[0] or storage.nbytes() < nbytes:
        return False
    return all(
        value.untyped_storage().data_ptr() == base and value.data_ptr() - base == offset
        for value, offset in zip(values, offsets)
    )
