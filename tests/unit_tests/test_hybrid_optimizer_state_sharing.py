# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""HybridDeviceOptimizer: ``optimizer.state`` is the state its sub-optimizers step.

RL frameworks read, move and reassign ``optimizer.state`` between training and rollout, and
call upstream's private members around checkpoint loads. Each test checks that what they
touch is the real state: identity with the sub-optimizer's dicts, assignments that count at
once, the members' meaning, and steps ``torch.equal`` to a twin that never saw the flow. Every
test runs on the CPU; with CUDA the parameters live on the GPU, and the client flows also
check where the state goes and what accelerator memory it takes. Every test runs twice: with
small copies, each moved whole, and with a first copy larger than a bucket, moved in parts of
a bucket as the HDO moves such a copy (an embedding) by default, scaled down to 64 KiB.
"""

import copy
import io
import sys

import pytest
import torch

from megatron.core.optimizer.cpu_offloading import hybrid_optimizer
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_buckets import CopyPart
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_parts import PART_ALIGN_BYTES

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    import optimizer_table
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests import optimizer_table

flows = optimizer_table.sibling("hdo_client_flows")
offloading = optimizer_table.sibling("test_optimizer_cpu_offloading")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SHAPES = [(64, 32), (128,), (32, 32), (48,), (16, 8)]
FRACTIONS = optimizer_table.OFFLOAD_FRACTIONS
# 80 KiB of fp32 (two parts of 64 KiB), first so that it is offloaded at every fraction but 0.
PARTED_SHAPE = (160, 128)


@pytest.fixture(autouse=True, params=["whole", "parts"])
def copies(request, monkeypatch):
    """Which way the host copies move: whole, or the first in parts."""
    if request.param == "parts":  # the default's bucket cap and part size, scaled down
        monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", PART_ALIGN_BYTES)
        monkeypatch.setattr(HybridDeviceOptimizer, "host_part_bytes", PART_ALIGN_BYTES)
        monkeypatch.setattr(sys.modules[__name__], "SHAPES", [PARTED_SHAPE] + SHAPES)
    return request.param


def test_the_parts_variant_moves_its_first_copy_in_parts(copies):
    """The fixture's parts variant is what it says: the first copy, and it alone, moves in two
    parts (so each test of this file also covers a copy in parts)."""
    for fraction in (0.5, 1.0):
        params, optimizer = make(fraction)
        train(params, optimizer, 1, seed=1)
        parted = [b for b in offloading.host_buckets(optimizer) if isinstance(b, CopyPart)]
        assert len(parted) == (2 if copies == "parts" else 0)
        assert all(b.hosts == [optimizer.param_to_inner_param[params[0]]] for b in parted)


def test_state_is_listed_in_parameter_order():
    """``state`` lists every parameter once, in the order of the param groups, although the
    in-place sub-optimizer creates its state before the host buckets do."""
    params, optimizer = flows.build_hdo(HybridDeviceOptimizer, SHAPES, 0.5, device=DEVICE)
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    assert optimizer.gpu_optimizer is not None and optimizer.cpu_optimizers
    assert list(optimizer.state) == params


# Upstream 0.19.2's members that clients and plugins call or probe.
UPSTREAM_MEMBERS = [
    "_move_new_state_to_right_device",
    "_update_fp32_params_by_new_state",
    "_get_sub_optimizer_param_groups",
    "_init_sub_optimizers",
    "_register_load_state_dict_hooks",
    "_register_param_copy_back_gpu_hook",
    "_set_sub_optimizer_grads",
    "_sync_hdo_state_to_sub_optimizers",
    "_sync_sub_optimizers_state_to_hdo",
    "_sync_hdo_param_groups_to_sub_optimizers",
    "build_cpu_optimizer_list",
    "update_fp32_param_by_new_param",
    "dummy_step",
    "sub_optimizers",
]


def make(fraction, seed=0, dtype=torch.bfloat16):
    return flows.build_hdo(HybridDeviceOptimizer, SHAPES, fraction, seed, dtype, DEVICE)


train = flows.train_params


def twins(fraction, steps=2):
    """Two identical optimizers, trained alike."""
    pair = [make(fraction), make(fraction)]
    for params, optimizer in pair:
        train(params, optimizer, steps, seed=1)
    return pair


def assert_same_training(pair, steps=2, seed=2):
    """Both twins take the same steps and end with equal parameters."""
    for params, optimizer in pair:
        train(params, optimizer, steps, seed)
    for index, (a, b) in enumerate(zip(pair[0][0], pair[1][0])):
        assert torch.equal(
            a, b
        ), f"parameter {index} differs by {(a.float() - b.float()).abs().max()}"


def stepped_dict(optimizer, param):
    """The dict the sub-optimizer that steps ``param`` keeps for it."""
    inner = optimizer.param_to_inner_param[param]
    owners = [o for o in optimizer.sub_optimizers if inner in o.state]
    assert len(owners) == 1, f"{len(owners)} sub-optimizers hold state for one parameter"
    return owners[0].state[inner]


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_each_parameters_state_is_the_dict_its_sub_optimizer_steps(fraction):
    params, optimizer = make(fraction)
    train(params, optimizer, 2, seed=1)
    for param in params:
        assert optimizer.state[param] is stepped_dict(optimizer, param)
        assert optimizer.state[param]["master_param"] is optimizer.param_to_inner_param[param]


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_an_assigned_tensor_is_the_sub_optimizers_at_once(fraction):
    (params, optimizer), (twin_params, twin) = pair = twins(fraction)
    for param, twin_param in zip(params, twin_params):
        halved = optimizer.state[param]["exp_avg"] * 0.5
        optimizer.state[param]["exp_avg"] = halved
        assert stepped_dict(optimizer, param)["exp_avg"] is halved
        twin.state[twin_param]["exp_avg"].mul_(0.5)
    assert_same_training(pair)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_a_dict_assigned_for_a_parameter_is_what_the_next_step_uses(fraction):
    (params, optimizer), (twin_params, twin) = pair = twins(fraction)
    for param, twin_param in zip(params, twin_params):
        replaced = {k: v.clone() for k, v in optimizer.state[param].items()}
        replaced["exp_avg_sq"].mul_(2.0)
        optimizer.state[param] = replaced
        assert optimizer.state[param] is stepped_dict(optimizer, param)
        twin.state[twin_param]["exp_avg_sq"].mul_(2.0)
    assert_same_training(pair)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_a_state_replaced_as_a_whole_is_adopted(fraction):
    """Upstream's own methods reassign ``self.state``; clients copy that pattern."""
    (params, optimizer), (twin_params, twin) = pair = twins(fraction)
    replaced = {}
    for param, twin_param in zip(params, twin_params):
        replaced[param] = {k: v.clone() for k, v in optimizer.state[param].items()}
        replaced[param]["exp_avg"].mul_(-1.0)
        twin.state[twin_param]["exp_avg"].mul_(-1.0)
    optimizer.state = replaced
    assert_same_training(pair)
    for param in params:
        assert optimizer.state[param] is stepped_dict(optimizer, param)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_a_dict_assigned_in_a_sub_optimizer_is_the_parameters_state(fraction):
    (params, optimizer), (twin_params, twin) = pair = twins(fraction)
    for param, twin_param in zip(params, twin_params):
        inner = optimizer.param_to_inner_param[param]
        owner = [o for o in optimizer.sub_optimizers if inner in o.state][0]
        owner.state[inner] = {k: v.clone() for k, v in owner.state[inner].items()}
        owner.state[inner]["exp_avg"].mul_(3.0)
        assert owner.state[inner] is optimizer.state[param]
        twin.state[twin_param]["exp_avg"].mul_(3.0)
    assert_same_training(pair)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_a_sub_optimizers_own_load_is_adopted_by_the_next_step(fraction):
    (params, optimizer), _ = pair = twins(fraction)
    for sub_optimizer in optimizer.sub_optimizers:
        sub_optimizer.load_state_dict(sub_optimizer.state_dict())
    assert_same_training(pair)
    for param in params:
        assert optimizer.state[param] is stepped_dict(optimizer, param)


