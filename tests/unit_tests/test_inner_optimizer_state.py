# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Tests for the distributed optimizer's contract with its inner optimizer (CPU)."""

import pytest
import torch

from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    import optimizer_table
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests import optimizer_table

FusedAdamDouble = optimizer_table.sibling("optimizer_doubles").FusedAdamDouble

# The contract exists only in the fork; with the overlay off there is nothing to test.
_contract = pytest.importorskip("megatron.core.optimizer.inner_optimizer_state")
_creation = pytest.importorskip("megatron.core.optimizer.optimizer_state_creation")
InnerOptimizerState = _contract.InnerOptimizerState
materialise_by_null_step = _creation.materialise_by_null_step

SHAPES = [(6, 4), (5,), (3, 3)]


class CountsStepInGroups(torch.optim.SGD):
    """SGD with momentum that also counts its steps in each param group, the way TE/Apex
    FusedAdam keep their Adam step; its per-parameter state is ``momentum_buffer``."""

    def __init__(self, params, lr=1e-2, weight_decay=0.0):
        super().__init__(params, lr=lr, momentum=0.9, weight_decay=weight_decay)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if any(p.grad is not None for p in group["params"]):
                group["step"] = group.get("step", 0) + 1
        return super().step(closure)


class ScaledStateDouble(CountsStepInGroups):
    """Precision-aware double: keeps bf16 moments and an fp32 master, exposed unscaled in
    fp32 through ``get_unscaled_state`` and set through ``set_scaled_state``."""

    def get_unscaled_state(self, param, name):  # pylint: disable=missing-function-docstring
        state = self.state[param]
        if name == "master_param" and name not in state:
            state[name] = param.detach().float().clone()
        return state[name].float()

    def set_scaled_state(self, param, name, value):  # pylint: disable=missing-function-docstring
        assert value.dtype == torch.float32
        dtype = torch.float32 if name == "master_param" else torch.bfloat16
        state = self.state[param]
        if name not in state:
            state[name] = torch.empty_like(value, dtype=dtype)
        state[name].copy_(value)


def make(optimizer_cls, seed=0, **kwargs):
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in SHAPES]
    groups = [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.1}]
    return params, optimizer_cls(groups, **kwargs)


def assert_trains_alike(params, optimizer, reference_params, reference, seed):
    """Three steps on the same gradients leave both sets of parameters equal."""
    train(params, optimizer, 3, seed=seed)
    train(reference_params, reference, 3, seed=seed)
    for param, reference_param in zip(params, reference_params):
        assert torch.equal(param, reference_param)


def train(params, optimizer, steps, seed):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator).to(param)
        optimizer.step()
        optimizer.zero_grad()


ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def hybrid(param_update_in_fp32):
    """An HDO offloading half its parameters; without fp32 updates its fp32 host copies keep
    no ``master_param`` entry, so only its parameter map says where a value lives."""

    def build(groups, **kwargs):
        return HybridDeviceOptimizer(
            groups,
            offload_fraction=0.5,
            cpu_optimizer_cls=torch.optim.AdamW,
            gpu_optimizer_cls=torch.optim.AdamW,
            param_update_in_fp32=param_update_in_fp32,
            lr=1e-2,
            **kwargs,
        )

    return build


OPTIMIZERS = {
    "torch_adamw": lambda groups, **kw: torch.optim.AdamW(groups, lr=1e-2, **kw),
    "group_step": CountsStepInGroups,
    "hdo": hybrid(param_update_in_fp32=True),
    "hdo_without_fp32_update": hybrid(param_update_in_fp32=False),
}
STATE_KEYS = {name: ADAM_KEYS for name in OPTIMIZERS}
STATE_KEYS["group_step"] = ("momentum_buffer",)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_materialise_changes_nothing_and_trains_like_a_fresh_optimizer(name):
    params, optimizer = make(OPTIMIZERS[name])
    reference_params, reference = make(OPTIMIZERS[name])
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    access = InnerOptimizerState(optimizer, STATE_KEYS[name])
    assert not access.is_materialised()
    access.materialise()
    assert access.is_materialised()
    for param, reference_param in zip(params, reference_params):
        assert torch.equal(param, reference_param)
        assert not access.read(param)[STATE_KEYS[name][0]].any()
    assert [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] == groups
    assert access.step() in (None, 0)
    assert_trains_alike(params, optimizer, reference_params, reference, seed=1)


