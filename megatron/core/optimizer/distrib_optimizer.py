# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The distributed optimizer: optimizer state sharded over the data-parallel ranks.

DDP keeps each model chunk's parameters and gradients in contiguous buffers cut into buckets,
and every bucket into one equal shard per data-parallel rank (see
:mod:`megatron.core.optimizer.distrib_optimizer_ranges`). A rank updates only the elements of its
shards: after the gradient reduce-scatter it hands the inner optimizer fp32 (or, with the
precision-aware optimizer, model-dtype) views of its pieces of each parameter, and after the
step it writes the updated pieces back into the parameter buffer for the all-gather.

This module holds the core of megatron-core 0.19.2's ``DistributedOptimizer``: construction,
the shard and main-parameter bookkeeping, offloading between training phases, the step and the
parameter sync. The rest comes from mixins, a module each:

* :class:`DistributedOptimizerStateDictMixin`: ``state_dict``/``load_state_dict`` and the access
  to each owned piece's main value and optimizer state that every format goes through;
* :class:`MainParamCopiesMixin`: gradients into the inner optimizer, updated values back into
  the parameter buffer, FP8/NVFP4 casts;
* :class:`ModelParamReloadMixin`: main pieces refreshed from model weights or a checkpoint;
* the formats of the parameter state: :class:`DistributedOptimizerShardedStateMixin`
  (distributed checkpointing; its model-shaped formats in
  :class:`DistributedOptimizerModelSpaceStateMixin`) and
  :class:`DistributedOptimizerParameterStateMixin` (``torch.save`` files).

