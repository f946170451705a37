# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""With ``in_place_step_on_thread``, the in-place step runs on a worker beside the host steps.

Each test runs the HDO beside the same one stepping in place first, on the calling thread,
and compares parameters and state with ``torch.equal``; step hooks on the sub-optimizers
record where and when they ran. Errors on either thread reach the caller, no worker outlives
its step, and the worker queues its kernels on the caller's device and stream.
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
    not getattr(hybrid_optimizer, "FORK_IMPLEMENTATION", False), reason="the fork's threads"
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WORKER = "hdo-in-place-step"
# More host buckets than ring slots, packed small ones among them; half stays in place.
SIZES = [16, 40_001, 3, (300, 301), 32_768, 77, 16_385, 5, 9_000, 12_000]


def make(on_thread, monkeypatch, seed=0):
    """Parameters and a half-offloaded HDO over them, its in-place step on a worker or not."""
    monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", 64 << 10)
    hdo_class = type("HybridDeviceOptimizer", (hybrid_optimizer.HybridDeviceOptimizer,), {})
    hdo_class.in_place_step_on_thread = on_thread
    params, optimizer = build_hdo(hdo_class, SIZES, 0.5, seed=seed, device=DEVICE)
    optimizer._ensure_built()
    assert optimizer.gpu_optimizer is not None and optimizer.cpu_optimizers
    return params, optimizer


def hand_out_grads(params):
    for param in params:
        param.grad = torch.ones_like(param)


def workers_alive():
    return [t for t in threading.enumerate() if t.name == WORKER and t.is_alive()]


def test_the_in_place_step_on_a_worker_steps_exactly_as_on_the_caller(monkeypatch):
    built, reference = make(True, monkeypatch), make(False, monkeypatch)
    where = {}

    def note(name):
        def hook(*_):
            where.setdefault(name, threading.current_thread().name)

        return hook

    for name, (_, optimizer) in (("built", built), ("reference", reference)):
        optimizer.gpu_optimizer.register_step_pre_hook(note(name))

    def after(opt):
        for group in opt.param_groups:
            group["lr"] *= 0.7

    has_grad = lambda step, index: (step + index) % 4 != 1  # pylint: disable=C3001
    for params, optimizer in (built, reference):
        train_drawn(params, optimizer, 4, 5, has_grad=has_grad, check=after)
    assert_same(built, reference)
    assert where == {"built": WORKER, "reference": threading.current_thread().name}
    assert not workers_alive()


def test_the_in_place_step_runs_while_the_host_steps_run(monkeypatch):
    params, optimizer = make(True, monkeypatch)
    # The in-place step and the first host step meet halfway: run one after the other, in
    # either order, the first to arrive waits in vain and the barrier breaks.
    meeting = threading.Barrier(2, timeout=10)
    met = []

    def meet(*_):
        try:
            meeting.wait()
            met.append(True)
        except threading.BrokenBarrierError:
            met.append(False)

    optimizer.cpu_optimizers[0].register_step_pre_hook(meet)
    optimizer.gpu_optimizer.register_step_pre_hook(meet)
    hand_out_grads(params)
    optimizer.step()
    assert met == [True, True]


def test_state_is_listed_in_parameter_order(monkeypatch):
    for on_thread in (True, False):
        params, optimizer = make(on_thread, monkeypatch)
        hand_out_grads(params)
        optimizer.step()
        assert list(optimizer.state) == params, on_thread


def test_an_error_in_the_in_place_step_reaches_the_caller(monkeypatch):
    params, optimizer = make(True, monkeypatch)
    where = []

    def fail(*_):
        where.append(threading.current_thread().name)
        raise RuntimeError("in-place step failed")

    optimizer.gpu_optimizer.register_step_pre_hook(fail)
    hand_out_grads(params)
    with pytest.raises(RuntimeError, match="in-place step failed"):
        optimizer.step()
    assert where == [WORKER]  # raised on the worker, raised again here
    assert not workers_alive()


def test_an_error_in_a_host_step_waits_for_the_worker_and_wins(monkeypatch):
    params, optimizer = make(True, monkeypatch)
    finished = []

    def fail(*_):
        raise RuntimeError("host step failed")

    def slow_in_place_failure(*_):
        threading.Event().wait(0.2)
        finished.append(True)
        raise RuntimeError("in-place step failed")

    optimizer.cpu_optimizers[0].register_step_pre_hook(fail)
    optimizer.gpu_optimizer.register_step_pre_hook(slow_in_place_failure)
    hand_out_grads(params)
    with pytest.raises(RuntimeError, match="host step failed") as raised:
        optimizer.step()
    assert finished == [True]  # the step returned only once the worker had ended
    assert "in-place step failed" in str(raised.value.__context__)
    assert not workers_alive()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams")
def test_the_worker_queues_on_the_callers_device_and_stream(monkeypatch):
    params, optimizer = make(True, monkeypatch)
    seen = []
    optimizer.gpu_optimizer.register_step_pre_hook(
        lambda *_: seen.append((torch.cuda.current_device(), torch.cuda.current_stream()))
    )
    hand_out_grads(params)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        optimizer.step()
    torch.cuda.synchronize()
    assert seen == [(stream.device.index, stream)]
