# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The HDO's host step runs on its share of the host's cores and gives the caller's threads back.

Several ranks on one host each step an HDO on the same cores. The host step runs on the cores
this process may use divided by the ranks on the host (``LOCAL_WORLD_SIZE``), or on what
``MEGATRON_HDO_HOST_STEP_THREADS`` or the HDO's ``host_step_threads`` say, and the caller's
intra-op thread count is set back afterwards, also after a failed step. Host AdamW is
elementwise, so the thread count changes no value.
"""

import pytest
import torch

from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

try:  # the fork's policy; upstream has none
    from megatron.core.optimizer.cpu_offloading import host_step_threads as policy
except ImportError:
    policy = None

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
THREADS_ENV = "MEGATRON_HDO_HOST_STEP_THREADS"
# Large enough that torch's fused AdamW splits each tensor between threads.
NUMELS = [1 << 17, 3000, 1 << 16, 77, 40_000]

needs_policy = pytest.mark.skipif(policy is None, reason="the thread policy is the fork's")


@pytest.fixture(autouse=True)
def host_of_cores(monkeypatch):
    """A host of 6 usable cores, no rank count and no override, the caller on one thread."""
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(6)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv(THREADS_ENV, raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class CountingAdamW(torch.optim.AdamW):
    """torch's AdamW that notes the intra-op thread count of each of its steps in ``seen``,
    and raises after stepping once ``fail`` is set."""

    seen = []
    fail = False

    def step(self, closure=None):
        CountingAdamW.seen.append(torch.get_num_threads())
        loss = super().step(closure)
        if CountingAdamW.fail:
            raise RuntimeError("host step failed")
        return loss


@pytest.fixture
def counting():
    """CountingAdamW with no steps noted and failing off."""
    CountingAdamW.seen = []
    CountingAdamW.fail = False
    yield CountingAdamW
    CountingAdamW.fail = False


def make_hdo(cpu_cls=torch.optim.AdamW, fraction=1.0, **options):
    """An HDO over bf16 parameters of ``NUMELS`` (the same values every time) and a function
    that hands them the same fp32 decoupled gradients every time: ``(hdo, params, hand_out)``."""
    generator = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(n, generator=generator).to(DEVICE, torch.bfloat16))
        for n in NUMELS
    ]
    grads = [torch.randn(n, generator=generator).mul_(1e-2).to(DEVICE) for n in NUMELS]
    hdo = HybridDeviceOptimizer(
        [{"params": params}],
        offload_fraction=fraction,
        cpu_optimizer_cls=cpu_cls,
        gpu_optimizer_cls=torch.optim.AdamW,
        param_update_in_fp32=True,
        lr=1e-3,
        weight_decay=0.01,
        **options,
    )

    def hand_out():
        for param, grad in zip(params, grads):
            param.decoupled_grad = grad

    return hdo, params, hand_out


@needs_policy
@pytest.mark.parametrize(
    "ranks, expected", [(None, 6), ("1", 6), ("2", 3), ("4", 1), ("8", 1), ("5", 1)]
)
def test_the_policy_shares_the_usable_cores_among_the_ranks_on_the_host(ranks, expected):
    """Six usable cores: all of them for a lone rank, an equal share each for several, at
    least one thread where the ranks outnumber the cores."""
    environ = {} if ranks is None else {"LOCAL_WORLD_SIZE": ranks}
    assert policy.usable_cores() == 6
    assert policy.host_step_threads(environ=environ) == expected
    assert policy.policy_threads(cores=16, ranks=8) == 2
    assert policy.policy_threads(cores=16, ranks=3) == 5
    assert policy.policy_threads(cores=2, ranks=8) == 1


@needs_policy
def test_an_override_wins_over_the_policy_and_zero_leaves_the_caller_s_count():
    """The environment variable beats the policy, the HDO's attribute beats both; 0 means the
    caller's count (None: nothing to set)."""
    ranks = {"LOCAL_WORLD_SIZE": "2"}
    assert policy.host_step_threads(environ={**ranks, THREADS_ENV: " 5 "}) == 5
    assert policy.host_step_threads(environ={**ranks, THREADS_ENV: "0"}) is None
    assert policy.host_step_threads(environ={**ranks, THREADS_ENV: ""}) == 3  # empty: unset
    # The HDO's attribute, where set, wins over the environment.
    assert policy.host_step_threads(4, environ={**ranks, THREADS_ENV: "5"}) == 4
    assert policy.host_step_threads(0, environ={**ranks, THREADS_ENV: "5"}) is None


