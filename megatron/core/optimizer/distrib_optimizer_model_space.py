# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The distributed checkpoint formats that save the optimizer state in the model's own shapes.

:class:`DistributedOptimizerModelSpaceStateMixin` gives ``DistributedOptimizer`` the two formats
whose checkpoint tensors are shaped like the model parameters and placed like the model's own
entries (``optimizer.state.<key>.<model key>``), so that they load under other parallel layouts:

``fully_reshardable``
    the state is gathered over the data-parallel ranks and saved as whole parameters; a load
    reads the parameters a rank owns a piece of, the wholly owned ones straight into the live
    state, the others into host tensors whose owned slices are kept.
``fully_sharded_model_space`` (the default of ``sharded_state_dict``)
    each owned piece of a parameter is a flattened slice (``flattened_range``) of the
    model-shaped tensor, backed by the live optimizer tensors.

Both load through the plan, agree, write pipeline of
:class:`~megatron.core.optimizer.distrib_optimizer_load.PlannedParamStateLoadMixin`. The
dispatch among formats and the others are in
:mod:`~megatron.core.optimizer.distrib_optimizer_sharded_state`.
"""

from dataclasses import replace
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch

from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensorFactory
from megatron.core.dist_checkpointing.optimizer import KEEP_VARS_HINT
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
from megatron.core.optimizer.distrib_optimizer_load import PlannedParamStateLoadMixin

__all__ = ["DistributedOptimizerModelSpaceStateMixin"]

STATE_KEY_PREFIX = 'optimizer.state'
MEM_EFFICIENT_FLAG = 'distrib_optim_fully_reshardable_mem_efficient'
# Entries of a parameter's state that carry no per-element data. A torch Adam ``step`` is a
# 0-dim tensor restored from the param groups, and the gathered tensors carry their length.
_NOT_ELEMENTWISE = ('step', 'numel_unpadded')


def _model_tensors_by_param(model_sharded_state_dict: ShardedStateDict) -> Dict[Any, Any]:
    """Map each model tensor to the ShardedTensor (or factory) that checkpoints it."""
    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    return {item.data: item for item in nested_values(sharded)}


def _model_metadata(by_param: Mapping[Any, Any], model_param: torch.Tensor):
    """The model's sharded entry for ``model_param``, or a clear error naming the cure."""
    if model_param not in by_param:
        raise ValueError(
            f"Model param {model_param} not in model_sharded_state_dict. Hint: {KEEP_VARS_HINT}"
        )
    return by_param[model_param]


def _state_entry(model_entry, state_key: str, data: torch.Tensor, **changes):
    """The checkpoint entry of one optimizer state tensor of a model parameter.

    It copies the model's entry (global shape, offsets, axis fragmentation) and changes the key
    to ``optimizer.state.<state_key>.<model key>`` and the data; factories keep no dtype.
    """
    changes.update(key=f'{STATE_KEY_PREFIX}.{state_key}.{model_entry.key}', data=data)
    if not isinstance(model_entry, ShardedTensorFactory):
        changes['dtype'] = data.dtype
    entry = replace(model_entry, **changes)
    entry.validate_metadata_integrity()
    return entry


def _model_replica_parts(model_entry) -> Tuple[int, int]:
    """The pipeline and tensor-parallel parts of a model entry's ``(PP, TP, DP)`` replica id,
    which an optimizer state entry keeps; the data-parallel part is the optimizer's to set."""
    if len(model_entry.replica_id) != 3:
        raise AssertionError(f'Expected replica_id format (PP, TP, DP), got: {model_entry}')
    return tuple(model_entry.replica_id[:2])


def _coalesced_bucket_starts(buffer) -> List[int]:
    """Where each bucket begins in a buffer's gathered (``dp_zero``) state tensors.

    Those tensors hold each bucket's unpadded elements back to back: the padding at the end of
    every bucket is dropped, so bucket ``b`` starts at the sum of the unpadded sizes before it.
    """
    starts, cursor = [], 0
    for bucket in buffer.buckets:
        starts.append(cursor)
        cursor += bucket.numel_unpadded
    return starts


def _single_dtype(gbuf_range_map: Mapping) -> Any:
    """The only ``(param_dtype, grad_dtype)`` key of a buffer's range map."""
    if len(gbuf_range_map) != 1:
        raise AssertionError("single dtype supported, for now.")
    return next(iter(gbuf_range_map))


