# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The contract between the distributed optimizer and the optimizer it wraps.

The distributed optimizer saves and loads each parameter shard's fp32 master value and
optimizer state, and needs that state to exist before an in-place checkpoint load. Inner
optimizers keep these in different places: torch's Adam family in ``state[p]`` with a
per-parameter ``step`` tensor; TE/Apex FusedAdam in ``state[p]`` with the step in
``param_group["step"]``, scaled and in lower precision when precision-aware; the
HybridDeviceOptimizer behind its ``master_param`` entries. :class:`InnerOptimizerState`
hides those differences behind a few operations (materialise, read, write, step counter,
retarget, offload and restore), with one implementation per kind of optimizer, chosen once
by what the optimizer offers rather than by its class (:func:`kind_of`).
"""

from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron.core.optimizer import state_load_checks as checks
from megatron.core.optimizer.optimizer_state_creation import materialise_by_null_step

MASTER = "master_param"
"""State key of an fp32 master copy kept by the inner optimizer."""

MOMENT_NAMES = ("exp_avg", "exp_avg_sq")
"""State keys of Adam's per-parameter moments, in the order the fused kernels take them."""


UNSCALED_STORE_DTYPES = (torch.float32, torch.bfloat16, torch.int16)
"""Live state dtypes that TE FusedAdam keeps without a scale factor, storing an fp32 value into
them by a plain cast: a checkpoint read can land in them directly."""

# Elements per host scaling pass: an fp16 staging buffer of 8 MiB, reused for every piece.
HOST_SCALE_CHUNK = 1 << 22


def _is_same_tensor(incoming: Any, live: Any) -> bool:
    """Whether ``incoming`` is ``live`` itself (or a view covering exactly its elements)."""
    return (
        isinstance(incoming, torch.Tensor)
        and isinstance(live, torch.Tensor)
        and incoming.dtype == live.dtype
        and incoming.device == live.device
        and incoming.numel() == live.numel()
        and incoming.data_ptr() == live.data_ptr()
    )


