# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Loads a Transformer Engine FusedAdam state dict without a second copy of the moments.

When a distributed checkpoint resumes, the distributed optimizer allocates the Adam moments of
its shard (a scaffold) and hands them to the inner optimizer's ``load_state_dict``. TE
FusedAdam's own loader lets torch cast every value to its parameter's dtype, then empties the
state of each parameter and copies every value into a freshly allocated tensor. For a while the
moments therefore exist twice.

:func:`load_fused_adam_state_dict` picks one of three paths (see :func:`plan_fused_adam_load`):

* ``"adopt"``: fp32 parameters and fp32 moments without master weights. The incoming tensors
  become the optimizer's state as they are: nothing is allocated and nothing is copied.
* ``"materialise"``: the precision-aware layouts (bf16 or fp16 moments, master weights, int16
  remainders of bf16 parameters). Every state tensor is created once: an incoming tensor that
  already has the dtype and device the optimizer keeps (and needs no scale) is used as it is,
  anything else is allocated once by the optimizer and set through its own ``set_scaled_state``.
* ``"fallback"``: the optimizer's own ``load_state_dict``, unchanged, for everything else.

Whatever the path, a load that raises leaves the optimizer's ``state``, ``param_groups`` and
``_scales`` as they were, and nothing about the optimizer instance is patched.

