# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Shard ranges and buffer layouts for the distributed optimizer.

The distributed optimizer keeps each model chunk's parameters and gradients in contiguous
buffers split into buckets. Every bucket is cut into as many equal, contiguous shards as there
are data-parallel ranks, and rank ``r`` owns shard ``r``: it reduces those gradient elements and
updates those parameter elements. Shards ignore parameter boundaries, so a parameter may be
owned in pieces by several ranks. This module computes, without any communication:

* where each parameter sits in a buffer (the layout that DDP allocates the buffers from);
* which piece of each parameter the local rank owns, in four coordinate systems;
* how the owned pieces map back to buffers, buckets and optimizer param groups.

Each function reproduces one of megatron-core 0.19.2's ``DistributedOptimizer`` class or static
methods, returning the same structures (and the layout dataclasses of
:mod:`megatron.core.optimizer.param_layout`, which DDP consumes):

========================================  ================================================
this module                               ``DistributedOptimizer`` method
========================================  ================================================
:func:`build_param_range_map`             ``_build_model_gbuf_param_range_map``
:func:`build_bucket_range`                ``_build_model_gbuf_range``
:func:`build_buffer_range_map`            ``_build_gbuf_range_map``
:func:`build_param_to_bucket_map`         ``_build_model_param_gbuf_map``
:func:`build_optimizer_group_ranges`      ``_build_optimizer_group_ranges``
:func:`compute_per_buffer_param_layout`   ``_compute_per_buffer_param_layout``
:func:`compute_full_param_layout`         ``compute_full_param_layout``
========================================  ================================================

Upstream reads the data-parallel rank and world size from the buffer's process group. Here they
are arguments, so the arithmetic runs without ``torch.distributed``;
:func:`build_bucket_range_from_group` and :func:`build_buffer_range_map_from_group` read them
from ``buffer.data_parallel_group`` as upstream does.

Where upstream checks an invariant with ``assert``, the same condition raises
:class:`AssertionError` here too (explicitly, so it also holds under ``python -O``).
"""

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from megatron.core.distributed.param_and_grad_buffer import group_params_for_buffers
from megatron.core.optimizer.param_layout import (
    FullParamLayout,
    PerBufferParamLayout,
    pad_bucket_end,
    pad_param_start,
)

# The four ranges recorded for every owned piece of a parameter.
GBUF_WORLD = "gbuf_world"
GBUF_WORLD_IN_BUCKET = "gbuf_world_in_bucket"
GBUF_LOCAL = "gbuf_local"
PARAM = "param"

BufferDtypes = Tuple[torch.dtype, torch.dtype]
"""Key of a buffer's entry in a range map: ``(param_dtype, grad_dtype)``."""


class Range:
    """A half-open interval ``[start, end)`` of element indices into a flat tensor.

    It behaves like upstream's ``megatron.core.optimizer.distrib_optimizer.Range``: the same
    attributes, ``normalize``, ``len`` and text form, and identity equality (no ``__eq__``).

    Args:
        start: first index inside the interval.
        end: first index past the interval.

    Attributes:
        start: first index inside the interval.
        end: first index past the interval.
        size: ``end - start``, fixed when the range is made.
    """

    def __init__(self, start: int, end: int):
        self.start = start
        self.end = end
        self.size = end - start

    def normalize(self, start: int = 0) -> "Range":
        """Return a new range of the same size that begins at ``start``.

        Args:
            start: where the new range begins.

        Returns:
            Range: ``[start, start + size)``; this range is left unchanged.
        """
        return Range(start, start + self.size)

    def __str__(self) -> str:
        return "%d,%d [%d]" % (self.start, self.end, self.size)

    def __repr__(self) -> str:
        return self.__str__()

    def __len__(self) -> int:
        return self.end - self.start