def test_null_step_leaves_existing_state_alone():
    params, optimizer = make(OPTIMIZERS["torch_adamw"])
    params[0].grad = torch.ones_like(params[0])
    optimizer.step()
    before = {k: v.clone() for k, v in optimizer.state[params[0]].items()}
    value = params[0].detach().clone()
    materialise_by_null_step(optimizer)
    for key, tensor in before.items():
        assert torch.equal(optimizer.state[params[0]][key], tensor)
    assert torch.equal(params[0], value)
    assert all(key in optimizer.state[p] for p in params for key in ("exp_avg", "step"))


class RecordsGradients(torch.optim.AdamW):
    """torch AdamW that records, at each step, how many elements of its parameters have a
    gradient (what a null step allocates besides the state)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, lr=1e-2, **kwargs)
        self.elements_with_grads = []

    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        self.elements_with_grads.append(sum(p.numel() for p in params if p.grad is not None))
        return super().step(closure)


class CreatesStateWithoutGradients(RecordsGradients):
    """Creates the state of every parameter it visits, with a gradient or not, as TE
    FusedAdam's step does."""

    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if not self.state[param]:
                    self.state[param].update(
                        step=torch.tensor(0.0),
                        exp_avg=torch.zeros_like(param),
                        exp_avg_sq=torch.zeros_like(param),
                    )
        return super().step(closure)


def test_null_step_needs_no_gradients_where_the_step_creates_state_without_them():
    params, optimizer = make(CreatesStateWithoutGradients)
    materialise_by_null_step(optimizer)
    assert optimizer.elements_with_grads == [0]
    assert all(optimizer.state[p]["exp_avg"].shape == p.shape for p in params)
    assert all(p.grad is None for p in params)


