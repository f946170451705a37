# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The core of the fork's ``DistributedOptimizer``, checked against megatron-core 0.19.2 (CPU).

Both classes are built over the same models and real ``_ParamAndGradBuffer`` objects on the
CPU, for several data-parallel sizes and every rank of each (the buffers' process groups are
stand-ins offering ``rank()`` and ``size()``, so no process group is needed). Upstream asks for
CUDA in a few places that have nothing to do with the logic under test; the ``cpu_as_cuda``
fixture answers those on the CPU:

* ``Tensor.type()`` names CPU tensors as their CUDA type (both classes classify parameters
  by these names);
* ``torch.tensor(..., device="cuda")`` (the scalars ``MixedPrecisionOptimizer`` allocates) and
  ``torch.cuda.current_device()`` give the CPU.

Where the fork deliberately differs from upstream (step handling, the inner-group index of
16-bit shards, state device), the tests check the fork's behaviour on its own.
"""

import itertools
import random
import sys
from types import SimpleNamespace

import pytest
import torch

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    import optimizer_table
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests import optimizer_table

upstream_modules = optimizer_table.sibling("upstream_modules")
_buffer_doubles = optimizer_table.sibling("buffer_doubles")
FakeGroup = _buffer_doubles.FakeGroup
param_and_grad_buffers = _buffer_doubles.param_and_grad_buffers

fork = pytest.importorskip(
    "megatron.core.optimizer.distrib_optimizer", reason="the fork's module is not importable"
)
if not hasattr(fork, "_find_adam"):
    pytest.skip("the imported distrib_optimizer is not the fork's", allow_module_level=True)

# pylint: disable=wrong-import-position
from megatron.core.optimizer.inner_optimizer_state import InnerOptimizerState

_optimizer_doubles = optimizer_table.sibling("optimizer_doubles")
FusedAdamDouble = _optimizer_doubles.FusedAdamDouble
GroupStepAdamW = _optimizer_doubles.GroupStepAdamW

LR = 0.01

UPSTREAM = upstream_modules.load()
needs_upstream = pytest.mark.skipif(UPSTREAM is None, reason="upstream's module is not available")


def patch_global(monkeypatch, module, name, value):
    """Replace ``name`` wherever ``module``'s ``DistributedOptimizer`` looks it up: upstream's
    class in its one module, the fork's in each of its modules that imports the name."""
    prefix = module.__name__ + "_"
    mixins = {cls.__module__ for cls in module.DistributedOptimizer.__mro__}
    modules = [module] + [sys.modules[home] for home in sorted(mixins) if home.startswith(prefix)]
    targets = [found for found in modules if name in vars(found)]
    assert targets, f"no module of {module.__name__} uses {name}"
    for target in targets:
        monkeypatch.setattr(target, name, value)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
IMPLEMENTATIONS = [fork] + ([UPSTREAM] if UPSTREAM is not None else [])


@pytest.fixture(autouse=True)
def upstream_as_with_torch_adam(monkeypatch):
    """The inner optimizer here is torch AdamW: upstream runs as where it would build one."""
    upstream_modules.as_with_torch_adam(UPSTREAM, monkeypatch)


# --------------------------------------------------------------------------------------------
# CPU stand-ins and builders
# --------------------------------------------------------------------------------------------


def _plain_retarget(self, param_groups):
    """What upstream does for a torch optimizer: new groups, then a reload of its state."""
    self.optimizer.param_groups = list(param_groups)
    self.optimizer.load_state_dict(self.optimizer.state_dict())


@pytest.fixture(name="cpu_as_cuda")
def fixture_cpu_as_cuda(monkeypatch):
    """Answer upstream's CUDA-only calls on the CPU (see the module docstring)."""
    original_type = torch.Tensor.type
    original_tensor = torch.tensor

    def cuda_type(self, *args, **kwargs):
        if args or kwargs:
            return original_type(self, *args, **kwargs)
        name = original_type(self)
        return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)

    def tensor(*args, device=None, **kwargs):
        if device is not None and str(device).startswith("cuda"):
            device = "cpu"
        return original_tensor(*args, device=device, **kwargs)

    monkeypatch.setattr(torch.Tensor, "type", cuda_type)
    monkeypatch.setattr(torch, "tensor", tensor)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    if not hasattr(InnerOptimizerState, "retarget"):
        monkeypatch.setattr(InnerOptimizerState, "retarget", _plain_retarget, raising=False)


