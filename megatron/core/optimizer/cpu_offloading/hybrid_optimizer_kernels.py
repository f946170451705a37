# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""What the fused-kernel step variants of the HybridDeviceOptimizer share.

Three variants replace a sub-optimizer's own step by the calls it would make, without its
walk over the parameters: torch's fused Adam or AdamW over a host bucket's blocks
(:mod:`hybrid_optimizer_flat_step`), Transformer Engine's FusedAdam over runs of adjacent
tensors in place (:mod:`hybrid_optimizer_flat_in_place`) and torch's fused Adam or AdamW by its
kernel over runs in place (:mod:`hybrid_optimizer_fused_list`); a large host copy stepped in
parts (:mod:`hybrid_optimizer_parts`) calls the same kernel. They are peers over this module:
the protocol they follow (:class:`FusedStep`), the names of the moments, the checks that tell
whether a step is the one kernel call (settings, hooks, a scaler, shared memory), and the
layout of runs of adjacent tensors with their moments laid out alike.
"""

from itertools import repeat
from typing import Any, Callable, List, Optional, Protocol, Sequence, Set, Tuple

import torch
from torch._utils import _unflatten_dense_tensors
from torch.optim import optimizer as _torch_optimizer

from megatron.core.optimizer.inner_optimizer_state import MOMENT_NAMES

# Tensor types whose memory runs are taken of (subclasses such as DTensor are left to TE).
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)

# A run of parameters: (index of its first in the group, how many, elements in all).
Run = Tuple[int, int, int]

# Most elements of a run (256 MiB of fp32): laying a run's moments out allocates a block of its
# size before the moments it replaces are freed, so this bounds what a step after a client moved
# the state holds on top of it; a few more tensors cost TE nothing.
RUN_NUMEL = 64 << 20


class FusedStep(Protocol):
    """A step that makes a sub-optimizer's fused-kernel calls itself.

    Each variant is built over one sub-optimizer and may decline: ``step`` returns False,
    having done nothing, whenever the optimizer's mode or state is not one its kernel call
    reproduces bit for bit, and the sub-optimizer then steps itself; ``lay_out`` afterwards
    moves the state it created into the layout the next fused step takes.
    """

    optimizer: torch.optim.Optimizer

    def applies(self) -> bool:
        """Whether the optimizer's class and mode are ones this step reproduces."""

    def lay_out(self) -> Any:
        """Move state made elsewhere (the optimizer's own step, a load, a client) into the
        layout this step takes."""

    def create_state(self, *args: Any) -> Any:
        """Create the state the optimizer's first step would, already laid out."""

    def step(self, *args: Any) -> bool:
        """Step with the fused kernel; False (nothing done) where the optimizer must."""


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s elements."""
    return tensor.numel() * tensor.element_size()


def typed_view(raw: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The bytes of ``raw`` from ``offset`` on, seen as a tensor of ``like``'s dtype and shape."""
    return raw[offset : offset + tensor_nbytes(like)].view(like.dtype).view(like.shape)


def grad_of(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The gradient Megatron left for ``param`` (precision-aware mode uses ``decoupled_grad``)."""
    grad = getattr(param, "decoupled_grad", None)
    return param.grad if grad is None else grad


def fused_kernel_settings(group) -> Optional[dict]:
    """The arguments of torch's fused Adam kernel for ``group`` (``decoupled`` tells AdamW's
    from Adam's), or None where its step is not that one call: not fused, amsgrad, a learning
    rate on an accelerator, tensor betas."""
    decoupled = group.get("decoupled_weight_decay")
    if not group.get("fused") or group.get("amsgrad") or group.get("differentiable"):
        return None
    if group.get("foreach"):  # torch refuses it beside fused (or a tensor lr): let it say so
        return None
    if decoupled is None or group.get("capturable"):
        return None
    lr, (beta1, beta2) = group["lr"], group["betas"]
    if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
        return None
    if isinstance(beta1, torch.Tensor) or isinstance(beta2, torch.Tensor):
        return None
    return dict(
        decoupled=decoupled,
        amsgrad=False,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group.get("maximize", False),
        grad_scale=None,
        found_inf=None,
    )


def adam_kernel(settings: dict) -> Callable[..., Any]:
    """torch's fused AdamW or Adam kernel, as ``settings`` (from :func:`fused_kernel_settings`)
    ask, taking ``decoupled`` out of them so that the rest are the kernel's arguments."""
    decoupled = settings.pop("decoupled")
    return (
        torch._fused_adamw_ if decoupled else torch._fused_adam_
    )  # pylint: disable=protected-access


def scaled(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a gradient scaler left ``optimizer`` a scale or an inf flag for its step."""
    return getattr(optimizer, "grad_scale", None) is not None or (
        getattr(optimizer, "found_inf", None) is not None
    )


def hooked(optimizer: torch.optim.Optimizer) -> bool:
    """Whether step hooks would see ``optimizer``'s step (its own, or every optimizer's)."""
    # pylint: disable=protected-access
    own = optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
    every = _torch_optimizer._global_optimizer_pre_hooks
    return bool(own or every or _torch_optimizer._global_optimizer_post_hooks)


def share_memory(values) -> bool:
    """Whether any two of the tensors among ``values`` share memory (on one device); other
    values and empty tensors are passed over."""
    spans = sorted(
        (value.device.type, value.device.index, value.data_ptr(), value.data_ptr() + value.nbytes)
        for value in values
        if isinstance(value, torch.Tensor) and value.nbytes
    )
    return any(a[:2] == b[:2] and b[2] < a[3] for a, b in zip(spans, spans[1:]))


def tensor_marks(tensors: List[torch.Tensor]) -> Tuple[tuple, tuple]:
    """Which tensors these are and where their memory is, as numbers (nothing kept alive).

    A tensor is named by ``object.__hash__``, which no other live object shares, rather than
    by ``id``: ``id`` raises an audit event, and where an audit hook is installed (filelock,
    which torch and megatron import, installs one) each call runs that hook in Python, several
    times the cost, on thousands of tensors a step.
    """
    return tuple(map(object.__hash__, tensors)), tuple(map(torch.Tensor.data_ptr, tensors))


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


class RunLayout:
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


def run_tensor(values, run: Run) -> torch.Tensor:
    """One tensor over a run: its first value itself, or a flat view from it over the run."""
    first, count, numel = run
    return values[first] if count == 1 else values[first].as_strided((numel,), (1,))


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
        moments = [[v for run in runs for v in _zero_moments(params, run)] for _ in MOMENT_NAMES]
        steps = _zero_counters(params) if counters else repeat(None)
        for param, values, step in zip(params, zip(*moments), steps):
            entry = optimizer.state[param]
            if counters:
                entry["step"] = step
            entry.update(zip(MOMENT_NAMES, values))
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
        groups: per group, its parameters and each moment's values, in ``MOMENT_NAMES`` order
            (None where a parameter has none, which leaves that moment as it is).

    Returns:
        Whether any moment was moved.
    """
    if share_memory(v for _, moments in groups for values in moments for v in values):
        return False
    moved = False
    for params, moments in groups:
        layout = RunLayout(params)
        for key, values in zip(MOMENT_NAMES, moments):
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
