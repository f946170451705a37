# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""torch's own fused Adam and AdamW in place, without their walk over the parameters.

Where TE is not installed, Megatron's factory hands the HDO torch's fused AdamW for the fp32
clones stepped in place. Its step gathers every parameter's gradient and state in Python before
one kernel call per group, which with thousands of shards holds the calling thread for tens of
milliseconds while the host buckets wait. The HDO makes the calls that step would make
instead (:class:`FusedListStep`).

The kernel is elementwise, reading each tensor's own counter, so a run of clones that lie back
to back, with their moments laid out alike and counters of one value, can be handed to it as
one tensor with the first one's counter. The state is made as torch's first step would make it
(a zero fp32 counter per clone, zero moments) but with the moments in one block per run
(:func:`~hybrid_optimizer_kernels.create_laid_out_state`); moments made otherwise (by
torch's own step, a load, a client) are moved into such blocks once, re-pointed with ``.data``
so that the entries keep their tensors (:func:`~hybrid_optimizer_kernels.lay_out_moments`).
The counters stay one per parameter, every one of them stepped; made here, each group's are the
scalars of one vector, which one add steps and one copy reads. Their values are read every
step, and runs are cut where they differ, so a clone that missed a step, or whose counter a
client wrote, keeps its own count. Counters that share memory leave the step to torch.
"""

import inspect
import operator
from itertools import repeat
from typing import List, Optional, Set, Tuple

import torch
from torch._utils import _unflatten_dense_tensors

from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_kernels import (
    PLAIN_TENSORS,
    RunLayout,
    adam_kernel,
    create_laid_out_state,
    fused_kernel_settings,
    hooked,
    lay_out_moments,
    scaled,
    share_memory,
    state_entries,
    tensor_marks,
)
from megatron.core.optimizer.inner_optimizer_state import MOMENT_NAMES

# torch's own Adam classes, whose fused step is one kernel call over each group's lists.
FUSED_TORCH_CLASSES = (torch.optim.Adam, torch.optim.AdamW)

_DTYPE = operator.attrgetter("dtype")

# The body of their step, under the wrappers torch puts around it.
_TORCH_ADAM_STEP = inspect.unwrap(torch.optim.Adam.step)

# fp32 elements of one 64-byte line, the widest vector the host kernel uses.
_LINE_NUMEL = 16

# A run as the kernel takes it: (index of its first parameter, how many, elements, where its
# gradients start in the buffer).
KernelRun = Tuple[int, int, int, int]


def _torch_own_step(cls: type) -> bool:
    """Whether ``cls.step`` is torch's own: its hook-running wrapper (made when the first
    instance is) over the grad-mode wrapper over Adam's step, nothing patched in between."""
    step = cls.step
    if getattr(step, "hooked", False):
        step = getattr(step, "__wrapped__", None)
    return getattr(step, "__wrapped__", None) is _TORCH_ADAM_STEP


def _cut(runs: List[KernelRun], numels: List[int], ends: List[bool]) -> List[KernelRun]:
    """``runs`` cut after every tensor ``i`` where ``ends[i]``."""
    pieces = []
    for first, count, _, offset in runs:
        start = first
        for index in range(first, first + count):
            if ends[index] or index == first + count - 1:
                numel = sum(numels[start : index + 1])
                pieces.append((start, index + 1 - start, numel, offset))
                offset += numel
                start = index + 1
    return pieces


def _one_vector(counters: List[torch.Tensor]) -> bool:
    """Whether ``counters`` are consecutive fp32 scalars of one storage, in order (and at
    least two)."""
    if len(counters) < 2:
        return False
    first = counters[0]
    storage = first.untyped_storage()
    if first.data_ptr() + 4 * len(counters) > storage.data_ptr() + storage.nbytes():
        return False
    for index, counter in enumerate(counters):
        if counter.untyped_storage().data_ptr() != storage.data_ptr():
            return False
        if counter.data_ptr() != first.data_ptr() + 4 * index:
            return False
    return True


