# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The distributed optimizer's whole-world parameter-state files (CPU, gloo).

``DistributedOptimizerParameterStateMixin`` is exercised on :class:`FakeCore`, a test double
holding exactly what the mixin reads from ``DistributedOptimizer``: buffers cut into
buckets, their range maps (built by ``distrib_optimizer_ranges``), a torch AdamW over the
owned fp32 shards and the ``_get/_set_main_param_and_optimizer_states`` pair, which goes
through ``InnerOptimizerState`` as the fork's core does.

The same double is handed to megatron-core 0.19.2's unbound methods to show that files pass
both ways. Tests of fixed upstream bugs also run against upstream, marked ``xfail(strict)``
so they prove the test detects the bug:

* loading into torch AdamW (``KeyError: 'step'`` upstream);
* refusing another model's file with a ValueError and leaving the optimizer untouched
  (upstream asserts, and only after it has started writing in some cases).

Two data-parallel ranks run in spawned gloo processes; nothing here needs CUDA.
"""

import copy
import multiprocessing
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    import optimizer_table
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests import optimizer_table

upstream_modules = optimizer_table.sibling("upstream_modules")

# The modules exist only in the fork; with the overlay off there is nothing to test.
param_state = pytest.importorskip(
    "megatron.core.optimizer.distrib_optimizer_param_state",
    reason="the fork's module is not importable (overlay off?)",
)
ranges = pytest.importorskip("megatron.core.optimizer.distrib_optimizer_ranges")
InnerOptimizerState = pytest.importorskip(
    "megatron.core.optimizer.inner_optimizer_state"
).InnerOptimizerState
Mixin = param_state.DistributedOptimizerParameterStateMixin
LoadGuard = pytest.importorskip("megatron.core.optimizer.state_load_checks").LoadGuard

BF16, FP32 = torch.bfloat16, torch.float32
KEYS = ("param", "exp_avg", "exp_avg_sq")

# Buffers of buckets of parameters: (numel, gap before the parameter[, global index]).
# Gaps stand for the alignment padding inside a bucket; a bucket's end is padded to a
# multiple of 4 * data-parallel size.
LAYOUT = [
    {"dtypes": (BF16, FP32), "buckets": [[(6, 0), (5, 3), (4, 0)], [(7, 2), (3, 0)]]},
    {"dtypes": (FP32, FP32), "buckets": [[(9, 0), (2, 1)]]},
]
# The same parameters with one element more: a file of "another model".
OTHER_LAYOUT = [
    {"dtypes": (BF16, FP32), "buckets": [[(6, 0), (5, 3), (4, 0)], [(7, 2), (4, 0)]]},
    {"dtypes": (FP32, FP32), "buckets": [[(9, 0), (2, 1)]]},
]


# ------------------------------------------------------------------------ upstream module

UPSTREAM = upstream_modules.load()
needs_upstream = pytest.mark.skipif(UPSTREAM is None, reason="upstream's module is not available")


@pytest.fixture(autouse=True)
def upstream_as_with_torch_adam(monkeypatch):
    """The inner optimizer here is torch AdamW: upstream runs as where it would build one."""
    upstream_modules.as_with_torch_adam(UPSTREAM, monkeypatch)


def upstream_method(name):
    """Upstream's method ``name`` as stored in the class (descriptors kept)."""
    return UPSTREAM.DistributedOptimizer.__dict__[name]


# ------------------------------------------------------------------------ the test double


