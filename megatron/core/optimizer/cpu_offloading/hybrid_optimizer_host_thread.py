# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The host steps of one HDO step on a thread of their own, beside the step's other work.

The thread that calls ``step()`` also launches the in-place sub-optimizer (for TE's FusedAdam,
a Python loop over its parameters), queues each bucket's download and upload, and copies
pageable host copies into free slots. Done between the host steps, that work adds to the step;
done while a worker thread runs the host steps, it is hidden behind them. Host Adam releases
the GIL inside its kernel, so both threads make progress.

The worker steps the buckets in order. Bucket ``i`` is stepped once the calling thread has
queued its download (:meth:`HostSteps.queued`); the calling thread takes the stepped buckets
back in the same order (:meth:`HostSteps.stepped`) to queue their uploads and the downloads
that reuse their slots. An exception on the worker is raised again on the calling thread;
:meth:`HostSteps.close` stops the worker early when the calling thread fails.
"""

import queue
import threading
from typing import Callable, Sequence

import torch


class HostSteps:
    """A worker thread stepping ``buckets`` in order with ``step_bucket``.

    Args:
        buckets: the step's host buckets, in pipeline order.
        step_bucket: steps one bucket on the host once its download is queued (it waits for
            the gradients to land itself).
    """

    def __init__(self, buckets: Sequence, step_bucket: Callable[[object], None]):
        self._buckets = list(buckets)
        self._step_bucket = step_bucket
        self._queued = [threading.Event() for _ in self._buckets]
        self._done: "queue.SimpleQueue" = queue.SimpleQueue()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="hdo-host-steps", daemon=True)
        self._thread.start()

    def queued(self, index: int) -> None:
        """The download of bucket ``index`` is queued: the worker may step it."""
        self._queued[index].set()

    def stepped(self):
        """The next bucket the worker has stepped, in order (waits for it).

        Raises:
            The exception the worker stopped on.
        """
        bucket, error = self._done.get()
        if error is not None:
            self._thread.join()
            raise error
        return bucket

    def close(self) -> None:
        """Stop the worker after the bucket it is stepping, and wait for it."""
        self._stop = True
        for event in self._queued:
            event.set()
        self._thread.join()

    def _run(self) -> None:
        # Grad mode is per thread; the sub-optimizers' own steps set it again where they do.
        with torch.no_grad():
            for index, bucket in enumerate(self._buckets):
                self._queued[index].wait()
                if self._stop:
                    return
                try:
                    self._step_bucket(bucket)
                except BaseException as error:  # pylint: disable=broad-except
                    self._done.put((None, error))  # raised again where step() was called
                    return
                self._done.put((bucket, None))
