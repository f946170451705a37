# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Distributed-checkpointing (``dist_checkpointing``) support of the distributed optimizer.

:class:`DistributedOptimizerShardedStateMixin` gives ``DistributedOptimizer`` its
``sharded_state_dict`` and the loaders that undo it. The checkpoint layouts are those of
megatron-core 0.19.2, so either implementation loads what the other saved. One format is picked
by ``metadata["distrib_optim_sharding_type"]``:

``fully_sharded_model_space`` (the default)
    every locally owned piece of a parameter becomes a flattened slice (``flattened_range``) of
    a tensor shaped like the model parameter; the data are the live optimizer tensors, so a
    load lands in them directly.
``fully_reshardable``
    the state is gathered over data-parallel ranks and cut into whole tensors shaped like the
    model parameters (``optimizer.state.<key>.<model key>``); a load asks only for the
    parameters a rank owns a piece of, reads those it owns whole into the live state and the
    others into host tensors, of which it keeps the owned slices.
``dp_reshardable``
    one checkpoint tensor per bucket and state key, the pieces of which are this rank's
    parameter slices plus padding; only the data-parallel size may change between save and load.
``dp_zero_gather_scatter``
    the whole gathered state as one object saved by data-parallel rank 0 (deprecated).
``fsdp_dtensor``
    Megatron-FSDP only: the inner optimizer's own state, keyed by parameter name.

The two formats shaped like the model (``fully_sharded_model_space``, ``fully_reshardable``) are
in :mod:`~megatron.core.optimizer.distrib_optimizer_model_space`.

Compared with 0.19.2, ``fully_reshardable`` locates each parameter correctly in the gathered
tensors when a buffer has several buckets (0.19.2 ignored the padding stripped at the end of
every bucket and saved shifted or zero-filled state), its load stages no whole copy of the
model's state on every rank's host, optimizer state is created through
``self.inner_state.materialise()`` instead of a training step, and the loaders check the whole
checkpointed state before writing any of it.

