# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Shard-range and layout arithmetic of the distributed optimizer, checked against upstream (CPU).

Every function of ``distrib_optimizer_ranges`` is compared with the ``DistributedOptimizer``
method of megatron-core 0.19.2 that it reproduces, on hand-built buffers, on random buffers and
on real ``_ParamAndGradBuffer`` objects built on the CPU. A few hand-worked examples and
invariants pin the arithmetic down independently of upstream.
"""

import itertools
import random
from types import SimpleNamespace

import pytest
import torch

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer.param_layout import BufferKey, FullParamLayout, PerBufferParamLayout

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    import optimizer_table
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests import optimizer_table

upstream_modules = optimizer_table.sibling("upstream_modules")
_buffer_doubles = optimizer_table.sibling("buffer_doubles")
FakeGroup = _buffer_doubles.FakeGroup
param_and_grad_buffers = _buffer_doubles.param_and_grad_buffers

# The module is the fork's own; with the overlay switched off there is nothing to test.
ranges = pytest.importorskip(
    "megatron.core.optimizer.distrib_optimizer_ranges",
    reason="the fork's module is not importable (overlay off?)",
)

WORLD_SIZES = (1, 2, 3, 4, 8)
RANGE_KEYS = ["gbuf_world", "gbuf_world_in_bucket", "gbuf_local", "param"]
UPSTREAM_MODULE = upstream_modules.load()
needs_upstream = pytest.mark.skipif(
    UPSTREAM_MODULE is None, reason="upstream's distrib_optimizer module is not available"
)
Upstream = UPSTREAM_MODULE.DistributedOptimizer if UPSTREAM_MODULE is not None else None


def fake_buffer(param_index_map, bucket_bounds, rank, world_size, dtypes=None, shards=None):
    """An object with exactly the buffer and bucket attributes the range code reads."""
    param_dtype, grad_dtype = dtypes or (torch.float32, torch.float32)
    buckets = [
        SimpleNamespace(offset=start, grad_data=torch.empty(end - start))
        for start, end in bucket_bounds
    ]
    return SimpleNamespace(
        buckets=buckets,
        param_index_map=param_index_map,
        param_dtype=param_dtype,
        grad_dtype=grad_dtype,
        data_parallel_group=FakeGroup(rank, world_size),
        num_optimizer_shards=shards,
    )


def new_param(numel, dtype=torch.float32, **attributes):
    """A trainable parameter with ``numel`` elements and the given attributes."""
    param = torch.nn.Parameter(torch.zeros(numel, dtype=dtype))
    for key, value in attributes.items():
        setattr(param, key, value)
    return param


def random_buffer(rng, world_size):
    """Params at unaligned offsets, with gaps, in buckets whose sizes split evenly."""
    index_map = {}
    bounds = []
    cursor = 0
    for _ in range(rng.randint(1, 4)):
        start = cursor
        for _ in range(rng.randint(1, 5)):
            cursor += rng.choice([0, 0, 1, 3])
            numel = rng.choice([1, 2, 5, 7, 13, 40])
            index_map[new_param(numel)] = (cursor, cursor + numel, len(bounds))
            cursor += numel
        cursor += rng.randint(0, 3 * world_size)
        size = cursor - start
        size += -size % world_size
        cursor = start + size
        bounds.append((start, cursor))
    return index_map, bounds


def canonical_range_map(range_map, names):
    """A range map with parameters replaced by names and ranges by tuples, order kept."""
    result = []
    for dtypes, bucket_ranges in range_map.items():
        buckets = []
        for bucket_range in bucket_ranges:
            assert list(bucket_range) == ["param_map"]
            buckets.append(canonical_param_map(bucket_range["param_map"], names))
        result.append((dtypes, buckets))
    return result


def canonical_param_map(param_map, names):
    """A param map as ``[(name, [(key, start, end, size, len, str), ...]), ...]``."""
    result = []
    for param, param_ranges in param_map.items():
        assert list(param_ranges) == RANGE_KEYS
        entries = []
        for key, value in param_ranges.items():
            entries.append(
                (key, value.start, value.end, value.size, len(value), str(value), repr(value))
            )
        result.append((names[param], entries))
    return result


def assert_fork_ranges(range_map):
    """Every range the fork builds is the fork's Range."""
    for bucket_ranges in range_map.values():
        for bucket_range in bucket_ranges:
            for param_ranges in bucket_range["param_map"].values():
                assert all(type(r) is ranges.Range for r in param_ranges.values())


