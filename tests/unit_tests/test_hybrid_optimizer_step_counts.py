# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Checkpoints crossing between in-place optimizers that count Adam steps in different places.

Megatron's factory hands the HybridDeviceOptimizer TE's FusedAdam for the parameters stepped in
place where Transformer Engine imports, torch's fused AdamW where it does not. FusedAdam counts
steps in each param group, torch in each parameter's state. A run saved on one side and resumed
on the other must keep counting from where it was: each test compares the resumed HDO with one
given the count by hand, bit for bit, and checks what a checkpoint without any count does.
"""

import copy

import pytest
import torch

from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    import optimizer_table
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests import optimizer_table

GroupStepAdamW = optimizer_table.sibling("optimizer_doubles").GroupStepAdamW
_optimizer_cpu_offloading = optimizer_table.sibling("test_optimizer_cpu_offloading")
checkpoint = _optimizer_cpu_offloading.checkpoint
train = _optimizer_cpu_offloading.train

try:  # the fork's registry of optimizers that count steps per group
    from megatron.core.optimizer import inner_optimizer_state
except ImportError:
    inner_optimizer_state = None

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUMELS = [4096, 1000, 77, 65536, 3, 12288, 513, 2048]

# The in-place sides, as Megatron's factory configures each (torch's fused, the double as TE).
PER_GROUP = (GroupStepAdamW, {})
PER_PARAM = (torch.optim.AdamW, {"fused": True})


@pytest.fixture(autouse=True)
def group_step_double_counts_per_group(monkeypatch):
    """The double stands in for FusedAdam: registered where the fork keeps that registry."""
    if hasattr(inner_optimizer_state, "GROUP_STEP_CLASSES"):
        identity = (GroupStepAdamW.__module__, GroupStepAdamW.__qualname__)
        classes = inner_optimizer_state.GROUP_STEP_CLASSES | {identity}
        monkeypatch.setattr(inner_optimizer_state, "GROUP_STEP_CLASSES", classes)


def make_hdo(in_place, seed=0, fraction=0.5, host=torch.optim.AdamW):
    """An HDO over bf16 parameters in two groups, ``fraction`` of them stepped on the host by
    ``host`` and the rest in place by ``in_place`` (a class and its options), as Megatron's
    factory builds it: ``(hdo, params)``."""
    generator = torch.Generator().manual_seed(seed)
    params = [
        torch.nn.Parameter(torch.randn(n, generator=generator).to(DEVICE, torch.bfloat16))
        for n in NUMELS
    ]
    gpu_cls, options = in_place
    hdo = HybridDeviceOptimizer(
        [{"params": params[:5], "weight_decay": 0.01}, {"params": params[5:]}],
        offload_fraction=fraction,
        cpu_optimizer_cls=host,
        gpu_optimizer_cls=gpu_cls,
        param_update_in_fp32=True,
        lr=1e-3,
        betas=(0.9, 0.95),
        **options,
    )
    return hdo, params


def in_place_ids(hdo):
    """Checkpoint ids of the parameters stepped in place."""
    params = [p for group in hdo.param_groups for p in group["params"]]
    return [i for i, p in enumerate(params) if p not in hdo.gpu_params_map_cpu_copy]


def assert_same(resumed, reference):
    """Parameters and every state entry of two HDOs' parameters equal bit for bit."""
    (hdo, params), (other, other_params) = resumed, reference
    for index, (a, b) in enumerate(zip(params, other_params)):
        assert torch.equal(a, b), f"parameter {index} differs"
        mine, theirs = hdo.state[a], other.state[b]
        assert sorted(mine) == sorted(theirs), index
        for key, value in theirs.items():
            assert torch.equal(torch.as_tensor(mine[key]), torch.as_tensor(value)), (index, key)


def test_group_counted_steps_resume_where_torch_counts_them_per_parameter():
    """A checkpoint of FusedAdam in place (steps in the groups) resumed with torch's fused
    AdamW in place: every in-place parameter's count is its group's, as if torch had counted
    it, instead of ``KeyError: 'step'`` at the first step."""
    source, source_params = make_hdo(PER_GROUP)
    train(source_params, source, 3, seed=1)
    saved = checkpoint(source)
    assert all("step" not in saved["state"][i] for i in in_place_ids(source))
    assert all("step" in group for group in saved["param_groups"]), "the groups' count is lost"

    resumed = make_hdo(PER_PARAM, seed=5)
    resumed[0].load_state_dict(copy.deepcopy(saved))
    by_hand = copy.deepcopy(saved)
    groups = {i: g for g in by_hand["param_groups"] for i in g["params"]}
    for i in in_place_ids(source):
        by_hand["state"][i]["step"] = torch.tensor(float(groups[i]["step"]))
    reference = make_hdo(PER_PARAM, seed=6)
    reference[0].load_state_dict(by_hand)

    for i in in_place_ids(source):
        assert float(resumed[0].state[resumed[1][i]]["step"]) == 3.0
    for hdo, params in (resumed, reference):
        train(params, hdo, 2, seed=2)
    assert_same(resumed, reference)