class TinyModel(torch.nn.Module):
    """fp32 and bf16 layers; ``bf16_first`` puts a bf16 parameter first in model order."""

    def __init__(self, bf16_first=False, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        layers = [
            ("dense", torch.nn.Linear(8, 24)),
            ("norm", torch.nn.LayerNorm(24).to(torch.bfloat16)),
            ("proj", torch.nn.Linear(24, 12).to(torch.bfloat16)),
            ("head", torch.nn.Linear(12, 5)),
        ]
        if bf16_first:
            layers = layers[1:2] + layers[:1] + layers[2:]
        for name, layer in layers:
            self.add_module(name, layer)
        for name, param in self.named_parameters():
            with torch.no_grad():
                param.uniform_(-1, 1)
            if name.endswith("weight") and param.dim() == 2:
                param.tensor_model_parallel = True
                param.partition_dim = 0
                param.partition_stride = 1
            if name == "head.bias":
                param.allreduce = True
                param.shared = False


def ddp_config(**overrides):
    """A distributed-optimizer DDP config."""
    return DistributedDataParallelConfig(use_distributed_optimizer=True, **overrides)


def optimizer_config(**overrides):
    """A bf16 distributed-optimizer config."""
    settings = dict(bf16=True, use_distributed_optimizer=True, lr=LR, weight_decay=0.1)
    settings.update(overrides)
    return OptimizerConfig(**settings)


def param_groups_of(model):
    """Two param groups told apart by ``wd_mult`` (load pairs groups by such keys)."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if p.dim() > 1], "wd_mult": 1.0},
        {"params": [p for n, p in named if p.dim() <= 1], "wd_mult": 0.0, "weight_decay": 0.0},
    ]


def real_buffers(model, config, world_size, rank, bucket_size, device="cpu"):
    """``_ParamAndGradBuffer`` objects (on the CPU unless told) laid out by the fork's code."""
    params = [p for p in model.parameters() if p.requires_grad]
    names = {p: n for n, p in model.named_parameters()}
    layout = fork.DistributedOptimizer.compute_full_param_layout(
        params, bucket_size, world_size, config
    )
    return param_and_grad_buffers(
        params, names, layout, config, bucket_size, lambda key: FakeGroup(rank, world_size), device
    )


def construct(module, model, inner, world_size=1, rank=0, bucket_size=None, **options):
    """``module``'s DistributedOptimizer over ``model`` (which has its ``ddp_config``), with CPU
    buffers for ``rank`` of ``world_size``; ``options`` may give ``config``, ``init_state_fn``."""
    buffers = real_buffers(model, model.ddp_config, world_size, rank, bucket_size)
    return module.DistributedOptimizer(
        inner,
        options.get("config") or optimizer_config(),
        None,
        options.get("init_state_fn"),
        [model],
        {0: buffers},
        FakeGroup(rank, world_size),
        None,
        0,
        0,
    )


def build(module, world_size=1, rank=0, bucket_size=None, bf16_first=False, **options):
    """A model and ``module``'s DistributedOptimizer over it; ``options`` may also give
    ``optimizer_cls`` (AdamW by default) and ``seed``."""
    model = TinyModel(bf16_first=bf16_first, seed=options.pop("seed", 0))
    model.ddp_config = ddp_config()
    inner = options.pop("optimizer_cls", torch.optim.AdamW)(param_groups_of(model), lr=LR)
    return model, construct(module, model, inner, world_size, rank, bucket_size, **options)


def names(model):
    """Parameter -> name, to compare two models' parameters."""
    return {p: n for n, p in model.named_parameters()}


def ranges_of(optimizer, model_param):
    """The ranges of the piece of ``model_param`` that ``optimizer``'s rank owns, looked up
    through its public bucket maps."""
    buffer_index, dtypes, bucket_index = optimizer.model_param_gbuf_map[model_param]
    return optimizer.gbuf_ranges[buffer_index][dtypes][bucket_index]["param_map"][model_param]


def fill_grads(model, seed):
    """Give every parameter's ``main_grad`` (a view into the grad buffer) random values."""
    generator = torch.Generator().manual_seed(seed)
    for _, param in sorted(model.named_parameters()):
        param.main_grad.copy_(torch.randn(param.shape, generator=generator).to(param.main_grad))


def train_step(optimizer, model, seed):
    """Gradients in, inner step, updated params back into the buffers."""
    fill_grads(model, seed)
    optimizer._copy_model_grads_to_main_grads()
    optimizer.optimizer.step()
    optimizer._copy_main_params_to_model_params()


CASES = [(1, 0, None), (2, 0, None), (2, 1, None), (3, 2, 200), (4, 1, 150), (4, 3, 150)]


# --------------------------------------------------------------------------------------------
# Construction
# --------------------------------------------------------------------------------------------


@needs_upstream
@pytest.mark.usefixtures("cpu_as_cuda")
@pytest.mark.parametrize("world_size, rank, bucket_size", CASES)
@pytest.mark.parametrize("bf16_first", [False, True])
def test_construction_matches_upstream(world_size, rank, bucket_size, bf16_first):
    setups = [build(m, world_size, rank, bucket_size, bf16_first) for m in (fork, UPSTREAM)]
    (mine_model, mine), (their_model, theirs) = setups
    mine_names, their_names = names(mine_model), names(their_model)

    assert mine.gbuf_idx_to_model_idx_map == theirs.gbuf_idx_to_model_idx_map
    assert mine.per_bucket_numel == theirs.per_bucket_numel
    assert mine.per_bucket_numel_unpadded == theirs.per_bucket_numel_unpadded
    assert len(mine.buffers) == len(theirs.buffers) and mine.is_stub_optimizer is False
    assert list(mine.per_model_bucket_groups) == list(theirs.per_model_bucket_groups)
    assert {mine_names[p]: v for p, v in mine.model_param_gbuf_map.items()} == {
        their_names[p]: v for p, v in theirs.model_param_gbuf_map.items()
    }
    assert [(mine_names[p], v) for p, v in mine.model_param_group_index_map.items()] == [
        (their_names[p], v) for p, v in theirs.model_param_group_index_map.items()
    ]
    for attribute in ("model_float16_groups", "model_fp32_groups"):
        assert [[mine_names[p] for p in g] for g in getattr(mine, attribute)] == [
            [their_names[p] for p in g] for g in getattr(theirs, attribute)
        ]

    def assert_same_shards(mine_groups, their_groups, model_groups):
        assert len(mine_groups) == len(their_groups)
        for group_a, group_b, models in zip(mine_groups, their_groups, model_groups):
            assert len(group_a) == len(group_b) == len(models)
            for a, b, model_param in zip(group_a, group_b, models):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                for attr in ("tensor_model_parallel", "partition_dim", "allreduce", "shared"):
                    assert getattr(a, attr, None) == getattr(b, attr, None)
                    assert getattr(a, attr, None) == getattr(model_param, attr, None)

    assert_same_shards(
        mine.shard_float16_groups, theirs.shard_float16_groups, mine.model_float16_groups
    )
    assert_same_shards(mine.shard_fp32_groups, theirs.shard_fp32_groups, mine.model_fp32_groups)
    assert_same_shards(
        mine.shard_fp32_from_float16_groups,
        theirs.shard_fp32_from_float16_groups,
        mine.model_float16_groups,
    )
    # Views stay views of the same elements; main copies are copies.
    for shard_group, models in zip(mine.shard_float16_groups, mine.model_float16_groups):
        for shard, model_param in zip(shard_group, models):
            start = ranges_of(mine, model_param)["param"].start
            assert shard.data_ptr() == model_param.data_ptr() + start * model_param.element_size()
    for main_group, models in zip(mine.shard_fp32_from_float16_groups, mine.model_float16_groups):
        for main, model_param in zip(main_group, models):
            assert model_param.main_param is main and model_param.main_param_sharded is True
            assert main.dtype == torch.float32 and main.data_ptr() != model_param.data_ptr()

    # The inner optimizer steps the shards, group by group, with its hyperparameters.
    assert len(mine.optimizer.param_groups) == len(theirs.optimizer.param_groups)
    for group_a, group_b in zip(mine.optimizer.param_groups, theirs.optimizer.param_groups):
        assert {k: v for k, v in group_a.items() if k != "params"} == {
            k: v for k, v in group_b.items() if k != "params"
        }
        assert [tuple(p.shape) for p in group_a["params"]] == [
            tuple(p.shape) for p in group_b["params"]
        ]
        for a, b in zip(group_a["params"], group_b["params"]):
            assert torch.equal(a, b)
    # Unowned 16-bit parameters carry an empty main_param slot, as upstream's.
    for name, param in mine_model.named_parameters():
        other = dict(their_model.named_parameters())[name]
        assert hasattr(param, "main_param") == hasattr(other, "main_param")
        if getattr(other, "main_param", None) is None:
            assert getattr(param, "main_param", None) is None


@pytest.mark.usefixtures("cpu_as_cuda")
def test_inner_optimizer_object_is_kept_and_retargeted():
    model = TinyModel()
    model.ddp_config = ddp_config()
    inner = torch.optim.AdamW(param_groups_of(model), lr=LR)
    optimizer = construct(fork, model, inner, 2, 1)
    assert optimizer.optimizer is inner and optimizer.inner_state.optimizer is inner
    stepped = [id(p) for g in inner.param_groups for p in g["params"]]
    expected = [
        id(p)
        for fp32, main in zip(optimizer.shard_fp32_groups, optimizer.shard_fp32_from_float16_groups)
        for p in [*fp32, *main]
    ]
    assert stepped == expected
    assert optimizer.inner_state.state_keys == ("exp_avg", "exp_avg_sq")


@pytest.mark.usefixtures("cpu_as_cuda")
def test_every_owned_param_reads_its_own_shard_even_when_a_bf16_buffer_comes_first():
    # Upstream indexes the inner group by buffer order, which picks the wrong shard here.
    _, optimizer = build(fork, world_size=2, rank=1, bf16_first=True)
    assert optimizer.model_fp32_groups[0] and optimizer.model_float16_groups[0]
    optimizer.inner_state.materialise()
    for model_param in optimizer.model_param_gbuf_map:
        piece = ranges_of(optimizer, model_param)["param"]
        read = optimizer._get_main_param_and_optimizer_states(model_param)["param"]
        expected = model_param.detach().view(-1)[piece.start : piece.end].float()
        assert torch.equal(read, expected)


@needs_upstream
@pytest.mark.usefixtures("cpu_as_cuda")
@pytest.mark.parametrize("module", IMPLEMENTATIONS, ids=lambda m: m.__name__.split(".")[-1])
def test_unsupported_optimizer_is_refused_before_anything_changes(module):
    model = TinyModel()
    model.ddp_config = ddp_config()
    inner = torch.optim.SGD(param_groups_of(model), lr=LR)
    before = [list(g["params"]) for g in inner.param_groups]
    with pytest.raises(AssertionError, match="init_state_fn"):
        construct(module, model, inner)
    assert [list(g["params"]) for g in inner.param_groups] == before
    assert not any(hasattr(p, "main_param") for p in model.parameters())


@pytest.mark.usefixtures("cpu_as_cuda")
def test_unsupported_optimizer_with_init_state_fn_is_accepted():
    _, optimizer = build(fork, optimizer_cls=torch.optim.SGD, init_state_fn=lambda opt, cfg: None)
    assert optimizer.is_stub_optimizer is False and optimizer.opt_group_ranges


@pytest.mark.usefixtures("cpu_as_cuda")
def test_unsupported_parameter_type_raises_type_error():
    model = torch.nn.Linear(4, 4).to(torch.float64)
    model.ddp_config = ddp_config()
    inner = torch.optim.AdamW(model.parameters(), lr=LR)
    with pytest.raises(TypeError, match="DoubleTensor"):
        construct(fork, model, inner)


@pytest.mark.usefixtures("cpu_as_cuda")
@pytest.mark.parametrize("module", IMPLEMENTATIONS, ids=lambda m: m.__name__.split(".")[-1])
def test_stub_optimizer(module, monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *args, **kwargs: 0)
    model = TinyModel()
    model.ddp_config = ddp_config()
    stub = module.DistributedOptimizer(
        None, optimizer_config(), None, None, [model], None, None, None, 0, 3
    )
    assert stub.is_stub_optimizer is True
    assert stub.model_chunks == [model] and stub.ddp_config is model.ddp_config
    assert stub.distributed_optimizer_instance_id == 3
    assert not hasattr(stub, "buffers")
    stub.zero_grad()
    stub._copy_model_grads_to_main_grads()
    stub._copy_main_params_to_model_params()
    stub.prepare_model_params_for_param_sync()
    assert stub.param_groups == [] and stub.get_parameters() == []
    if module is fork:
        assert stub.inner_state is None


def test_chunks_with_different_ddp_configs_are_refused():
    first, second = TinyModel(), TinyModel()
    first.ddp_config = ddp_config()
    second.ddp_config = ddp_config(overlap_grad_reduce=True)
    with pytest.raises(AssertionError, match="DistributedDataParallelConfig"):
        fork.DistributedOptimizer(
            None, optimizer_config(), None, None, [first, second], None, None, None, 0, 0
        )


# --------------------------------------------------------------------------------------------
# State keys and dtypes
# --------------------------------------------------------------------------------------------


@needs_upstream
@pytest.mark.parametrize(
    "optimizer_name, scalar",
    [("adam", "adam"), ("lion", "adam"), ("muon", "lion"), ("muon", "adam"), ("sgd", "adam")],
)
@pytest.mark.parametrize("exp_avg_dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_state_keys_and_dtypes_match_upstream(optimizer_name, scalar, exp_avg_dtype):
    config = SimpleNamespace(
        optimizer=optimizer_name,
        muon_scalar_optimizer=scalar,
        exp_avg_dtype=exp_avg_dtype,
        exp_avg_sq_dtype=torch.float16,
    )
    holder = SimpleNamespace(config=config)
    keys = fork.DistributedOptimizer.optimizer_state_keys.fget(holder)
    assert keys == UPSTREAM.DistributedOptimizer.optimizer_state_keys.fget(holder)
    effective = scalar if optimizer_name == "muon" else optimizer_name
    assert keys == (("exp_avg",) if effective == "lion" else ("exp_avg", "exp_avg_sq"))
    for key in ("exp_avg", "exp_avg_sq", "master_param", "param"):
        assert fork.DistributedOptimizer._get_state_key_dtype(
            holder, key
        ) == UPSTREAM.DistributedOptimizer._get_state_key_dtype(holder, key)


@pytest.mark.usefixtures("cpu_as_cuda")
def test_scaffold_dtypes_for_the_precision_aware_optimizer():
    config = optimizer_config()
    _, optimizer = build(fork, world_size=2, rank=0, config=config)
    config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    config.exp_avg_dtype = torch.bfloat16
    config.exp_avg_sq_dtype = torch.float16
    inner_groups = optimizer.optimizer.state_dict()["param_groups"]
    for remainders, master_dtype in ((True, torch.int16), (False, torch.float32)):
        config.store_param_remainders = remainders
        scaffold = optimizer._state_scaffold(inner_groups, 7)
        assert list(scaffold) == sorted(p for g in inner_groups for p in g["params"])
        # The saved groups list the inner optimizer's shards by position.
        for saved, stepped in zip(inner_groups, optimizer.optimizer.param_groups, strict=True):
            for index, shard in zip(saved["params"], stepped["params"], strict=True):
                entry, numel = scaffold[index], shard.numel()
                assert entry["exp_avg"].dtype == torch.bfloat16
                assert entry["exp_avg"].numel() == numel
                assert entry["exp_avg_sq"].dtype == torch.float16
                assert entry["master_param"].dtype == master_dtype
                assert entry["master_param"].numel() == numel
                assert float(entry["step"]) == 7.0


class DecoupledGradDouble(FusedAdamDouble):
    """The FusedAdam double reading ``decoupled_grad``, as TE FusedAdam does under Megatron's
    precision-aware optimizer (``use_decoupled_grad``)."""

    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        for param in params:
            param.grad = getattr(param, "decoupled_grad", None)
        try:
            return super().step(closure)
        finally:
            for param in params:
                param.grad = None


def _precision_aware_options(module, remainders, monkeypatch):
    """``build`` options for Megatron's precision-aware optimizer on the FusedAdam double: bf16
    moments, master weights kept by the optimizer, with or without remainders."""
    if module is UPSTREAM:  # the double stands for TE FusedAdam: upstream's TE mode
        monkeypatch.setattr(UPSTREAM, "HAVE_APEX_OR_TE", True)
    # Set after construction: OptimizerConfig refuses these settings where TE does not import.
    config = optimizer_config()
    config.use_precision_aware_optimizer = True
    config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    config.store_param_remainders = remainders
    config.exp_avg_dtype = config.exp_avg_sq_dtype = torch.bfloat16

    def inner(groups, lr):
        return DecoupledGradDouble(
            groups,
            lr=lr,
            master_weights=True,
            exp_avg_dtype=torch.bfloat16,
            exp_avg_sq_dtype=torch.bfloat16,
            store_param_remainders=remainders,
        )

    def init_state(inner_optimizer, config=None):  # pylint: disable=unused-argument
        for group in inner_optimizer.param_groups:
            for param in group["params"]:
                inner_optimizer.initialize_state(param, remainders)

    return dict(optimizer_cls=inner, config=config, init_state_fn=init_state)


def _precision_aware_cases():
    cases = []
    for module, remainders, via in itertools.product(
        IMPLEMENTATIONS, [False, True], ["as_kept", "fp32_buffers"]
    ):
        marks = []
        if module is not fork and remainders and via == "fp32_buffers":
            marks.append(
                pytest.mark.xfail(
                    reason="0.19.2 hands set_scaled_state the remainders its fp32 buffers "
                    "widened, and it takes int16 only",
                    strict=True,
                )
            )
        name = "fork" if module is fork else "upstream"
        master = "remainders" if remainders else "fp32_master"
        cases.append(
            pytest.param(module, remainders, via, id=f"{name}-{master}-{via}", marks=marks)
        )
    return cases


@pytest.mark.usefixtures("cpu_as_cuda")
@pytest.mark.parametrize("module, remainders, via", _precision_aware_cases())
def test_precision_aware_parameter_state_resumes_exactly(module, remainders, via, monkeypatch):
    """Precision-aware optimizer (bf16 moments, master weights kept by the optimizer, with and
    without ``store_param_remainders``): each shard's state read through
    ``_get_main_param_and_optimizer_states`` and written into a fresh optimizer through
    ``_set_main_param_and_optimizer_states`` resumes the run exactly, whether the state comes
    back as the optimizer keeps it (dp_reshardable) or widened to fp32, as the legacy and
    dp_zero formats' gather buffers hold it. With remainders the master goes back as the int16
    low bits FusedAdam keeps (a widened master is what TE rejected on the H200)."""
    options = _precision_aware_options(module, remainders, monkeypatch)
    model, optimizer = build(module, 2, 1, 150, **options)
    for seed in range(2):
        train_step(optimizer, model, seed)
    as_saved = {"as_kept": None, "fp32_buffers": lambda t: t.to(torch.float32, copy=True)}[via]
    resumed_model, resumed = _resume(optimizer, model, 2, 1, 150, module, as_saved, **options)
    masters = [
        resumed.optimizer.state[p]["master_param"]
        for group in resumed.optimizer.param_groups
        for p in group["params"]
        if p.dtype == torch.bfloat16
    ]
    assert masters and {m.dtype for m in masters} == {torch.int16 if remainders else torch.float32}
    for seed in range(2, 4):
        train_step(optimizer, model, seed)
        train_step(resumed, resumed_model, seed)
    for param, again in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(param, again)


def _keep_state_cases():
    cases = []
    for module, remainders in itertools.product(IMPLEMENTATIONS, [False, True]):
        upstream = module is not fork
        marks = [
            pytest.mark.xfail(
                reason="0.19.2 saves and loads through the inner optimizer's state_dict",
                strict=True,
            )
        ]
        name = f"{'upstream' if upstream else 'fork'}-{'remainders' if remainders else 'fp32'}"
        cases.append(pytest.param(module, remainders, id=name, marks=marks if upstream else []))
    return cases


@pytest.mark.usefixtures("cpu_as_cuda")
@pytest.mark.parametrize("module, remainders", _keep_state_cases())
def test_load_over_allocated_state_keeps_its_tensors(module, remainders, monkeypatch):
    """A load over state FusedAdam already keeps (the second pass of a dist-checkpoint load)
    loads the param groups and keeps every state tensor: no round trip through the inner
    optimizer's state_dict, which for precision-aware TE FusedAdam is an fp32 copy of every
    state tensor, followed by a new set in the stored dtypes. Saving the groups takes no such
    round trip either."""
    options = _precision_aware_options(module, remainders, monkeypatch)
    model, optimizer = build(module, 2, 1, 150, **options)
    train_step(optimizer, model, 0)
    round_trips, real_state_dict = [], optimizer.optimizer.state_dict
    monkeypatch.setattr(
        optimizer.optimizer, "state_dict", lambda: round_trips.append(1) or real_state_dict()
    )
    saved = optimizer.state_dict()
    # The checkpoint holds what the inner optimizer's own state_dict lists for its groups.
    assert saved["optimizer"]["param_groups"] == [
        {key: value for key, value in group.items() if key != "params"}
        for group in real_state_dict()["param_groups"]
    ]
    for group in saved["optimizer"]["param_groups"]:
        group["lr"], group["step"] = 0.125, 7
    held = {param: dict(entry) for param, entry in optimizer.optimizer.state.items()}
    assert held and all(held.values())

    optimizer.load_state_dict(saved)

    # Neither the save nor the load read the state back through the inner state_dict.
    assert not round_trips
    assert optimizer.optimizer.state.keys() == held.keys()
    for param, entry in optimizer.optimizer.state.items():
        assert entry.keys() == held[param].keys()
        assert all(entry[name] is tensor for name, tensor in held[param].items())
    # The groups' hyperparameters and the step counter come from the checkpoint.
    assert {group["lr"] for group in optimizer.optimizer.param_groups} == {0.125}
    assert {group["step"] for group in optimizer.optimizer.param_groups} == {7}


# --------------------------------------------------------------------------------------------
# Gradients and parameters
# --------------------------------------------------------------------------------------------


@needs_upstream
@pytest.mark.usefixtures("cpu_as_cuda")
@pytest.mark.parametrize("world_size, rank, bucket_size", CASES)
def test_training_steps_match_upstream(world_size, rank, bucket_size):
    (mine_model, mine), (their_model, theirs) = [
        build(m, world_size, rank, bucket_size) for m in (fork, UPSTREAM)
    ]
    for seed in range(3):
        train_step(mine, mine_model, seed)
        train_step(theirs, their_model, seed)
        grads_a = mine._collect_main_grad_data_for_unscaling()
        grads_b = theirs._collect_main_grad_data_for_unscaling()
        # Every owned shard has a gradient (a bare zip would pass on two empty lists).
        owned = sum(len(g) for g in mine.model_float16_groups + mine.model_fp32_groups)
        assert len(grads_a) == len(grads_b) == owned > 0
        for a, b in zip(grads_a, grads_b):
            assert torch.equal(a, b)
        assert len(mine.buffers) == len(theirs.buffers) > 0
        for buffer_a, buffer_b in zip(mine.buffers, theirs.buffers):
            assert torch.equal(buffer_a.param_data, buffer_b.param_data)
    model_a, main_a = mine._get_model_and_main_params_data_float16()
    model_b, main_b = theirs._get_model_and_main_params_data_float16()
    float16_owned = sum(len(group) for group in mine.shard_fp32_from_float16_groups)
    assert len(model_a) == len(main_a) == len(model_b) == len(main_b) == float16_owned > 0
    assert all(torch.equal(a, b) for a, b in zip(model_a + main_a, model_b + main_b))

    their_names = {n: p for p, n in names(their_model).items()}
    for model_param, name in names(mine_model).items():
        if model_param not in mine.model_param_gbuf_map:
            continue
        read = mine._get_main_param_and_optimizer_states(model_param)
        expected = theirs._get_main_param_and_optimizer_states(their_names[name])
        # Like upstream's, the getter hands out torch AdamW's per-parameter step as well.
        assert set(read) == set(expected) == {"param", "exp_avg", "exp_avg_sq", "step"}
        for key in read:
            assert torch.equal(read[key], expected[key])

    for module_optimizer in (mine, theirs):
        module_optimizer.zero_grad(set_to_none=True)
    for group in mine.optimizer.param_groups:
        assert all(p.grad is None for p in group["params"])


@pytest.mark.usefixtures("cpu_as_cuda")
def test_zero_grad_without_set_to_none_zeroes_in_place():
    model, optimizer = build(fork, world_size=2, rank=0)
    fill_grads(model, 0)
    optimizer._copy_model_grads_to_main_grads()
    grads = [p.grad for g in optimizer.optimizer.param_groups for p in g["params"]]
    optimizer.zero_grad(set_to_none=False)
    for group, grad in zip(
        [p for g in optimizer.optimizer.param_groups for p in g["params"]], grads
    ):
        assert group.grad is grad and not grad.any()


@pytest.mark.usefixtures("cpu_as_cuda")
def test_set_then_get_main_param_and_optimizer_states():
    model, optimizer = build(fork, world_size=2, rank=1, bucket_size=150)
    train_step(optimizer, model, 0)
    generator = torch.Generator().manual_seed(5)
    written = {}
    for model_param in optimizer.model_param_gbuf_map:
        numel = len(ranges_of(optimizer, model_param)["param"])
        tensors = {
            k: torch.randn(numel, generator=generator, dtype=torch.float64)
            for k in ("param", "exp_avg", "exp_avg_sq")
        }
        if len(written) % 2:
            tensors["step"] = torch.tensor(99.0)  # ignored, never an error
        optimizer._set_main_param_and_optimizer_states(model_param, tensors)
        written[model_param] = tensors
    for model_param, tensors in written.items():
        read = optimizer._get_main_param_and_optimizer_states(model_param)
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(read[key], tensors[key].float())
    assert optimizer.inner_state.step() == 1
    with pytest.raises(KeyError):
        optimizer._set_main_param_and_optimizer_states(
            next(iter(written)), {"param": torch.zeros(1)}
        )


@needs_upstream
@pytest.mark.usefixtures("cpu_as_cuda")
def test_copy_model_params_to_main_params_matches_upstream():
    (mine_model, mine), (_, theirs) = [build(m, 3, 1, 200) for m in (fork, UPSTREAM)]
    generator = torch.Generator().manual_seed(3)
    checkpoint = {
        f"module.{name}": torch.randn(p.shape, generator=generator).to(p.dtype)
        for name, p in mine_model.named_parameters()
    }
    mine._copy_model_params_to_main_params(state_dict={"model": dict(checkpoint)})
    theirs._copy_model_params_to_main_params(state_dict={"model": dict(checkpoint)})
    for group_a, group_b in zip(mine.optimizer.param_groups, theirs.optimizer.param_groups):
        for a, b in zip(group_a["params"], group_b["params"]):
            assert torch.equal(a, b)
    # Without a state dict the main pieces come back from the model parameters.
    mine._copy_model_params_to_main_params()
    for model_param, main in zip(
        mine.model_float16_groups[0], mine.shard_fp32_from_float16_groups[0]
    ):
        piece = ranges_of(mine, model_param)["param"]
        assert torch.equal(main, model_param.detach().view(-1)[piece.start : piece.end].float())


@pytest.mark.usefixtures("cpu_as_cuda")
def test_copy_model_params_to_main_params_refreshes_copies_kept_by_the_inner_optimizer():
    model, optimizer = build(fork, world_size=2, rank=0)
    refreshed = []
    optimizer.optimizer.update_fp32_param_by_new_param = lambda: refreshed.append(True)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    optimizer._copy_model_params_to_main_params()
    assert refreshed == [True]
    for model_param, main in zip(
        optimizer.model_float16_groups[0], optimizer.shard_fp32_from_float16_groups[0]
    ):
        piece = ranges_of(optimizer, model_param)["param"]
        assert torch.equal(main, model_param.detach().view(-1)[piece.start : piece.end].float())


# --------------------------------------------------------------------------------------------
# FP8 parameters (a stand-in predicate marks parameters as FP8)
# --------------------------------------------------------------------------------------------


def _fake_fp8(monkeypatch, module, recorded):
    patch_global(monkeypatch, module, "is_float8tensor", lambda t: getattr(t, "fake_fp8", False))
    patch_global(
        monkeypatch,
        module,
        "quantize_param_shard",
        lambda params, mains, offsets, group: recorded.append((params, mains, offsets, group)),
    )


@needs_upstream
@pytest.mark.usefixtures("cpu_as_cuda")
@pytest.mark.parametrize("recipe", ["delayed", "mxfp8"])
@pytest.mark.parametrize("world_size, rank, bucket_size", CASES[1:4])
def test_fp8_params_match_upstream(monkeypatch, recipe, world_size, rank, bucket_size):
    setups = []
    for module in (fork, UPSTREAM):
        recorded = []
        _fake_fp8(monkeypatch, module, recorded)
        model = TinyModel()
        model.proj.weight.fake_fp8 = True
        model.ddp_config = ddp_config(fp8_param_gather=True)
        inner = torch.optim.AdamW(param_groups_of(model), lr=LR)
        config = optimizer_config(fp8_recipe=recipe)
        optimizer = construct(module, model, inner, world_size, rank, bucket_size, config=config)
        setups.append((model, optimizer, recorded))
    (mine_model, mine, mine_calls), (_, theirs, their_calls) = setups
    owned = mine_model.proj.weight in mine.model_param_gbuf_map
    for a, b in zip(mine.shard_float16_groups, theirs.shard_float16_groups):
        assert [x is None for x in a] == [x is None for x in b]
    assert any(x is None for g in mine.shard_float16_groups for x in g) == (
        owned and recipe != "delayed"
    )

    fp8_a = mine._get_fp8_params_and_shard_fp32_from_fp8()
    fp8_b = theirs._get_fp8_params_and_shard_fp32_from_fp8()
    assert len(fp8_a[0]) == len(fp8_b[0]) == 1 and fp8_a[2] == fp8_b[2]
    assert (fp8_a[1][0] is None) == (fp8_b[1][0] is None) == (not owned)
    if owned:
        assert torch.equal(fp8_a[1][0], fp8_b[1][0])

    mine._copy_main_params_to_model_params()
    theirs._copy_main_params_to_model_params()
    assert len(mine_calls) == len(their_calls) == 1
    assert mine_calls[0][2] == their_calls[0][2]
    for buffer_a, buffer_b in zip(mine.buffers, theirs.buffers):
        assert torch.equal(buffer_a.param_data, buffer_b.param_data)


# --------------------------------------------------------------------------------------------
# NVFP4 parameters (a stand-in predicate marks parameters as NVFP4)
# --------------------------------------------------------------------------------------------


@needs_upstream
@pytest.mark.usefixtures("cpu_as_cuda")
@pytest.mark.parametrize("keeps_init_value", [True, False])
@pytest.mark.parametrize("world_size, rank, bucket_size", CASES[1:4])
def test_nvfp4_params_match_upstream(monkeypatch, keeps_init_value, world_size, rank, bucket_size):
    """An NVFP4 parameter has no flat shard, its main copy starts from the kept high-precision
    value where there is one, and the cast back goes through ``quantize_nvfp4_param_shard`` with
    the same pieces and offsets as upstream's, never through a copy into the buffer."""
    setups = []
    for module in (fork, UPSTREAM):
        recorded = []
        patch_global(
            monkeypatch, module, "is_nvfp4tensor", lambda t: getattr(t, "fake_nvfp4", False)
        )
        patch_global(monkeypatch, module, "is_grouped_nvfp4tensor", lambda t: False)
        patch_global(
            monkeypatch,
            module,
            "quantize_nvfp4_param_shard",
            lambda *args, calls=recorded: calls.append(args),
        )
        model = TinyModel()
        weight = model.proj.weight
        weight.fake_nvfp4 = True
        cleared = []
        if keeps_init_value:
            # Not representable in bf16, so a main copy made from the parameter would differ.
            init_value = weight.detach().float() + 1.0 / 3.0
            weight.get_high_precision_init_val = lambda value=init_value: value
            weight.clear_high_precision_init_val = lambda cleared=cleared: cleared.append(True)
        model.ddp_config = ddp_config(fp4_param_gather=True)
        inner = torch.optim.AdamW(param_groups_of(model), lr=LR)
        optimizer = construct(module, model, inner, world_size, rank, bucket_size)
        setups.append((model, optimizer, recorded, cleared))
    (model, mine, mine_calls, mine_cleared), (_, theirs, their_calls, their_cleared) = setups
    weight = model.proj.weight
    owned = weight in mine.model_param_gbuf_map
    assert mine_cleared == their_cleared == ([True] if keeps_init_value and owned else [])
    for a, b in zip(mine.shard_float16_groups, theirs.shard_float16_groups):
        assert [x is None for x in a] == [x is None for x in b]
    assert any(x is None for g in mine.shard_float16_groups for x in g) == owned

    params_a, mains_a, offsets_a = mine._get_nvfp4_params_and_shard_fp32_from_nvfp4()
    params_b, mains_b, offsets_b = theirs._get_nvfp4_params_and_shard_fp32_from_nvfp4()
    assert len(params_a) == len(params_b) == 1 and offsets_a == offsets_b
    assert (mains_a[0] is None) == (mains_b[0] is None) == (not owned)
    if owned:
        assert torch.equal(mains_a[0], mains_b[0])
        piece = ranges_of(mine, weight)["param"]
        source = weight.detach().float() + 1.0 / 3.0 if keeps_init_value else weight.float()
        assert torch.equal(mains_a[0], source.view(-1)[piece.start : piece.end])

    before = [buffer.param_data.clone() for buffer in mine.buffers]
    mine._copy_main_params_to_model_params()
    theirs._copy_main_params_to_model_params()
    assert len(mine_calls) == len(their_calls) == 1
    assert mine_calls[0][2] == their_calls[0][2]
    assert mine_calls[0][3] is mine.data_parallel_group
    for buffer_a, buffer_b in zip(mine.buffers, theirs.buffers):
        assert torch.equal(buffer_a.param_data, buffer_b.param_data)
    if owned:
        # The NVFP4 parameter's place in the buffer is left to the quantizing cast.
        index, _, bucket = mine.model_param_gbuf_map[weight]
        world = ranges_of(mine, weight)["gbuf_world_in_bucket"]
        start = mine.buffers[index].buckets[bucket].offset + world.start
        assert torch.equal(
            mine.buffers[index].param_data[start : start + world.size],
            before[index][start : start + world.size],
        )


# --------------------------------------------------------------------------------------------
# Grouped quantized tensors (stand-in members)
# --------------------------------------------------------------------------------------------


@needs_upstream
def test_expand_quantized_param_shard_matches_upstream(monkeypatch):
    rng = random.Random(0)
    members_of = {}
    for module in (fork, UPSTREAM):
        patch_global(
            monkeypatch,
            module,
            "is_grouped_tensor_with_quantized_storage",
            lambda t: id(t) in members_of,
        )
        patch_global(
            monkeypatch,
            module,
            "get_grouped_quantized_members",
            lambda t, create_if_missing: members_of[id(t)],
        )
    for _ in range(60):
        sizes = [rng.randint(1, 9) for _ in range(rng.randint(1, 5))]
        grouped = torch.zeros(sum(sizes))
        members_of[id(grouped)] = [torch.zeros(s) for s in sizes]
        start = rng.randint(0, sum(sizes) - 1)
        end = rng.randint(start + 1, sum(sizes))
        main = torch.arange(start, end, dtype=torch.float32)
        for shard, offset in ((main, start), (None, None)):
            mine = fork.DistributedOptimizer._expand_quantized_param_shard_for_cast(
                grouped, shard, offset
            )
            theirs = UPSTREAM.DistributedOptimizer._expand_quantized_param_shard_for_cast(
                grouped, shard, offset
            )
            assert [id(m) for m in mine[0]] == [id(m) for m in theirs[0]]
            assert mine[2] == theirs[2]
            for a, b in zip(mine[1], theirs[1]):
                assert (a is None and b is None) or torch.equal(a, b)
    plain = torch.zeros(4)
    assert fork.DistributedOptimizer._expand_quantized_param_shard_for_cast(plain, None, 3) == (
        [plain],
        [None],
        [3],
    )


# --------------------------------------------------------------------------------------------
# MXFP8 parameter gather through the gradient buffer
# --------------------------------------------------------------------------------------------


@needs_upstream
@pytest.mark.usefixtures("cpu_as_cuda")
@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("world_size, rank, bucket_size", CASES[1:4])
def test_prepare_model_params_for_param_sync_matches_upstream(
    staged, world_size, rank, bucket_size
):
    """With MXFP8 reusing the gradient buffer for the overlapped parameter gather, the fp32
    main pieces are staged into the buffers after the gradient buffers are zeroed, and the
    chunks' dispatch state is reset afterwards; otherwise nothing happens."""
    setups = []
    for module in (fork, UPSTREAM):
        config = optimizer_config(overlap_param_gather=staged)
        config.reuse_grad_buf_for_mxfp8_param_ag = True
        model, optimizer = build(module, world_size, rank, bucket_size, config=config)
        calls = []
        model.zero_grad_buffer = lambda calls=calls: calls.append("zero_grad_buffer")
        model.reset_param_sync_dispatch_state = lambda calls=calls: calls.append("reset")
        with torch.no_grad():
            for group in optimizer.shard_fp32_from_float16_groups:
                for main in group:
                    main.add_(1.0 / 3.0)  # not representable in bf16: the copy narrows
        before = [buffer.param_data.clone() for buffer in optimizer.buffers]
        optimizer.prepare_model_params_for_param_sync()
        setups.append((optimizer, calls, before))
    (mine, mine_calls, before), (theirs, their_calls, _) = setups
    assert mine_calls == their_calls == (["zero_grad_buffer", "reset"] if staged else [])
    owned = sum(len(group) for group in mine.shard_fp32_from_float16_groups)
    assert owned > 0
    for index, (buffer_a, buffer_b) in enumerate(zip(mine.buffers, theirs.buffers)):
        assert torch.equal(buffer_a.param_data, buffer_b.param_data)
        if not staged:
            assert torch.equal(buffer_a.param_data, before[index])
    if staged:
        assert any(not torch.equal(b.param_data, a) for b, a in zip(mine.buffers, before))


# --------------------------------------------------------------------------------------------
# Non-parameter state
# --------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("cpu_as_cuda")
def test_state_dict_before_and_after_a_step():
    model, optimizer = build(fork, world_size=2, rank=0)
    saved = optimizer.state_dict()
    assert set(saved) == {"optimizer"} and set(saved["optimizer"]) == {"param_groups"}
    assert all("params" not in g and "step" not in g for g in saved["optimizer"]["param_groups"])
    for seed in range(3):
        train_step(optimizer, model, seed)
    saved = optimizer.state_dict()
    assert [g["step"] for g in saved["optimizer"]["param_groups"]] == [3, 3]
    assert [g["wd_mult"] for g in saved["optimizer"]["param_groups"]] == [1.0, 0.0]
    assert all("params" in g for g in optimizer.optimizer.param_groups)


@needs_upstream
@pytest.mark.usefixtures("cpu_as_cuda")
def test_state_dict_equals_upstreams():
    (mine_model, mine), (their_model, theirs) = [build(m, 2, 1, 150) for m in (fork, UPSTREAM)]
    for seed in range(2):
        train_step(mine, mine_model, seed)
        train_step(theirs, their_model, seed)
    assert mine.state_dict() == theirs.state_dict()


def _resume(
    source_optimizer,
    source_model,
    world_size,
    rank,
    bucket_size,
    module=fork,
    as_saved=None,
    **options,
):
    """A fresh optimizer loaded from ``source_optimizer``'s state dict and parameter state;
    ``as_saved`` (a tensor's copy by default) stands for what a checkpoint format keeps of each
    state tensor, ``options`` go to :func:`build`."""
    as_saved = as_saved or torch.Tensor.clone
    model, optimizer = build(module, world_size, rank, bucket_size, seed=1, **options)
    with torch.no_grad():
        for a, b in zip(model.parameters(), source_model.parameters()):
            a.copy_(b)
    saved = source_optimizer.state_dict()
    optimizer.load_state_dict(saved)
    # Without autograd: 0.19.2 writes fp32 shards, views of parameters that require grad, in
    # place, which autograd refuses.
    with torch.no_grad():
        for model_param, source_param in zip(model.parameters(), source_model.parameters()):
            if source_param in source_optimizer.model_param_gbuf_map:
                tensors = source_optimizer._get_main_param_and_optimizer_states(source_param)
                optimizer._set_main_param_and_optimizer_states(
                    model_param, {k: as_saved(v) for k, v in tensors.items()}
                )
    return model, optimizer


@pytest.mark.usefixtures("cpu_as_cuda")
@pytest.mark.parametrize("world_size, rank, bucket_size", CASES)
def test_resume_continues_exactly(world_size, rank, bucket_size):
    model, optimizer = build(fork, world_size, rank, bucket_size)
    for seed in range(2):
        train_step(optimizer, model, seed)
    resumed_model, resumed = _resume(optimizer, model, world_size, rank, bucket_size)

    steps = [
        resumed.optimizer.state[p]["step"]
        for g in resumed.optimizer.param_groups
        for p in g["params"]
    ]
    assert all(float(s) == 2.0 for s in steps)
    assert len({id(s) for s in steps}) == len(steps)  # one counter each, not one shared
    for group in resumed.optimizer.param_groups:
        for shard in group["params"]:
            state = resumed.optimizer.state[shard]
            assert (
                state["exp_avg"].device == shard.device and state["exp_avg"].dtype == torch.float32
            )

    for seed in range(2, 4):
        train_step(optimizer, model, seed)
        train_step(resumed, resumed_model, seed)
        for buffer_a, buffer_b in zip(optimizer.buffers, resumed.buffers):
            assert torch.equal(buffer_a.param_data, buffer_b.param_data)


@pytest.mark.usefixtures("cpu_as_cuda")
@pytest.mark.parametrize(
    "module", IMPLEMENTATIONS, ids=lambda m: "fork" if m is fork else "upstream"
)
def test_group_step_adam_resumes_exactly(module, monkeypatch):
    """Apex FusedAdam's contract (fp32 moments in the state, the Adam step in the param groups,
    torch's own load): the saved step comes back into every group, so bias correction goes
    on where it stopped, and the resumed run equals the uninterrupted one."""
    # What the module sees where Apex imports: its FusedAdam is the ``Adam`` it accepts.
    monkeypatch.setattr(module, "Adam", GroupStepAdamW)
    if module is UPSTREAM:  # 0.19.2 reads the step from the groups only in its Apex/TE mode
        monkeypatch.setattr(UPSTREAM, "HAVE_APEX_OR_TE", True)
        monkeypatch.setattr(UPSTREAM, "USING_APEX_OPTIMIZER", True)
    model, optimizer = build(module, 2, 1, 150, optimizer_cls=GroupStepAdamW)
    for seed in range(3):
        train_step(optimizer, model, seed)
    saved = optimizer.state_dict()
    assert {group["step"] for group in saved["optimizer"]["param_groups"]} == {3}
    resumed_model, resumed = _resume(
        optimizer, model, 2, 1, 150, module, optimizer_cls=GroupStepAdamW
    )
    assert [group["step"] for group in resumed.optimizer.param_groups] == [3, 3]
    for seed in range(3, 5):
        train_step(optimizer, model, seed)
        train_step(resumed, resumed_model, seed)
    for param, again in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(param, again)


@pytest.mark.usefixtures("cpu_as_cuda")
def test_load_state_dict_restores_hyperparameters_and_grad_scaler_absence():
    model, optimizer = build(fork, world_size=2, rank=1)
    train_step(optimizer, model, 0)
    saved = optimizer.state_dict()
    saved["optimizer"]["param_groups"][0]["lr"] = 0.5
    saved["optimizer"]["param_groups"].reverse()  # pairing is by identity, not position
    _, loaded = build(fork, world_size=2, rank=1)
    loaded.load_state_dict(saved)
    assert [g["lr"] for g in loaded.optimizer.param_groups] == [0.5, LR]
    assert [g["wd_mult"] for g in loaded.optimizer.param_groups] == [1.0, 0.0]
    # A second load reuses the state tensors it created the first time.
    before = {id(t) for s in loaded.optimizer.state.values() for t in s.values()}
    loaded.load_state_dict(saved)
    after = {id(t) for s in loaded.optimizer.state.values() for t in s.values()}
    assert before == after


@pytest.mark.usefixtures("cpu_as_cuda")
def test_load_without_step_is_no_error():
    """A state dict saved before the first step has no step anywhere; loading it gives every
    shard a step counter at 0, so the next step is the first. (Its moments come from the
    parameter state, which this test does not load.)"""
    model, optimizer = build(fork, world_size=2, rank=0)
    saved = optimizer.state_dict()  # saved before any step: no 'step' anywhere
    assert all("step" not in group for group in saved["optimizer"]["param_groups"])
    loaded_model, loaded = build(fork, world_size=2, rank=0)
    loaded.load_state_dict(saved)
    assert loaded.optimizer.state and loaded.inner_state.step() == 0
    train_step(loaded, loaded_model, 0)  # torch AdamW finds its per-parameter step
    assert loaded.inner_state.step() == 1


@pytest.mark.usefixtures("cpu_as_cuda")
def test_bad_state_dicts_are_refused_before_anything_changes():
    model, optimizer = build(fork, world_size=2, rank=0)
    train_step(optimizer, model, 0)
    _, target = build(fork, world_size=2, rank=0)
    groups_before = [dict(g) for g in target.optimizer.param_groups]

    unmatched = optimizer.state_dict()
    unmatched["optimizer"]["param_groups"][0]["wd_mult"] = 2.0
    with pytest.raises(KeyError, match="no param group matching"):
        target.load_state_dict(unmatched)

    disagreeing = optimizer.state_dict()
    disagreeing["optimizer"]["param_groups"][1]["step"] = 5
    with pytest.raises(ValueError, match="disagree on the step"):
        target.load_state_dict(disagreeing)

    unknown = {**optimizer.state_dict(), "param_state": {}, "param_state_sharding_type": "nope"}
    with pytest.raises(NotImplementedError, match="nope"):
        target.load_state_dict(unknown)

    assert not target.optimizer.state
    assert [dict(g) for g in target.optimizer.param_groups] == groups_before


@needs_upstream
@pytest.mark.usefixtures("cpu_as_cuda")
def test_state_dicts_cross_between_fork_and_upstream():
    (mine_model, mine), (their_model, theirs) = [build(m, 2, 0, None) for m in (fork, UPSTREAM)]
    for seed in range(2):
        train_step(mine, mine_model, seed)
        train_step(theirs, their_model, seed)
    _, fork_loaded = build(fork, 2, 0, None)
    fork_loaded.load_state_dict(theirs.state_dict())
    _, upstream_loaded = build(UPSTREAM, 2, 0, None)
    upstream_loaded.load_state_dict(mine.state_dict())
    assert fork_loaded.inner_state.step() == 2
    for loaded in (fork_loaded, upstream_loaded):
        hyper = [
            {k: v for k, v in g.items() if k != "params"} for g in loaded.optimizer.param_groups
        ]
        assert [h["wd_mult"] for h in hyper] == [1.0, 0.0] and all(h["step"] == 2 for h in hyper)
    for group in upstream_loaded.optimizer.param_groups:
        for shard in group["params"]:
            assert float(upstream_loaded.optimizer.state[shard]["step"]) == 2.0


@pytest.mark.usefixtures("cpu_as_cuda")
def test_grad_scaler_state_round_trip():
    class Scaler:
        """The two methods a grad scaler offers for checkpoints."""

        def __init__(self, scale):
            self.scale = scale

        def state_dict(self):  # pylint: disable=missing-function-docstring
            return {"scale": self.scale}

        def load_state_dict(self, state):  # pylint: disable=missing-function-docstring
            self.scale = state["scale"]

    _, optimizer = build(fork, world_size=1)
    optimizer.grad_scaler = Scaler(4.0)
    saved = optimizer.state_dict()
    assert saved["grad_scaler"] == {"scale": 4.0}
    _, loaded = build(fork, world_size=1)
    loaded.grad_scaler = Scaler(1.0)
    loaded.load_state_dict(saved)
    assert loaded.grad_scaler.scale == 4.0


@pytest.mark.usefixtures("cpu_as_cuda")
def test_param_state_is_loaded_by_the_named_loader(monkeypatch):
    _, optimizer = build(fork, world_size=1)
    calls = []
    monkeypatch.setattr(
        type(optimizer), "load_parameter_state_from_dp_reshardable", lambda self, s: calls.append(s)
    )
    monkeypatch.setattr(type(optimizer), "_plan_param_state_load", lambda self, s: lambda: None)
    saved = {
        **optimizer.state_dict(),
        "param_state": "PAYLOAD",
        "param_state_sharding_type": "dp_reshardable",
    }
    optimizer.load_state_dict(saved)
    assert calls == ["PAYLOAD"]


# --------------------------------------------------------------------------------------------
# Reloading model params by name
# --------------------------------------------------------------------------------------------


class FakeGrouped(torch.nn.Module):
    """A grouped-GEMM module in either storage form."""

    def __init__(self, count, grouped):
        super().__init__()
        self.num_gemms = count
        self.single_grouped_weight = grouped
        self.use_bias = False

    @staticmethod
    def _split_grouped_checkpoint_tensor(tensor, key):
        assert key.endswith("weight")
        return list(tensor.unbind(0))


class Synthesizing(torch.nn.Module):
    """A module that builds one runtime parameter from two checkpoint tensors."""

    @staticmethod
    def _synthetic_state_dict_key_suffixes():
        return ["down.a", "down.b"]

    @staticmethod
    def _synthesize_fused_qkv_down_weight(state_dict, prefix):
        state_dict[prefix + "fused"] = state_dict[prefix + "down.a"] + state_dict[prefix + "down.b"]


@needs_upstream
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("prefix", ["", "module.", "decoder."])
def test_grouped_checkpoint_names_are_normalized_like_upstream(grouped, prefix):
    outer = torch.nn.Module()
    outer.experts = FakeGrouped(3, grouped)
    tensors = [torch.randn(2, 2) for _ in range(3)]
    if grouped:
        checkpoint = {f"{prefix}experts.weight{i}": t for i, t in enumerate(tensors)}
    else:
        checkpoint = {f"{prefix}experts.weight": torch.stack(tensors)}
    checkpoint["other"] = torch.zeros(1)
    results = []
    for module in (fork, UPSTREAM):
        flat = dict(checkpoint)
        module.DistributedOptimizer._normalize_state_dict_for_grouped_params(flat, outer)
        results.append(flat)
    assert list(results[0]) == list(results[1])
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])
    wanted = [f"{prefix}experts.weight{i}" for i in range(3)]
    if grouped:
        wanted = [f"{prefix}experts.weight"]
    assert sorted(results[0]) == sorted(wanted + ["other"])


