# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The offloaded step behind the next forward (``overlap_cpu_optimizer_step_with_forward``).

The HybridDeviceOptimizer alone: a step that runs behind equals the step it replaces bit for
bit; whatever reads the optimizer waits for it; ``wait_for_params`` waits for the buckets of
the parameters asked for and no others; the buckets go in ``host_step_order``; a failure on the
worker leaves the optimizer refusing to go on. Through Megatron's factory, DDP with
``overlap_param_gather`` and the DistributedOptimizer (two gloo ranks on the CPU, one NCCL rank
on a GPU): training with the mode on equals training with it off in model parameters, masters
and moments, and checkpoints cross between the two both ways.
"""

import threading
import time

import pytest
import torch

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    import optimizer_table
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests import optimizer_table

from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

flows = optimizer_table.sibling("hdo_client_flows")
resets = optimizer_table.sibling("test_hybrid_optimizer_client_resets")
# The double registered as counting steps per group, as FusedAdam is (an autouse fixture).
group_step_double_counts_per_group = resets.group_step_double_counts_per_group
fixture_parallel_state = optimizer_table.sibling("single_rank").fixture_parallel_state
results_on_cpu_ranks = optimizer_table.sibling("cpu_ranks").results_on_cpu_ranks
distributed = optimizer_table.sibling("test_hybrid_optimizer_in_distributed_optimizer")

pytestmark = pytest.mark.skipif(
    not hasattr(HybridDeviceOptimizer, "wait_for_params"),
    reason="the step behind the forward is the fork's (upstream 0.19.2 has none)",
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(64, 32), (300,), (128, 64), (1000,)]
# Where CUDA pins the ring, a slot for every bucket must fit within upstream's pinned total
# (else the step stays where it is): buckets of whole powers of two do, as large models' do.
HELD_SHAPES = [(512, 256), (256, 512), (512, 256), (256, 512)]
STEPS = 3


def behind(optimizer, order=None):
    """Run ``optimizer``'s host step behind the forward from its first step on."""
    optimizer.overlap_cpu_optimizer_step_with_forward = True
    optimizer.host_step_order = order
    return optimizer


@pytest.mark.parametrize("dtype", optimizer_table.dtype_params())
@pytest.mark.parametrize("fraction", optimizer_table.OFFLOADED_FRACTIONS)
def test_a_step_behind_the_forward_equals_the_step_it_replaces(fraction, dtype):
    kept = flows.build_hdo(HybridDeviceOptimizer, HELD_SHAPES, fraction, dtype=dtype, device=DEVICE)
    params, hdo = flows.build_hdo(
        HybridDeviceOptimizer, HELD_SHAPES, fraction, dtype=dtype, device=DEVICE
    )
    behind(hdo, order=lambda param: -param.numel())  # another order than the parameters'
    flows.train_params(*kept, STEPS, seed=1)
    flows.train_params(params, hdo, STEPS, seed=1)
    assert hdo.host_step_pending  # it did run behind
    hdo.finish_step()
    resets.assert_same_run((kept[1], kept[0]), (hdo, params))


@pytest.mark.parametrize("fraction", optimizer_table.OFFLOADED_FRACTIONS)
def test_slime_reset_written_while_the_step_runs_behind_reaches_the_next_step(fraction):
    """slime writes the group step before zeroing the state, so it can land while the step
    still runs behind: the step must not then overwrite it with the one it took."""
    runs = [resets.make_hdo(resets.SIDES["group_counters"], fraction) for _ in range(2)]
    behind(runs[1][0])
    for hdo, params in runs:
        resets.train_hdo(hdo, params, STEPS, seed=1, decoupled=False)
    for hdo, _ in runs:
        resets.reset_as_slime_does(hdo)
    for hdo, params in runs:
        resets.train_hdo(hdo, params, 2, seed=2, decoupled=False)
    runs[1][0].finish_step()  # the parameters themselves are read without waiting
    resets.assert_same_run(*runs)