def bucket_shard_ranges(
    bucket_offset: int, bucket_numel: int, data_parallel_world_size: int
) -> List[Range]:
    """Cut one bucket into the data-parallel shards, in buffer coordinates.

    Args:
        bucket_offset: index of the bucket's first element in its buffer.
        bucket_numel: number of elements of the bucket, padding included.
        data_parallel_world_size: number of shards.

    Returns:
        list[Range]: entry ``r`` is the range of the buffer that rank ``r`` owns.

    Raises:
        AssertionError: if ``bucket_numel`` is not a multiple of the world size.
    """
    if bucket_numel % data_parallel_world_size != 0:
        raise AssertionError(
            f"A bucket of {bucket_numel} elements cannot be split into "
            f"{data_parallel_world_size} equal shards"
        )
    shard_numel = bucket_numel // data_parallel_world_size
    bucket_end = bucket_offset + bucket_numel
    ranges = []
    for rank in range(data_parallel_world_size):
        first = bucket_offset + rank * shard_numel
        ranges.append(Range(first, min(first + shard_numel, bucket_end)))
    return ranges


def build_param_range_map(
    param_index_map: Mapping[Any, Tuple[int, int, int]], shard_range: Range, bucket_offset: int
) -> Dict[Any, Dict[str, Range]]:
    """Find the piece of each parameter that falls inside one shard.

    Reproduces ``DistributedOptimizer._build_model_gbuf_param_range_map``.

    A parameter at ``[p_start, p_end)`` of the buffer overlaps the shard at
    ``[lo, hi) = [max(p_start, shard.start), min(p_end, shard.end))``. When that is not empty,
    the parameter gets four ranges, all of length ``hi - lo``:

    * ``"gbuf_world"``: ``[lo, hi)``, in buffer coordinates;
    * ``"gbuf_world_in_bucket"``: the same, relative to the bucket's first element;
    * ``"gbuf_local"``: the same, relative to the shard's first element;
    * ``"param"``: the same, relative to the parameter's first element (which elements of the
      flattened parameter this shard holds).

    Args:
        param_index_map: parameter -> ``(start, end, bucket_id)`` in buffer coordinates, as in
            ``_ParamAndGradBuffer.param_index_map``. It may hold the parameters of every bucket;
            ``bucket_id`` is not read.
        shard_range: the shard, in buffer coordinates.
        bucket_offset: index of the shard's bucket's first element in the buffer.

    Returns:
        dict: parameter -> ``{"gbuf_world", "gbuf_world_in_bucket", "gbuf_local", "param"}``
        ranges, for the parameters that overlap the shard, in ``param_index_map`` order.
    """
    shard_start = shard_range.start
    shard_end = shard_range.start + shard_range.size
    owned = {}
    for param, (param_start, param_end, _) in param_index_map.items():
        low = max(param_start, shard_start)
        high = min(param_end, shard_end)
        if high <= low:
            continue
        owned[param] = {
            GBUF_WORLD: Range(low, high),
            GBUF_WORLD_IN_BUCKET: Range(low - bucket_offset, high - bucket_offset),
            GBUF_LOCAL: Range(low - shard_start, high - shard_start),
            PARAM: Range(low - param_start, high - param_start),
        }
    return owned


def _check_shard_count(buffer: Any, data_parallel_world_size: int) -> None:
    """Refuse a buffer whose layout was built for a different number of shards."""
    shards = getattr(buffer, "num_optimizer_shards", None)
    if shards is not None and shards != data_parallel_world_size:
        raise AssertionError(
            f"The buffer's parameter layout was computed for {shards} optimizer shards, but "
            f"the optimizer shards it over {data_parallel_world_size} data-parallel ranks; "
            f"compute the layout with the size of the group the optimizer shards over"
        )


