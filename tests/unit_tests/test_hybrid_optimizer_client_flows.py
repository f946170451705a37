# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""GPU: what RL frameworks do with an offloading optimizer between training phases.

Megatron-core's DDP and DistributedOptimizer with a HybridDeviceOptimizer inside, as
``get_megatron_optimizer(optimizer_cpu_offload=True)`` builds it, world size 1. Each flow
frees the accelerator state and brings it back (or, after a ``dp_reshardable`` load, replaces
``_update_fp32_params_by_new_state`` on the class and syncs, as SkyRL does), then trains next
to a twin that never did: the parameters must stay ``torch.equal``. The accelerator memory
the offload frees must be the state of the parameters stepped in place, and what comes back
must be no more than that. With ``HDO_FLOW_RESULTS`` set to a file, each case appends its
figures there as a JSON line (run it against upstream with ``MEGATRON_OPTIMIZER_FORK=0``).
"""

import json
import os

import pytest
import torch

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    import optimizer_table
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests import optimizer_table

flows = optimizer_table.sibling("hdo_client_flows")
fixture_parallel_state = optimizer_table.sibling("single_rank").fixture_parallel_state
_hybrid_optimizer_in_distributed_optimizer = optimizer_table.sibling(
    "test_hybrid_optimizer_in_distributed_optimizer"
)
batches = _hybrid_optimizer_in_distributed_optimizer.batches
build = _hybrid_optimizer_in_distributed_optimizer.build
load_dist = _hybrid_optimizer_in_distributed_optimizer.load_dist
save_dist = _hybrid_optimizer_in_distributed_optimizer.save_dist
train = _hybrid_optimizer_in_distributed_optimizer.train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# About 1.6M parameters: 12 MiB of fp32 moments, well above allocator rounding.
HIDDEN = 512
STEPS = 3


def hdos_of(optimizer):
    return [member.optimizer for member in optimizer.chained_optimizers]


def state_bytes(optimizer, keys=None):
    return sum(flows.accelerator_state_bytes(hdo, keys) for hdo in hdos_of(optimizer))


def offload_by_reassignment(optimizer):
    for hdo in hdos_of(optimizer):
        flows.offload_state_by_reassignment(hdo)


def reload_by_the_hdo(optimizer):
    for hdo in hdos_of(optimizer):
        flows.reload_state_by_the_hdo(hdo)


def reload_moments(optimizer):
    for hdo in hdos_of(optimizer):
        flows.reload_moments_to_the_accelerator(hdo)


# flow -> (offload, reload, state keys the reload brings back; None: all)
ROUND_TRIPS = {
    "reassign+move_new_state": (offload_by_reassignment, reload_by_the_hdo, None),
    "reassign+moments_to_cuda": (offload_by_reassignment, reload_moments, flows.MOMENTS),
    "offload_to_cpu+restore": (lambda o: o.offload_to_cpu(), lambda o: o.restore_from_cpu(), None),
}
FLOWS = sorted(ROUND_TRIPS) + ["patched_master_update+sync_after_load"]


def record(case, **figures):
    """Append the case's figures to ``HDO_FLOW_RESULTS``, if set."""
    path = os.environ.get("HDO_FLOW_RESULTS")
    if path:
        fork = os.environ.get("MEGATRON_OPTIMIZER_FORK", "1") != "0"
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps({"impl": "fork" if fork else "upstream", **case, **figures}))
            out.write("\n")


def assert_equal_models(actual, expected):
    for index, (a, e) in enumerate(zip(actual.parameters(), expected.parameters())):
        assert torch.equal(a, e), f"param {index}: max diff {(a.float() - e.float()).abs().max()}"


