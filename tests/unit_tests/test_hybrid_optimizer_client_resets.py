# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""A client's reset of the optimizer states, through the HybridDeviceOptimizer's public face.

slime's ``--reset-optimizer-states`` walks ``optimizer.chained_optimizers`` and, for each
member's inner optimizer (the HDO with ``--optimizer-cpu-offload``), sets ``group["step"] = 0``
in every public param group that has one and zeroes ``step``, ``exp_avg`` and ``exp_avg_sq``
in ``optimizer.state``. An optimizer that counts Adam steps in its param groups (TE's
FusedAdam, stepping the parameters kept in place) must then restart its bias correction: each
test compares the HDO reset that way with a twin whose sub-optimizers were reset directly, bit
for bit, after further steps, and checks that the reset changed the run at all.
"""

import copy

import pytest
import torch

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    import optimizer_table
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests import optimizer_table

GroupStepAdamW = optimizer_table.sibling("optimizer_doubles").GroupStepAdamW
te_fused_adam = optimizer_table.sibling("optimizer_doubles").te_fused_adam
fixture_parallel_state = optimizer_table.sibling("single_rank").fixture_parallel_state
results_on_cpu_ranks = optimizer_table.sibling("cpu_ranks").results_on_cpu_ranks
_in_distributed_optimizer = optimizer_table.sibling(
    "test_hybrid_optimizer_in_distributed_optimizer"
)
batches, build, train = (
    _in_distributed_optimizer.batches,
    _in_distributed_optimizer.build,
    _in_distributed_optimizer.train,
)
_step_counts = optimizer_table.sibling("test_hybrid_optimizer_step_counts")
make_hdo_with = _step_counts.make_hdo

try:  # the fork's registry of optimizers that count steps per group
    from megatron.core.optimizer import inner_optimizer_state
except ImportError:
    inner_optimizer_state = None

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STEPS_BEFORE, STEPS_AFTER = 3, 2
MOMENTS = ("exp_avg", "exp_avg_sq")

# (host optimizer, in-place optimizer): as Megatron's factory builds it with TE (torch's AdamW
# on the host, a group counter in place), and a group counter on both sides, so that fraction
# 1.0 (nothing in place) still steps one.
SIDES = {
    "factory": (torch.optim.AdamW, GroupStepAdamW),
    "group_counters": (GroupStepAdamW, GroupStepAdamW),
}


# The double registered as counting steps per group, as FusedAdam is (an autouse fixture).
group_step_double_counts_per_group = _step_counts.group_step_double_counts_per_group


def reset_as_slime_does(optimizer):
    """slime's reset of one inner optimizer, through its public groups and state."""
    for group in optimizer.param_groups:
        if "step" in group:
            group["step"] = 0
    for state in optimizer.state.values():
        if "step" in state:
            if isinstance(state["step"], torch.Tensor):
                state["step"].zero_()
            else:
                state["step"] = 0
        for key in MOMENTS:
            if key in state:
                state[key].zero_()


def reset_sub_optimizers(hdo):
    """The same reset done on each sub-optimizer of ``hdo`` directly."""
    for optimizer in hdo.sub_optimizers:
        reset_as_slime_does(optimizer)


def make_hdo(sides, fraction, seed=0):
    """bf16 parameters in two groups under an HDO built as Megatron's factory builds it, with
    ``sides`` (host, in-place) optimizer classes."""
    host, in_place = sides
    return make_hdo_with((in_place, {}), seed, fraction, host)


def train_hdo(hdo, params, steps, seed, decoupled):
    """``steps`` steps with gradients drawn from ``seed``; ``decoupled`` hands them over in
    fp32 as ``decoupled_grad``, as the precision-aware optimizer does."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for param in params:
            grad = torch.randn(param.shape, generator=generator)
            if decoupled:
                param.decoupled_grad = grad.to(DEVICE)
            else:
                param.grad = grad.to(DEVICE, param.dtype)
        hdo.step()
        for param in params:
            param.grad = None
            param.decoupled_grad = None


def group_counted_steps(hdo):
    """The step of every sub-optimizer group that counts one."""
    return [
        group["step"]
        for optimizer in hdo.sub_optimizers
        for group in optimizer.param_groups
        if "step" in group
    ]


def assert_same_run(mine, theirs):
    """Parameters and every state tensor of two HDOs' parameters equal bit for bit."""
    (hdo, params), (other, other_params) = mine, theirs
    for index, (a, b) in enumerate(zip(params, other_params)):
        assert torch.equal(a, b), f"parameter {index} differs"
        for key, value in hdo.state[a].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other.state[b][key]), f"{key} of {index} differs"