class FakeCore:
    """Test double for the part of ``DistributedOptimizer`` the param-state methods use.

    Args:
        layout: buffers as in :data:`LAYOUT`; a buffer with ``"fp8": True`` holds
            parameters flagged ``fake_fp8`` (bf16 tensors) under ``(torch.uint8, grad)``.
        group: the data-parallel process group (gloo).
        dp_rank, dp_size: the shard this object owns; default to the group's.
    """

    def __init__(self, layout, group, dp_rank=None, dp_size=None):
        self.data_parallel_group = group
        self.data_parallel_group_gloo = group
        rank = group.rank() if dp_rank is None else dp_rank
        size = group.size() if dp_size is None else dp_size
        self.is_stub_optimizer = False
        self.config = SimpleNamespace(
            optimizer="adam", use_precision_aware_optimizer_no_fp8_or_ds_fp8=False
        )
        self.model_params = []
        self.buffers = [self._make_buffer(spec, size) for spec in layout]
        self.gbuf_ranges = [ranges.build_buffer_range_map(b, rank, size) for b in self.buffers]
        self.per_bucket_numel = [
            {b.dtypes: [bucket.grad_data.numel() for bucket in b.buckets]} for b in self.buffers
        ]
        self.per_bucket_numel_unpadded = [
            {b.dtypes: [bucket.numel_unpadded for bucket in b.buckets]} for b in self.buffers
        ]
        self.model_param_group_index_map, self.main_of, self.param_range_of = {}, {}, {}
        groups = [{"params": []}, {"params": [], "weight_decay": 0.05}]
        for by_dtype in self.gbuf_ranges:
            for bucket_maps in by_dtype.values():
                for bucket_map in bucket_maps:
                    for model_param, piece in bucket_map["param_map"].items():
                        # A plain fp32 tensor, as the core's main-param shards are.
                        main = torch.zeros(len(piece["param"]))
                        group_index = len(self.main_of) % 2
                        order = len(groups[group_index]["params"])
                        groups[group_index]["params"].append(main)
                        self.model_param_group_index_map[model_param] = (group_index, order)
                        self.main_of[model_param] = main
                        self.param_range_of[model_param] = piece["param"]
        self.optimizer = torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1)
        self.inner_state = InnerOptimizerState(self.optimizer, ("exp_avg", "exp_avg_sq"))
        self._load_guard = LoadGuard(type(self).__name__)

    def _make_buffer(self, spec, dp_size):
        fp8 = spec.get("fp8", False)
        buffer = SimpleNamespace(
            dtypes=(torch.uint8 if fp8 else spec["dtypes"][0], spec["dtypes"][1]),
            grad_dtype=spec["dtypes"][1],
            buckets=[],
            param_index_map={},
            numel_unpadded=0,
        )
        buffer.param_dtype = buffer.dtypes[0]
        indexed, offset = [], 0
        for bucket_id, bucket in enumerate(spec["buckets"]):
            position = 0
            for numel, gap, *index in bucket:
                param = torch.nn.Parameter(torch.zeros(numel, dtype=spec["dtypes"][0]))
                param.fake_fp8 = fp8
                start = offset + position + gap
                buffer.param_index_map[param] = (start, start + numel, bucket_id)
                position += gap + numel
                indexed.append((index[0] if index else len(self.model_params), param))
                self.model_params.append(param)
            unit = 4 * dp_size
            padded = -(-position // unit) * unit
            buffer.buckets.append(
                SimpleNamespace(
                    offset=offset, grad_data=torch.empty(padded), numel_unpadded=position
                )
            )
            buffer.numel_unpadded += position
            offset += padded
        indexed.sort(key=lambda pair: pair[0])
        buffer.param_indices = [index for index, _ in indexed]
        buffer.params = [param for _, param in indexed]
        return buffer

    optimizer_state_keys = ("exp_avg", "exp_avg_sq")

    @classmethod
    def _is_distopt_quantized_param(cls, tensor):
        return getattr(tensor, "fake_fp8", False)

    def _get_main_param_and_optimizer_states(self, model_param):
        return self.inner_state.read(self.main_of[model_param])

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        self.inner_state.write(self.main_of[model_param], tensors)


class ForkHost(Mixin, FakeCore):
    """The fork's param-state methods on the double."""


PARAM_STATE_METHODS = (
    "get_parameter_state_dp_reshardable",
    "get_parameter_state_dp_zero",
    "save_parameter_state",
    "load_parameter_state",
    "load_parameter_state_from_dp_zero",
    "load_parameter_state_from_dp_zero_legacy",
    "_update_legacy_world_tensors",
    "split_state_dict_if_needed",
    "load_parameter_state_from_dp_reshardable",
)


def upstream_host_class(with_state_access=False):
    """The double with upstream's param-state methods; ``with_state_access`` also takes
    upstream's own ``_get/_set_main_param_and_optimizer_states``."""
    names = PARAM_STATE_METHODS
    if with_state_access:
        names += ("_get_main_param_and_optimizer_states", "_set_main_param_and_optimizer_states")
    return type("UpstreamHost", (FakeCore,), {name: upstream_method(name) for name in names})


def host_class(impl):
    return ForkHost if impl == "fork" else upstream_host_class(with_state_access=True)


def fix_impls(upstream_error):
    """Run a test of a fix on the fork, and on upstream where it must fail with
    ``upstream_error``."""
    return [
        "fork",
        pytest.param(
            "upstream",
            marks=[
                needs_upstream,
                pytest.mark.xfail(strict=True, raises=upstream_error, reason="upstream bug"),
            ],
        ),
    ]


# ------------------------------------------------------------------------ helpers


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A gloo group of one rank."""
    owned = not dist.is_initialized()
    if owned:
        store = tmp_path_factory.mktemp("pg") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    if dist.get_world_size() != 1:
        pytest.skip("needs a world of one process")
    yield dist.new_group([0], backend="gloo")
    if owned:
        dist.destroy_process_group()


def truth(host, seed):
    """Reproducible full (unsharded) state of every model parameter of ``host``."""
    full = {}
    for index, param in enumerate(host.model_params):
        generator = torch.Generator().manual_seed(seed * 1000 + index)
        values = {key: torch.randn(param.numel(), generator=generator) for key in KEYS}
        values["exp_avg_sq"] = values["exp_avg_sq"].abs()
        full[param] = values
    return full


def fill(host, seed, step):
    """Give ``host`` its pieces of :func:`truth` and the step ``step``."""
    host.inner_state.materialise()
    for model_param, values in truth(host, seed).items():
        if model_param in host.main_of:
            piece = host.param_range_of[model_param]
            host.inner_state.write(
                host.main_of[model_param],
                {key: value[piece.start : piece.end] for key, value in values.items()},
            )
    host.inner_state.set_step(step)
    return host


def assert_holds_truth(host, seed):
    """Every owned piece equals the matching slice of :func:`truth`."""
    for model_param, values in truth(host, seed).items():
        if model_param in host.main_of:
            piece = host.param_range_of[model_param]
            live = host.inner_state.read(host.main_of[model_param])
            for key in KEYS:
                assert torch.equal(live[key], values[key][piece.start : piece.end]), key


def snapshot(host):
    """Copy of everything a load may change."""
    return (
        {id(p): {k: v.clone() for k, v in s.items()} for p, s in host.optimizer.state.items()},
        [main.detach().clone() for main in host.main_of.values()],
    )


def assert_untouched(host, before):
    after = snapshot(host)
    assert before[0].keys() == after[0].keys()
    for pid, state in before[0].items():
        for key, value in state.items():
            assert torch.equal(value, after[0][pid][key])
    assert all(torch.equal(a, b) for a, b in zip(before[1], after[1]))


def assert_same_structure(left, right):
    """Equal nested dicts/lists with exactly equal tensors (dtype included)."""
    if isinstance(left, torch.Tensor):
        assert isinstance(right, torch.Tensor) and left.dtype == right.dtype
        assert torch.equal(left, right)
    elif isinstance(left, dict):
        assert isinstance(right, dict) and list(left) == list(right)
        for key in left:
            assert_same_structure(left[key], right[key])
    elif isinstance(left, (list, tuple)):
        assert type(left) is type(right) and len(left) == len(right)
        for one, other in zip(left, right):
            assert_same_structure(one, other)
    else:
        assert left == right


def train(host, steps, seed):
    """``steps`` AdamW steps on reproducible gradients."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for main in host.main_of.values():
            main.grad = torch.randn(main.shape, generator=generator)
        host.optimizer.step()


def assert_same_optimizer(host, other):
    for model_param, main in host.main_of.items():
        mine = host.inner_state.read(main)
        theirs = other.inner_state.read(other_main(other, host, model_param))
        for key in KEYS:
            assert torch.equal(mine[key], theirs[key]), key
    assert host.inner_state.step() == other.inner_state.step()


def other_main(other, host, model_param):
    """The main param of ``other`` for the model parameter at the same index in ``host``."""
    (index,) = [i for i, param in enumerate(host.model_params) if param is model_param]
    return other.main_of[other.model_params[index]]


# ------------------------------------------------------------------------ dp_zero format


def test_dp_zero_layout(group):
    """World tensors hold each bucket's unpadded elements back to back, gaps as zeros."""
    host = fill(ForkHost(LAYOUT, group), seed=1, step=3)
    state = host.get_parameter_state_dp_zero()
    assert state["buckets_coalesced"] is True
    assert sorted(key for key in state if isinstance(key, int)) == [0, 1]
    full = truth(host, 1)
    for gbuf_idx, buffer in enumerate(host.buffers):
        entry = state[gbuf_idx][buffer.dtypes]
        assert list(entry) == list(KEYS) + ["numel_unpadded"]
        assert entry["numel_unpadded"] == buffer.numel_unpadded
        for key in KEYS:
            expected = torch.zeros(buffer.numel_unpadded)
            shift = 0
            for bucket in buffer.buckets:
                for param, (start, end, _) in buffer.param_index_map.items():
                    if bucket.offset <= start < bucket.offset + bucket.grad_data.numel():
                        expected[start - bucket.offset + shift : end - bucket.offset + shift] = (
                            full[param][key]
                        )
                shift += bucket.numel_unpadded
            assert entry[key].dtype == FP32 and torch.equal(entry[key], expected)


def test_empty_data_and_all_ranks(group):
    host = fill(ForkHost(LAYOUT, group), seed=1, step=3)
    empty = host.get_parameter_state_dp_zero(empty_data=True)
    for gbuf_idx, buffer in enumerate(host.buffers):
        entry = empty[gbuf_idx][buffer.dtypes]
        assert entry["numel_unpadded"] == buffer.numel_unpadded
        for key in KEYS:
            assert torch.equal(entry[key], torch.zeros(buffer.numel_unpadded))
    assert_same_structure(
        host.get_parameter_state_dp_zero(return_on_all_ranks=True, use_gloo_comm=False),
        host.get_parameter_state_dp_zero(),
    )


@pytest.mark.parametrize("impl", fix_impls(KeyError))
def test_save_load_resumes_torch_adamw_exactly(group, tmp_path, impl):
    """Upstream: ``KeyError: 'step'`` from its ``_set_main_param_and_optimizer_states``."""
    source = ForkHost(LAYOUT, group)
    fill(source, seed=2, step=0)
    train(source, 3, seed=10)
    source.save_parameter_state(tmp_path / "param_state.pt")

    target = host_class(impl)(LAYOUT, group)
    # What load_state_dict does first: allocate the state and restore the step.
    target.inner_state.materialise()
    target.inner_state.set_step(source.inner_state.step())
    target.load_parameter_state(tmp_path / "param_state.pt")
    assert_same_optimizer(source, target)

    train(source, 2, seed=11)
    train(target, 2, seed=11)
    assert_same_optimizer(source, target)


def test_load_into_an_optimizer_that_never_stepped(group, tmp_path):
    """The state is created in place and the step counter is left as it was."""
    source = fill(ForkHost(LAYOUT, group), seed=3, step=7)
    source.save_parameter_state(tmp_path / "param_state.pt")
    target = ForkHost(LAYOUT, group)
    assert not target.optimizer.state
    target.load_parameter_state(tmp_path / "param_state.pt")
    assert_holds_truth(target, 3)
    assert target.inner_state.step() == 0


def test_load_writes_in_place(group):
    """No state tensor is replaced, so views held elsewhere stay valid."""
    source = fill(ForkHost(LAYOUT, group), seed=4, step=1)
    target = fill(ForkHost(LAYOUT, group), seed=5, step=1)
    before = {
        id(main): [t.data_ptr() for t in target.inner_state.read(main).values()]
        for main in target.main_of.values()
    }
    target.load_parameter_state_from_dp_zero(source.get_parameter_state_dp_zero())
    assert_holds_truth(target, 4)
    for main in target.main_of.values():
        assert [t.data_ptr() for t in target.inner_state.read(main).values()] == before[id(main)]


def test_single_rank_load_copies_nothing_on_the_host(group, monkeypatch):
    """With one data-parallel rank the loaded tensors are the shard: every piece is written
    from a view of them (no padded copy, no scatter into a second buffer), and exactly."""
    state = fill(ForkHost(LAYOUT, group), seed=6, step=1).get_parameter_state_dp_zero()
    loaded = {
        value.untyped_storage().data_ptr()
        for entry in state.values()
        if isinstance(entry, dict)
        for by_key in entry.values()
        for value in by_key.values()
        if isinstance(value, torch.Tensor)
    }
    target = fill(ForkHost(LAYOUT, group), seed=7, step=1)
    sources = []
    write = target._set_main_param_and_optimizer_states

    def recording(model_param, tensors):
        sources.extend(tensor.untyped_storage().data_ptr() for tensor in tensors.values())
        write(model_param, tensors)

    monkeypatch.setattr(target, "_set_main_param_and_optimizer_states", recording)
    target.load_parameter_state_from_dp_zero(state)
    assert sources and set(sources) <= loaded
    assert_holds_truth(target, 6)


# ------------------------------------------------------------------------ compatibility


@needs_upstream
@pytest.mark.parametrize(
    "kwargs", [{}, {"empty_data": True}, {"return_on_all_ranks": True, "use_gloo_comm": True}]
)
def test_dp_zero_gather_matches_upstream(group, kwargs):
    host = fill(ForkHost(LAYOUT, group), seed=6, step=2)
    ours = host.get_parameter_state_dp_zero(**kwargs)
    theirs = upstream_method("get_parameter_state_dp_zero")(host, **kwargs)
    assert_same_structure(ours, theirs)


@needs_upstream
def test_files_pass_both_ways(group, tmp_path):
    source = fill(ForkHost(LAYOUT, group), seed=7, step=2)
    source.save_parameter_state(tmp_path / "fork.pt")
    upstream_method("save_parameter_state")(source, tmp_path / "upstream.pt")
    assert_same_structure(torch.load(tmp_path / "fork.pt"), torch.load(tmp_path / "upstream.pt"))

    into_fork = ForkHost(LAYOUT, group)
    into_fork.load_parameter_state(tmp_path / "upstream.pt")
    assert_holds_truth(into_fork, 7)

    into_upstream = upstream_host_class()(LAYOUT, group)
    into_upstream.inner_state.materialise()
    into_upstream.load_parameter_state(tmp_path / "fork.pt")
    assert_holds_truth(into_upstream, 7)


@needs_upstream
def test_dp_reshardable_matches_upstream_without_copies(group):
    host = fill(ForkHost(LAYOUT, group), seed=8, step=2)
    ours = host.get_parameter_state_dp_reshardable()
    theirs = upstream_method("get_parameter_state_dp_reshardable")(host)
    assert_same_structure(ours, theirs)
    for model_param, main in host.main_of.items():
        live = host.inner_state.read(main)
        found = [
            entry
            for buckets in (ours[0], ours[1])
            for per_bucket in buckets.values()
            for bucket in per_bucket
            for entry in bucket
            if entry["param"].data_ptr() == main.data_ptr()
        ]
        assert len(found) == 1, model_param.shape
        assert all(found[0][key].data_ptr() == live[key].data_ptr() for key in KEYS)


# ------------------------------------------------------------------------ dp_reshardable


def test_dp_reshardable_round_trip_through_a_file(group, tmp_path):
    source = fill(ForkHost(LAYOUT, group), seed=9, step=4)
    torch.save(source.get_parameter_state_dp_reshardable(), tmp_path / "rank0.pt")
    target = ForkHost(LAYOUT, group)
    target.load_parameter_state_from_dp_reshardable(torch.load(tmp_path / "rank0.pt"))
    assert_holds_truth(target, 9)
    assert target.inner_state.step() == 0  # the fork's entries carry no step


@needs_upstream
def test_dp_reshardable_restores_a_saved_step(group):
    """Upstream's entries (torch AdamW) carry ``step``; it is restored, not dropped."""
    source = fill(upstream_host_class(with_state_access=True)(LAYOUT, group), seed=10, step=5)
    saved = copy.deepcopy(source.get_parameter_state_dp_reshardable())
    target = fill(ForkHost(LAYOUT, group), seed=11, step=1)
    target.load_parameter_state_from_dp_reshardable(saved)
    assert_holds_truth(target, 10)
    assert target.inner_state.step() == 5


def test_dp_reshardable_as_distributed_checkpointing_hands_it_back(group):
    """Padding entries are skipped and a live (not saved) step is not restored."""
    source = fill(ForkHost(LAYOUT, group), seed=12, step=6)
    state = copy.deepcopy(source.get_parameter_state_dp_reshardable())
    for per_dtype in (state[0], state[1]):
        for per_bucket in per_dtype.values():
            for bucket in per_bucket:
                for entry in bucket:
                    del entry["gbuf_local_start"], entry["gbuf_local_end"]
                    entry["padding"] = False
                    entry["step"] = torch.tensor(99.0)
                bucket.insert(1, {key: torch.full((2,), float("nan")) for key in KEYS})
                bucket[1]["padding"] = True
    target = fill(ForkHost(LAYOUT, group), seed=13, step=2)
    target.load_parameter_state_from_dp_reshardable(state)
    assert_holds_truth(target, 12)
    assert target.inner_state.step() == 2


def test_dp_reshardable_refuses_another_dp_size(group):
    """A plain per-rank dict from rank 0 of 2 does not fit a run of 1 rank."""
    source = fill(ForkHost(LAYOUT, group, dp_rank=0, dp_size=2), seed=14, step=1)
    saved = source.get_parameter_state_dp_reshardable()
    target = fill(ForkHost(LAYOUT, group), seed=15, step=1)
    before = snapshot(target)
    with pytest.raises(ValueError, match="data-parallel"):
        target.load_parameter_state_from_dp_reshardable(saved)
    assert_untouched(target, before)


def _damaged(state, damage):
    damage(state)
    return state


@pytest.mark.parametrize(
    "damage, error, match",
    [
        (
            lambda s: _damaged(s, lambda s: s.update(per_bucket_numel_unpadded=[{}, {}])),
            ValueError,
            "another model",
        ),
        (lambda s: _damaged(s, lambda s: s.pop(1)), KeyError, "buffer 1"),
        (
            lambda s: _damaged(s, lambda s: s[0][(BF16, FP32)][1][0].pop("exp_avg_sq")),
            KeyError,
            "exp_avg_sq",
        ),
        (
            lambda s: _damaged(s, lambda s: s[0][(BF16, FP32)][1].pop()),
            ValueError,
            "parameter pieces",
        ),
        (
            lambda s: _damaged(s, lambda s: s[1][(FP32, FP32)][0][0].update(param=torch.ones(3))),
            ValueError,
            "'param'",
        ),
        (lambda s: None, ValueError, "param_state"),
    ],
)
def test_dp_reshardable_refuses_bad_input_before_writing(group, damage, error, match):
    source = fill(ForkHost(LAYOUT, group), seed=16, step=1)
    state = damage(source.get_parameter_state_dp_reshardable())
    target = ForkHost(LAYOUT, group)
    with pytest.raises(error, match=match):
        target.load_parameter_state_from_dp_reshardable(state)
    assert not target.optimizer.state  # not even materialised


# ------------------------------------------------------------------------ bad dp_zero input


def _drop_key(state):
    del state[0][(BF16, FP32)]["exp_avg"]


def _rename_dtype(state):
    state[1][(BF16, FP32)] = state[1].pop((FP32, FP32))


def _wrap_in_optimizer_dict(state):
    inner = dict(state)
    state.clear()
    state.update(param_state=inner, param_state_sharding_type="dp_zero_gather_scatter")


def _make_legacy(state):
    state.pop("buckets_coalesced")
    for gbuf_idx in (0, 1):
        ((_, entry),) = state[gbuf_idx].items()
        state[gbuf_idx] = {FP32: {key: [entry[key]] for key in KEYS}}


@pytest.mark.parametrize(
    "damage, error, match",
    [
        (_drop_key, KeyError, "exp_avg"),
        (_rename_dtype, KeyError, r"no \(torch.float32, torch.float32\) entry"),
        (_wrap_in_optimizer_dict, KeyError, "param_state"),
        (_make_legacy, KeyError, "update_legacy_format=True"),
        (lambda s: s.update({2: s[1]}), ValueError, "beyond"),
        (lambda s: s[1][(FP32, FP32)].update(exp_avg=torch.zeros(3)), ValueError, "exp_avg"),
    ],
)
def test_dp_zero_refuses_bad_input_before_writing(group, damage, error, match):
    state = fill(ForkHost(LAYOUT, group), seed=17, step=1).get_parameter_state_dp_zero()
    damage(state)
    target = ForkHost(LAYOUT, group)
    with pytest.raises(error, match=match):
        target.load_parameter_state_from_dp_zero(state)
    assert not target.optimizer.state


@pytest.mark.parametrize("impl", fix_impls(AssertionError))
def test_file_of_another_model_is_refused_untouched(group, tmp_path, impl):
    """Upstream asserts (AssertionError) instead of naming the problem in a ValueError."""
    fill(ForkHost(OTHER_LAYOUT, group), seed=18, step=1).save_parameter_state(tmp_path / "o.pt")
    target = fill(host_class(impl)(LAYOUT, group), seed=19, step=1)
    before = snapshot(target)
    with pytest.raises(ValueError, match="another model"):
        target.load_parameter_state(tmp_path / "o.pt")
    assert_untouched(target, before)


def test_missing_file_and_missing_state(group, tmp_path):
    target = ForkHost(LAYOUT, group)
    with pytest.raises(FileNotFoundError, match="absent.pt.*expected a dp_zero file"):
        target.load_parameter_state(tmp_path / "absent.pt")
    with pytest.raises(ValueError, match="param_state"):
        target.load_parameter_state_from_dp_zero(None)
    assert not target.optimizer.state


def test_stub_optimizer_loads_nothing(group, tmp_path):
    target = ForkHost(LAYOUT, group)
    target.is_stub_optimizer = True
    target.load_parameter_state(tmp_path / "absent.pt")
    assert not target.optimizer.state


# ------------------------------------------------------------------------ legacy format


def _legacy_file(state, cuts):
    """A pre-coalescing file: each buffer keyed by torch.float32, cut at ``cuts[gbuf]``."""
    legacy = {}
    for gbuf_idx, sizes in enumerate(cuts):
        ((_, entry),) = state[gbuf_idx].items()
        legacy[gbuf_idx] = {FP32: {key: list(entry[key].split(sizes)) for key in KEYS}}
    return legacy


@pytest.mark.parametrize("impl", ["fork", pytest.param("upstream", marks=needs_upstream)])
def test_legacy_format_is_recut_at_the_new_buckets(group, impl):
    source = fill(ForkHost(LAYOUT, group), seed=20, step=1)
    legacy = _legacy_file(source.get_parameter_state_dp_zero(), [[4, 26], [3, 5, 4]])
    target = (ForkHost if impl == "fork" else upstream_host_class())(LAYOUT, group)
    target.inner_state.materialise()
    target.load_parameter_state_from_dp_zero(legacy, update_legacy_format=True)
    assert_holds_truth(target, 20)


def test_legacy_format_of_another_model_is_refused(group):
    source = fill(ForkHost(LAYOUT, group), seed=21, step=1)
    legacy = _legacy_file(source.get_parameter_state_dp_zero(), [[30], [12]])
    legacy[1][FP32]["exp_avg"][0] = legacy[1][FP32]["exp_avg"][0][:-1]
    target = ForkHost(LAYOUT, group)
    with pytest.raises(ValueError, match="another model.*'exp_avg' of buffer 1"):
        target.load_parameter_state_from_dp_zero_legacy(legacy)
    assert not target.optimizer.state


@pytest.mark.parametrize("sizes, new", [([5, 7, 1], [2, 11]), ([13], [4, 4, 5]), ([6], [6])])
def test_update_legacy_world_tensors(sizes, new):
    old = list(torch.arange(sum(sizes), dtype=FP32).split(sizes))
    recut = Mixin._update_legacy_world_tensors(old, new)
    assert [t.numel() for t in recut] == new
    assert torch.equal(torch.cat(recut), torch.cat(old))
    if UPSTREAM is not None:
        theirs = UPSTREAM.DistributedOptimizer._update_legacy_world_tensors(old, new)
        assert all(torch.equal(a, b) for a, b in zip(recut, theirs))
    with pytest.raises(ValueError, match="re-cut"):
        Mixin._update_legacy_world_tensors(old, new + [1])


# ------------------------------------------------------------------------ FP8 split

# Parameters 0..4: 0, 2 and 4 are FP8 weights in a buffer of their own, 1 and 3 bf16 biases.
# Within a buffer the higher index comes first, as DDP lays buffers out.
FP8_LAYOUT = [
    {"dtypes": (BF16, FP32), "buckets": [[(3, 0, 3), (2, 0, 1)]]},
    {"dtypes": (BF16, FP32), "fp8": True, "buckets": [[(4, 0, 4), (6, 0, 2), (5, 0, 0)]]},
]
FP8_NUMELS = {0: 5, 1: 2, 2: 6, 3: 3, 4: 4}


def _unsplit_state():
    """A file of the same model saved without FP8 parameter gather: one bf16 buffer holding
    every parameter from the highest index down."""
    total = sum(FP8_NUMELS.values())
    entry = {
        key: torch.randn(total, generator=torch.Generator().manual_seed(i))
        for i, key in enumerate(KEYS)
    }
    entry["numel_unpadded"] = total
    return {"buckets_coalesced": True, 0: {(BF16, FP32): entry}}


def _slices(entry, key):
    """Each parameter index's elements of an unsplit world tensor."""
    out, offset = {}, 0
    for index in sorted(FP8_NUMELS, reverse=True):
        out[index] = entry[key][offset : offset + FP8_NUMELS[index]]
        offset += FP8_NUMELS[index]
    return out


def test_split_for_fp8_buffers(group):
    host = ForkHost(FP8_LAYOUT, group)
    state = _unsplit_state()
    pieces = {key: _slices(state[0][(BF16, FP32)], key) for key in KEYS}
    host.split_state_dict_if_needed(state)
    assert list(state) == ["buckets_coalesced", 0, 1]
    assert list(state[0]) == [(BF16, FP32)] and list(state[1]) == [(torch.uint8, FP32)]
    for gbuf_idx, dtypes, indices in (
        (0, (BF16, FP32), [3, 1]),
        (1, (torch.uint8, FP32), [4, 2, 0]),
    ):
        entry = state[gbuf_idx][dtypes]
        assert entry["numel_unpadded"] == sum(FP8_NUMELS[i] for i in indices)
        for key in KEYS:
            assert torch.equal(entry[key], torch.cat([pieces[key][i] for i in indices]))


@needs_upstream
def test_split_matches_upstream(group):
    host = ForkHost(FP8_LAYOUT, group)
    ours, theirs = _unsplit_state(), _unsplit_state()
    host.split_state_dict_if_needed(ours)
    upstream_method("split_state_dict_if_needed")(host, theirs)
    assert_same_structure(ours, theirs)


def test_split_is_a_no_op_when_not_needed(group):
    already = _unsplit_state()
    ForkHost(FP8_LAYOUT, group).split_state_dict_if_needed(already)
    again = copy.deepcopy(already)
    ForkHost(FP8_LAYOUT, group).split_state_dict_if_needed(again)
    assert_same_structure(again, already)
    plain = fill(ForkHost(LAYOUT, group), seed=22, step=1).get_parameter_state_dp_zero()
    kept = copy.deepcopy(plain)
    ForkHost(LAYOUT, group).split_state_dict_if_needed(plain)
    assert_same_structure(plain, kept)


def test_unsplit_file_loads_into_fp8_buffers(group):
    state = _unsplit_state()
    pieces = {key: _slices(state[0][(BF16, FP32)], key) for key in KEYS}
    host = ForkHost(FP8_LAYOUT, group)
    host.load_parameter_state_from_dp_zero(state)
    index_of = {}
    for buffer in host.buffers:
        index_of.update(zip(buffer.params, buffer.param_indices))
    for model_param, main in host.main_of.items():
        live = host.inner_state.read(main)
        for key in KEYS:
            assert torch.equal(live[key], pieces[key][index_of[model_param]])


# ------------------------------------------------------------------------ two DP ranks


def _two_rank_worker(rank, store, tmp, queue):
    """One data-parallel rank of two; reports an exception text or None."""
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        pg = dist.new_group([0, 1], backend="gloo")
        fill(ForkHost(LAYOUT, pg), seed=30, step=4).save_parameter_state(f"{tmp}/dp2.pt")

        target = ForkHost(LAYOUT, pg)
        target.load_parameter_state(f"{tmp}/dp1.pt")
        assert_holds_truth(target, 31)

        # Rank 0 alone sees the faulty file; every rank must raise instead of hanging.
        bad = None
        if rank == 0:
            bad = torch.load(f"{tmp}/dp1.pt")
            del bad[1][(FP32, FP32)]["exp_avg_sq"]
        try:
            target.load_parameter_state_from_dp_zero(bad)
        except KeyError as error:
            assert "exp_avg_sq" in str(error)
        else:
            raise AssertionError("the faulty file was accepted")
        assert_holds_truth(target, 31)

        # Each rank plans its own share of a dp_reshardable state; rank 1's alone is faulty.
        # No rank may write its share: both raise, rank 0 naming rank 1.
        share = fill(ForkHost(LAYOUT, pg), seed=32, step=4).get_parameter_state_dp_reshardable()
        share = copy.deepcopy(share)
        if rank == 1:
            del share[1][(FP32, FP32)][0][0]["exp_avg_sq"]
        try:
            target.load_parameter_state_from_dp_reshardable(share)
        except (KeyError, RuntimeError) as error:
            expected = "exp_avg_sq" if rank == 1 else "data-parallel rank 1 refused"
            assert expected in str(error), str(error)
        else:
            raise AssertionError("a share one rank refused was loaded")
        assert_holds_truth(target, 31)
        dist.destroy_process_group()
        queue.put((rank, None))
    except BaseException as error:  # pylint: disable=broad-exception-caught
        queue.put((rank, repr(error)))


def test_two_ranks_save_and_load_across_dp_sizes(group, tmp_path):
    """dp_zero files reshard: DP=2 reads a DP=1 file and writes one equal to DP=1's."""
    fill(ForkHost(LAYOUT, group), seed=31, step=4).save_parameter_state(tmp_path / "dp1.pt")
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [
        context.Process(target=_two_rank_worker, args=(r, tmp_path / "store", tmp_path, queue))
        for r in range(2)
    ]
    for worker in workers:
        worker.start()
    reports = dict(queue.get(timeout=300) for _ in workers)
    for worker in workers:
        worker.join(timeout=60)
    assert reports == {0: None, 1: None}

    expected = fill(ForkHost(LAYOUT, group), seed=30, step=4).get_parameter_state_dp_zero()
    assert_same_structure(torch.load(tmp_path / "dp2.pt"), expected)
    target = ForkHost(LAYOUT, group)
    target.load_parameter_state(tmp_path / "dp2.pt")
    assert_holds_truth(target, 30)