def keeps_param_remainders(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> bool:
    """Whether ``optimizer`` keeps ``param``'s master weight as the int16 low bits that the bf16
    parameter lacks (TE FusedAdam's ``store_param_remainders``) rather than as fp32."""
    return bool(getattr(optimizer, "store_param_remainders", False)) and (
        param.dtype == torch.bfloat16
    )


# Optimizers (module, class name) known to count Adam steps in ``param_group["step"]`` and to
# read no per-parameter count.
GROUP_STEP_CLASSES = {
    ("transformer_engine.pytorch.optimizers.fused_adam", "FusedAdam"),
    ("apex.optimizers.fused_adam", "FusedAdam"),
}


def _keeps_steps_per_param(optimizer: torch.optim.Optimizer) -> bool:
    """torch's Adam family keeps a step tensor per parameter; TE/Apex FusedAdam one per group."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


def step_counter_of(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Where ``optimizer`` reads its Adam step count: ``"param"`` (torch's Adam family),
    ``"group"`` (:data:`GROUP_STEP_CLASSES`), or None for any other optimizer."""
    if _keeps_steps_per_param(optimizer):
        return "param"
    cls = type(optimizer)
    return "group" if (cls.__module__, cls.__qualname__) in GROUP_STEP_CLASSES else None


class InnerOptimizerState:
    """Reads and writes an inner optimizer's per-parameter state for checkpointing.

    The kind of optimizer is recognised once, here, by what it offers: constructing this class
    gives the implementation for it (:class:`ScaledFusedAdamState` for precision-aware TE
    FusedAdam, :class:`HybridDeviceOptimizerState` for an optimizer that builds and places its
    own state, this class for torch's Adam family and any optimizer keeping plain per-parameter
    state). Callers never ask which kind it is.

    Args:
        optimizer: the wrapped optimizer (torch, TE/Apex FusedAdam, HybridDeviceOptimizer...).
        state_keys: the tensor state saved per parameter, e.g. ``("exp_avg", "exp_avg_sq")``
            for Adam or ``("exp_avg",)`` for Lion.
        precision_aware: the optimizer keeps scaled, lower-precision state and its own fp32
            master weights, read and written through ``get_unscaled_state`` and
            ``set_scaled_state`` (TE FusedAdam with Megatron's precision-aware optimizer).
    """

    builds_own_state = False
    """Whether the optimizer creates and places its state itself (nothing may be allocated
    for it from outside, and it loads its own state dict)."""

    scaled = False
    """Whether state is read and written unscaled through the optimizer's own accessors."""

    def __new__(cls, optimizer=None, state_keys=MOMENT_NAMES, precision_aware=False):
        # pylint: disable=unused-argument
        if cls is InnerOptimizerState:
            cls = kind_of(optimizer, precision_aware)
        return super().__new__(cls)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        state_keys: Sequence[str] = MOMENT_NAMES,
        precision_aware: bool = False,
    ):
        self.optimizer = optimizer
        self.state_keys = tuple(state_keys)
        self.precision_aware = precision_aware

    def params(self) -> Iterator[torch.Tensor]:
        """The optimizer's parameters, group by group."""
        for group in self.optimizer.param_groups:
            yield from group["params"]

    def retarget(self, param_groups: Sequence[Dict]) -> None:
        """Point the optimizer at new parameter groups (the shards a rank owns) in place: the
        groups are assigned and the optimizer reloads its own state dict, which re-keys state
        by the new parameters.

        Args:
            param_groups: dicts with ``"params"`` and the group's hyperparameters.
        """
        self.optimizer.param_groups = list(param_groups)
        self.optimizer.load_state_dict(self.optimizer.state_dict())

    def saved_param_groups(self) -> List[Dict]:
        """The param groups as the optimizer's ``state_dict`` lists them (parameters as running
        indices), read without its state (TE FusedAdam's ``state_dict`` would copy every
        precision-aware state tensor to fp32)."""
        groups, start = [], 0
        for group in self.optimizer.param_groups:
            saved = {key: value for key, value in group.items() if key != "params"}
            saved["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            groups.append(saved)
        return groups

    def state_for_reload(self) -> Dict:
        """The optimizer's state as its ``state_dict`` gives it, to be loaded back into it."""
        return self.optimizer.state_dict()["state"]

    def counts_steps_per_param(self) -> bool:
        """Whether the Adam step is kept in each parameter's state (torch's Adam family) rather
        than in the param groups (TE/Apex FusedAdam), read without changing anything."""
        if self.optimizer.state:
            return any("step" in entry for entry in self.optimizer.state.values())
        return _keeps_steps_per_param(self.optimizer)

    @property
    def keeps_copies(self) -> bool:
        """Whether the optimizer keeps copies of its parameters that must be refreshed when
        the parameters change outside (it offers ``update_fp32_param_by_new_param``)."""
        return callable(getattr(self.optimizer, "update_fp32_param_by_new_param", None))

    def refresh_copies(self) -> None:
        """Refresh the copies the optimizer keeps of its parameters, if it keeps any."""
        if self.keeps_copies:
            self.optimizer.update_fp32_param_by_new_param()

    def is_materialised(self) -> bool:
        """Whether every parameter already has its state tensors."""
        return all(
            all(key in self.optimizer.state.get(p, {}) for key in self.state_keys)
            for p in self.params()
            if p.numel() > 0
        )

    def scaffold(
        self,
        shards: Dict[Any, Tuple[int, torch.device]],
        dtypes: Dict[str, torch.dtype],
        step: Optional[int],
    ) -> Dict[Any, Dict[str, torch.Tensor]]:
        """Uninitialised state for a load to fill, keyed as in the optimizer's state dict.

        Loading the optimizer's state dict with it makes these very tensors the state (no
        second copy); the parameter-state load then writes their values.

        Args:
            shards: saved parameter id -> number of elements and device of its flat shard.
            dtypes: state key -> the dtype the optimizer keeps it in.
            step: the checkpoint's step, kept per parameter where the optimizer counts it there
                (0 where the checkpoint has none).
        """
        per_param_step = _keeps_steps_per_param(self.optimizer)
        state = {}
        for param_id in sorted(shards):
            numel, device = shards[param_id]
            entry = {
                key: torch.empty((numel,), dtype=dtype, device=device)
                for key, dtype in dtypes.items()
            }
            if per_param_step:
                entry["step"] = torch.tensor(float(step or 0), dtype=torch.float32)
            state[param_id] = entry
        return state

    def materialise(self) -> None:
        """Create missing state in place, leaving values, counters and hyperparameters as
        they are (a null step of the parameters without state)."""
        if not self.is_materialised():
            materialise_by_null_step(self.optimizer)

    def read(self, param: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The fp32 master value (``"param"``) and each state tensor of ``param``.

        Unscaled state is a view of the live tensor wherever the optimizer keeps it in
        fp32; precision-aware state comes back unscaled in fp32.
        """
        state = self.optimizer.state[param]
        missing = [key for key in self.state_keys if key not in state]
        if missing:
            raise KeyError(
                f"{type(self.optimizer).__name__} has no {missing} state for a parameter of "
                f"shape {tuple(param.shape)}; materialise the state before reading it"
            )
        tensors = {key: state[key] for key in self.state_keys}
        tensors["param"] = state.get(MASTER, self._holder(param))
        return tensors

    def load_targets(self, param: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Tensors a checkpoint read can fill for ``param``, keyed as :meth:`read`.

        A checkpoint holds what :meth:`read` gives: fp32 master values and unscaled state.
        Wherever storing such a value is a plain copy (or cast) into the live tensor, the
        live tensor is the target, so that the read lands in place and the later
        :meth:`write` has nothing left to do for it. Plain optimizers keep every such tensor.
        """
        return self.read(param)

    def _holder(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor the optimizer steps for ``param``: the parameter itself."""
        return param

    def check_write(self, param: torch.Tensor, tensors: Dict[str, torch.Tensor]) -> None:
        """Raise, writing nothing, if :meth:`write` would refuse ``tensors`` for ``param``."""
        missing = [key for key in ("param",) + self.state_keys if key not in tensors]
        if missing:
            raise KeyError(f"checkpointed parameter state lacks {missing}")

    @torch.no_grad()
    def write(self, param: torch.Tensor, tensors: Dict[str, torch.Tensor]) -> None:
        """Set ``param``'s master value and state from ``tensors`` (any dtype or device).

        Values are copied into the tensors the optimizer already keeps, so nothing new is
        allocated; keys other than ``"param"`` and the state keys (a saved ``step``, say)
        are ignored, since step counters are restored by :meth:`set_step`.
        """
        missing = [key for key in ("param",) + self.state_keys if key not in tensors]
        if missing:
            raise KeyError(f"checkpointed parameter state lacks {missing}")
        live_tensors = self.read(param)
        for key, live in live_tensors.items():
            live.copy_(tensors[key].reshape(live.shape))
        if live_tensors["param"] is not param:
            # Readers of the public parameter (norms, the next copy to the model) see the
            # loaded value too, not only the copy the optimizer steps.
            param.detach().copy_(live_tensors["param"].reshape(param.shape))

    def step(self) -> Optional[int]:
        """The Adam step count, wherever the optimizer keeps it (None before any step)."""
        for param in self.params():
            step = self.optimizer.state.get(param, {}).get("step")
            if step is not None:
                return int(checks.host_value(step) if torch.is_tensor(step) else step)
        for group in self.optimizer.param_groups:
            if group.get("step") is not None and group["params"]:
                return int(group["step"])
        return None

    def set_step(self, step: int) -> None:
        """Restore the step count into every place the optimizer reads it from."""
        keeps_per_param = False
        for param in self.params():
            state = self.optimizer.state.get(param, {})
            if torch.is_tensor(state.get("step")):
                state["step"].fill_(step)
                keeps_per_param = True
            elif "step" in state:
                state["step"] = step
                keeps_per_param = True
        if not keeps_per_param:
            for group in self.optimizer.param_groups:
                group["step"] = step

    def offload(self) -> None:
        """Move every accelerator state tensor to the host, by assignment into ``state`` (an
        offloading optimizer's host-resident state is there already and stays as it is; a
        ``master_param`` that is the tensor the optimizer steps stays too)."""
        for param, entry in self.optimizer.state.items():
            stepped = self._holder(param)
            for key, value in list(entry.items()):
                # A master that is the tensor the optimizer steps frees nothing when moved.
                if isinstance(value, torch.Tensor) and value.is_cuda and value is not stepped:
                    entry[key] = value.cpu()

    def restore(self) -> None:
        """Bring offloaded state back: every host tensor onto the current CUDA device."""
        for entry in self.optimizer.state.values():
            for key, value in list(entry.items()):
                if isinstance(value, torch.Tensor) and not value.is_cuda:
                    entry[key] = value.cuda()

    def finish_load(self) -> None:
        """Let the optimizer adopt state written from outside (plain optimizers need
        nothing: the writes went into their state)."""

    # ------------------------------------------------------------ a step behind the forward

    def step_behind_forward(self, order: Callable[[torch.Tensor], float]) -> bool:
        """Have the optimizer run its host step behind the next forward, stepping its
        parameters in ``order``; whether it can (plain optimizers step where their parameters
        are, at once)."""
        return False

    def step_pending(self) -> bool:
        """Whether a step is still running behind the forward."""
        return False

    def wait_for_params(self, params: List[torch.Tensor], block: bool) -> bool:
        """Wait (``block``) or look whether ``params`` have their update of a step running
        behind the forward; True where none runs."""
        return True

    def finish_step(self) -> None:
        """Wait for a step running behind the forward, if any."""


class ScaledFusedAdamState(InnerOptimizerState):
    """TE FusedAdam with Megatron's precision-aware optimizer: moments in lower precision with
    scales and fp32 master weights (or int16 remainders), read and written unscaled through
    ``get_unscaled_state`` and ``set_scaled_state``."""

    scaled = True

    def materialise(self) -> None:
        """Create missing state with the optimizer's own allocator (``_initialize_state``):
        zero moments, and the master copied from the parameter in place.

        TE's own first-step initialisation makes an fp32 clone of each parameter before
        storing its master, one parameter's worth of memory on top of the state; the copy
        into the allocated master gives the same values without it. Parameters this cannot
        handle (DTensor or quantized ones, an optimizer without that allocator) are left to
        the null step.
        """
        allocate = getattr(self.optimizer, "_initialize_state", None)
        if callable(allocate):
            for param in self.params():
                if param.numel() == 0 or self.optimizer.state.get(param):
                    continue
                if type(param) not in (torch.Tensor, torch.nn.Parameter):
                    continue
                self._allocate_state(allocate, param)
        super().materialise()

    @torch.no_grad()
    def _allocate_state(self, allocate, param: torch.Tensor) -> None:
        remainders = keeps_param_remainders(self.optimizer, param)
        for key in self.state_keys:
            allocate(param, key, True)
        if not getattr(self.optimizer, "master_weights", False):
            return
        allocate(param, MASTER, False, remainders)
        if remainders:
            return  # zero low bits: the bf16 parameter is the master value
        master = self.optimizer.state[param][MASTER]
        if (
            type(master) is torch.Tensor and master.dtype == torch.float32
        ):  # pylint: disable=unidiomatic-typecheck
            master.copy_(param.detach())
        else:
            self.optimizer.set_scaled_state(param, MASTER, param.detach().float())

    def read(self, param: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The fp32 master value (``"param"``) and each state tensor of ``param``, unscaled
        into new fp32 tensors."""
        unscaled = self.optimizer.get_unscaled_state
        tensors = {key: unscaled(param, key) for key in self.state_keys}
        tensors["param"] = unscaled(param, MASTER)
        return tensors

    def check_write(self, param: torch.Tensor, tensors: Dict[str, torch.Tensor]) -> None:
        super().check_write(param, tensors)
        self._master_as_kept(param, tensors["param"])

    def load_targets(self, param: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Tensors a checkpoint read can fill for ``param``: the live tensor where the
        optimizer stores the saved value by a plain cast (fp32 and bf16 state, int16
        remainders), a host fp32 tensor where it computes a scale first (fp16 or fp8 state).

        The host tensors keep what a scale needs off the accelerator: they cost host memory
        (4 bytes per element and key) until :meth:`write` scales them into the live state,
        through a staging buffer of :data:`HOST_SCALE_CHUNK` fp16 elements.
        """
        state = self.optimizer.state[param]
        targets = {}
        for key, name in [(key, key) for key in self.state_keys] + [("param", MASTER)]:
            live = state.get(name)
            if not isinstance(live, torch.Tensor):
                raise KeyError(
                    f"{type(self.optimizer).__name__} has no {name!r} state for a parameter of "
                    f"shape {tuple(param.shape)}; materialise the state before loading it"
                )
            if (
                type(live) is torch.Tensor and live.dtype in UNSCALED_STORE_DTYPES
            ):  # pylint: disable=unidiomatic-typecheck
                targets[key] = live
            else:
                targets[key] = torch.empty(live.shape, dtype=torch.float32, device="cpu")
        return targets

    @torch.no_grad()
    def write(self, param: torch.Tensor, tensors: Dict[str, torch.Tensor]) -> None:
        """Set ``param``'s master value and state from ``tensors``, scaled into the tensors the
        optimizer keeps (a tensor that is the live one, filled by the read, is left as is)."""
        missing = [key for key in ("param",) + self.state_keys if key not in tensors]
        if missing:
            raise KeyError(f"checkpointed parameter state lacks {missing}")
        state = self.optimizer.state[param]
        setter = self.optimizer.set_scaled_state
        if not _is_same_tensor(tensors["param"], state.get(MASTER)):
            setter(param, MASTER, self._master_as_kept(param, tensors["param"]))
        for key in self.state_keys:
            if _is_same_tensor(tensors[key], state.get(key)):
                continue
            unscaled = tensors[key].to(torch.float32)
            if not self._scale_on_host(param, key, unscaled):
                setter(param, key, unscaled)

    def _scale_on_host(self, param: torch.Tensor, key: str, unscaled: torch.Tensor) -> bool:
        """Store host fp32 values into an fp16 state the way ``set_scaled_state`` does (the
        absmax over the dtype's range as the scale, the values multiplied by its reciprocal,
        then cast), computing on the host: ``set_scaled_state`` would first copy the whole
        piece to the accelerator in fp32. The arithmetic is IEEE fp32 either side, rounded
        once to fp16, so the result is the same bits. Returns False, doing nothing, where the
        optimizer does not keep what that takes (then ``set_scaled_state`` stores it).
        ``unscaled`` is left as it is: it may be a caller's tensor (a plain parameter-state
        dict).

        The scaled values go out :data:`HOST_SCALE_CHUNK` elements at a time through one fp16
        staging buffer: a pass that multiplies and casts at once, and no host temporaries the
        size of the piece (each would be a full pass more, over freshly faulted pages).
        """
        live = self.optimizer.state[param].get(key)
        ranges = getattr(self.optimizer, "dtype_to_range_map", None)
        scale = getattr(self.optimizer, "_scales", {}).get(param, {}).get(key)
        if (
            unscaled.is_cuda
            or type(live) is not torch.Tensor  # pylint: disable=unidiomatic-typecheck
            or live.dtype != torch.float16
            or not live.is_contiguous()
            or live.numel() != unscaled.numel()
            or not isinstance(ranges, dict)
            or not isinstance(ranges.get(torch.float16), torch.Tensor)
            or not isinstance(scale, torch.Tensor)
        ):
            return False
        max_range = ranges[torch.float16].to(device="cpu", dtype=torch.float32)
        low, high = torch.aminmax(unscaled)
        host_scale = torch.maximum(-low, high).to(torch.float32).reshape(1) / max_range
        inverse = torch.where(host_scale > 0, host_scale.reciprocal(), 0.0)
        source, target = unscaled.reshape(-1), live.view(-1)
        staging = torch.empty(min(HOST_SCALE_CHUNK, source.numel()), dtype=torch.float16)
        for start in range(0, source.numel(), HOST_SCALE_CHUNK):
            piece = source[start : start + HOST_SCALE_CHUNK]
            scaled = staging[: piece.numel()]
            torch.mul(piece, inverse, out=scaled)
            # From pageable memory the copy returns once the data left the buffer.
            target[start : start + piece.numel()].copy_(scaled)
        scale.copy_(host_scale.reshape(scale.shape))
        return True

    def _master_as_kept(self, param: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        """``master`` in the form ``set_scaled_state`` takes: fp32, or the int16 remainders
        that an optimizer with ``store_param_remainders`` keeps for a bf16 parameter (what
        ``get_unscaled_state`` gave when the checkpoint was written).

        The legacy and dp_zero formats gather every state into fp32 buffers, upstream's as well
        as the fork's, so remainders can arrive as fp32 holding int16 values; they convert back
        exactly. Any other value is a real fp32 master, which such an optimizer cannot take.
        """
        if not keeps_param_remainders(self.optimizer, param):
            return master.to(torch.float32)
        if master.dtype == torch.int16:
            return master
        remainders = master.to(torch.int16)
        exact = master.is_floating_point() and checks.host_value(
            (remainders.to(master.dtype) == master).all()
        )
        if not exact:
            raise ValueError(
                f"the checkpoint holds {master.dtype} master weights for a bf16 parameter of "
                f"shape {tuple(param.shape)} that are not int16 remainders, but the optimizer "
                "keeps int16 remainders (store_param_remainders): save and load with the same "
                "setting"
            )
        return remainders


class HybridDeviceOptimizerState(InnerOptimizerState):
    """An optimizer that builds and places its own state, on the host or where each parameter
    lives (the HybridDeviceOptimizer): it regroups itself, materialises through its own null
    step, loads its own state dict, keeps copies of its parameters, and says where each state
    tensor belongs."""

    builds_own_state = True

    def retarget(self, param_groups: Sequence[Dict]) -> None:
        """Regroup without building anything for the groups being replaced (where it can:
        upstream's class rebuilds on its reload)."""
        regroup = getattr(self.optimizer, "replace_param_groups", None)
        if regroup is None:
            super().retarget(param_groups)
        else:
            regroup(param_groups)

    def state_for_reload(self) -> Dict:
        """Its state, read even while a failed load's mark is set: the load this read is part
        of writes every value again, and a failure there puts the mark back."""
        guard = getattr(self.optimizer, "_load_guard", None)
        failure = getattr(guard, "failure", None)
        if guard is not None:
            guard.failure = None
        try:
            return super().state_for_reload()
        finally:
            if guard is not None and failure is not None:
                guard.failure = failure

    def counts_steps_per_param(self) -> bool:
        if self.optimizer.state:
            return super().counts_steps_per_param()
        return any(_keeps_steps_per_param(o) for o in self.optimizer.sub_optimizers)

    def materialise(self) -> None:
        """Create missing state where the optimizer places it (its ``dummy_step``)."""
        if not self.is_materialised():
            self.optimizer.dummy_step()

    def _holder(self, param: torch.Tensor) -> torch.Tensor:
        """The copy the optimizer steps for ``param`` (``param_to_inner_param``)."""
        return self.optimizer.param_to_inner_param.get(param, param)

    def restore(self) -> None:
        """Bring each state tensor back where the optimizer keeps it: host-resident state stays
        on the host."""
        self.optimizer._move_new_state_to_right_device()  # pylint: disable=protected-access

    def finish_load(self) -> None:
        """Let it adopt state written from outside and refresh its copies."""
        self.optimizer._sync_hdo_state_to_sub_optimizers()  # pylint: disable=protected-access

    def step_behind_forward(self, order: Callable[[torch.Tensor], float]) -> bool:
        """Set its ``overlap_cpu_optimizer_step_with_forward`` and ``host_step_order``
        (upstream's class has neither: it cannot)."""
        optimizer = self.optimizer
        if not callable(getattr(optimizer, "wait_for_params", None)):
            return False
        optimizer.overlap_cpu_optimizer_step_with_forward = True
        optimizer.host_step_order = order
        return True

    def step_pending(self) -> bool:
        return bool(getattr(self.optimizer, "host_step_pending", False))

    def wait_for_params(self, params: List[torch.Tensor], block: bool) -> bool:
        if not self.step_pending():
            return True
        return self.optimizer.wait_for_params(params, block)

    def finish_step(self) -> None:
        if self.step_pending():
            self.optimizer.finish_step()


def kind_of(optimizer: Any, precision_aware: bool = False) -> type:
    """The :class:`InnerOptimizerState` implementation for ``optimizer``, by what it offers."""
    if callable(getattr(optimizer, "dummy_step", None)):
        return HybridDeviceOptimizerState
    if precision_aware and hasattr(optimizer, "set_scaled_state"):
        return ScaledFusedAdamState
    return InnerOptimizerState
