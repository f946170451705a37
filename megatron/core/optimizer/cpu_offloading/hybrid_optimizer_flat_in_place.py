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
from typing import Callable, List, Optional, Sequence, Set, Tuple

import torch
from torch._utils import _unflatten_dense_tensors

from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_flat_step import (
    _hooked,
    share_memory,
    tensor_marks,
)

_MOMENTS = ("exp_avg", "exp_avg_sq")

# Tensor types whose memory runs are taken of (subclasses such as DTensor are left to TE).
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)

# The optimizer classes the flat step drives, by module and name (no import of TE here):
# Transformer Engine's FusedAdam. A class belongs here only if its step is elementwise over each
# group with one counter per group in ``group["step"]`` and per-parameter ``exp_avg`` and
# ``exp_avg_sq`` as its only state, so that TE's step over a run equals it over the run's
# tensors.
FLAT_STEPPED_CLASSES = {("transformer_engine.pytorch.optimizers.fused_adam", "FusedAdam")}

# A run of parameters: (index of its first in the group, how many, elements in all).
Run = Tuple[int, int, int]

# Most elements of a run (256 MiB of fp32): laying a run's moments out allocates a block of its
# size before the moments it replaces are freed, so this bounds what a step after a client moved
# the state holds on top of it; a few more tensors cost TE nothing.
RUN_NUMEL = 64 << 20


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
    if any(dtypes.get(key, torch.float32) != torch.float32 for key in _MOMENTS):
        return False
    return not _hooked(optimizer)


def adjacent_runs(tensors: Sequence[torch.Tensor], most: Optional[int] = None) -> List[Run]:
    """Runs of consecutive dense fp32 tensors that lie back to back in the storage of the
    run's first, of at most ``most`` elements (default ``RUN_NUMEL``) unless one tensor alone is
    larger (a run of one is any tensor)."""
    most = RUN_NUMEL if most is None else most
    runs: List[List[int]] = []
    end, limit = None, 0
    for index, tensor in enumerate(tensors):
        dense = tensor.dtype == torch.float32 and tensor.is_contiguous()
        start = tensor.data_ptr()
        adjacent = runs and start == end and start + tensor.nbytes <= limit
        if dense and adjacent and runs[-1][2] + tensor.numel() <= most:
            runs[-1][1] += 1
            runs[-1][2] += tensor.numel()
        else:
            runs.append([index, 1, tensor.numel()])
            storage = tensor.untyped_storage()
            limit = storage.data_ptr() + storage.nbytes() if dense else 0
        end = start + tensor.nbytes if dense else None
    return [(first, count, numel) for first, count, numel in runs]


