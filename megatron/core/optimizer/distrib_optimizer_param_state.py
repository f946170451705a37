# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The ``torch.save`` parameter-state formats of the distributed optimizer.

Each data-parallel rank owns one contiguous shard of every bucket. Two formats put the fp32
master value and optimizer state of those shards into ``torch.save`` files:

* ``dp_reshardable`` (here): each rank's shard state as it lies in memory (no copy), bucket by
  bucket, with the bucket sizes it was cut with. Distributed checkpointing makes it
  reshardable; as a plain per-rank dict it loads only under the layout it was saved with.
* ``dp_zero`` (the "legacy" checkpoint format, one file for the whole world:
  :mod:`~megatron.core.optimizer.distrib_optimizer_dp_zero`).

The methods live in :class:`DistributedOptimizerParameterStateMixin`, which
``DistributedOptimizer`` inherits, beside the walkers over buffers and buckets both formats use;
they keep megatron-core 0.19.2's names, signatures and file layouts, so files move freely
between the fork and upstream.
"""

from typing import Callable, Dict, List, Mapping, Tuple

import torch

from megatron.core.optimizer import state_load_checks as checks
from megatron.core.optimizer.distrib_optimizer_dp_zero import DpZeroParamStateMixin

__all__ = ["DistributedOptimizerParameterStateMixin"]

PER_BUCKET_NUMEL = "per_bucket_numel"
PER_BUCKET_NUMEL_UNPADDED = "per_bucket_numel_unpadded"


class DistributedOptimizerParameterStateMixin(DpZeroParamStateMixin):
    """``DistributedOptimizer``'s save and load of the ``dp_reshardable`` parameter-state format,
    and (from :class:`DpZeroParamStateMixin`) of ``dp_zero``.

    The host class provides, under megatron-core's names: ``gbuf_ranges`` (one
    ``{(param_dtype, grad_dtype): [bucket range map, ...]}`` per buffer), ``per_bucket_numel``
    and ``per_bucket_numel_unpadded`` (same nesting, bucket sizes with and without the end
    padding), ``buffers`` (read only to split a checkpoint for FP8 parameter buffers),
    ``data_parallel_group`` and ``data_parallel_group_gloo`` (or None),
    ``optimizer_state_keys``, ``_get_main_param_and_optimizer_states`` and
    ``_set_main_param_and_optimizer_states`` (the only way state is read or written here),
    ``_is_distopt_quantized_param``, ``is_stub_optimizer`` and ``inner_state`` (an
    :class:`~megatron.core.optimizer.inner_optimizer_state.InnerOptimizerState`).

    Every load checks the whole checkpoint against the model before it changes any state.
    """

    # ---------------------------------------------------------------- shared walkers

    def _param_state_keys(self) -> Tuple[str, ...]:
        """The per-element tensors every format stores: the master value, then the state."""
        return ("param",) + tuple(self.optimizer_state_keys)

    def _param_state_buffers(self):
        """Yield ``(gbuf_idx, dtypes, bucket range maps)`` for every buffer."""
        for gbuf_idx, by_dtype in enumerate(self.gbuf_ranges):
            if len(by_dtype) != 1:
                raise ValueError(
                    f"buffer {gbuf_idx} mixes {len(by_dtype)} dtype pairs; parameter-state "
                    "files support a single (param_dtype, grad_dtype) per buffer"
                )
            ((dtypes, bucket_maps),) = by_dtype.items()
            yield gbuf_idx, dtypes, bucket_maps

    def _bucket_numels(self, gbuf_idx: int, dtypes, world_size: int) -> List[Tuple[int, int]]:
        """``(padded, unpadded)`` element counts of each bucket of a buffer."""
        padded = self.per_bucket_numel[gbuf_idx][dtypes]
        unpadded = self.per_bucket_numel_unpadded[gbuf_idx][dtypes]
        for bucket_idx, (size, used) in enumerate(zip(padded, unpadded)):
            if size % world_size or used > size:
                raise ValueError(
                    f"bucket {bucket_idx} of buffer {gbuf_idx} ({used} used of {size} elements) "
                    f"cannot be cut into {world_size} data-parallel shards"
                )
        return list(zip(padded, unpadded))

    # ---------------------------------------------------------------- dp_reshardable

    def get_parameter_state_dp_reshardable(self):
        """This rank's shard state laid out by buffer and bucket, without copying it.

        Returns:
            dict: ``per_bucket_numel`` and ``per_bucket_numel_unpadded``, and for each
            ``gbuf_idx`` a ``{dtypes: [[param entry, ...] per bucket]}``. A param entry holds
            the live ``"param"`` and state tensors of one owned piece of a model parameter
            plus ``"gbuf_local_start"``/``"gbuf_local_end"``, its place in the rank's shard.
            The lists and entries are new, so callers may edit them.
        """
        return self._dp_reshardable_layout(self._get_main_param_and_optimizer_states)

    def _dp_reshardable_layout(self, tensors_of):
        """:meth:`get_parameter_state_dp_reshardable`'s dict with each piece's tensors given
        by ``tensors_of(model_param)``."""
        state = {
            PER_BUCKET_NUMEL: self.per_bucket_numel,
            PER_BUCKET_NUMEL_UNPADDED: self.per_bucket_numel_unpadded,
        }
        for gbuf_idx, dtypes, bucket_maps in self._param_state_buffers():
            per_bucket = []
            for bucket_map in bucket_maps:
                entries = []
                for model_param, ranges in bucket_map["param_map"].items():
                    entry = dict(tensors_of(model_param))
                    entry["gbuf_local_start"] = ranges["gbuf_local"].start
                    entry["gbuf_local_end"] = ranges["gbuf_local"].end
                    entries.append(entry)
                per_bucket.append(entries)
            state[gbuf_idx] = {dtypes: per_bucket}
        return state

    def load_parameter_state_from_dp_reshardable(self, state_dict):
        """Write back the state of :meth:`get_parameter_state_dp_reshardable`.

        Accepts both the plain per-rank dict and the dict distributed checkpointing loads for
        ``sharded_param_state_dp_reshardable`` (whose entries are flagged ``"padding"``
        where they fill gaps). A step counter carried by a plain dict is restored.

        Raises:
            ValueError: the checkpoint belongs to another model, or is a plain dict saved
                under another data-parallel layout.
            KeyError: an expected buffer, bucket or state tensor is missing.
        """
        self._plan_agree_write(
            "load_parameter_state_from_dp_reshardable",
            lambda: self._plan_dp_reshardable_param_state(state_dict),
        )

    def _plan_dp_reshardable_param_state(self, state_dict) -> Callable[[], None]:
        """Check a dp_reshardable state; return what writes it."""
        return self._param_state_writer(*self._plan_dp_reshardable_load(state_dict))

    def _plan_dp_reshardable_load(self, state_dict):
        """Match every saved entry with its parameter, checking everything first."""
        if not isinstance(state_dict, Mapping):
            raise ValueError(
                f"expected the dp_reshardable parameter state as a dict, got "
                f"{type(state_dict).__name__} (is the checkpoint's param_state missing?)"
            )
        saved_unpadded = state_dict.get(PER_BUCKET_NUMEL_UNPADDED)
        if saved_unpadded is not None and saved_unpadded != self.per_bucket_numel_unpadded:
            raise ValueError(
                f"the checkpoint is of another model: its buckets hold {saved_unpadded} "
                f"elements, this run's {self.per_bucket_numel_unpadded}"
            )
        # A plain dict (entries still carry their shard positions) was not resharded by
        # distributed checkpointing, so it fits only the bucket padding it was cut with.
        plain = self._is_plain_dp_reshardable(state_dict)
        saved_padded = state_dict.get(PER_BUCKET_NUMEL)
        if plain and saved_padded is not None and saved_padded != self.per_bucket_numel:
            raise ValueError(
                f"a plain dp_reshardable parameter state loads only under the data-parallel "
                f"size it was saved with: its padded bucket sizes are {saved_padded}, this "
                f"run's {self.per_bucket_numel}. Save a dp_zero file or a distributed "
                f"checkpoint to change the data-parallel size."
            )
        keys = self._param_state_keys()
        writes, steps = [], set()
        for gbuf_idx, dtypes, bucket_maps in self._param_state_buffers():
            saved_buckets = self._saved_entry(state_dict, gbuf_idx, dtypes)
            if len(saved_buckets) != len(bucket_maps):
                raise ValueError(
                    f"buffer {gbuf_idx} has {len(bucket_maps)} buckets but the checkpoint "
                    f"{len(saved_buckets)}"
                )
            for bucket_idx, (bucket_map, saved) in enumerate(zip(bucket_maps, saved_buckets)):
                entries = [entry for entry in saved if not entry.get("padding", False)]
                where = f"bucket {bucket_idx} of buffer {gbuf_idx}"
                if len(entries) != len(bucket_map["param_map"]):
                    raise ValueError(
                        f"{where} owns {len(bucket_map['param_map'])} parameter pieces but the "
                        f"checkpoint has {len(entries)}"
                        + (" (saved by another data-parallel rank?)" if plain else "")
                    )
                for entry, (model_param, ranges) in zip(entries, bucket_map["param_map"].items()):
                    local = ranges["gbuf_local"]
                    if plain:
                        saved_place = (entry.get("gbuf_local_start"), entry.get("gbuf_local_end"))
                        if saved_place != (local.start, local.end):
                            raise ValueError(
                                f"in {where} the checkpoint places a piece at {saved_place} "
                                f"where this rank owns {(local.start, local.end)}: it was "
                                f"saved under another data-parallel layout or rank"
                            )
                    writes.append(
                        (model_param, self._saved_tensors(entry, keys, len(local), where))
                    )
                    # Entries handed back by distributed checkpointing carry the live step
                    # tensor rather than a saved one; only a plain dict's step is trusted.
                    if plain and entry.get("step") is not None:
                        steps.add(int(checks.step_value(entry["step"], f"a piece in {where}")))
        if len(steps) > 1:
            raise ValueError(f"the checkpoint's parameters disagree on the step: {sorted(steps)}")
        return writes, (steps.pop() if steps else None)

    @staticmethod
    def _is_plain_dp_reshardable(state_dict) -> bool:
        """Whether the entries still carry the ``gbuf_local_*`` positions they were saved
        with (a :meth:`get_parameter_state_dp_reshardable` dict, not one that distributed
        checkpointing handed back)."""
        for key, per_dtype in state_dict.items():
            if not isinstance(key, int) or not isinstance(per_dtype, Mapping):
                continue
            for buckets in per_dtype.values():
                for bucket in buckets:
                    for entry in bucket:
                        return isinstance(entry, Mapping) and "gbuf_local_start" in entry
        return False

    @staticmethod
    def _saved_entry(state_dict, gbuf_idx: int, dtypes):
        """``state_dict[gbuf_idx][dtypes]``, or a KeyError that says what is there."""
        per_dtype = state_dict.get(gbuf_idx)
        if not isinstance(per_dtype, Mapping):
            found = [key for key in state_dict if isinstance(key, int)]
            raise KeyError(
                f"the parameter state has no entry for buffer {gbuf_idx} (buffers present: "
                f"{found}); is it a parameter-state checkpoint of this model?"
            )
        if dtypes not in per_dtype:
            raise KeyError(
                f"buffer {gbuf_idx} of the parameter state has no {dtypes} entry, only "
                f"{list(per_dtype)}"
            )
        return per_dtype[dtypes]

    @staticmethod
    def _saved_tensors(entry, keys, numel: int, where: str) -> Dict[str, torch.Tensor]:
        """The state tensors of one saved entry, checked to cover ``numel`` elements."""
        missing = [key for key in keys if key not in entry]
        if missing:
            raise KeyError(f"a parameter's state in {where} lacks {missing}")
        tensors = {}
        for key in keys:
            value = entry[key]
            if not isinstance(value, torch.Tensor) or value.numel() != numel:
                size = value.numel() if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(
                    f"'{key}' of a parameter in {where} should have {numel} elements, the "
                    f"checkpoint has {size}"
                )
            checks.check_state_shape(value, (numel,), key, f"a parameter in {where}")
            tensors[key] = value
        return tensors
