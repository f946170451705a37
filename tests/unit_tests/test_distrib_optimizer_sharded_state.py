# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Sharded (dist-checkpointing) state of the distributed optimizer, checked against upstream.

The mixin runs on :class:`Host`, a test double carrying exactly the attributes and methods of
``DistributedOptimizer`` that the mixin reads, with hand-laid buffers (gaps between parameters,
padding at the end of every bucket, several buckets per buffer) and a real torch AdamW over the
owned shards. The same double also runs megatron-core 0.19.2's own methods (copied onto a
subclass), so keys, shapes, offsets, replica ids, flattened ranges and data can be compared
for every sharding type and every rank of several data-parallel sizes.

Expected values are derived independently from a "model-space truth": random state tensors per
parameter, scattered into each layout's buffers. ``fully_reshardable`` must give back exactly
that truth, also where upstream 0.19.2 reads shifted offsets (several buckets per buffer).
"""

import copy
import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.validation import _validate_sharding_for_key

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    import optimizer_table
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests import optimizer_table

upstream_modules = optimizer_table.sibling("upstream_modules")
FakeGroup = optimizer_table.sibling("buffer_doubles").FakeGroup
FusedAdamDouble = optimizer_table.sibling("optimizer_doubles").FusedAdamDouble

sharded_state = pytest.importorskip(
    "megatron.core.optimizer.distrib_optimizer_sharded_state",
    reason="the fork's module is not importable (overlay off?)",
)
model_space = pytest.importorskip("megatron.core.optimizer.distrib_optimizer_model_space")
ranges = pytest.importorskip("megatron.core.optimizer.distrib_optimizer_ranges")
param_state = pytest.importorskip("megatron.core.optimizer.distrib_optimizer_param_state")
inner = pytest.importorskip("megatron.core.optimizer.inner_optimizer_state")
LoadGuard = pytest.importorskip("megatron.core.optimizer.state_load_checks").LoadGuard

Mixin = sharded_state.DistributedOptimizerShardedStateMixin

UPSTREAM = upstream_modules.load()
if UPSTREAM is None:
    # The double itself borrows upstream's methods, so nothing here runs without them.
    pytest.skip("upstream's distrib_optimizer module is not available", allow_module_level=True)
Upstream = UPSTREAM.DistributedOptimizer

STATE_KEYS = ("exp_avg", "exp_avg_sq")
TRUTH_KEYS = ("param",) + STATE_KEYS
DTYPES = (torch.float32, torch.float32)
SHAPES = [(4, 6), (10,), (3, 5), (7,), (2, 3, 4), (9,), (5, 2)]
# Parameters per bucket, per buffer. Buffer 0 has two buckets (the case upstream gets wrong).
MULTI_BUCKET = [[[0, 1], [2, 3]], [[4, 5, 6]]]
SINGLE_BUCKET = [[[0, 1, 2, 3]], [[4, 5, 6]]]
GAP = 1  # elements left free before every second parameter
END_PADDING = 3  # at least this much padding at the end of every bucket
WORLD_SIZES = (1, 2, 3, 4)
UPSTREAM_MEMBERS = (
    "checkpoint_fully_reshardable_formats",
    "_init_optimizer_states_with_dummy_values",
    "_param_name",
    "sharded_state_dict",
    "_param_groups_to_param2group_meta",
    "_param2group_meta_to_param_groups",
    "sharded_param_state_fsdp_dtensor",
    "sharded_param_state_dp_zero",
    "sharded_param_state_fully_reshardable",
    "sharded_param_state_dp_reshardable",
    "sharded_param_state_fs_model_space",
    "load_parameter_state_from_fs_model_space",
    "load_parameter_state_from_fully_reshardable",
)


class Model(torch.nn.Module):
    """One model chunk: parameters ``w0, w1, ...`` and the config ``_param_name`` reads."""

    def __init__(self, shapes):
        super().__init__()
        for index, shape in enumerate(shapes):
            self.register_parameter(f"w{index}", torch.nn.Parameter(torch.zeros(shape)))
        self.config = SimpleNamespace(num_moe_experts=None)


@pytest.fixture(autouse=True)
def single_rank_expert_parallelism(monkeypatch):
    """Parameter names go through megatron's expert renaming, which asks parallel_state for
    the expert-parallel size and rank. Pin them to one rank, as in a process that never
    initialised model parallelism (an earlier test may have left torch.distributed up)."""
    monkeypatch.setattr(parallel_state, "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE", 1)
    monkeypatch.setattr(parallel_state, "_MPU_EXPERT_MODEL_PARALLEL_RANK", 0)


def model_truth(params, seed):
    """Random fp32 ``param``/``exp_avg``/``exp_avg_sq`` per parameter, in model shape."""
    generator = torch.Generator().manual_seed(seed)
    return {key: [torch.randn(p.shape, generator=generator) for p in params] for key in TRUTH_KEYS}


def lay_out(params, plan, world_size):
    """Buffers as the mixin reads them: param_index_map, padded buckets, unpadded sizes.

    Every second parameter starts after a gap of ``GAP`` elements; every bucket ends with at
    least ``END_PADDING`` elements of padding and splits evenly over ``world_size`` ranks.
    """
    buffers = []
    for buckets_plan in plan:
        index_map, buckets, cursor = {}, [], 0
        for bucket_id, members in enumerate(buckets_plan):
            offset = cursor
            for position, param_index in enumerate(members):
                cursor += GAP * (position % 2)
                numel = params[param_index].numel()
                index_map[params[param_index]] = (cursor, cursor + numel, bucket_id)
                cursor += numel
            unpadded = cursor - offset
            size = unpadded + END_PADDING
            size += -size % world_size
            cursor = offset + size
            buckets.append(
                SimpleNamespace(
                    offset=offset,
                    grad_data=torch.empty(size),
                    numel_unpadded=unpadded,
                    bucket_id=bucket_id,
                )
            )
        buffers.append(
            SimpleNamespace(
                param_index_map=index_map,
                buckets=buckets,
                param_dtype=DTYPES[0],
                grad_dtype=DTYPES[1],
                numel=cursor,
                numel_unpadded=sum(b.numel_unpadded for b in buckets),
            )
        )
    return buffers


def position(params, param):
    """Index of ``param`` in ``params`` by identity (tensors compare element-wise)."""
    return next(i for i, p in enumerate(params) if p is param)


def buffer_truth(buffer, params, truth):
    """The truth scattered into a buffer's flat layout (free elements hold zero)."""
    flat = {key: torch.zeros(buffer.numel) for key in TRUTH_KEYS}
    for param, (start, end, _) in buffer.param_index_map.items():
        for key in TRUTH_KEYS:
            flat[key][start:end] = truth[key][position(params, param)].reshape(-1)
    return flat


