# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Tests for loading TE FusedAdam state without a second copy of the moments.

Transformer Engine is absent here, so ``FusedAdamDouble`` (``optimizer_doubles``) stands in for its FusedAdam and is
registered by monkeypatching ``fused_adam_state_load.fused_adam_classes``. Allocations are
counted by wrapping the double's ``_initialize_state``, and reuse is checked by identity and
``data_ptr``, since there is no accelerator memory counter on the CPU.
"""

import io
import logging
import os

import pytest
import torch

if os.environ.get("MEGATRON_OPTIMIZER_FORK", "").strip().lower() in ("0", "off", "false", "no"):
    pytest.skip("the module under test exists only in the fork", allow_module_level=True)

# pylint: disable=wrong-import-position
from megatron.core.optimizer import fused_adam_state_load as fsl
from megatron.core.optimizer.inner_optimizer_state import InnerOptimizerState

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    import optimizer_table
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests import optimizer_table

FusedAdamDouble = optimizer_table.sibling("optimizer_doubles").FusedAdamDouble

SHAPES = [(4, 3), (5,), (2, 2, 2)]


# name: (parameter dtype, optimizer kwargs, dtype of each incoming state, expected path,
#        names whose incoming tensor becomes the state as it is)
MODES = {
    "fp32": (torch.float32, {}, {}, "adopt", ("exp_avg", "exp_avg_sq")),
    "bf16_moments": (
        torch.bfloat16,
        dict(master_weights=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
        dict(exp_avg=torch.bfloat16, exp_avg_sq=torch.bfloat16),
        "materialise",
        ("exp_avg", "exp_avg_sq", "master_param"),
    ),
    "fp16_moments": (
        torch.bfloat16,
        dict(master_weights=True, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16),
        {},
        "materialise",
        ("master_param",),
    ),
    "fp32_master": (
        torch.bfloat16,
        dict(master_weights=True),
        {},
        "materialise",
        ("exp_avg", "exp_avg_sq", "master_param"),
    ),
    "remainders": (
        torch.bfloat16,
        dict(master_weights=True, store_param_remainders=True),
        {},
        "materialise",
        ("exp_avg", "exp_avg_sq", "master_param"),
    ),
    "fp16_master": (
        torch.float16,
        dict(master_weights=True, master_weight_dtype=torch.float16),
        {},
        "materialise",
        ("exp_avg", "exp_avg_sq"),
    ),
}


@pytest.fixture(autouse=True)
def register_double(monkeypatch):
    """Makes the loader treat FusedAdamDouble as TE's FusedAdam."""
    monkeypatch.setattr(fsl, "fused_adam_classes", lambda: (FusedAdamDouble,))


@pytest.fixture
def allocations(monkeypatch):
    """Records (state name, dtype) of every state the double allocates."""
    calls = []
    original = FusedAdamDouble._initialize_state

    def counting(self, param, state_name, zero_buffer, store_param_remainders=False):
        original(self, param, state_name, zero_buffer, store_param_remainders)
        calls.append((state_name, self.state[param][state_name].dtype))

    monkeypatch.setattr(FusedAdamDouble, "_initialize_state", counting)
    return calls


@pytest.fixture
def own_loads(monkeypatch):
    """Records every call of the double's own load_state_dict."""
    calls = []
    original = FusedAdamDouble.load_state_dict

    def recording(self, state_dict):
        calls.append(self)
        original(self, state_dict)

    monkeypatch.setattr(FusedAdamDouble, "load_state_dict", recording)
    return calls