def _run_view(values: List[torch.Tensor], run: KernelRun) -> torch.Tensor:
    """The run's first value itself, or one flat view from it over the run."""
    first, count, numel, _ = run
    return values[first] if count == 1 else values[first].as_strided((numel,), (1,))


class _GroupPlan:
    """Where one group's tensors lie: its gradients' span in the buffer, and its runs where the
    moments lie like the clones (None where they do not: the kernel then takes each tensor)."""

    def __init__(self, params: List[torch.Tensor], counters, moments, start: int, base: int):
        self.span = (start, start + sum(map(torch.Tensor.numel, params)))
        # Whether the counters are one vector's scalars in order, as the state is made. The
        # view over them is cut each step from the first counter, not kept: held here, it
        # would keep their memory after a client moved or dropped the state.
        self.counters_in_vector = _one_vector(counters)
        layout = RunLayout(params)
        self.numels = layout.numels
        self.layout_runs: Optional[List[KernelRun]] = None
        if layout.dense and all(map(layout.holds, moments)):
            runs = [
                (first, count, numel, (params[first].data_ptr() - base) // 4)
                for first, count, numel in layout.runs
            ]
            # A tensor's last partial vector may be rounded otherwise than the vectors before
            # it (the host kernel's scalar loop), so a run ends after a tensor that does not
            # fill whole 64-byte lines, where that vector stays last.
            self.layout_runs = _cut(runs, self.numels, [n % _LINE_NUMEL != 0 for n in self.numels])
        self.runs = self.layout_runs  # cut further where the counters differ

    def counter_vector(self, counters: List[torch.Tensor]) -> Optional[torch.Tensor]:
        """One view over the group's counters where they lie as one vector, else None."""
        if not self.counters_in_vector:
            return None
        return counters[0].as_strided((len(counters),), (1,))

    def kernel_lists(self, buffer: torch.Tensor, params, counters, avgs, sqs):
        """The kernel's tensor lists for this group: per run, or per tensor."""
        if self.runs is None:
            grads = _unflatten_dense_tensors(buffer[slice(*self.span)], params)
            return params, grads, avgs, sqs, counters
        grads = []
        for run in self.runs:
            first, count, numel, offset = run
            grad = buffer[offset : offset + numel]
            grads.append(grad if count > 1 else grad.view_as(params[first]))
        return (
            [_run_view(params, run) for run in self.runs],
            grads,
            [_run_view(avgs, run) for run in self.runs],
            [_run_view(sqs, run) for run in self.runs],
            [counters[run[0]] for run in self.runs],
        )


class FusedListStep:
    """Steps torch's fused Adam or AdamW in place by its kernel, over runs of adjacent clones.

    The HDO makes the calls torch's fused step would make: each counter stepped, then one
    kernel call per group over its runs (each parameter's own tensors where its moments do not
    lie like the clones), with the gradients cut from the HDO's widened buffer instead of set
    on each parameter: the same kernel over the same elements, so the same bits. Where no group
    has state yet, it is made first (:meth:`create_state`). A group with part of its state,
    amsgrad, hooks, a step set on the instance or patched on the class, a scaler, capturable or
    foreach modes, a tensor learning rate, a stream being captured and state on another device
    or of another dtype leave the step to the optimizer, after which the moments are laid out.

    Args:
        optimizer: the HDO's in-place optimizer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._seen: Optional[tuple] = None  # the tensors and addresses the last step checked
        self._checked: Optional[tuple] = None  # and those the last lay-out left
        self._plans: List[_GroupPlan] = []

    def applies(self) -> bool:
        """Whether the optimizer is torch's fused Adam or AdamW in the mode whose step is one
        kernel call per group with a float learning rate, its step torch's own (none set on the
        instance or patched on the class), and nothing watches that step."""
        return self._settings() is not None

    def _settings(self) -> Optional[List[dict]]:
        """Each group's kernel arguments where :meth:`applies`, else None."""
        optimizer = self.optimizer
        if type(optimizer) not in FUSED_TORCH_CLASSES or "step" in vars(optimizer):
            return None
        if not _torch_own_step(type(optimizer)) or hooked(optimizer) or scaled(optimizer):
            return None
        settings = list(map(fused_kernel_settings, optimizer.param_groups))
        if any(s is None or isinstance(s["lr"], torch.Tensor) for s in settings):
            return None
        return settings

    def _groups(self):
        """Per group: its parameters, and their counters and moments (None where missing)."""
        entries_of = state_entries(self.optimizer.state)
        groups = []
        for group in self.optimizer.param_groups:
            entries = entries_of(group["params"])
            state = [list(map(dict.get, entries, repeat(key))) for key in ("step",) + MOMENT_NAMES]
            groups.append((group["params"], *state))
        return groups

    @torch.no_grad()
    def step(self, grads: Optional[Tuple[torch.Tensor, int]] = None) -> bool:
        """Make the optimizer's kernel calls, if its mode and state allow; False (nothing done)
        if not, and the optimizer must step itself.

        Args:
            grads: the gradients of all parameters in one fp32 buffer laid out as the
                parameters' memory is from address ``base``: ``(buffer, base)``. Without it
                nothing is done (each parameter's ``grad`` is torch's own step to read).
        """
        settings = None if grads is None else self._settings()
        if settings is None:
            return False
        buffer, base = grads
        if buffer.is_cuda and torch.cuda.is_current_stream_capturing():
            return False  # torch's step refuses to be captured in this mode: let it say so
        groups = self._groups()
        tensors = _flat(groups)  # group by group, so a parameter moved to another group tells
        seen = _marks(tensors)
        if seen is None and self.create_state():  # a first step: torch would create it now
            groups = self._groups()
            tensors = _flat(groups)
            seen = _marks(tensors)
        if seen is None:
            return False
        if seen != self._seen:
            if self.lay_out():  # moments torch or a load made one by one
                groups = self._groups()
                tensors = _flat(groups)
                seen = _marks(tensors)
            if not self._check(groups, buffer, base, seen):
                return False
        # A dtype can change under the same object and address (a ``.data`` view): read every
        # step, since the kernel would take such a counter or moment as fp32.
        if set(map(_DTYPE, tensors)) != {torch.float32}:
            self._seen = None
            return False
        self._cut_runs([group_counters for _, group_counters, _, _ in groups])
        # Every gradient is cut before any counter moves, as torch gathers them before its calls.
        calls = [plan.kernel_lists(buffer, *group) for plan, group in zip(self._plans, groups)]
        optimizer = self.optimizer
        # The profiler's range and hook point of torch's own step, so that traces read alike.
        with torch.autograd.profiler.record_function(
            f"Optimizer.step#{type(optimizer).__name__}.step"
        ):
            for (_, group_counters, _, _), plan, lists, kwargs in zip(
                groups, self._plans, calls, settings
            ):
                kernel = adam_kernel(kwargs)
                vector = plan.counter_vector(group_counters)
                if vector is not None:
                    vector.add_(1)  # the same fp32 add as torch's, in one kernel
                else:
                    torch._foreach_add_(group_counters, 1)  # pylint: disable=protected-access
                params, grads_of, avgs, sqs, steps = lists
                kernel(params, grads_of, avgs, sqs, [], steps, **kwargs)
            optimizer._optimizer_step_code()  # pylint: disable=protected-access
        return True

    def _check(self, groups, buffer: torch.Tensor, base: int, seen: tuple) -> bool:
        """Whether torch's step would make exactly these calls: every tensor a plain fp32 one
        on the buffer's device, parameters dense and back to back from ``base`` as the buffer
        is laid out, moments of their parameters' shapes, counters scalars; remembers each
        group's plan, and ``seen`` as checked, if so."""
        self._seen = None
        device, plans, at = buffer.device, [], base
        for params, counters, avgs, sqs in groups:
            start = (at - base) // 4
            for param in params:
                if param.data_ptr() != at or not param.is_contiguous():
                    return False
                at += param.nbytes
            tensors = params + counters + avgs + sqs
            if not all(type(t) in PLAIN_TENSORS for t in tensors):
                return False
            if {(t.device, t.dtype) for t in tensors} != {(device, torch.float32)}:
                return False
            if any(counter.dim() for counter in counters):
                return False
            if share_memory(counters):  # one shared counter is stepped once per parameter
                return False
            shapes = [param.shape for param in params]
            if [avg.shape for avg in avgs] != shapes or [sq.shape for sq in sqs] != shapes:
                return False
            plans.append(_GroupPlan(params, counters, (avgs, sqs), start, base))
        if buffer.dtype != torch.float32 or (at - base) // 4 > buffer.numel():
            return False
        self._plans, self._seen = plans, seen
        return True

    def _cut_runs(self, counters: List[List[torch.Tensor]]):
        """Cut each group's runs where its counters differ, reading them all at once where any
        run is longer than one. They are read every step (on an accelerator, one wait for its
        stream): a write through ``.data`` or a collective into a counter leaves no trace on
        the tensor that would tell when to read them."""
        plans = [plan for plan in self._plans if plan.layout_runs is not None]
        if not any(count > 1 for plan in plans for _, count, _, _ in plan.layout_runs):
            return
        vectors = [plan.counter_vector(group) for plan, group in zip(self._plans, counters)]
        if all(vector is not None for vector in vectors):
            counts = torch.cat(vectors).tolist() if len(vectors) > 1 else vectors[0].tolist()
        else:
            counts = torch.stack([counter for group in counters for counter in group]).tolist()
        start = 0
        for plan in self._plans:
            values = counts[start : start + len(plan.numels)]
            start += len(plan.numels)
            if plan.layout_runs is not None:
                ends = [a != b for a, b in zip(values, values[1:])] + [True]
                plan.runs = _cut(plan.layout_runs, plan.numels, ends)

    @torch.no_grad()
    def lay_out(self) -> bool:
        """Lay the moments out one block per run (:func:`lay_out_moments`) where the kernel
        step applies, unless they are as a step or the last lay-out left them.

        Returns:
            Whether any moment was moved.
        """
        if self._settings() is None:
            return False
        seen = self._moment_marks()
        if seen is None or seen == self._checked:
            return False
        groups = [(params, [avgs, sqs]) for params, _, avgs, sqs in self._groups()]
        moved = lay_out_moments(self.optimizer.state, groups)
        if moved:
            self._seen = None
        self._checked = self._moment_marks()
        return moved

    def _moment_marks(self) -> Optional[tuple]:
        """The marks of every parameter and moment, group by group; None where one is
        missing."""
        return _marks([t for params, _, avgs, sqs in self._groups() for t in params + avgs + sqs])

    def create_state(self, only: Optional[Set[int]] = None) -> bool:
        """Give each group whose parameters have no state yet the state torch's fused step
        creates on its first step (a zero fp32 counter per parameter, zero moments), with the
        moments laid out one block per run, so that no step or lay-out moves them and none is
        held twice. Where the kernel step does not apply, or a group has any state, torch's
        step creates it (:func:`create_laid_out_state`, which says which groups).

        Returns:
            Whether any state was created.
        """
        if self._settings() is None:
            return False
        return create_laid_out_state(self.optimizer, only, counters=True)


def _marks(tensors: List[torch.Tensor]) -> Optional[tuple]:
    """:func:`tensor_marks` of ``tensors``; None where one is missing or no tensor."""
    try:
        return tensor_marks(tensors)
    except TypeError:
        return None


def _flat(groups) -> List[torch.Tensor]:
    """Every tensor of the groups, group by group: parameters, counters, moments."""
    return [t for tensors in groups for values in tensors for t in values]
