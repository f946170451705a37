# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""A table of HybridDeviceOptimizer configurations, each checked for exact steps.

Every test runs over ``STEP_CASES``, one frozen :class:`StepCase` per row, and compares with
``torch.equal`` only:

1. the optimizer's parameters and state after a few steps against a straightforward reference:
   for each parameter its own optimizer of the row's class and settings, over an fp32 master
   (``param_update_in_fp32``) or a copy of the parameter, on the device the optimizer steps
   it on (the host for the offloaded share), copied back into the parameter's dtype;
2. a run checkpointed midway (through bytes) and resumed by a fresh optimizer against the run
   that went on uninterrupted;
3. with CUDA, upstream megatron-core 0.19.2's optimizer against this one on the same inputs,
   and checkpoints written by either resumed by the other.

A learning-rate schedule changes every group's ``lr`` before each step. A row may take the
shard sizes of a model from ``benchmarks/hdo_cases.py``, scaled down; the fork's bucket cap and
part size are set per row and must change nothing but the pipeline. Adding a case is adding a
row. Run against upstream's module with ``MEGATRON_OPTIMIZER_FORK=0``.
"""

import dataclasses
import importlib
import io
import sys
from pathlib import Path
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

import pytest
import torch

from megatron.core.optimizer.cpu_offloading import hybrid_optimizer
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_buckets import CopyPart

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    import optimizer_table
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests import optimizer_table

upstream_modules = optimizer_table.sibling("upstream_modules")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORK = getattr(hybrid_optimizer, "FORK_IMPLEMENTATION", False)
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

STEPS = 4  # steps of every run
CHECKPOINT_AFTER = 2  # steps before the checkpoint of the resume tests
LR_DECAY = 0.8  # each group's lr before step s is its base lr times LR_DECAY ** s
MASTER = "master_param"

Settings = Tuple[Tuple[str, Any], ...]

# How a row meets upstream: the same steps, a checkpoint from the fork resumed by upstream,
# one from upstream resumed by the fork.
LEGS = ("steps", "fork-to-upstream", "upstream-to-fork")


def settings(**kwargs: Any) -> Settings:
    """Hyperparameters as a sorted tuple of pairs, so that a row stays immutable.

    Args:
        **kwargs: optimizer hyperparameters (lr, betas, weight_decay, fused, ...).

    Returns:
        The pairs, sorted by name.
    """
    return tuple(sorted(kwargs.items()))


FUSED_ADAM = settings(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
# Megatron's two groups: without and with weight decay.
TWO_GROUPS = (settings(weight_decay=0.0), settings(weight_decay=0.1))
THREE_GROUPS = (
    settings(weight_decay=0.0),
    settings(lr=3e-3, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6),
    settings(lr=2e-2, weight_decay=0.01, betas=(0.95, 0.999), eps=1e-5),
)
# Sizes that fill no whole vector or line (1, 3, 2**7 + 1, 2**16 + 1, ...) and a 2-D parameter,
# in an order that puts the large one inside a 0.3 or 0.5 offload, with some in place after it.
ODD = (1, 3, 129, 2, 1000, 7, 65537, (3, 43), 5, 31)


@dataclasses.dataclass(frozen=True)
class UpstreamGap:
    """Why upstream 0.19.2 cannot give a row's results: its comparisons with upstream are then
    expected to fail (strictly: one that passes fails, so the note cannot outlive the gap).

    Attributes:
        reason: what upstream does differently.
        raises: how the comparison fails.
        legs: the comparisons (of ``LEGS``) that fail.
    """

    reason: str
    raises: type = AssertionError
    legs: FrozenSet[str] = frozenset(LEGS)


@dataclasses.dataclass(frozen=True)
class StepCase:
    """One configuration of the optimizer and its parameters.

    Attributes:
        name: the test id.
        shapes: the parameters' shapes (an int is a 1-D size); ignored where ``model`` is set.
        model: ``(name, dp, scale)`` for ``hdo_cases.case_numels``: rank 0's shard sizes of a
            named model under ``dp``-way data parallelism, scaled.
        dtypes: the parameters' dtypes, repeated over the parameters in turn.
        fraction: ``offload_fraction``.
        optimizer: the torch optimizer class on both sides (host and in place).
        options: hyperparameters given to the optimizer (``lr`` among them).
        groups: per param group, what it sets apart from ``options``; the parameters are cut
            into as many consecutive runs of near-equal length.
        param_update_in_fp32: step 16-bit parameters on fp32 masters.
        overlap: ``overlap_cpu_optimizer_d2h_h2d``.
        no_grad: ``(step, parameter index)`` pairs whose gradient is None in that step.
        bucket_bytes: the fork's host bucket cap (``_HOST_BUCKET_BYTES``); 0 leaves its own.
        host_part_bytes: the fork's ``host_part_bytes``; None leaves its own.
        upstream_gaps: where and why upstream 0.19.2 cannot give this row's results (one gap
            a leg at most).
    """

    name: str
    shapes: Tuple[Any, ...] = ODD
    model: Tuple[Any, ...] = ()
    dtypes: Tuple[torch.dtype, ...] = (torch.bfloat16,)
    fraction: float = 0.5
    optimizer: type = torch.optim.AdamW
    options: Settings = FUSED_ADAM
    groups: Tuple[Settings, ...] = TWO_GROUPS
    param_update_in_fp32: bool = True
    overlap: bool = True
    no_grad: FrozenSet[Tuple[int, int]] = frozenset()
    bucket_bytes: int = 0
    host_part_bytes: Optional[int] = None
    upstream_gaps: Tuple[UpstreamGap, ...] = ()

    def param_shapes(self) -> List[Any]:
        """The parameters' shapes; skips a row of a model where ``benchmarks/`` is absent."""
        if not self.model:
            return list(self.shapes)
        return case_numels_of(*self.model)

    def group_of(self, index: int, count: int) -> int:
        """The param group of parameter ``index`` of ``count``."""
        return index * len(self.groups) // count

    def base_lr(self, group: int) -> float:
        """The learning rate of ``group`` before any decay."""
        return dict(self.options, **dict(self.groups[group]))["lr"]


