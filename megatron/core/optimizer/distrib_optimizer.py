# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The distributed optimizer: optimizer state sharded over the data-parallel ranks.

DDP keeps each model chunk's parameters and gradients in contiguous buffers cut into buckets,
and every bucket into one equal shard per data-parallel rank (see
:mod:`megatron.core.optimizer.distrib_optimizer_ranges`). A rank updates only the elements of its
shards: after the gradient reduce-scatter it hands the inner optimizer fp32 (or, with the
precision-aware optimizer, model-dtype) views of its pieces of each parameter, and after the
step it writes the updated pieces back into the parameter buffer for the all-gather.

This module holds the core of megatron-core 0.19.2's ``DistributedOptimizer``: construction,
the shard and main-parameter bookkeeping, the copies between model and main parameters and
gradients, FP8/NVFP4 casts, the non-parameter ``state_dict`` and parameter sync. Checkpoint
formats live in two mixins, :class:`DistributedOptimizerShardedStateMixin` (distributed
checkpointing) and :class:`DistributedOptimizerParameterStateMixin` (``torch.save`` files).
Every access to the inner optimizer's per-parameter state goes through
:class:`~megatron.core.optimizer.inner_optimizer_state.InnerOptimizerState` (``self.inner_state``),
so that plain torch optimizers, TE/Apex FusedAdam and the HybridDeviceOptimizer are handled by
what they offer rather than by their class.
"""

import itertools
import logging
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from megatron.core import tensor_parallel
from megatron.core.config_logger import has_config_logger_enabled, log_config_to_disk
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer, partition_buckets
from megatron.core.fp4_utils import (
    is_grouped_nvfp4tensor,
    is_nvfp4tensor,
    quantize_nvfp4_param_shard,
)
from megatron.core.fp8_utils import (
    dequantize_fp8_tensor,
    get_grouped_quantized_members,
    is_float8tensor,
    is_grouped_tensor_with_quantized_storage,
    quantize_param_shard,
)
from megatron.core.optimizer import distrib_optimizer_behind as behind_forward
from megatron.core.optimizer import distrib_optimizer_ranges as ranges
from megatron.core.optimizer import fork_info, fused_adam_state_load, inner_optimizer_state
from megatron.core.optimizer import state_load_checks as checks
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
from megatron.core.optimizer.distrib_optimizer_behind import StepBehindForward
from megatron.core.optimizer.distrib_optimizer_formats import FORMATS, format_named
from megatron.core.optimizer.distrib_optimizer_param_state import (
    DistributedOptimizerParameterStateMixin,
)
from megatron.core.optimizer.distrib_optimizer_ranges import Range
from megatron.core.optimizer.distrib_optimizer_sharded_state import (
    DistributedOptimizerShardedStateMixin,
)
from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.inner_optimizer_state import MASTER, InnerOptimizerState
from megatron.core.optimizer.optimizer import (
    MixedPrecisionOptimizer,
    _zero_grad_group_helper,
    copy_optimizer_param_metadata,
    param_group_identifier_keys,
)
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


def _counts_steps_per_param(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer keeps its step in each parameter's state (torch's Adam family)
    rather than in its param groups (TE/Apex FusedAdam)."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


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


def _param_group_identity(group: Dict) -> Tuple:
    """The values that pair a saved param group with a current one (order is not saved)."""
    identity = []
    for key in param_group_identifier_keys:
        # NeMo names lr_mult and wd_mult pre_lr_mult and pre_wd_mult.
        identity.append(group.get(key, group.get(f"pre_{key}")))
    return tuple(identity)


def _strip_module_prefix(name: str) -> str:
    """A parameter or module name without the ``module.`` levels that wrappers add."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def _unique_key_ending_with(state_dict_flat: Dict, suffix: str) -> Optional[str]:
    """The one key ending with ``suffix``, or None when there are none or several."""
    found = [key for key in state_dict_flat if key.endswith(suffix)]
    return found[0] if len(found) == 1 else None