def make_params(dtype, seed=0, shapes=SHAPES):
    """Parameters with deterministic values."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype)) for shape in shapes]


def clone_params(params):
    """Independent copies of ``params``."""
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def make_optimizer(params, kwargs, groups=1):
    """A FusedAdamDouble over ``params`` split into ``groups`` groups with distinct lrs."""
    if groups == 1:
        return FusedAdamDouble(params, lr=1e-2, weight_decay=0.1, **kwargs)
    split = [{"params": params[i::groups], "lr": 1e-2 * (i + 1)} for i in range(groups)]
    return FusedAdamDouble(split, lr=1e-2, weight_decay=0.1, **kwargs)


def train(optimizer, params, steps, seed):
    """Takes ``steps`` steps with deterministic gradients."""
    for index in range(steps):
        gen = torch.Generator().manual_seed(1000 * seed + index)
        for param in params:
            param.grad = torch.randn(param.shape, generator=gen).to(param.dtype)
        optimizer.step()


def checkpoint(optimizer, incoming_dtypes=None):
    """A saved-and-reloaded copy of the state dict, states cast as the mode's scaffold has them."""
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    for entry in saved["state"].values():
        for name, dtype in (incoming_dtypes or {}).items():
            entry[name] = entry[name].to(dtype)
    return saved


def copy_state_dict(state_dict):
    """A deep copy whose tensors share nothing with the original."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def trained_setup(mode, steps=3, seed=0):
    """Runs a mode's optimizer for some steps; returns (params, optimizer, checkpoint)."""
    dtype, kwargs, incoming_dtypes, _, _ = MODES[mode]
    params = make_params(dtype, seed)
    optimizer = make_optimizer(params, kwargs)
    train(optimizer, params, steps, seed)
    return params, optimizer, checkpoint(optimizer, incoming_dtypes)


def fresh(mode, params):
    """A new optimizer of a mode over copies of ``params``."""
    copies = clone_params(params)
    return copies, make_optimizer(copies, MODES[mode][1])


def synthetic_state_dict(optimizer, seed=5, names=("exp_avg", "exp_avg_sq"), dtype=None):
    """A state dict for ``optimizer`` with random states and a changed lr and step."""
    gen = torch.Generator().manual_seed(seed)
    groups = optimizer.state_dict()["param_groups"]
    for group in groups:
        group["lr"] = 0.5
        group["step"] = 7
    state = {}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for key, param in enumerate(params):
        state[key] = {
            name: torch.rand(param.shape, generator=gen).to(dtype or torch.float32)
            for name in names
        }
    return {"state": state, "param_groups": groups}


def record(optimizer):
    """What the optimizer holds now: objects to compare by identity and values to compare."""
    return {
        "state": optimizer.state,
        "entries": {
            p: (d, dict(d), {k: v.clone() for k, v in d.items()})
            for p, d in optimizer.state.items()
        },
        "groups": optimizer.param_groups,
        "group_entries": [(g, dict(g)) for g in optimizer.param_groups],
        "scales": optimizer._scales,
        "scale_entries": {
            p: (d, dict(d), {k: v.clone() for k, v in d.items()})
            for p, d in optimizer._scales.items()
        },
    }


def _assert_same_entries(mapping, recorded):
    """Asserts a per-parameter mapping holds the very dicts and tensors ``record`` saw."""
    assert set(mapping) == set(recorded)
    for param, (entry, items, values) in recorded.items():
        assert mapping[param] is entry
        assert entry.keys() == items.keys()
        for name, tensor in items.items():
            assert entry[name] is tensor
            assert torch.equal(tensor, values[name])


def assert_unchanged(optimizer, before):
    """Asserts the optimizer holds exactly what ``record`` saw."""
    assert optimizer.state is before["state"]
    _assert_same_entries(optimizer.state, before["entries"])
    assert optimizer.param_groups is before["groups"]
    assert len(optimizer.param_groups) == len(before["group_entries"])
    for group, (old_group, items) in zip(optimizer.param_groups, before["group_entries"]):
        assert group is old_group
        assert group.keys() == items.keys()
        assert all(group[key] is items[key] for key in items)
    assert optimizer._scales is before["scales"]
    _assert_same_entries(optimizer._scales, before["scale_entries"])