Which classes count as TE FusedAdam is decided by :func:`fused_adam_classes`. Tests register a
test double by monkeypatching that module-level function, for example
``monkeypatch.setattr(fused_adam_state_load, "fused_adam_classes", lambda: (MyDouble,))``;
every function of this module looks it up at call time.
"""

import dataclasses
import logging
from collections import defaultdict
from collections.abc import Mapping, MutableMapping
from copy import deepcopy
from itertools import chain
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from megatron.core.optimizer.inner_optimizer_state import (
    MASTER,
    MOMENT_NAMES,
    UNSCALED_STORE_DTYPES,
    keeps_param_remainders,
)

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed support
    DTensor = None

logger = logging.getLogger(__name__)

ADOPT = "adopt"
MATERIALISE = "materialise"
FALLBACK = "fallback"
KEEP = "keep"

# Attributes of TE FusedAdam that the adopt and materialise paths rely on.
REQUIRED_FEATURES = (
    "name_to_dtype_map",
    "master_weights",
    "set_scaled_state",
    "_initialize_state",
    "_scales",
)

# Dtypes FusedAdam may keep its state in, other than fp8 (which it keeps as uint8).
_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Parameter dtypes the adopt and materialise paths handle.
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """How a FusedAdam state dict is (or would be) loaded.

    Attributes:
        path: ``"adopt"``, ``"materialise"`` or ``"fallback"``.
        reason: Why that path was chosen, in words.
    """

    path: str
    reason: str


def fused_adam_classes() -> Tuple[type, ...]:
    """Returns the optimizer classes that are treated as Transformer Engine's FusedAdam.

    Tests that have no TE register a test double by monkeypatching this function on the module
    (every caller in this module looks it up at call time).

    Returns:
        tuple: ``(transformer_engine.pytorch.optimizers.FusedAdam,)`` when TE can be imported,
        otherwise an empty tuple, so that every load then takes the fallback path.
    """
    try:
        # pylint: disable=import-outside-toplevel
        from transformer_engine.pytorch.optimizers import FusedAdam
    except (ImportError, OSError, RuntimeError):
        return ()
    return (FusedAdam,)


def plan_fused_adam_load(
    optimizer: Any,
    state_dict: Any,
    *,
    precision_aware: bool = False,
    is_hybrid: bool = False,
    is_fsdp: bool = False,
    is_stub: bool = False,
) -> LoadPlan:
    """Decides how ``state_dict`` is to be loaded into ``optimizer``; changes nothing.

    Args:
        optimizer: The inner (torch) optimizer that would receive the state dict.
        state_dict: A torch optimizer state dict: ``{"state": ..., "param_groups": ...}``.
        precision_aware: The caller runs Megatron's precision-aware optimizer. Adoption is then
            ruled out; materialising is allowed.
        is_hybrid: The optimizer belongs to a HybridDeviceOptimizer (forces the fallback).
        is_fsdp: The caller is Megatron-FSDP (forces the fallback).
        is_stub: The caller is a stub optimizer without parameters (forces the fallback).

    Returns:
        LoadPlan: The path and the reason for it.

    Raises:
        ValueError: ``optimizer`` is an eligible FusedAdam and the state dict's parameter groups
            differ from the optimizer's in number or in size.
    """
    reason = _caller_fallback_reason(is_hybrid, is_fsdp, is_stub)
    if reason is None:
        reason = _optimizer_fallback_reason(optimizer)
    if reason is None:
        reason = _state_dict_fallback_reason(state_dict)
    if reason is not None:
        return LoadPlan(FALLBACK, reason)

    id_map = _pair_params(optimizer, state_dict["param_groups"])
    reason = _entries_fallback_reason(optimizer, state_dict["state"], id_map)
    if reason is not None:
        return LoadPlan(FALLBACK, reason)

    blocker = _adoption_blocker(optimizer, state_dict["state"], id_map, precision_aware)
    if blocker is None:
        return LoadPlan(ADOPT, "fp32 parameters and fp32 moments: incoming tensors become state")
    return LoadPlan(MATERIALISE, blocker)


def load_fused_adam_state_dict(
    optimizer: Any, state_dict: Any, *, release_incoming: bool = False, **flags: bool
) -> LoadPlan:
    """Loads ``state_dict`` into ``optimizer`` along the path :func:`plan_fused_adam_load` picks.

    * adopt: the parameter groups are updated from the saved ones as torch's base loader does
      (hyperparameters, ``"step"`` included, are taken from the state dict; the ``"params"``
      stay the optimizer's own), and each parameter's state becomes a new dict holding the very
      tensors of the state dict: no allocation, no copy, and no cast.
    * materialise: the groups are updated the same way; each state tensor is then either the
      incoming tensor itself (when it already has the stored dtype, the parameter's device and
      a dtype that takes no scale) or is allocated once by the optimizer's ``_initialize_state``
      and filled by its ``set_scaled_state``.
    * fallback: ``type(optimizer).load_state_dict(optimizer, state_dict)``.

    Memory: the materialise path holds at most one transient copy of one parameter's state.
    With ``release_incoming=True`` it also removes each parameter's entry from
    ``state_dict["state"]`` once that parameter is done, so incoming tensors that were not kept
    as state are freed as it goes, provided the caller holds no other reference to them or to
    the per-parameter dicts (drop such references before calling). Without it, the incoming
    tensors live as long as the caller keeps the state dict.

    Inputs are left as they are, except that ``release_incoming=True`` empties
    ``state_dict["state"]`` and lets fp16 scaling work in place on incoming fp32 tensors. If the
    load raises, the optimizer's ``state``, ``param_groups`` and ``_scales`` are put back to
    the same objects holding the same tensors as before, and the error propagates (entries that
    ``release_incoming`` already consumed are not put back into the state dict). Until the load
    has succeeded, the previous state tensors are therefore kept alive. After a load that
    replaced existing state tensors, the CUDA caching allocator is emptied once (only when CUDA
    is initialised).

    Args:
        optimizer: The inner (torch) optimizer, normally a TE FusedAdam.
        state_dict: A torch optimizer state dict: ``{"state": ..., "param_groups": ...}``.
        release_incoming: The caller hands the state dict's per-parameter entries over, so
            they may be dropped as soon as they are loaded (materialise path only).
        **flags: The caller's situation (``precision_aware``, ``is_hybrid``, ``is_fsdp``,
            ``is_stub``), as :func:`plan_fused_adam_load` takes them.

    Returns:
        LoadPlan: The path that was taken and why.

    Raises:
        ValueError: The parameter groups do not match (raised before anything changes).
        Exception: Whatever the load raised, after the optimizer has been restored.
    """
    plan = plan_fused_adam_load(optimizer, state_dict, **flags)
    _log_plan(optimizer, plan)

    snapshot = _Snapshot(optimizer)
    try:
        if plan.path == ADOPT:
            _adopt(optimizer, state_dict)
        elif plan.path == MATERIALISE:
            _materialise(optimizer, state_dict, release_incoming)
        else:
            type(optimizer).load_state_dict(optimizer, state_dict)
    except BaseException:
        snapshot.restore()
        raise
    replaced = snapshot.replaced_state_tensors()
    del snapshot
    if replaced and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return plan


def _caller_fallback_reason(is_hybrid: bool, is_fsdp: bool, is_stub: bool) -> Optional[str]:
    """Returns the fallback reason that the caller's flags force, if any."""
    if is_stub:
        return "stub optimizer: left to its own loader"
    if is_hybrid:
        return "HybridDeviceOptimizer: it loads its sub-optimizers itself"
    if is_fsdp:
        return "Megatron-FSDP: state is loaded by the wrapped optimizer's own loader"
    return None