@pytest.mark.parametrize("member", UPSTREAM_MEMBERS)
def test_upstreams_members_are_there(member):
    assert callable(getattr(HybridDeviceOptimizer, member, None)) or isinstance(
        getattr(HybridDeviceOptimizer, member, None), property
    )


@requires_cuda
def test_a_download_notes_its_event_and_the_step_takes_it():
    """``_cpu_optimizer_map_data_event`` maps each host sub-optimizer whose gradients are on
    their way to the event of that copy, as upstream's does; a step leaves none behind."""
    # pylint: disable=protected-access
    params, optimizer = make(1.0)
    assert optimizer._cpu_optimizer_map_data_event == {}
    train(params, optimizer, 1, seed=1)
    assert optimizer._cpu_optimizer_map_data_event == {}
    for param in params:
        param.grad = torch.ones_like(param)
    first = offloading.ring_plan(optimizer).first_downloads[0]
    optimizer._download(first)
    bucket = offloading.host_buckets(optimizer)[first]
    if not isinstance(
        bucket, CopyPart
    ):  # a whole bucket's key is its sub-optimizer, as upstream keys it
        assert bucket.event_key is bucket.optimizer
    else:  # the parts of a copy share its sub-optimizer, so each adds its range
        assert bucket.event_key == (bucket.optimizer, bucket.part)
    event = optimizer._cpu_optimizer_map_data_event[bucket.event_key]
    assert isinstance(event, torch.cuda.Event)
    event.synchronize()
    optimizer._cpu_optimizer_map_data_event.clear()