class Host:
    """Test double of ``DistributedOptimizer`` for the sharded-state mixin.

    It has the attributes the mixin reads under upstream's names (``gbuf_ranges``,
    ``buffers``, ``data_parallel_group`` (and ``_gloo``), ``data_parallel_group_idx``,
    ``distributed_optimizer_instance_id``, ``ddp_config``, ``config``, ``model_chunks``,
    ``optimizer``, ``state``, ``optimizer_state_keys``, ``inner_state``,
    ``per_bucket_numel(_unpadded)``, ``model_param_group_index_map``) and these methods:

    * ``_get_main_param_and_optimizer_states`` / ``_set_...``: through the fork's
      ``InnerOptimizerState`` over a torch AdamW of the owned fp32 shards (``expose_step`` adds
      torch's ``step`` to what is read, as 0.19.2's getter does);
    * ``_main_param_and_optimizer_load_targets``: the getter's load-side twin;
    * ``get_parameter_state_dp_reshardable``: upstream's own (it communicates nothing), and
      the fork's ``_dp_reshardable_layout`` that loads use;
    * ``get_parameter_state_dp_zero``: the gather over all ranks simulated from the truth, in
      the documented coalesced layout (each bucket's unpadded elements back to back); every
      call is recorded in ``gathers``;
    * ``state_dict`` returns fixed common state; ``load_state_dict`` records its argument.
    """

    def __init__(self, params, buffers, truth, rank, world_size, **options):
        self.model_chunks = [options.get("model")]
        self.params = params
        self.buffers = buffers
        self.truth = truth
        self.data_parallel_group = FakeGroup(rank, world_size)
        self.data_parallel_group_gloo = options.get("gloo_group", self.data_parallel_group)
        self.data_parallel_group_idx = 3
        self.distributed_optimizer_instance_id = options.get("instance_id", 0)
        self.ddp_config = SimpleNamespace(use_megatron_fsdp=options.get("fsdp", False))
        self.config = SimpleNamespace(
            optimizer="adam", use_precision_aware_optimizer_no_fp8_or_ds_fp8=False
        )
        self.optimizer_state_keys = STATE_KEYS
        self.expose_step = options.get("expose_step", False)
        self.gathers = []
        self.loaded_common = []
        self.gbuf_ranges = [ranges.build_buffer_range_map(b, rank, world_size) for b in buffers]
        self.per_bucket_numel = [
            {DTYPES: [b.grad_data.numel() for b in buf.buckets]} for buf in buffers
        ]
        self.per_bucket_numel_unpadded = [
            {DTYPES: [b.numel_unpadded for b in buf.buckets]} for buf in buffers
        ]
        groups = [
            {"params": [], "lr": 0.1, "weight_decay": 0.01},
            {"params": [], "lr": 0.1, "weight_decay": 0.0},
        ]
        self.model_param_group_index_map = {}
        self.shard_of = {}
        for buf_index, range_map in enumerate(self.gbuf_ranges):
            flat = buffer_truth(buffers[buf_index], params, truth)
            for bucket in range_map[DTYPES]:
                for param, param_ranges in bucket["param_map"].items():
                    world = param_ranges["gbuf_world"]
                    shard = torch.nn.Parameter(flat["param"][world.start : world.end].clone())
                    group_index = position(params, param) % 2
                    self.model_param_group_index_map[param] = (
                        group_index,
                        len(groups[group_index]["params"]),
                    )
                    groups[group_index]["params"].append(shard)
                    self.shard_of[param] = (shard, flat, world)
        moment_dtype = options.get("precision_aware")
        if moment_dtype is None:
            self.optimizer = torch.optim.AdamW(groups)
        else:
            self.optimizer = FusedAdamDouble(
                groups,
                master_weights=True,
                exp_avg_dtype=moment_dtype,
                exp_avg_sq_dtype=moment_dtype,
            )
        self.inner_state = inner.InnerOptimizerState(
            self.optimizer, STATE_KEYS, precision_aware=moment_dtype is not None
        )
        self._load_guard = LoadGuard(type(self).__name__)
        if options.get("materialise", True):
            self.inner_state.materialise()
            for shard, flat, world in self.shard_of.values():
                self.inner_state.write(
                    shard, {key: flat[key][world.start : world.end] for key in TRUTH_KEYS}
                )
            self.inner_state.set_step(7)

    @property
    def state(self):  # pylint: disable=missing-function-docstring
        return self.optimizer.state

    def state_dict(self):  # pylint: disable=missing-function-docstring
        groups = [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
        ]
        return {"optimizer": {"param_groups": groups}, "grad_scaler": {"scale": 4.0}}

    _common_state_dict = state_dict  # what the core describes itself with while loading

    def load_state_dict(self, state_dict):  # pylint: disable=missing-function-docstring
        self.loaded_common.append(state_dict)

    def _get_main_param_and_optimizer_states(self, model_param):
        return self._tensors_of(model_param, self.inner_state.read)

    def _main_param_and_optimizer_load_targets(self, model_param):
        return self._tensors_of(model_param, self.inner_state.load_targets)

    def _tensors_of(self, model_param, access):
        shard = self.shard_of[model_param][0]
        tensors = access(shard)
        if self.expose_step:
            tensors["step"] = self.optimizer.state[shard]["step"]
        return tensors

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        self.inner_state.write(self.shard_of[model_param][0], tensors)

    get_parameter_state_dp_reshardable = Upstream.get_parameter_state_dp_reshardable
    # Loading lays the pieces out with the fork's walker, which the saves above cross-check.
    _dp_reshardable_layout = param_state.DistributedOptimizerParameterStateMixin.__dict__[
        "_dp_reshardable_layout"
    ]
    _param_state_buffers = param_state.DistributedOptimizerParameterStateMixin.__dict__[
        "_param_state_buffers"
    ]

    def get_parameter_state_dp_zero(
        self, use_gloo_comm=True, empty_data=False, return_on_all_ranks=False
    ):
        """What the gather of all ranks' shards returns (see the class docstring)."""
        self.gathers.append((use_gloo_comm, empty_data, return_on_all_ranks))
        if self.data_parallel_group.rank() != 0 and not return_on_all_ranks:
            return None
        state = {"buckets_coalesced": True}
        for buf_index, buf in enumerate(self.buffers):
            flat = buffer_truth(buf, self.params, self.truth)
            world = {}
            for key in TRUTH_KEYS:
                parts = [flat[key][b.offset : b.offset + b.numel_unpadded] for b in buf.buckets]
                world[key] = torch.zeros(buf.numel_unpadded) if empty_data else torch.cat(parts)
            world["numel_unpadded"] = buf.numel_unpadded
            state[buf_index] = {DTYPES: world}
        return state

    def live_state(self):
        """Each owned parameter's master value and moments (clones), by model param."""
        return {
            param: {k: v.detach().clone() for k, v in self.inner_state.read(shard).items()}
            for param, (shard, _, _) in self.shard_of.items()
        }


class ForkHost(Mixin, model_space.DistributedOptimizerModelSpaceStateMixin, Host):
    """The double with the fork's sharded-state methods, the model-shaped formats' included."""


UpstreamHost = type(
    "UpstreamHost", (Host,), {name: Upstream.__dict__[name] for name in UPSTREAM_MEMBERS}
)


def build(plan, world_size, rank, seed=0, host_class=ForkHost, **options):
    """A host for ``rank`` of ``world_size`` with the model, layout and truth of ``seed``."""
    torch.manual_seed(seed)
    model = options.pop("model", None) or Model(SHAPES)
    params = list(model.parameters())
    buffers = options.pop("buffers", None) or lay_out(params, plan, world_size)
    truth = options.pop("truth", None) or model_truth(params, seed)
    return host_class(params, buffers, truth, rank, world_size, model=model, **options)


def build_nothing(*args):  # pylint: disable=missing-function-docstring
    del args


def merge_nothing(*args):  # pylint: disable=missing-function-docstring
    del args


def model_sharded_state_dict(host, factory_index=3, tp_index=0, all_factories=False, rank=None):
    """The model's sharded entries: one tensor-parallel sharded, one factory, rest plain.

    ``all_factories`` makes every entry a factory: megatron-core 0.19.2 refuses a
    ShardedTensor with a ``flattened_range``, so ``fully_sharded_model_space`` only works
    with factories there. ``rank`` is the data-parallel part of the replica ids (default: the
    host's rank; the whole data-parallel group's rank where there are several optimizer
    instances).
    """
    rank = host.data_parallel_group.rank() if rank is None else rank
    entries = {}
    for index, param in enumerate(host.params):
        key = f"decoder.w{index}"
        if index == factory_index or all_factories:
            entries[key] = ShardedTensorFactory(
                key, param, build_nothing, merge_nothing, replica_id=(0, 0, rank)
            )
        elif index == tp_index:
            entries[key] = ShardedTensor.from_rank_offsets(
                key, param, (0, 1, 2), replica_id=(0, 0, rank)
            )
        else:
            entries[key] = ShardedTensor.from_rank_offsets(key, param, replica_id=(0, 0, rank))
    return {"model": entries}


