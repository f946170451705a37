# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The HDO's copies queued on a thread of their own (``copy_thread``) step exactly as the
calling thread's queueing does, and a step that fails leaves nothing behind.

The copy thread itself runs its jobs in order on one thread, and keeps a job's error for the
caller without stopping the jobs after it. With the switch on, each test runs the same
parameters and gradients through an HDO queueing its copies on the calling thread and one
queueing them on the copy thread, and compares parameters and state with ``torch.equal``; the
buckets are small, packed, and in parts, with gradients missing at some steps. On a host
without CUDA the copies are host copies, on the same thread and in the same order.
"""

import threading
import time

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

# The copy thread is the fork's own; upstream queues its copies from hooks.
pytestmark = pytest.mark.skipif(
    not getattr(hybrid_optimizer, "FORK_IMPLEMENTATION", False), reason="the fork's step"
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PART_BYTES = 64 << 10
# Small copies packed together, two copies in parts, one a bucket of its own.
SIZES = [16, 40_001, 3, (30, 31), 77, 9, 16_384, 20_000, 5]


def copy_thread_module():
    # pylint: disable=import-outside-toplevel
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer_copy_thread

    return hybrid_optimizer_copy_thread


def hdo_class(copy_thread: bool, **attributes):
    """The HDO with its copies queued on the copy thread or not, and buckets of a part."""
    attributes = {"copy_thread": copy_thread, "host_part_bytes": PART_BYTES, **attributes}
    return type("HybridDeviceOptimizer", (hybrid_optimizer.HybridDeviceOptimizer,), attributes)


def build(cls, monkeypatch, overlap=True, pinned=True):
    """Parameters and an HDO over them, its host buckets an eighth of a part. Unpinned (on
    CUDA), every host copy goes up through its bucket's slot."""
    monkeypatch.setattr(hybrid_optimizer, "_HOST_BUCKET_BYTES", PART_BYTES // 8)
    params, optimizer = build_hdo(cls, SIZES, 1.0, device=DEVICE)
    # Both are read when the ring is planned, on first use.
    optimizer.overlap_cpu_optimizer_d2h_h2d = overlap
    optimizer.pin_cpu_params = pinned
    assert (optimizer._ring_plan.slots > 1) == overlap
    return params, optimizer


def some_grads(step, index):
    """Gradients missing: one small copy every other step, a copy in parts at the third."""
    return {2: step % 2 == 0, 1: step != 2}.get(index, True)


@pytest.fixture(name="threads")
def _threads():
    """Two host threads at least, so that the step has one to leave to the copy thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield torch.get_num_threads()
    torch.set_num_threads(before)


# ---------------------------------------------------------------------- the thread itself


def test_jobs_run_in_the_order_handed_out_on_one_other_thread():
    copies = copy_thread_module().CopyThread()
    seen = []
    for index in range(40):
        copies.hand_out(lambda index=index: seen.append((index, threading.get_ident())))
    copies.finish()
    assert [index for index, _ in seen] == list(range(40))
    assert len({ident for _, ident in seen}) == 1
    assert seen[0][1] != threading.get_ident()


def test_waiting_for_a_job_returns_once_it_and_those_before_it_have_run():
    copies = copy_thread_module().CopyThread()
    seen = []
    copies.hand_out(lambda: (time.sleep(0.05), seen.append("slow")))
    ticket = copies.hand_out(lambda: seen.append("second"))
    copies.hand_out(lambda: (time.sleep(0.2), seen.append("last")))
    copies.wait_for(ticket)
    assert seen == ["slow", "second"]
    copies.finish()
    assert seen == ["slow", "second", "last"]


def test_a_job_s_error_is_raised_once_and_the_jobs_after_it_still_run():
    copies = copy_thread_module().CopyThread()
    seen = []

    def fail():
        raise ValueError("job failed")

    copies.hand_out(fail)
    copies.hand_out(lambda: seen.append("after"))
    copies.finish()
    assert seen == ["after"]
    with pytest.raises(ValueError, match="job failed"):
        copies.check()
    copies.check()  # raised once: a later step does not see it again


# ---------------------------------------------------------------------- the step


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "staged"])
@pytest.mark.parametrize("overlap", [True, False], ids=["ring", "one-slot"])
def test_copies_queued_on_the_copy_thread_step_exactly_as_on_the_calling_thread(
    overlap, pinned, threads, monkeypatch
):  # pylint: disable=unused-argument
    cls = hdo_class(True)
    queued_on = []
    queue_copies = cls._queue_copies

    def noting_thread(self, *args):
        queued_on.append(threading.get_ident())
        return queue_copies(self, *args)

    monkeypatch.setattr(cls, "_queue_copies", noting_thread)
    built = build(cls, monkeypatch, overlap, pinned)
    reference = build(hdo_class(False), monkeypatch, overlap, pinned)
    for params, optimizer in (built, reference):
        train_drawn(params, optimizer, 4, seed=5, has_grad=some_grads)
    assert_same(built, reference)
    assert len(built[1]._buckets) > 6
    assert any(bucket.parted is not None for bucket in built[1]._buckets)
    assert any(bucket.packed for bucket in built[1]._buckets)
    # Every bucket's copies but the last's went out from the copy thread.
    caller = threading.get_ident()
    assert sum(ident != caller for ident in queued_on) == 4 * (len(built[1]._buckets) - 1)


def test_host_steps_run_with_one_host_thread_fewer_and_the_count_comes_back(threads, monkeypatch):
    counts = []
    for target in (hybrid_optimizer.FlatAdamStep, hybrid_optimizer.PartedCopy):
        name = "step" if target is hybrid_optimizer.FlatAdamStep else "step_part"
        original = getattr(target, name)

        def counting(*args, original=original, **kwargs):
            counts.append(torch.get_num_threads())
            return original(*args, **kwargs)

        monkeypatch.setattr(target, name, counting)
    for copy_thread, during in ((True, threads - 1), (False, threads)):
        counts.clear()
        params, optimizer = build(hdo_class(copy_thread), monkeypatch)
        train_drawn(params, optimizer, 2, seed=1)
        assert counts and set(counts) == {during}, copy_thread
        assert torch.get_num_threads() == threads


def test_a_copy_job_that_fails_fails_the_step_and_every_bucket_stepped_goes_up(
    threads, monkeypatch
):
    cls = hdo_class(True)
    download = cls._download
    lost = []

    def losing(self, index):
        if index in lost and threading.get_ident() != caller:
            raise RuntimeError(f"download of bucket {index} lost")
        return download(self, index)

    caller = threading.get_ident()
    monkeypatch.setattr(cls, "_download", losing)
    params, optimizer = build(cls, monkeypatch)
    train_drawn(params, optimizer, 1, seed=2)  # the ring and the state exist
    buckets = optimizer._buckets
    slots = optimizer._ring_plan.slots
    failing = slots + 2  # its download is queued by bucket 2's copies, on the copy thread
    assert buckets[2].follower == failing

    def hosts(bucket):  # the bucket's own elements of its host copies
        return [bucket.sliced(optimizer.param_to_inner_param[p]).clone() for p in bucket.params]

    before = [hosts(bucket) for bucket in buckets]
    lost.append(failing)
    for param in params:
        param.grad = torch.randn(param.shape).to(DEVICE, param.dtype)
    with pytest.raises(RuntimeError, match=f"download of bucket {failing} lost"):
        optimizer.step()
    assert torch.get_num_threads() == threads
    stepped = []
    for index, bucket in enumerate(buckets):
        changed = [not torch.equal(a, b) for a, b in zip(hosts(bucket), before[index])]
        assert all(changed) or not any(changed), index
        stepped.append(all(changed))
    # The step goes on until it sees the error: after bucket 3 (the first host step after
    # bucket 2's copies were handed out), before the bucket whose download was lost.
    last = stepped.count(True)
    assert stepped == [True] * last + [False] * (len(buckets) - last)
    assert 4 <= last <= failing
    for index, bucket in enumerate(buckets):
        for param in bucket.params:  # the last one stepped too: its copies went out
            host = bucket.sliced(optimizer.param_to_inner_param[param])
            assert torch.equal(bucket.sliced(param.detach()).cpu(), host.to(param.dtype)), index
    lost.clear()  # the next step does not see the error again
    optimizer.zero_grad()
    train_drawn(params, optimizer, 1, seed=3)
    for param in params:
        host = optimizer.param_to_inner_param[param]
        assert torch.equal(param.detach().cpu(), host.to(param.dtype))
