# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The copies between the model parameters and this rank's main pieces of them.

:class:`MainParamCopiesMixin` gives ``DistributedOptimizer`` the traffic of a step: before it,
each owned piece of a reduced gradient is handed to the inner optimizer (``grad`` in fp32, or
``decoupled_grad`` with the precision-aware optimizer); after it, the updated main pieces are
written into the DDP parameter buffer for the all-gather, FP8 and NVFP4 parameters being cast
from their main pieces by megatron-core's quantize helpers. It also clears the gradients and
lists the tensors ``MixedPrecisionOptimizer`` unscales.
"""

from typing import Iterable, Iterator, List, Tuple

import torch

from megatron.core.fp4_utils import (
    is_grouped_nvfp4tensor,
    is_nvfp4tensor,
    quantize_nvfp4_param_shard,
)
from megatron.core.fp8_utils import (
    get_grouped_quantized_members,
    is_float8tensor,
    is_grouped_tensor_with_quantized_storage,
    quantize_param_shard,
)
from megatron.core.optimizer.distrib_optimizer_ranges import Range
from megatron.core.optimizer.optimizer import _zero_grad_group_helper

__all__ = ["MainParamCopiesMixin"]


class MainParamCopiesMixin:
    """``DistributedOptimizer``'s copies of gradients in and of updated values out.

    The host class provides, under megatron-core's names: ``config``, ``ddp_config``,
    ``is_stub_optimizer``, ``optimizer``, ``model_chunks``, ``buffers``, ``data_parallel_group``,
    ``model_param_gbuf_map``, the owned parameters' groups (``model_float16_groups``,
    ``model_fp32_groups``) and their shards (``shard_float16_groups``, ``shard_fp32_groups``,
    ``shard_fp32_from_float16_groups``), ``_get_model_param_range_map`` and, where the step can
    run behind the forward, ``_step_behind``.
    """

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