def _built_once(optimizer):
    return (
        [id(o) for o in optimizer.sub_optimizers],
        [id(t) for t in optimizer.param_to_inner_param.values()],
        {id(k): id(v) for k, v in optimizer.cpu_copy_map_grad.items()},
    )


@pytest.mark.parametrize("fraction", optimizer_table.OFFLOADED_FRACTIONS)
def test_upstreams_post_load_sequence_keeps_what_is_built_once(fraction):
    """Client patches replay upstream's post-load hook: rebuild, then sync groups and state."""
    (params, optimizer), twin_pair = twins(fraction)
    before = _built_once(optimizer)
    # pylint: disable=protected-access
    optimizer._init_sub_optimizers()
    optimizer._sync_hdo_param_groups_to_sub_optimizers()
    optimizer._sync_hdo_state_to_sub_optimizers()
    assert _built_once(optimizer) == before
    assert_same_training([(params, optimizer), twin_pair])


@pytest.mark.parametrize("fraction", optimizer_table.OFFLOADED_FRACTIONS)
def test_get_sub_optimizer_param_groups_describes_the_placement(fraction):
    params, optimizer = make(fraction)
    # pylint: disable=protected-access
    cpu_groups, gpu_groups, to_copy, to_param, to_fp32 = optimizer._get_sub_optimizer_param_groups(
        fraction
    )
    assert to_copy is optimizer.gpu_params_map_cpu_copy
    assert to_param is optimizer.cpu_copys_map_gpu_param
    assert to_fp32 is optimizer.param_to_fp32_param
    stepped = [id(t) for group in cpu_groups + gpu_groups for t in group["params"]]
    assert sorted(stepped) == sorted(id(optimizer.param_to_inner_param[p]) for p in params)
    with pytest.raises(ValueError, match="offload_fraction"):
        optimizer._get_sub_optimizer_param_groups(1.0 - fraction + 0.25)


