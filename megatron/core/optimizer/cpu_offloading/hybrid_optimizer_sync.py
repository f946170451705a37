# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""How the HybridDeviceOptimizer keeps one state: shared entries, group sync, checkpoints.

``state[p]`` is the very dict the sub-optimizer steps for ``p``'s inner tensor
(:mod:`hybrid_optimizer_state`). :class:`SharedStateMixin` holds the HybridDeviceOptimizer's
members that keep it so: listing the entries that got state, adopting what clients wrote
around them, pushing the public groups' hyperparameters and steps to the sub-groups, and the
checkpoint hooks (plan, then write every entry where its inner tensor lives).
"""

from typing import Any, Dict, List, Optional

import torch

from megatron.core.optimizer import state_load_checks as checks
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_state import (
    ParamState,
    StateMap,
    home_of,
    placed,
    plan_step_counts,
)
from megatron.core.optimizer.inner_optimizer_state import MASTER, MOMENT_NAMES, step_counter_of
from megatron.core.optimizer.optimizer_state_creation import materialise_by_null_step

# Constructor options of the hybrid optimizer itself. They live in ``defaults`` (so that
# ``HybridDeviceOptimizer(params, **opt.defaults)`` rebuilds an equivalent optimizer) but
# never in param groups, which would put classes into checkpoints.
HDO_OPTIONS = (
    "offload_fraction",
    "cpu_optimizer_cls",
    "gpu_optimizer_cls",
    "param_update_in_fp32",
    "pin_cpu_grads",
    "pin_cpu_params",
    "overlap_cpu_optimizer_d2h_h2d",
)


def hyperparameters(group: Dict[str, Any]) -> Dict[str, Any]:
    """The entries of a param group that a sub-optimizer should follow."""
    return {k: v for k, v in group.items() if k not in ("params", "step") + HDO_OPTIONS}


def same_count(step: Any, other: Any) -> bool:
    """Whether two group step counts are one count: the same object, or equal numbers (a
    tensor count is only ever the same object, since clients reset those in place)."""
    if step is other:
        return True
    if isinstance(step, torch.Tensor) or isinstance(other, torch.Tensor):
        return False
    return step == other


class SharedStateMixin:
    """The HybridDeviceOptimizer's members that keep ``state``, the sub-optimizers' state and
    the param groups one, and its checkpoint hooks (see :mod:`hybrid_optimizer`)."""

    def _new_sub_state_map(self) -> StateMap:
        """A sub-optimizer's ``state``: its inner tensors map to the shared entries."""
        return StateMap(self._entries_by_inner.get)

    def _shared_sub_state(self, optimizer: torch.optim.Optimizer) -> StateMap:
        """``optimizer.state``, put back to a shared map if it was replaced as a whole."""
        if not isinstance(optimizer.state, StateMap):
            optimizer.state = self._new_sub_state_map()
        return optimizer.state

    def _entry_of(self, param) -> Optional[ParamState]:
        """The state dict shared by ``param`` and its sub-optimizer (None for other keys)."""
        if not isinstance(param, torch.Tensor):
            return None
        return self._entries.get(param)

    def _mirror_group_steps(self, steps_before: List[Any], keep: Optional[Dict[int, Any]] = None):
        """Copy the step of sub-optimizers that count it in their param groups (TE, Apex),
        except into the public groups of ``keep`` (index -> a step a client wrote there),
        which stay written by the client for the next sync to hand over."""
        keep = keep or {}
        noted, mirrored = list(self._group_steps_in_sync), {}
        for (sub_group, index), before in zip(self._sub_groups, steps_before):
            step = sub_group.get("step")
            if step is not None and step is not before:
                mirrored[index] = step
                if index not in keep:
                    self.param_groups[index]["step"] = step
        self._note_group_steps()
        for index in keep:
            # Noted as the sub-groups have it, so the client's step still reads as written.
            before = noted[index] if index < len(noted) else None
            self._group_steps_in_sync[index] = mirrored.get(index, before)

    def _note_group_steps(self):
        """Remember each public group's step as the sub-groups have it now, so that the next
        sync can tell a step a client wrote into the public group from one mirrored there."""
        self._group_steps_in_sync = [group.get("step") for group in self.param_groups]

    def _group_steps_written_outside(self) -> Dict[int, Any]:
        """Public group index -> the step a client wrote there since the last sync."""
        noted = self._group_steps_in_sync
        written = {}
        for index, group in enumerate(self.param_groups):
            if "step" not in group:
                continue
            before = noted[index] if index < len(noted) else None
            if not same_count(group["step"], before):
                written[index] = group["step"]
        return written

    def _sync_hdo_param_groups_to_sub_optimizers(self):
        """Push the public groups' hyperparameters (lr, weight decay, ...) to the sub-groups,
        and a step a client wrote into a public group (slime's reset of the optimizer states
        sets it to 0) to the sub-groups that count steps in their group, which step next."""
        self.finish_step()  # a step running behind the forward writes what this reads
        written = self._group_steps_written_outside()
        for sub_group, index in self._sub_groups:
            sub_group.update(hyperparameters(self.param_groups[index]))
            if index in written and "step" in sub_group:
                sub_group["step"] = written[index]
        self._note_group_steps()

    def _hand_back_group_steps(self):
        """Give the public groups' loaded steps to the sub-groups: a group loaded without one
        leaves its sub-groups none, as a sub-optimizer's own load would."""
        for sub_group, index in self._sub_groups:
            if "step" in self.param_groups[index]:
                sub_group["step"] = self.param_groups[index]["step"]
            else:
                sub_group.pop("step", None)
        self._note_group_steps()

    def _list_created_state(self):
        """Show in ``self.state`` the entries that got state since the last look (the
        sub-optimizers' first step creates it), with their ``master_param``."""
        created = self._state_changes.created
        if not created:
            return
        # In parameter order, whichever sub-optimizer made it first.
        order = {id(entry): index for index, entry in enumerate(self._entries.values())}
        for entry in sorted(created, key=lambda entry: order.get(id(entry), len(order))):
            self._list_entry(entry)
        created.clear()

    def _list_entry(self, entry: ParamState):
        if not entry:
            return
        if entry.keeps_master and MASTER not in entry:
            dict.__setitem__(entry, MASTER, entry.inner)
        if dict.get(self.state, entry.param) is not entry:
            dict.__setitem__(self.state, entry.param, entry)

    def dummy_step(self):
        """Materialise the sub-optimizers' state without changing anything else.

        Each sub-optimizer takes a null step (zero gradients, learning rate and weight
        decay) on its parameters that have no state yet, then gets its counters and
        hyperparameters back: the result equals a never-stepped optimizer whose state
        tensors already exist, which is what an in-place checkpoint load needs. TE's moments
        are created laid out for the flat in-place step instead (zeros, as TE makes them).
        """
        self.finish_step()  # a step running behind the forward writes what this reads
        self._ensure_built()
        flat = self._flat_in_place_step()
        if flat is not None:
            flat.create_state()  # laid out for the flat step; the null step skips it then
        for optimizer in self.sub_optimizers:
            materialise_by_null_step(optimizer)
        self._sync_sub_optimizers_state_to_hdo()

    def _sync_sub_optimizers_state_to_hdo(self):
        """Show every parameter's state in ``self.state``: its one entry, shared with the
        sub-optimizer, listed once it holds state."""
        self.finish_step()  # a step running behind the forward writes what this reads
        if not isinstance(self.state, StateMap):
            self.state = StateMap(self._entry_of)
        for entry in self._entries.values():
            self._list_entry(entry)
        self._state_changes.created.clear()

    def _settle_state_written_outside(self):
        """Before a step: take home the state that clients left elsewhere.

        Entries parked on the host go back to their accelerator; a ``state`` replaced as a
        whole is adopted. Nothing is scanned when neither happened.
        """
        if not isinstance(self.state, StateMap):
            self._sync_hdo_state_to_sub_optimizers()
            return
        for optimizer in self.sub_optimizers:
            if not isinstance(optimizer.state, StateMap):
                self._adopt_sub_optimizer_state(optimizer)
        parked = self._state_changes.parked
        if parked:
            self._lay_out_in_place_state()
        for entry in parked.values():
            entry.settle()
        parked.clear()

    def _adopt_sub_optimizer_state(self, optimizer: torch.optim.Optimizer):
        """Take in a sub-optimizer's ``state`` that was replaced as a whole (its own
        ``load_state_dict``, say): its dicts refill the shared entries, which it gets back."""
        replaced = optimizer.state
        optimizer.state = self._new_sub_state_map()
        for entry in self._entries.values():
            if entry.optimizer is not optimizer:
                continue
            values = replaced.get(entry.inner)
            if values is None:
                dict.clear(entry)
            elif values is not entry:
                entry.refill(values)
            dict.__setitem__(optimizer.state, entry.inner, entry)
            self._list_entry(entry)

    def _sync_hdo_state_to_sub_optimizers(self):
        """Make what ``self.state`` shows the state that is stepped, wherever it was written.

        Assignments into ``self.state[p]`` reach the sub-optimizer by themselves (it is the
        same dict); this adopts what bypassed them: a ``state`` mapping or a per-parameter dict
        replaced as a whole, or a sub-optimizer's entry replaced. Then every ``master_param``
        is written into its inner tensor and every state tensor is moved home.
        """
        self.finish_step()  # a step running behind the forward writes what this reads
        shown = self.state
        replaced = not isinstance(shown, StateMap)
        if replaced:
            self.state = StateMap(self._entry_of)
        for param, entry in self._entries.items():
            value = shown.get(param)
            if value is not None and value is not entry:
                entry.refill(value)
            elif replaced and value is None:
                dict.clear(entry)
            sub_state = self._shared_sub_state(entry.optimizer)
            if dict.get(sub_state, entry.inner) is not entry:
                dict.__setitem__(sub_state, entry.inner, entry)
        self._sync_sub_optimizers_state_to_hdo()
        self._update_fp32_params_by_new_state()
        self._move_new_state_to_right_device()

    @torch.no_grad()
    def _update_fp32_params_by_new_state(self):
        """Write each entry's ``master_param`` into the inner tensor it stands for, where
        something other than that tensor was put there, and show the inner tensor again."""
        self.finish_step()  # a step running behind the forward writes what this reads
        if not self.param_update_in_fp32:
            return
        for entry in self._entries.values():
            master = dict.get(entry, MASTER)
            if isinstance(master, torch.Tensor) and master is not entry.inner:
                entry.inner.copy_(master.reshape(entry.inner.shape))
                dict.__setitem__(entry, MASTER, entry.inner)

    def _move_new_state_to_right_device(self):
        """Move every state tensor to where its inner tensor keeps it.

        Host copies' state goes to the host, the state of tensors stepped in place to their
        device, decided by where each inner tensor lives; the dtype becomes the one the
        sub-optimizer keeps it in. State already home is left as it is, so nothing is
        allocated on the accelerator for host-resident state.
        """
        self.finish_step()  # a step running behind the forward writes what this reads
        self._lay_out_in_place_state()
        for entry in self._entries.values():
            entry.settle()
        self._state_changes.parked.clear()

    def _lay_out_in_place_state(self):
        """Take the in-place moments home laid out for the flat in-place step (one block per
        run), where a client parked them on the host between training phases."""
        flat = self._flat_in_place_step()
        if flat is not None:
            flat.lay_out()

    @torch.no_grad()
    def _settle(self, inner, optimizer, live, key, value):
        """Return the tensor that keeps a loaded ``value`` for ``inner`` from now on: the live
        tensor, written in place, where one of the same size exists."""
        if not isinstance(value, torch.Tensor):
            return value
        if key == MASTER:
            if value is not inner:
                inner.copy_(value.reshape(inner.shape))
            return inner
        if isinstance(live, torch.Tensor) and live.numel() == value.numel():
            # A live tensor a client parked away from home is replaced, not written.
            if (live.device, live.dtype) == home_of(inner, optimizer, key, live):
                if live is not value:
                    live.copy_(value.reshape(live.shape))
                return live
        return placed(inner, optimizer, key, value)

    @torch.no_grad()
    def update_fp32_param_by_new_param(self):
        """Refresh every inner copy from its parameter after the parameters changed outside."""
        self.finish_step()  # a step running behind the forward writes what this reads
        for param, inner in self.param_to_inner_param.items():
            if inner is not param:
                inner.copy_(param.detach().view_as(inner))

    # ------------------------------------------------------------------ checkpoints

    def _plan_load(self, state_dict) -> Dict[torch.Tensor, Dict[str, Any]]:
        """Check everything a load will write, changing nothing; return it per parameter
        (:func:`~megatron.core.optimizer.state_load_checks.plan_optimizer_state_dict`).

        The step and the master copies are no state every entry must hold: sub-optimizers of
        two kinds (TE FusedAdam in place, torch AdamW on the host) keep the step in different
        places. The optimizer's own tensors coming back (a reload of its own state dict, as
        the distributed optimizer does) were checked when they were loaded.

        Raises:
            KeyError, ValueError: naming the problem and the parameter's id in the checkpoint.
        """
        return checks.plan_optimizer_state_dict(
            state_dict,
            self.param_groups,
            f"{type(self).__name__}.load_state_dict",
            live_keys={k for e in self._entries.values() for k in e},
            optional_keys=(MASTER, "step"),
            own_tensors={id(v) for e in self._entries.values() for v in e.values()},
        )

    @staticmethod
    def _settle_loaded_state(self, state_dict):
        """Load pre-hook: plan, then write every entry where its inner tensor lives.

        The settled state is kept aside and torch is handed an empty one, so torch's own
        load never casts state onto the public parameters' device. From the first write on
        the optimizer is marked as loading; the post-hook clears the mark, so a load that
        fails in between leaves an optimizer that refuses to step or save.
        """
        self._ensure_built()
        planned, group_steps = plan_step_counts(
            self._plan_load(state_dict),
            state_dict["param_groups"],
            self.param_groups,
            lambda param: step_counter_of(self._owner[self.param_to_inner_param[param]]),
            f"{type(self).__name__}.load_state_dict",
        )
        self._load_guard.failure = "load_state_dict did not complete"
        flat = self._flat_in_place_step()
        if flat is not None:
            # Moments coming from elsewhere (a checkpoint read to the host) into an in-place
            # optimizer without state land in blocks laid out for the flat step, so that its
            # first step need not move them; moments already on the device are adopted as they
            # are, since a block beside them would hold them twice while the caller keeps them.
            flat.create_state(only={id(inner) for inner in self._coming_to_device(planned)})
        loaded = {}
        for param, values in planned.items():
            inner = self.param_to_inner_param[param]
            optimizer = self._owner[inner]
            live_state = optimizer.state.get(inner, {})
            loaded[param] = {
                key: self._settle(inner, optimizer, live_state.get(key), key, value)
                for key, value in values.items()
            }
        self._loaded_state = loaded
        groups = [
            {k: v for k, v in saved.items() if k not in HDO_OPTIONS}
            for saved in state_dict["param_groups"]
        ]
        for index, step in group_steps.items():  # the post-hook hands them to the sub-groups
            if step is None:
                groups[index].pop("step", None)
            else:
                groups[index]["step"] = step
        return {**state_dict, "state": {}, "param_groups": groups}

    def _coming_to_device(self, planned) -> List[torch.Tensor]:
        """The inner tensors on an accelerator whose planned moments are all tensors elsewhere."""
        coming = []
        for param, values in planned.items():
            inner = self.param_to_inner_param[param]
            moments = [values.get(key) for key in MOMENT_NAMES]
            if all(isinstance(m, torch.Tensor) and m.device != inner.device for m in moments):
                coming.append(inner)
        return coming

    @staticmethod
    def _adopt_loaded_state(self):
        """Load post-hook: install the settled state into the same sub-optimizers."""
        loaded = self.__dict__.pop("_loaded_state", {})
        self.state = StateMap(self._entry_of)
        for param, entry in self._entries.items():
            values = loaded.get(param, {})
            values.pop(MASTER, None)  # already written into the inner tensor
            dict.clear(entry)
            dict.update(entry, values)
            dict.__setitem__(self._shared_sub_state(entry.optimizer), entry.inner, entry)
            self._list_entry(entry)
        self._state_changes.created.clear()
        self._state_changes.parked.clear()
        self._sync_hdo_param_groups_to_sub_optimizers()
        self._hand_back_group_steps()
        self._load_guard.failure = None

    @staticmethod
    def _refuse_after_a_failed_load(self):
        """State-dict pre-hook: a half-written state is not saved."""
        self._load_guard.check("save its state")

    @staticmethod
    def _state_as_plain_dicts(self, state_dict):
        """State-dict post-hook: each parameter's state as a plain dict of its own, so that a
        checkpoint holds no class of this module and later changes to it leave the live state
        alone."""
        state_dict["state"] = {key: dict(entry) for key, entry in state_dict["state"].items()}
        return state_dict

    def _register_load_state_dict_hooks(self):
        """Register the checkpoint hooks (once): loads cast each entry where its inner tensor
        lives, and saved state is made of plain dicts."""
        if getattr(self, "_checkpoint_hooks", None) is not None:
            return
        self._checkpoint_hooks = (
            self.register_load_state_dict_pre_hook(SharedStateMixin._settle_loaded_state),
            self.register_load_state_dict_post_hook(SharedStateMixin._adopt_loaded_state),
            self.register_state_dict_pre_hook(SharedStateMixin._refuse_after_a_failed_load),
            self.register_state_dict_post_hook(SharedStateMixin._state_as_plain_dicts),
        )