def test_null_step_gives_gradients_to_a_bounded_share_of_the_elements_at_a_time():
    generator = torch.Generator().manual_seed(3)
    sizes = [1000, 7, 300, 64, 2048, 5, 999, 128] * 8
    params = [torch.nn.Parameter(torch.randn(n, generator=generator)) for n in sizes]
    optimizer = RecordsGradients([{"params": params[::2]}, {"params": params[1::2]}])
    reference_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    reference = torch.optim.AdamW(
        [{"params": reference_params[::2]}, {"params": reference_params[1::2]}], lr=1e-2
    )
    params[1].grad = torch.ones_like(params[1])  # a gradient the null step must put back
    kept_grad = params[1].grad

    materialise_by_null_step(optimizer)

    budget = max(-(-sum(sizes) // _creation.NULL_STEP_SHARES), max(sizes))
    assert optimizer.elements_with_grads[0] == 0
    assert len(optimizer.elements_with_grads) > 2
    assert 0 < max(optimizer.elements_with_grads) <= budget
    assert params[1].grad is kept_grad and all(p.grad is None for p in params if p is not params[1])
    for param in params:
        state = optimizer.state[param]
        assert torch.equal(state["step"], torch.tensor(0.0))
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    params[1].grad = None
    assert_trains_alike(params, optimizer, reference_params, reference, seed=4)


ADAM_OPTIONS = [
    (torch.optim.AdamW, {}),
    (torch.optim.AdamW, {"amsgrad": True, "foreach": False}),
    (torch.optim.AdamW, {"fused": True}),
    (torch.optim.AdamW, {"foreach": True, "maximize": True, "dtype": torch.bfloat16}),
    (torch.optim.Adam, {"weight_decay": 0.01}),
    (torch.optim.Adam, {"amsgrad": True, "fused": True}),
    (torch.optim.Adam, {"foreach": True, "dtype": torch.float64}),
]
if torch.cuda.is_available():
    ADAM_OPTIONS += [
        (torch.optim.AdamW, {"fused": True, "device": "cuda"}),
        (torch.optim.Adam, {"capturable": True, "device": "cuda"}),
    ]


def _adam_id(entry):
    cls, options = entry
    return cls.__name__ + "".join(f"-{key}={value}" for key, value in options.items())


@pytest.mark.parametrize("entry", ADAM_OPTIONS, ids=[_adam_id(e) for e in ADAM_OPTIONS])
def test_torch_adam_state_is_created_without_gradients_as_its_null_step_creates_it(
    entry, monkeypatch
):
    """torch's Adam and AdamW get their state allocated directly (no gradient of any
    parameter's size), and it is the state the null step gives: same keys, dtypes, devices,
    shapes and values, and the same training afterwards."""
    cls, options = entry
    options = dict(options)
    device, dtype = options.pop("device", "cpu"), options.pop("dtype", torch.float32)

    def build():
        generator = torch.Generator().manual_seed(0)
        params = [
            torch.nn.Parameter(torch.randn(s, generator=generator).to(device, dtype))
            for s in SHAPES
        ]
        groups = [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.1}]
        return params, cls(groups, lr=1e-2, **options)

    params, optimizer = build()
    grads_seen = []
    real_step = optimizer.step

    def recording_step(*args, **kwargs):
        grads_seen.extend(p.grad is not None for g in optimizer.param_groups for p in g["params"])
        return real_step(*args, **kwargs)

    optimizer.step = recording_step
    materialise_by_null_step(optimizer)
    assert grads_seen and not any(grads_seen)
    del optimizer.step

    reference_params, reference = build()
    monkeypatch.setattr(_creation, "STATE_BY_EXAMPLE", ())
    materialise_by_null_step(reference)
    monkeypatch.undo()
    for param, reference_param in zip(params, reference_params):
        state, expected = optimizer.state[param], reference.state[reference_param]
        assert sorted(state) == sorted(expected)
        for key, value in expected.items():
            assert (state[key].dtype, state[key].device) == (value.dtype, value.device), key
            assert state[key].shape == value.shape and torch.equal(state[key], value), key
        assert torch.equal(param, reference_param)
    assert optimizer.state[params[0]]["step"] is not optimizer.state[params[1]]["step"]
    assert_trains_alike(params, optimizer, reference_params, reference, seed=2)


def test_fp16_parameters_are_left_alone_when_their_adam_state_is_created():
    """A null step of an fp16 parameter divides 0 by eps, which underflows to 0 in fp16: the
    parameter would become NaN. Creating the state directly takes no step."""
    params = [torch.nn.Parameter(torch.randn(s).half()) for s in SHAPES]
    before = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    materialise_by_null_step(optimizer)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(optimizer.state[p]["exp_avg"].dtype == torch.float16 for p in params)


def test_settings_that_build_no_example_fall_back_to_the_null_step(monkeypatch):
    params, optimizer = make(torch.optim.AdamW, lr=1e-2)
    reference_params, reference = make(torch.optim.AdamW, lr=1e-2)

    def refuses(*_, **__):
        raise ValueError("these settings build no optimizer")

    monkeypatch.setattr(torch.optim.AdamW, "__init__", refuses)
    materialise_by_null_step(optimizer)
    monkeypatch.undo()
    monkeypatch.setattr(_creation, "STATE_BY_EXAMPLE", ())
    materialise_by_null_step(reference)
    for param, reference_param in zip(params, reference_params):
        for key, value in reference.state[reference_param].items():
            assert torch.equal(optimizer.state[param][key], value), key
    assert_trains_alike(params, optimizer, reference_params, reference, seed=3)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("restore_model", [True, False], ids=["with_model", "state_only"])
def test_write_restores_a_checkpoint_in_place_and_resumes_exactly(name, restore_model):
    """``state_only``: the distributed optimizer's main params come from this state alone,
    so the value must reach the tensor the optimizer steps (an offloaded host copy)."""
    params, optimizer = make(OPTIMIZERS[name])
    source = InnerOptimizerState(optimizer, STATE_KEYS[name])
    train(params, optimizer, 3, seed=1)
    saved = {
        i: {k: v.detach().clone() for k, v in source.read(p).items()} for i, p in enumerate(params)
    }
    saved_step = source.step()
    train(params, optimizer, 2, seed=2)

    resumed_params, resumed = make(OPTIMIZERS[name], seed=5)
    target = InnerOptimizerState(resumed, STATE_KEYS[name])
    target.materialise()
    live = {
        i: {k: v.data_ptr() for k, v in target.read(p).items()}
        for i, p in enumerate(resumed_params)
    }
    for index, param in enumerate(resumed_params):
        if restore_model:
            with torch.no_grad():
                param.copy_(saved[index]["param"])  # the model checkpoint
        target.write(param, {**saved[index], "step": torch.tensor(99.0)})
    target.set_step(saved_step)
    target.finish_load()
    for index, param in enumerate(resumed_params):
        assert {k: v.data_ptr() for k, v in target.read(param).items()} == live[index]
        # The public parameter holds the loaded value before any step: the first forward
        # pass after the load reads it.
        assert torch.equal(param, saved[index]["param"].to(param.dtype))
    train(resumed_params, resumed, 2, seed=2)
    for param, resumed_param in zip(params, resumed_params):
        assert torch.equal(param, resumed_param)


def test_state_without_a_step_entry_loads_without_a_key_error():
    """Upstream's Adam init_state_fn creates moments but no ``step``: writing a checkpoint
    (which has no per-parameter step either) must not look for one."""
    params, optimizer = make(OPTIMIZERS["torch_adamw"])
    for param in params:
        optimizer.state[param]["exp_avg"] = torch.zeros_like(param)
        optimizer.state[param]["exp_avg_sq"] = torch.zeros_like(param)
    access = InnerOptimizerState(optimizer)
    for param in params:
        ones = torch.ones_like(param)
        access.write(param, {"param": ones, "exp_avg": ones, "exp_avg_sq": ones})
        assert torch.equal(optimizer.state[param]["exp_avg"], ones)


def test_a_missing_state_key_is_named():
    params, optimizer = make(OPTIMIZERS["torch_adamw"])
    access = InnerOptimizerState(optimizer)
    with pytest.raises(KeyError, match="exp_avg"):
        access.read(params[0])
    access.materialise()
    with pytest.raises(KeyError, match="exp_avg_sq"):
        access.write(params[0], {"param": params[0], "exp_avg": params[0]})


@pytest.mark.parametrize("name, per_param", [("torch_adamw", True), ("group_step", False)])
def test_step_is_read_and_restored_where_the_optimizer_keeps_it(name, per_param):
    params, optimizer = make(OPTIMIZERS[name])
    train(params, optimizer, 4, seed=1)
    access = InnerOptimizerState(optimizer, STATE_KEYS[name])
    assert access.step() == 4
    access.set_step(7)
    assert access.step() == 7
    if per_param:
        assert all(float(optimizer.state[p]["step"]) == 7.0 for p in params)
    else:
        assert [g["step"] for g in optimizer.param_groups] == [7, 7]


def test_lion_like_state_keys():
    params, optimizer = make(OPTIMIZERS["torch_adamw"])
    access = InnerOptimizerState(optimizer, state_keys=("exp_avg",))
    access.materialise()
    assert set(access.read(params[0])) == {"param", "exp_avg"}


def test_precision_aware_state_is_read_unscaled_and_written_through_the_setter():
    params, optimizer = make(ScaledStateDouble)
    access = InnerOptimizerState(optimizer, precision_aware=True)
    for param in params:
        # A different value per key (each exact in bf16), so a key written into another's
        # place shows.
        values = {
            key: torch.full(param.shape, value)
            for key, value in (("param", 0.5), ("exp_avg", 0.25), ("exp_avg_sq", 0.125))
        }
        access.write(param, values)
        state = optimizer.state[param]
        assert state["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(state["master_param"], values["param"])
        tensors = access.read(param)
        assert set(tensors) == set(values)
        assert all(t.dtype == torch.float32 for t in tensors.values())
        for key, value in values.items():
            assert torch.equal(tensors[key], value), key


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_retarget_keeps_the_optimizer_and_trains_the_new_groups_like_a_fresh_one(name):
    params, optimizer = make(OPTIMIZERS[name])
    shards = [torch.nn.Parameter(p.detach().flatten()[:2].clone()) for p in params]
    groups = [
        dict(g, params=shards[i : i + len(g["params"])])
        for i, g in zip((0, 2), optimizer.param_groups)
    ]
    InnerOptimizerState(optimizer, STATE_KEYS[name]).retarget(groups)
    assert [p for g in optimizer.param_groups for p in g["params"]] == shards
    assert [g.get("weight_decay") for g in optimizer.param_groups] == [
        g.get("weight_decay") for g in groups
    ]

    expected = [torch.nn.Parameter(s.detach().clone()) for s in shards]
    fresh = OPTIMIZERS[name](
        [{"params": expected[:2]}, {"params": expected[2:], "weight_decay": 0.1}]
    )
    assert_trains_alike(shards, optimizer, expected, fresh, seed=4)


def test_retarget_regroups_the_hybrid_optimizer_without_building_for_the_old_groups():
    params, optimizer = make(OPTIMIZERS["hdo"])
    shards = [torch.nn.Parameter(p.detach().flatten()[:2].clone()) for p in params]
    InnerOptimizerState(optimizer).retarget([{"params": shards, "lr": 1e-2}])
    assert set(optimizer.param_to_inner_param) == set(shards)


def test_empty_parameters_get_no_state_and_do_not_block_materialisation():
    params, optimizer = make(OPTIMIZERS["torch_adamw"])
    empty = torch.nn.Parameter(torch.empty(0))
    optimizer.add_param_group({"params": [empty]})
    access = InnerOptimizerState(optimizer)
    access.materialise()
    assert access.is_materialised()
    assert empty not in optimizer.state or not optimizer.state[empty]
    assert all(access.read(p)["exp_avg"].shape == p.shape for p in params)


def test_the_implementation_is_chosen_once_by_what_the_optimizer_offers():
    params = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))]
    plain = InnerOptimizerState(torch.optim.AdamW(params))
    scaled = InnerOptimizerState(ScaledStateDouble(params), precision_aware=True)
    unscaled = InnerOptimizerState(ScaledStateDouble(params), precision_aware=False)
    hybrid = InnerOptimizerState(
        HybridDeviceOptimizer(
            params, cpu_optimizer_cls=torch.optim.AdamW, gpu_optimizer_cls=torch.optim.AdamW, lr=0.1
        )
    )
    assert type(plain) is InnerOptimizerState and type(unscaled) is InnerOptimizerState
    assert type(scaled) is _contract.ScaledFusedAdamState and scaled.scaled
    assert type(hybrid) is _contract.HybridDeviceOptimizerState and hybrid.builds_own_state
    assert not plain.builds_own_state and not plain.keeps_copies and hybrid.keeps_copies
    # Saved groups list the parameters as running indices, without touching the state.
    assert [g["params"] for g in plain.saved_param_groups()] == [[0, 1]]
    assert [g["params"] for g in hybrid.saved_param_groups()] == [[0, 1]]
    assert plain.counts_steps_per_param() and hybrid.counts_steps_per_param()
    assert not InnerOptimizerState(CountsStepInGroups(params)).counts_steps_per_param()