def all_params(optimizer):
    """The optimizer's parameters in order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def test_double_own_loader_allocates_a_second_copy(allocations):
    """The double reproduces the problem: every state is allocated again on load."""
    params, _, saved = trained_setup("fp32")
    _, optimizer = fresh("fp32", params)
    allocations.clear()
    optimizer.load_state_dict(saved)
    assert len(allocations) == 2 * len(SHAPES)
    for key, param in enumerate(all_params(optimizer)):
        for name in ("exp_avg", "exp_avg_sq"):
            assert optimizer.state[param][name].data_ptr() != saved["state"][key][name].data_ptr()
            assert torch.equal(optimizer.state[param][name], saved["state"][key][name])


def test_adopt_reuses_incoming_tensors(allocations, own_loads):
    """fp32 moments become the state as they are: same objects, no allocation, no copy."""
    params, _, saved = trained_setup("fp32")
    _, optimizer = fresh("fp32", params)
    own_params_list = optimizer.param_groups[0]["params"]
    ptrs = {k: {n: t.data_ptr() for n, t in e.items()} for k, e in saved["state"].items()}
    allocations.clear()

    plan = fsl.load_fused_adam_state_dict(optimizer, saved)

    assert plan.path == "adopt"
    assert allocations == []
    assert own_loads == []
    for key, param in enumerate(all_params(optimizer)):
        state = optimizer.state[param]
        assert set(state) == {"exp_avg", "exp_avg_sq"}
        for name in ("exp_avg", "exp_avg_sq"):
            assert state[name] is saved["state"][key][name]
            assert state[name].data_ptr() == ptrs[key][name]
    group = optimizer.param_groups[0]
    assert group["params"] is own_params_list
    assert group["step"] == 3
    assert group["lr"] == saved["param_groups"][0]["lr"]


def test_adopt_takes_hyperparameters_from_the_state_dict():
    """Group hyperparameters and the step come from the state dict, params stay the optimizer's."""
    params = make_params(torch.float32)
    optimizer = make_optimizer(params, {}, groups=2)
    incoming = synthetic_state_dict(optimizer)
    incoming["param_groups"][1]["weight_decay"] = 0.25
    incoming["param_groups"][0]["schedule"] = [1, 2]
    own = [group["params"] for group in optimizer.param_groups]

    assert fsl.load_fused_adam_state_dict(optimizer, incoming).path == "adopt"

    for group, params_list in zip(optimizer.param_groups, own):
        assert group["params"] is params_list
        assert group["lr"] == 0.5
        assert group["step"] == 7
    assert optimizer.param_groups[1]["weight_decay"] == 0.25
    assert optimizer.param_groups[0]["weight_decay"] == 0.1
    # The saved groups are deep-copied: changing them later changes nothing loaded.
    incoming["param_groups"][0]["lr"] = 9.0
    incoming["param_groups"][0]["schedule"].append(3)
    assert optimizer.param_groups[0]["lr"] == 0.5
    assert optimizer.param_groups[0]["schedule"] == [1, 2]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_steps_after_load_match_own_loader_exactly(mode, own_loads):
    """After either load, the same steps give torch.equal parameters and states."""
    params, _, saved = trained_setup(mode)
    ours_params, ours = fresh(mode, params)
    theirs_params, theirs = fresh(mode, params)

    plan = fsl.load_fused_adam_state_dict(ours, copy_state_dict(saved))
    theirs.load_state_dict(copy_state_dict(saved))

    assert plan.path == MODES[mode][3]
    assert own_loads == [theirs]
    train(ours, ours_params, 4, seed=9)
    train(theirs, theirs_params, 4, seed=9)
    for mine, other in zip(ours_params, theirs_params):
        assert torch.equal(mine, other)
    for mine, other in zip(all_params(ours), all_params(theirs)):
        assert ours.state[mine].keys() == theirs.state[other].keys()
        for name in ours.state[mine]:
            assert torch.equal(ours.state[mine][name], theirs.state[other][name])
    assert [g["step"] for g in ours.param_groups] == [7]