def _matching_class(optimizer: Any) -> Optional[type]:
    """Returns the registered FusedAdam class ``optimizer`` is an instance of, if any."""
    for cls in fused_adam_classes():
        if isinstance(optimizer, cls):
            return cls
    return None


def _optimizer_fallback_reason(optimizer: Any) -> Optional[str]:
    """Returns why ``optimizer`` itself rules out the adopt and materialise paths, if it does."""
    cls = _matching_class(optimizer)
    if cls is None:
        return f"{type(optimizer).__name__} is not a Transformer Engine FusedAdam"
    missing = [name for name in REQUIRED_FEATURES if not hasattr(optimizer, name)]
    if missing:
        return f"FusedAdam lacks {', '.join(missing)}"
    if getattr(type(optimizer), "load_state_dict", None) is not cls.load_state_dict:
        return f"{type(optimizer).__name__} overrides FusedAdam.load_state_dict"
    if getattr(optimizer, "_optimizer_load_state_dict_pre_hooks", None) or getattr(
        optimizer, "_optimizer_load_state_dict_post_hooks", None
    ):
        return "load_state_dict hooks are registered on the optimizer"
    if not isinstance(optimizer.name_to_dtype_map, Mapping):
        return "FusedAdam.name_to_dtype_map is not a mapping"
    if not isinstance(optimizer._scales, dict):
        return "FusedAdam._scales is not a dict"
    return None


def _state_dict_fallback_reason(state_dict: Any) -> Optional[str]:
    """Returns why the state dict's outer structure rules out the fast paths, if it does."""
    if not isinstance(state_dict, Mapping):
        return "the state dict is not a mapping"
    if not isinstance(state_dict.get("state"), Mapping):
        return "the state dict has no 'state' mapping"
    groups = state_dict.get("param_groups")
    if not isinstance(groups, Sequence) or not all(
        isinstance(group, Mapping) and "params" in group for group in groups
    ):
        return "the state dict has no list of 'param_groups' with 'params'"
    return None


def _pair_params(optimizer: Any, saved_groups: Sequence[Mapping]) -> Dict[Any, torch.Tensor]:
    """Maps each saved parameter id to the optimizer's parameter, as torch's loader pairs them.

    Raises:
        ValueError: The groups differ in number or in size.
    """
    groups = optimizer.param_groups
    if len(groups) != len(saved_groups):
        raise ValueError(
            f"the state dict has {len(saved_groups)} parameter groups, "
            f"the optimizer has {len(groups)}"
        )
    for index, (group, saved) in enumerate(zip(groups, saved_groups)):
        if len(group["params"]) != len(saved["params"]):
            raise ValueError(
                f"parameter group {index} holds {len(saved['params'])} parameters in the state "
                f"dict and {len(group['params'])} in the optimizer"
            )
    return dict(
        zip(
            chain.from_iterable(saved["params"] for saved in saved_groups),
            chain.from_iterable(group["params"] for group in groups),
        )
    )


def _is_dtensor(tensor: Any) -> bool:
    """Tells whether ``tensor`` is a torch DTensor."""
    return DTensor is not None and isinstance(tensor, DTensor)


def _is_plain_tensor(tensor: Any) -> bool:
    """Tells whether ``tensor`` is a torch.Tensor or Parameter, not a tensor subclass."""
    return type(tensor) in (torch.Tensor, torch.nn.Parameter)


def _expected_names(optimizer: Any) -> frozenset:
    """Returns the state names a loaded FusedAdam parameter holds."""
    if optimizer.master_weights:
        return frozenset(MOMENT_NAMES + (MASTER,))
    return frozenset(MOMENT_NAMES)