class HeldAdamW(torch.optim.AdamW):
    """torch AdamW whose host steps wait for the test: each instance's step blocks until its
    ``release`` is set, and notes the order the steps came in."""

    started: list = []

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.release = threading.Event()

    def step(self, closure=None):
        HeldAdamW.started.append(self)
        if not self.release.wait(timeout=60):
            raise TimeoutError("the test never released this host step")
        return super().step(closure)


class FailingAdamW(torch.optim.AdamW):
    """torch AdamW whose steps raise."""

    def step(self, closure=None):
        raise ValueError("host step refused")


def held_hdo(cpu_cls=HeldAdamW, order=None):
    """The parameters and groups of ``hdo_client_flows.build_hdo`` for :data:`HELD_SHAPES`, all
    offloaded (one host bucket per group), stepped behind the forward by ``cpu_cls``."""
    generator = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to(DEVICE, torch.bfloat16))
        for shape in HELD_SHAPES
    ]
    hdo = HybridDeviceOptimizer(
        [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.1}],
        offload_fraction=1.0,
        cpu_optimizer_cls=cpu_cls,
        gpu_optimizer_cls=torch.optim.AdamW,
        param_update_in_fp32=True,
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    return params, behind(hdo, order)


def hand_out_grads(params, seed=1):
    generator = torch.Generator().manual_seed(seed)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator).to(DEVICE, param.dtype)


def release_all(hdo):
    for optimizer in hdo.cpu_optimizers:
        optimizer.release.set()


def test_readers_of_the_optimizer_wait_for_the_step():
    HeldAdamW.started.clear()
    kept = flows.build_hdo(HybridDeviceOptimizer, HELD_SHAPES, 1.0, device=DEVICE)
    hand_out_grads(kept[0])
    kept[1].step()
    params, hdo = held_hdo()
    hand_out_grads(params)
    hdo.step()
    assert hdo.host_step_pending
    # Released only after the reader has started waiting: a reader that did not wait would
    # read the state before the step.
    threading.Timer(0.3, release_all, args=(hdo,)).start()
    started = time.monotonic()
    state = hdo.state_dict()
    assert time.monotonic() - started >= 0.25
    assert not hdo.host_step_pending
    for index, param in enumerate(params):
        for key in ("exp_avg", "exp_avg_sq"):
            saved = state["state"][index][key]
            assert torch.equal(saved, kept[1].state[kept[0][index]][key])


def test_wait_for_params_waits_for_their_buckets_alone():
    HeldAdamW.started.clear()
    params, hdo = held_hdo()
    first, second = hdo.cpu_optimizers
    hand_out_grads(params)
    hdo.step()
    first.release.set()
    assert hdo.wait_for_params(params[:2])  # the first group's bucket
    assert not hdo.wait_for_params(params[2:], block=False)
    assert hdo.host_step_pending
    second.release.set()
    assert hdo.wait_for_params(params[2:])
    hdo.finish_step()
    assert not hdo.host_step_pending


def test_host_buckets_go_in_the_host_step_order():
    HeldAdamW.started.clear()
    params, hdo = held_hdo()
    place = {id(param): -index for index, param in enumerate(params)}  # the last first
    hdo.host_step_order = lambda param: place[id(param)]
    release_all(hdo)
    hand_out_grads(params)
    hdo.step()
    hdo.finish_step()
    # The parameters' order would step the first group first.
    first, second = (started.param_groups[0]["params"] for started in HeldAdamW.started)
    assert any(host is hdo.gpu_params_map_cpu_copy[params[3]] for host in first)
    assert any(host is hdo.gpu_params_map_cpu_copy[params[0]] for host in second)


# What clients call between training and rollout (README, "RL clients"), right after a step.
CLIENT_CALLS = {
    "bridge_refresh": lambda hdo: hdo.update_fp32_param_by_new_param(),
    "verl_offload_and_home": lambda hdo: (
        flows.offload_state_by_reassignment(hdo),
        flows.reload_state_by_the_hdo(hdo),
    ),
    "skyrl_masters": lambda hdo: hdo._update_fp32_params_by_new_state(),
    "group_sync": lambda hdo: hdo._sync_hdo_param_groups_to_sub_optimizers(),
    "dummy_step": lambda hdo: hdo.dummy_step(),
}