@needs_upstream
@pytest.mark.parametrize("grouped", [False, True])
def test_grouped_checkpoint_names_with_both_forms_are_left_alone(grouped):
    outer = torch.nn.Module()
    outer.experts = FakeGrouped(2, grouped)
    checkpoint = {
        "experts.weight": torch.zeros(2, 3),
        "experts.weight0": torch.ones(3),
        "experts.weight1": torch.ones(3),
    }
    for module in (fork, UPSTREAM):
        flat = dict(checkpoint)
        module.DistributedOptimizer._normalize_state_dict_for_grouped_params(flat, outer)
        assert list(flat) == list(checkpoint)
        assert all(flat[k] is checkpoint[k] for k in flat)


@needs_upstream
@pytest.mark.parametrize("prefix", ["", "model.", "model.decoder."])
def test_synthesized_params_and_prefixes_match_upstream(prefix):
    root = torch.nn.Module()
    root.decoder = torch.nn.Module()
    root.decoder.attention = Synthesizing()
    checkpoint = {
        f"{prefix}attention.down.a": torch.ones(2),
        f"{prefix}attention.down.b": torch.ones(2) * 2,
    }
    results = []
    for module in (fork, UPSTREAM):
        flat = dict(checkpoint)
        module.DistributedOptimizer._synthesize_state_dict_params_for_model(flat, root)
        results.append(flat)
        for name in ("decoder.attention", "attention", "", "x.y"):
            assert fork.DistributedOptimizer._state_dict_module_prefixes(
                flat, name, "down.a"
            ) == UPSTREAM.DistributedOptimizer._state_dict_module_prefixes(flat, name, "down.a")
    assert list(results[0]) == list(results[1])
    assert torch.equal(results[0][f"{prefix}attention.fused"], torch.full((2,), 3.0))