def _round_trip(case, flow, fraction, precision_aware):
    model, optimizer = build(fraction, seed=1, precision_aware=precision_aware, hidden=HIDDEN)
    twin_model, twin = build(fraction, seed=1, precision_aware=precision_aware, hidden=HIDDEN)
    data = batches(STEPS, seed=2, hidden=HIDDEN)
    train(model, optimizer, data)
    train(twin_model, twin, data)
    offload, reload, keys = ROUND_TRIPS[flow]
    in_place, brought_back = state_bytes(optimizer), state_bytes(optimizer, keys)
    with flows.measured_memory():
        before = flows.allocated()
        offload(optimizer)
        offloaded = flows.allocated()
        reload(optimizer)
        reloaded = flows.allocated()
    figures = dict(
        in_place_state=in_place,
        freed_by_offload=before - offloaded,
        added_by_reload=reloaded - offloaded,
        expected_back=brought_back,
    )
    record(case, **figures)
    return model, optimizer, twin_model, twin, figures


def _resume_with_patched_master_update(case, fraction, precision_aware, folder, monkeypatch):
    calls = []
    update_masters = flows.client_master_update(calls)

    # pylint: disable-next=import-outside-toplevel
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    monkeypatch.setattr(HybridDeviceOptimizer, "_update_fp32_params_by_new_state", update_masters)
    model, optimizer = build(fraction, seed=1, precision_aware=precision_aware, hidden=HIDDEN)
    train(model, optimizer, batches(STEPS, seed=2, hidden=HIDDEN))
    save_dist(model, optimizer, folder, "dp_reshardable")
    resumed_model, resumed = build(
        fraction, seed=11, precision_aware=precision_aware, hidden=HIDDEN
    )
    load_dist(resumed_model, resumed, folder, "dp_reshardable")
    with flows.measured_memory():
        before = flows.allocated()
        for hdo in hdos_of(resumed):
            hdo._sync_hdo_state_to_sub_optimizers()  # pylint: disable=protected-access
        synced = flows.allocated()
    figures = dict(
        in_place_state=state_bytes(resumed),
        added_by_sync=synced - before,
        patched_update_called=bool(calls),
    )
    record(case, **figures)
    return resumed_model, resumed, model, optimizer, figures


@pytest.mark.parametrize("flow", FLOWS)
@pytest.mark.parametrize("precision_aware", [True, False], ids=["precision_aware", "fp32_main"])
@pytest.mark.parametrize("fraction", optimizer_table.OFFLOADED_FRACTIONS)
def test_a_client_flow_frees_the_right_memory_and_trains_like_a_twin(
    parallel_state, tmp_path, monkeypatch, fraction, precision_aware, flow
):
    # pylint: disable=redefined-outer-name,unused-argument,too-many-arguments
    case = dict(flow=flow, fraction=fraction, precision_aware=precision_aware)
    if flow in ROUND_TRIPS:
        model, optimizer, twin_model, twin, figures = _round_trip(
            case, flow, fraction, precision_aware
        )
    else:
        model, optimizer, twin_model, twin, figures = _resume_with_patched_master_update(
            case, fraction, precision_aware, str(tmp_path), monkeypatch
        )
    follow_up = batches(STEPS, seed=3, hidden=HIDDEN)
    try:
        train(model, optimizer, follow_up)
        train(twin_model, twin, follow_up)
        exact = all(torch.equal(a, e) for a, e in zip(model.parameters(), twin_model.parameters()))
        record(case, exact=exact)
    except Exception as error:
        record(case, error=f"{type(error).__name__}: {str(error)[:200]}")
        raise

    if flow in ROUND_TRIPS:
        if flow.startswith("offload_to_cpu"):  # main copies move too
            assert figures["freed_by_offload"] >= figures["in_place_state"]
            assert figures["added_by_reload"] == figures["freed_by_offload"]
        else:
            assert figures["freed_by_offload"] == figures["in_place_state"]
            assert figures["added_by_reload"] == figures["expected_back"]
    else:
        assert figures["patched_update_called"]
        assert figures["added_by_sync"] <= 0
    for hdo in hdos_of(optimizer):
        assert flows.misplaced_state(hdo) == []
    assert_equal_models(model, twin_model)
