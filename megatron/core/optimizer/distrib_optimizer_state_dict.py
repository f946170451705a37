# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The distributed optimizer's own state dict and the access to each owned piece's state.

:class:`DistributedOptimizerStateDictMixin` gives ``DistributedOptimizer`` what does not depend
on the data-parallel rank (param groups, step counts, grad scaler): ``state_dict`` and
``load_state_dict``, which runs the load pipeline of
:class:`~megatron.core.optimizer.distrib_optimizer_load.PlannedParamStateLoadMixin` and writes the
parameter state too when the state dict carries it. It also maps each owned model parameter to
the tensor the inner optimizer steps for it; every checkpoint format reads and writes the main
value and optimizer state of a piece through those members, which go through
:class:`~megatron.core.optimizer.inner_optimizer_state.InnerOptimizerState` alone.
"""

import logging
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron.core.optimizer import fused_adam_state_load
from megatron.core.optimizer import state_load_checks as checks
from megatron.core.optimizer.distrib_optimizer_formats import format_named
from megatron.core.optimizer.distrib_optimizer_load import PlannedParamStateLoadMixin
from megatron.core.optimizer.inner_optimizer_state import MASTER
from megatron.core.optimizer.optimizer import param_group_identifier_keys
from megatron.core.utils import log_single_rank

__all__ = ["DistributedOptimizerStateDictMixin"]

logger = logging.getLogger(__name__)


def _counts_steps_per_param(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer keeps its step in each parameter's state (torch's Adam family)
    rather than in its param groups (TE/Apex FusedAdam)."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


def _param_group_identity(group: Dict) -> Tuple:
    """The values that pair a saved param group with a current one (order is not saved)."""
    identity = []
    for key in param_group_identifier_keys:
        # NeMo names lr_mult and wd_mult pre_lr_mult and pre_wd_mult.
        identity.append(group.get(key, group.get(f"pre_{key}")))
    return tuple(identity)


class DistributedOptimizerStateDictMixin(PlannedParamStateLoadMixin):
    """``DistributedOptimizer``'s ``state_dict``/``load_state_dict`` and its per-piece state access.

    The host class provides, under megatron-core's names: ``optimizer`` and ``inner_state``,
    ``config``, ``grad_scaler``, ``ddp_config``, ``is_stub_optimizer``, the owned parameters'
    groups (``model_fp32_groups``, ``model_float16_groups``) with ``_inner_param_index``,
    ``optimizer_state_keys``, ``_get_state_key_dtype``, ``_get_model_param_range_map``, the
    parameter-state planners (``_plan_param_state_load``), ``_loads_its_own_way`` and
    ``_load_state_dict_megatron_fsdp``.
    """

    # ------------------------------------------------------------------ non-parameter state

    def state_dict(self):
        """The optimizer state that does not depend on the data-parallel rank.

        That is the param groups (hyperparameters, without their parameter lists; each with the
        ``step`` count once the optimizer has stepped) and the grad scaler. The per-parameter
        tensors are saved by the parameter-state methods.

        Returns:
            dict: ``{"optimizer": {"param_groups": [...]}, "grad_scaler": {...}}`` (the latter
            only with a grad scaler).
        """
        if self.is_stub_optimizer:
            raise RuntimeError("a stub DistributedOptimizer (no inner optimizer) has no state dict")
        self._ready_for("save its state")
        return self._common_state_dict()

    def _common_state_dict(self):
        """What :meth:`state_dict` returns, also while a load is under way (a dist-checkpoint
        load describes the optimizer with it before reading)."""
        saved = {"param_groups": self.inner_state.saved_param_groups()}
        step = self.inner_state.step()
        # Saved with the type upstream saves: torch's float counter, FusedAdam's int.
        as_saved = float if _counts_steps_per_param(self.optimizer) else int
        for group in saved["param_groups"]:
            del group["params"]
            # FusedAdam does not count steps in empty groups; every group gets the same count.
            if step is not None:
                group["step"] = as_saved(step)

        state_dict = {"optimizer": saved}
        if self.grad_scaler:
            state_dict["grad_scaler"] = self.grad_scaler.state_dict()
        return state_dict

    def _pair_saved_param_groups(self, saved_groups: List[Dict], inner_groups: List[Dict]):
        """Each current group's saved settings, with the current ``params`` entry.

        Groups are paired by :data:`param_group_identifier_keys`, not by position: construction
        order is not part of a checkpoint. Of two saved groups with one identity the last wins.
        """
        saved_by_identity = {_param_group_identity(group): group for group in saved_groups}
        paired = []
        for group in inner_groups:
            identity = _param_group_identity(group)
            if identity not in saved_by_identity:
                described = dict(zip(param_group_identifier_keys, identity))
                raise KeyError(
                    f"the checkpoint has no param group matching the optimizer's group "
                    f"{described}; it holds {len(saved_groups)} groups"
                )
            paired.append({**saved_by_identity[identity], "params": group["params"]})
        return paired

    def _state_scaffold(self, inner_groups: List[Dict], step: Optional[int]) -> Dict:
        """Uninitialised state tensors for every shard, keyed as in the inner state dict, made
        by the inner-optimizer contract (:meth:`InnerOptimizerState.scaffold`) in the dtypes the
        optimizer keeps, each on its parameter's device."""
        precision_aware = self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
        if precision_aware and self.config.store_param_remainders and self.config.bf16:
            master_dtype = torch.int16  # the low bits the bf16 parameter lacks
        else:
            master_dtype = self.config.main_params_dtype
        dtypes = {key: self._get_state_key_dtype(key) for key in self.optimizer_state_keys}
        if precision_aware:
            dtypes[MASTER] = master_dtype
        shards = {
            inner_groups[group_index]["params"][position]: (
                len(self._get_model_param_range_map(model_param)["gbuf_world"]),
                model_param.device,
            )
            for model_param, (group_index, position) in self._inner_param_index.items()
        }
        return self.inner_state.scaffold(shards, dtypes, step)

    def load_state_dict(self, state_dict):
        """Load what :meth:`state_dict` saved, and the parameter state when it is included.

        If the inner optimizer has no state yet, its state is created once (by the optimizer
        itself when it places its own state, otherwise as uninitialised tensors on each shard's
        device) and handed to the optimizer without a second copy (TE FusedAdam goes through
        :func:`~megatron.core.optimizer.fused_adam_state_load.load_fused_adam_state_dict`). If
        it has state (the second pass of a dist-checkpoint load), its state tensors are kept
        and only the param groups are loaded.
        Values come later from the parameter state. A saved ``step`` is restored wherever the
        optimizer counts steps; a missing one is no error.

        Args:
            state_dict: as returned by :meth:`state_dict`, or a distributed checkpoint's
                optimizer entry (then also with ``param_state`` and
                ``param_state_sharding_type``).

        Raises:
            KeyError: a current param group has no saved counterpart.
            NotImplementedError: the parameter state has an unknown sharding type.
            ValueError: ``param_state`` and ``param_state_sharding_type`` do not come together,
                the parameter state does not fit (see ``_check_param_state_for_load``), or the
                saved groups disagree on the step of an optimizer that counts steps per
                parameter.
            RuntimeError: this is a stub optimizer.
            All of them before anything is changed.
        """
        if self.is_stub_optimizer:
            raise RuntimeError("a stub DistributedOptimizer (no inner optimizer) cannot load state")
        if self.ddp_config.use_megatron_fsdp:
            self._load_state_dict_megatron_fsdp(state_dict)
            return

        # The parameter state is written by the load itself (the plan made below, not checked
        # again) unless a subclass or a client replaced the format's public loader.
        scaffolds = not self.optimizer.state and not self.inner_state.builds_own_state
        try:
            wrote_param_state = self._plan_agree_write(
                "load_state_dict",
                lambda: self._plan_state_dict_load(state_dict),
                on_refusal=self._refuse_after_a_load_request,
            )
        finally:
            self._load_request_outstanding = False
        if not wrote_param_state:
            # Values come with the parameter state (load_parameter_state, Megatron-LM's next
            # call): until then the state is the scaffold's garbage, or this run's moments
            # beside the checkpoint's steps.
            done = (
                "created the optimizer state without values"
                if scaffolds
                else "loaded the checkpoint's param groups and steps over this run's state"
            )
            self._load_guard.pending(
                f"load_state_dict {done}, and the parameter state (load_parameter_state, or a "
                "state dict with param_state) is not loaded yet"
            )

    def _refuse_after_a_load_request(self) -> None:
        """A refused ``load_state_dict`` after a dist-checkpoint read that filled the live state
        in place: the state is partly the refused checkpoint's."""
        if self._load_request_outstanding:
            self._load_guard.pending(
                "a distributed-checkpoint read wrote into the optimizer state, then "
                "load_state_dict refused the checkpoint"
            )

    def _plan_state_dict_load(self, state_dict) -> Callable[[], bool]:
        """Check the parameter state, the groups and the step counters of ``state_dict``,
        changing nothing; return the writer, which says whether it wrote parameter state."""
        try:
            write_param_state = self._plan_param_state_load(state_dict)
            saved_groups = state_dict["optimizer"]["param_groups"]
            inner_groups = self.inner_state.saved_param_groups()
            groups = self._pair_saved_param_groups(saved_groups, inner_groups)
            steps = {group["step"] for group in groups if group.get("step") is not None}
            for step in steps:
                checks.step_value(step, "the checkpoint's param groups")
            if len(steps) > 1 and self.inner_state.counts_steps_per_param():
                raise ValueError(
                    f"the checkpoint's param groups disagree on the step: {sorted(steps)}"
                )
        finally:
            checks.finish_scan_warm_up()  # started by the load request, scan or not

        def write() -> bool:
            self._load_param_groups_and_state(groups, inner_groups, steps)
            self._load_grad_scaler_state(state_dict)
            if write_param_state is None:
                return False
            sharding_type = state_dict["param_state_sharding_type"]
            log_single_rank(
                logger,
                logging.INFO,
                f"Loading distributed optimizer sharded state of type {sharding_type}",
            )
            fmt = format_named(sharding_type)
            if self._loads_its_own_way(fmt):
                fmt.load(self, state_dict["param_state"])  # plans and writes again, nested
            else:
                write_param_state()
            return True

        return write

    def _load_param_groups_and_state(self, groups, inner_groups, steps) -> None:
        """Write the loaded groups and create (or keep) the inner optimizer's state."""
        own_state = self.inner_state.builds_own_state
        if not self.optimizer.state and own_state:
            self.inner_state.materialise()
        scaffolded = not self.optimizer.state
        # State already allocated (the second pass of a dist-checkpoint load, or a load over a
        # trained optimizer) keeps its tensors: the parameter state fills them next, and a
        # round trip through the optimizer's state_dict would copy every state tensor (TE
        # FusedAdam's precision-aware state comes back as fp32). The HybridDeviceOptimizer
        # hands the loaded groups to its sub-optimizers itself, so it still loads.
        keep_state = not scaffolded and not own_state
        if scaffolded:
            state = self._state_scaffold(inner_groups, min(steps) if steps else None)
        else:
            # Reusing the existing tensors avoids reallocating (and fragmenting) memory.
            state = None if keep_state else self.inner_state.state_for_reload()
        if keep_state:
            fused_adam_state_load.load_param_groups_keeping_state(self.optimizer, groups)
        else:
            fused_adam_state_load.load_fused_adam_state_dict(
                self.optimizer,
                {"state": state, "param_groups": groups},
                release_incoming=scaffolded,
                precision_aware=self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                is_hybrid=own_state,
                is_fsdp=False,
                is_stub=False,
            )
        del state
        if len(steps) == 1:
            self.inner_state.set_step(int(next(iter(steps))))
            self.inner_state.finish_load()

    def _load_grad_scaler_state(self, state_dict):
        """Restore the grad scaler, telling why when it cannot be."""
        if "grad_scaler" not in state_dict:
            if self.config.fp16:
                log_single_rank(
                    logger,
                    logging.INFO,
                    "***WARNING*** the checkpoint has no grad scaler state (an old checkpoint?); "
                    "the grad scaler is not loaded ...",
                )
        elif self.grad_scaler:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        else:
            log_single_rank(
                logger,
                logging.INFO,
                "***WARNING*** the checkpoint has grad scaler state but this optimizer has no "
                "grad scaler; skipping it ...",
            )

    # ------------------------------------------------------------------ parameter state access

    def _index_inner_params(self) -> Dict[torch.nn.Parameter, Tuple[int, int]]:
        """Owned model parameter -> where its shard is in the inner optimizer's groups.

        A group lists its fp32 shards before its 16-bit ones, so a position in
        ``model_param_group_index_map`` (buffer order) is not always a position in the inner
        group; upstream used it as one, mixing up shards when a 16-bit buffer came first.
        """
        index = {}
        for group_index, (fp32_params, float16_params) in enumerate(
            zip(self.model_fp32_groups, self.model_float16_groups)
        ):
            for position, model_param in enumerate([*fp32_params, *float16_params]):
                index[model_param] = (group_index, position)
        return index

    def _inner_param(self, model_param: torch.nn.Parameter) -> torch.Tensor:
        """The tensor the inner optimizer steps for the owned piece of ``model_param``."""
        group_index, position = self._inner_param_index[model_param]
        return self.optimizer.param_groups[group_index]["params"][position]

    def _get_main_param_and_optimizer_states(self, model_param):
        """The main value and optimizer state of the owned piece of ``model_param``.

        Returns:
            dict: ``"param"`` (the fp32 main value), one tensor per entry of
            :attr:`optimizer_state_keys` and, where the inner optimizer counts steps per
            parameter (torch's Adam family, also inside the HybridDeviceOptimizer), its live
            0-dim ``"step"`` tensor, as upstream hands it to its checkpoint writers (which keep
            it out of the per-element state). Precision-aware state comes back unscaled in
            fp32; otherwise the tensors are the live ones.
        """
        return self._main_param_and_optimizer_tensors(model_param, self.inner_state.read)

    def _main_param_and_optimizer_load_targets(self, model_param):
        """Where a checkpoint read puts the main value and optimizer state of the owned piece
        of ``model_param``: keyed as :meth:`_get_main_param_and_optimizer_states`, the live
        tensors wherever storing the saved value is a plain copy or cast, host tensors where
        the inner optimizer must scale it first (never new accelerator memory)."""
        return self._main_param_and_optimizer_tensors(model_param, self.inner_state.load_targets)

    def _main_param_and_optimizer_tensors(self, model_param, tensors_of):
        shard = self._inner_param(model_param)
        tensors = tensors_of(shard)
        step = self.optimizer.state.get(shard, {}).get("step")
        if torch.is_tensor(step):
            tensors["step"] = step
        return tensors

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        """Copy ``tensors`` into the main value and optimizer state of ``model_param``'s piece.

        Args:
            model_param: an owned model parameter.
            tensors: ``"param"`` and every :attr:`optimizer_state_keys` entry, any dtype and
                device. The state must exist; values are copied into it in place. A ``step``
                entry is ignored, present or not: the count comes from the param groups (or a
                plain dp_reshardable dict), and the one a distributed checkpoint hands back is
                the loading optimizer's own pre-load tensor, not a saved value.
        """
        self.inner_state.write(self._inner_param(model_param), tensors)

    def _check_main_param_and_optimizer_states(self, model_param, tensors) -> None:
        """Raise, writing nothing, if the inner optimizer would refuse ``tensors`` for
        ``model_param``'s piece (missing keys, fp32 masters where it keeps remainders)."""
        self.inner_state.check_write(self._inner_param(model_param), tensors)