@needs_upstream
@pytest.mark.usefixtures("cpu_as_cuda")
def test_state_dict_param_map_layouts_and_errors():
    (mine_model, mine), (their_model, theirs) = [build(m) for m in (fork, UPSTREAM)]
    checkpoint = {
        f"module.module.{n}": p.detach().clone() for n, p in mine_model.named_parameters()
    }
    for layout in (
        dict(checkpoint),
        {"model": dict(checkpoint)},
        {"model0": dict(checkpoint)},
        {"model_0": dict(checkpoint)},
    ):
        mine_map = mine._build_model_param_to_state_dict_param_map(dict(layout))
        their_map = theirs._build_model_param_to_state_dict_param_map(dict(layout))
        assert [names(mine_model)[p] for p in mine_map] == [
            names(their_model)[p] for p in their_map
        ]
        assert all(a is b for a, b in zip(mine_map.values(), their_map.values()))
    broken = dict(checkpoint)
    broken.pop("module.module.head.bias")
    with pytest.raises(AssertionError, match="head.bias has 0 matches"):
        mine._build_model_param_to_state_dict_param_map(broken)
    with pytest.raises(AssertionError, match="model1"):
        mine.model_chunks.append(mine_model)
        mine._build_model_param_to_state_dict_param_map({"model0": dict(checkpoint)})