def names_of(params):
    """Parameter -> position, for readable comparisons."""
    return {param: index for index, param in enumerate(params)}


# --------------------------------------------------------------------------------------------
# Range
# --------------------------------------------------------------------------------------------


def test_range_attributes_text_and_length():
    interval = ranges.Range(3, 10)
    assert (interval.start, interval.end, interval.size) == (3, 10, 7)
    assert len(interval) == 7
    assert str(interval) == "3,10 [7]"
    assert repr(interval) == "3,10 [7]"
    assert repr([ranges.Range(0, 0)]) == "[0,0 [0]]"


def test_range_normalize_returns_a_shifted_copy():
    interval = ranges.Range(3, 10)
    at_zero = interval.normalize()
    at_five = interval.normalize(5)
    assert (at_zero.start, at_zero.end, at_zero.size) == (0, 7, 7)
    assert (at_five.start, at_five.end, at_five.size) == (5, 12, 7)
    assert isinstance(at_five, ranges.Range) and at_five is not interval
    assert (interval.start, interval.end, interval.size) == (3, 10, 7)


def test_range_size_is_fixed_at_construction():
    interval = ranges.Range(2, 6)
    interval.end = 9
    assert interval.size == 4 and len(interval) == 7
    assert str(interval) == "2,9 [4]"
    assert interval.normalize(1).end == 5


@needs_upstream
@pytest.mark.parametrize("bounds", [(0, 0), (0, 1), (3, 10), (128, 4096), (7, 5), (1.5, 4)])
def test_range_matches_upstream(bounds):
    mine, theirs = ranges.Range(*bounds), UPSTREAM_MODULE.Range(*bounds)
    assert (mine.start, mine.end, mine.size) == (theirs.start, theirs.end, theirs.size)
    assert (str(mine), repr(mine)) == (str(theirs), repr(theirs))
    for start in (0, 4, 100):
        normal_mine, normal_theirs = mine.normalize(start), theirs.normalize(start)
        assert (normal_mine.start, normal_mine.end, normal_mine.size) == (
            normal_theirs.start,
            normal_theirs.end,
            normal_theirs.size,
        )
    if bounds[1] >= bounds[0] and isinstance(bounds[0], int):
        assert len(mine) == len(theirs)
    else:
        with pytest.raises(type(_error_of(len, theirs))):
            len(mine)
    # Identity equality and hashing, as upstream.
    assert (theirs == UPSTREAM_MODULE.Range(*bounds)) is False
    assert (mine == ranges.Range(*bounds)) is False
    assert len({mine, ranges.Range(*bounds)}) == len({theirs, UPSTREAM_MODULE.Range(*bounds)}) == 2


def _error_of(function, *args):
    try:
        function(*args)
    except Exception as error:  # pylint: disable=broad-exception-caught
        return error
    raise AssertionError("expected an error")


# --------------------------------------------------------------------------------------------
# Hand-worked ranges
# --------------------------------------------------------------------------------------------


def test_bucket_shard_ranges_cut_evenly_from_the_bucket_offset():
    shards = ranges.bucket_shard_ranges(
        bucket_offset=24, bucket_numel=12, data_parallel_world_size=3
    )
    assert [(r.start, r.end, r.size) for r in shards] == [(24, 28, 4), (28, 32, 4), (32, 36, 4)]
    with pytest.raises(AssertionError):
        ranges.bucket_shard_ranges(0, 10, 4)


