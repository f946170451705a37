# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The in-place sub-optimizer's step on a thread of its own, beside the host steps.

TE's FusedAdam walks its parameters in Python before its kernels (tens of ms for thousands of
tensors), and on the thread that calls ``step()`` that adds to the host steps. Host AdamW must
stay on that thread: off it, torch's OpenMP regions get a second team and both teams sleep
between regions (``benchmarks/host_adam_threads.py``). The in-place side of the step (its
fp32 clones' widened gradients, the in-place step, the clones copied back) has no OpenMP
regions of note, only Python and kernel launches, and the host kernels release the GIL, so it
can run on a worker thread while the calling thread steps the host buckets.

CUDA's current device and stream and torch's grad mode are per thread: the worker takes the
caller's stream of the in-place parameters' device, so their kernels queue in the caller's
order, and gradients are off.
"""

import contextlib
import sys
import threading
from typing import Callable, Iterator, List, Optional

import torch

# Seconds a thread may hold the GIL while another waits for it, while the worker runs. CPython's
# default (5 ms) let the worker's Python keep the calling thread waiting after each host kernel.
SWITCH_INTERVAL_S = 1e-4


@contextlib.contextmanager
def run_beside(
    work: Callable[[], None], on_thread: bool, device: Optional[torch.device] = None
) -> Iterator[None]:
    """Run ``work`` on a worker thread while the ``with`` body runs, or before it.

    The worker is joined when the body ends, however it ends, so that no thread outlives the
    step. Its exception is raised then; where the body raised one, that one goes on, with the
    worker's as its context.

    Args:
        work: what runs beside the body (the in-place side of the step).
        on_thread: run it on a worker thread; False runs it first, on this thread.
        device: where ``work`` launches its kernels: a CUDA device gets the caller's current
            stream of that device on the worker.
    """
    if not on_thread:
        work()
        yield
        return
    errors: List[BaseException] = []
    stream = None
    if device is not None and device.type == "cuda":
        stream = torch.cuda.current_stream(device)

    def run():
        try:
            with torch.no_grad(), _on_caller_stream(stream):
                work()
        except BaseException as error:  # pylint: disable=broad-except
            errors.append(error)  # raised again on the calling thread

    worker = threading.Thread(target=run, name="hdo-in-place-step", daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, SWITCH_INTERVAL_S))
    try:
        worker.start()
        try:
            yield
        except BaseException as error:
            worker.join()
            if errors and error.__context__ is None:
                error.__context__ = errors[0]
            raise
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    if errors:
        raise errors[0]


def _on_caller_stream(stream) -> contextlib.AbstractContextManager:
    """The caller's CUDA device and stream on this thread (nothing where there is none)."""
    if stream is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.cuda.device(stream.device))
    stack.enter_context(torch.cuda.stream(stream))
    return stack