# --------------------------------------------------------------------------------------------
# Parameter sync
# --------------------------------------------------------------------------------------------


def _sync_recorder(tags):
    """A model chunk whose bucket groups' first params carry ``tags``; it records syncs."""
    groups = []
    for tag in tags:
        param = torch.zeros(1)
        if tag is not None:
            param.is_managed_by_layer_wise_optimizer = tag
        groups.append(SimpleNamespace(buckets=[SimpleNamespace(params_list=[param])], tag=tag))
    groups.append(SimpleNamespace(buckets=[], tag="empty"))
    synced = []
    chunk = SimpleNamespace(
        bucket_groups=groups[:2],
        expert_parallel_bucket_groups=groups[2:],
        _start_bucket_group_param_sync=lambda group, force_sync: synced.append(
            (group.tag, force_sync)
        ),
        ddp_config=ddp_config(),
    )
    return chunk, synced


@needs_upstream
@pytest.mark.usefixtures("cpu_as_cuda")
@pytest.mark.parametrize("overlap, defer", [(False, False), (True, False), (False, True)])
def test_step_with_ready_grads_syncs_the_optimizer_buckets(overlap, defer):
    results = []
    for module in (fork, UPSTREAM):
        model, optimizer = build(module, world_size=2, rank=0)
        chunk, synced = _sync_recorder([None, False, True])
        optimizer.model_chunks = [chunk]
        optimizer.ddp_config = ddp_config(overlap_param_gather=overlap)
        if defer:
            optimizer._defer_param_sync = True
        fill_grads(model, 0)
        optimizer._copy_model_grads_to_main_grads()
        assert optimizer.step_with_ready_grads() is True
        results.append((synced, [b.param_data.clone() for b in optimizer.buffers]))
    assert results[0][0] == results[1][0]
    assert results[0][0] == ([] if overlap or defer else [(None, False), (False, False)])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