def test_straddling_params_hand_worked():
    """Bucket 1 starts at 12; its params straddle the shards [12, 16), [16, 20), [20, 24)."""
    first, second, third = new_param(12), new_param(5), new_param(7)
    index_map = {first: (0, 12, 0), second: (12, 17, 1), third: (17, 24, 1)}
    buffer = fake_buffer(index_map, [(0, 12), (12, 24)], rank=0, world_size=3)
    # Per rank: (param, gbuf_world, gbuf_world_in_bucket, gbuf_local, param) as (start, end).
    expected = [
        [(second, (12, 16), (0, 4), (0, 4), (0, 4))],
        [(second, (16, 17), (4, 5), (0, 1), (4, 5)), (third, (17, 20), (5, 8), (1, 4), (0, 3))],
        [(third, (20, 24), (8, 12), (0, 4), (3, 7))],
    ]
    for rank, wanted in enumerate(expected):
        param_map = ranges.build_bucket_range(buffer, 1, rank, 3)["param_map"]
        assert list(param_map) == [entry[0] for entry in wanted]
        for param, *bounds in wanted:
            got = [(value.start, value.end) for value in param_map[param].values()]
            assert got == bounds


def test_shard_holding_only_padding_is_empty():
    param = new_param(5)
    buffer = fake_buffer({param: (0, 5, 0)}, [(0, 16)], rank=0, world_size=4)
    owned = [ranges.build_bucket_range(buffer, 0, rank, 4)["param_map"] for rank in range(4)]
    assert [list(param_map) for param_map in owned] == [[param], [param], [], []]
    assert str(owned[1][param]["param"]) == "4,5 [1]"


def test_invalid_rank_and_shard_count_are_refused():
    param = new_param(8)
    buffer = fake_buffer({param: (0, 8, 0)}, [(0, 8)], rank=0, world_size=2, shards=4)
    with pytest.raises(AssertionError, match="4 optimizer shards"):
        ranges.build_bucket_range(buffer, 0, 0, 2)
    buffer.num_optimizer_shards = None
    with pytest.raises(ValueError):
        ranges.build_bucket_range(buffer, 0, 2, 2)
    with pytest.raises(AssertionError):
        ranges.build_bucket_range(buffer, 0, 0, 3)


def test_owned_pieces_tile_every_param_exactly_once():
    rng = random.Random(7)
    for world_size in WORLD_SIZES:
        for _ in range(20):
            index_map, bounds = random_buffer(rng, world_size)
            buffer = fake_buffer(index_map, bounds, 0, world_size)
            covered = {param: [] for param in index_map}
            for rank in range(world_size):
                range_map = ranges.build_buffer_range_map(buffer, rank, world_size)
                (bucket_ranges,) = range_map.values()
                for bucket_index, bucket_range in enumerate(bucket_ranges):
                    offset, end = bounds[bucket_index]
                    shard_numel = (end - offset) // world_size
                    for param, piece in bucket_range["param_map"].items():
                        start = index_map[param][0]
                        assert piece["gbuf_world"].start - start == piece["param"].start
                        assert (
                            piece["gbuf_world"].start - offset
                            == piece["gbuf_world_in_bucket"].start
                        )
                        assert (
                            0 <= piece["gbuf_local"].start < piece["gbuf_local"].end <= shard_numel
                        )
                        assert (
                            piece["gbuf_local"].start + offset + rank * shard_numel
                            == piece["gbuf_world"].start
                        )
                        assert len({r.size for r in piece.values()}) == 1
                        covered[param].append((piece["param"].start, piece["param"].end))
            for param, pieces in covered.items():
                pieces.sort()
                numel = index_map[param][1] - index_map[param][0]
                assert pieces[0][0] == 0 and pieces[-1][1] == numel
                assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))


# --------------------------------------------------------------------------------------------
# Ranges against upstream
# --------------------------------------------------------------------------------------------