def test_a_master_the_optimizer_cannot_take_is_refused_before_writing():
    """With ``store_param_remainders`` a bf16 parameter's master is kept as int16 low bits; a
    real fp32 master is refused by the check the plan runs, not half-way through the writes."""
    param = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    optimizer = ScaledStateDouble([param])
    optimizer.store_param_remainders = True
    access = InnerOptimizerState(optimizer, precision_aware=True)
    moments = {key: torch.zeros(4) for key in ("exp_avg", "exp_avg_sq")}
    with pytest.raises(ValueError, match="not int16 remainders"):
        access.check_write(param, {"param": torch.full((4,), 0.25), **moments})
    access.check_write(param, {"param": torch.tensor([1.0, -3.0, 0.0, 7.0]), **moments})
    with pytest.raises(KeyError, match="exp_avg_sq"):
        access.check_write(param, {"param": torch.zeros(4), "exp_avg": torch.zeros(4)})


@pytest.mark.parametrize(
    "options",
    [
        dict(master_weights=True),
        dict(master_weights=True, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16),
        dict(master_weights=True, store_param_remainders=True),
        dict(master_weights=False, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    ],
    ids=["fp32_master", "fp16_moments", "remainders", "no_master"],
)
def test_precision_aware_state_is_allocated_as_the_first_step_would_make_it(options):
    """The precision-aware kind creates the state with the optimizer's allocator and copies
    the master in place (no step, no fp32 clone of the parameter): the state and scales are
    those the optimizer's own first-step initialisation makes, bit for bit."""
    generator = torch.Generator().manual_seed(2)
    shapes = [(6, 4), (5,), (3, 3)]
    params = [torch.nn.Parameter(torch.randn(s, generator=generator).bfloat16()) for s in shapes]
    optimizer = FusedAdamDouble([{"params": params}], lr=1e-2, **options)
    reference = FusedAdamDouble([{"params": params}], lr=1e-2, **options)
    calls = []
    for name in ("step", "initialize_state"):
        original = getattr(optimizer, name)
        setattr(
            optimizer,
            name,
            lambda *a, _o=original, _n=name, **k: (calls.append(_n), _o(*a, **k))[1],
        )
    access = InnerOptimizerState(optimizer, ADAM_KEYS, precision_aware=True)
    access.materialise()
    assert access.is_materialised() and not calls
    for param in params:
        reference.initialize_state(
            param, reference.store_param_remainders and param.dtype == torch.bfloat16
        )
        assert optimizer.state[param].keys() == reference.state[param].keys()
        for key, value in optimizer.state[param].items():
            assert value.dtype == reference.state[param][key].dtype
            assert torch.equal(value, reference.state[param][key]), key
        assert optimizer._scales.get(param, {}).keys() == reference._scales.get(param, {}).keys()
    assert "step" not in optimizer.param_groups[0]


@pytest.mark.parametrize("chunk", [None, 5], ids=["one_pass", "chunk_of_5"])
def test_fp16_moments_from_a_callers_host_tensors_are_scaled_as_the_optimizer_scales(
    chunk, monkeypatch
):
    """fp16 moments written from host fp32 tensors are scaled on the host: the same state and
    scales as the optimizer's ``set_scaled_state``, and the caller's tensors are not divided
    in place (they may be a plain parameter-state dict the caller keeps). With a chunk of 5
    elements every piece but the smallest goes through the staging buffer in several passes,
    the last one short."""
    if chunk is not None:
        monkeypatch.setattr(_contract, "HOST_SCALE_CHUNK", chunk)
    generator = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator).bfloat16()) for s in SHAPES]
    options = dict(master_weights=True, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16)
    optimizer = FusedAdamDouble([{"params": params}], lr=1e-2, **options)
    reference = FusedAdamDouble([{"params": params}], lr=1e-2, **options)
    access = InnerOptimizerState(optimizer, ADAM_KEYS, precision_aware=True)
    access.materialise()
    for param in params:
        reference.initialize_state(param, False)
        saved = {
            "param": torch.randn(param.shape, generator=generator),
            "exp_avg": torch.randn(param.shape, generator=generator) * 1e-3,
            "exp_avg_sq": torch.rand(param.shape, generator=generator) * 1e-6,
        }
        pristine = {k: v.clone() for k, v in saved.items()}
        access.write(param, saved)
        assert all(torch.equal(saved[k], pristine[k]) for k in saved)
        for key in ADAM_KEYS:
            reference.set_scaled_state(param, key, pristine[key].clone())
            assert torch.equal(optimizer.state[param][key], reference.state[param][key])
            assert torch.equal(optimizer._scales[param][key], reference._scales[param][key])
