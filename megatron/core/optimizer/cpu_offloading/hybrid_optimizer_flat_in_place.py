# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The in-place step without the in-place optimizer's walk over its parameters.

Transformer Engine's FusedAdam takes runs of adjacent tensors (below); torch's own fused Adam
and AdamW take them through their kernel (``hybrid_optimizer_fused_list``), with the moments
laid out the same way (:func:`lay_out_moments`).

TE's FusedAdam checks and gathers each parameter in Python (its state, its gradient, its
dtype, DTensor parity) before one multi-tensor kernel; with thousands of shards stepped in
place that walk takes tens of milliseconds of the calling thread, which the host buckets then
wait for. Its kernel is elementwise, so a run of parameters that lie back to back in one
storage, with their gradients and both moments laid out alike, can be handed to it as one
tensor: TE's own step, over a few runs instead of thousands of tensors.

The HDO lays out its fp32 clones back to back and widens their gradients into one buffer in
the same order. The moments are created laid out, one block per run, with the zeros TE would
create (:meth:`FlatInPlaceStep.create_state`: on the first step, by ``dummy_step``, or as a
load from the host into an optimizer without state fills them), so the first step takes runs
too and no block of moments is moved. Moments that lie otherwise (a client put others there one
by one, a load adopted them, TE's own step created them) are moved into one block per run by
the next step before it takes runs (:meth:`FlatInPlaceStep.lay_out`), re-pointed with
``.data``: they stay the entries' own tensors, so what clients read, hold or assign is the
state. Where the optimizer steps the clones alone, their gradients are concatenated into one
buffer laid out like the clones' block and handed over as runs, without a gradient tensor per
clone. Anything else (another class or mode, a step hook, a parameter without a gradient, a
counter per parameter) leaves the step to the optimizer itself, after which the moments are
laid out. As with the host blocks, one clone or moment saved or deep-copied
alone takes its whole block along (a whole state dict takes each block once), and a view a
client took of a moment before it was laid out still shows the old memory.
"""

from itertools import repeat
from typing import List, Optional, Set, Tuple

import torch

from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_kernels import (
    PLAIN_TENSORS,
    RunLayout,
    create_laid_out_state,
    hooked,
    lay_out_moments,
    run_tensor,
    state_entries,
    tensor_marks,
)
from megatron.core.optimizer.inner_optimizer_state import MOMENT_NAMES

# The optimizer classes the flat step drives, by module and name (no import of TE here):
# Transformer Engine's FusedAdam. A class belongs here only if its step is elementwise over each
# group with one counter per group in ``group["step"]`` and per-parameter ``exp_avg`` and
# ``exp_avg_sq`` as its only state, so that TE's step over a run equals it over the run's
# tensors.
FLAT_STEPPED_CLASSES = {("transformer_engine.pytorch.optimizers.fused_adam", "FusedAdam")}


def steps_flat(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is TE's FusedAdam (``FLAT_STEPPED_CLASSES``) in the mode whose step
    is one fp32 kernel per group: no CUDA graphs, no master weights, fp32 moments, gradients in
    ``grad``, no hooks."""
    cls = type(optimizer)
    if (cls.__module__, cls.__qualname__) not in FLAT_STEPPED_CLASSES or "step" in vars(optimizer):
        return False
    modes = ("capturable", "master_weights", "use_decoupled_grad")
    if any(getattr(optimizer, mode, False) for mode in modes):
        return False
    dtypes = getattr(optimizer, "name_to_dtype_map", {})
    if any(dtypes.get(key, torch.float32) != torch.float32 for key in MOMENT_NAMES):
        return False
    return not hooked(optimizer)


class FlatInPlaceStep:
    """Steps TE FusedAdam's groups over runs of adjacent parameters with TE's own step.

    Args:
        optimizer: the HDO's in-place optimizer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._layouts: List[RunLayout] = []
        self._seen: Optional[tuple] = None  # the tensors and addresses the last flat step saw
        self._checked: Optional[tuple] = None  # and those the last lay-out left

    def applies(self) -> bool:
        """Whether the optimizer's mode lets its step take runs (:func:`steps_flat`)."""
        return steps_flat(self.optimizer)

    def _entries(self):
        """The state entry of every parameter ({} where it has none)."""
        entries = state_entries(self.optimizer.state)
        return [
            entry for group in self.optimizer.param_groups for entry in entries(group["params"])
        ]

    def _groups(self, with_grads: bool = True):
        """Per group: its parameters, their gradients (or None) and each moment's values."""
        entries_of = state_entries(self.optimizer.state)
        groups = []
        for group in self.optimizer.param_groups:
            params = group["params"]
            entries = entries_of(params)
            moments = [list(map(dict.get, entries, repeat(key))) for key in MOMENT_NAMES]
            grads = [param.grad for param in params] if with_grads else None
            groups.append((params, grads, moments))
        return groups

    @torch.no_grad()
    def step(self, grads: Optional[Tuple[torch.Tensor, int]] = None) -> bool:
        """Run the optimizer's step over runs, if its mode and state allow; False (nothing
        done) if not, and the optimizer must step itself.

        Args:
            grads: the gradients of all parameters in one fp32 buffer laid out as the
                parameters' memory is from address ``base``: ``(buffer, base)``; each
                parameter's ``grad`` is then not read. None reads each ``grad``.
        """
        if not steps_flat(self.optimizer):
            return False
        groups = self._groups(with_grads=grads is None)
        if grads is None and any(g is None for _, group_grads, _ in groups for g in group_grads):
            return False  # a parameter without a gradient: TE skips it, a run could not
        seen = _look(groups)
        if seen is None and self.create_state():  # a first step: TE would create them now
            groups = self._groups(with_grads=grads is None)
            seen = _look(groups)
        if seen is None:
            return False
        if seen != self._seen and not self._check(groups, seen):
            # Moments put back one by one (a client's ``.cuda()`` per tensor): laid out first,
            # which moves them as TE's own step and a lay-out after it would, minus TE's walk.
            if not self.lay_out():
                return False
            groups = self._groups(with_grads=grads is None)
            seen = _look(groups)
            if seen is None or not self._check(groups, seen):
                return False
        if grads is None:
            # Gradients are new tensors every step: checked every step.
            if not all(layout.holds(g) for (_, g, _), layout in zip(groups, self._layouts)):
                return False
            run_grads = [
                [run_tensor(g, run) for run in layout.runs]
                for (_, g, _), layout in zip(groups, self._layouts)
            ]
        else:
            run_grads = self._grads_from_buffer(*grads)
            if run_grads is None:
                return False
        self._step_runs(groups, run_grads)
        return True

    def _check(self, groups, seen: tuple) -> bool:
        """Whether the moments lie like their runs of parameters, with the group's counter
        alone; remembers the layouts, and ``seen`` as checked, if so."""
        self._seen = None
        if any("step" in entry for entry in self._entries()):
            return False  # a counter per parameter: not the group's, which the runs share
        self._layouts = [RunLayout(params) for params, _, _ in groups]
        if not all(
            layout.holds(values)
            for (_, _, moments), layout in zip(groups, self._layouts)
            for values in moments
        ):
            return False
        self._seen = seen
        return True

    def _grads_from_buffer(self, buffer: torch.Tensor, base: int):
        """Each run's gradient as a slice of ``buffer`` (laid out like the parameters from
        address ``base``), or None where a run is not dense or falls outside it."""
        if buffer.dtype != torch.float32 or not buffer.is_contiguous():
            return None
        run_grads = []
        for layout in self._layouts:
            if not layout.dense:
                return None
            slices = []
            for (_, _, numel), start in zip(layout.runs, layout.starts):
                offset, rest = divmod(start - base, 4)
                if rest or offset < 0 or offset + numel > buffer.numel():
                    return None
                slices.append(buffer[offset : offset + numel])
            run_grads.append(slices)
        return run_grads

    def _step_runs(self, groups, run_grads):
        """TE's step on a stand-in optimizer that shares every setting of the real one but
        holds, per group, one tensor per run (with its gradient and moments)."""
        optimizer = self.optimizer
        stand_in = object.__new__(type(optimizer))
        vars(stand_in).update(vars(optimizer))
        stand_in.state = {}
        stand_in.param_groups = []
        for group, (params, _, moments), layout, grads in zip(
            optimizer.param_groups, groups, self._layouts, run_grads
        ):
            tensors = []
            for run, grad in zip(layout.runs, grads):
                tensor = run_tensor(params, run)
                if tensor is params[run[0]]:  # a run of one: a view, whose grad is its own
                    tensor = tensor.view_as(tensor)
                tensor.grad = grad.view_as(tensor)
                stand_in.state[tensor] = {
                    key: run_tensor(values, run) for key, values in zip(MOMENT_NAMES, moments)
                }
                tensors.append(tensor)
            stand_in.param_groups.append({**group, "params": tensors})
        type(optimizer).step(stand_in)
        for group, stepped in zip(optimizer.param_groups, stand_in.param_groups):
            group["step"] = stepped["step"]

    @torch.no_grad()
    def create_state(self, only: Optional[Set[int]] = None) -> bool:
        """Give each group whose parameters have no state yet the zero fp32 moments TE creates
        on a first step, laid out: one block per run of adjacent parameters, each parameter's
        moments views into it, so that no step or lay-out has to move them later. Groups with
        any state, an empty or non-plain tensor, or a parameter whose ``id`` is not in ``only``
        (where given) are left to TE.

        Returns:
            Whether any state was created.
        """
        if not steps_flat(self.optimizer):
            return False
        return create_laid_out_state(self.optimizer, only)

    @torch.no_grad()
    def lay_out(self) -> bool:
        """Lay the moments out one block per run (:func:`lay_out_moments`), unless they are as
        a flat step or the last lay-out left them.

        Returns:
            Whether any moment was moved.
        """
        if not steps_flat(self.optimizer):
            return False
        groups = self._groups(with_grads=False)
        seen = _look(groups)
        if seen is None or seen in (self._seen, self._checked):
            return False  # as a flat step or the last lay-out left it
        moved = lay_out_moments(self.optimizer.state, [(p, m) for p, _, m in groups])
        if moved:
            self._seen = None
        self._checked = _look(self._groups(with_grads=False))
        return moved


def _look(groups) -> Optional[tuple]:
    """Which tensors the groups hold, how many each, and where their memory is, as numbers
    (nothing kept alive); None where a moment is missing or a tensor is not a plain one (a
    DTensor's memory is not its own to take runs of)."""
    tensors, sizes = [], []
    for params, _, moments in groups:
        sizes.append(len(params))
        tensors += params
        for values in moments:
            tensors += values
    if not all(type(tensor) in PLAIN_TENSORS for tensor in tensors):
        return None
    return (tuple(sizes), *tensor_marks(tensors))