@pytest.mark.parametrize("call", sorted(CLIENT_CALLS))
def test_a_client_call_right_after_the_step_waits_for_it(call):
    """The host step is held until after the call has started: a call that did not wait would
    act on the state before the step (or race the worker), and the run would leave its twin's."""
    HeldAdamW.started.clear()
    twin_params, twin = held_hdo()
    twin.overlap_cpu_optimizer_step_with_forward = False
    release_all(twin)
    params, hdo = held_hdo()
    for run_params, run in ((twin_params, twin), (params, hdo)):
        hand_out_grads(run_params)
        run.step()
        if run is hdo:
            assert hdo.host_step_pending
            threading.Timer(0.3, release_all, args=(hdo,)).start()
        CLIENT_CALLS[call](run)
        run.zero_grad()
        hand_out_grads(run_params, seed=2)
        run.step()
    hdo.finish_step()
    resets.assert_same_run((twin, twin_params), (hdo, params))


def test_a_failed_host_step_leaves_the_optimizer_refusing_to_go_on():
    params, hdo = held_hdo(cpu_cls=FailingAdamW)
    hand_out_grads(params)
    hdo.step()  # returns: the failure comes on the worker
    with pytest.raises(RuntimeError, match="host step refused"):
        hdo.finish_step()
    with pytest.raises(RuntimeError, match="load a checkpoint"):
        hdo.step()


# ------------------------------------------------------------------ through Megatron's factory

HIDDEN = 64
# (offload fraction, precision-aware optimizer)
MEGATRON_CASES = [(0.5, False), (0.5, True), (1.0, False), (1.0, True)]
WORLD_SIZE = 2


def build_megatron(fraction, precision_aware, run_behind, seed=0):
    """A bf16 model in DDP with ``overlap_param_gather`` and the optimizer Megatron's factory
    builds for CPU offload; ``run_behind`` sets ``overlap_cpu_optimizer_step_with_forward`` on
    the config, as a user would."""
    fields = {"overlap_cpu_optimizer_step_with_forward": True} if run_behind else {}
    model, optimizer = distributed.build(
        fraction, seed, precision_aware, HIDDEN, overlap=True, **fields
    )
    if run_behind:
        for hdo in hdos_of(optimizer):
            # A slot for each bucket of a model this small, pinned, would hold more than
            # upstream pins (the step would then stay where it is): the slots stay pageable.
            hdo.pin_cpu_grads = False
    return model, optimizer


def hdos_of(optimizer):
    """The HDO inside each member of Megatron's chained optimizer."""
    return [member.optimizer for member in optimizer.chained_optimizers]


def megatron_batches(count, seed, device):
    """``count`` bf16 batches drawn from ``seed``: the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(8, HIDDEN, generator=generator).to(device, torch.bfloat16) for _ in range(count)
    ]


def train_megatron(model, optimizer, data):
    """Megatron's loop; returns whether each step left its host part running behind."""
    behind_after = []
    for batch in data:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        model(batch).float().pow(2).mean().backward()  # the pre-hooks wait for the parameters
        model.finish_grad_sync()
        optimizer.step()
        behind_after.append(any(hdo.host_step_pending for hdo in hdos_of(optimizer)))
    return behind_after


def differences(run, other):
    """What differs between two runs: model parameters after a forced parameter sync (as
    evaluation and checkpointing get them), and each HDO's masters and moments."""
    found = []
    for model, _ in (run, other):
        model.start_param_sync(force_sync=True)
    pairs = zip(run[0].parameters(), other[0].parameters())
    if not all(torch.equal(a, b) for a, b in pairs):
        found.append("model parameters differ")
    for mine, theirs in zip(hdos_of(run[1]), hdos_of(other[1])):
        params = [p for group in mine.param_groups for p in group["params"]]
        others = [p for group in theirs.param_groups for p in group["params"]]
        for a, b in zip(params, others):
            for key, value in mine.state[a].items():
                if torch.is_tensor(value) and not torch.equal(value, theirs.state[b][key]):
                    found.append(f"{key} differs")
    return sorted(set(found))