@needs_upstream
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_buffer_range_map_matches_upstream_on_random_buffers(world_size):
    rng = random.Random(world_size)
    for case in range(25):
        index_map, bounds = random_buffer(rng, world_size)
        dtypes = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)][case % 2]
        names = names_of(index_map)
        shards = world_size if case % 3 else None
        for rank in range(world_size):
            buffer = fake_buffer(index_map, bounds, rank, world_size, dtypes, shards)
            theirs = Upstream._build_gbuf_range_map(buffer)
            mine = ranges.build_buffer_range_map(buffer, rank, world_size)
            from_group = ranges.build_buffer_range_map_from_group(buffer)
            assert_fork_ranges(mine)
            assert list(mine) == [dtypes]
            assert canonical_range_map(mine, names) == canonical_range_map(theirs, names)
            assert canonical_range_map(from_group, names) == canonical_range_map(theirs, names)
            for bucket_index in range(len(bounds)):
                theirs_bucket = Upstream._build_model_gbuf_range(buffer, bucket_index)
                mine_bucket = ranges.build_bucket_range_from_group(buffer, bucket_index)
                assert canonical_param_map(mine_bucket["param_map"], names) == canonical_param_map(
                    theirs_bucket["param_map"], names
                )


@needs_upstream
def test_param_range_map_matches_upstream_for_any_shard():
    rng = random.Random(3)
    index_map, _ = random_buffer(rng, 1)
    names = names_of(index_map)
    end = max(stop for _, stop, _ in index_map.values())
    for start, stop, offset in itertools.product(
        range(0, end + 3, 5), range(0, end + 3, 7), (0, 4)
    ):
        if stop < start:
            continue
        theirs = Upstream._build_model_gbuf_param_range_map(
            index_map, UPSTREAM_MODULE.Range(start, stop), offset
        )
        mine = ranges.build_param_range_map(index_map, ranges.Range(start, stop), offset)
        assert canonical_param_map(mine, names) == canonical_param_map(theirs, names)


@needs_upstream
def test_refusals_match_upstream():
    param = new_param(8)
    cases = [
        (fake_buffer({param: (0, 8, 0)}, [(0, 8)], 0, 2, shards=4), AssertionError),
        (fake_buffer({param: (0, 8, 0)}, [(0, 9)], 0, 2), AssertionError),
    ]
    for buffer, error in cases:
        with pytest.raises(error):
            Upstream._build_gbuf_range_map(buffer)
        with pytest.raises(error):
            ranges.build_buffer_range_map_from_group(buffer)


def _buffers_for_groups(world_size, rank, rng):
    """Three buffers of different dtypes and their params."""
    buffers, params = [], []
    dtype_pairs = [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
    ]
    for dtypes in dtype_pairs:
        index_map, bounds = random_buffer(rng, world_size)
        params.extend(index_map)
        buffers.append(fake_buffer(index_map, bounds, rank, world_size, dtypes))
    return buffers, params


@needs_upstream
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_param_to_bucket_map_and_group_ranges_match_upstream(world_size):
    rng = random.Random(100 + world_size)
    for _ in range(6):
        for rank in range(world_size):
            buffers, params = _buffers_for_groups(world_size, rank, random.Random(rng.random()))
            shuffled = list(params)
            rng.shuffle(shuffled)
            cut = sorted(rng.sample(range(len(shuffled) + 1), 2))
            param_groups = [
                {"params": shuffled[: cut[0]], "lr": 1.0, "wd_mult": 1.0},
                {"params": [], "lr": 2.0},
                {"params": shuffled[cut[0] : cut[1]], "weight_decay": 0.0, "lr_mult": 0.5},
                {"params": shuffled[cut[1] :], "is_decoupled_lr": True},
            ]
            theirs_ranges = [Upstream._build_gbuf_range_map(buffer) for buffer in buffers]
            mine_ranges = [ranges.build_buffer_range_map(b, rank, world_size) for b in buffers]

            assert ranges.build_param_to_bucket_map(
                mine_ranges
            ) == Upstream._build_model_param_gbuf_map(theirs_ranges)

            theirs_index, theirs_groups = Upstream._build_optimizer_group_ranges(
                param_groups, theirs_ranges
            )
            mine_index, mine_groups = ranges.build_optimizer_group_ranges(param_groups, mine_ranges)
            assert list(mine_index.items()) == list(theirs_index.items())
            assert len(mine_groups) == len(theirs_groups) == len(param_groups)
            for mine_group, theirs_group in zip(mine_groups, theirs_groups):
                assert list(mine_group) == list(theirs_group)
                assert [id(p) for p in mine_group["params"]] == [
                    id(p) for p in theirs_group["params"]
                ]
                assert mine_group["orig_group"] is theirs_group["orig_group"]
                assert mine_group["orig_group_idx"] is theirs_group["orig_group_idx"]