@pytest.mark.parametrize("fraction", optimizer_table.OFFLOADED_FRACTIONS)
def test_a_class_level_master_update_and_sync_after_a_load_resume_exactly(fraction, monkeypatch):
    calls = []
    monkeypatch.setattr(
        HybridDeviceOptimizer, "_update_fp32_params_by_new_state", flows.client_master_update(calls)
    )
    params, optimizer = make(fraction)
    train(params, optimizer, 3, seed=1)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    saved_params = [p.detach().clone() for p in params]

    resumed_params, resumed = make(fraction, seed=5)
    with torch.no_grad():
        for target, source in zip(resumed_params, saved_params):
            target.copy_(source)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=False))  # upstream's has classes
    resumed._sync_hdo_state_to_sub_optimizers()  # pylint: disable=protected-access
    assert calls and calls[-1] is resumed
    assert_same_training([(params, optimizer), (resumed_params, resumed)])


@pytest.mark.parametrize("fraction", optimizer_table.OFFLOADED_FRACTIONS)
def test_saved_state_and_copies_of_state_are_plain_dicts(fraction):
    params, optimizer = make(fraction)
    train(params, optimizer, 1, seed=1)
    saved = optimizer.state_dict()
    assert saved["state"] and all(type(e) is dict for e in saved["state"].values())
    copied = copy.deepcopy(optimizer.state)
    assert all(type(e) is dict for e in copied.values())
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    assert len(torch.load(buffer, weights_only=True)["state"]) == len(params)


# ------------------------------------------------------------------ client flows


def _offload_reload(optimizer, reload):
    flows.offload_state_by_reassignment(optimizer)
    reload(optimizer)


FLOWS = {
    "reassign_then_move_by_the_hdo": lambda o: _offload_reload(o, flows.reload_state_by_the_hdo),
    "reassign_then_moments_to_device": lambda o: _offload_reload(
        o, lambda hdo: flows.reload_moments_to_the_accelerator(hdo, DEVICE)
    ),
}


@pytest.mark.parametrize("flow", sorted(FLOWS))
@pytest.mark.parametrize("fraction", optimizer_table.OFFLOADED_FRACTIONS)
def test_a_state_round_trip_through_the_host_trains_like_a_twin(fraction, flow):
    (params, optimizer), twin_pair = twins(fraction)
    FLOWS[flow](optimizer)
    train(params, optimizer, 1, seed=2)
    train(*twin_pair, 1, seed=2)
    assert flows.misplaced_state(optimizer) == []
    assert_same_training([(params, optimizer), twin_pair])


@requires_cuda
@pytest.mark.parametrize("flow", sorted(FLOWS))
@pytest.mark.parametrize("fraction", optimizer_table.OFFLOADED_FRACTIONS)
def test_a_round_trip_frees_the_in_place_state_and_puts_nothing_host_resident_on_the_gpu(
    fraction, flow
):
    (params, optimizer), twin_pair = twins(fraction)
    in_place = flows.accelerator_state_bytes(optimizer)
    in_place_moments = flows.accelerator_state_bytes(optimizer, flows.MOMENTS)
    by_the_hdo = flow.endswith("by_the_hdo")
    with flows.measured_memory():
        before = flows.allocated()
        flows.offload_state_by_reassignment(optimizer)
        offloaded = flows.allocated()
        if by_the_hdo:
            flows.reload_state_by_the_hdo(optimizer)
        else:
            flows.reload_moments_to_the_accelerator(optimizer)
        reloaded = flows.allocated()
    assert before - offloaded == in_place
    # The clients' own reload leaves the step counters on the host until the next step.
    assert reloaded - offloaded == (in_place if by_the_hdo else in_place_moments)
    assert_same_training([(params, optimizer), twin_pair])
    assert flows.misplaced_state(optimizer) == []


@requires_cuda
@pytest.mark.parametrize("fraction", optimizer_table.DEVICE_KEPT_FRACTIONS)
def test_a_load_over_state_parked_on_the_host_puts_it_home(fraction):
    (params, optimizer), (twin_params, twin) = twins(fraction)
    buffer = io.BytesIO()
    torch.save(twin.state_dict(), buffer)
    flows.offload_state_by_reassignment(optimizer)
    buffer.seek(0)
    optimizer.load_state_dict(torch.load(buffer, weights_only=True))
    assert flows.misplaced_state(optimizer) == []
    assert_same_training([(params, optimizer), (twin_params, twin)])