def canonical(value, with_data=True):
    """A comparable form of a (sharded) state dict; tensors become dtype, shape and values."""
    if isinstance(value, dict):
        return {key: canonical(item, with_data) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(canonical(item, with_data) for item in value)
    if isinstance(value, ShardedTensor):
        flat = value.flattened_range
        return (
            "ShardedTensor",
            value.key,
            value.dtype,
            tuple(value.local_shape),
            tuple(value.global_shape),
            tuple(value.global_offset),
            value.axis_fragmentations,
            value.replica_id,
            value.prepend_axis_num,
            value.allow_shape_mismatch,
            None if flat is None else (flat.start, flat.stop, flat.step),
            canonical(value.data, with_data),
        )
    if isinstance(value, ShardedTensorFactory):
        flat = value.flattened_range
        return (
            "Factory",
            value.key,
            value.replica_id,
            None if flat is None else (flat.start, flat.stop, flat.step),
            value.build_fn,
            value.merge_fn,
            canonical(value.data, with_data),
        )
    if isinstance(value, ShardedObject):
        return (
            "ShardedObject",
            value.key,
            tuple(value.global_shape),
            tuple(value.global_offset),
            value.replica_id,
            canonical(value.data, with_data),
        )
    if isinstance(value, LocalNonpersistentObject):
        return ("LocalNonpersistent", canonical(value.obj, with_data))
    if isinstance(value, torch.Tensor):
        data = value.detach().tolist() if with_data and value.numel() else None
        return ("tensor", value.dtype, tuple(value.shape), data)
    return value


def sharded_entries(state):
    """Every ShardedTensor or factory of a state dict."""
    return [v for v in nested_values(state) if isinstance(v, (ShardedTensor, ShardedTensorFactory))]


def simulate_load(saved, request):
    """Do what a checkpoint load does to ``request``: fill its tensors in place from the
    saved entries with the same key, offset and flattened range, then unwrap everything."""
    by_place = {}
    for entry in sharded_entries(saved):
        flat = entry.flattened_range
        offset = getattr(entry, "global_offset", None)
        by_place[(entry.key, offset, None if flat is None else (flat.start, flat.stop))] = entry
    for entry in sharded_entries(request):
        flat = entry.flattened_range
        offset = getattr(entry, "global_offset", None)
        source = by_place[(entry.key, offset, None if flat is None else (flat.start, flat.stop))]
        with torch.no_grad():
            entry.data.copy_(source.data)

    def unwrap(value):
        if isinstance(value, (ShardedTensor, ShardedTensorFactory, ShardedObject)):
            return value.data
        if isinstance(value, LocalNonpersistentObject):
            return value.obj
        return value

    dict_list_map_inplace(unwrap, request)
    return request


def assert_live_state_is(host, truth):
    """Every owned shard's master value and moments equal the truth's slice, exactly."""
    for param, tensors in host.live_state().items():
        index = position(host.params, param)
        param_range = owned_param_range(host, param)
        for key in TRUTH_KEYS:
            expected = truth[key][index].reshape(-1)[param_range.start : param_range.end]
            assert torch.equal(tensors[key], expected), (index, key)


def owned_param_range(host, param):
    """The ``param`` range of the piece of ``param`` that ``host`` owns."""
    for range_map in host.gbuf_ranges:
        for bucket in range_map[DTYPES]:
            if param in bucket["param_map"]:
                return bucket["param_map"][param]["param"]
    raise KeyError(param)


def all_hosts(plan, world_size, host_class=ForkHost, **options):
    """One host per rank, sharing model, layout and truth."""
    first = build(plan, world_size, 0, host_class=host_class, **options)
    hosts = [first]
    for rank in range(1, world_size):
        options.update(model=first.model_chunks[0], buffers=first.buffers, truth=first.truth)
        hosts.append(build(plan, world_size, rank, host_class=host_class, **options))
    return hosts


def host_pair(plan, world_size, rank, **options):
    """A fork host and an upstream host with identical model, layout and optimizer state."""
    fork = build(plan, world_size, rank, **options)
    shared = dict(options, model=fork.model_chunks[0], buffers=fork.buffers, truth=fork.truth)
    upstream = build(plan, world_size, rank, host_class=UpstreamHost, **shared)
    return fork, upstream


RANKS = [(ws, rank) for ws in WORLD_SIZES for rank in range(ws)]


# --------------------------------------------------------------------------------------------
# The double itself
# --------------------------------------------------------------------------------------------


def test_layout_has_bucket_padding_and_every_rank_owns_a_piece_of_every_bucket():
    for world_size in WORLD_SIZES:
        for host in all_hosts(MULTI_BUCKET, world_size):
            for buf in host.buffers:
                assert all(
                    b.grad_data.numel() - b.numel_unpadded >= END_PADDING for b in buf.buckets
                )
            for range_map in host.gbuf_ranges:
                assert all(bucket["param_map"] for bucket in range_map[DTYPES])


def test_the_fake_gather_matches_upstreams_real_gather():
    """On one rank the double's gather equals upstream's own get_parameter_state_dp_zero."""
    host = build(MULTI_BUCKET, 1, 0)
    real = Upstream.get_parameter_state_dp_zero
    store = torch.distributed.HashStore()
    if torch.distributed.is_initialized():
        pytest.skip("another test module holds the default process group")
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        host.data_parallel_group_gloo = torch.distributed.new_group(backend="gloo")
        gathered = real(host, use_gloo_comm=True)
    finally:
        torch.distributed.destroy_process_group()
    simulated = host.get_parameter_state_dp_zero()
    for buf_index in range(len(host.buffers)):
        for key in TRUTH_KEYS:
            mine, theirs = simulated[buf_index][DTYPES][key], gathered[buf_index][DTYPES][key]
            assert torch.equal(mine, theirs)


# --------------------------------------------------------------------------------------------
# Same output as upstream
# --------------------------------------------------------------------------------------------


def test_class_attribute_matches_upstream():
    assert (
        Mixin.checkpoint_fully_reshardable_formats == Upstream.checkpoint_fully_reshardable_formats
    )
    assert isinstance(Mixin.checkpoint_fully_reshardable_formats, set)


@pytest.mark.parametrize("world_size,rank", RANKS)
@pytest.mark.parametrize("is_loading", [False, True])
@pytest.mark.parametrize("expose_step", [False, True])
def test_dp_reshardable_matches_upstream(world_size, rank, is_loading, expose_step):
    fork, upstream = host_pair(MULTI_BUCKET, world_size, rank, expose_step=expose_step)
    mine = fork.sharded_param_state_dp_reshardable(model_sharded_state_dict(fork), is_loading, {})
    theirs = upstream.sharded_param_state_dp_reshardable(
        model_sharded_state_dict(upstream), is_loading, {}
    )
    # Padding pieces are uninitialised memory: compare their metadata only.
    assert canonical(mine, with_data=False) == canonical(theirs, with_data=False)
    for buf_index in range(len(fork.buffers)):
        for bucket_idx, bucket_pieces in enumerate(mine[buf_index][DTYPES]):
            for piece_idx, piece in enumerate(bucket_pieces):
                if not piece["padding"].obj:
                    their_piece = theirs[buf_index][DTYPES][bucket_idx][piece_idx]
                    assert canonical(piece) == canonical(their_piece)


@pytest.mark.parametrize("world_size,rank", RANKS)
def test_dp_reshardable_pieces_are_the_live_optimizer_tensors(world_size, rank):
    host = build(MULTI_BUCKET, world_size, rank)
    state = host.sharded_param_state_dp_reshardable({}, True, {})
    live = {
        id(t)
        for tensors in map(host.inner_state.read, host.optimizer.state)
        for t in tensors.values()
    }
    for buf_index in range(len(host.buffers)):
        for bucket_pieces in state[buf_index][DTYPES]:
            for piece in bucket_pieces:
                tensors = [v.data for v in piece.values() if isinstance(v, ShardedTensor)]
                if not piece["padding"].obj:
                    assert all(id(t) in live for t in tensors)


def dp_reshardable_pieces(host, state):
    """The non-padding pieces of a dp_reshardable param state, by the model param they are of."""
    pieces = {}
    for buf_index, range_map in enumerate(host.gbuf_ranges):
        for bucket, saved in zip(range_map[DTYPES], state[buf_index][DTYPES]):
            owned = [p for p in saved if not getattr(p["padding"], "obj", p["padding"])]
            for param, piece in zip(bucket["param_map"], owned):
                pieces[param] = {k: piece[k] for k in TRUTH_KEYS}
    return pieces


@pytest.mark.parametrize("world_size,rank", [(1, 0), (3, 2)])
@pytest.mark.parametrize("moment_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dp_reshardable_reads_precision_aware_state_in_place_or_on_the_host(
    world_size, rank, moment_dtype
):
    """The checkpoint holds fp32 moments. bf16 moments are stored by a plain cast, so the read
    casts into the live tensors and the write has nothing left to do; fp16 moments need a
    scale, so they are read into host fp32 tensors and scaled on the host by the write.
    Nothing is staged next to the live state, and the result is what the optimizer's own
    set_scaled_state makes of the saved values."""
    saver = build(MULTI_BUCKET, world_size, rank, seed=1, precision_aware=moment_dtype)
    saved = saver.sharded_param_state_dp_reshardable({}, False, {})
    shared = dict(model=saver.model_chunks[0], buffers=saver.buffers, precision_aware=moment_dtype)
    loader = build(MULTI_BUCKET, world_size, rank, seed=2, **shared)
    expected = build(MULTI_BUCKET, world_size, rank, seed=2, **shared)
    # The reference stores every value through the optimizer's own set_scaled_state.
    del expected.optimizer.dtype_to_range_map
    for param, tensors in dp_reshardable_pieces(expected, saved).items():
        # Scaling divides its input in place (as TE's does), so the saved values are copied.
        expected._set_main_param_and_optimizer_states(
            param, {k: v.data.clone() for k, v in tensors.items()}
        )

    request = loader.sharded_param_state_dp_reshardable({}, True, {})
    live = {t.data_ptr(): t for entry in loader.optimizer.state.values() for t in entry.values()}
    for buf_index in range(len(loader.buffers)):
        for pieces in request[buf_index][DTYPES]:
            for piece in (p for p in pieces if not p["padding"].obj):
                assert piece["param"].data.data_ptr() in live  # the fp32 master
                for key in STATE_KEYS:
                    target = piece[key].data
                    if moment_dtype == torch.bfloat16:
                        assert live.get(target.data_ptr()) is target
                    else:
                        assert target.data_ptr() not in live and target.dtype == torch.float32

    scalings = []
    setter = loader.optimizer.set_scaled_state
    loader.optimizer.set_scaled_state = lambda p, name, v: (
        scalings.append(name),
        setter(p, name, v),
    )
    # The second pass: what the loader does with each piece that came back.
    for param, tensors in dp_reshardable_pieces(loader, simulate_load(saved, request)).items():
        loader._set_main_param_and_optimizer_states(param, tensors)
    # bf16 moments were filled by the read; fp16 ones are scaled on the host, never by a
    # set_scaled_state that would copy each piece to the accelerator in fp32 first.
    assert not any(name in STATE_KEYS for name in scalings)
    for param, shard in ((p, loader.shard_of[p][0]) for p in loader.shard_of):
        reference = expected.optimizer.state[expected.shard_of[param][0]]
        for key, value in loader.optimizer.state[shard].items():
            assert torch.equal(value, reference[key]), key
        if moment_dtype != torch.bfloat16:
            for key, scale in loader.optimizer._scales[shard].items():
                assert torch.equal(
                    scale, expected.optimizer._scales[expected.shard_of[param][0]][key]
                )


@pytest.mark.parametrize("world_size,rank", RANKS)
@pytest.mark.parametrize("expose_step", [False, True])
@pytest.mark.parametrize("instance_id", [0, 1])
def test_fs_model_space_matches_upstream(world_size, rank, expose_step, instance_id):
    fork, upstream = host_pair(
        MULTI_BUCKET, world_size, rank, expose_step=expose_step, instance_id=instance_id
    )
    mine = fork.sharded_param_state_fs_model_space(
        model_sharded_state_dict(fork, all_factories=True), False, {}
    )
    theirs = upstream.sharded_param_state_fs_model_space(
        model_sharded_state_dict(upstream, all_factories=True), False, {}
    )
    assert canonical(mine) == canonical(theirs)
    assert len(mine) == len(owned_ranges(fork))
    assert ("step" in mine[0]) == expose_step


@pytest.mark.parametrize("world_size,rank", RANKS)
@pytest.mark.parametrize("is_loading", [False, True])
def test_fully_reshardable_single_bucket_matches_upstream(world_size, rank, is_loading):
    fork, upstream = host_pair(SINGLE_BUCKET, world_size, rank)
    mine = fork.sharded_param_state_fully_reshardable(
        model_sharded_state_dict(fork), is_loading, {}
    )
    theirs = upstream.sharded_param_state_fully_reshardable(
        model_sharded_state_dict(upstream), is_loading, {}
    )
    if is_loading:
        # The fork asks only for what the rank owns a piece of, with upstream's numbering and
        # metadata but its own replica ids (main where the rank's piece starts the parameter;
        # the targets are checked in test_fully_reshardable_reads_owned_params_...).
        assert set(mine) == owned_reshardable_indices(fork) and set(mine) <= set(theirs)
        params = [p for buf in fork.buffers for p in buf.param_index_map]
        for index, entries in mine.items():
            main = owned_param_range(fork, params[index]).start == 0
            for key, entry in entries.items():
                assert entry.replica_id == (0, 0, 0 if main else 1), (index, key)
                entry.replica_id = theirs[index][key].replica_id
        theirs = {index: theirs[index] for index in mine}
    assert canonical(mine, with_data=not is_loading) == canonical(theirs, with_data=not is_loading)
    # Saving all-gathers; loading gathers nothing (upstream asks for an empty gather).
    assert fork.gathers == ([] if is_loading else [(False, False, True)])


@pytest.mark.parametrize("world_size,rank", RANKS)
@pytest.mark.parametrize("plan", [SINGLE_BUCKET, MULTI_BUCKET], ids=["single", "multi"])
def test_fully_reshardable_saves_the_model_space_truth(world_size, rank, plan):
    host = build(plan, world_size, rank)
    state = host.sharded_param_state_fully_reshardable(model_sharded_state_dict(host), False, {})
    index = 0
    for buf in host.buffers:
        for param in buf.param_index_map:
            entries = state[index]
            assert sorted(entries) == sorted(TRUTH_KEYS)
            for key in TRUTH_KEYS:
                assert torch.equal(entries[key].data, host.truth[key][position(host.params, param)])
            index += 1
    assert len(state) == len(SHAPES)


@pytest.mark.parametrize("world_size,rank", RANKS)
def test_fully_reshardable_multi_bucket_fixes_upstreams_offsets(world_size, rank, caplog):
    """Same metadata as upstream, but upstream reads later buckets' params from the wrong
    place (it ignores the padding stripped at the end of earlier buckets)."""
    fork, upstream = host_pair(MULTI_BUCKET, world_size, rank)
    mine = fork.sharded_param_state_fully_reshardable(model_sharded_state_dict(fork), False, {})
    with caplog.at_level("WARNING"):
        theirs = upstream.sharded_param_state_fully_reshardable(
            model_sharded_state_dict(upstream), False, {}
        )
    assert canonical(mine, with_data=False) == canonical(theirs, with_data=False)
    differing = set()
    for index, entries in mine.items():
        for key, entry in entries.items():
            if not torch.equal(entry.data, theirs[index][key].data):
                differing.add(index)
    # Exactly the parameters of buffer 0's second bucket are wrong upstream.
    first_buffer = list(fork.buffers[0].param_index_map.values())
    assert differing == {i for i, (_, _, bucket) in enumerate(first_buffer) if bucket > 0}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_fully_reshardable_mem_efficient_saves_on_rank_zero_only(world_size):
    for host in all_hosts(MULTI_BUCKET, world_size):
        metadata = {"distrib_optim_fully_reshardable_mem_efficient": True}
        state = host.sharded_param_state_fully_reshardable(
            model_sharded_state_dict(host), False, metadata
        )
        assert host.gathers == [(True, False, False)]
        assert (state is None) == (host.data_parallel_group.rank() != 0)
        loading = host.sharded_param_state_fully_reshardable(
            model_sharded_state_dict(host), True, metadata
        )
        assert set(loading) == owned_reshardable_indices(host)


@pytest.mark.parametrize("world_size,rank", RANKS)
@pytest.mark.parametrize("is_loading", [False, True])
@pytest.mark.parametrize("instance_id", [0, 1])
def test_dp_zero_matches_upstream(world_size, rank, is_loading, instance_id):
    fork, upstream = host_pair(MULTI_BUCKET, world_size, rank, instance_id=instance_id)
    mine = fork.sharded_param_state_dp_zero({}, is_loading, {})
    theirs = upstream.sharded_param_state_dp_zero({}, is_loading, {})
    assert canonical(mine) == canonical(theirs)
    assert isinstance(mine, ShardedObject) == (rank == 0 and instance_id == 0)
    expected_gathers = [] if is_loading or instance_id else [(False, False, False)]
    assert fork.gathers == expected_gathers


SAVABLE = list(optimizer_table.sharded_formats(round_trips=True))
UNSAVABLE = list(optimizer_table.sharded_formats(round_trips=False))


@pytest.mark.parametrize("world_size,rank", [(1, 0), (3, 0), (3, 2)])
@pytest.mark.parametrize("sharding_type", SAVABLE + UNSAVABLE + [None])
def test_sharded_state_dict_matches_upstream(world_size, rank, sharding_type):
    plan = SINGLE_BUCKET  # upstream's fully_reshardable is only right with one bucket
    fork, upstream = host_pair(plan, world_size, rank)
    metadata = {} if sharding_type is None else {"distrib_optim_sharding_type": sharding_type}
    factories = sharding_type in ("fully_sharded_model_space", None)
    mine = fork.sharded_state_dict(
        model_sharded_state_dict(fork, all_factories=factories), metadata=metadata
    )
    theirs = upstream.sharded_state_dict(
        model_sharded_state_dict(upstream, all_factories=factories), metadata=metadata
    )
    assert canonical(mine, with_data=False) == canonical(theirs, with_data=False)
    assert mine["param_state_sharding_type"] == (sharding_type or "fully_sharded_model_space")
    common = {k: v for k, v in mine.items() if not k.startswith("param_state")}
    assert sorted(common) == ["grad_scaler", "optimizer"]
    wrapped = sharding_type in ("dp_reshardable", "dp_zero_gather_scatter")
    assert all(isinstance(v, ShardedObject) for v in common.values()) == wrapped


def test_deprecated_sharding_type_argument_wins_over_metadata(caplog):
    fork, upstream = host_pair(SINGLE_BUCKET, 2, 1)
    metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
    with caplog.at_level("WARNING"):
        mine = fork.sharded_state_dict(
            model_sharded_state_dict(fork), sharding_type="fully_reshardable", metadata=metadata
        )
    assert "deprecated" in caplog.text
    theirs = upstream.sharded_state_dict(
        model_sharded_state_dict(upstream), sharding_type="fully_reshardable", metadata=metadata
    )
    assert mine["param_state_sharding_type"] == "fully_reshardable"
    assert canonical(mine) == canonical(theirs)


@pytest.mark.parametrize("sharding_type", SAVABLE + UNSAVABLE)
def test_loading_materialises_state_without_moving_anything(sharding_type):
    host = build(SINGLE_BUCKET, 2, 1, materialise=False)
    assert not host.optimizer.state
    masters = [p.detach().clone() for p in host.inner_state.params()]
    request = host.sharded_state_dict(
        model_sharded_state_dict(host, all_factories=True),
        is_loading=True,
        metadata={"distrib_optim_sharding_type": sharding_type},
    )
    assert host.inner_state.is_materialised()
    assert host.inner_state.step() == 0
    assert all(torch.equal(a, b) for a, b in zip(masters, host.inner_state.params()))
    assert request["param_state_sharding_type"] == sharding_type
    assert host.loaded_common == []


def test_a_load_request_is_answered_after_a_failed_load():
    """A run recovers by loading again: the load request is built while an earlier failed
    load's mark is set, and notes that its reader will write into the live state."""
    host = build(SINGLE_BUCKET, 2, 1, materialise=False)
    host._load_guard.failure = "load_state_dict failed while writing the state (injected)"
    host._load_request_outstanding = False
    host.sharded_state_dict(
        model_sharded_state_dict(host, all_factories=True),
        is_loading=True,
        metadata={"distrib_optim_sharding_type": "dp_reshardable"},
    )
    assert host._load_request_outstanding
    with pytest.raises(RuntimeError, match="injected"):
        host.sharded_state_dict(model_sharded_state_dict(host), is_loading=False)


# --------------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("plan", [SINGLE_BUCKET, MULTI_BUCKET], ids=["single", "multi"])
@pytest.mark.parametrize("save_size,load_size", [(1, 1), (2, 3), (4, 1), (3, 4)])
def test_fully_reshardable_round_trip_across_data_parallel_sizes(plan, save_size, load_size):
    saver = build(plan, save_size, save_size - 1, seed=1)
    saved = saver.sharded_param_state_fully_reshardable(model_sharded_state_dict(saver), False, {})
    for rank in range(load_size):
        loader = build(plan, load_size, rank, seed=2, model=saver.model_chunks[0])
        loader.inner_state.set_step(2)  # the saver's is 7
        before = loader.live_state()
        request = loader.sharded_param_state_fully_reshardable(
            model_sharded_state_dict(loader), True, {}
        )
        loaded = simulate_load(saved, request)
        loader.load_parameter_state_from_fully_reshardable(loaded)
        assert_live_state_is(loader, saver.truth)
        assert any(
            not torch.equal(before[p]["exp_avg"], t["exp_avg"])
            for p, t in loader.live_state().items()
        )
        # Steps come back through the param groups (load_state_dict); the parameter state
        # leaves the counter alone.
        assert loader.inner_state.step() == 2


@pytest.mark.parametrize("world_size,rank", [(1, 0), (2, 1), (3, 2)])
@pytest.mark.parametrize(
    "moment_dtype", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_fully_reshardable_reads_owned_params_in_place_or_on_the_host(
    world_size, rank, moment_dtype
):
    """The request names only the parameters the rank owns a piece of. One it owns whole, under
    a plain model entry, is read into the live state wherever a plain cast stores the
    checkpoint's fp32 value (fp32 master and moments, bf16 moments) and into the host tensors
    the write scales from for fp16 moments; a piece, or a factory's entry, is read whole into
    a zero-filled host fp32 tensor. Loading that gives what the optimizer's own
    set_scaled_state (or a plain copy) makes of the saved values, bit for bit."""
    options = {} if moment_dtype is None else {"precision_aware": moment_dtype}
    saver = build(MULTI_BUCKET, world_size, rank, seed=1, **options)
    saved = saver.sharded_param_state_fully_reshardable(model_sharded_state_dict(saver), False, {})
    shared = dict(model=saver.model_chunks[0], buffers=saver.buffers, **options)
    loader = build(MULTI_BUCKET, world_size, rank, seed=2, **shared)
    expected = build(MULTI_BUCKET, world_size, rank, seed=2, **shared)
    if moment_dtype is not None:
        del expected.optimizer.dtype_to_range_map  # every value through set_scaled_state
    owned = owned_ranges(loader)
    for param, ranges in owned.items():
        piece = ranges["param"]
        truth = {
            key: saver.truth[key][position(saver.params, param)].reshape(-1)[
                piece.start : piece.end
            ]
            for key in TRUTH_KEYS
        }
        expected._set_main_param_and_optimizer_states(
            param, {k: v.clone() for k, v in truth.items()}
        )

    request = loader.sharded_param_state_fully_reshardable(
        model_sharded_state_dict(loader), True, {}
    )
    assert set(request) == owned_reshardable_indices(loader)
    live = {shard.data_ptr() for shard, _, _ in loader.shard_of.values()}
    live.update(t.data_ptr() for entry in loader.optimizer.state.values() for t in entry.values())
    index = -1
    for buf in loader.buffers:
        for param in buf.param_index_map:
            index += 1
            if param not in owned:
                continue
            whole = owned[param]["param"].size == param.numel()
            plain = position(loader.params, param) != 3  # model_sharded_state_dict's factory
            for key in TRUTH_KEYS:
                target = request[index][key].data
                assert target.shape == param.shape
                if not (whole and plain):
                    assert target.data_ptr() not in live and not torch.any(target), (index, key)
                elif moment_dtype == torch.float16 and key in STATE_KEYS:
                    assert target.data_ptr() not in live, (index, key)  # scaled by the write
                else:
                    assert target.data_ptr() in live, (index, key)
                    continue
                assert target.dtype == torch.float32 and not target.is_cuda

    loader.load_parameter_state_from_fully_reshardable(simulate_load(saved, request))
    for param in owned:
        shard, reference = loader.shard_of[param][0], expected.shard_of[param][0]
        for key, value in loader.optimizer.state[shard].items():
            assert torch.equal(value, expected.optimizer.state[reference][key]), key
        assert torch.equal(shard, reference)
        for key, scale in getattr(loader.optimizer, "_scales", {}).get(shard, {}).items():
            assert torch.equal(scale, expected.optimizer._scales[reference][key]), key


def load_requests_by_key(hosts, method, **model_options):
    """``(rank, entry)`` pairs of every host's load request, by checkpoint key; a host's
    place in ``hosts`` is its rank."""
    by_key = {}
    for rank, host in enumerate(hosts):
        model = model_sharded_state_dict(host, rank=rank, **model_options)
        request = getattr(host, method)(model, True, {})
        for entry in sharded_entries(request):
            by_key.setdefault(entry.key, []).append((rank, entry))
    return by_key


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("plan", [SINGLE_BUCKET, MULTI_BUCKET], ids=["single", "multi"])
@pytest.mark.parametrize("instances", [1, 2])
@pytest.mark.parametrize("host_class", [ForkHost, UpstreamHost], ids=["fork", "upstream"])
def test_fully_reshardable_load_requests_pass_the_access_check(
    world_size, plan, instances, host_class
):
    """Dist-checkpointing's load checks that the main replicas of all ranks' requests cover
    every tensor exactly once (``validate_access_integrity``, on by default). Upstream's
    ranks all ask for everything; the fork's ask only for what they own, and with several
    data-parallel ranks (and optimizer instances) every parameter still has exactly one main
    replica."""
    hosts = []
    for instance_id in range(instances):
        hosts += all_hosts(plan, world_size, host_class=host_class, instance_id=instance_id)
    by_key = load_requests_by_key(
        hosts, "sharded_param_state_fully_reshardable", factory_index=None, tp_index=None
    )
    assert len(by_key) == len(SHAPES) * len(TRUTH_KEYS)
    for key, rank_sharding in by_key.items():
        assert not _validate_sharding_for_key(rank_sharding), key


def test_fully_reshardable_load_reads_int16_remainders_on_the_host():
    """Remainders arrive as fp32 and are checked before they are converted: the read goes into
    a host fp32 tensor, never into the live int16 tensor."""
    host = build(SINGLE_BUCKET, 1, 0)
    live = host._main_param_and_optimizer_load_targets

    def with_remainders(model_param):
        targets = live(model_param)
        targets["param"] = torch.zeros(targets["param"].shape, dtype=torch.int16)
        return targets

    host._main_param_and_optimizer_load_targets = with_remainders
    request = host.sharded_param_state_fully_reshardable(model_sharded_state_dict(host), True, {})
    states = {t.data_ptr() for entry in host.optimizer.state.values() for t in entry.values()}
    for entries in request.values():
        assert entries["param"].data.dtype == torch.float32
        for key in STATE_KEYS:
            assert entries[key].data.dtype == torch.float32
    plain = [e for i, e in request.items() if i != 3]  # index 3 is the model's factory entry
    assert all(e[k].data.data_ptr() in states for e in plain for k in STATE_KEYS)


@pytest.mark.parametrize("world_size,rank", RANKS)
def test_fully_reshardable_load_agrees_with_upstreams_loader(world_size, rank):
    saver = build(SINGLE_BUCKET, world_size, rank, seed=1)
    saved = saver.sharded_param_state_fully_reshardable(model_sharded_state_dict(saver), False, {})
    fork, upstream = host_pair(SINGLE_BUCKET, world_size, rank, seed=2, model=saver.model_chunks[0])
    for host in (fork, upstream):
        request = host.sharded_param_state_fully_reshardable(
            model_sharded_state_dict(host), True, {}
        )
        host.load_parameter_state_from_fully_reshardable(simulate_load(saved, request))
        assert_live_state_is(host, saver.truth)


@pytest.mark.parametrize("world_size,rank", RANKS)
@pytest.mark.parametrize("expose_step", [False, True])
def test_fs_model_space_round_trip_loads_in_place(world_size, rank, expose_step):
    saver = build(MULTI_BUCKET, world_size, rank, seed=1, expose_step=expose_step)
    saved = saver.sharded_param_state_fs_model_space(
        model_sharded_state_dict(saver, all_factories=True), False, {}
    )
    loader = build(
        MULTI_BUCKET, world_size, rank, seed=2, model=saver.model_chunks[0], expose_step=expose_step
    )
    loader.inner_state.set_step(2)  # the saver's is 7, and saved with its state if exposed
    request = loader.sharded_param_state_fs_model_space(
        model_sharded_state_dict(loader, all_factories=True), True, {}
    )
    live_ids = {
        id(t)
        for tensors in map(loader.inner_state.read, loader.optimizer.state)
        for t in tensors.values()
    }
    assert all(id(entry.data) in live_ids for entry in sharded_entries(request))
    loaded = simulate_load(saved, request)
    loader.load_parameter_state_from_fs_model_space(loaded)
    assert_live_state_is(loader, saver.truth)
    assert loader.inner_state.step() == 2  # restored through the param groups, not from here


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


def loaded_fully_reshardable(host):
    """A loaded fully_reshardable param state for ``host`` (from another host's save), every
    parameter's entry as upstream's request reads it (copies, not live)."""
    saver = build(SINGLE_BUCKET, 1, 0, seed=1, model=host.model_chunks[0])
    saved = saver.sharded_param_state_fully_reshardable(model_sharded_state_dict(saver), False, {})
    return {i: {k: v.data.clone() for k, v in e.items()} for i, e in saved.items()}


def loaded_fs_model_space(host):
    """A loaded fully_sharded_model_space param state for ``host`` (copies, not live)."""
    state = host.sharded_param_state_fs_model_space(
        model_sharded_state_dict(host, all_factories=True), False, {}
    )
    return {
        i: {k: (v.data.clone() if hasattr(v, "data") else v) for k, v in e.items()}
        for i, e in state.items()
    }


def corruptions(entry_key):
    """Ways to spoil one loaded entry, with the message each must produce."""
    return [
        (lambda s: s.pop(len(s) - 1), "missing or not a dict"),
        (lambda s: s[len(s) - 1].pop(entry_key), "lacks"),
        (lambda s: s[len(s) - 1].pop("exp_avg_sq"), "lacks"),
        (lambda s: s[len(s) - 1].update(exp_avg=torch.zeros(3)), "elements, expected"),
        (lambda s: s[len(s) - 1].update(exp_avg=[1.0]), "not a tensor"),
    ]


@pytest.mark.parametrize("case", range(5))
@pytest.mark.parametrize("sharding_type", ["fully_reshardable", "fully_sharded_model_space"])
def test_bad_param_state_fails_before_anything_is_written(case, sharding_type):
    host = build(SINGLE_BUCKET, 2, 1, seed=2)
    if sharding_type == "fully_reshardable":
        loaded, entry_key, load = (
            loaded_fully_reshardable(host),
            "param",
            host.load_parameter_state_from_fully_reshardable,
        )
    else:
        loaded, entry_key, load = (
            loaded_fs_model_space(host),
            "fp32_param",
            host.load_parameter_state_from_fs_model_space,
        )
    # Entries a loader visits first are good, so a partial write would be visible.
    spoil, message = corruptions(entry_key)[case]
    last_owned = max(
        i
        for i in loaded
        if sharding_type != "fully_reshardable" or i in owned_reshardable_indices(host)
    )
    loaded[len(loaded) - 1], loaded[last_owned] = loaded[last_owned], loaded[len(loaded) - 1]
    for key in list(loaded[0]):
        if isinstance(loaded[0][key], torch.Tensor) and key != "step":
            loaded[0][key] = loaded[0][key] + 1.0
    spoil(loaded)
    before = host.live_state()
    document = {"param_state": loaded, "param_state_sharding_type": sharding_type}
    with pytest.raises(ValueError, match=message):
        host._check_param_state_for_load(document)
    with pytest.raises(ValueError, match=message):
        load(loaded)
    for param, tensors in host.live_state().items():
        assert all(torch.equal(tensors[k], before[param][k]) for k in TRUTH_KEYS)


def owned_ranges(host):
    """Each model parameter ``host`` owns a piece of -> that piece's ranges, read from its
    public ``gbuf_ranges``, buffer by buffer, bucket by bucket."""
    return {
        param: param_ranges
        for buffer_ranges in host.gbuf_ranges
        for bucket_ranges in buffer_ranges.values()
        for bucket in bucket_ranges
        for param, param_ranges in bucket["param_map"].items()
    }


def owned_reshardable_indices(host):
    """fully_reshardable indices of the parameters ``host`` owns."""
    owned = set()
    index = 0
    for buf_index, buf in enumerate(host.buffers):
        params = {p for b in host.gbuf_ranges[buf_index][DTYPES] for p in b["param_map"]}
        for param in buf.param_index_map:
            if param in params:
                owned.add(index)
            index += 1
    return owned


def test_check_param_state_for_load_names_the_problem():
    host = build(SINGLE_BUCKET, 1, 0)
    with pytest.raises(ValueError, match="'param_state' but no 'param_state_sharding_type'"):
        host._check_param_state_for_load({"param_state": {}})
    with pytest.raises(ValueError, match="'param_state_sharding_type' but no 'param_state'"):
        host._check_param_state_for_load({"param_state_sharding_type": "dp_reshardable"})
    with pytest.raises(NotImplementedError, match="Unknown sharding_type: nope"):
        host._check_param_state_for_load({"param_state": {}, "param_state_sharding_type": "nope"})
    with pytest.raises(ValueError, match="expected a dict"):
        host._check_param_state_for_load(
            {"param_state": None, "param_state_sharding_type": "fully_sharded_model_space"}
        )
    # Nothing to check without param state; the formats another mixin loads go to its planner.
    assert host._plan_param_state_load({"optimizer": {}}) is None
    host._plan_dp_reshardable_param_state = lambda state: ("planned", state)
    planned = host._plan_param_state_load(
        {"param_state": 1, "param_state_sharding_type": "dp_reshardable"}
    )
    assert planned == ("planned", 1)


@pytest.mark.parametrize("sharding_type", ["fully_sharded_bucket_space", "nope"])
@pytest.mark.parametrize("is_loading", [False, True])
def test_unknown_sharding_type_fails_before_touching_the_optimizer(sharding_type, is_loading):
    host = build(SINGLE_BUCKET, 1, 0, materialise=False)
    host.state_dict = None  # calling it would fail differently
    with pytest.raises(NotImplementedError, match=f"Unknown sharding_type: {sharding_type}"):
        host.sharded_state_dict(
            {}, is_loading, metadata={"distrib_optim_sharding_type": sharding_type}
        )
    assert not host.optimizer.state


def test_megatron_fsdp_accepts_only_fsdp_dtensor():
    host = build(SINGLE_BUCKET, 1, 0, fsdp=True)
    with pytest.raises(NotImplementedError, match="not supported with Megatron FSDP"):
        host.sharded_state_dict({}, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    plain = build(SINGLE_BUCKET, 1, 0)
    with pytest.raises(AssertionError, match="only supported with Megatron FSDP"):
        plain.sharded_state_dict({}, metadata={"distrib_optim_sharding_type": "fsdp_dtensor"})


@pytest.mark.parametrize(
    "method", ["sharded_param_state_fs_model_space", "sharded_param_state_fully_reshardable"]
)
def test_model_param_missing_from_model_state_dict(method):
    host = build(SINGLE_BUCKET, 1, 0)
    partial = model_sharded_state_dict(host, all_factories=True)
    partial["model"].pop("decoder.w2")
    with pytest.raises(ValueError, match="not in model_sharded_state_dict"):
        getattr(host, method)(partial, False, {})


def test_fully_reshardable_refuses_flattened_model_tensors():
    host = build(SINGLE_BUCKET, 1, 0)
    model = model_sharded_state_dict(host)
    entry = model["model"]["decoder.w1"]
    model["model"]["decoder.w1"] = ShardedTensorFactory(
        entry.key, entry.data, build_nothing, merge_nothing, flattened_range=slice(0, 5)
    )
    with pytest.raises(AssertionError, match="Flattened model tensor not supported"):
        host.sharded_param_state_fully_reshardable(model, False, {})


def test_fs_model_space_requires_three_part_replica_ids():
    host = build(SINGLE_BUCKET, 1, 0)
    model = model_sharded_state_dict(host, all_factories=True)
    model["model"]["decoder.w1"].replica_id = (0, 1)
    with pytest.raises(AssertionError, match="Expected replica_id format"):
        host.sharded_param_state_fs_model_space(model, False, {})


def test_fs_model_space_with_sharded_tensors_fails_as_upstream_does():
    """megatron-core 0.19.2 refuses ShardedTensors with a flattened_range; so do both."""
    fork, upstream = host_pair(SINGLE_BUCKET, 2, 0)
    for host in (fork, upstream):
        with pytest.raises(CheckpointingException, match="flattened_range is not supported"):
            host.sharded_param_state_fs_model_space(model_sharded_state_dict(host), False, {})


# --------------------------------------------------------------------------------------------
# Names, param groups and Megatron-FSDP
# --------------------------------------------------------------------------------------------


def test_param_name_and_group_meta_match_upstream():
    fork, upstream = host_pair(SINGLE_BUCKET, 1, 0)
    model_groups = [
        {"params": fork.params[:3], "lr": 0.5, "wd_mult": 1.0},
        {"params": fork.params[3:], "lr": 0.25, "wd_mult": 0.0},
    ]
    mine = fork._param_groups_to_param2group_meta(model_groups)
    theirs = upstream._param_groups_to_param2group_meta(model_groups)
    assert mine == theirs
    assert mine["w0"] == {"lr": 0.5, "wd_mult": 1.0} and mine["w6"]["lr"] == 0.25
    assert [fork._param_name(p) for p in fork.params] == [f"w{i}" for i in range(len(SHAPES))]
    regrouped = [{"params": fork.params[3:]}, {"params": fork.params[:3]}]
    assert fork._param2group_meta_to_param_groups(mine, regrouped) == (
        upstream._param2group_meta_to_param_groups(theirs, regrouped)
    )
    assert fork._param2group_meta_to_param_groups(mine, regrouped)[1] == {
        "params": ["w0", "w1", "w2"],
        "lr": 0.5,
        "wd_mult": 1.0,
    }


def test_param2group_meta_strictness_matches_upstream(caplog):
    fork, upstream = host_pair(SINGLE_BUCKET, 1, 0)
    meta = {"w0": {"lr": 1.0}, "w1": {"lr": 2.0}, "w2": {"lr": 1.0}}
    mixed = [{"params": fork.params[:3]}]
    missing = [{"params": [fork.params[0], fork.params[3], fork.params[2]]}]
    for host in (fork, upstream):
        with pytest.raises(ValueError, match="w1"):
            host._param2group_meta_to_param_groups(meta, mixed)
        with pytest.raises(ValueError, match="w3 not found"):
            host._param2group_meta_to_param_groups(meta, missing)
    with caplog.at_level("WARNING"):
        lenient = fork._param2group_meta_to_param_groups(meta, mixed + missing, strict=False)
    assert lenient == upstream._param2group_meta_to_param_groups(
        meta, mixed + missing, strict=False
    )
    assert lenient == [{"params": ["w0", "w2"], "lr": 1.0}, {"params": ["w0", "w2"], "lr": 1.0}]


def test_param_name_rejects_clashing_chunks_and_unknown_params():
    host = build(SINGLE_BUCKET, 1, 0)
    host.model_chunks = [host.model_chunks[0], Model([(2,)])]
    with pytest.raises(ValueError, match="conflict between model chunks"):
        host._param_name(host.params[0])
    other = build(SINGLE_BUCKET, 1, 0)
    with pytest.raises(AssertionError, match="not found in param_to_name"):
        other._param_name(torch.nn.Parameter(torch.zeros(1)))


class NamedShardHost(ForkHost):
    """Megatron-FSDP double: the optimizer's params are the model params themselves."""

    def load_state_dict_for_test(self, state_dict):
        """The Megatron-FSDP branch of ``DistributedOptimizer.load_state_dict``."""
        self._load_state_dict_megatron_fsdp(state_dict)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.optimizer = torch.optim.AdamW(
            [{"params": self.params[:4], "lr": 0.1}, {"params": self.params[4:], "lr": 0.2}]
        )
        self.inner_state = inner.InnerOptimizerState(self.optimizer, STATE_KEYS)


def test_fsdp_dtensor_state():
    host = build(SINGLE_BUCKET, 1, 0, fsdp=True, host_class=NamedShardHost)
    for param in host.params:
        param.data.normal_()
    before = [p.detach().clone() for p in host.params]
    metadata = {"distrib_optim_sharding_type": "fsdp_dtensor"}
    request = host.sharded_state_dict({}, is_loading=True, metadata=metadata)
    assert all(torch.equal(a, b) for a, b in zip(before, host.params))
    assert host.inner_state.step() == 0
    assert sorted(request["state"]) == [f"w{i}" for i in range(len(SHAPES))]
    assert request["state"]["w0"] is host.optimizer.state[host.params[0]]
    assert request["param_to_group_meta"]["w5"]["lr"] == 0.2
    theirs = Upstream.sharded_param_state_fsdp_dtensor(host, is_loading=False)
    assert canonical(host.sharded_param_state_fsdp_dtensor(False)) == canonical(theirs)


def _trained_fsdp_host(seed):
    host = build(SINGLE_BUCKET, 1, 0, seed=seed, fsdp=True, host_class=NamedShardHost)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(2):
        for param in host.params:
            param.grad = torch.randn(param.shape, generator=generator)
        host.optimizer.step()
    return host


def _fsdp_snapshot(host):
    return (
        [p.detach().clone() for p in host.params],
        {
            position(host.params, p): {k: v.clone() for k, v in e.items()}
            for p, e in host.optimizer.state.items()
        },
        [{k: v for k, v in g.items() if k != "params"} for g in host.optimizer.param_groups],
    )


FSDP_BAD_INPUTS = {
    "transposed moment": (lambda sd: sd["state"][0].update(exp_avg=sd["state"][0]["exp_avg"].T)),
    "nan moment": (lambda sd: sd["state"][1]["exp_avg_sq"].fill_(math.nan)),
    "missing moment": (lambda sd: sd["state"][2].pop("exp_avg_sq")),
    "negative step": (lambda sd: sd["state"][0].update(step=torch.tensor(-1.0))),
    "one group less": (lambda sd: sd["param_groups"].pop()),
}


@pytest.mark.parametrize("bad", sorted(FSDP_BAD_INPUTS))
def test_a_megatron_fsdp_load_checks_everything_before_the_optimizer_loads(bad):
    """Megatron-FSDP hands the state dict to the wrapped optimizer, whose own load would take
    a transposed or NaN moment, a missing one or a negative step and fail (or train on it)
    later: the plan refuses them first, the learning rate saved with them included."""
    source = _trained_fsdp_host(seed=1)
    state_dict = copy.deepcopy(source.optimizer.state_dict())
    for group in state_dict["param_groups"]:
        group["lr"] = 0.5
    FSDP_BAD_INPUTS[bad](state_dict)
    host = _trained_fsdp_host(seed=2)
    before = _fsdp_snapshot(host)
    with pytest.raises((KeyError, ValueError)):
        host.load_state_dict_for_test(state_dict)
    after = _fsdp_snapshot(host)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert before[1].keys() == after[1].keys()
    for index, entry in before[1].items():
        assert all(torch.equal(v, after[1][index][k]) for k, v in entry.items())
    assert before[2] == after[2]


def test_a_megatron_fsdp_load_of_a_good_state_dict_resumes():
    source = _trained_fsdp_host(seed=1)
    host = _trained_fsdp_host(seed=2)
    with torch.no_grad():
        for param, saved in zip(host.params, source.params):
            param.copy_(saved)
    host.load_state_dict_for_test(copy.deepcopy(source.optimizer.state_dict()))
    for param in source.params:
        twin = host.params[position(source.params, param)]
        for key, value in source.optimizer.state[param].items():
            assert torch.equal(host.optimizer.state[twin][key], value)


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fs_model_space_round_trip_keeps_state_on_the_gpu():
    saver = build(MULTI_BUCKET, 2, 1, seed=1)
    saved = saver.sharded_param_state_fs_model_space(
        model_sharded_state_dict(saver, all_factories=True), False, {}
    )
    loader = build(MULTI_BUCKET, 2, 1, seed=2, model=saver.model_chunks[0])
    for group in loader.optimizer.param_groups:
        for shard in group["params"]:
            shard.data = shard.data.cuda()
            for key, value in loader.optimizer.state[shard].items():
                loader.optimizer.state[shard][key] = value.cuda()
    request = loader.sharded_param_state_fs_model_space(
        model_sharded_state_dict(loader, all_factories=True), True, {}
    )
    assert all(entry.data.is_cuda for entry in sharded_entries(request))
    loader.load_parameter_state_from_fs_model_space(simulate_load(saved, request))
    for param, tensors in loader.live_state().items():
        piece = owned_param_range(loader, param)
        index = position(loader.params, param)
        for key in TRUTH_KEYS:
            assert tensors[key].is_cuda
            expected = saver.truth[key][index].reshape(-1)[piece.start : piece.end]
            assert torch.equal(tensors[key].cpu(), expected)


def test_layout_is_not_trivial():
    """The multi-bucket layout really shifts params of the second bucket."""
    for world_size in WORLD_SIZES:
        host = build(MULTI_BUCKET, world_size, 0)
        first = host.buffers[0]
        padding = first.buckets[0].grad_data.numel() - first.buckets[0].numel_unpadded
        assert padding >= END_PADDING
        assert math.prod(SHAPES[0]) + SHAPES[1][0] + GAP == first.buckets[0].numel_unpadded
        assert len(list(itertools.chain.from_iterable(b.buckets for b in host.buffers))) == 3