def _stack_indexed_tensors(state_dict_flat: Dict, name: str, count: int) -> None:
    """``<name>0 ... <name>{count-1}`` -> one ``<name>`` tensor stacked along a new dim 0,
    when all of them are there and ``<name>`` is not."""
    if any(key.endswith(name) for key in state_dict_flat):
        return
    keys = [_unique_key_ending_with(state_dict_flat, f"{name}{index}") for index in range(count)]
    if None in keys:
        return
    prefix = keys[0][: len(keys[0]) - len(f"{name}0")]
    state_dict_flat[prefix + name] = torch.stack([state_dict_flat.pop(key) for key in keys])


def _split_grouped_tensor(state_dict_flat: Dict, name: str, module) -> None:
    """One ``<name>`` tensor -> ``<name>0, <name>1, ...`` through the module's splitter, when
    it is there (once) and no indexed tensor is."""
    count = module.num_gemms
    if any(_unique_key_ending_with(state_dict_flat, f"{name}{i}") for i in range(count)):
        return
    key = _unique_key_ending_with(state_dict_flat, name)
    if key is None:
        return
    prefix = key[: len(key) - len(name)]
    parts = list(module._split_grouped_checkpoint_tensor(state_dict_flat[key], key))
    if len(parts) != count:
        raise ValueError(f"{key} splits into {len(parts)} tensors, the module has {count} GEMMs")
    del state_dict_flat[key]
    for index, part in enumerate(parts):
        state_dict_flat[f"{prefix}{name}{index}"] = part