def _stores_remainders(optimizer: Any, param: torch.Tensor, name: str) -> bool:
    """Tells whether ``name`` of ``param`` is kept as the int16 remainders of a bf16 param."""
    return name == MASTER and keeps_param_remainders(optimizer, param)


def _stored_dtype(optimizer: Any, param: torch.Tensor, name: str) -> torch.dtype:
    """Returns the dtype FusedAdam keeps state ``name`` of ``param`` in."""
    if _stores_remainders(optimizer, param, name):
        return torch.int16
    return optimizer.name_to_dtype_map[name]


def _entries_fallback_reason(
    optimizer: Any, incoming: Mapping, id_map: Mapping[Any, torch.Tensor]
) -> Optional[str]:
    """Returns why the parameters or the per-parameter state rule out the fast paths, if so."""
    expected = _expected_names(optimizer)
    for name in sorted(expected):
        dtype = optimizer.name_to_dtype_map.get(name)
        if dtype == torch.uint8:
            return f"{name} is kept in fp8 (uint8)"
        if dtype not in _STATE_DTYPES:
            return f"{name} is kept in unsupported dtype {dtype}"
    for param in id_map.values():
        if _is_dtensor(param):
            return "DTensor parameters"
        if not _is_plain_tensor(param):
            return f"parameters of tensor subclass {type(param).__name__}"
        if param.dtype not in _PARAM_DTYPES:
            return f"parameters of dtype {param.dtype}"

    tensors = []
    for key, entry in incoming.items():
        if key not in id_map:
            return f"state for {key!r}, which no parameter group lists"
        if not isinstance(entry, Mapping):
            return f"the state of parameter {key!r} is not a mapping"
        if entry and set(entry) != expected:
            return (
                f"unexpected state keys {sorted(map(str, entry))} for parameter {key!r} "
                f"(expected {sorted(expected)})"
            )
        param = id_map[key]
        for name, value in entry.items():
            reason = _value_fallback_reason(optimizer, param, key, name, value)
            if reason is not None:
                return reason
            tensors.append(value)
    if _incoming_overlaps(tensors, list(id_map.values())):
        return "incoming state tensors share memory with each other or with parameters"
    return None


def _value_fallback_reason(
    optimizer: Any, param: torch.Tensor, key: Any, name: str, value: Any
) -> Optional[str]:
    """Returns why one incoming state value rules out the fast paths, if it does."""
    where = f"{name} of parameter {key!r}"
    if _is_dtensor(value):
        return f"{where} is a DTensor"
    if type(value) is not torch.Tensor:
        return f"{where} is a {type(value).__name__}, not a plain tensor"
    if value.shape != param.shape:
        shapes = f"{tuple(value.shape)} against the parameter's {tuple(param.shape)}"
        return f"shape mismatch: {where} has shape {shapes}"
    if _stores_remainders(optimizer, param, name):
        if value.dtype != torch.int16:
            return f"{where} should hold int16 remainders, not {value.dtype}"
    elif not value.is_floating_point():
        return f"{where} has non-floating dtype {value.dtype}"
    return None


def _memory_span(tensor: torch.Tensor) -> Optional[Tuple[str, int, int, int]]:
    """Returns (device, storage address, first byte, end byte) of the memory ``tensor`` uses."""
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return None
    extent = 1 + sum(
        (size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride())
    )
    start = tensor.storage_offset() * tensor.element_size()
    return (
        str(tensor.device),
        tensor.untyped_storage().data_ptr(),
        start,
        start + extent * tensor.element_size(),
    )


def _incoming_overlaps(incoming: List[torch.Tensor], params: List[torch.Tensor]) -> bool:
    """Tells whether an incoming tensor overlaps another incoming tensor or a parameter."""
    spans = []
    for is_incoming, tensors in ((True, incoming), (False, params)):
        for tensor in tensors:
            span = _memory_span(tensor)
            if span is not None:
                spans.append((span, is_incoming))
    spans.sort(key=lambda item: item[0])
    active = []
    for span, is_incoming in spans:
        active = [
            (other, flag) for other, flag in active if other[:2] == span[:2] and other[3] > span[2]
        ]
        if any(is_incoming or flag for _, flag in active):
            return True
        active.append((span, is_incoming))
    return False