Every load runs one pipeline (plan, agree, write, finish:
:class:`~megatron.core.optimizer.distrib_optimizer_load.PlannedParamStateLoadMixin`), and every
access to the inner optimizer's per-parameter state goes through
:class:`~megatron.core.optimizer.inner_optimizer_state.InnerOptimizerState` (``self.inner_state``),
so that plain torch optimizers, TE/Apex FusedAdam and the HybridDeviceOptimizer are handled by
what they offer rather than by their class.
"""

import itertools
import logging
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron.core import tensor_parallel
from megatron.core.config_logger import has_config_logger_enabled, log_config_to_disk
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer, partition_buckets
from megatron.core.fp4_utils import is_nvfp4tensor
from megatron.core.optimizer import distrib_optimizer_behind as behind_forward
from megatron.core.optimizer import distrib_optimizer_ranges as ranges
from megatron.core.optimizer import fork_info, inner_optimizer_state
from megatron.core.optimizer import state_load_checks as checks
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.optimizer.distrib_optimizer_behind import StepBehindForward
from megatron.core.optimizer.distrib_optimizer_formats import FORMATS
from megatron.core.optimizer.distrib_optimizer_main_params import MainParamCopiesMixin
from megatron.core.optimizer.distrib_optimizer_model_space import (
    DistributedOptimizerModelSpaceStateMixin,
)
from megatron.core.optimizer.distrib_optimizer_param_state import (
    DistributedOptimizerParameterStateMixin,
)
from megatron.core.optimizer.distrib_optimizer_ranges import Range
from megatron.core.optimizer.distrib_optimizer_reload import ModelParamReloadMixin
from megatron.core.optimizer.distrib_optimizer_sharded_state import (
    DistributedOptimizerShardedStateMixin,
)
from megatron.core.optimizer.distrib_optimizer_state_dict import DistributedOptimizerStateDictMixin
from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.inner_optimizer_state import InnerOptimizerState
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer, copy_optimizer_param_metadata
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.param_layout import FullParamLayout, PerBufferParamLayout
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import log_single_rank

# Besides the class, the names other code imports from this module, as in 0.19.2.
__all__ = [
    "DistributedOptimizer",
    "Range",
    "HybridDeviceOptimizer",
    "MixedPrecisionOptimizer",
    "HAVE_APEX_OR_TE",
    "USING_APEX_OPTIMIZER",
    "USING_TE_OPTIMIZER",
]

logger = logging.getLogger(__name__)

# Lets tests and tools tell this implementation from upstream's.
FORK_IMPLEMENTATION = True


def _find_adam() -> Tuple[type, bool, bool]:
    """The Adam class megatron-core builds: TE's FusedAdam, else Apex's, else torch's.

    Returns:
        tuple: ``(class, comes from TE, comes from Apex)``.
    """
    # pylint: disable=import-outside-toplevel
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam

        return FusedAdam, True, False
    except ImportError:
        pass
    try:
        from apex.optimizers import FusedAdam

        return FusedAdam, False, True
    except ImportError:
        return torch.optim.Adam, False, False


# Kept under upstream's module-level names: other code imports or patches them. Nothing in
# this module branches on them any more; the step count is found wherever the optimizer keeps it.
Adam, USING_TE_OPTIMIZER, USING_APEX_OPTIMIZER = _find_adam()
HAVE_APEX_OR_TE = USING_TE_OPTIMIZER or USING_APEX_OPTIMIZER

# ``Tensor.type()`` names of the parameters the optimizer accepts. Upstream classifies by these
# strings, which also pins parameters to CUDA; the same test is kept.
_FLOAT16_TYPE_NAMES = ("torch.cuda.HalfTensor", "torch.cuda.BFloat16Tensor")
_FLOAT32_TYPE_NAME = "torch.cuda.FloatTensor"


def _is_float16_param(param: torch.Tensor) -> bool:
    return param.type() in _FLOAT16_TYPE_NAMES


def _is_float32_param(param: torch.Tensor) -> bool:
    return param.type() == _FLOAT32_TYPE_NAME


def _clear_main_param_slots(param_groups: List[Dict]) -> None:
    """Mark every trainable 16-bit parameter as having a sharded main copy, none yet."""
    trainable = (p for group in param_groups for p in group["params"] if p.requires_grad)
    for param in trainable:
        if _is_float16_param(param):
            param.main_param, param.main_param_sharded = None, True


def _check_supported_optimizer(optimizer, init_state_fn) -> None:
    """Refuse an inner optimizer whose state cannot be created for checkpoint loading."""
    if optimizer is None or init_state_fn is not None:
        return
    if isinstance(optimizer, (Adam, torch.optim.AdamW)):
        return
    if inner_optimizer_state.kind_of(optimizer).builds_own_state:
        return
    raise AssertionError(
        f"DistributedOptimizer cannot wrap {type(optimizer).__name__}: its state could not be "
        f"rebuilt when a checkpoint is loaded. Use Adam ({Adam.__module__}.{Adam.__name__}), "
        "torch.optim.AdamW or the HybridDeviceOptimizer, or pass an init_state_fn (as for Lion)."
    )


def _inherit_param_attributes(shard: torch.Tensor, model_param: torch.Tensor) -> None:
    """Give a shard (a view or a copy) the parallelism and optimizer tags of its parameter, which
    gradient clipping and checkpointing read from whatever tensor they are handed."""
    tensor_parallel.copy_tensor_model_parallel_attributes(shard, model_param)
    tensor_parallel.copy_gtp_attributes(shard, model_param)
    copy_optimizer_param_metadata(shard, model_param)


class DistributedOptimizer(
    DistributedOptimizerShardedStateMixin,
    DistributedOptimizerModelSpaceStateMixin,
    DistributedOptimizerParameterStateMixin,
    DistributedOptimizerStateDictMixin,
    MainParamCopiesMixin,
    ModelParamReloadMixin,
    MixedPrecisionOptimizer,
):
    """Mixed-precision optimizer whose state is sharded over the data-parallel ranks.

    Args:
        optimizer: the inner optimizer (Adam, AdamW, the HybridDeviceOptimizer, or one with an
            ``init_state_fn``), built over the model parameters; its param groups are pointed at
            this rank's shards. None builds a stub for ranks that optimize nothing.
        config: optimizer configuration.
        grad_scaler: loss scaler; may be None for bf16 without loss scaling.
        init_state_fn: creates the inner optimizer's state (optimizers other than Adam).
        model_chunks: the DDP-wrapped model chunks; they must share one ``ddp_config``.
        per_model_buffers: model chunk index -> that chunk's ``_ParamAndGradBuffer`` list.
        data_parallel_group: the group the state is sharded over (and params all-gathered in).
        data_parallel_group_gloo: a Gloo group over the same ranks, for checkpoint traffic.
        data_parallel_group_idx: index of the data-parallel group, for checkpoint keys.
        distributed_optimizer_instance_id: which distributed optimizer instance this is.

    Attributes:
        model_chunks, ddp_config, distributed_optimizer_instance_id: as given.
        is_stub_optimizer: whether there is no inner optimizer.
        inner_state: the :class:`InnerOptimizerState` of the inner optimizer (None for a stub).
        buffers: every buffer of every chunk, in chunk order.
        gbuf_ranges: per buffer, ``{(param_dtype, grad_dtype): [bucket range map, ...]}``.
        model_param_gbuf_map: owned parameter -> ``(buffer index, dtypes, bucket index)``.
        model_param_group_index_map: owned parameter -> ``(group index, position in group)``.
        opt_group_ranges: per param group, the owned parameters and the group itself.
        model_float16_groups, model_fp32_groups: the owned model parameters by group.
        shard_float16_groups, shard_fp32_groups: views of the owned pieces of those parameters.
        shard_fp32_from_float16_groups: fp32 main copies of the 16-bit pieces (None entries with
            the precision-aware optimizer, which keeps them itself).
    """

    @classmethod
    def _build_model_gbuf_param_range_map(
        cls, param_world_index_map, gbuf_world_range, bucket_offset
    ):
        """Map each parameter overlapping one shard to its four ranges.

        See :func:`~megatron.core.optimizer.distrib_optimizer_ranges.build_param_range_map`.
        """
        return ranges.build_param_range_map(param_world_index_map, gbuf_world_range, bucket_offset)

    @classmethod
    def _build_model_gbuf_range(cls, param_and_grad_buffer: _ParamAndGradBuffer, bucket_index: int):
        """What the local rank owns of one bucket.

        See :func:`~megatron.core.optimizer.distrib_optimizer_ranges.build_bucket_range`.
        """
        return ranges.build_bucket_range_from_group(param_and_grad_buffer, bucket_index)

    @classmethod
    def _build_gbuf_range_map(cls, param_and_grad_buffer: _ParamAndGradBuffer):
        """What the local rank owns of every bucket of a buffer.

        See :func:`~megatron.core.optimizer.distrib_optimizer_ranges.build_buffer_range_map`.
        """
        return ranges.build_buffer_range_map_from_group(param_and_grad_buffer)

    @classmethod
    def _build_model_param_gbuf_map(
        cls, gbuf_ranges: List[Dict]
    ) -> Dict[torch.nn.Parameter, Tuple]:
        """Owned parameter -> ``(buffer index, dtypes, bucket index)``.

        See :func:`~megatron.core.optimizer.distrib_optimizer_ranges.build_param_to_bucket_map`.
        """
        return ranges.build_param_to_bucket_map(gbuf_ranges)

    @classmethod
    def _build_optimizer_group_ranges(cls, param_groups: List[Dict], gbuf_ranges: List[Dict]):
        """Sort the owned parameters into the optimizer's param groups.

        See :func:`~megatron.core.optimizer.distrib_optimizer_ranges.build_optimizer_group_ranges`.
        """
        return ranges.build_optimizer_group_ranges(param_groups, gbuf_ranges)

    @staticmethod
    def _compute_per_buffer_param_layout(
        params, bucket_size, data_parallel_world_size, ddp_config, param_indices=None
    ) -> PerBufferParamLayout:
        """Lay out one buffer's parameters and buckets.

        See :func:`.distrib_optimizer_ranges.compute_per_buffer_param_layout`.
        """
        return ranges.compute_per_buffer_param_layout(
            params, bucket_size, data_parallel_world_size, ddp_config, param_indices
        )

    @staticmethod
    def compute_full_param_layout(
        params,
        bucket_size,
        data_parallel_world_size,
        ddp_config,
        expert_data_parallel_world_size=None,
    ) -> FullParamLayout:
        """Lay out every buffer of a model chunk (DDP allocates its buffers from this).

        See :func:`~megatron.core.optimizer.distrib_optimizer_ranges.compute_full_param_layout`.
        """
        return ranges.compute_full_param_layout(
            params,
            bucket_size,
            data_parallel_world_size,
            ddp_config,
            expert_data_parallel_world_size,
        )

    # ------------------------------------------------------------------ main parameters

    @classmethod
    def _float16_shard_and_main(
        cls, model_param: torch.nn.Parameter, param_range: Range, config: OptimizerConfig
    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The owned piece of a 16-bit (or quantized) parameter and its fp32 main copy."""
        quantized = cls._is_distopt_quantized_param(model_param)
        nvfp4 = is_nvfp4tensor(model_param)
        start, end = param_range.start, param_range.end

        # MXFP8, blockwise, grouped and NVFP4 tensors cannot be viewed flat; delayed-scaling FP8
        # tensors can.
        if (quantized and config.fp8_recipe != "delayed") or nvfp4:
            shard = None
        else:
            shard = model_param.detach().view(-1)[start:end]
            _inherit_param_attributes(shard, model_param)

        if config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return shard, None  # the inner optimizer keeps the main copy

        if quantized or nvfp4:
            # Prefer the value the parameter had before quantization, when it was kept:
            # starting from dequantized values would lose precision until a checkpoint loads.
            if hasattr(model_param, "get_high_precision_init_val"):
                full = model_param.get_high_precision_init_val()
                main = full.view(-1)[start:end].clone().to(model_param.device).float()
                model_param.clear_high_precision_init_val()
            else:
                main = model_param.float().view(-1)[start:end]
        else:
            main = shard.clone().float()
        _inherit_param_attributes(main, model_param)
        return shard, main

    @classmethod
    def _build_model_and_main_param_groups(
        cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config: OptimizerConfig
    ):
        """Make the shards the inner optimizer updates, and point its groups at them.

        Each owned parameter contributes the piece this rank owns: for fp32 parameters a view
        (the optimizer updates it in place), for 16-bit parameters a view plus an fp32 main
        copy that the optimizer updates instead (unless the precision-aware optimizer keeps
        main copies itself; then it is handed the 16-bit views). 16-bit parameters also get
        ``main_param`` (their main copy) and ``main_param_sharded = True``. Each group's
        ``orig_group["params"]`` becomes its fp32 shards followed by its 16-bit ones.

        Args:
            gbuf_ranges: per buffer, the range maps of its buckets.
            param_gbuf_map: owned parameter -> where its ranges are in ``gbuf_ranges``.
            opt_group_ranges: per param group, its owned parameters and the group.
            config: optimizer configuration.

        Returns:
            tuple: ``(model_float16_groups, model_fp32_groups, shard_float16_groups,
            shard_fp32_groups, shard_fp32_from_float16_groups)``, one list per group each.

        Raises:
            TypeError: a parameter is neither a CUDA fp32 nor a CUDA fp16/bf16 tensor.
        """
        precision_aware = config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
        result = tuple([] for _ in range(5))
        model_16, model_32, shard_16, shard_32, main_16 = result

        for group_range in opt_group_ranges:
            for groups in result:
                groups.append([])
            for model_param in group_range["params"]:
                if not model_param.requires_grad:
                    raise AssertionError("the distributed optimizer got a frozen parameter")
                buffer_index, dtypes, bucket_index = param_gbuf_map[model_param]
                bucket_range = gbuf_ranges[buffer_index][dtypes][bucket_index]
                param_range = bucket_range["param_map"][model_param]["param"]

                if _is_float16_param(model_param):
                    shard, main = cls._float16_shard_and_main(model_param, param_range, config)
                    model_param.main_param = main
                    model_param.main_param_sharded = True
                    model_16[-1].append(model_param)
                    shard_16[-1].append(shard)
                    main_16[-1].append(main)
                elif _is_float32_param(model_param):
                    # Detached (upstream's is not): a leaf view of the same elements, which an
                    # optimizer that adds it as a param group (the HybridDeviceOptimizer)
                    # accepts; stepping it still updates the parameter in place.
                    flat = model_param.detach().view(-1)
                    shard = flat[param_range.start : param_range.end]
                    _inherit_param_attributes(shard, model_param)
                    model_32[-1].append(model_param)
                    shard_32[-1].append(shard)
                else:
                    raise TypeError(
                        "The distributed optimizer takes torch.cuda.FloatTensor, "
                        "torch.cuda.HalfTensor or torch.cuda.BFloat16Tensor parameters, "
                        f"not {model_param.type()}"
                    )

            stepped_16 = shard_16[-1] if precision_aware else main_16[-1]
            group_range["orig_group"]["params"] = [*shard_32[-1], *stepped_16]

        return result

    # ------------------------------------------------------------------ construction

    def __init__(
        self,
        optimizer: Optional[torch.optim.Optimizer],
        config: OptimizerConfig,
        grad_scaler: Optional[MegatronGradScaler],
        init_state_fn: Optional[Callable],
        model_chunks: List[MegatronModule],
        per_model_buffers,
        data_parallel_group,
        data_parallel_group_gloo,
        data_parallel_group_idx: int,
        distributed_optimizer_instance_id: int,
    ):
        """Shard the inner optimizer's parameters over the data-parallel ranks.

        Raises:
            AssertionError: the inner optimizer is not supported, the model chunks disagree on
                their DDP config, or ``per_model_buffers`` is missing; raised before anything
                (the inner optimizer included) is changed.
        """
        _check_supported_optimizer(optimizer, init_state_fn)
        if not model_chunks:
            raise AssertionError("the distributed optimizer needs at least one model chunk")
        ddp_config = model_chunks[0].ddp_config
        if any(chunk.ddp_config != ddp_config for chunk in model_chunks[1:]):
            raise AssertionError("all model chunks must share one DistributedDataParallelConfig")
        needs_buffers = optimizer is not None and not ddp_config.use_megatron_fsdp
        if needs_buffers and per_model_buffers is None:
            raise AssertionError("per_model_buffers must be provided")

        if has_config_logger_enabled(config):
            log_config_to_disk(config, locals(), prefix=type(self).__name__)

        super().__init__(optimizer, config, grad_scaler, init_state_fn)
        self.model_chunks = model_chunks
        self.ddp_config = ddp_config
        self.distributed_optimizer_instance_id = distributed_optimizer_instance_id

        fork_info.announce(type(self))
        # Set while a load is writing and left set when it fails there (state_load_checks).
        self._load_guard = checks.LoadGuard(type(self).__name__)
        # The parameter syncs' gates while the offloaded step runs behind the forward.
        self._step_behind: Optional[StepBehindForward] = None
        # Set by a dist-checkpoint load request, whose reader writes into the live state.
        self._load_request_outstanding = False
        # A rank whose sub-models are all frozen still takes part, with no inner optimizer.
        self.is_stub_optimizer = optimizer is None
        if self.is_stub_optimizer:
            self.inner_state = None
            return
        self.inner_state = InnerOptimizerState(
            optimizer,
            self.optimizer_state_keys,
            precision_aware=config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
        )
        if self.ddp_config.use_megatron_fsdp:
            return  # Megatron-FSDP shards the weights and gradients itself

        self.per_model_buffers = per_model_buffers
        self.buffers = list(itertools.chain(*per_model_buffers.values()))
        self.data_parallel_group = data_parallel_group
        self.data_parallel_group_gloo = data_parallel_group_gloo
        self.data_parallel_group_idx = data_parallel_group_idx

        buffer_owners = [
            model_idx for model_idx, buffers in per_model_buffers.items() for _ in buffers
        ]
        self.gbuf_idx_to_model_idx_map = dict(enumerate(buffer_owners))
        self.per_model_bucket_groups = {
            model_idx: partition_buckets(buffers)
            for model_idx, buffers in per_model_buffers.items()
        }

        self.gbuf_ranges = []
        self.per_bucket_numel = []
        self.per_bucket_numel_unpadded = []
        for buffer in self.buffers:
            dtypes = (buffer.param_dtype, buffer.grad_dtype)
            self.per_bucket_numel.append({dtypes: [b.grad_data.numel() for b in buffer.buckets]})
            self.per_bucket_numel_unpadded.append(
                {dtypes: [b.numel_unpadded for b in buffer.buckets]}
            )
            self.gbuf_ranges.append(self._build_gbuf_range_map(buffer))
        self.model_param_gbuf_map = self._build_model_param_gbuf_map(self.gbuf_ranges)

        index_map, group_ranges = self._build_optimizer_group_ranges(
            self.optimizer.param_groups, self.gbuf_ranges
        )
        self.model_param_group_index_map = index_map
        self.opt_group_ranges = group_ranges
        # Every 16-bit parameter gets a main_param slot (read when computing parameter norms);
        # the ones this rank owns a piece of are filled in next.
        _clear_main_param_slots(self.optimizer.param_groups)
        model_16, model_32, shard_16, shard_32, main_16 = self._build_model_and_main_param_groups(
            self.gbuf_ranges, self.model_param_gbuf_map, group_ranges, config
        )
        self.model_float16_groups = model_16
        self.model_fp32_groups = model_32
        self.shard_float16_groups = shard_16
        self.shard_fp32_groups = shard_32
        self.shard_fp32_from_float16_groups = main_16

        self._inner_param_index = self._index_inner_params()

        # The same optimizer object now steps the shards (for the HybridDeviceOptimizer
        # without rebuilding it, so nothing it allocated is thrown away).
        self.inner_state.retarget(
            [group_range["orig_group"] for group_range in self.opt_group_ranges]
        )
        self._step_behind = self._make_step_behind_forward(config)

    def _make_step_behind_forward(self, config) -> Optional[StepBehindForward]:
        """The gates of the parameter syncs where the offloaded step is asked to run behind the
        next forward and can (see :mod:`distrib_optimizer_behind`); None otherwise."""
        if not behind_forward.asked_for(config):
            return None
        reason = behind_forward.unsuitable(config, self.ddp_config)
        if reason is not None:
            behind_forward.warn_off(reason)
            return None
        precision_aware = config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
        stepped_of = dict(self._model_and_main_pairs(model_dtype_shards=precision_aware))
        copied_of = {} if precision_aware else dict(self._model_and_main_pairs())
        groups = []
        for bucket_group, position in behind_forward.forward_order(self.model_chunks):
            params = [p for b in bucket_group.buckets for p in b.params_list if p in stepped_of]
            if params:
                groups.append(
                    behind_forward.GatedGroup(
                        bucket_group,
                        position,
                        [stepped_of[p] for p in params],
                        [(p, copied_of[p]) for p in params if p in copied_of],
                    )
                )
        inner = self.inner_state
        gates = StepBehindForward(
            groups, inner.wait_for_params, inner.step_pending, inner.finish_step, self._copy_pairs
        )
        if not inner.step_behind_forward(gates.step_order()):
            # Only an optimizer with a host step has one to run behind the forward.
            if config.optimizer_cpu_offload:
                behind_forward.warn_off(f"{type(self.optimizer).__name__} cannot run it")
            return None
        return gates

    def _get_model_param_range_map(self, param: torch.nn.Parameter):
        """The four ranges (``gbuf_world``, ``gbuf_world_in_bucket``, ``gbuf_local``,
        ``param``) of the piece of ``param`` this rank owns."""
        buffer_index, dtypes, bucket_index = self.model_param_gbuf_map[param]
        return self.gbuf_ranges[buffer_index][dtypes][bucket_index]["param_map"][param]

    def get_grad_stats_parallel_group(self) -> torch.distributed.ProcessGroup:
        """The group gradient norms and zero counts are reduced over.

        Every rank of the distributed optimizer instance holds different gradient pieces, so
        this is the whole instance (set from outside as ``grad_stats_parallel_group``).
        """
        return getattr(self, "grad_stats_parallel_group", None)

    @property
    def optimizer_state_keys(self):
        """Names of the per-parameter state tensors: ``("exp_avg", "exp_avg_sq")`` for Adam,
        ``("exp_avg",)`` for Lion."""
        name = self.config.optimizer
        if name == "muon":
            # This optimizer then holds Muon's scalar parameters, stepped by the scalar optimizer.
            name = self.config.muon_scalar_optimizer
        if name == "lion":
            return ("exp_avg",)
        return ("exp_avg", "exp_avg_sq")

    def _get_state_key_dtype(self, key):
        """The dtype the inner optimizer keeps state ``key`` in (fp32 unless configured)."""
        if key in ("exp_avg", "exp_avg_sq"):
            return getattr(self.config, f"{key}_dtype")
        return torch.float32

    def _loads_its_own_way(self, fmt) -> bool:
        """Whether this optimizer's public loader of ``fmt`` is not the one its format mixin
        defines (a subclass overrides it, or a client patched the class or wrapped the
        instance's): then the load goes through it, as upstream's ``load_state_dict`` does."""
        loader = getattr(self, fmt.loader)
        return getattr(loader, "__func__", None) is not _OWN_LOADERS[fmt.loader]

    # ------------------------------------------------------------------ offload between phases

    def _params_with_own_memory(self) -> List[torch.Tensor]:
        """The inner optimizer's parameters that hold memory of their own (fp32 main copies),
        not the views of model parameters that fp32 and precision-aware shards are."""
        return [
            param
            for group in self.optimizer.param_groups
            for param in group["params"]
            if not param._is_view()
        ]

    def offload_to_cpu(self):
        """Move the optimizer's own tensors to the host, freeing accelerator memory between
        training phases (an RL framework's rollout).

        Main copies and state move. Shards that are views of model parameters stay: their
        memory is the model's, and a moved view would no longer update its parameter. An inner
        HybridDeviceOptimizer's offloaded state stays where it is, and so do the fp32 clones it
        steps in place (its sub-optimizers hold them).
        """
        if self.is_stub_optimizer:
            return
        self._finish_step_behind()
        log_single_rank(logger, logging.INFO, "[OFFLOAD] moving optimizer state to CPU")
        for param in self._params_with_own_memory():
            if param.is_cuda:
                param.data = param.data.cpu()
        self.inner_state.offload()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def restore_from_cpu(self):
        """Bring back what :meth:`offload_to_cpu` moved, each state tensor to where the inner
        optimizer keeps it (host-resident state of a HybridDeviceOptimizer stays on the host)."""
        if self.is_stub_optimizer:
            return
        self._finish_step_behind()
        log_single_rank(logger, logging.INFO, "[RESTORE] moving optimizer state back to GPU")
        for param in self._params_with_own_memory():
            if not param.is_cuda:
                param.data = param.data.cuda()
        self.inner_state.restore()

    # ------------------------------------------------------------------ step and param sync

    def start_param_sync_for_bucket_group_subset(self) -> None:
        """Start the parameter all-gather of the bucket groups this optimizer manages.

        Bucket groups tagged as managed by a LayerWiseDistributedOptimizer are left to it, so
        no bucket is gathered twice; without such tags every bucket group is gathered.
        """
        # Imported here: the layer-wise module imports this one.
        # pylint: disable=import-outside-toplevel
        from megatron.core.optimizer.layer_wise_optimizer import (
            _bucket_is_managed_by_layer_wise_optimizer,
        )

        for model_chunk in self.model_chunks:
            bucket_groups = model_chunk.bucket_groups + model_chunk.expert_parallel_bucket_groups
            for bucket_group in bucket_groups:
                if not bucket_group.buckets:
                    continue
                first_bucket = bucket_group.buckets[0]
                if _bucket_is_managed_by_layer_wise_optimizer(
                    first_bucket, default_for_untagged=False
                ):
                    continue
                model_chunk._start_bucket_group_param_sync(bucket_group, force_sync=False)

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Step the inner optimizer, then start the parameter all-gather.

        The all-gather runs here unless it overlaps the next forward pass
        (``overlap_param_gather``) or a chained optimizer deferred it (``_defer_param_sync``);
        under Megatron-FSDP the sharded weights are gathered ahead of the next forward.

        Returns:
            bool: whether the update succeeded.
        """
        self._ready_for("step")
        succeeded = super().step_with_ready_grads()

        fsdp = self.ddp_config.use_megatron_fsdp
        sync_now = not self.ddp_config.overlap_param_gather and not getattr(
            self, "_defer_param_sync", False
        )
        timers = self.config.timers if (fsdp or sync_now) else None
        if timers is not None:
            timers("params-all-gather", log_level=1).start(barrier=self.config.barrier_with_L1_time)
        if fsdp:
            for model_chunk in self.model_chunks:
                model_chunk.start_param_sync()
        elif sync_now:
            self.start_param_sync_for_bucket_group_subset()
        if timers is not None:
            timers("params-all-gather").stop()
        return succeeded


# The public loaders as the format mixins define them, taken before any client patches the
# class: a load writes its own plan through these, and goes through any other.
_OWN_LOADERS = {
    fmt.loader: getattr(DistributedOptimizer, fmt.loader) for fmt in FORMATS.values() if fmt.loader
}