def build_bucket_range(
    buffer: Any, bucket_index: int, data_parallel_rank: int, data_parallel_world_size: int
) -> Dict[str, Dict[Any, Dict[str, Range]]]:
    """Describe what one rank owns of one bucket.

    Reproduces ``DistributedOptimizer._build_model_gbuf_range``, with the rank and world size
    given rather than read from the buffer's group.

    Args:
        buffer: a ``_ParamAndGradBuffer`` or an object with the attributes read here:
            ``buckets`` (each with ``offset`` and ``grad_data``), ``param_index_map`` and,
            optionally, ``num_optimizer_shards``.
        bucket_index: which of ``buffer.buckets``.
        data_parallel_rank: the owning rank, ``0 <= rank < world size``.
        data_parallel_world_size: number of ranks the bucket is sharded over.

    Returns:
        dict: ``{"param_map": ...}`` with the :func:`build_param_range_map` of the rank's shard.

    Raises:
        AssertionError: if the buffer's layout was built for another number of shards, or the
            bucket does not split evenly.
        ValueError: if the rank is outside the world.
    """
    _check_shard_count(buffer, data_parallel_world_size)
    if not 0 <= data_parallel_rank < data_parallel_world_size:
        raise ValueError(
            f"data-parallel rank {data_parallel_rank} is outside a world of "
            f"{data_parallel_world_size}"
        )
    bucket = buffer.buckets[bucket_index]
    shards = bucket_shard_ranges(bucket.offset, bucket.grad_data.numel(), data_parallel_world_size)
    param_map = build_param_range_map(
        buffer.param_index_map, shards[data_parallel_rank], bucket.offset
    )
    return {"param_map": param_map}


def build_buffer_range_map(
    buffer: Any, data_parallel_rank: int, data_parallel_world_size: int
) -> Dict[BufferDtypes, List[Dict[str, Dict[Any, Dict[str, Range]]]]]:
    """Describe what one rank owns of every bucket of a buffer.

    Reproduces ``DistributedOptimizer._build_gbuf_range_map``, with the rank and world size
    given rather than read from the buffer's group.

    Args:
        buffer: as for :func:`build_bucket_range`, also with ``param_dtype`` and
            ``grad_dtype``.
        data_parallel_rank: the owning rank.
        data_parallel_world_size: number of ranks each bucket is sharded over.

    Returns:
        dict: ``{(param_dtype, grad_dtype): [bucket range, ...]}``, one
        :func:`build_bucket_range` result per bucket, in bucket order.
    """
    per_bucket = [
        build_bucket_range(buffer, index, data_parallel_rank, data_parallel_world_size)
        for index in range(len(buffer.buckets))
    ]
    return {(buffer.param_dtype, buffer.grad_dtype): per_bucket}


def data_parallel_rank_and_size(buffer: Any) -> Tuple[int, int]:
    """Read the local rank and the world size from ``buffer.data_parallel_group``.

    Args:
        buffer: anything with a ``data_parallel_group`` offering ``rank()`` and ``size()``.

    Returns:
        tuple[int, int]: ``(rank, world_size)``.
    """
    group = buffer.data_parallel_group
    return group.rank(), group.size()


def build_bucket_range_from_group(
    buffer: Any, bucket_index: int
) -> Dict[str, Dict[Any, Dict[str, Range]]]:
    """:func:`build_bucket_range` for the local rank of the buffer's data-parallel group.

    Args:
        buffer: as for :func:`build_bucket_range`, with a ``data_parallel_group``.
        bucket_index: which of ``buffer.buckets``.

    Returns:
        dict: ``{"param_map": ...}`` for this process's rank.
    """
    rank, world_size = data_parallel_rank_and_size(buffer)
    return build_bucket_range(buffer, bucket_index, rank, world_size)


def build_buffer_range_map_from_group(
    buffer: Any,
) -> Dict[BufferDtypes, List[Dict[str, Dict[Any, Dict[str, Range]]]]]:
    """:func:`build_buffer_range_map` for the local rank of the buffer's data-parallel group.

    Args:
        buffer: as for :func:`build_buffer_range_map`, with a ``data_parallel_group``.

    Returns:
        dict: ``{(param_dtype, grad_dtype): [bucket range, ...]}`` for this process's rank.
    """
    rank, world_size = data_parallel_rank_and_size(buffer)
    return build_buffer_range_map(buffer, rank, world_size)


def _owned_params(gbuf_ranges: Sequence[Mapping]):
    """Walk buffer range maps, yielding ``(buffer index, dtypes, bucket index, param)``."""
    for buffer_index, range_map in enumerate(gbuf_ranges):
        for dtypes, bucket_ranges in range_map.items():
            for bucket_index, bucket_range in enumerate(bucket_ranges):
                for param in bucket_range["param_map"]:
                    yield buffer_index, dtypes, bucket_index, param