The host class supplies the attributes under upstream's names (``gbuf_ranges``, ``buffers``,
``data_parallel_group``, ``data_parallel_group_idx``, ``distributed_optimizer_instance_id``,
``ddp_config``, ``model_chunks``, ``optimizer``, ``state``, ``optimizer_state_keys``,
``inner_state``) and the methods ``state_dict``, ``_get_main_param_and_optimizer_states``,
``_main_param_and_optimizer_load_targets``, ``_set_main_param_and_optimizer_states``,
``get_parameter_state_dp_zero``, ``get_parameter_state_dp_reshardable`` and
``_dp_reshardable_layout``.
"""

import gc
import logging
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch

from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedStateDict,
)
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
from megatron.core.optimizer import state_load_checks as checks
from megatron.core.optimizer.distrib_optimizer_formats import (
    DEFAULT_SHARDING_TYPE,
    FORMATS,
    FSDP_DTENSOR,
    LAYOUT_FREE_FORMATS,
    format_named,
)
from megatron.core.optimizer.distrib_optimizer_load import PlannedParamStateLoadMixin
from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_experts_in_state_dict
from megatron.core.utils import log_single_rank

logger = logging.getLogger(__name__)

LOADABLE_SHARDING_TYPES = tuple(name for name, fmt in FORMATS.items() if fmt.loadable)
"""Values of ``param_state_sharding_type`` that ``load_state_dict`` accepts."""


def _holds_tensors(description: Any) -> bool:
    """Whether a sharded description holds tensors (or factories) that a read fills."""
    sharded, _ = extract_sharded_tensors_and_factories({'param_state': description})
    return any(True for _ in nested_values(sharded))


def _names_of_params(model_chunks) -> Dict[torch.Tensor, str]:
    """Parameter -> name over all model chunks, expert indices made global.

    Names must be unique across chunks, since checkpoints are keyed by them.
    """
    named = [dict(chunk.named_parameters()) for chunk in model_chunks]
    by_name = {}
    for chunk_params in named:
        shared = set(by_name).intersection(chunk_params)
        if shared:
            raise ValueError(
                f"Parameter names conflict between model chunks: {shared}. Model chunks "
                "must not repeat a parameter name."
            )
        by_name.update(chunk_params)
    num_experts = model_chunks[0].config.num_moe_experts if model_chunks else None
    return {
        param: name for name, param in handle_experts_in_state_dict(by_name, num_experts).items()
    }


class DistributedOptimizerShardedStateMixin(PlannedParamStateLoadMixin):
    """Sharded (``dist_checkpointing``) state dicts of ``DistributedOptimizer``.

    See the module documentation for the formats and for what the host class must supply.
    """

    # Formats whose common state does not depend on the optimizer's internal buffer layout, so
    # it is saved as plain values rather than per-data-parallel-group objects.
    checkpoint_fully_reshardable_formats: set[str] = set(LAYOUT_FREE_FORMATS)

    # ------------------------------------------------------------------------------------
    # Helpers
    # ------------------------------------------------------------------------------------

    def _init_optimizer_states_with_dummy_values(self):
        """Give every parameter its optimizer state so a checkpoint can be loaded into it.

        The inner-optimizer contract creates the missing state without moving parameters or
        step counters (an actual step with zero gradients would apply weight decay).
        """
        self.inner_state.materialise()

    def _loaded_state_tensors(self) -> List[Any]:
        """The inner optimizer's parameters and the state of each group's first one: the
        devices and dtypes a load's non-finite scan meets."""
        tensors = []
        for group in self.optimizer.param_groups:
            tensors += group["params"]
            if group["params"]:
                tensors += self.optimizer.state.get(group["params"][0], {}).values()
        return tensors

    def _param_name(self, param: torch.nn.Parameter) -> str:
        """The name of a model parameter, as the model chunks call it.

        Expert parameters get their global expert index (see ``handle_experts_in_state_dict``).
        The mapping is computed once and kept in ``self.param_to_name``.
        """
        if getattr(self, 'param_to_name', None) is None:
            self.param_to_name = _names_of_params(self.model_chunks)
        try:
            return self.param_to_name[param]
        except KeyError:
            raise AssertionError(
                f"Parameter {param} not found in param_to_name mapping. "
            ) from None

    def _dp_group_key(self, name: str) -> str:
        """Checkpoint key of an object that differs between data-parallel groups."""
        return f'optimizer.distributed.dp_group_idx_{self.data_parallel_group_idx}.{name}'

    # ------------------------------------------------------------------------------------
    # Entry point
    # ------------------------------------------------------------------------------------

    def sharded_state_dict(
        self,
        model_sharded_state_dict: ShardedStateDict = {},  # never modified
        is_loading: bool = False,
        sharding_type: Optional[str] = None,
        metadata: Optional[dict] = None,
    ):
        """The optimizer's sharded state dict in the format the metadata asks for.

        Args:
            model_sharded_state_dict: the model's sharded state dict, whose entries (made with
                ``keep_vars=True``) give each parameter's checkpoint key and placement.
            is_loading: build the dict to load into rather than to save. The optimizer state
                is created first if it does not exist yet.
            sharding_type: deprecated; use ``metadata["distrib_optim_sharding_type"]``.
            metadata: ``distrib_optim_sharding_type`` picks the format (default
                ``fully_sharded_model_space``); ``distrib_optim_fully_reshardable_mem_efficient``
                tunes ``fully_reshardable``.

        Returns:
            dict: for ``fsdp_dtensor`` the dict of :meth:`sharded_param_state_fsdp_dtensor`;
            otherwise the entries of ``state_dict()`` (wrapped in per-data-parallel-group
            ``ShardedObject``s unless the format is fully reshardable) plus ``param_state`` and
            ``param_state_sharding_type``.

        Raises:
            NotImplementedError: unknown format, or a format Megatron-FSDP cannot use; raised
                before the optimizer is touched.
        """
        # A load request holds the live tensors, which the reader writes into.
        self._finish_step_behind()
        if not is_loading:
            self._load_guard.check("save its state")
        metadata = {} if metadata is None else metadata
        if sharding_type is None:
            sharding_type = metadata.get('distrib_optim_sharding_type', DEFAULT_SHARDING_TYPE)
        else:
            log_single_rank(
                logger,
                logging.WARNING,
                'DistributedOptimizer.sharded_state_dict argument `sharding_type` is deprecated'
                ' and will be removed; set `metadata["distrib_optim_sharding_type"]` instead.',
            )

        if self.ddp_config.use_megatron_fsdp and sharding_type != FSDP_DTENSOR:
            raise NotImplementedError(
                f"sharding_type {sharding_type} is not supported with Megatron FSDP."
            )
        if sharding_type == FSDP_DTENSOR:
            return self.sharded_param_state_fsdp_dtensor(is_loading)
        fmt = format_named(sharding_type)

        if is_loading:
            # The load writes into the optimizer's own tensors, which must exist by then.
            self._init_optimizer_states_with_dummy_values()
            checks.warm_up_nonfinite_scan(self._loaded_state_tensors())
            common_state = self._common_state_dict()
        else:
            common_state = self.state_dict()
        if not fmt.layout_free:
            # This state is tied to the data-parallel group's buffer layout.
            replica_id = (
                self.distributed_optimizer_instance_id,
                0,
                self.data_parallel_group.rank(),
            )
            common_state = {
                key: ShardedObject(
                    self._dp_group_key(key), value, (1,), (0,), replica_id=replica_id
                )
                for key, value in common_state.items()
            }

        param_state = fmt.describe(self, model_sharded_state_dict, is_loading, metadata)
        if is_loading:
            # The reader fills the tensors of the request in place, before load_state_dict can
            # check anything: if that load then refuses the checkpoint, the state is already
            # partly its. A request without tensors (dp_zero_gather_scatter's one object) is
            # read into new memory, so a refusal then leaves the state as it was.
            self._load_request_outstanding = _holds_tensors(param_state)
        if fmt.gathers:
            # The gathers leave large temporaries behind, and training may run with GC off.
            gc.collect()

        common_state['param_state'] = param_state
        common_state['param_state_sharding_type'] = sharding_type
        return common_state

    def _check_param_state_for_load(self, state_dict: Mapping) -> None:
        """Check a loaded optimizer state dict's ``param_state`` (see
        :meth:`_plan_param_state_load`), writing nothing."""
        self._plan_param_state_load(state_dict)

    def _plan_param_state_load(self, state_dict: Mapping) -> Optional[Callable[[], None]]:
        """Check a loaded optimizer state dict's ``param_state``; return what writes it.

        ``load_state_dict`` calls this first, so that a checkpoint it cannot load fails before
        param groups, grad scaler or optimizer state change: every format is checked entry by
        entry against this optimizer (a dp_zero state on data-parallel rank 0, whose verdict
        every rank then shares).

        Returns:
            The writer of the checked state, or None when there is no ``param_state``.

        Raises:
            ValueError, KeyError: ``param_state`` without its ``param_state_sharding_type`` or
                the other way round, or parameter state that does not fit this optimizer.
            NotImplementedError: a sharding type nothing can load.
        """
        has_state = 'param_state' in state_dict
        has_type = 'param_state_sharding_type' in state_dict
        if has_state != has_type:
            present, absent = (
                ('param_state', 'param_state_sharding_type')
                if has_state
                else ('param_state_sharding_type', 'param_state')
            )
            raise ValueError(
                f"the optimizer state dict has '{present}' but no '{absent}' "
                f"(keys: {sorted(map(str, state_dict.keys()))})"
            )
        if not has_state:
            return None
        fmt = format_named(state_dict['param_state_sharding_type'])
        return fmt.plan(self, state_dict['param_state'])

    def _plan_dp_zero_gather_scatter_param_state(self, state_dict) -> Callable[[], None]:
        """Check a dp_zero state (on data-parallel rank 0); return what scatters it."""
        return self._plan_dp_zero_param_state(state_dict, False)

    # ------------------------------------------------------------------------------------
    # Megatron-FSDP
    # ------------------------------------------------------------------------------------

    def _param_groups_to_param2group_meta(
        self, param_groups: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """Map each parameter's name to its group's settings (the group less ``params``).

        Parameters of one group share one settings dict.
        """
        pairs = []
        for group in param_groups:
            settings = {key: value for key, value in group.items() if key != "params"}
            pairs.extend((self._param_name(param), settings) for param in group["params"])
        return dict(pairs)

    def _param2group_meta_to_param_groups(
        self, param_to_group_meta: dict[str, Any], param_groups: list[dict[str, Any]], strict=True
    ) -> list[dict[str, Any]]:
        """Rebuild checkpointed param groups in the order of the current ``param_groups``.

        Each current group becomes ``{"params": [names...], **settings}``, the settings being
        those saved for its parameters, which must agree within a group.

        Args:
            param_to_group_meta: parameter name -> saved group settings.
            param_groups: the optimizer's current groups (of parameters).
            strict: raise on a parameter without saved settings or with settings differing
                from the rest of its group; otherwise warn and leave that parameter out.

        Raises:
            ValueError: in strict mode, as described above.
        """
        rebuilt = []
        for group in param_groups:
            names, settings = [], {}
            for name in map(self._param_name, group["params"]):
                saved = param_to_group_meta.get(name)
                if name not in param_to_group_meta:
                    problem = f"Parameter {name} not found in param_to_group_meta mapping."
                elif settings and settings != saved:
                    # Settings collected so far must match; none collected matches anything.
                    problem = (
                        f"Parameter {name} was saved with group settings {saved}, but the "
                        f"parameters {names} of the same current group were saved with "
                        f"{settings}; the checkpoint's param groups do not match this "
                        f"optimizer's."
                    )
                else:
                    names.append(name)
                    settings.update(saved)
                    continue
                if strict:
                    raise ValueError(problem)
                logger.warning(problem)
            rebuilt.append({"params": names, **settings})
        return rebuilt

    def sharded_param_state_fsdp_dtensor(self, is_loading: bool = False):
        """The inner optimizer's state and group settings keyed by parameter name.

        With Megatron-FSDP the optimizer state is made of DTensors, which the checkpoint
        handles directly.

        Args:
            is_loading: create the optimizer state first, for an in-place load.

        Returns:
            dict: ``{"state": {name: state}, "param_to_group_meta": {name: settings}}``.
        """
        if not self.ddp_config.use_megatron_fsdp:
            raise AssertionError("fsdp_dtensor sharding type is only supported with Megatron FSDP.")
        if is_loading:
            self._init_optimizer_states_with_dummy_values()
        param_to_group_meta = self._param_groups_to_param2group_meta(self.optimizer.param_groups)
        state = {}
        for key, value in self.state.items():
            state[self._param_name(key) if isinstance(key, torch.Tensor) else key] = value
        return {"state": state, "param_to_group_meta": param_to_group_meta}

    def _load_state_dict_megatron_fsdp(self, state_dict):
        """Megatron-FSDP: the wrapped optimizer loads the state dict itself, once every rank
        has checked its share against the optimizer's groups and parameters (counts, state
        keys, shapes, steps, non-finite values) and nothing has changed before."""

        def plan():
            if "param_to_group_meta" in state_dict:
                state_dict["param_groups"] = self._param2group_meta_to_param_groups(
                    state_dict.pop("param_to_group_meta"), self.optimizer.param_groups
                )
            checks.plan_optimizer_state_dict(
                state_dict,
                self.optimizer.param_groups,
                f"{type(self).__name__}.load_state_dict (Megatron-FSDP)",
                live_keys={k for entry in self.optimizer.state.values() for k in entry},
            )
            return lambda: self.optimizer.load_state_dict(state_dict)

        self._plan_agree_write("load_state_dict (Megatron-FSDP)", plan)

    # ------------------------------------------------------------------------------------
    # dp_zero_gather_scatter (deprecated)
    # ------------------------------------------------------------------------------------

    def sharded_param_state_dp_zero(
        self, model_sharded_state_dict, is_loading: bool = False, metadata: Optional[dict] = None
    ):
        """The gathered parameter state as one object, saved by data-parallel rank 0.

        The layout is that of ``get_parameter_state_dp_zero`` and fixed to the current
        tensor/pipeline parallelism. Loading reads it on rank 0 and relies on
        ``load_parameter_state_from_dp_zero`` to scatter it.

        Returns:
            ShardedObject on rank 0 of the first optimizer instance (data None when loading),
            else ``LocalNonpersistentObject(None)``.
        """
        del model_sharded_state_dict, metadata  # the layout does not depend on them
        first_instance = self.distributed_optimizer_instance_id == 0
        data = None
        if first_instance and not is_loading:
            # Every rank of the first instance takes part in the gather.
            data = self.get_parameter_state_dp_zero(use_gloo_comm=False)
        if first_instance and self.data_parallel_group.rank() == 0:
            return ShardedObject(self._dp_group_key('param_state'), data, (1,), (0,))
        return LocalNonpersistentObject(None)

    # ------------------------------------------------------------------------------------
    # dp_reshardable
    # ------------------------------------------------------------------------------------

    def sharded_param_state_dp_reshardable(
        self, model_sharded_state_dict, is_loading: bool = False, metadata: Optional[dict] = None
    ):
        """The local state as pieces of one checkpoint tensor per bucket and state key.

        ``get_parameter_state_dp_reshardable`` lists each bucket's owned parameter slices with
        their place in the rank's shard. Gaps between (and around) them become padding pieces,
        so that the pieces of all ranks cover the tensor, whose length is the bucket's unpadded
        size: the padding past it depends on the data-parallel size and is left out. Keys are
        ``optimizer.distributed.dp_group_idx_<i>.gbuf_idx_<g>.dtype_<d>.bucket_idx_<b>.<key>``.
        Saving, pieces are views of the live optimizer tensors (unscaled fp32 copies for
        precision-aware state). Loading, they are the live tensors wherever the saved value is
        stored by a plain cast, so the read lands in place and allocates nothing; state the
        inner optimizer must scale is read into host tensors. No data is exchanged; only the
        data-parallel size may change between save and load.

        Returns:
            dict: ``get_parameter_state_dp_reshardable``'s dict with ShardedTensors in place of
            tensors, ``padding`` and ``step`` wrapped as local non-persistent objects, and the
            bucket sizes as ShardedObjects.
        """
        del model_sharded_state_dict, metadata  # the layout depends on neither
        dp_rank = self.data_parallel_group.rank()
        dp_size = self.data_parallel_group.size()
        if is_loading:
            state = self._dp_reshardable_layout(self._main_param_and_optimizer_load_targets)
        else:
            state = self.get_parameter_state_dp_reshardable()
        for name in ('per_bucket_numel', 'per_bucket_numel_unpadded'):
            state[name] = ShardedObject(
                self._dp_group_key(name),
                state[name],
                (1,),
                (0,),
                replica_id=(self.distributed_optimizer_instance_id, 0, dp_rank),
            )
        for gbuf_idx in range(len(self.gbuf_ranges)):
            for dtype, buckets_state in state[gbuf_idx].items():
                for bucket_idx, entries in enumerate(buckets_state):
                    key_prefix = self._dp_group_key(
                        f'gbuf_idx_{gbuf_idx}.dtype_{dtype}.bucket_idx_{bucket_idx}'
                    )
                    buckets_state[bucket_idx] = self._sharded_bucket_pieces(
                        entries,
                        self.buffers[gbuf_idx].buckets[bucket_idx],
                        dp_rank,
                        dp_size,
                        key_prefix,
                    )
        return state

    def _sharded_bucket_pieces(self, entries, bucket, dp_rank, dp_size, key_prefix):
        """One bucket's ``dp_reshardable`` pieces: owned slices and padding, in shard order.

        Args:
            entries: ``{state tensors..., "gbuf_local_start", "gbuf_local_end"}`` per owned
                parameter slice, in shard order.
            bucket: the buffer's bucket (``grad_data``, ``numel_unpadded``).
            dp_rank: this rank in the data-parallel group.
            dp_size: the data-parallel group's size.
            key_prefix: checkpoint key of the bucket, completed by the state key.
        """
        bucket_numel = bucket.grad_data.numel()
        unpadded_numel = bucket.numel_unpadded
        if unpadded_numel > bucket_numel or bucket_numel % dp_size:
            raise AssertionError(
                f"bucket of {bucket_numel} elements ({unpadded_numel} unpadded) cannot be "
                f"split into {dp_size} equal shards"
            )
        if not entries:
            raise AssertionError('empty bucket encountered')
        shard_numel = bucket_numel // dp_size
        shard_start = dp_rank * shard_numel

        pieces = []
        for position in range(len(entries) + 1):
            gap_start = entries[position - 1]['gbuf_local_end'] if position else 0
            gap_end = (
                entries[position]['gbuf_local_start'] if position < len(entries) else shard_numel
            )
            # A gap needs covering only where it starts inside the unpadded bucket. Its tensors
            # copy the dtypes of the entry before it (the last entry for a leading gap).
            if gap_end != gap_start and shard_start + gap_start < unpadded_numel:
                like = entries[position - 1]
                padding = {
                    k: torch.empty(gap_end - gap_start, dtype=v.dtype, device=v.device)
                    for k, v in like.items()
                    if isinstance(v, torch.Tensor)
                }
                padding.update(gbuf_local_start=gap_start, gbuf_local_end=gap_end, padding=True)
                pieces.append(padding)
            if position < len(entries):
                pieces.append(entries[position])

        replica_id = (self.distributed_optimizer_instance_id, 0, 0)
        for piece in pieces:
            local_start = piece.pop('gbuf_local_start')
            local_end = piece.pop('gbuf_local_end')
            piece.setdefault('padding', False)
            for key, value in piece.items():
                if key in ('padding', 'step'):
                    # Loader bookkeeping, and the 0-dim step restored from the param groups.
                    piece[key] = LocalNonpersistentObject(value)
                    continue
                if value.shape != (local_end - local_start,):
                    raise AssertionError(
                        f"'{key}' of shape {tuple(value.shape)} does not fill its shard range "
                        f"[{local_start}, {local_end})"
                    )
                piece[key] = ShardedTensor(
                    f'{key_prefix}.{key}',
                    value,
                    value.dtype,
                    value.shape,
                    (unpadded_numel,),
                    (shard_start + local_start,),
                    axis_fragmentations=None,
                    replica_id=replica_id,
                    allow_shape_mismatch=False,
                    flattened_range=None,
                )
        return pieces
