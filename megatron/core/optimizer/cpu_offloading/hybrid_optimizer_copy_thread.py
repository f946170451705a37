# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""A thread that queues the HDO step's copies while the calling thread runs the host kernels.

Between two host buckets the calling thread queues the stepped bucket's upload and the
download that reuses its slot: some CUDA calls and their Python, a fraction of a millisecond a
bucket, while the host kernel's threads wait for the next kernel. Handed to this thread, that
work runs beside the next kernel instead. The kernel releases the GIL while it runs, so the
two threads' Python does not wait for each other there; the HDO hands each job out right
before its next kernel, and lowers torch's host threads by one while the thread is in use, so
that the kernel's threads do not share their cores with it.

Jobs run one at a time in the order they are handed out, which keeps each stream's copies in
the order the step queued them (the device staging buffers rely on it). A job that raises
does not stop the later ones, which upload buckets already stepped; its error is kept for the
caller to raise (:meth:`CopyThread.take_error`).
"""

import os
import queue
import threading
from typing import Callable, Optional

import torch


class CopyThread:
    """One daemon thread running the jobs handed to it, in order."""

    def __init__(self):
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._done = threading.Condition()
        self._handed_out = 0
        self._finished = 0
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None

    def hand_out(self, job: Callable[[], None], device: Optional[torch.device] = None) -> int:
        """Queue ``job`` to run on the thread, with ``device`` current there (a CUDA device,
        or None). Returns the job's ticket, for :meth:`wait_for`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hdo-copies", daemon=True)
            self._thread.start()
        self._handed_out += 1
        self._jobs.put((self._handed_out, job, device))
        return self._handed_out

    def wait_for(self, ticket: int):
        """Return once the job of ``ticket`` and every job before it have run."""
        with self._done:
            self._done.wait_for(lambda: self._finished >= ticket)

    def finish(self):
        """Return once every job handed out has run."""
        self.wait_for(self._handed_out)

    def take_error(self) -> Optional[BaseException]:
        """The first error a job raised since the last call, if any (cleared)."""
        with self._done:
            error, self._error = self._error, None
        return error

    def check(self):
        """Raise the first error a job raised since the last check, if any."""
        error = self.take_error()
        if error is not None:
            raise error

    @torch.no_grad()  # grad mode is the thread's own: the step's no_grad does not reach here
    def _run(self):
        while True:
            ticket, job, device = self._jobs.get()
            try:
                if device is not None and device.type == "cuda":
                    torch.cuda.set_device(device)  # never a context on another device
                job()
            except BaseException as error:  # pylint: disable=broad-exception-caught
                with self._done:
                    self._error = self._error or error
            finally:
                del job
                with self._done:
                    self._finished = ticket
                    self._done.notify_all()


_THREAD: Optional[CopyThread] = None


def shared_copy_thread() -> CopyThread:
    """The process's copy thread, made on first use (again in a forked child, which has no
    thread of its parent's)."""
    global _THREAD  # pylint: disable=global-statement
    if _THREAD is None:
        _THREAD = CopyThread()
    return _THREAD


def _forget_after_fork():
    global _THREAD  # pylint: disable=global-statement
    _THREAD = None


os.register_at_fork(after_in_child=_forget_after_fork)
