# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The per-parameter state a HybridDeviceOptimizer shares with its sub-optimizers.

Each parameter ``p`` has exactly one state dict, a :class:`ParamState`: it is at once
``hdo.state[p]`` and ``sub_optimizer.state[inner]``, where ``inner`` is the tensor the
sub-optimizer steps for ``p`` (a host copy, an fp32 clone or ``p`` itself). Whatever a client
reads, moves or reassigns there is what the next step uses.

Every state tensor has a *home*: the device of its inner tensor (the host for offloaded
state), the dtype the sub-optimizer keeps it in, and the inner tensor's shape. A tensor
assigned into an entry is put there at once, with one exception: accelerator-resident state
assigned from the host stays on the host, since that is how clients free accelerator memory
between training phases; the next step (or ``_move_new_state_to_right_device``) takes it home.
The ``master_param`` entry, where the optimizer keeps one, always is the inner tensor itself: a
value assigned to it is copied into that tensor.
"""

from collections import defaultdict
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from megatron.core.optimizer.inner_optimizer_state import MASTER


def home_of(
    inner: torch.Tensor, optimizer: torch.optim.Optimizer, key: str, value: torch.Tensor
) -> Tuple[torch.device, torch.dtype]:
    """The device and dtype that ``optimizer`` keeps state ``key`` of ``inner`` in.

    The step counter lives where torch's optimizers create it (beside the parameter when the
    group is fused or capturable, on the host otherwise); floating-point state takes the dtype
    the optimizer declares for it (TE FusedAdam's ``exp_avg_dtype``, ...) or the inner tensor's.
    """
    if key == "step":
        group = optimizer.param_groups[0] if optimizer.param_groups else {}
        if group.get("fused") or group.get("capturable"):
            return inner.device, torch.float32
        return torch.device("cpu"), value.dtype
    if not value.is_floating_point():
        return inner.device, value.dtype
    declared = getattr(optimizer, f"{key}_dtype", None)
    return inner.device, declared if isinstance(declared, torch.dtype) else inner.dtype


@torch.no_grad()
def placed(
    inner: torch.Tensor, optimizer: torch.optim.Optimizer, key: str, value: torch.Tensor
) -> torch.Tensor:
    """``value`` at its home: moved and cast as needed, in ``inner``'s shape when it holds one
    value per element. Returns ``value`` itself when it is already there."""
    device, dtype = home_of(inner, optimizer, key, value)
    value = value.to(device=device, dtype=dtype)
    if key != "step" and value.shape != inner.shape and value.numel() == inner.numel() > 1:
        value = value.reshape(inner.shape)
    return value


def plan_step_counts(
    planned: Dict[torch.Tensor, Dict[str, Any]],
    saved_groups: List[Dict[str, Any]],
    param_groups: List[Dict[str, Any]],
    counter_of: Callable[[torch.Tensor], Optional[str]],
    name: str,
) -> Tuple[Dict[torch.Tensor, Dict[str, Any]], Dict[int, Optional[int]]]:
    """Each loaded step count where the optimizer stepping its parameter reads it, for a
    checkpoint saved by one that kept it elsewhere, changing nothing.

    torch's Adam family counts steps in each parameter's state, TE and Apex FusedAdam in the
    param group; a checkpoint saved with one in place and loaded with the other (TE installed
    on one side only, say) holds the count only where the saving optimizer kept it. Without
    it, torch's step raises ``KeyError: 'step'`` and FusedAdam restarts its bias correction.
    A count the loading optimizer does not read is dropped, since nothing would advance it and
    a later load would take it for the live one.

    Args:
        planned: parameter -> its checked checkpoint entry.
        saved_groups: the checkpoint's param groups (parameter ids as saved).
        param_groups: the optimizer's groups, paired in order with ``saved_groups``.
        counter_of: where the optimizer stepping a parameter reads its count: ``"param"``,
            ``"group"``, or None (another optimizer: its entries and group are left as saved).
        name: what is loading, for the messages.

    Returns:
        ``planned`` with a ``step`` (the saved group's) in every entry with state that a
        per-parameter counter steps and that holds none, and no ``step`` in the entries a
        per-group counter steps; and, per group index, the group's step where it changes: the
        largest of its parameters' saved counts for a group a per-group counter steps whose
        checkpoint holds none (how many steps that counter would have made), or None (drop
        it) for a group only per-parameter counters step.

    Raises:
        KeyError: for an entry a per-parameter counter steps that holds state but no step,
            in a group whose checkpoint holds none either, naming the parameter's id.
    """
    filled, group_steps = dict(planned), {}
    for index, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        saved_step = saved.get("step")
        counters = [counter_of(param) for param in group["params"]]
        counts = []
        for param_id, param, counter in zip(saved["params"], group["params"], counters):
            values = planned.get(param, {})
            stepped = any(key not in (MASTER, "step") for key in values)
            if counter == "group" and "step" in values:
                if stepped:
                    counts.append(values["step"])
                filled[param] = {key: value for key, value in values.items() if key != "step"}
            elif counter == "param" and stepped and "step" not in values:
                if saved_step is None:
                    raise KeyError(
                        f"{name}: parameter {param_id!r} has state but no 'step', and its "
                        f"param group {index} holds no step either, so its step count is lost"
                    )
                step = torch.tensor(float(saved_step), dtype=torch.float32)
                filled[param] = {**values, "step": step}
        if "group" in counters and saved_step is None and counts:
            group_steps[index] = max(int(float(count)) for count in counts)
        elif counters and set(counters) == {"param"} and saved_step is not None:
            group_steps[index] = None
    return filled, group_steps


class StateChanges:
    """What assignments into the entries left for the optimizer to finish.

    Attributes:
        created: entries that were empty when something was assigned into them (the
            sub-optimizer's first step, a load); the optimizer lists them in its ``state``.
        parked: entries holding accelerator state on the host, keyed by ``id``.
    """

    __slots__ = ("created", "parked")

    def __init__(self):
        self.created: List["ParamState"] = []
        self.parked: Dict[int, "ParamState"] = {}


class ParamState(dict):
    """The state dict of one parameter, shared by the optimizer and its sub-optimizer.

    Args:
        param: the public parameter (the key in the optimizer's ``state``).
        inner: the tensor the sub-optimizer steps (its key there).
        optimizer: the sub-optimizer.
        keeps_master: the entry shows ``inner`` as its ``master_param``.
        changes: where assignments are recorded for the optimizer.
    """

    __slots__ = ("param", "inner", "optimizer", "keeps_master", "_changes")

    def __init__(self, param, inner, optimizer, keeps_master: bool, changes: StateChanges):
        super().__init__()
        self.param = param
        self.inner = inner
        self.optimizer = optimizer
        self.keeps_master = keeps_master
        self._changes = changes

    def __setitem__(self, key: str, value: Any):
        if not self:
            self._changes.created.append(self)
        if isinstance(value, torch.Tensor):
            value = self._assigned(key, value)
        super().__setitem__(key, value)

    def update(self, *args, **kwargs):  # pylint: disable=arguments-differ
        """As ``dict.update``, each value placed as an assignment would place it."""
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: str, default: Any = None) -> Any:
        """As ``dict.setdefault``, the default placed as an assignment would place it."""
        if key not in self:
            self[key] = default
        return self[key]

    def __reduce__(self):
        # Copies and pickles are plain dicts: a checkpoint names no class of this module.
        return (dict, (dict(self),))

    @torch.no_grad()
    def _assigned(self, key: str, value: torch.Tensor) -> torch.Tensor:
        """The tensor this entry keeps for ``value`` assigned under ``key``."""
        inner = self.inner
        if key == MASTER and self.keeps_master:
            if value is not inner:
                inner.copy_(value.reshape(inner.shape))
            return inner
        if value.device.type == "cpu" and inner.device.type != "cpu":
            if home_of(inner, self.optimizer, key, value)[0].type != "cpu":
                self._changes.parked[id(self)] = self
                return value
        return placed(inner, self.optimizer, key, value)

    def settle(self):
        """Put every tensor of the entry at its home (``master_param`` back on ``inner``)."""
        for key, value in list(self.items()):
            if not isinstance(value, torch.Tensor):
                continue
            if key == MASTER and self.keeps_master:
                kept = self._assigned(key, value)
            else:
                kept = placed(self.inner, self.optimizer, key, value)
            if kept is not value:
                dict.__setitem__(self, key, kept)

    def refill(self, values: Mapping[str, Any]):
        """Replace the entry's contents with ``values``, placed as assignments are."""
        values = dict(values)
        dict.clear(self)
        self.update(values)


class StateMap(defaultdict):
    """The optimizer's ``state``: each parameter of its groups maps to its one shared entry.

    An entry is listed once it is looked up or holds state, as in torch's ``defaultdict``;
    assigning a whole dict refills the entry, and deleting it clears the entry, so the state
    that is stepped always is the state shown.

    Args:
        entry_of: the shared entry of a parameter (None for a key of no group).
    """

    def __init__(self, entry_of: Callable[[Any], Optional[ParamState]]):
        super().__init__(dict)
        self._entry_of = entry_of

    def __missing__(self, param):
        entry = self._entry_of(param)
        if entry is None:
            return super().__missing__(param)
        dict.__setitem__(self, param, entry)
        return entry

    def __setitem__(self, param, value):
        entry = self._entry_of(param)
        if entry is not None and value is not entry:
            entry.refill(value)
            value = entry
        super().__setitem__(param, value)

    def __delitem__(self, param):
        entry = dict.pop(self, param)
        if isinstance(entry, ParamState):
            dict.clear(entry)

    def pop(self, param, *default):  # pylint: disable=arguments-differ
        """As ``dict.pop``; a shared entry is cleared (its values are returned as a dict)."""
        if param not in self:
            return dict.pop(self, param, *default)
        entry = dict.pop(self, param)
        if isinstance(entry, ParamState):
            values = dict(entry)
            dict.clear(entry)
            return values
        return entry

    def clear(self):
        """Forget every parameter's state."""
        for entry in self.values():
            if isinstance(entry, ParamState):
                dict.clear(entry)
        super().clear()

    def update(self, *args, **kwargs):  # pylint: disable=arguments-differ
        """As ``dict.update``, each dict refilling its parameter's entry."""
        for param, value in dict(*args, **kwargs).items():
            self[param] = value

    def setdefault(self, param, default=None):
        """As ``dict.setdefault``; a parameter of the groups gets its shared entry."""
        if param in self or self._entry_of(param) is None:
            return super().setdefault(param, default)
        entry = self[param]
        if default:
            entry.refill(default)
        return entry

    def copy(self):
        """A plain ``defaultdict`` holding the same entries."""
        return defaultdict(dict, self)

    def __reduce__(self):
        return (defaultdict, (dict,), None, None, iter(self.items()))