def test_group_ranges_hand_worked():
    first, second, third = new_param(4), new_param(4), new_param(4)
    index_map = {first: (0, 4, 0), second: (4, 8, 0), third: (8, 12, 1)}
    buffer = fake_buffer(index_map, [(0, 8), (8, 12)], 0, 1, (torch.bfloat16, torch.float32))
    gbuf_ranges = [ranges.build_buffer_range_map(buffer, 0, 1)]
    groups = [{"params": [third, first]}, {"params": []}, {"params": [second], "lr": 0.1}]
    place, group_ranges = ranges.build_optimizer_group_ranges(groups, gbuf_ranges)
    assert place == {first: (0, 0), second: (2, 0), third: (0, 1)}
    assert [g["params"] for g in group_ranges] == [[first, third], [], [second]]
    assert all(g["orig_group"] is groups[i] for i, g in enumerate(group_ranges))
    assert all(g["orig_group_idx"] is groups[i] for i, g in enumerate(group_ranges))
    dtypes = (torch.bfloat16, torch.float32)
    assert ranges.build_param_to_bucket_map(gbuf_ranges) == {
        first: (0, dtypes, 0),
        second: (0, dtypes, 0),
        third: (0, dtypes, 1),
    }


@needs_upstream
def test_param_listed_in_two_groups_joins_the_last_like_upstream():
    first, second = new_param(4), new_param(4)
    buffer = fake_buffer({first: (0, 4, 0), second: (4, 8, 0)}, [(0, 8)], 0, 1)
    groups = [{"params": [first, second]}, {"params": [first]}, {"params": []}]
    mine_index, mine_groups = ranges.build_optimizer_group_ranges(
        groups, [ranges.build_buffer_range_map(buffer, 0, 1)]
    )
    theirs_index, theirs_groups = Upstream._build_optimizer_group_ranges(
        groups, [Upstream._build_gbuf_range_map(buffer)]
    )
    assert mine_index == theirs_index == {first: (1, 0), second: (0, 0)}
    assert [g["params"] for g in mine_groups] == [g["params"] for g in theirs_groups]


@needs_upstream
def test_group_and_bucket_refusals_match_upstream():
    param = new_param(4)
    buffer = fake_buffer({param: (0, 4, 0)}, [(0, 4)], 0, 1)
    once = ranges.build_buffer_range_map(buffer, 0, 1)
    theirs_once = Upstream._build_gbuf_range_map(buffer)
    with pytest.raises(AssertionError):
        Upstream._build_model_param_gbuf_map([theirs_once, theirs_once])
    with pytest.raises(AssertionError):
        ranges.build_param_to_bucket_map([once, once])

    frozen = new_param(4)
    frozen.requires_grad_(False)
    with pytest.raises(AssertionError):
        Upstream._build_optimizer_group_ranges([{"params": [param, frozen]}], [theirs_once])
    with pytest.raises(AssertionError):
        ranges.build_optimizer_group_ranges([{"params": [param, frozen]}], [once])
    with pytest.raises(KeyError):
        Upstream._build_optimizer_group_ranges([{"params": []}], [theirs_once])
    with pytest.raises(KeyError):
        ranges.build_optimizer_group_ranges([{"params": []}], [once])


# --------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------


def ddp_config(**overrides):
    """A distributed-optimizer DDP config."""
    return DistributedDataParallelConfig(use_distributed_optimizer=True, **overrides)


def assert_same_layout(mine, theirs):
    """Dataclass equality plus the order of the parameters."""
    assert type(mine) is PerBufferParamLayout
    assert mine == theirs
    assert [id(p) for p in mine.param_index_map] == [id(p) for p in theirs.param_index_map]


def test_per_buffer_layout_hand_worked():
    first, second, third = new_param(10), new_param(100), new_param(3)
    layout = ranges.compute_per_buffer_param_layout([first, second, third], None, 2, ddp_config())
    assert layout.param_index_map == {third: (0, 3, 0), second: (64, 164, 0), first: (192, 202, 0)}
    assert layout.bucket_indices == [(0, 256)]
    assert layout.per_bucket_numel_unpadded == [202]
    assert layout.param_indices == [] and layout.num_optimizer_shards == 2