@pytest.mark.usefixtures("cpu_as_cuda")
def test_grad_stats_group_is_the_assigned_one():
    _, optimizer = build(fork)
    assert optimizer.get_grad_stats_parallel_group() is None
    optimizer.grad_stats_parallel_group = marker = object()
    assert optimizer.get_grad_stats_parallel_group() is marker


# --------------------------------------------------------------------------------------------
# CUDA only
# --------------------------------------------------------------------------------------------


@needs_cuda
def test_scaffold_lives_on_the_parameter_device_on_cuda():
    model = TinyModel().cuda()
    model.ddp_config = ddp_config()
    device = torch.cuda.current_device()
    buffers = real_buffers(model, model.ddp_config, 1, 0, None, device=device)
    optimizer = fork.DistributedOptimizer(
        torch.optim.AdamW(param_groups_of(model), lr=LR),
        optimizer_config(),
        None,
        None,
        [model],
        {0: buffers},
        FakeGroup(0, 1),
        None,
        0,
        0,
    )
    optimizer.load_state_dict(optimizer.state_dict())
    for group in optimizer.optimizer.param_groups:
        for shard in group["params"]:
            assert shard.is_cuda
            assert optimizer.optimizer.state[shard]["exp_avg"].device == shard.device


# --------------------------------------------------------------------------------------------
# HybridDeviceOptimizer (needs InnerOptimizerState.retarget, which points it at the shards)
# --------------------------------------------------------------------------------------------