def save_legacy(run, folder, rank):
    """Megatron-LM's legacy checkpoint: the common state per rank, the parameter state."""
    model, optimizer = run
    optimizer.save_parameter_state(f"{folder}/param_state.pt")
    common = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(common, f"{folder}/common{rank}.pt")


def load_legacy(run, folder, rank):
    """Read :func:`save_legacy`'s checkpoint into a fresh run."""
    model, optimizer = run
    common = torch.load(f"{folder}/common{rank}.pt", weights_only=False)
    model.load_state_dict(common["model"])
    optimizer.load_state_dict(common["optimizer"])
    optimizer.load_parameter_state(f"{folder}/param_state.pt")


def megatron_mismatches(fraction, precision_aware, device, folder, rank, barrier):
    """Train with the mode off and on, save each, load each into the other mode, go on: what
    differs from the run with the mode off (empty: nothing)."""
    problems = []
    off, on = (build_megatron(fraction, precision_aware, flag) for flag in (False, True))
    train_megatron(*off, megatron_batches(STEPS, 1, device))
    ran_behind = train_megatron(*on, megatron_batches(STEPS, 1, device))
    if not all(ran_behind):
        problems.append(f"the steps did not run behind the forward: {ran_behind}")
    problems += [f"trained: {found}" for found in differences(off, on)]
    for run, name in ((off, "off"), (on, "on")):
        save_legacy(run, f"{folder}/{name}", rank)
    barrier()
    resumed = {
        "on->off": build_megatron(fraction, precision_aware, False, seed=5),
        "off->on": build_megatron(fraction, precision_aware, True, seed=5),
    }
    load_legacy(resumed["on->off"], f"{folder}/on", rank)
    load_legacy(resumed["off->on"], f"{folder}/off", rank)
    data = megatron_batches(STEPS, 2, device)
    for run in (off, on, *resumed.values()):
        train_megatron(*run, data)
    problems += [f"going on: {found}" for found in differences(off, on)]
    for name, run in resumed.items():
        problems += [f"resumed {name}: {found}" for found in differences(off, run)]
    return problems


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fraction, precision_aware", MEGATRON_CASES)
def test_behind_the_forward_through_the_distributed_optimizer(
    parallel_state, tmp_path, fraction, precision_aware
):  # pylint: disable=unused-argument,redefined-outer-name
    for name in ("on", "off"):
        (tmp_path / name).mkdir()
    found = megatron_mismatches(fraction, precision_aware, "cuda", tmp_path, 0, lambda: None)
    assert found == []


def megatron_rank(rank, world, folder):
    """One spawned gloo rank: every case of :data:`MEGATRON_CASES`, with what differs."""
    import os  # pylint: disable=import-outside-toplevel

    found = {}
    for fraction, precision_aware in MEGATRON_CASES:
        case = f"{fraction}-{precision_aware}"
        for name in ("on", "off"):
            os.makedirs(f"{folder}/{case}/{name}", exist_ok=True)
        found[case] = megatron_mismatches(
            fraction, precision_aware, "cpu", f"{folder}/{case}", rank, world.barrier
        )
    return found


@pytest.mark.multirank
def test_behind_the_forward_on_cpu_ranks(tmp_path):
    """Megatron's factory, DDP with overlap_param_gather, DistributedOptimizer and HDO on two
    gloo ranks: fractions 0.5 and 1.0, precision-aware off and on."""
    found = results_on_cpu_ranks(megatron_rank, tmp_path, WORLD_SIZE)
    for rank, problems in enumerate(found):
        assert all(not mismatches for mismatches in problems.values()), f"rank {rank}: {problems}"
        assert len(problems) == len(MEGATRON_CASES)