@pytest.mark.parametrize("decoupled", [False, True], ids=["grad", "precision_aware"])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("sides", sorted(SIDES))
def test_slime_reset_restarts_the_steps_the_sub_optimizers_count(sides, fraction, decoupled):
    runs = {name: make_hdo(SIDES[sides], fraction) for name in ("slime", "direct", "kept")}
    for hdo, params in runs.values():
        train_hdo(hdo, params, STEPS_BEFORE, seed=1, decoupled=decoupled)
    reset_as_slime_does(runs["slime"][0])
    reset_sub_optimizers(runs["direct"][0])
    for hdo, params in runs.values():
        train_hdo(hdo, params, STEPS_AFTER, seed=2, decoupled=decoupled)

    assert_same_run(runs["slime"], runs["direct"])
    # Where everything is offloaded to torch's AdamW, no group counts a step: the reset goes
    # through the per-parameter steps of ``state`` alone.
    counting = not (sides == "factory" and fraction == 1.0)
    counted = group_counted_steps(runs["slime"][0])
    assert set(counted) == ({STEPS_AFTER} if counting else set()), "a count did not restart"
    public = [group.get("step") for group in runs["slime"][0].param_groups]
    assert public == [STEPS_AFTER if counting else None] * 2, "public groups lag the counts"
    kept_params, reset_params = runs["kept"][1], runs["slime"][1]
    assert any(not torch.equal(a, b) for a, b in zip(kept_params, reset_params))


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_a_reset_run_saves_and_resumes_its_restarted_count(fraction):
    hdo, params = make_hdo(SIDES["group_counters"], fraction)
    train_hdo(hdo, params, STEPS_BEFORE, seed=1, decoupled=False)
    reset_as_slime_does(hdo)
    train_hdo(hdo, params, 1, seed=2, decoupled=False)
    saved = copy.deepcopy(hdo.state_dict())
    resumed, resumed_params = make_hdo(SIDES["group_counters"], fraction, seed=5)
    with torch.no_grad():
        for mine, source in zip(resumed_params, params):
            mine.copy_(source)
    resumed.load_state_dict(saved)

    train_hdo(hdo, params, STEPS_AFTER, seed=3, decoupled=False)
    train_hdo(resumed, resumed_params, STEPS_AFTER, seed=3, decoupled=False)
    assert_same_run((resumed, resumed_params), (hdo, params))
    assert set(group_counted_steps(resumed)) == {1 + STEPS_AFTER}


def test_hyperparameters_written_with_the_reset_reach_the_sub_groups():
    hdo, params = make_hdo(SIDES["factory"], 0.5)
    train_hdo(hdo, params, 1, seed=1, decoupled=False)
    for group in hdo.param_groups:
        group["lr"] = 5e-4
    reset_as_slime_does(hdo)
    train_hdo(hdo, params, 1, seed=2, decoupled=False)
    lrs = {group["lr"] for optimizer in hdo.sub_optimizers for group in optimizer.param_groups}
    assert lrs == {5e-4}
    assert set(group_counted_steps(hdo)) == {1}


# ------------------------------------------------------------------ through Megatron's factory


def hdos_of(optimizer):
    """The HDO inside each member of Megatron's chained optimizer."""
    return [member.optimizer for member in optimizer.chained_optimizers]