def test_per_parameter_steps_resume_where_the_group_counts_them():
    """A checkpoint of torch's AdamW in place (steps per parameter, none in the groups) resumed
    with FusedAdam in place: its groups count on from the parameters' steps instead of
    restarting the bias correction at one."""
    source, source_params = make_hdo(PER_PARAM)
    train(source_params, source, 3, seed=1)
    saved = checkpoint(source)
    assert all("step" not in group for group in saved["param_groups"])

    resumed = make_hdo(PER_GROUP, seed=5)
    resumed[0].load_state_dict(copy.deepcopy(saved))
    by_hand = copy.deepcopy(saved)
    for group in by_hand["param_groups"]:
        group["step"] = 3
    reference = make_hdo(PER_GROUP, seed=6)
    reference[0].load_state_dict(by_hand)

    assert [group.get("step") for group in resumed[0].gpu_optimizer.param_groups] == [3, 3]
    for hdo, params in (resumed, reference):
        train(params, hdo, 2, seed=2)
    assert_same(resumed, reference)
    assert [group["step"] for group in resumed[0].gpu_optimizer.param_groups] == [5, 5]


def test_state_without_any_step_count_is_refused_before_anything_changes():
    """In-place state with no count anywhere (neither in the entry nor in its group) cannot
    resume torch's AdamW: the load says which parameter, and the optimizer is as it was."""
    source, source_params = make_hdo(PER_GROUP)
    train(source_params, source, 2, seed=1)
    saved = checkpoint(source)
    for group in saved["param_groups"]:
        group.pop("step", None)

    hdo, params = make_hdo(PER_PARAM, seed=5)
    twin = make_hdo(PER_PARAM, seed=5)
    for optimizer, tensors in (hdo, params), twin:
        train(tensors, optimizer, 1, seed=3)
    first = in_place_ids(source)[0]
    with pytest.raises(KeyError, match=rf"parameter {first}\b.*'step'"):
        hdo.load_state_dict(saved)
    assert_same((hdo, params), twin)
    for optimizer, tensors in (hdo, params), twin:
        train(tensors, optimizer, 1, seed=4)
    assert_same((hdo, params), twin)


def in_place_counts(hdo):
    """The counts the in-place optimizer reads: its groups' steps, or its entries' steps."""
    optimizer = hdo.gpu_optimizer
    if isinstance(optimizer, torch.optim.AdamW):
        return [
            float(optimizer.state[p]["step"]) for g in optimizer.param_groups for p in g["params"]
        ]
    return [group.get("step") for group in optimizer.param_groups]


def counts_by_hand(saved, in_place, ids, count):
    """``saved`` with ``count`` where ``in_place`` reads it, for the parameters ``ids``."""
    by_hand = copy.deepcopy(saved)
    for group in by_hand["param_groups"]:
        group.pop("step", None)
        if in_place is PER_GROUP:
            group["step"] = count
    for i in ids:
        by_hand["state"][i].pop("step", None)
        if in_place is PER_PARAM:
            by_hand["state"][i]["step"] = torch.tensor(float(count))
    return by_hand


@pytest.mark.parametrize(
    "first, second", [(PER_PARAM, PER_GROUP), (PER_GROUP, PER_PARAM)], ids=["torch-te", "te-torch"]
)
def test_a_run_that_crosses_twice_steps_resume_from_the_count_it_reached(first, second):
    """Saved on one side, resumed and trained on the other, saved again and resumed on the
    first side: the count is the one the run reached, not one the first load left behind where
    the second side does not read it."""
    source, source_params = make_hdo(first)
    train(source_params, source, 3, seed=1)
    crossed, crossed_params = make_hdo(second, seed=5)
    crossed.load_state_dict(checkpoint(source))
    train(crossed_params, crossed, 2, seed=2)
    saved = checkpoint(crossed)

    back, back_params = make_hdo(first, seed=6)
    back.load_state_dict(copy.deepcopy(saved))
    ids = in_place_ids(source)
    assert set(in_place_counts(back)) == {5}
    reference = make_hdo(first, seed=7)
    reference[0].load_state_dict(counts_by_hand(saved, first, ids, 5))
    for hdo, params in ((back, back_params), reference):
        train(params, hdo, 2, seed=3)
    assert_same((back, back_params), reference)


def test_a_group_the_checkpoint_never_stepped_counts_from_zero_after_the_load():
    """Loaded into an HDO that has trained, a group without a saved count leaves FusedAdam's
    group no count of its own, as its own load would: the trained count would bias-correct
    the next update of state that never stepped."""
    source, source_params = make_hdo(PER_GROUP)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):  # the second group never gets a gradient
        for param in source_params[:5]:
            param.grad = torch.randn(param.shape, generator=generator).to(DEVICE, param.dtype)
        source.step()
    saved = checkpoint(source)
    assert "step" in saved["param_groups"][0] and "step" not in saved["param_groups"][1]

    trained, trained_params = make_hdo(PER_GROUP, seed=5)
    train(trained_params, trained, 4, seed=2)
    trained.load_state_dict(saved)
    assert [group.get("step") for group in trained.gpu_optimizer.param_groups] == [3, None]
