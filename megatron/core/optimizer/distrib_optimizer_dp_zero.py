# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""``dp_zero``: the distributed optimizer's parameter state as one file for the whole world.

This is the "legacy" checkpoint format (``save_parameter_state``/``load_parameter_state``, and
distributed checkpointing's ``dp_zero_gather_scatter``). Every rank lays its shard of a bucket
out flat, data-parallel rank 0 gathers the shards and strips the padding at the end of each
bucket, and one world tensor per state key holds a whole buffer. Loading cuts the world
tensors back into shards and scatters them, so the file loads under any data-parallel size.
On disk::

    {"buckets_coalesced": True,
     gbuf_idx: {(param_dtype, grad_dtype): {"param": t, "exp_avg": t, ...,
                                             "numel_unpadded": n}}, ...}

Files written before the buckets were coalesced key a buffer by ``torch.float32`` and hold one
tensor per old bucket; ``update_legacy_format=True`` reads those. A file whose FP8 parameters
shared a buffer with the others is split to the current buffers
(``split_state_dict_if_needed``).
"""

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from megatron.core.optimizer import state_load_checks as checks
from megatron.core.optimizer.distrib_optimizer_load import PlannedParamStateLoadMixin

__all__ = ["DpZeroParamStateMixin"]

BUCKETS_COALESCED = "buckets_coalesced"
NUMEL_UNPADDED = "numel_unpadded"
LEGACY_BUFFER_KEY = torch.float32
"""Key of each buffer's entry in a file written before buckets were coalesced."""


def _naming_the_file(error: Exception, filename) -> Exception:
    """``error`` from reading ``filename``, of the same type where it can be, with a message
    that names the file and what it should have been."""
    message = (
        f"cannot read the parameter-state file {str(filename)!r}: expected a dp_zero file "
        f"written by save_parameter_state (is it truncated, or not a torch.save file?): "
        f"{type(error).__name__}: {error}"
    )
    try:
        return type(error)(message)
    except Exception:  # pylint: disable=broad-exception-caught
        return ValueError(message)


def _shard_views(
    bucket_state: torch.Tensor, padded_numel: int, world_size: int, device: torch.device
) -> List[torch.Tensor]:
    """Cut one bucket's unpadded world tensor into the ``world_size`` equal shards of the
    padded bucket; only shards reaching into the end padding are copied (and zero-filled)."""
    shard_numel = padded_numel // world_size
    unpadded_numel = bucket_state.numel()
    shards = []
    for first in range(0, padded_numel, shard_numel):
        last = first + shard_numel
        if last <= unpadded_numel:
            shard = bucket_state[first:last]
        else:
            shard = torch.zeros(shard_numel, dtype=torch.float32)
            if first < unpadded_numel:
                shard[: unpadded_numel - first].copy_(bucket_state[first:])
        shards.append(shard.to(device=device, dtype=torch.float32))
    return shards


class DpZeroParamStateMixin(PlannedParamStateLoadMixin):
    """``DistributedOptimizer``'s save and load of the ``dp_zero`` parameter-state format.

    The host class provides what the ``torch.save`` formats' mixin documents
    (:mod:`~megatron.core.optimizer.distrib_optimizer_param_state`), with that mixin's walkers
    over buffers and buckets (``_param_state_keys``, ``_param_state_buffers``,
    ``_bucket_numels``) and its reader of one saved entry (``_saved_entry``).
    """

    # ---------------------------------------------------------------- dp_zero: save

    def get_parameter_state_dp_zero(
        self,
        use_gloo_comm: bool = True,
        empty_data: bool = False,
        return_on_all_ranks: bool = False,
    ):
        """Gather every rank's shard state into whole-buffer fp32 CPU tensors.

        Args:
            use_gloo_comm: move the shards over the gloo data-parallel group (when the
                optimizer has one) rather than the main one.
            empty_data: only allocate the world tensors (zero-filled), with no collective;
                used to build a structure to load into.
            return_on_all_ranks: all-gather, so every rank gets the world tensors.

        Returns:
            dict or None: the ``dp_zero`` state (see the module docstring) on data-parallel
            rank 0, or on every rank with ``return_on_all_ranks``; None elsewhere.
        """
        group, device = self._param_state_group(use_gloo_comm)
        rank, world_size = group.rank(), group.size()
        keeps_result = rank == 0 or return_on_all_ranks
        keys = self._param_state_keys()
        state = {BUCKETS_COALESCED: True}
        for gbuf_idx, dtypes, bucket_maps in self._param_state_buffers():
            numels = self._bucket_numels(gbuf_idx, dtypes, world_size)
            world_tensors = {}
            if keeps_result:
                total = sum(unpadded for _, unpadded in numels)
                world_tensors = {key: torch.zeros(total, dtype=torch.float32) for key in keys}
                world_tensors[NUMEL_UNPADDED] = total
            if not empty_data:
                offset = 0
                for bucket_map, (padded, unpadded) in zip(bucket_maps, numels):
                    shard = self._read_bucket_shard(bucket_map, keys, padded // world_size)
                    for row, key in enumerate(keys):
                        gathered = self._gather_shard(
                            shard[row], group, device, return_on_all_ranks
                        )
                        if gathered is not None:
                            world_tensors[key][offset : offset + unpadded].copy_(
                                gathered[:unpadded]
                            )
                    offset += unpadded
            state[gbuf_idx] = {dtypes: world_tensors}
        return state if keeps_result else None

    def _read_bucket_shard(self, bucket_map, keys, shard_numel: int) -> torch.Tensor:
        """This rank's shard of one bucket as a ``(len(keys), shard_numel)`` fp32 CPU tensor;
        the gaps no parameter covers stay zero."""
        shard = torch.zeros((len(keys), shard_numel), dtype=torch.float32)
        for model_param, ranges in bucket_map["param_map"].items():
            tensors = self._get_main_param_and_optimizer_states(model_param)
            local = ranges["gbuf_local"]
            for row, key in enumerate(keys):
                if key not in tensors:
                    raise KeyError(
                        f"the optimizer keeps no '{key}' state for a parameter; it must step "
                        f"(or have its state materialised) before its state is saved"
                    )
                shard[row, local.start : local.end].copy_(tensors[key].detach().reshape(-1))
        return shard

    @staticmethod
    def _gather_shard(shard, group, device, to_all: bool) -> Optional[torch.Tensor]:
        """Concatenate one key's shard from every rank, on rank 0 (or every rank)."""
        world_size = group.size()
        keeps_result = to_all or group.rank() == 0
        pieces = None
        if keeps_result:
            pieces = [torch.empty_like(shard, device=device) for _ in range(world_size)]
        shard = shard.to(device)
        if to_all:
            torch.distributed.all_gather(pieces, shard, group=group)
        else:
            root = torch.distributed.get_global_rank(group, 0)
            torch.distributed.gather(shard, pieces, dst=root, group=group)
        return torch.cat(pieces).cpu() if keeps_result else None

    def save_parameter_state(self, filename: str):
        """Gather the parameter state and write it to ``filename`` from data-parallel rank 0.

        Args:
            filename (str): path of the file to write.
        """
        self._ready_for("save its parameter state")
        state_dict = self.get_parameter_state_dp_zero()
        if self.data_parallel_group.rank() == 0:
            torch.save(state_dict, filename)

    # ---------------------------------------------------------------- dp_zero: load

    def load_parameter_state(self, filename: str, *, update_legacy_format=False):
        """Read a ``dp_zero`` file on data-parallel rank 0 and scatter it to every rank.

        Args:
            filename (str): path of a file written by :meth:`save_parameter_state`.
            update_legacy_format (bool): the file predates coalesced buckets.
        """
        if getattr(self, "is_stub_optimizer", False):
            return
        state_dict, problem = None, None
        if self.data_parallel_group.rank() == 0:
            try:
                state_dict = torch.load(filename, map_location="cpu", weights_only=True)
            except Exception as error:  # pylint: disable=broad-exception-caught
                problem = _naming_the_file(error, filename)
        else:
            filename = None

        def plan(state):
            try:
                return self._plan_dp_zero_param_state(state, update_legacy_format, problem)
            except (KeyError, ValueError) as error:
                if filename is None or str(filename) in str(error):
                    raise
                message = f"{filename}: {error.args[0] if error.args else ''}"
                raise type(error)(message) from error

        self._plan_agree_write("load_parameter_state", lambda: plan(state_dict))

    def load_parameter_state_from_dp_zero(self, state_dict, *, update_legacy_format=False):
        """Scatter a ``dp_zero`` state held by data-parallel rank 0 into every rank's shards.

        The inverse of :meth:`get_parameter_state_dp_zero`: each bucket's world tensors are
        padded back to the bucket size, cut into equal shards, and each rank writes its shard
        into its parameters' state. Ranks other than 0 pass None.

        Args:
            state_dict: the loaded file on rank 0.
            update_legacy_format (bool): read the pre-coalescing format
                (:meth:`load_parameter_state_from_dp_zero_legacy`).

        Raises:
            ValueError: the state belongs to another model (sizes differ).
            KeyError: a buffer, dtype entry or state tensor is missing.
        """
        self._plan_agree_write(
            "load_parameter_state_from_dp_zero",
            lambda: self._plan_dp_zero_param_state(state_dict, update_legacy_format),
        )

    def load_parameter_state_from_dp_zero_legacy(self, state_dict):
        """Scatter a ``dp_zero`` state written before buckets were coalesced.

        Such files key each buffer by ``torch.float32`` and keep a list of per-bucket tensors
        cut at the old bucket boundaries; they are re-cut at this run's boundaries
        (:meth:`_update_legacy_world_tensors`), which needs the same total size.
        """
        self._plan_agree_write(
            "load_parameter_state_from_dp_zero_legacy",
            lambda: self._plan_dp_zero_param_state(state_dict, True),
        )

    @classmethod
    def _update_legacy_world_tensors(cls, old_tensors, new_numels):
        """Re-cut a buffer's per-bucket tensors at new bucket sizes of the same total.

        Args:
            old_tensors: the tensors of the old buckets, in order.
            new_numels: element count of each new bucket.

        Returns:
            list[torch.Tensor]: one tensor per new bucket (views of one concatenation).

        Raises:
            ValueError: if the totals differ.
        """
        old_total = sum(tensor.numel() for tensor in old_tensors)
        new_total = sum(new_numels)
        if old_total != new_total or not old_tensors:
            raise ValueError(
                f"cannot re-cut {old_total} checkpointed elements into buckets of {new_total}"
            )
        joined = torch.cat([tensor.reshape(-1) for tensor in old_tensors])
        return list(joined.split(list(new_numels)))

    def _plan_dp_zero_param_state(self, state_dict, legacy: bool, problem=None):
        """Check a dp_zero state on rank 0; return what scatters it. The other ranks have
        nothing to check: the agreement after every plan (``_agree_on_plan``) gives them rank
        0's verdict.

        Args:
            state_dict: the state on data-parallel rank 0 (anything elsewhere).
            legacy: the pre-coalescing format.
            problem: an error rank 0 already met reading it (raised here).
        """
        group, _ = self._param_state_group()
        per_bucket = None
        if group.rank() == 0:
            if problem is not None:
                raise problem
            per_bucket = self._dp_zero_bucket_states(state_dict, legacy)
            checks.scan_nonfinite(
                (
                    (f"bucket {index} of buffer {gbuf_idx}", key, value)
                    for gbuf_idx, buckets in per_bucket.items()
                    for index, bucket in enumerate(buckets)
                    for key, value in bucket.items()
                ),
                "the dp_zero parameter state",
            )
        return lambda: self._scatter_dp_zero_state(per_bucket)

    @torch.no_grad()
    def _scatter_dp_zero_state(self, per_bucket) -> None:
        """Scatter a checked dp_zero state bucket by bucket (``per_bucket`` on rank 0 only)."""
        group, device = self._param_state_group()
        is_root = group.rank() == 0
        self._begin_param_state_load()
        keys = self._param_state_keys()
        for gbuf_idx, dtypes, bucket_maps in self._param_state_buffers():
            numels = self._bucket_numels(gbuf_idx, dtypes, group.size())
            for bucket_idx, (bucket_map, (padded, _)) in enumerate(zip(bucket_maps, numels)):
                bucket_state = per_bucket[gbuf_idx][bucket_idx] if is_root else None
                received = {
                    key: self._scatter_shard(
                        bucket_state[key] if is_root else None, padded, group, device
                    )
                    for key in keys
                }
                for model_param, ranges in bucket_map["param_map"].items():
                    local = ranges["gbuf_local"]
                    self._set_main_param_and_optimizer_states(
                        model_param,
                        {key: shard[local.start : local.end] for key, shard in received.items()},
                    )
        self.inner_state.finish_load()

    @staticmethod
    def _scatter_shard(bucket_state, padded_numel: int, group, device) -> torch.Tensor:
        """Rank 0 sends each rank its shard of one bucket's world tensor; returns this rank's."""
        world_size = group.size()
        if world_size == 1:
            # The only shard is the loaded bucket itself: its pieces are written straight from
            # it, without a padded copy and the scatter's second one (each as large as it).
            return bucket_state.to(torch.float32)
        shard = torch.empty(padded_numel // world_size, dtype=torch.float32, device=device)
        shards = None
        if bucket_state is not None:
            shards = _shard_views(bucket_state, padded_numel, world_size, device)
        root = torch.distributed.get_global_rank(group, 0)
        torch.distributed.scatter(shard, shards, src=root, group=group)
        return shard

    def _dp_zero_bucket_states(self, state_dict, legacy: bool):
        """Check a ``dp_zero`` state against the model and cut it into per-bucket views.

        Returns:
            dict: ``{gbuf_idx: [{key: unpadded bucket tensor}, ...]}`` in bucket order.
        """
        if not isinstance(state_dict, Mapping):
            raise ValueError(
                f"expected the dp_zero parameter state as a dict on data-parallel rank 0, got "
                f"{type(state_dict).__name__} (is the checkpoint's param_state missing?)"
            )
        if "param_state" in state_dict:
            raise KeyError(
                "this is a whole optimizer state dict; load its 'param_state' entry instead"
            )
        if not legacy:
            # Rearranges the file only when FP8 parameters sit in buffers of their own.
            self.split_state_dict_if_needed(state_dict)
            self._refuse_extra_buffers(state_dict)
        keys = self._param_state_keys()
        hint = ""
        if not legacy and BUCKETS_COALESCED not in state_dict:
            hint = " (the file predates coalesced buckets: load it with update_legacy_format=True)"
        per_bucket = {}
        for gbuf_idx, dtypes, _ in self._param_state_buffers():
            unpadded = [used for _, used in self._bucket_numels(gbuf_idx, dtypes, 1)]
            total = sum(unpadded)
            try:
                entry = self._saved_entry(
                    state_dict, gbuf_idx, LEGACY_BUFFER_KEY if legacy else dtypes
                )
            except KeyError as error:
                raise KeyError(f"{error.args[0]}{hint}") from None
            missing = [key for key in keys if key not in entry]
            if missing:
                raise KeyError(f"buffer {gbuf_idx} of the parameter state lacks {missing}{hint}")
            if legacy:
                per_bucket[gbuf_idx] = self._legacy_bucket_states(entry, keys, unpadded, gbuf_idx)
                continue
            saved_total = entry.get(NUMEL_UNPADDED)
            if saved_total != total:
                raise ValueError(
                    f"the checkpoint is of another model: buffer {gbuf_idx} holds {total} "
                    f"elements in this run and {saved_total} in the checkpoint"
                )
            for key in keys:
                if not isinstance(entry[key], torch.Tensor) or entry[key].numel() != total:
                    raise ValueError(
                        f"'{key}' of buffer {gbuf_idx} should be a tensor of {total} elements"
                    )
            cuts = [entry[key].reshape(-1).split(unpadded) for key in keys]
            per_bucket[gbuf_idx] = [dict(zip(keys, bucket)) for bucket in zip(*cuts)]
        return per_bucket

    def _refuse_extra_buffers(self, state_dict) -> None:
        """A file with more buffers than the model was written for another model."""
        extra = [key for key in state_dict if isinstance(key, int) and key >= len(self.gbuf_ranges)]
        if extra:
            raise ValueError(
                f"the checkpoint is of another model: it holds buffers {sorted(extra)} beyond "
                f"this run's {len(self.gbuf_ranges)}"
            )

    def _legacy_bucket_states(
        self, entry, keys, unpadded: Sequence[int], gbuf_idx: int
    ) -> List[Dict[str, torch.Tensor]]:
        """Re-cut each key's old per-bucket tensors at this run's bucket sizes."""
        cuts = []
        for key in keys:
            tensors = entry[key]
            if not isinstance(tensors, (list, tuple)) or not all(
                isinstance(tensor, torch.Tensor) for tensor in tensors
            ):
                raise ValueError(
                    f"'{key}' of buffer {gbuf_idx} should be a list of per-bucket tensors in "
                    f"the legacy format"
                )
            try:
                cuts.append(self._update_legacy_world_tensors(tensors, unpadded))
            except ValueError as error:
                raise ValueError(
                    f"the checkpoint is of another model: '{key}' of buffer {gbuf_idx}: {error}"
                ) from None
        return [dict(zip(keys, bucket)) for bucket in zip(*cuts)]

    # ---------------------------------------------------------------- FP8 split

    def split_state_dict_if_needed(self, state_dict):
        """Rearrange, in place, a ``dp_zero`` state saved without ``--fp8-param-gather`` for
        a run with it.

        Without FP8 parameter gather, weights and biases share one buffer; with it, FP8
        weights get a buffer of their own (keyed ``(torch.uint8, grad_dtype)``) next to the
        16-bit one. The shared buffer's world tensors are then split into the two: walking the
        parameters from the highest index down (the order a buffer lays them out), each
        parameter's elements go to the FP8 or the 16-bit tensor. Nothing happens when the run
        has no FP8 buffer or the state is already split.
        """
        quantized = [
            gbuf_idx
            for gbuf_idx in range(len(self.gbuf_ranges))
            if self._is_distopt_quantized_param(self.buffers[gbuf_idx].params[0])
        ]
        if not quantized:
            return
        saved_index = {}
        for key, per_dtype in state_dict.items():
            if key == BUCKETS_COALESCED:
                continue
            for dtypes in per_dtype:
                if dtypes[0] == torch.uint8:
                    return
                if dtypes in saved_index:
                    raise ValueError(
                        f"the checkpoint holds two {dtypes} buffers; it cannot be split for FP8 "
                        f"parameter buffers"
                    )
                saved_index[dtypes] = key

        result = {BUCKETS_COALESCED: state_dict[BUCKETS_COALESCED]}
        for gbuf_idx, dtypes, _ in self._param_state_buffers():
            if gbuf_idx in quantized:
                continue
            if dtypes not in saved_index:
                raise KeyError(f"the checkpoint has no {dtypes} buffer for buffer {gbuf_idx}")
            result[gbuf_idx] = dict(state_dict[saved_index[dtypes]])

        for fp8_idx in quantized:
            fp8_buffer = self.buffers[fp8_idx]
            # A quantized parameter reports its nominal 16-bit dtype, that of the buffer its
            # elements were saved in.
            shared_dtypes = (fp8_buffer.params[0].dtype, fp8_buffer.grad_dtype)
            partners = [
                gbuf_idx
                for gbuf_idx, dtypes, _ in self._param_state_buffers()
                if dtypes == shared_dtypes
            ]
            if not partners:
                raise ValueError(
                    f"no {shared_dtypes} buffer to split FP8 buffer {fp8_idx}'s state from"
                )
            shared_idx = partners[-1]
            pieces = self._fp8_split_order(fp8_buffer, self.buffers[shared_idx])
            fp8_state, shared_state = self._split_world_tensors(
                result[shared_idx][shared_dtypes], pieces, fp8_idx
            )
            result[fp8_idx] = {(torch.uint8, fp8_buffer.grad_dtype): fp8_state}
            result[shared_idx][shared_dtypes] = shared_state

        state_dict.clear()
        state_dict.update(result)

    @staticmethod
    def _fp8_split_order(fp8_buffer, shared_buffer) -> List[Tuple[bool, int]]:
        """``(is_fp8, numel)`` of every parameter, from the highest parameter index down.

        Each buffer lists its parameters in increasing ``param_indices`` order, and together
        the two buffers must hold every index from 0 up exactly once.
        """
        by_index = {}
        for is_fp8, buffer in ((True, fp8_buffer), (False, shared_buffer)):
            for index, param in zip(sorted(buffer.param_indices), buffer.params):
                if index in by_index:
                    raise ValueError(f"parameter index {index} is in both FP8 split buffers")
                by_index[index] = (is_fp8, param.nelement())
        if sorted(by_index) != list(range(len(by_index))):
            raise ValueError("the FP8 split buffers' parameter indices are not 0..n-1")
        return [by_index[index] for index in sorted(by_index, reverse=True)]

    def _split_world_tensors(self, shared_entry, pieces, fp8_idx: int):
        """Split each key's world tensor into its FP8 and 16-bit elements."""
        fp8_state, shared_state = {}, {}
        needed = sum(numel for _, numel in pieces)
        for key in self._param_state_keys():
            whole = shared_entry[key]
            if whole.numel() < needed:
                raise ValueError(
                    f"'{key}' has {whole.numel()} elements, too few for the {needed} of the "
                    f"parameters split into FP8 buffer {fp8_idx}"
                )
            parts = {True: [], False: []}
            offset = 0
            for is_fp8, numel in pieces:
                parts[is_fp8].append(whole[offset : offset + numel])
                offset += numel
            for target, is_fp8 in ((fp8_state, True), (shared_state, False)):
                chosen = parts[is_fp8]
                target[key] = torch.cat(chosen) if chosen else whole.new_empty(0)
        fp8_state[NUMEL_UNPADDED] = sum(numel for is_fp8, numel in pieces if is_fp8)
        shared_state[NUMEL_UNPADDED] = sum(numel for is_fp8, numel in pieces if not is_fp8)
        return fp8_state, shared_state