def _adoption_blocker(
    optimizer: Any, incoming: Mapping, id_map: Mapping[Any, torch.Tensor], precision_aware: bool
) -> Optional[str]:
    """Returns why the incoming tensors cannot simply become the state, or None if they can."""
    if precision_aware:
        return "precision-aware optimizer: state materialised once"
    for name in MOMENT_NAMES:
        dtype = optimizer.name_to_dtype_map[name]
        if dtype != torch.float32:
            return f"{name} is kept in {dtype}: state materialised once"
    if optimizer.master_weights:
        return "master weights: state materialised once"
    if getattr(optimizer, "store_param_remainders", False):
        return "param remainders: state materialised once"
    for param in id_map.values():
        if param.dtype != torch.float32:
            return f"{param.dtype} parameters: state materialised once"
        if not param.is_contiguous():
            return "non-contiguous parameters: state materialised once"
    for key, entry in incoming.items():
        param = id_map[key]
        for name, value in entry.items():
            if value.dtype != torch.float32:
                return f"{name} of parameter {key!r} arrives in {value.dtype}: materialised once"
            if value.device != param.device:
                return f"{name} of parameter {key!r} is on {value.device}, not {param.device}"
            if not value.is_contiguous():
                return f"{name} of parameter {key!r} is not contiguous: materialised once"
    return None


def load_param_groups_keeping_state(optimizer: Any, saved_groups: Sequence[Mapping]) -> LoadPlan:
    """Loads the saved parameter groups and keeps every state tensor the optimizer holds.

    For a load over state that is already allocated as the optimizer keeps it (the second pass
    of a dist-checkpoint load, whose values come from the parameter state next): reading that
    state back through ``optimizer.state_dict()`` to load it again would, for TE FusedAdam with
    precision-aware state, allocate an fp32 copy of every state tensor and then a new set in
    the stored dtypes. The groups are merged as :func:`load_fused_adam_state_dict` merges them
    (hyperparameters and ``"step"`` from the saved groups, ``"params"`` the optimizer's own);
    the caller has checked that they pair up. Logs on rank 0 like the other paths.

    Args:
        optimizer: The inner (torch) optimizer, with state for its parameters.
        saved_groups: The saved parameter groups, in the optimizer's group order.

    Returns:
        LoadPlan: The ``"keep"`` path.
    """
    plan = LoadPlan(KEEP, "state already allocated: parameter groups loaded, state tensors kept")
    _log_plan(optimizer, plan)
    optimizer.param_groups = _merged_param_groups(optimizer, saved_groups)
    return plan


def _merged_param_groups(optimizer: Any, saved_groups: Sequence[Mapping]) -> List[Dict]:
    """Builds the loaded parameter groups as torch's base loader does.

    Every hyperparameter (``"step"`` included) comes from a deep copy of the saved group; the
    ``"params"`` list, and ``"param_names"`` when the saved group has none, stay the optimizer's.
    """
    merged = []
    for group, saved in zip(optimizer.param_groups, deepcopy(list(saved_groups))):
        loaded = dict(saved)
        loaded["params"] = group["params"]
        if "param_names" in group and "param_names" not in loaded:
            loaded["param_names"] = group["param_names"]
        merged.append(loaded)
    return merged


def _adopt(optimizer: Any, state_dict: Mapping) -> None:
    """Makes the incoming tensors the optimizer's state, without copy or cast."""
    id_map = _pair_params(optimizer, state_dict["param_groups"])
    groups = _merged_param_groups(optimizer, state_dict["param_groups"])
    state = defaultdict(dict)
    for key, entry in state_dict["state"].items():
        state[id_map[key]] = {name: entry[name] for name in MOMENT_NAMES if name in entry}
    optimizer.state = state
    optimizer.param_groups = groups


def _materialise(optimizer: Any, state_dict: Mapping, release_incoming: bool) -> None:
    """Sets each state tensor once, reusing incoming tensors that already fit."""
    id_map = _pair_params(optimizer, state_dict["param_groups"])
    optimizer.param_groups = _merged_param_groups(optimizer, state_dict["param_groups"])
    optimizer.state = defaultdict(dict)
    incoming = state_dict["state"]
    release = release_incoming and isinstance(incoming, MutableMapping)
    for key in list(incoming):
        param = id_map[key]
        entry = incoming[key]
        optimizer.state[param] = {}
        for name in list(entry):
            _set_one_state(optimizer, param, name, entry[name], release)
        if release:
            # The entry's tensors that did not become state are freed here.
            del incoming[key]
        del entry