def test_shared_embedding_gets_a_bucket_of_its_own():
    embedding, first, second = new_param(10, shared_embedding=True), new_param(5), new_param(7)
    layout = ranges.compute_per_buffer_param_layout(
        [embedding, first, second], None, 3, ddp_config(), [0, 1, 2]
    )
    # Placed last first: second at 0, first at 64, then the embedding closes bucket 0 at the
    # aligned start 128 it would have had, and opens bucket 1 at the padded end lcm(3,128)=384.
    assert layout.param_index_map == {
        second: (0, 7, 0),
        first: (64, 69, 0),
        embedding: (384, 394, 1),
    }
    assert layout.bucket_indices == [(0, 384), (384, 768)]
    assert layout.per_bucket_numel_unpadded == [128, 10]
    assert layout.param_indices == [0, 1, 2]


def test_bucket_size_and_nccl_padding():
    params = [new_param(n) for n in (50, 60, 70)]
    layout = ranges.compute_per_buffer_param_layout(
        params, 100, 4, ddp_config(pad_buckets_for_high_nccl_busbw=True)
    )
    # 70 at 0; 60 at 128, bucket 0 reaches 188 >= 100 and ends at 2**16; 50 opens bucket 1.
    assert layout.bucket_indices == [(0, 2**16), (2**16, 2**17)]
    assert layout.per_bucket_numel_unpadded == [188, 50]
    assert layout.param_index_map[params[0]] == (2**16, 2**16 + 50, 1)


def random_params(rng, count):
    """Params of random sizes, some of them shared embeddings."""
    params = []
    for _ in range(count):
        shared = rng.random() < 0.2
        params.append(
            new_param(rng.choice([1, 3, 64, 65, 100, 127, 128, 500]), shared_embedding=shared)
        )
    return params


@needs_upstream
@pytest.mark.parametrize("world_size", WORLD_SIZES + (6,))
@pytest.mark.parametrize("pad_for_busbw", [False, True])
def test_per_buffer_layout_matches_upstream(world_size, pad_for_busbw):
    rng = random.Random(world_size * 2 + pad_for_busbw)
    config = ddp_config(pad_buckets_for_high_nccl_busbw=pad_for_busbw)
    cases = [[], [new_param(5, shared_embedding=True)], [new_param(1) for _ in range(3)]]
    cases += [random_params(rng, rng.randint(1, 12)) for _ in range(30)]
    shared = [new_param(9, shared_embedding=True), new_param(9, shared_embedding=True)]
    cases += [shared, [shared[0], new_param(3), shared[1]], [new_param(3)] + shared]
    for params in cases:
        for bucket_size in (None, 0, 1, 64, 200, 1000, 10**9):
            indices = list(range(len(params))) if bucket_size == 64 else None
            theirs = Upstream._compute_per_buffer_param_layout(
                params, bucket_size, world_size, config, indices
            )
            mine = ranges.compute_per_buffer_param_layout(
                params, bucket_size, world_size, config, indices
            )
            assert_same_layout(mine, theirs)