@needs_policy
@pytest.mark.parametrize(
    "environ, override, named",
    [
        ({THREADS_ENV: "two"}, None, THREADS_ENV),
        ({THREADS_ENV: "-1"}, None, THREADS_ENV),
        ({THREADS_ENV: "1.5"}, None, THREADS_ENV),
        ({}, -2, "host_step_threads"),
        ({}, "many", "host_step_threads"),
        ({"LOCAL_WORLD_SIZE": "0"}, None, "LOCAL_WORLD_SIZE"),
        ({"LOCAL_WORLD_SIZE": "eight"}, None, "LOCAL_WORLD_SIZE"),
    ],
)
def test_a_bad_setting_is_refused_naming_where_it_came_from(environ, override, named):
    """Anything but a whole number (of at least 0 threads, at least 1 rank) is refused, and
    the error names the variable or attribute it came from."""
    with pytest.raises(ValueError, match=named) as refused:
        policy.host_step_threads(override, environ=environ)
    assert "whole number" in str(refused.value)


def test_the_host_step_runs_on_the_policy_s_threads_and_gives_the_caller_s_back(
    monkeypatch, counting
):
    """Two ranks on six cores: each host step runs on three threads, and the caller, on one
    thread (as torchrun starts ranks), is on one again after the step."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    hdo, _, hand_out = make_hdo(counting)
    for _ in range(2):
        hand_out()
        hdo.step()
        assert torch.get_num_threads() == 1
    assert counting.seen and set(counting.seen) == {3}


def test_the_environment_and_the_attribute_override_the_policy(monkeypatch, counting):
    """MEGATRON_HDO_HOST_STEP_THREADS=2 runs the host step on two threads; the HDO's
    ``host_step_threads = 0`` leaves it on the caller's one."""
    monkeypatch.setenv(THREADS_ENV, "2")
    hdo, _, hand_out = make_hdo(counting)
    hand_out()
    hdo.step()
    assert set(counting.seen) == {2} and torch.get_num_threads() == 1
    counting.seen.clear()
    hdo.host_step_threads = 0  # the caller's count
    hand_out()
    hdo.step()
    assert set(counting.seen) == {1}


def test_a_failing_host_step_gives_the_caller_s_thread_count_back(counting):
    """A host step that raises still sets the caller's count back (one thread here, six in
    the step)."""
    hdo, _, hand_out = make_hdo(counting)
    hand_out()
    counting.fail = True
    with pytest.raises(RuntimeError, match="host step failed"):
        hdo.step()
    assert counting.seen == [6]
    assert torch.get_num_threads() == 1


def test_a_bad_override_fails_the_step_before_anything_is_stepped(monkeypatch, counting):
    """A bad MEGATRON_HDO_HOST_STEP_THREADS fails the step before any sub-optimizer steps and
    leaves the parameters as they were; with a good value the next step runs."""
    monkeypatch.setenv(THREADS_ENV, "all")
    hdo, params, hand_out = make_hdo(counting)
    before = [p.detach().clone() for p in params]
    hand_out()
    with pytest.raises(ValueError, match=THREADS_ENV):
        hdo.step()
    assert not counting.seen
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    monkeypatch.setenv(THREADS_ENV, "2")
    hdo.step()
    assert counting.seen == [2] and torch.get_num_threads() == 1


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_the_host_step_s_values_do_not_depend_on_its_threads(monkeypatch, fraction):
    """Host AdamW is elementwise: stepped by torch's fused kernel on one thread or on six (the
    policy's share of this host), the parameters and every state entry are equal bit for bit."""
    kernel, seen = torch._fused_adamw_, []  # pylint: disable=protected-access

    def noting(*args, **kwargs):
        if args[0][0].device.type == "cpu":
            seen[-1].add(torch.get_num_threads())
        return kernel(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", noting)
    results = []
    for threads in (1, None):
        seen.append(set())
        hdo, params, hand_out = make_hdo(fraction=fraction, fused=True)
        hdo.host_step_threads = threads
        for _ in range(3):
            hand_out()
            hdo.step()
        results.append((hdo, params))
    assert seen == [{1}, {6}]
    (one, one_params), (shared, shared_params) = results
    for index, (a, b) in enumerate(zip(one_params, shared_params)):
        assert torch.equal(a, b), f"parameter {index} differs"
        mine, theirs = one.state[a], shared.state[b]
        assert sorted(mine) == sorted(theirs)
        for key, value in mine.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(theirs[key])), (index, key)