@pytest.mark.parametrize("mode", ["fp32", "bf16_moments", "fp32_master", "remainders"])
def test_resume_matches_uninterrupted_run(mode):
    """Where the checkpoint holds the exact state, resuming equals never stopping."""
    dtype, kwargs, incoming_dtypes, _, _ = MODES[mode]
    params = make_params(dtype)
    run = make_optimizer(params, kwargs)
    train(run, params, 3, seed=0)
    saved = checkpoint(run, incoming_dtypes)
    resumed_params = clone_params(params)
    resumed = make_optimizer(resumed_params, kwargs)

    fsl.load_fused_adam_state_dict(resumed, saved)

    train(run, params, 3, seed=4)
    train(resumed, resumed_params, 3, seed=4)
    for original, again in zip(params, resumed_params):
        assert torch.equal(original, again)


def test_parameter_state_with_remainders_round_trips_through_the_inner_state_contract():
    """Megatron's parameter-state path reads a bf16 parameter's master as FusedAdam keeps it
    under ``store_param_remainders`` (int16, as upstream 0.19.2 saves it) and writes it back
    the same way; resuming from what it wrote equals never stopping. Remainders widened to fp32
    (as the fp32 gather buffers of the legacy formats hold them) go back exactly; a real fp32
    master for an optimizer that keeps remainders is refused by name."""
    _, kwargs, _, _, _ = MODES["remainders"]
    params = make_params(torch.bfloat16)
    run = make_optimizer(params, kwargs)
    train(run, params, 3, seed=0)
    source = InnerOptimizerState(run, precision_aware=True)
    saved = [{k: v.clone() for k, v in source.read(p).items()} for p in params]
    assert {t["param"].dtype for t in saved} == {torch.int16}

    resumed_params = clone_params(params)
    resumed = make_optimizer(resumed_params, kwargs)
    resumed.load_state_dict(run.state_dict())  # groups and step, as the common state dict
    target = InnerOptimizerState(resumed, precision_aware=True)
    for param, tensors in zip(resumed_params, saved):
        target.write(param, tensors)
        assert torch.equal(resumed.state[param]["master_param"], tensors["param"])
    train(run, params, 3, seed=4)
    train(resumed, resumed_params, 3, seed=4)
    for original, again in zip(params, resumed_params):
        assert torch.equal(original, again)

    # The legacy and dp_zero formats gather states into fp32 buffers: remainders arrive as
    # fp32 integers and go back exactly; a real fp32 master is refused by name.
    widened = dict(saved[0], param=saved[0]["param"].float())
    target.write(resumed_params[0], widened)
    assert torch.equal(resumed.state[resumed_params[0]]["master_param"], saved[0]["param"])
    wrong = dict(saved[0], param=resumed_params[0].detach().float() + 0.25)
    with pytest.raises(ValueError, match="not int16 remainders.*store_param_remainders"):
        target.write(resumed_params[0], wrong)


@pytest.mark.parametrize("mode", sorted(m for m in MODES if MODES[m][3] == "materialise"))
def test_precision_modes_hold_one_tensor_per_state(mode, allocations, own_loads):
    """Fitting tensors are reused as they are; the others are allocated once, with scales."""
    params, _, saved = trained_setup(mode)
    _, ours = fresh(mode, params)
    _, theirs = fresh(mode, params)
    reused = MODES[mode][4]
    incoming = copy_state_dict(saved)
    ptrs = {k: {n: t.data_ptr() for n, t in e.items()} for k, e in incoming["state"].items()}
    allocations.clear()

    plan = fsl.load_fused_adam_state_dict(ours, incoming)

    assert plan.path == "materialise"
    assert own_loads == []
    names = {"exp_avg", "exp_avg_sq", "master_param"}
    allocated = sorted(names - set(reused))
    assert sorted(name for name, _ in allocations) == sorted(allocated * len(SHAPES))
    for key, param in enumerate(all_params(ours)):
        state = ours.state[param]
        assert set(state) == names
        for name in reused:
            assert state[name] is incoming["state"][key][name]
            assert state[name].data_ptr() == ptrs[key][name]
        for name in allocated:
            assert state[name].data_ptr() != ptrs[key][name]
            assert state[name].dtype == ours.name_to_dtype_map[name]

    allocations.clear()
    theirs.load_state_dict(copy_state_dict(saved))
    assert len(allocations) == 3 * len(SHAPES)
    for mine, other in zip(all_params(ours), all_params(theirs)):
        for name in names:
            assert ours.state[mine][name].dtype == theirs.state[other][name].dtype
            assert torch.equal(ours.state[mine][name], theirs.state[other][name])
        assert ours._scales.get(mine, {}).keys() == theirs._scales.get(other, {}).keys()
        for name, scale in ours._scales.get(mine, {}).items():
            assert torch.equal(scale, theirs._scales[other][name])