def _hybrid(param_groups, lr, **options):
    """An HDO offloading half its parameters, torch AdamW on both halves."""
    # pylint: disable=import-outside-toplevel
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    return HybridDeviceOptimizer(
        param_groups,
        offload_fraction=0.5,
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.AdamW,
        lr=lr,
        **options,
    )


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CPU stand-ins for CUDA buffers; on a GPU the HDO takes its real streams, and "
    "test_distrib_optimizer_resume.py covers it there",
)
@pytest.mark.usefixtures("cpu_as_cuda")
@pytest.mark.parametrize("world_size, rank, bucket_size", CASES[1:4])
def test_hybrid_device_optimizer_resume_continues_exactly(world_size, rank, bucket_size):
    model, optimizer = build(fork, world_size, rank, bucket_size, optimizer_cls=_hybrid)
    inner = optimizer.optimizer
    for seed in range(2):
        train_step(optimizer, model, seed)
    assert optimizer.optimizer is inner  # retargeted, not rebuilt
    assert optimizer.state_dict()["optimizer"]["param_groups"][0]["step"] == 2
    resumed_model, resumed = build(fork, world_size, rank, bucket_size, optimizer_cls=_hybrid)
    with torch.no_grad():
        for a, b in zip(resumed_model.parameters(), model.parameters()):
            a.copy_(b)
    resumed.load_state_dict(optimizer.state_dict())
    for param, source in zip(resumed_model.parameters(), model.parameters()):
        if source in optimizer.model_param_gbuf_map:
            tensors = optimizer._get_main_param_and_optimizer_states(source)
            resumed._set_main_param_and_optimizer_states(
                param, {k: v.clone() for k, v in tensors.items()}
            )
    resumed.inner_state.finish_load()
    assert resumed.inner_state.step() == 2
    for seed in range(2, 4):
        train_step(optimizer, model, seed)
        train_step(resumed, resumed_model, seed)
        for buffer_a, buffer_b in zip(optimizer.buffers, resumed.buffers):
            assert torch.equal(buffer_a.param_data, buffer_b.param_data)