class DistributedOptimizer(
    DistributedOptimizerShardedStateMixin,
    DistributedOptimizerParameterStateMixin,
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

    def _loads_its_own_way(self, fmt) -> bool:
        """Whether this optimizer's public loader of ``fmt`` is not the one defined here (a
        subclass overrides it, or a client patched the class or wrapped the instance's): then
        the load goes through it, as upstream's ``load_state_dict`` does."""
        loader = getattr(self, fmt.loader)
        return getattr(loader, "__func__", None) is not _OWN_LOADERS[fmt.loader]

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

    # ------------------------------------------------------------------ quantized parameters

    @classmethod
    def _is_fp8_param_for_param_gather(cls, tensor) -> bool:
        """Whether the FP8/MXFP8 parameter all-gather casts ``tensor`` (grouped NVFP4 aside)."""
        if cls._is_grouped_nvfp4_param(tensor):
            return False
        return cls._is_distopt_quantized_param(tensor)

    @classmethod
    def _is_distopt_quantized_param(cls, tensor) -> bool:
        """Whether ``tensor`` is an FP8 tensor or a grouped tensor with quantized storage."""
        return cls._is_grouped_quantized_tensor(tensor) or is_float8tensor(tensor)

    @staticmethod
    def _is_grouped_quantized_tensor(tensor) -> bool:
        """Whether ``tensor`` is a TE GroupedTensor that stores quantized data."""
        return is_grouped_tensor_with_quantized_storage(tensor)

    @classmethod
    def _is_grouped_nvfp4_param(cls, tensor) -> bool:
        """Whether ``tensor`` is a grouped parameter made of NVFP4 members."""
        return is_grouped_nvfp4tensor(tensor)

    @classmethod
    def _get_grouped_quantized_members(cls, tensor) -> List[torch.Tensor]:
        """A grouped quantized parameter's members (built and cached on first use)."""
        return get_grouped_quantized_members(tensor, create_if_missing=True)

    @classmethod
    def _expand_quantized_param_shard_for_cast(cls, model_param, shard_main_param, start_offset):
        """Split a grouped quantized parameter's main shard over its member tensors.

        The cast kernels take one quantized tensor at a time, so a grouped parameter becomes
        one entry per member, in member order (the same on every rank): the member, the slice
        of the main shard that falls in it (None if none does) and where that slice starts in
        the member (None likewise). Any other parameter is returned as a single entry.

        Args:
            model_param: the quantized model parameter.
            shard_main_param: this rank's fp32 main piece of it, or None.
            start_offset: where that piece starts in the flattened parameter, or None.

        Returns:
            tuple: three equally long lists ``(params, main pieces, start offsets)``.
        """
        if not cls._is_grouped_quantized_tensor(model_param):
            return [model_param], [shard_main_param], [start_offset]

        piece_start = start_offset or 0
        piece_numel = 0 if shard_main_param is None else shard_main_param.numel()
        piece_end = piece_start + piece_numel
        flat_piece = None if shard_main_param is None else shard_main_param.view(-1)

        members = cls._get_grouped_quantized_members(model_param)
        pieces, offsets = [], []
        member_start = 0
        for member in members:
            member_end = member_start + member.numel()
            low, high = max(member_start, piece_start), min(member_end, piece_end)
            if low < high:
                pieces.append(flat_piece[low - piece_start : high - piece_start])
                offsets.append(low - member_start)
            else:
                pieces.append(None)
                offsets.append(None)
            member_start = member_end
        return list(members), pieces, offsets

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

    # ------------------------------------------------------------------ gradients and params

    def zero_grad(self, set_to_none: bool = True):
        """Clear the gradients of the model parameters and of their shards.

        The shard gradients are cleared too, so their memory can be released.

        Args:
            set_to_none: drop the gradients instead of zeroing them.
        """
        if self.ddp_config.use_megatron_fsdp:
            for model_chunk in self.model_chunks:
                model_chunk.zero_grad_buffer()  # Megatron-FSDP owns the gradients
        elif not self.is_stub_optimizer:
            self._zero_shard_grads(set_to_none)

    def _zero_shard_grads(self, set_to_none: bool):
        """Clear the gradients of the owned model parameters and of all their shards."""
        precision_aware = self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
        group_lists = [
            self.model_float16_groups,
            self.model_fp32_groups,
            self.shard_float16_groups,
            self.shard_fp32_groups,
        ]
        if not precision_aware:
            group_lists.append(self.shard_fp32_from_float16_groups)
        for groups in group_lists:
            for group in groups:
                _zero_grad_group_helper(group, set_to_none, precision_aware)

    def _collect_main_grad_data_for_unscaling(self):
        """The gradients the inner optimizer reads, for unscaling and the inf/nan check."""
        attribute = "grad"
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            attribute = "decoupled_grad"
        return [
            getattr(param, attribute).data
            for group in self.optimizer.param_groups
            for param in group["params"]
        ]

    def _get_model_and_main_params_data_float16(self):
        """Aligned lists of the 16-bit shards' data and of their main copies' data (None
        entries with the precision-aware optimizer)."""
        precision_aware = self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
        model_data, main_data = [], []
        for shard_group, main_group in zip(
            self.shard_float16_groups, self.shard_fp32_from_float16_groups
        ):
            for shard, main in zip(shard_group, main_group):
                model_data.append(shard.data)
                main_data.append(None if precision_aware else main.data)
        return model_data, main_data

    def _model_and_main_pairs(
        self, model_dtype_shards: bool = False
    ) -> Iterator[Tuple[torch.nn.Parameter, torch.Tensor]]:
        """``(model parameter, shard)`` for every owned parameter, 16-bit groups first.

        Args:
            model_dtype_shards: pair 16-bit parameters with their 16-bit shards rather than
                with their fp32 main copies.
        """
        if model_dtype_shards:
            shards_16 = self.shard_float16_groups
        else:
            shards_16 = self.shard_fp32_from_float16_groups
        for model_groups, shard_groups in (
            (self.model_float16_groups, shards_16),
            (self.model_fp32_groups, self.shard_fp32_groups),
        ):
            for model_group, shard_group in zip(model_groups, shard_groups):
                yield from zip(model_group, shard_group)

    def _owned_piece_range(self, model_param, shard: torch.Tensor, key: str = "param") -> Range:
        """The ``key`` range of ``model_param``'s owned piece, checked against ``shard``."""
        piece = self._get_model_param_range_map(model_param)[key]
        if piece.size != shard.nelement():
            raise AssertionError(
                f"a shard of {shard.nelement()} elements does not match its range {piece}"
            )
        return piece

    def _buffers_for_quantized_params(self) -> List:
        """The buffers whose ``params`` list the quantized parameters."""
        if not self.ddp_config.use_megatron_fsdp:
            return self.buffers
        return [
            group.model_weight_buffer
            for model_chunk in self.model_chunks
            for group in model_chunk.param_and_grad_buffer.parameter_groups
        ]

    def _get_fp8_params_and_shard_fp32_from_fp8(self):
        """The FP8 parameters with the fp32 main piece of each and where it starts.

        Every FP8 parameter of the buffers is listed (in buffer order, so identically on every
        rank); a parameter this rank owns nothing of has None for both.

        Returns:
            tuple: three aligned lists ``(fp8 params, main pieces, start offsets)``.
        """
        params = [
            param
            for buffer in self._buffers_for_quantized_params()
            for param in buffer.params
            if self._is_fp8_param_for_param_gather(param)
        ]
        slot = {param: index for index, param in enumerate(params)}
        pieces = [None] * len(params)
        offsets = [None] * len(params)
        for model_param, main in self._model_and_main_pairs():
            if self._is_fp8_param_for_param_gather(model_param):
                index = slot[model_param]
                pieces[index] = main
                offsets[index] = self._owned_piece_range(model_param, main).start
        return params, pieces, offsets

    def _get_nvfp4_params_and_shard_fp32_from_nvfp4(self):
        """The NVFP4 tensors with the fp32 main piece of each and where it starts.

        A grouped NVFP4 parameter contributes one entry per member. Under Megatron-FSDP the
        lists are empty.

        Returns:
            tuple: three aligned lists ``(nvfp4 tensors, main pieces, start offsets)``.
        """
        tensors, slots = [], {}
        buffers = [] if self.ddp_config.use_megatron_fsdp else self.buffers
        for buffer in buffers:
            for param in buffer.params:
                if is_nvfp4tensor(param):
                    slots[param] = [len(tensors)]
                    tensors.append(param)
                elif self._is_grouped_nvfp4_param(param):
                    members = self._get_grouped_quantized_members(param)
                    slots[param] = list(range(len(tensors), len(tensors) + len(members)))
                    tensors.extend(members)
        pieces = [None] * len(tensors)
        offsets = [None] * len(tensors)

        for model_param, main in self._model_and_main_pairs():
            if model_param not in slots:
                continue
            start = self._owned_piece_range(model_param, main).start
            members, member_pieces, member_offsets = self._expand_quantized_param_shard_for_cast(
                model_param, main, start
            )
            if len(members) != len(slots[model_param]):
                raise AssertionError("a grouped NVFP4 parameter changed its member count")
            for index, member, piece, offset in zip(
                slots[model_param], members, member_pieces, member_offsets
            ):
                if tensors[index] is not member:
                    raise AssertionError("a grouped NVFP4 parameter changed its members")
                pieces[index] = piece
                offsets[index] = offset
        return tensors, pieces, offsets

    def _copy_model_grads_to_main_grads(self):
        """Hand the inner optimizer this rank's reduced gradient pieces.

        After the reduce-scatter each owned piece's gradient sits in the parameter's
        ``main_grad``; its slice becomes the shard's ``grad`` (in fp32), or, with the
        precision-aware optimizer, its ``decoupled_grad`` as is (a ``grad`` must have its
        tensor's dtype; the optimizer reads ``decoupled_grad`` instead).
        """
        if self.is_stub_optimizer or self.ddp_config.use_megatron_fsdp:
            return  # Megatron-FSDP places its gradients itself
        precision_aware = self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
        for model_param, shard in self._model_and_main_pairs(model_dtype_shards=precision_aware):
            piece = self._owned_piece_range(model_param, shard)
            grad_piece = model_param.main_grad.view(-1)[piece.start : piece.end]
            if precision_aware:
                shard.decoupled_grad = grad_piece
            else:
                shard.grad = grad_piece.float()

    def _copy_main_params_to_model_params(self):
        """Write the updated main pieces into the parameter buffer, for the all-gather.

        Quantized (FP8) and NVFP4 parameters are cast from their main pieces by the quantize
        helpers instead. Nothing is copied with the precision-aware optimizer, which writes the
        model parameters itself.
        """
        if self.is_stub_optimizer:
            return
        if self._step_behind is not None and self._step_behind.arm():
            return  # each bucket group's sync copies its pieces once they are up
        fsdp = self.ddp_config.use_megatron_fsdp
        if fsdp:  # Megatron-FSDP also quantizes where needed
            for model_chunk in self.model_chunks:
                model_chunk.param_and_grad_buffer.copy_main_weights_to_model_weights()
        if fsdp or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return

        if self.ddp_config.fp8_param_gather:
            expanded = ([], [], [])
            for entry in zip(*self._get_fp8_params_and_shard_fp32_from_fp8()):
                for accumulated, part in zip(
                    expanded, self._expand_quantized_param_shard_for_cast(*entry)
                ):
                    accumulated.extend(part)
            quantize_param_shard(*expanded, self.data_parallel_group)
        elif self.ddp_config.fp4_param_gather:
            quantize_nvfp4_param_shard(
                *self._get_nvfp4_params_and_shard_fp32_from_nvfp4(), self.data_parallel_group
            )

        self._copy_pairs(self._model_and_main_pairs())

    def _copy_pairs(self, pairs: Iterable[Tuple[torch.nn.Parameter, torch.Tensor]]):
        """Copy each ``(model parameter, main piece)`` into the parameter buffer, but for the
        quantized parameters, which their own helpers cast."""
        self._copy_into_param_buffer(
            (model_param, main)
            for model_param, main in pairs
            if not (self._is_distopt_quantized_param(model_param) or is_nvfp4tensor(model_param))
        )

    def _copy_into_param_buffer(self, pairs: Iterable[Tuple[torch.nn.Parameter, torch.Tensor]]):
        """Copy each main piece where its model parameter's piece lies in the bucket's
        parameter data."""
        for model_param, main in pairs:
            in_bucket = self._owned_piece_range(model_param, main, "gbuf_world_in_bucket")
            bucket_params = self._bucket_param_data(model_param)
            bucket_params.view(-1)[in_bucket.start : in_bucket.end].copy_(main)

    def _bucket_param_data(self, model_param: torch.nn.Parameter) -> torch.Tensor:
        """The parameter data of the bucket holding ``model_param``."""
        buffer_index, _, bucket_index = self.model_param_gbuf_map[model_param]
        return self.buffers[buffer_index].buckets[bucket_index].param_data

    @torch.no_grad()
    def prepare_model_params_for_param_sync(self) -> None:
        """Put the fp32 main pieces into the DDP parameter buffers before an explicit
        parameter sync (MXFP8 reusing the gradient buffer, with overlapped all-gathers)."""
        staged = self.config.reuse_grad_buf_for_mxfp8_param_ag and self.config.overlap_param_gather
        if self.is_stub_optimizer or not staged:
            return
        for model_chunk in self.model_chunks:
            model_chunk.zero_grad_buffer()
        self._copy_main_params_to_param_buffer()

    def _copy_main_params_to_param_buffer(self):
        """Copy the fp32 main pieces straight into the parameter buffer (MXFP8 only: there the
        buffer is not the storage of the model parameters, so it is filled for the gather)."""
        if self.ddp_config.use_megatron_fsdp:
            raise NotImplementedError(
                "_copy_main_params_to_param_buffer is not supported with Megatron-FSDP"
            )
        self._copy_into_param_buffer(
            (model_param, main)
            for main_group, model_group in zip(
                self.shard_fp32_from_float16_groups, self.model_float16_groups
            )
            for main, model_param in zip(main_group, model_group)
        )
        # The buffer changed, so the next forward pre-hook must redo its post-sync work.
        for model_chunk in self.model_chunks:
            model_chunk.reset_param_sync_dispatch_state()

    # ------------------------------------------------------------------ reloading model params

    @staticmethod
    def _normalize_state_dict_for_grouped_params(state_dict_flat, model_chunk):
        """Rename grouped-GEMM weights between their grouped and per-GEMM forms, in place.

        TE grouped linear layers store ``weight`` (and ``bias``) either as one grouped tensor
        or as ``weight0 ... weight{n-1}``. When a checkpoint has the other form than the module
        now uses, the tensors are stacked or split (by the module's
        ``_split_grouped_checkpoint_tensor``) under the names the module expects. The module's
        own load hook does this for ``load_state_dict``; reloading main parameters by name
        needs it here.

        Args:
            state_dict_flat: parameter name -> tensor, changed in place.
            model_chunk: the model chunk whose modules are inspected.
        """
        for module_name, module in model_chunk.named_modules():
            grouped_gemm = hasattr(module, "num_gemms")
            if not (grouped_gemm and hasattr(module, "_split_grouped_checkpoint_tensor")):
                continue
            base = _strip_module_prefix(module_name)
            wants_grouped = {"weight": getattr(module, "single_grouped_weight", False)}
            if getattr(module, "use_bias", False):
                wants_grouped["bias"] = getattr(module, "single_grouped_bias", False)
            for attribute, grouped in wants_grouped.items():
                name = f"{base}.{attribute}" if base else attribute
                if grouped:
                    _stack_indexed_tensors(state_dict_flat, name, module.num_gemms)
                else:
                    _split_grouped_tensor(state_dict_flat, name, module)

    @staticmethod
    def _synthesize_state_dict_params_for_model(state_dict_flat, model_chunk):
        """Let modules build, in the flat state dict, parameters stored as several tensors.

        A module taking part offers ``_synthetic_state_dict_key_suffixes()`` (names of its
        checkpoint tensors, used to find the module's prefix in the checkpoint) and
        ``_synthesize_fused_qkv_down_weight(state_dict_flat, prefix)``, which adds its runtime
        parameter under its own name.

        Args:
            state_dict_flat: parameter name -> tensor, changed in place.
            model_chunk: the model chunk whose modules are inspected.
        """
        for module_name, module in model_chunk.named_modules():
            build = getattr(module, "_synthesize_fused_qkv_down_weight", None)
            sources = getattr(module, "_synthetic_state_dict_key_suffixes", None)
            if not (callable(build) and callable(sources)):
                continue
            for source in sources():
                prefixes = DistributedOptimizer._state_dict_module_prefixes(
                    state_dict_flat, module_name, source
                )
                for prefix in prefixes:
                    build(state_dict_flat, prefix)

    @staticmethod
    def _state_dict_module_prefixes(state_dict_flat, module_name, inner_key):
        """Where a module's entries start in a checkpoint whose names may differ in front.

        The module's path is shortened from the front until some key ends in
        ``<path>.<inner_key>``; the parts of those keys before ``inner_key`` are returned.

        Args:
            state_dict_flat: parameter name -> tensor.
            module_name: the module's dotted name in the model chunk.
            inner_key: a checkpoint name below the module.

        Returns:
            set[str]: the prefixes found with the longest path that matches any key (empty if
            none does).
        """
        parts = module_name.split(".") if module_name else []
        for first in range(len(parts) + 1):
            tail = ".".join([*parts[first:], inner_key])
            prefixes = {
                key[: len(key) - len(inner_key)] for key in state_dict_flat if key.endswith(tail)
            }
            if prefixes:
                return prefixes
        return set()

    def _build_model_param_to_state_dict_param_map(self, state_dict):
        """Pair every model parameter with the checkpoint tensor of the same name.

        Args:
            state_dict: one chunk's flat state dict, or ``{"model": ...}``, or one entry per
                chunk as ``model0, model1, ...`` (``model_0, ...`` for NeMo).

        Returns:
            dict: model parameter -> checkpoint tensor.

        Raises:
            AssertionError: the layout does not fit the chunks, a parameter name matches no
                or several keys, or shapes differ.
        """
        per_chunk = self._state_dicts_per_chunk(state_dict)
        pairs = {}
        for chunk_state, model_chunk in zip(per_chunk, self.model_chunks):
            self._normalize_state_dict_for_grouped_params(chunk_state, model_chunk)
            self._synthesize_state_dict_params_for_model(chunk_state, model_chunk)
            unclaimed = set(chunk_state)
            for name, model_param in model_chunk.named_parameters():
                name = _strip_module_prefix(name)
                hits = [key for key in unclaimed if key.endswith(name)]
                if len(hits) != 1:
                    raise AssertionError(f"Parameter {name} has {len(hits)} matches in state dict")
                tensor = chunk_state[hits[0]]
                if tensor.shape != model_param.shape:
                    raise AssertionError(
                        f"Parameter {name} has shape {tuple(model_param.shape)}, its checkpoint "
                        f"tensor {hits[0]} has shape {tuple(tensor.shape)}"
                    )
                pairs[model_param] = tensor
                unclaimed.discard(hits[0])
        return pairs

    def _state_dicts_per_chunk(self, state_dict) -> List[Dict]:
        """One flat state dict per model chunk, from any of the accepted layouts."""
        for prefix in ("model", "model_"):
            if f"{prefix}0" in state_dict:
                names = [f"{prefix}{index}" for index in range(len(self.model_chunks))]
                missing = [name for name in names if name not in state_dict]
                if missing:
                    raise AssertionError(f"Wrong state_dict format, cannot find {missing}")
                return [state_dict[name] for name in names]
        if len(self.model_chunks) != 1:
            raise AssertionError(
                f"a state dict for {len(self.model_chunks)} model chunks needs one entry per "
                "chunk (model0, model1, ...)"
            )
        return [state_dict["model"] if "model" in state_dict else state_dict]

    def _copy_model_params_to_main_params(self, state_dict=None):
        """Refresh the main pieces from the model parameters (or from ``state_dict``).

        Used when fine-tuning reloads the weights; the gradient buffers are not involved.
        Quantized parameters are dequantized first. With the precision-aware optimizer the
        inner optimizer owns the main values, and an optimizer that keeps copies of its
        parameters (the HybridDeviceOptimizer) refreshes them from the main pieces afterwards.

        Args:
            state_dict: optional checkpoint to take the values from, as accepted by
                :meth:`_build_model_param_to_state_dict_param_map`.

        Raises:
            NotImplementedError: under Megatron-FSDP, unless the inner optimizer refreshes
                itself.
        """
        self._finish_step_behind()  # the model parameters are then the step's
        if self.ddp_config.use_megatron_fsdp and not self.inner_state.keeps_copies:
            raise NotImplementedError(
                "Megatron-FSDP does not implement a model-to-main parameter update."
            )
        copy_main = not (
            self.ddp_config.use_megatron_fsdp
            or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
        )
        if copy_main:
            sources = None
            if state_dict is not None:
                sources = self._build_model_param_to_state_dict_param_map(state_dict)
            for model_param, main in self._model_and_main_pairs():
                piece = self._owned_piece_range(model_param, main)
                source = model_param if sources is None else sources[model_param]
                if self._is_grouped_quantized_tensor(source):
                    source = source.float()
                elif self._is_distopt_quantized_param(source):
                    source = dequantize_fp8_tensor(source)
                main.data.copy_(source.view(-1)[piece.start : piece.end])
        self.inner_state.refresh_copies()

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


# The public loaders as defined here, before any client patches the class: a load writes its
# own plan through these, and goes through any other.
_OWN_LOADERS = {
    fmt.loader: getattr(DistributedOptimizer, fmt.loader) for fmt in FORMATS.values() if fmt.loader
}