# Gradients missing in places. With the "missing-grads" row's sizes, 256-byte buckets and a 0.5
# offload, the host buckets are [0], [1, 2, 3], [4], [5] and 6 to 9 are stepped in place:
# parameter 1 never has a gradient, 3 (in its bucket) misses the first and the last step, 4 (a
# bucket of its own, which then stages nothing) the first and the third, in-place 8 the third.
GAPS = frozenset({(s, 1) for s in range(STEPS)} | {(0, 3), (3, 3), (0, 4), (2, 4), (2, 8)})
STALE_GRADS = UpstreamGap(
    "upstream never clears a host copy's or an fp32 clone's grad, so a parameter whose gradient "
    "is None after it had one is stepped again with the stale gradient"
)
STATELESS_PARAM = UpstreamGap(
    "with param_update_in_fp32 upstream's load replaces state by a plain dict, then looks every "
    "parameter up in it: one without state (never given a gradient) raises KeyError",
    raises=KeyError,
    legs=frozenset({"fork-to-upstream"}),
)

STEP_CASES = (
    StepCase("gpt-dp8-odd-shards", model=("gpt", 8, 3e-4)),
    StepCase(
        "moe-dp8-small-shards-small-buckets",
        model=("moe", 8, 2e-4),
        fraction=1.0,
        bucket_bytes=1 << 12,
    ),
    StepCase(
        "stress-dp64-fp32-0.3",
        model=("stress", 64, 1e-3),
        dtypes=(torch.float32,),
        fraction=0.3,
        param_update_in_fp32=False,
        bucket_bytes=1 << 10,
    ),
    StepCase("llama-dp8-fp16", model=("llama", 8, 1e-3), dtypes=(torch.float16,)),
    StepCase("dense32-dp8-no-overlap", model=("dense32", 8, 1e-4), overlap=False),
    StepCase("odd-sizes-0.3-three-groups", fraction=0.3, groups=THREE_GROUPS),
    StepCase("odd-sizes-bf16-moments", param_update_in_fp32=False),
    StepCase("odd-sizes-fraction-0", fraction=0.0, groups=THREE_GROUPS),
    StepCase(
        "adam-l2-weight-decay",
        optimizer=torch.optim.Adam,
        groups=(settings(weight_decay=0.0), settings(lr=5e-3, weight_decay=0.05, eps=1e-6)),
    ),
    StepCase("amsgrad", options=settings(amsgrad=True, **dict(FUSED_ADAM))),
    StepCase(
        "adam-maximize-fp32-fraction-1",
        dtypes=(torch.float32,),
        fraction=1.0,
        optimizer=torch.optim.Adam,
        options=settings(maximize=True, weight_decay=0.01, **dict(FUSED_ADAM)),
        param_update_in_fp32=False,
    ),
    StepCase(
        "not-fused", options=settings(lr=1e-2, betas=(0.9, 0.95), eps=1e-8), groups=THREE_GROUPS
    ),
    StepCase(
        "fp32-beside-bf16",
        dtypes=(torch.bfloat16, torch.float32),
        groups=THREE_GROUPS,
        upstream_gaps=(
            UpstreamGap(
                "upstream's load looks every parameter with state up among the fp32 copies, "
                "which fp32 parameters lack under param_update_in_fp32",
                raises=KeyError,
                legs=frozenset({"fork-to-upstream"}),
            ),
        ),
    ),
    StepCase(
        "many-small-buckets-ring-reused",
        shapes=tuple(range(1, 200, 9)),
        fraction=1.0,
        bucket_bytes=256,
    ),
    StepCase(
        "missing-grads",
        shapes=(64, 16, 32, 16, 16, 48, 100, 3, 20, 64),
        no_grad=GAPS,
        bucket_bytes=256,
        upstream_gaps=(
            dataclasses.replace(STALE_GRADS, legs=frozenset({"steps", "upstream-to-fork"})),
            STATELESS_PARAM,
        ),
    ),
    StepCase(
        "large-copy-in-64k-parts",
        shapes=(300_001, 5, 131_072, 17, 70_000),
        fraction=1.0,
        no_grad=frozenset({(1, 0), (3, 4)}),
        bucket_bytes=64 << 10,  # copies larger than a bucket have a sub-optimizer of their own
        host_part_bytes=64 << 10,
        upstream_gaps=(STALE_GRADS,),
    ),
)

