# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Host buckets stepped on a worker thread: the same results, in the same order, no leftovers.

With ``threaded_host_steps`` the HDO's host buckets are stepped on a worker thread while the
caller queues the copies (``HostStepThread``). Each test runs that beside the caller-thread
step on the same inputs and compares parameters and state with ``torch.equal``, checks that
every bucket is stepped on the worker after its download and before its upload, and that an
error on either thread reaches the caller with the worker stopped.
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
    not getattr(hybrid_optimizer, "FORK_IMPLEMENTATION", False), reason="the fork's host thread"
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Flat buckets, buckets of one large parameter, sizes that are not multiples of a vector;
# more buckets than the ring has slots, so that downloads wait for earlier steps.
SIZES = [16, 32, 1001, 48, 77, 4096, 3, 160, 65541, 64, (8, 12), 5] * 3
BUCKET_BYTES = 1 << 16


def make(monkeypatch, fraction, threaded, seed=0):
    """An HDO over SIZES in host buckets of BUCKET_BYTES, stepped on a worker or not."""
    monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", BUCKET_BYTES)
    hdo_class = hybrid_optimizer.HybridDeviceOptimizer
    params, optimizer = build_hdo(hdo_class, SIZES, fraction, seed=seed, device=DEVICE)
    optimizer.threaded_host_steps = threaded
    return params, optimizer


def train(params, optimizer, steps, seed):
    """Drawn gradients, one parameter without one every third step, the lr changing."""

    def after(opt):
        for group in opt.param_groups:
            group["lr"] *= 0.7

    train_drawn(
        params,
        optimizer,
        steps,
        seed,
        has_grad=lambda step, index: (step + index) % 7 != 3,
        check=after,
    )


