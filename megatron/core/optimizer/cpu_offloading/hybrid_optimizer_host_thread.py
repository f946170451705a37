# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Host bucket steps on a worker thread, while the caller's thread queues the copies.

Stepped on the caller's thread, the host buckets wait for everything else the caller does in a
step: queueing each bucket's download and upload. A worker
thread steps the buckets in order instead, each once its download is queued (and, where CUDA
exists, has landed), and hands each one back to the caller, who queues its upload and the
download that reuses its slot while the worker steps the next. Torch's kernels release the
interpreter lock, so the two threads overlap wherever either is inside one.

One parallel region per tensor is what makes a host step slow on a second thread (its OpenMP
team sleeps between regions), so this pays where buckets are stepped in few regions: flat
buckets (:mod:`hybrid_optimizer_flat_step`) and large parameters.
"""

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Optional

import torch


def _callers_settings() -> Callable[[], None]:
    """What makes another thread compute as this one does: torch's thread count and denormal
    mode are per thread (a client may change them between steps), and so is the current CUDA
    device, which torch's optimizers query (device 0 on a new thread: a context there)."""
    threads = torch.get_num_threads()
    # torch has no getter for flush-denormal; a denormal float survives only with it off.
    flush_denormal = torch.tensor(1e-40).item() == 0.0
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def apply():
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        torch.set_flush_denormal(flush_denormal)
        if device is not None:
            torch.cuda.set_device(device)

    return apply


class HostStepThread:
    """One worker thread, started on first use and ended when this object is collected."""

    def __init__(self):
        self._executor: Optional[ThreadPoolExecutor] = None

    def run(
        self,
        count: int,
        queued: Iterable[int],
        step: Callable[[int], None],
        stepped: Callable[[int], Optional[int]],
    ):
        """Step buckets ``0 .. count - 1`` in order on the worker.

        Args:
            count: the number of buckets.
            queued: the buckets that may be stepped at once (downloads queued, or none due).
            step: steps bucket ``i``; runs on the worker.
            stepped: the caller's work once bucket ``i`` is stepped; returns the bucket whose
                download it queued, if any, which the worker may then step.

        Raises:
            Whatever ``step`` or ``stepped`` raised; the worker has stopped
            by then, so nothing is stepped after the error.
        """
        ready = [threading.Event() for _ in range(count)]
        for index in queued:
            ready[index].set()
        cancelled = threading.Event()
        done: "queue.SimpleQueue[Optional[int]]" = queue.SimpleQueue()
        as_the_caller = _callers_settings()

        def work():
            finished = 0
            try:
                as_the_caller()
                for index in range(count):
                    ready[index].wait()
                    if cancelled.is_set():
                        return
                    step(index)
                    done.put(index)
                    finished += 1
            finally:
                if finished < count:
                    done.put(None)  # the caller stops waiting for the rest

        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="hdo-host-steps")
        future = self._executor.submit(work)
        try:
            for _ in range(count):
                index = done.get()
                if index is None:
                    break
                follower = stepped(index)
                if follower is not None:
                    ready[follower].set()
        except BaseException:
            cancelled.set()
            for event in ready:
                event.set()
            future.exception()  # waits for the bucket being stepped, if any
            raise
        future.result()  # the worker's error, if it had one