def in_place_class_for_the_factory(monkeypatch):
    """TE's FusedAdam where it imports (the factory then picks it); else the double, given to
    the factory under the name it builds the in-place optimizer from."""
    fused_adam = te_fused_adam()
    if fused_adam is not None:
        return fused_adam
    import megatron.core.optimizer as factory  # pylint: disable=import-outside-toplevel

    monkeypatch.setattr(factory, "Adam", GroupStepAdamW)
    return GroupStepAdamW


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision_aware", [False, True], ids=["plain", "precision_aware"])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_slime_reset_through_the_distributed_optimizer(
    parallel_state, monkeypatch, fraction, precision_aware
):  # pylint: disable=unused-argument,redefined-outer-name
    in_place = in_place_class_for_the_factory(monkeypatch)
    runs = {name: build(fraction, seed=0, precision_aware=precision_aware) for name in "sdk"}
    for model, optimizer in runs.values():
        train(model, optimizer, batches(STEPS_BEFORE, seed=1))
    for member in runs["s"][1].chained_optimizers:
        reset_as_slime_does(member.optimizer)
    for hdo in hdos_of(runs["d"][1]):
        reset_sub_optimizers(hdo)
    for model, optimizer in runs.values():
        train(model, optimizer, batches(STEPS_AFTER, seed=2))

    (slime_model, slime), (direct_model, direct), (kept_model, _) = runs.values()
    for a, b in zip(slime_model.parameters(), direct_model.parameters()):
        assert torch.equal(a, b)
    for mine, theirs in zip(hdos_of(slime), hdos_of(direct)):
        params = [p for group in mine.param_groups for p in group["params"]]
        others = [p for group in theirs.param_groups for p in group["params"]]
        assert_same_run((mine, params), (theirs, others))
    in_place_groups = [
        group
        for hdo in hdos_of(slime)
        if isinstance(hdo.gpu_optimizer, in_place)
        for group in hdo.gpu_optimizer.param_groups
    ]
    assert all(group["step"] == STEPS_AFTER for group in in_place_groups)
    assert bool(in_place_groups) == (fraction < 1.0)
    assert any(
        not torch.equal(a, b) for a, b in zip(slime_model.parameters(), kept_model.parameters())
    )


# ------------------------------------------------------------------ the same on CPU ranks

WORLD_SIZE = 2
CPU_CASES = [(0.5, False), (0.5, True), (1.0, False), (1.0, True)]


def cpu_batches(count, seed, hidden):
    """``count`` bf16 batches drawn from ``seed``: the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(16, hidden, generator=generator).to(torch.bfloat16) for _ in range(count)]


def reset_flow_mismatches(fraction, precision_aware):
    """Run the reset flow on this rank of a world; return what differs (empty: nothing)."""
    hidden = 64
    runs = {name: build(fraction, 0, precision_aware, hidden) for name in "sdk"}
    for model, optimizer in runs.values():
        train(model, optimizer, cpu_batches(STEPS_BEFORE, 1, hidden))
    for member in runs["s"][1].chained_optimizers:
        reset_as_slime_does(member.optimizer)
    for hdo in hdos_of(runs["d"][1]):
        reset_sub_optimizers(hdo)
    for model, optimizer in runs.values():
        train(model, optimizer, cpu_batches(STEPS_AFTER, 2, hidden))
    (slime_model, slime), (direct_model, direct), (kept_model, _) = runs.values()
    problems = []
    pairs = zip(slime_model.parameters(), direct_model.parameters())
    if not all(torch.equal(a, b) for a, b in pairs):
        problems.append("model parameters differ from the direct reset's")
    for mine, theirs in zip(hdos_of(slime), hdos_of(direct)):
        for a, b in zip(mine.state.values(), theirs.state.values()):
            if any(torch.is_tensor(v) and not torch.equal(v, b[k]) for k, v in a.items()):
                problems.append("optimizer state differs from the direct reset's")
                break
        counts = group_counted_steps(mine)
        if mine.gpu_optimizer is not None and set(counts) != {STEPS_AFTER}:
            problems.append(f"group counts {counts}, expected {STEPS_AFTER}")
    pairs = zip(slime_model.parameters(), kept_model.parameters())
    if all(torch.equal(a, b) for a, b in pairs):
        problems.append("the reset changed nothing")
    return problems


def reset_flow_rank(rank, world, folder):  # pylint: disable=unused-argument
    """One spawned gloo rank: every case of :data:`CPU_CASES`, with what differs."""
    import megatron.core.optimizer as factory  # pylint: disable=import-outside-toplevel

    factory.Adam = GroupStepAdamW  # what the factory builds the in-place optimizer from
    if hasattr(inner_optimizer_state, "GROUP_STEP_CLASSES"):
        identity = (GroupStepAdamW.__module__, GroupStepAdamW.__qualname__)
        inner_optimizer_state.GROUP_STEP_CLASSES |= {identity}
    return {f"{f}-{p}": reset_flow_mismatches(f, p) for f, p in CPU_CASES}


@pytest.mark.multirank
def test_slime_reset_through_the_distributed_optimizer_on_cpu_ranks(tmp_path):
    """Megatron's factory (DDP, DistributedOptimizer, HDO with the double in place) on two
    gloo ranks, fractions 0.5 and 1.0, precision-aware off and on."""
    found = results_on_cpu_ranks(reset_flow_rank, tmp_path, WORLD_SIZE)
    for rank, problems in enumerate(found):
        assert problems == {f"{f}-{p}": [] for f, p in CPU_CASES}, f"rank {rank}: {problems}"