def test_fp16_materialise_leaves_caller_tensors_alone_unless_released():
    """Scaling divides in place: the caller's fp32 tensors are kept unless handed over."""
    params, _, saved = trained_setup("fp16_moments")
    _, kept = fresh("fp16_moments", params)
    incoming = copy_state_dict(saved)
    fsl.load_fused_adam_state_dict(kept, incoming)
    for key in saved["state"]:
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(incoming["state"][key][name], saved["state"][key][name])

    _, released = fresh("fp16_moments", params)
    handed_over = copy_state_dict(saved)
    fsl.load_fused_adam_state_dict(released, handed_over, release_incoming=True)
    assert handed_over["state"] == {}
    for mine, other in zip(all_params(kept), all_params(released)):
        for name in ("exp_avg", "exp_avg_sq", "master_param"):
            assert torch.equal(kept.state[mine][name], released.state[other][name])
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(kept._scales[mine][name], released._scales[other][name])


@pytest.mark.parametrize("what", ["incoming", "parameter"])
def test_non_contiguous_tensors_are_materialised_not_adopted(what, own_loads):
    """A non-contiguous tensor cannot become FusedAdam's state (its kernels take flat
    storage): the state is materialised once, contiguous, with the incoming values."""
    params = make_params(torch.float32)
    if what == "parameter":
        params[0] = torch.nn.Parameter(torch.randn(3, 4).t())  # shape (4, 3), transposed
    optimizer = make_optimizer(params, {})
    incoming = synthetic_state_dict(optimizer)
    if what == "incoming":
        value = incoming["state"][0]["exp_avg"]
        incoming["state"][0]["exp_avg"] = value.t().contiguous().t()
    expected = {k: {n: t.clone() for n, t in e.items()} for k, e in incoming["state"].items()}

    plan = fsl.load_fused_adam_state_dict(optimizer, incoming)

    assert plan.path == "materialise" and "contiguous" in plan.reason
    assert own_loads == []
    for key, param in enumerate(all_params(optimizer)):
        for name, value in expected[key].items():
            state = optimizer.state[param][name]
            assert state.is_contiguous() and torch.equal(state, value)
    if what == "incoming":
        assert optimizer.state[params[0]]["exp_avg"] is not incoming["state"][0]["exp_avg"]


def test_precision_aware_flag_turns_adopt_into_materialise(allocations):
    """With precision_aware, fp32 state is materialised, which still reuses every tensor."""
    params, _, saved = trained_setup("fp32")
    _, optimizer = fresh("fp32", params)
    allocations.clear()
    plan = fsl.load_fused_adam_state_dict(optimizer, saved, precision_aware=True)
    assert plan.path == "materialise"
    assert "precision-aware" in plan.reason
    assert allocations == []
    for key, param in enumerate(all_params(optimizer)):
        assert optimizer.state[param]["exp_avg"] is saved["state"][key]["exp_avg"]


def _fp8(optimizer):
    return FusedAdamDouble(all_params(optimizer), exp_avg_dtype=torch.uint8), {}


def _master_without_master_weights(optimizer):
    return optimizer, {"names": ("exp_avg", "exp_avg_sq", "master_param")}