class MixedModel(torch.nn.Module):
    """fp32 and bf16 layers, expert params, a shared embedding and a layer-wise-managed param."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(40, 8)
        self.embedding.weight.shared_embedding = True
        self.dense = torch.nn.Linear(8, 24)
        self.norm = torch.nn.LayerNorm(24).to(torch.bfloat16)
        self.expert_one = torch.nn.Linear(24, 12, bias=False)
        self.expert_two = torch.nn.Linear(12, 24).to(torch.bfloat16)
        for expert in (self.expert_one, self.expert_two):
            for param in expert.parameters():
                param.allreduce = False
        self.head = torch.nn.Linear(24, 3)
        self.head.bias.is_managed_by_layer_wise_optimizer = True
        self.output = torch.nn.Linear(24, 40, bias=False)
        self.output.weight.shared_embedding = True


@needs_upstream
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("grad_reduce_in_fp32", [False, True])
def test_full_layout_matches_upstream_on_a_module(world_size, grad_reduce_in_fp32):
    params = list(MixedModel().parameters())
    config = ddp_config(grad_reduce_in_fp32=grad_reduce_in_fp32)
    for bucket_size, expert_world_size in itertools.product((None, 100, 400), (None, 1, 2)):
        theirs = Upstream.compute_full_param_layout(
            params,
            bucket_size,
            world_size,
            config,
            expert_data_parallel_world_size=expert_world_size,
        )
        mine = ranges.compute_full_param_layout(
            params,
            bucket_size,
            world_size,
            config,
            expert_data_parallel_world_size=expert_world_size,
        )
        assert type(mine) is FullParamLayout
        assert list(mine.layouts) == list(theirs.layouts)
        assert len(mine.layouts) >= 4
        for key, layout in mine.layouts.items():
            assert_same_layout(layout, theirs.layouts[key])
        expert_keys = [key for key in mine.layouts if key.is_expert_parallel]
        assert expert_keys and all(
            mine.layouts[key].num_optimizer_shards == (expert_world_size or world_size)
            for key in expert_keys
        )


def test_full_layout_groups_by_buffer_key():
    fp32, bf16, expert = new_param(4), new_param(4, torch.bfloat16), new_param(4, allreduce=False)
    layout = ranges.compute_full_param_layout(
        [fp32, bf16, expert], None, 2, ddp_config(grad_reduce_in_fp32=True), 8
    )
    assert list(layout.layouts) == [
        BufferKey(torch.float32, torch.float32, False),
        BufferKey(torch.bfloat16, torch.float32, False),
        BufferKey(torch.float32, torch.float32, True),
    ]
    shards = [one.num_optimizer_shards for one in layout.layouts.values()]
    assert shards == [2, 2, 8]


# --------------------------------------------------------------------------------------------
# Real buffers built from the layouts
# --------------------------------------------------------------------------------------------


def real_buffers(params, layout, config, bucket_size):
    """megatron-core's ``_ParamAndGradBuffer`` objects on the CPU, one per buffer key."""
    names = {param: f"param{index}" for index, param in enumerate(params)}
    return param_and_grad_buffers(
        params,
        names,
        layout,
        config,
        bucket_size,
        lambda key: FakeGroup(0, layout.layouts[key].num_optimizer_shards),
    )


@needs_upstream
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("bucket_size", [None, 150])
def test_real_buffers_give_upstream_ranges(world_size, bucket_size):
    model = MixedModel()
    params = list(model.parameters())
    names = names_of(params)
    config = ddp_config()
    layout = ranges.compute_full_param_layout(params, bucket_size, world_size, config, 2)
    buffers = real_buffers(params, layout, config, bucket_size)
    assert sum(len(buffer.buckets) for buffer in buffers) > len(buffers)
    for rank in range(world_size):
        for buffer in buffers:
            buffer.data_parallel_group.rank_value = rank % buffer.data_parallel_group.size()
        theirs = [Upstream._build_gbuf_range_map(buffer) for buffer in buffers]
        mine = [ranges.build_buffer_range_map_from_group(buffer) for buffer in buffers]
        explicit = [
            ranges.build_buffer_range_map(b, *ranges.data_parallel_rank_and_size(b))
            for b in buffers
        ]
        for one, two, three in zip(mine, theirs, explicit):
            assert canonical_range_map(one, names) == canonical_range_map(two, names)
            assert canonical_range_map(three, names) == canonical_range_map(two, names)
        assert ranges.build_param_to_bucket_map(mine) == Upstream._build_model_param_gbuf_map(
            theirs
        )
        groups = [
            {"params": [p for p in params if p.dim() > 1]},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
        ]
        mine_index, mine_groups = ranges.build_optimizer_group_ranges(groups, mine)
        theirs_index, theirs_groups = Upstream._build_optimizer_group_ranges(groups, theirs)
        assert list(mine_index.items()) == list(theirs_index.items())
        assert [[id(p) for p in g["params"]] for g in mine_groups] == [
            [id(p) for p in g["params"]] for g in theirs_groups
        ]