def _set_one_state(
    optimizer: Any, param: torch.Tensor, name: str, value: torch.Tensor, owned: bool
) -> None:
    """Sets state ``name`` of ``param`` from ``value``, allocating at most once."""
    stored = _stored_dtype(optimizer, param, name)
    needs_scale = optimizer.name_to_dtype_map[name] != torch.float32
    reusable = (
        stored in UNSCALED_STORE_DTYPES
        and value.dtype == stored
        and value.device == param.device
        and value.is_contiguous()
    )
    if reusable:
        optimizer.state[param][name] = value
        if needs_scale:
            # FusedAdam keeps a scale for every non-fp32 state; bf16 ignores its value.
            optimizer._scales.setdefault(param, {})[name] = torch.ones(
                [1], dtype=torch.float32, device=param.device
            )
        return

    remainders = stored == torch.int16
    optimizer._initialize_state(param, name, False, remainders)
    # set_scaled_state copies across devices itself, so only the dtype is converted here.
    source = value if remainders else value.float()
    if source is value and needs_scale and stored not in UNSCALED_STORE_DTYPES and not owned:
        if value.device == param.device:
            # Scaling divides its input in place; the caller's tensor is left as it was.
            source = value.clone()
    optimizer.set_scaled_state(param, name, source)


def _tensors_of(state: Mapping) -> List[torch.Tensor]:
    """Lists the tensors held by an optimizer state mapping (one level of per-param dicts)."""
    found = []
    for entry in state.values():
        if isinstance(entry, Mapping):
            found.extend(value for value in entry.values() if isinstance(value, torch.Tensor))
    return found


class _Snapshot:
    """What an optimizer's ``state``, ``param_groups`` and ``_scales`` were, to put back.

    The same dict objects are restored with the same entries; tensor contents are not copied
    (no path of this module writes into tensors the optimizer held before the load).
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.state = optimizer.state
        self.state_entries = _dict_entries(self.state)
        self.param_groups = optimizer.param_groups
        self.group_entries = [(group, dict(group)) for group in self.param_groups]
        self.has_scales = hasattr(optimizer, "_scales")
        self.scales = getattr(optimizer, "_scales", None)
        self.scale_entries = _dict_entries(self.scales) if isinstance(self.scales, dict) else None

    def restore(self) -> None:
        """Puts the recorded objects and their entries back on the optimizer."""
        optimizer = self.optimizer
        optimizer.state = self.state
        _put_back(self.state, self.state_entries)
        optimizer.param_groups = self.param_groups
        self.param_groups[:] = [group for group, _ in self.group_entries]
        for group, entries in self.group_entries:
            group.clear()
            group.update(entries)
        if self.has_scales:
            optimizer._scales = self.scales
            if self.scale_entries is not None:
                _put_back(self.scales, self.scale_entries)

    def replaced_state_tensors(self) -> bool:
        """Tells whether a state tensor held before the load is no longer held after it."""
        now = {id(tensor) for tensor in _tensors_of(self.optimizer.state)}
        return any(id(tensor) not in now for tensor in _tensors_of(self.state))


def _dict_entries(mapping: dict) -> List[Tuple[Any, Any, Optional[dict]]]:
    """Records a dict's entries and, for dict values, their entries too."""
    return [
        (key, value, dict(value) if isinstance(value, dict) else None)
        for key, value in mapping.items()
    ]


def _put_back(mapping: dict, entries: List[Tuple[Any, Any, Optional[dict]]]) -> None:
    """Restores a dict (and its dict values) to the entries :func:`_dict_entries` recorded."""
    mapping.clear()
    for key, value, inner in entries:
        if inner is not None:
            value.clear()
            value.update(inner)
        mapping[key] = value


def _is_rank_zero() -> bool:
    """Tells whether this process logs: not distributed, or rank 0."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return True
    return torch.distributed.get_rank() == 0


def _log_plan(optimizer: Any, plan: LoadPlan) -> None:
    """Logs the path a load takes, on rank 0 only."""
    if _is_rank_zero():
        logger.info(
            "FusedAdam state load for %s: %s (%s)", type(optimizer).__name__, plan.path, plan.reason
        )