def build_param_to_bucket_map(
    gbuf_ranges: Sequence[Mapping],
) -> Dict[Any, Tuple[int, BufferDtypes, int]]:
    """Index the owned parameters by where their ranges are stored.

    Reproduces ``DistributedOptimizer._build_model_param_gbuf_map``.

    Args:
        gbuf_ranges: one :func:`build_buffer_range_map` result per buffer, in buffer order.

    Returns:
        dict: parameter -> ``(buffer index, (param_dtype, grad_dtype), bucket index)``, so that
        ``gbuf_ranges[i][dtypes][j]["param_map"][param]`` holds the parameter's ranges.

    Raises:
        AssertionError: if a parameter is owned in two buckets.
    """
    where = {}
    for buffer_index, dtypes, bucket_index, param in _owned_params(gbuf_ranges):
        if param in where:
            raise AssertionError(
                "A parameter appears in more than one bucket; each parameter must live in "
                "exactly one bucket"
            )
        where[param] = (buffer_index, dtypes, bucket_index)
    return where


def build_optimizer_group_ranges(
    param_groups: Sequence[Dict], gbuf_ranges: Sequence[Mapping]
) -> Tuple[Dict[Any, Tuple[int, int]], List[Dict[str, Any]]]:
    """Sort the locally owned parameters into the optimizer's param groups.

    Reproduces ``DistributedOptimizer._build_optimizer_group_ranges``, including its entries:
    one group range per param group, empty ones kept, each holding ``"params"`` (the owned
    parameters of the group in buffer, then bucket, then buffer-index order), ``"orig_group"``
    (the param group) and ``"orig_group_idx"`` (which upstream also sets to the param group
    dict, not to its index).

    Args:
        param_groups: the inner optimizer's param groups, each with ``"params"``. A parameter
            listed in several groups belongs to the last of them.
        gbuf_ranges: one :func:`build_buffer_range_map` result per buffer, in buffer order.

    Returns:
        tuple: ``(model_param_group_index_map, opt_group_ranges)``; the map takes each owned
        parameter to ``(group index, position in the group range's "params")``.

    Raises:
        AssertionError: if a parameter of ``param_groups`` does not require grad.
        KeyError: if an owned parameter is in no param group.
    """
    group_of = {}
    for group_index, group in enumerate(param_groups):
        for param in group["params"]:
            if not param.requires_grad:
                raise AssertionError("Every parameter of the optimizer must require grad")
            group_of[param] = group_index

    group_ranges = [{"params": []} for _ in param_groups]
    place_of = {}
    for _, _, _, param in _owned_params(gbuf_ranges):
        group_index = group_of[param]
        members = group_ranges[group_index]["params"]
        place_of[param] = (group_index, len(members))
        members.append(param)

    for group_range, group in zip(group_ranges, param_groups):
        group_range["orig_group"] = group
        group_range["orig_group_idx"] = group
    return place_of, group_ranges


def _needs_own_bucket(param: torch.nn.Parameter) -> bool:
    """A shared embedding is put in a bucket of its own."""
    return bool(getattr(param, "shared_embedding", False))


