# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The host steps run on a worker thread beside the in-place step and the copies' queueing.

Each test runs the HDO beside the same one stepping its host buckets on the calling thread
(``host_steps_on_thread = False``) and compares parameters and state with ``torch.equal``; the
sub-optimizers' step hooks record where they ran. Errors on either thread reach the caller,
and no worker outlives its step.
"""

import threading

import pytest
import torch

from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    from hdo_client_flows import build_hdo
    from test_hybrid_optimizer_packed_copies import assert_same
    from test_optimizer_cpu_offloading import train_drawn
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests.hdo_client_flows import build_hdo
    from tests.unit_tests.test_hybrid_optimizer_packed_copies import assert_same
    from tests.unit_tests.test_optimizer_cpu_offloading import train_drawn

pytestmark = pytest.mark.skipif(
    not getattr(hybrid_optimizer, "FORK_IMPLEMENTATION", False), reason="the fork's host steps"
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BUCKET_BYTES = 64 << 10
# More buckets than ring slots (so downloads wait for slots), packed small ones among them.
SIZES = [16, 40_001, 3, (300, 301), 32_768, 77, 16_385, 5, 9_000, 12_000]


def make(on_thread, monkeypatch, fraction=0.5, seed=0, part_bytes=0):
    """Parameters and an HDO over them, its host steps on a worker thread or not."""
    monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", BUCKET_BYTES)
    hdo_class = type("HybridDeviceOptimizer", (hybrid_optimizer.HybridDeviceOptimizer,), {})
    hdo_class.host_steps_on_thread = on_thread
    hdo_class.host_part_bytes = part_bytes
    return build_hdo(hdo_class, SIZES, fraction, seed=seed, device=DEVICE)


def train(built, steps, seed, has_grad=lambda step, index: True):
    """Drawn gradients; the learning rate changes after each step."""

    def after(opt):
        for group in opt.param_groups:
            group["lr"] *= 0.7

    train_drawn(*built, steps, seed, has_grad=has_grad, check=after)


def record_threads(optimizer, seen):
    """Hook every host sub-optimizer's step to note the thread it runs on."""
    for sub in optimizer.cpu_optimizers:
        sub.register_step_pre_hook(lambda *_: seen.add(threading.current_thread().name))


def workers_alive():
    return [t for t in threading.enumerate() if t.name == "hdo-host-steps" and t.is_alive()]


@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("part_bytes", [0, 64 << 10], ids=["whole", "parts"])
def test_host_steps_on_a_worker_thread_step_exactly_as_on_the_caller(
    fraction, part_bytes, monkeypatch
):
    built, reference = (
        make(True, monkeypatch, fraction, part_bytes=part_bytes),
        make(False, monkeypatch, fraction, part_bytes=part_bytes),
    )
    seen, seen_reference = set(), set()
    built[1]._ensure_built()
    reference[1]._ensure_built()
    record_threads(built[1], seen)
    record_threads(reference[1], seen_reference)
    # Some parameters skip steps, so buckets keep some copies and skip others entirely.
    has_grad = lambda step, index: (step + index) % 4 != 1
    train(built, 4, seed=5, has_grad=has_grad)
    train(reference, 4, seed=5, has_grad=has_grad)
    assert_same(built, reference)
    assert len(built[1]._buckets) > built[1]._ring_plan.slots  # slots were reused
    assert seen_reference == {threading.current_thread().name}
    if part_bytes == 0:  # parts step in their own kernel calls, on the calling thread
        assert seen == {"hdo-host-steps"}
    assert not workers_alive()


def test_an_error_in_a_host_step_reaches_the_caller_and_stops_the_worker(monkeypatch):
    params, optimizer = make(True, monkeypatch)
    optimizer._ensure_built()
    where = []

    def fail(*_):
        where.append(threading.current_thread().name)
        raise RuntimeError("host step failed")

    optimizer.cpu_optimizers[-1].register_step_pre_hook(fail)
    for param in params:
        param.grad = torch.ones_like(param)
    with pytest.raises(RuntimeError, match="host step failed"):
        optimizer.step()
    assert where == ["hdo-host-steps"]
    assert not workers_alive()


def test_an_error_in_the_in_place_step_stops_the_worker(monkeypatch):
    params, optimizer = make(True, monkeypatch)
    optimizer._ensure_built()
    assert optimizer.gpu_optimizer is not None
    stepped = set()
    record_threads(optimizer, stepped)

    def fail(*_):
        raise RuntimeError("in-place step failed")

    optimizer.gpu_optimizer.register_step_pre_hook(fail)
    for param in params:
        param.grad = torch.ones_like(param)
    with pytest.raises(RuntimeError, match="in-place step failed"):
        optimizer.step()
    assert stepped <= {"hdo-host-steps"}  # whatever the worker stepped before it stopped
    assert not workers_alive()