@pytest.mark.parametrize("flat", [True, False], ids=["flat", "per-copy"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_threaded_host_steps_equal_the_callers_own(fraction, flat, monkeypatch):
    params, optimizer = make(monkeypatch, fraction, threaded=True)
    optimizer.flat_host_steps = flat
    train(params, optimizer, 6, seed=5)
    assert len(optimizer._buckets) > optimizer._ring_plan.slots > 0
    assert any(bucket.flat is not None for bucket in optimizer._buckets) == flat
    reference_params, reference = make(monkeypatch, fraction, threaded=False)
    reference.flat_host_steps = flat
    train(reference_params, reference, 6, seed=5)
    assert_same((params, optimizer), (reference_params, reference))


def record(monkeypatch, optimizer, events):
    """Note ``(what, bucket index, thread)`` of each download, host step and upload."""
    index_of = {id(bucket): index for index, bucket in enumerate(optimizer._buckets)}

    def wrap(name, what, index_from):
        original = getattr(optimizer, name)

        def noted(arg, *args, **kwargs):
            result = original(arg, *args, **kwargs)
            events.append((what, index_from(arg), threading.get_ident()))
            return result

        monkeypatch.setattr(optimizer, name, noted)

    wrap("_download", "download", lambda index: index)
    wrap("_step_host_bucket", "step", lambda bucket: index_of[id(bucket)])
    wrap("_upload", "upload", lambda bucket: index_of[id(bucket)])


def test_each_bucket_is_stepped_on_the_worker_between_its_download_and_upload(monkeypatch):
    params, optimizer = make(monkeypatch, 1.0, threaded=True)
    train(params, optimizer, 1, seed=1)  # builds the buckets and the ring
    events = []
    record(monkeypatch, optimizer, events)
    train(params, optimizer, 2, seed=2)
    caller = threading.get_ident()
    buckets = len(optimizer._buckets)
    assert len(events) == 2 * 3 * buckets
    for first in (0, 3 * buckets):  # each step
        step = events[first : first + 3 * buckets]
        position = {(what, index): at for at, (what, index, _) in enumerate(step)}
        assert [index for what, index, _ in step if what == "step"] == list(range(buckets))
        for index in range(buckets):
            assert position["download", index] < position["step", index]
            assert position["step", index] < position["upload", index]
        for what, _, thread in step:
            assert (thread == caller) == (what != "step"), what


def test_an_error_in_a_host_step_reaches_the_caller_and_stops_the_worker(monkeypatch):
    params, optimizer = make(monkeypatch, 1.0, threaded=True)
    train(params, optimizer, 1, seed=1)
    events = []
    record(monkeypatch, optimizer, events)
    failing = optimizer._buckets[2]
    original = failing.optimizer.step

    def fail(*args, **kwargs):
        raise RuntimeError("host step failed")

    failing.optimizer.step = fail
    failing.flat = None  # the sub-optimizer's own step runs
    with pytest.raises(RuntimeError, match="host step failed"):
        train(params, optimizer, 1, seed=2)
    steps = [index for what, index, _ in events if what == "step"]
    assert steps == [0, 1]  # nothing after the failed bucket was stepped
    failing.optimizer.step = original
    train(params, optimizer, 1, seed=3)  # the optimizer steps again
    assert [index for what, index, _ in events if what == "step"][2:] == list(
        range(len(optimizer._buckets))
    )


def test_an_error_on_the_callers_side_stops_the_worker_before_it_steps_on(monkeypatch):
    params, optimizer = make(monkeypatch, 1.0, threaded=True)
    train(params, optimizer, 1, seed=1)
    events = []
    record(monkeypatch, optimizer, events)
    upload = optimizer._upload

    def upload_fails_at_one(bucket, *args, **kwargs):
        if bucket is optimizer._buckets[1]:
            raise RuntimeError("upload failed")
        return upload(bucket, *args, **kwargs)

    monkeypatch.setattr(optimizer, "_upload", upload_fails_at_one)
    with pytest.raises(RuntimeError, match="upload failed"):
        train(params, optimizer, 1, seed=2)
    steps = [index for what, index, _ in events if what == "step"]
    # Buckets 0 .. slots - 1 were downloaded up front and bucket 0's follower after its step;
    # the follower of bucket 1 was downloaded, but its upload failed before it was handed on.
    assert steps == list(range(len(steps))) and 2 <= len(steps) <= optimizer._ring_plan.slots + 1
    # The worker had stopped when the error reached the caller: nothing is stepped later.
    optimizer._host_thread._executor.submit(lambda: None).result()
    assert [index for what, index, _ in events if what == "step"] == steps


def test_an_error_in_the_in_place_step_steps_no_host_bucket(monkeypatch):
    """A step that fails before any upload must leave nothing half-stepped: retried, it then
    gives what one step gives on the caller's thread."""
    params, optimizer = make(monkeypatch, 0.5, threaded=True)
    reference_params, reference = make(monkeypatch, 0.5, threaded=False)
    for pair in ((params, optimizer), (reference_params, reference)):
        train(*pair, 1, seed=1)
    events = []
    record(monkeypatch, optimizer, events)
    in_place = optimizer.gpu_optimizer.step
    host_step = optimizer._step_host_bucket
    host_stepped = threading.Event()

    def noted_host_step(bucket):
        host_stepped.set()
        host_step(bucket)

    def fails():
        host_stepped.wait(timeout=1.0)  # a worker already running would step meanwhile
        raise RuntimeError("in place")

    monkeypatch.setattr(optimizer, "_step_host_bucket", noted_host_step)
    monkeypatch.setattr(optimizer.gpu_optimizer, "step", fails)
    with pytest.raises(RuntimeError, match="in place"):
        train(params, optimizer, 1, seed=2)
    assert not [event for event in events if event[0] == "step"]
    monkeypatch.setattr(optimizer.gpu_optimizer, "step", in_place)
    train(params, optimizer, 1, seed=2)
    train(reference_params, reference, 1, seed=2)
    assert_same((params, optimizer), (reference_params, reference))


def _tiny_gradient_steps(params, optimizer, steps, seed):
    """Gradients small enough that their squares are denormal floats."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for param in params:
            grad = torch.randn(param.shape, generator=generator) * 1e-21
            param.grad = grad.to(param.device, param.dtype)
        optimizer.step()


def test_the_worker_takes_the_callers_denormal_mode_at_each_step(monkeypatch):
    """Flush-denormal is a per-thread setting; set after the worker exists, it must still
    decide the host steps as it does on the caller's thread."""
    pairs = [make(monkeypatch, 1.0, threaded=threaded) for threaded in (True, False)]
    for pair in pairs:
        _tiny_gradient_steps(*pair, 1, seed=1)  # the worker exists from here on
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        for pair in pairs:
            _tiny_gradient_steps(*pair, 2, seed=2)
    finally:
        torch.set_flush_denormal(False)
    (params, optimizer), (reference_params, reference) = pairs
    assert_same((params, optimizer), (reference_params, reference))
    squares = [s["exp_avg_sq"] for s in reference.state.values() if "exp_avg_sq" in s]
    assert any(bool((square == 0).any()) for square in squares)  # the flush mattered


def test_the_worker_takes_the_callers_thread_count_and_device(monkeypatch):
    params, optimizer = make(monkeypatch, 1.0, threaded=True)
    train(params, optimizer, 1, seed=1)
    seen, devices_set = [], []
    host_step = optimizer._step_host_bucket

    def noted(bucket):
        seen.append((threading.get_ident(), torch.get_num_threads()))
        host_step(bucket)

    monkeypatch.setattr(optimizer, "_step_host_bucket", noted)
    # The caller's current CUDA device, as a rank other than 0 has it (faked on any host).
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", devices_set.append)
    threads = torch.get_num_threads()
    wanted = 1 if threads > 1 else 2
    torch.set_num_threads(wanted)
    try:
        train(params, optimizer, 1, seed=2)
    finally:
        torch.set_num_threads(threads)
    assert seen and all(thread != threading.get_ident() for thread, _ in seen)
    assert {count for _, count in seen} == {wanted}
    assert devices_set and set(devices_set) == {3}