def compute_per_buffer_param_layout(
    params: Sequence[torch.nn.Parameter],
    bucket_size: Optional[int],
    data_parallel_world_size: int,
    ddp_config: Any,
    param_indices: Optional[List[int]] = None,
) -> PerBufferParamLayout:
    """Place the parameters of one buffer and cut the buffer into buckets.

    Reproduces ``DistributedOptimizer._compute_per_buffer_param_layout``. The parameters are
    placed last first (the order in which backprop produces their gradients):

    * every parameter starts at a multiple of 64 elements (:func:`pad_param_start`);
    * a bucket is closed once it holds ``bucket_size`` elements or more (never when
      ``bucket_size`` is None) and after a parameter marked ``shared_embedding``; such a
      parameter also closes the bucket before it when that bucket is not empty, so it is
      alone in its bucket;
    * a bucket's end is padded (:func:`pad_bucket_end`) to a multiple of
      ``lcm(data_parallel_world_size, 128)`` (also of ``2**16`` with
      ``ddp_config.pad_buckets_for_high_nccl_busbw``); the next bucket starts there.

    A bucket's unpadded size runs from its start to the end of its content: the end of its last
    parameter, or, when a shared embedding closes it early, the 64-aligned start that parameter
    would have had in it.

    Args:
        params: the buffer's parameters, in model order.
        bucket_size: about how many elements a bucket holds, or None for a single bucket.
        data_parallel_world_size: number of shards each bucket is split into.
        ddp_config: a ``DistributedDataParallelConfig`` (``pad_buckets_for_high_nccl_busbw`` is
            read).
        param_indices: each parameter's index among the parameters of its dtype, stored as is.

    Returns:
        PerBufferParamLayout: with ``num_optimizer_shards`` set to the world size.
    """
    index_map = {}
    bucket_bounds = []
    unpadded_sizes = []
    bucket_start = 0
    cursor = 0
    bucket_has_params = False

    def close_bucket(content_end):
        nonlocal bucket_start, cursor, bucket_has_params
        padded_end = pad_bucket_end(
            content_end, data_parallel_world_size, ddp_config.pad_buckets_for_high_nccl_busbw
        )
        bucket_bounds.append((bucket_start, padded_end))
        unpadded_sizes.append(content_end - bucket_start)
        bucket_start = padded_end
        cursor = padded_end
        bucket_has_params = False

    for param in reversed(params):
        start = pad_param_start(cursor)
        alone = _needs_own_bucket(param)
        if alone and bucket_has_params:
            close_bucket(start)
            start = bucket_start
        end = start + param.data.nelement()
        index_map[param] = (start, end, len(bucket_bounds))
        bucket_has_params = True
        cursor = end
        if alone or (bucket_size is not None and end - bucket_start >= bucket_size):
            close_bucket(end)

    if bucket_has_params:
        close_bucket(cursor)

    return PerBufferParamLayout(
        param_index_map=index_map,
        bucket_indices=bucket_bounds,
        per_bucket_numel_unpadded=unpadded_sizes,
        param_indices=param_indices if param_indices is not None else [],
        num_optimizer_shards=data_parallel_world_size,
    )


def compute_full_param_layout(
    params: Sequence[torch.nn.Parameter],
    bucket_size: Optional[int],
    data_parallel_world_size: int,
    ddp_config: Any,
    expert_data_parallel_world_size: Optional[int] = None,
) -> FullParamLayout:
    """Lay out every buffer of a model chunk.

    Reproduces ``DistributedOptimizer.compute_full_param_layout``: the parameters are grouped
    into buffers by megatron-core's ``group_params_for_buffers`` (by storage dtype, gradient
    dtype, expert parallelism and layer-wise management), and each buffer is laid out by
    :func:`compute_per_buffer_param_layout`. Expert-parallel buffers are sharded over
    ``expert_data_parallel_world_size`` (the dense world size when it is None), the others over
    ``data_parallel_world_size``.

    Args:
        params: every trainable parameter of the chunk, in model order.
        bucket_size: about how many elements a bucket holds, or None for one bucket per buffer.
        data_parallel_world_size: shard count for dense buffers.
        ddp_config: a ``DistributedDataParallelConfig`` (``grad_reduce_in_fp32`` and
            ``pad_buckets_for_high_nccl_busbw`` are read).
        expert_data_parallel_world_size: shard count for expert-parallel buffers.

    Returns:
        FullParamLayout: one :class:`PerBufferParamLayout` per ``BufferKey``, in the order
        ``group_params_for_buffers`` returns the keys.
    """
    layouts = {}
    grouped = group_params_for_buffers(params, ddp_config.grad_reduce_in_fp32)
    for key, (buffer_params, param_indices) in grouped.items():
        world_size = data_parallel_world_size
        if key.is_expert_parallel and expert_data_parallel_world_size is not None:
            world_size = expert_data_parallel_world_size
        layouts[key] = compute_per_buffer_param_layout(
            buffer_params, bucket_size, world_size, ddp_config, param_indices
        )
    return FullParamLayout(layouts=layouts)
