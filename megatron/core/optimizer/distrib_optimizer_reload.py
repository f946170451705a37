# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Refreshing the distributed optimizer's main pieces from model weights.

:class:`ModelParamReloadMixin` gives ``DistributedOptimizer`` ``_copy_model_params_to_main_params``,
which fine-tuning and RL weight updates call after they replace the model's weights, from the
model itself or from a checkpoint's state dict matched to the parameters by name. Names are
matched across the wrappers' ``module.`` prefixes, TE's grouped-GEMM weights are stacked or split
into the form the module uses, and modules that build a parameter from several checkpoint
tensors are asked to build it.
"""

from typing import Dict, List, Optional

import torch

from megatron.core.fp8_utils import dequantize_fp8_tensor

__all__ = ["ModelParamReloadMixin"]


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


class ModelParamReloadMixin:
    """``DistributedOptimizer``'s reload of its main pieces from model weights.

    The host class provides, under megatron-core's names: ``model_chunks``, ``config``,
    ``ddp_config``, ``inner_state``, ``_model_and_main_pairs``, ``_owned_piece_range``, the
    quantized-parameter tests (``_is_grouped_quantized_tensor``, ``_is_distopt_quantized_param``)
    and ``_finish_step_behind``.
    """

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
                prefixes = ModelParamReloadMixin._state_dict_module_prefixes(
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