def _unknown_key(optimizer):
    return optimizer, {"extra_key": 99}


def _broadcast_shape(optimizer):
    return optimizer, {"reshape": (3,)}


def _none_value(optimizer):
    return optimizer, {"none": "exp_avg_sq"}


def _aliased(optimizer):
    return optimizer, {"alias": True}


def _aliases_a_parameter(optimizer):
    return optimizer, {"alias_param": True}


def _missing_scales(optimizer):
    del optimizer._scales
    return optimizer, {}


def _hook(optimizer):
    optimizer.register_load_state_dict_post_hook(lambda opt: None)
    return optimizer, {}


class _OwnLoader(FusedAdamDouble):
    """A subclass with a load_state_dict of its own."""

    def load_state_dict(self, state_dict):
        """Delegates to the double's loader."""
        super().load_state_dict(state_dict)


def _overridden(optimizer):
    return _OwnLoader(all_params(optimizer)), {}


FALLBACKS = {
    "fp8": (_fp8, "fp8"),
    "unexpected_name": (_master_without_master_weights, "unexpected state keys"),
    "unknown_key": (_unknown_key, "no parameter group lists"),
    "shape": (_broadcast_shape, "shape mismatch"),
    "none_value": (_none_value, "not a plain tensor"),
    "aliased": (_aliased, "share memory"),
    "aliases_a_parameter": (_aliases_a_parameter, "share memory"),
    "missing_feature": (_missing_scales, "lacks _scales"),
    "hooks": (_hook, "hooks"),
    "overridden": (_overridden, "overrides"),
}


@pytest.mark.parametrize("case", sorted(FALLBACKS))
def test_fallback_modes_use_the_optimizers_own_loader(case, allocations, own_loads):
    """Each unsupported case names its reason and goes through the double's loader."""
    make, reason = FALLBACKS[case]
    optimizer, edits = make(make_optimizer(make_params(torch.float32), {}))
    incoming = synthetic_state_dict(optimizer, names=edits.get("names", ("exp_avg", "exp_avg_sq")))
    first = incoming["state"][0]
    if "extra_key" in edits:
        incoming["state"][edits["extra_key"]] = {"exp_avg": torch.zeros(1)}
    if "reshape" in edits:
        first["exp_avg"] = torch.full(edits["reshape"], 0.25)
    if "none" in edits:
        first[edits["none"]] = None
    if "alias" in edits:
        first["exp_avg_sq"] = first["exp_avg"]
    if "alias_param" in edits:
        # Adopted, the parameter's own storage would become its moment.
        first["exp_avg"] = all_params(optimizer)[0].detach()

    plan = fsl.load_fused_adam_state_dict(optimizer, incoming)

    assert plan.path == "fallback"
    assert reason in plan.reason
    assert own_loads == [optimizer]
    assert optimizer.param_groups[0]["step"] == 7
    assert len(allocations) > 0
    param = all_params(optimizer)[1]
    assert optimizer.state[param]["exp_avg"] is not incoming["state"][1]["exp_avg"]


@pytest.mark.parametrize(
    "flag, reason",
    [("is_hybrid", "HybridDeviceOptimizer"), ("is_fsdp", "FSDP"), ("is_stub", "stub")],
)
def test_caller_flags_force_the_fallback(flag, reason, own_loads):
    """The caller-level conditions override an otherwise adoptable load."""
    params, _, saved = trained_setup("fp32")
    _, optimizer = fresh("fp32", params)
    plan = fsl.load_fused_adam_state_dict(optimizer, saved, **{flag: True})
    assert plan == fsl.LoadPlan("fallback", plan.reason)
    assert reason in plan.reason
    assert own_loads == [optimizer]
    first = all_params(optimizer)[0]
    assert optimizer.state[first]["exp_avg"] is not saved["state"][0]["exp_avg"]