# --------------------------------------------------------------------------------------------
# dp_reshardable checkpoints crossing between the fork and upstream
# --------------------------------------------------------------------------------------------

DP_RESHARDABLE = {"distrib_optim_sharding_type": "dp_reshardable"}


def _checkpoint_entries(sharded):
    """Path -> what a dist checkpoint keeps of each leaf of a sharded optimizer state dict:
    ShardedTensors and ShardedObjects with their keys, placement and data, local
    non-persistent objects only as such (with the type of what they hold)."""
    # pylint: disable=import-outside-toplevel
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedObject,
        ShardedTensor,
    )

    entries = {}

    def walk(value, path):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, path + (key,))
        elif isinstance(value, list):
            for index, item in enumerate(value):
                walk(item, path + (index,))
        elif isinstance(value, ShardedTensor):
            placement = (value.key, value.global_shape, value.global_offset, value.replica_id)
            entries[path] = ("tensor", placement, value.dtype, value.data.tolist())
        elif isinstance(value, ShardedObject):
            entries[path] = ("object", value.key, value.replica_id, repr(value.data))
        elif isinstance(value, LocalNonpersistentObject):
            entries[path] = ("local", type(value.obj).__name__)
        else:
            entries[path] = ("plain", repr(value))

    walk(sharded, ())
    return entries


def _dist_checkpoint_load(saved, request):
    """What ``dist_checkpointing.load`` makes of ``request`` given the checkpoint ``saved``:
    tensors filled in place from the saved pieces, objects replaced by the saved ones, local
    non-persistent objects handed back as the loader made them."""
    # pylint: disable=import-outside-toplevel
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedObject,
        ShardedTensor,
    )

    pieces = {
        (v.key, v.global_offset): v.data
        for v in nested_values(saved)
        if isinstance(v, ShardedTensor)
    }
    objects = {v.key: v.data for v in nested_values(saved) if isinstance(v, ShardedObject)}

    def load(value):
        if isinstance(value, ShardedTensor):
            with torch.no_grad():
                value.data.copy_(pieces[(value.key, value.global_offset)])
            return value.data
        if isinstance(value, ShardedObject):
            return objects[value.key]
        if isinstance(value, LocalNonpersistentObject):
            return value.obj
        return value

    return dict_list_map_inplace(load, request)


def _trained(module, steps):
    """One data-parallel rank of two (several buckets) after ``steps`` training steps."""
    model, optimizer = build(module, 2, 1, 150)
    for seed in range(steps):
        train_step(optimizer, model, seed)
    return model, optimizer


def _resume_from_dp_reshardable(saver, saver_model, module):
    """``module``'s fresh optimizer (other initial weights) loaded from ``saver``'s
    dp_reshardable dist checkpoint the way Megatron-LM loads one."""
    model, optimizer = build(module, 2, 1, 150, seed=1)
    with torch.no_grad():
        for param, source in zip(model.parameters(), saver_model.parameters()):
            param.copy_(source)
    if module is not fork:
        # 0.19.2 without TE/Apex reads a step from every state entry while describing itself.
        optimizer._init_optimizer_states_with_dummy_values()
    saved = saver.sharded_state_dict({}, metadata=DP_RESHARDABLE)
    request = optimizer.sharded_state_dict({}, is_loading=True, metadata=DP_RESHARDABLE)
    with torch.no_grad():  # upstream copies into views of fp32 parameters
        optimizer.load_state_dict(_dist_checkpoint_load(saved, request))
    return model, optimizer


def _continue_both(pairs, seeds):
    """Train each (model, optimizer) pair on the same gradients."""
    for seed in seeds:
        for model, optimizer in pairs:
            train_step(optimizer, model, seed)


def _assert_same_run(first, second):
    """Parameters, main values and every state tensor (step included) are equal."""
    (model_a, optimizer_a), (model_b, optimizer_b) = first, second
    for param_a, param_b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(param_a, param_b)
        if param_a in optimizer_a.model_param_gbuf_map:
            state_a = optimizer_a._get_main_param_and_optimizer_states(param_a)
            state_b = optimizer_b._get_main_param_and_optimizer_states(param_b)
            assert set(state_a) == set(state_b)
            for key, value in state_a.items():
                assert torch.equal(value, state_b[key]), key


@needs_upstream
@pytest.mark.usefixtures("cpu_as_cuda")
@pytest.mark.parametrize("is_loading", [False, True])
def test_dp_reshardable_checkpoint_equals_upstreams(is_loading):
    """Same keys, placements, data and non-persistent entries (torch AdamW's step among them)
    as upstream's, for saving and for loading."""
    (_, mine), (_, theirs) = _trained(fork, 3), _trained(UPSTREAM, 3)
    mine_entries = _checkpoint_entries(
        mine.sharded_state_dict({}, is_loading, None, DP_RESHARDABLE)
    )
    their_entries = _checkpoint_entries(
        theirs.sharded_state_dict({}, is_loading, None, DP_RESHARDABLE)
    )
    assert mine_entries == their_entries
    assert any(path[-1] == "step" for path in mine_entries)


@needs_upstream
@pytest.mark.usefixtures("cpu_as_cuda")
@pytest.mark.parametrize("saver_module", ["fork", "upstream"])
def test_dp_reshardable_resume_in_the_fork_is_exact(saver_module):
    """Either side's checkpoint, loaded by the fork: two more steps equal the uninterrupted
    run, step counters included."""
    saver_model, saver = _trained(fork if saver_module == "fork" else UPSTREAM, 3)
    resumed = _resume_from_dp_reshardable(saver, saver_model, fork)
    assert resumed[1].inner_state.step() == 3
    _continue_both([(saver_model, saver), resumed], range(3, 5))
    _assert_same_run((saver_model, saver), resumed)


@needs_upstream
@pytest.mark.usefixtures("cpu_as_cuda")
def test_upstream_resumes_a_fork_dp_reshardable_checkpoint_as_its_own():
    """Upstream cannot tell a checkpoint the fork wrote from one it wrote itself."""
    (mine_model, mine), (their_model, theirs) = _trained(fork, 3), _trained(UPSTREAM, 3)
    from_fork = _resume_from_dp_reshardable(mine, mine_model, UPSTREAM)
    from_upstream = _resume_from_dp_reshardable(theirs, their_model, UPSTREAM)
    _continue_both([from_fork, from_upstream], range(3, 5))
    _assert_same_run(from_fork, from_upstream)


@needs_upstream
@pytest.mark.usefixtures("cpu_as_cuda")
@pytest.mark.xfail(
    reason="0.19.2 copies the step its dp_reshardable load request holds (the loading "
    "optimizer's own, 1 after priming) over the step load_state_dict restored",
    strict=True,
)
def test_upstream_resumes_a_fork_dp_reshardable_checkpoint_exactly():
    """Fork writes, upstream loads, two steps: not equal to the uninterrupted run, for a reason
    that is upstream's own (its own checkpoint fails the same way, see the test above)."""
    saver_model, saver = _trained(fork, 3)
    resumed = _resume_from_dp_reshardable(saver, saver_model, UPSTREAM)
    _continue_both([(saver_model, saver), resumed], range(3, 5))
    _assert_same_run((saver_model, saver), resumed)