class _Layout:
    """Where a group's parameters lie: their runs, and each one's distance in bytes from its
    run's first and size, to which gradients and moments are compared."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.runs = adjacent_runs(params)
        self.numels = list(map(torch.Tensor.numel, params))
        # A run lies in one storage, so its first tensor's device is the whole run's.
        self.devices = [params[first].device for first, _, _ in self.runs]
        ptrs = list(map(torch.Tensor.data_ptr, params))
        self.firsts = [first for first, count, _ in self.runs for _ in range(count)]
        self.distances = [ptr - ptrs[first] for ptr, first in zip(ptrs, self.firsts)]
        # Where each run starts, and whether every run is one dense fp32 tensor (a run of one
        # may be any tensor).
        self.starts = [ptrs[first] for first, _, _ in self.runs]
        self.dense = all(
            params[first].dtype == torch.float32 and params[first].is_contiguous()
            for first, _, _ in self.runs
        )

    def holds(self, values) -> bool:
        """Whether ``values`` lie as the parameters do: dense fp32 tensors of their sizes on
        their devices, at the same distances from their run's first, inside that first one's
        storage."""
        try:
            ptrs = list(map(torch.Tensor.data_ptr, values))
        except TypeError:  # a value missing or no tensor
            return False
        if list(map(torch.Tensor.numel, values)) != self.numels:
            return False
        if [values[first].device for first, _, _ in self.runs] != self.devices:
            return False
        if any(value.dtype != torch.float32 for value in values):
            return False
        if not all(map(torch.Tensor.is_contiguous, values)):
            return False
        if [ptr - ptrs[first] for ptr, first in zip(ptrs, self.firsts)] != self.distances:
            return False
        for first, count, numel in self.runs:
            if count > 1:
                head = values[first]
                storage = head.untyped_storage()
                if head.data_ptr() + numel * 4 > storage.data_ptr() + storage.nbytes():
                    return False
        return True


def state_entries(state) -> Callable[[List[torch.Tensor]], List[dict]]:
    """A function from parameters to their entries in ``state`` ({} where one has none or an
    empty one), as ``state.get`` would find them.

    A lookup by tensor hashes it through ``id``, whose audit event runs every installed audit
    hook in Python (filelock, which torch and megatron import, installs one); keyed by
    ``object.__hash__`` instead, which names the same objects, thousands of lookups a step stay
    in C.
    """
    by_mark = dict(zip(map(object.__hash__, state), state.values()))

    def entries(params: List[torch.Tensor]) -> List[dict]:
        return [entry or {} for entry in map(by_mark.get, map(object.__hash__, params))]

    return entries


def _run_tensor(values, run: Run) -> torch.Tensor:
    """One tensor over a run: its first value itself, or a flat view from it over the run."""
    first, count, numel = run
    return values[first] if count == 1 else values[first].as_strided((numel,), (1,))


class FlatInPlaceStep:
    """Steps TE FusedAdam's groups over runs of adjacent parameters with TE's own step.

    Args:
        optimizer: the HDO's in-place optimizer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._layouts: List[_Layout] = []
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
            moments = [list(map(dict.get, entries, repeat(key))) for key in _MOMENTS]
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
                [_run_tensor(g, run) for run in layout.runs]
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
        self._layouts = [_Layout(params) for params, _, _ in groups]
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
                tensor = _run_tensor(params, run)
                if tensor is params[run[0]]:  # a run of one: a view, whose grad is its own
                    tensor = tensor.view_as(tensor)
                tensor.grad = grad.view_as(tensor)
                stand_in.state[tensor] = {
                    key: _run_tensor(values, run) for key, values in zip(_MOMENTS, moments)
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


@torch.no_grad()
def create_laid_out_state(
    optimizer: torch.optim.Optimizer, only: Optional[Set[int]] = None, counters: bool = False
) -> bool:
    """Give each group of ``optimizer`` whose parameters have no state yet zero fp32 moments,
    one block per run of adjacent parameters (each parameter's moments views into it), and with
    ``counters`` a zero fp32 counter per parameter on its device, as torch's fused Adam makes
    them. Groups with any state, an empty or non-plain tensor, or a parameter whose ``id`` is
    not in ``only`` (where given) are passed over, and so, with ``counters``, are groups of
    parameters other than fp32 (whose moments torch makes in their dtype).

    Returns:
        Whether any state was created.
    """
    created = False
    entries = state_entries(optimizer.state)
    for group in optimizer.param_groups:
        params = group["params"]
        if not params or any(entries(params)):
            continue
        if not all(type(p) in PLAIN_TENSORS and p.numel() > 0 for p in params):
            continue
        if counters and any(p.dtype != torch.float32 for p in params):
            continue
        if only is not None and not all(id(p) in only for p in params):
            continue
        runs = adjacent_runs(params)
        moments = [[v for run in runs for v in _zero_moments(params, run)] for _ in _MOMENTS]
        steps = _zero_counters(params) if counters else repeat(None)
        for param, values, step in zip(params, zip(*moments), steps):
            entry = optimizer.state[param]
            if counters:
                entry["step"] = step
            entry.update(zip(_MOMENTS, values))
        created = True
    return created


@torch.no_grad()
def lay_out_moments(state, groups) -> bool:
    """Put moments that do not lie like their run of parameters into one block per run on
    the parameters' device. Moments already there (the optimizer's own step, a load, a client's
    ``.to`` back) are moved and re-pointed with ``.data``; moments elsewhere (parked on the host
    by a client, to be taken home) are copied into the block, whose views replace them in the
    entries. A run of one is left as it is (taking it home is the entry's own business), and so
    is everything where two moments share memory (the optimizer steps them as shared; blocks
    would part them).

    Args:
        state: the optimizer's state, whose entries take the views of moments copied in.
        groups: per group, its parameters and each moment's values, in ``_MOMENTS`` order
            (None where a parameter has none, which leaves that moment as it is).

    Returns:
        Whether any moment was moved.
    """
    if share_memory(v for _, moments in groups for values in moments for v in values):
        return False
    moved = False
    for params, moments in groups:
        layout = _Layout(params)
        for key, values in zip(_MOMENTS, moments):
            if layout.holds(values) or not all(map(_fits, values, params)):
                continue
            for first, count, numel in layout.runs:
                if count == 1:
                    continue
                moved = True
                span = values[first : first + count]
                block = torch.empty(numel, dtype=torch.float32, device=params[first].device)
                views = _unflatten_dense_tensors(block, span)
                home = [value.device == block.device for value in span]
                if all(home):
                    torch._foreach_copy_(views, span)  # pylint: disable=protected-access
                else:
                    for view, value in zip(views, span):
                        view.copy_(value, non_blocking=True)  # from pinned: in stream order
                for param, value, view, at_home in zip(params[first:], span, views, home):
                    if at_home:
                        value.data = view
                    else:
                        state[param][key] = view
    return moved


def _zero_counters(params: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """A zero fp32 counter for each parameter on its device, as torch's fused Adam makes them:
    where the parameters share a device, the scalars of one vector, so that one add counts
    the step and one read gives every value."""
    devices = {param.device for param in params}
    if len(devices) != 1:
        return [torch.zeros((), dtype=torch.float32, device=param.device) for param in params]
    return list(torch.zeros(len(params), dtype=torch.float32, device=devices.pop()).unbind())


def _zero_moments(params: Sequence[torch.Tensor], run: Run) -> List[torch.Tensor]:
    """Zero fp32 moments for the parameters of ``run``: views into one block where the run is
    longer than one, else one tensor shaped like the parameter (as TE allocates it)."""
    first, count, numel = run
    if count == 1:
        return [torch.zeros_like(params[first], dtype=torch.float32)]
    block = torch.zeros(numel, dtype=torch.float32, device=params[first].device)
    return list(_unflatten_dense_tensors(block, params[first : first + count]))


def _fits(value, param: torch.Tensor) -> bool:
    """Whether ``value`` can be copied into a block beside ``param``'s run unchanged: an fp32
    tensor of its size (on any device)."""
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == torch.float32
        and value.numel() == param.numel()
    )


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