def test_dtensor_state_falls_back(tmp_path, own_loads):
    """DTensor states are left to the optimizer's own loader."""
    if fsl.DTensor is None or not torch.distributed.is_available():
        pytest.skip("torch without distributed support")
    if torch.distributed.is_initialized():
        pytest.skip("another test module holds the default process group (GPU runs)")
    # pylint: disable=import-outside-toplevel
    from torch.distributed.tensor import DeviceMesh, Replicate

    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        mesh = DeviceMesh("cpu", [0])
        optimizer = make_optimizer(make_params(torch.float32), {})
        incoming = synthetic_state_dict(optimizer)
        local = incoming["state"][0]["exp_avg"]
        incoming["state"][0]["exp_avg"] = fsl.DTensor.from_local(local, mesh, [Replicate()])
        plan = fsl.load_fused_adam_state_dict(optimizer, incoming)
    finally:
        torch.distributed.destroy_process_group()
    assert plan.path == "fallback"
    assert "DTensor" in plan.reason
    assert own_loads == [optimizer]
    assert torch.equal(optimizer.state[all_params(optimizer)[0]]["exp_avg"], local)


def test_not_a_fused_adam_is_left_to_its_class():
    """A torch optimizer is loaded by its own class, untouched by this module."""
    params = make_params(torch.float32)
    source = torch.optim.AdamW(params, lr=0.1)
    train(source, params, 2, seed=1)
    saved = copy_state_dict(source.state_dict())
    target = torch.optim.AdamW(clone_params(params), lr=0.3)
    plan = fsl.load_fused_adam_state_dict(target, saved)
    assert plan.path == "fallback"
    assert "not a Transformer Engine FusedAdam" in plan.reason
    for mine, other in zip(all_params(target), params):
        assert torch.equal(target.state[mine]["exp_avg"], source.state[other]["exp_avg"])
        assert torch.equal(target.state[mine]["step"], source.state[other]["step"])
    assert target.param_groups[0]["lr"] == 0.1


def test_without_transformer_engine_everything_falls_back(monkeypatch, own_loads):
    """With no FusedAdam class registered, even the double goes through its own loader."""
    monkeypatch.setattr(fsl, "fused_adam_classes", lambda: ())
    params, _, saved = trained_setup("fp32")
    _, optimizer = fresh("fp32", params)
    plan = fsl.load_fused_adam_state_dict(optimizer, saved)
    assert plan.path == "fallback"
    assert "not a Transformer Engine FusedAdam" in plan.reason
    assert own_loads == [optimizer]


def test_fused_adam_classes_reflects_transformer_engine(monkeypatch):
    """The real lookup finds TE's FusedAdam when TE imports, and nothing otherwise."""
    monkeypatch.undo()
    found = fsl.fused_adam_classes()
    try:
        # pylint: disable=import-outside-toplevel
        from transformer_engine.pytorch.optimizers import FusedAdam
    except (ImportError, OSError, RuntimeError):
        assert found == ()
    else:
        assert found == (FusedAdam,)


@pytest.mark.parametrize("change", ["group_count", "group_size"])
def test_mismatched_groups_raise_before_any_change(change, own_loads):
    """Groups that do not pair up raise a ValueError naming the counts; nothing changes."""
    params, optimizer, _ = trained_setup("fp16_moments")
    incoming = synthetic_state_dict(optimizer)
    if change == "group_count":
        incoming["param_groups"].append(dict(incoming["param_groups"][0], params=[]))
        message = "2 parameter groups, the optimizer has 1"
    else:
        incoming["param_groups"][0]["params"] = incoming["param_groups"][0]["params"][:-1]
        message = f"holds {len(params) - 1} parameters in the state dict and {len(params)}"
    before = record(optimizer)

    with pytest.raises(ValueError, match=message):
        fsl.load_fused_adam_state_dict(optimizer, incoming)

    assert own_loads == []
    assert_unchanged(optimizer, before)