def _checkpointed_tensors(entry: Any, expected: Tuple[str, ...], numel: int, where: str):
    """Check one parameter's loaded state and name it the way the setter expects.

    Args:
        entry: the loaded ``{state key: tensor}`` of one parameter.
        expected: state keys that must be present (``"param"`` for the fp32 master value).
        numel: elements each tensor must hold.
        where: the parameter's description, for error messages.

    Returns:
        dict: ``{"param": ..., <state key>: ...}``; ``fp32_param`` is renamed to ``param`` and
        ``step`` dropped (it is restored with the param groups).
    """
    if not isinstance(entry, Mapping):
        raise ValueError(f"checkpointed optimizer state of {where} is missing or not a dict")
    tensors = {}
    for key, value in entry.items():
        if key in _NOT_ELEMENTWISE:
            continue
        tensors['param' if key == 'fp32_param' else key] = value
    missing = [key for key in expected if key not in tensors]
    if missing:
        raise ValueError(f"checkpointed optimizer state of {where} lacks {missing}")
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"checkpointed '{key}' of {where} is a {type(value).__name__}, not a tensor "
                f"(was the sharded state dict loaded?)"
            )
        if value.numel() != numel:
            raise ValueError(
                f"checkpointed '{key}' of {where} has {value.numel()} elements, expected {numel}"
            )
    return tensors


def _loaded_entry(state_dict: Any, index: int) -> Any:
    """Entry ``index`` of a loaded model-space param state, None when it is absent."""
    if not isinstance(state_dict, Mapping):
        raise ValueError(
            f"the checkpointed param_state is a {type(state_dict).__name__}, expected a dict "
            f"keyed by parameter index"
        )
    return state_dict.get(index)