CASE_IDS = [case.name for case in STEP_CASES]
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def case_numels_of(name: str, dp: int, scale: float) -> List[int]:
    """``hdo_cases.case_numels`` from ``benchmarks/``; skips where that folder is absent (a
    vendored tree)."""
    if not (BENCHMARKS / "hdo_cases.py").is_file():
        pytest.skip("no benchmarks/ here (a vendored tree)")
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module("hdo_cases").case_numels(name, dp, scale)


def upstream_cases(legs: Tuple[str, ...]) -> List[Any]:
    """``(case, leg)`` for each row and each of ``legs``, the legs of a row's upstream gap
    expected to fail."""
    params = []
    for case in STEP_CASES:
        for leg in legs:
            gaps = [gap for gap in case.upstream_gaps if leg in gap.legs]
            assert len(gaps) <= 1, f"{case.name}: two upstream gaps in {leg}"
            marks = [
                pytest.mark.xfail(raises=gap.raises, reason=gap.reason, strict=True) for gap in gaps
            ]
            name = case.name if len(legs) == 1 else f"{case.name}-{leg}"
            params.append(pytest.param(case, leg, id=name, marks=marks))
    return params


# ---------------------------------------------------------------- building and training


def make_params(case: StepCase, seed: int = 0) -> List[torch.nn.Parameter]:
    """The row's parameters on ``DEVICE``, drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    shapes = case.param_shapes()
    return [
        torch.nn.Parameter(
            torch.randn(shape, generator=generator).to(DEVICE, case.dtypes[i % len(case.dtypes)])
        )
        for i, shape in enumerate(shapes)
    ]


def make_hdo(case: StepCase, params, hdo_class=HybridDeviceOptimizer, cpu_optimizer_cls=None):
    """An optimizer of ``hdo_class`` over ``params`` as the row configures it.

    Args:
        case: the row.
        params: the parameters, in the row's order.
        hdo_class: the fork's class or upstream's.
        cpu_optimizer_cls: the host side's class; None for the row's.
    """
    groups = [{"params": [], **dict(extra)} for extra in case.groups]
    for index, param in enumerate(params):
        groups[case.group_of(index, len(params))]["params"].append(param)
    return hdo_class(
        [group for group in groups if group["params"]],
        offload_fraction=case.fraction,
        cpu_optimizer_cls=cpu_optimizer_cls or case.optimizer,
        gpu_optimizer_cls=case.optimizer,
        param_update_in_fp32=case.param_update_in_fp32,
        overlap_cpu_optimizer_d2h_h2d=case.overlap,
        **dict(case.options),
    )


def use_fork_knobs(case: StepCase, monkeypatch) -> None:
    """Set the fork's bucket cap and part size the row asks for (nothing on upstream's)."""
    if not FORK:
        return
    if case.bucket_bytes:
        monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", case.bucket_bytes)
    if case.host_part_bytes is not None:
        monkeypatch.setattr(HybridDeviceOptimizer, "host_part_bytes", case.host_part_bytes)


def assert_knobs_took_effect(case: StepCase, optimizer) -> None:
    """A row with a small bucket cap has more staged buckets than ring slots, and one with a
    part size moves a copy in parts (the fork's optimizer only)."""
    if not FORK or not isinstance(optimizer, HybridDeviceOptimizer):
        return
    # pylint: disable=protected-access
    if case.bucket_bytes:
        staged = [bucket for bucket in optimizer._buckets if bucket.grads]
        assert len(staged) > optimizer._ring.plan.slots, "the buckets fit the ring"
    if case.host_part_bytes is not None:
        assert any(isinstance(b, CopyPart) for b in optimizer._buckets), "no copy in parts"


def grads_at(case: StepCase, params: List[torch.Tensor], step: int) -> List[torch.Tensor]:
    """Step ``step``'s gradients (host tensors in each parameter's dtype; None in a gap),
    drawn from the step alone, so that a resumed run draws what the uninterrupted one did."""
    generator = torch.Generator().manual_seed(1000 + step)
    grads = []
    for index, param in enumerate(params):
        grad = torch.randn(param.shape, generator=generator).to(param.dtype)
        grads.append(None if (step, index) in case.no_grad else grad)
    return grads


def set_lrs(case: StepCase, groups: List[Dict[str, Any]], group_ids: List[int], step: int):
    """Write the schedule's lr for ``step`` into ``groups`` (``group_ids``: the row's group of
    each), as a scheduler does before a step."""
    for group, group_id in zip(groups, group_ids):
        group["lr"] = case.base_lr(group_id) * LR_DECAY**step


def hdo_group_ids(case: StepCase, optimizer, params: List[torch.Tensor]) -> List[int]:
    """The row's group of each of the optimizer's param groups."""
    index_of = {id(param): index for index, param in enumerate(params)}
    return [
        case.group_of(index_of[id(group["params"][0])], len(params))
        for group in optimizer.param_groups
    ]


def train(case: StepCase, params, optimizer, steps: range) -> None:
    """Take the ``steps`` (global step numbers) with the row's gradients and lr schedule."""
    group_ids = hdo_group_ids(case, optimizer, params)
    for step in steps:
        for param, grad in zip(params, grads_at(case, params, step)):
            param.grad = None if grad is None else grad.to(param.device)
        set_lrs(case, optimizer.param_groups, group_ids, step)
        optimizer.step()
        optimizer.zero_grad()
        if step == steps[0]:
            assert_knobs_took_effect(case, optimizer)


def offloaded_share(numels: List[int], fraction: float) -> List[bool]:
    """Which parameters (in order) the optimizer steps on host copies: each one while fewer
    than ``fraction`` of all elements are offloaded before it."""
    budget, offloaded, share = fraction * sum(numels), 0, []
    for numel in numels:
        share.append(offloaded < budget)
        offloaded += numel if share[-1] else 0
    return share


# ---------------------------------------------------------------- the reference


@dataclasses.dataclass
class Reference:
    """Per parameter: the tensor the reference steps and its own optimizer."""

    masters: List[torch.Tensor]
    optimizers: List[torch.optim.Optimizer]

    def state_of(self, index: int) -> Dict[str, Any]:
        """Parameter ``index``'s reference state (empty before its first step)."""
        return dict(self.optimizers[index].state.get(self.masters[index]) or {})


def reference_run(case: StepCase, params: List[torch.Tensor], steps: int) -> Reference:
    """The row's steps taken the plain way, from the parameters' values (left unchanged)."""
    share = offloaded_share([p.numel() for p in params], case.fraction)
    masters, optimizers, group_ids = [], [], []
    for index, param in enumerate(params):
        where = torch.device("cpu") if share[index] else param.device
        dtype = torch.float32 if case.param_update_in_fp32 else param.dtype
        master = param.detach().to(where, dtype, copy=True)
        group_ids.append(case.group_of(index, len(params)))
        extra = dict(case.groups[group_ids[-1]])
        masters.append(master)
        optimizers.append(case.optimizer([{"params": [master], **extra}], **dict(case.options)))
    for step in range(steps):
        for master, grad in zip(masters, grads_at(case, params, step)):
            master.grad = None if grad is None else grad.to(master.device, master.dtype)
        for optimizer, group_id in zip(optimizers, group_ids):
            set_lrs(case, optimizer.param_groups, [group_id], step)
            optimizer.step()
    return Reference(masters, optimizers)


# ---------------------------------------------------------------- comparing


def _differs_by(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """The largest difference of two tensors, for a failure message."""
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} instead of {tuple(expected.shape)}"
    difference = (actual.detach().cpu().double() - expected.detach().cpu().double()).abs()
    return f"at most {difference.max().item():.3g} ({int((difference != 0).sum())} elements)"


def assert_tensor_equal(actual, expected, what: str, placed: bool = True) -> None:
    """``torch.equal`` (and, if ``placed``, the same device and dtype)."""
    assert isinstance(actual, torch.Tensor), f"{what}: {type(actual).__name__}"
    if placed:
        assert (actual.device, actual.dtype) == (expected.device, expected.dtype), what
    assert actual.dtype == expected.dtype, f"{what}: {actual.dtype} instead of {expected.dtype}"
    assert torch.equal(
        actual.detach().cpu(), expected.detach().cpu()
    ), f"{what} differs by {_differs_by(actual, expected)}"


def assert_state_equal(actual, expected, what: str, placed: bool = True) -> None:
    """Two state dicts hold the same keys and equal values."""
    assert sorted(actual) == sorted(expected), f"{what}: keys {sorted(actual)}"
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert_tensor_equal(actual[key], value, f"{what} {key}", placed)
        else:
            assert actual[key] == value, f"{what} {key}"


def state_of(optimizer, param) -> Dict[str, Any]:
    """``param``'s state in an optimizer (empty where it has none)."""
    return dict(optimizer.state.get(param) or {})


def assert_same_runs(a_params, a_optimizer, b_params, b_optimizer, placed: bool = True):
    """Two optimizers' parameters and states (master copies included) are equal."""
    for index, (a_param, b_param) in enumerate(zip(a_params, b_params)):
        assert_tensor_equal(a_param, b_param, f"parameter {index}", placed)
        a_state, b_state = state_of(a_optimizer, a_param), state_of(b_optimizer, b_param)
        assert_state_equal(a_state, b_state, f"parameter {index}'s state", placed)


def assert_moved(params, initial) -> None:
    """The steps changed the parameters (so that equal results say something)."""
    assert any(not torch.equal(p.detach(), i) for p, i in zip(params, initial)), "nothing moved"
    assert all(bool(torch.isfinite(p).all()) for p in params), "a parameter is not finite"


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize("case", STEP_CASES, ids=CASE_IDS)
def test_steps_equal_each_parameter_stepped_alone(case, monkeypatch):
    """Parameters and state after the steps equal the reference's: each parameter stepped by
    an optimizer of its own (the row's class and settings, on the device its share is stepped
    on: the host for the offloaded share), over an fp32 master with ``param_update_in_fp32``,
    then narrowed into the parameter."""
    use_fork_knobs(case, monkeypatch)
    params = make_params(case)
    initial = [p.detach().clone() for p in params]
    reference = reference_run(case, params, STEPS)
    optimizer = make_hdo(case, params)
    train(case, params, optimizer, range(STEPS))
    assert_moved(params, initial)
    # The reference steps the share that the optimizer copies to the host there.
    offloaded = [param in optimizer.gpu_params_map_cpu_copy for param in params]
    assert offloaded == offloaded_share([p.numel() for p in params], case.fraction)
    for index, (param, master) in enumerate(zip(params, reference.masters)):
        expected = master.to(param.device, param.dtype)
        assert_tensor_equal(param, expected, f"parameter {index}")
        state, expected_state = state_of(optimizer, param), reference.state_of(index)
        master_param = state.pop(MASTER, None)
        if case.param_update_in_fp32 and expected_state:
            assert_tensor_equal(master_param, master, f"parameter {index}'s {MASTER}")
        else:
            assert master_param is None, f"parameter {index} shows a {MASTER}"
        assert_state_equal(state, expected_state, f"parameter {index}'s state")


@pytest.mark.parametrize("case", STEP_CASES, ids=CASE_IDS)
def test_a_checkpoint_midway_resumes_exactly(case, monkeypatch):
    """Checkpointed after some steps (through bytes) and loaded into a fresh optimizer over
    parameters restored to their saved values, the run goes on as the uninterrupted one."""
    use_fork_knobs(case, monkeypatch)
    params = make_params(case)
    optimizer = make_hdo(case, params)
    train(case, params, optimizer, range(CHECKPOINT_AFTER))
    saved, saved_params = checkpoint(optimizer), [p.detach().clone() for p in params]
    train(case, params, optimizer, range(CHECKPOINT_AFTER, STEPS))

    resumed_params = make_params(case, seed=1)
    restore(resumed_params, saved_params)
    resumed = make_hdo(case, resumed_params)
    resumed.load_state_dict(saved)
    train(case, resumed_params, resumed, range(CHECKPOINT_AFTER, STEPS))
    assert_same_runs(resumed_params, resumed, params, optimizer)


def checkpoint(optimizer) -> Dict[str, Any]:
    """The optimizer's state dict after a trip through bytes. ``weights_only=False`` lets
    upstream's (classes in its groups) through; weights-only loading has tests of its own."""
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def restore(params: List[torch.Tensor], values: List[torch.Tensor]) -> None:
    """Copy saved values into parameters, as a model checkpoint load does."""
    with torch.no_grad():
        for param, value in zip(params, values):
            param.copy_(value)


@pytest.fixture(name="upstream_hdo_class", scope="module")
def fixture_upstream_hdo_class():
    """Upstream megatron-core 0.19.2's HybridDeviceOptimizer, loaded from its own file."""
    return upstream_modules.hybrid_optimizer_class()


@requires_cuda
@pytest.mark.parametrize("case, leg", upstream_cases(LEGS[:1]))
def test_steps_equal_upstreams(case, leg, upstream_hdo_class, monkeypatch):
    """The same inputs stepped by upstream's optimizer and by this one give equal parameters
    and state (the fork's knobs only change its pipeline)."""
    assert leg == "steps"
    use_fork_knobs(case, monkeypatch)
    runs = []
    for hdo_class in (upstream_hdo_class, HybridDeviceOptimizer):
        params = make_params(case)
        optimizer = make_hdo(case, params, hdo_class)
        train(case, params, optimizer, range(STEPS))
        runs.append((params, optimizer))
    (upstream_params, upstream), (params, optimizer) = runs
    assert_same_runs(params, optimizer, upstream_params, upstream)


# Upstream's load moves each sub-optimizer's state to the host where that sub-optimizer is an
# instance of ``cpu_optimizer_cls``, else to CUDA: with one class on both sides it would move
# the in-place state to the host too. Reading a checkpoint, upstream gets a host class of its
# own, which steps as the row's class does.
HOST_SIDE = {
    cls: type(f"Host{cls.__name__}", (cls,), {}) for cls in (torch.optim.Adam, torch.optim.AdamW)
}


@requires_cuda
@pytest.mark.parametrize("case, leg", upstream_cases(LEGS[1:]))
def test_checkpoints_cross_between_fork_and_upstream(case, leg, upstream_hdo_class, monkeypatch):
    """A checkpoint written midway by one implementation, resumed by the other over restored
    parameters, goes on as the writer's uninterrupted run."""
    use_fork_knobs(case, monkeypatch)
    fork_writes = leg == "fork-to-upstream"
    params = make_params(case)
    optimizer = make_hdo(case, params, HybridDeviceOptimizer if fork_writes else upstream_hdo_class)
    train(case, params, optimizer, range(CHECKPOINT_AFTER))
    saved, saved_params = checkpoint(optimizer), [p.detach().clone() for p in params]
    train(case, params, optimizer, range(CHECKPOINT_AFTER, STEPS))

    resumed_params = make_params(case, seed=1)
    restore(resumed_params, saved_params)
    if fork_writes:
        host_side = HOST_SIDE[case.optimizer]
        resumed = make_hdo(case, resumed_params, upstream_hdo_class, host_side)
    else:
        resumed = make_hdo(case, resumed_params)
    resumed.load_state_dict(saved)
    train(case, resumed_params, resumed, range(CHECKPOINT_AFTER, STEPS))
    # Upstream leaves a loaded step counter where its load put it: values only.
    assert_same_runs(resumed_params, resumed, params, optimizer, placed=False)