def test_shape_mismatch_falls_back_and_restores_when_the_loader_raises(own_loads):
    """A state that cannot fit its parameter goes to the own loader, whose failure is undone."""
    _, optimizer, _ = trained_setup("fp32")
    incoming = synthetic_state_dict(optimizer)
    incoming["state"][2]["exp_avg"] = torch.zeros(7)
    assert "shape mismatch" in fsl.plan_fused_adam_load(optimizer, incoming).reason
    before = record(optimizer)

    with pytest.raises(RuntimeError):
        fsl.load_fused_adam_state_dict(optimizer, incoming)

    assert own_loads == [optimizer]
    assert_unchanged(optimizer, before)


def test_failing_own_loader_is_undone(monkeypatch):
    """A fallback loader that swaps state, groups and scales and then raises is undone."""
    _, optimizer, _ = trained_setup("fp16_moments")
    incoming = synthetic_state_dict(optimizer)
    before = record(optimizer)

    def swapping(self, state_dict):  # pylint: disable=unused-argument
        self.state = {}
        self.param_groups = []
        self._scales = {}
        raise RuntimeError("own loader failed")

    monkeypatch.setattr(FusedAdamDouble, "load_state_dict", swapping)
    with pytest.raises(RuntimeError, match="own loader failed"):
        fsl.load_fused_adam_state_dict(optimizer, incoming, is_hybrid=True)

    assert_unchanged(optimizer, before)


def test_failure_midway_restores_everything(monkeypatch):
    """set_scaled_state raising on its second call leaves the optimizer exactly as it was."""
    params, optimizer, _ = trained_setup("fp16_moments")
    _, _, other = trained_setup("fp16_moments", steps=2, seed=3)
    before = record(optimizer)
    calls = []
    original = FusedAdamDouble.set_scaled_state

    def failing(self, param, state_name, unscaled_state):
        calls.append(state_name)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        original(self, param, state_name, unscaled_state)

    monkeypatch.setattr(FusedAdamDouble, "set_scaled_state", failing)
    with pytest.raises(RuntimeError, match="injected failure"):
        fsl.load_fused_adam_state_dict(optimizer, other)
    monkeypatch.setattr(FusedAdamDouble, "set_scaled_state", original)

    assert len(calls) == 2
    assert_unchanged(optimizer, before)
    # The restored optimizer still works: a retry loads the other state.
    assert fsl.load_fused_adam_state_dict(optimizer, other).path == "materialise"
    assert optimizer.param_groups[0]["step"] == 2
    assert optimizer.state[params[0]]["exp_avg"].dtype == torch.float16


def test_allocator_cache_released_only_when_state_was_replaced(monkeypatch):
    """empty_cache runs once, and only when CUDA is up and old state tensors were dropped."""
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    params, optimizer, saved = trained_setup("fp32")

    _, fresh_optimizer = fresh("fp32", params)
    fsl.load_fused_adam_state_dict(fresh_optimizer, copy_state_dict(saved))
    assert emptied == []

    fsl.load_fused_adam_state_dict(optimizer, optimizer.state_dict())
    assert emptied == []

    fsl.load_fused_adam_state_dict(optimizer, copy_state_dict(saved))
    assert emptied == [True]

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    fsl.load_fused_adam_state_dict(optimizer, copy_state_dict(saved))
    assert emptied == [True]


def test_logs_the_path_once_per_call(caplog):
    """One log line per load names the path and, for the fallback, the reason."""
    params, _, saved = trained_setup("fp32")
    _, optimizer = fresh("fp32", params)
    with caplog.at_level(logging.INFO, logger=fsl.__name__):
        fsl.load_fused_adam_state_dict(optimizer, copy_state_dict(saved))
        fsl.load_fused_adam_state_dict(optimizer, copy_state_dict(saved), is_fsdp=True)
    messages = [r.getMessage() for r in caplog.records if r.name == fsl.__name__]
    assert len(messages) == 2
    assert "adopt" in messages[0]
    assert "fallback" in messages[1] and "Megatron-FSDP" in messages[1]