class DistributedOptimizerModelSpaceStateMixin(PlannedParamStateLoadMixin):
    """``DistributedOptimizer``'s ``fully_reshardable`` and ``fully_sharded_model_space`` formats.

    The host class supplies what the sharded-state mixin's module documentation lists
    (:mod:`~megatron.core.optimizer.distrib_optimizer_sharded_state`), under the same names.
    """

    def _owned_param_ranges(self) -> Iterator[Tuple[torch.nn.Parameter, Dict[str, Any]]]:
        """Locally owned ``(model param, range map)`` pairs, buffer by buffer, bucket by bucket.

        This order numbers the ``fully_sharded_model_space`` entries.
        """
        for gbuf_range_map in self.gbuf_ranges:
            for bucket_range_maps in gbuf_range_map.values():
                for bucket_range_map in bucket_range_maps:
                    yield from bucket_range_map["param_map"].items()

    def _plan_fully_reshardable_param_state(self, state_dict) -> Callable[[], None]:
        """Check a fully_reshardable state; return what writes it."""
        return self._param_state_writer(self._fully_reshardable_load_plan(state_dict))

    def _plan_fs_model_space_param_state(self, state_dict) -> Callable[[], None]:
        """Check a fully_sharded_model_space state; return what writes it."""
        return self._param_state_writer(self._fs_model_space_load_plan(state_dict))

    # ------------------------------------------------------------------------------------
    # fully_reshardable
    # ------------------------------------------------------------------------------------

    def sharded_param_state_fully_reshardable(
        self, model_sharded_state_dict, is_loading: bool = False, metadata: Optional[dict] = None
    ):
        """Whole model-shaped state tensors per parameter, built from the gathered state.

        Every parameter of every buffer gets ``"param"`` (fp32 master) and one tensor per
        optimizer state key, each shaped like the model parameter and keyed
        ``optimizer.state.<key>.<model key>`` with the model's placement and, when saving, its
        replica id (a load request's comes from :meth:`_fully_reshardable_load_replica_id`).

        Saving gathers the buffers' state (``get_parameter_state_dp_zero``) and slices it. Each
        parameter is found in the gathered tensors relative to its bucket, which starts where
        the unpadded sizes of the buckets before it add up to. Loading gathers nothing: each
        rank asks only for the parameters it owns a piece of (entries keep their numbering),
        into the tensors :meth:`_fully_reshardable_load_targets` picks, and
        :meth:`load_parameter_state_from_fully_reshardable` keeps its own slices.

        Args:
            model_sharded_state_dict: the model's sharded state dict; parameters must not be
                flattened.
            is_loading: build the dict to load into.
            metadata: ``distrib_optim_fully_reshardable_mem_efficient=True`` gathers with Gloo
                onto data-parallel rank 0 only (other ranks then save nothing) instead of
                all-gathering with NCCL. Both produce the same checkpoint content.

        Returns:
            dict or None: ``{param index: {key: ShardedTensor or factory}}``, parameters
            numbered buffer by buffer in ``param_index_map`` order; None when saving in
            memory-efficient mode on a rank other than data-parallel rank 0.
        """
        metadata = {} if metadata is None else metadata
        by_param = _model_tensors_by_param(model_sharded_state_dict)
        if is_loading:
            gathered = None
            state_keys = ('param',) + tuple(self.optimizer_state_keys)
            owned = dict(self._owned_param_ranges())
        else:
            mem_efficient = bool(metadata.get(MEM_EFFICIENT_FLAG, False))
            gathered = self.get_parameter_state_dp_zero(
                use_gloo_comm=mem_efficient, empty_data=False, return_on_all_ranks=not mem_efficient
            )
            if gathered is None:
                return None

        state = {}
        index = -1
        for gbuf_idx, gbuf_range_map in enumerate(self.gbuf_ranges):
            dtype = _single_dtype(gbuf_range_map)
            buffer = self.buffers[gbuf_idx]
            if gathered is not None:
                world_tensors = gathered[gbuf_idx][dtype]
                state_keys = tuple(k for k in world_tensors if k not in _NOT_ELEMENTWISE)
                bucket_starts = _coalesced_bucket_starts(buffer)
            for model_param, (start, end, bucket_id) in buffer.param_index_map.items():
                index += 1
                model_entry = _model_metadata(by_param, model_param)
                if model_entry.flattened_range is not None:
                    raise AssertionError(f"Flattened model tensor not supported ({model_entry})")
                shape = model_entry.data.shape
                if gathered is None:
                    if model_param not in owned:
                        continue
                    values = self._fully_reshardable_load_targets(
                        model_param, owned[model_param]["param"], model_entry, state_keys
                    )
                else:
                    bucket = buffer.buckets[bucket_id]
                    first = bucket_starts[bucket_id] + start - bucket.offset
                    values = {}
                    for key in state_keys:
                        world = world_tensors[key]
                        if first + end - start > world.numel():
                            raise AssertionError(
                                f"'{model_entry.key}' ends at element {first + end - start} "
                                f"of the gathered '{key}' state, which has only {world.numel()}"
                            )
                        values[key] = world[first : first + end - start].reshape(shape)
                changes = {}
                if gathered is None:
                    changes['replica_id'] = self._fully_reshardable_load_replica_id(
                        model_entry, owned[model_param]["param"]
                    )
                state[index] = {
                    key: _state_entry(model_entry, key, value, **changes)
                    for key, value in values.items()
                }
        return state

    def _fully_reshardable_load_replica_id(self, model_entry, piece) -> Tuple[int, int, int]:
        """The replica id of a ``fully_reshardable`` load request for one owned parameter.

        Only the ranks owning a piece of a parameter ask for it, so data-parallel rank 0 (the
        main replica of the model's entry) may not be among them. Dist-checkpointing's access
        check wants one main replica for every part of every tensor: it is the rank whose
        piece starts the parameter, in the first distributed optimizer instance. The model's
        pipeline and tensor-parallel parts are kept, so tensor-parallel replicas stay apart.

        Args:
            model_entry: the model's checkpoint entry of the parameter.
            piece: the range of the parameter that this rank owns.

        Returns:
            tuple: ``(model's first part, model's second part, 0 or 1)``, 0 on the main replica.
        """
        main = piece.start == 0 and self.distributed_optimizer_instance_id == 0
        return (*_model_replica_parts(model_entry), 0 if main else 1)

    def _fully_reshardable_load_targets(self, model_param, piece, model_entry, state_keys):
        """The tensors a ``fully_reshardable`` read fills for one owned parameter.

        The checkpoint holds each parameter whole, in fp32. Where this rank owns all of it and
        the model's entry is a plain tensor, each key's target is the tensor a plain cast
        stores the value into (:meth:`_main_param_and_optimizer_load_targets`: the live fp32
        or bf16 state, or the host tensor a scale is computed from), viewed in the model's
        shape, so that nothing is staged. Elsewhere (a piece of a parameter, a factory's
        entry, int16 remainders, which the load checks before it converts them) the target is
        a zero-filled host fp32 tensor of the whole parameter, of which the load keeps the
        owned slice.

        Args:
            model_param: a parameter this rank owns a piece of.
            piece: the owned piece's range in the parameter.
            model_entry: the model's checkpoint entry of the parameter.
            state_keys: ``"param"`` and the optimizer state keys.

        Returns:
            dict: one tensor of the model parameter's shape per key of ``state_keys``.
        """
        shape = model_entry.data.shape
        live = {}
        if piece.size == shape.numel() and isinstance(model_entry, ShardedTensor):
            live = self._main_param_and_optimizer_load_targets(model_param)
        targets = {}
        for key in state_keys:
            target = live.get(key)
            if (
                isinstance(target, torch.Tensor)
                and target.dtype in (torch.float32, torch.bfloat16)
                and target.is_contiguous()
                and target.numel() == shape.numel()
            ):
                targets[key] = target.view(shape)
            else:
                targets[key] = torch.zeros(shape, dtype=torch.float32)
        return targets

    def _fully_reshardable_load_plan(self, state_dict: Any):
        """Check a loaded ``fully_reshardable`` state and pick the locally owned slices.

        Returns:
            list: ``(model param, {"param": ..., <state key>: ...})`` for each owned piece, the
            tensors being views of the loaded ones.
        """
        expected = ('param',) + tuple(self.optimizer_state_keys)
        plan = []
        index = -1
        for gbuf_idx, gbuf_range_map in enumerate(self.gbuf_ranges):
            dtype = _single_dtype(gbuf_range_map)
            owned = {}
            for bucket_range_map in gbuf_range_map[dtype]:
                owned.update(bucket_range_map["param_map"])
            # Entries are numbered over all of the buffer's parameters, owned or not.
            for model_param, (start, end, _) in self.buffers[gbuf_idx].param_index_map.items():
                index += 1
                if model_param not in owned:
                    continue
                where = f"parameter {index} (shape {tuple(model_param.shape)})"
                full = _checkpointed_tensors(
                    _loaded_entry(state_dict, index), expected, end - start, where
                )
                piece = owned[model_param]["param"]
                plan.append(
                    (
                        model_param,
                        {k: v.reshape(-1)[piece.start : piece.end] for k, v in full.items()},
                    )
                )
        return plan

    @torch.no_grad()
    def load_parameter_state_from_fully_reshardable(self, state_dict: dict):
        """Load what :meth:`sharded_param_state_fully_reshardable` described.

        Every entry is checked before the first is written; then each owned slice is copied
        into the optimizer's existing tensors.

        Args:
            state_dict: the loaded ``param_state``: parameter index -> whole state tensors.
        """
        self._plan_agree_write(
            "load_parameter_state_from_fully_reshardable",
            lambda: self._plan_fully_reshardable_param_state(state_dict),
        )

    # ------------------------------------------------------------------------------------
    # fully_sharded_model_space (deprecated)
    # ------------------------------------------------------------------------------------

    def sharded_param_state_fs_model_space(
        self, model_sharded_state_dict, is_loading: bool = False, metadata: Optional[dict] = None
    ):
        """Each owned parameter slice as a flattened piece of a model-shaped tensor.

        An owned slice's state (``fp32_param`` and each optimizer state key) is described by
        the model parameter's entry with ``flattened_range`` set to the slice and the
        data-parallel coordinate of the replica id set to the optimizer instance. The data are
        the live optimizer tensors. A torch ``step`` stays a plain tensor (not checkpointed per
        element). Tensor and pipeline parallelism may change between save and load.

        Returns:
            dict: ``{index: {key: ShardedTensor or factory}}``, owned slices numbered buffer by
            buffer, bucket by bucket.
        """
        del metadata  # the layout does not depend on it
        by_param = _model_tensors_by_param(model_sharded_state_dict)
        tensors_of = (
            self._main_param_and_optimizer_load_targets
            if is_loading
            else self._get_main_param_and_optimizer_states
        )
        state = {}
        for index, (model_param, param_range_map) in enumerate(self._owned_param_ranges()):
            tensors = tensors_of(model_param)
            tensors['fp32_param'] = tensors.pop('param')
            model_entry = _model_metadata(by_param, model_param)
            replica_id = (
                *_model_replica_parts(model_entry),
                self.distributed_optimizer_instance_id,
            )
            piece = param_range_map['param']
            for key, value in tensors.items():
                if key == 'step':
                    continue
                tensors[key] = _state_entry(
                    model_entry,
                    key,
                    value,
                    flattened_range=slice(piece.start, piece.end),
                    replica_id=replica_id,
                )
            state[index] = tensors
        return state

    def _fs_model_space_load_plan(self, state_dict: Any):
        """Check a loaded ``fully_sharded_model_space`` state, pairing it with owned params."""
        expected = ('param',) + tuple(self.optimizer_state_keys)
        plan = []
        for index, (model_param, param_range_map) in enumerate(self._owned_param_ranges()):
            where = f"parameter slice {index} (shape {tuple(model_param.shape)})"
            tensors = _checkpointed_tensors(
                _loaded_entry(state_dict, index), expected, param_range_map['param'].size, where
            )
            plan.append((model_param, tensors))
        return plan

    @torch.no_grad()
    def load_parameter_state_from_fs_model_space(self, state_dict):
        """Load what :meth:`sharded_param_state_fs_model_space` described.

        Usually the checkpoint was read straight into the optimizer's tensors and the copies
        here are no-ops; everything is checked before anything is written.

        Args:
            state_dict: the loaded ``param_state``: index -> ``{"fp32_param", <state key>...}``.
        """
        self._plan_agree_write(
            "load_parameter_state_from_fs_model_space",
            lambda: self._plan_fs_model_space_param_state(state_dict),
        )
