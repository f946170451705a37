# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The host part of a HybridDeviceOptimizer step, running behind the next forward pass.

With ``overlap_cpu_optimizer_step_with_forward`` the HDO's ``step()`` queues every download and
the in-place step, then hands its host buckets to one worker thread and returns. The worker
steps and uploads the buckets in the order the next forward needs them and marks each as it
goes up; whoever needs some parameters (the distributed optimizer's parameter sync of one DDP
bucket group) waits for their buckets alone, and whoever reads the optimizer as a whole (state,
checkpoints, the next step) waits for all of it (:meth:`PendingHostStep.join`).

One worker per step, started and joined by the calling thread: the host step is bound by host
memory bandwidth in kernels that release the GIL, so the forward's Python runs beside it.
"""

import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import torch

from megatron.core.optimizer.cpu_offloading.host_step_threads import threads_for_host_step
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer_ring import recorded

# What profiles show: each host bucket on the worker, and a wait of the calling thread for some.
HOST_BUCKET_RANGE = "HybridDeviceOptimizer.host_bucket"
WAIT_RANGE = "HybridDeviceOptimizer.wait_for_params"


# Workers of several HDOs in one process (Megatron chains a dense and an expert optimizer, each
# with its own) step one bucket at a time between them, each on the intra-op threads the host
# step has, rather than all at once on more threads than there are cores.
_ONE_BUCKET_AT_A_TIME = threading.Lock()


class HostStepFailed(RuntimeError):
    """The host part of a step behind the forward raised; the parameters it had not uploaded
    keep their previous values, so the optimizer and the model disagree."""


class PendingHostStep:
    """The host buckets of one step, stepped and uploaded on a worker thread.

    Args:
        run_bucket: steps bucket ``index`` and queues its upload; returns the indices of the
            buckets that went up (a copy in parts goes up when its parts are stepped).
        count: number of buckets.
        h2d_stream: the stream uploads go on (None without CUDA).
        upload_events: one reusable CUDA event per bucket (None entries are made on first use);
            kept by the HDO across steps.
        setup: run first on the worker (device, intra-op threads); returns a context manager.
    """

    def __init__(
        self,
        run_bucket: Callable[[int], Iterable[int]],
        count: int,
        h2d_stream: Any,
        upload_events: List[Any],
        setup: Callable[[], Any],
    ):
        self._run_bucket = run_bucket
        self._h2d_stream = h2d_stream
        self._upload_events = upload_events
        self._setup = setup
        self._up = [threading.Event() for _ in range(count)]
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._work, name="hdo-host-step")

    def start(self) -> "PendingHostStep":
        """Start the worker; returns self."""
        self._thread.start()
        return self

    def on_worker(self) -> bool:
        """Whether the calling thread is the worker (which must never wait for itself)."""
        return threading.current_thread() is self._thread

    def _work(self):
        try:
            with torch.no_grad(), self._setup():
                for index in range(len(self._up)):
                    with _ONE_BUCKET_AT_A_TIME, torch.profiler.record_function(HOST_BUCKET_RANGE):
                        for done in self._run_bucket(index):
                            self._mark_up(done)
        except BaseException as error:  # pylint: disable=broad-exception-caught
            # Kept and raised again by every waiter: a worker's exception has nowhere else to go.
            self.error = error
        finally:
            for marker in self._up:
                marker.set()  # waiters wake up; a failure is raised to them

    def _mark_up(self, index: int):
        if self._h2d_stream is not None:
            self._upload_events[index] = recorded(self._upload_events[index], self._h2d_stream)
        self._up[index].set()

    def is_up(self, buckets: Sequence[int]) -> bool:
        """Whether every bucket of ``buckets`` has gone up (or the worker stopped)."""
        return all(self._up[index].is_set() for index in buckets)

    def wait_up(self, buckets: Sequence[int]):
        """Block until ``buckets`` have gone up, then order the current CUDA stream after their
        uploads.

        Raises:
            HostStepFailed: the worker raised.
        """
        with torch.profiler.record_function(WAIT_RANGE):
            for index in buckets:
                self._up[index].wait()
        self._raise_failure()
        if self._h2d_stream is None:
            return
        current = torch.cuda.current_stream(self._h2d_stream.device)
        for index in buckets:
            event = self._upload_events[index]
            if event is not None:
                current.wait_event(event)

    def join(self):
        """Wait for the whole host step.

        Raises:
            HostStepFailed: the worker raised.
        """
        self._thread.join()
        self._raise_failure()

    def _raise_failure(self):
        if self.error is not None:
            raise HostStepFailed(
                "the host step behind the forward failed: "
                f"{type(self.error).__name__}: {self.error}"
            ) from self.error


def buckets_of_params(bucket_params: Sequence[Sequence[torch.Tensor]]) -> Dict[int, List[int]]:
    """``id(public parameter)`` -> indices of the buckets that step it (a copy in parts is in
    several)."""
    found: Dict[int, List[int]] = {}
    for index, params in enumerate(bucket_params):
        for param in params:
            found.setdefault(id(param), []).append(index)
    return found


class StepBehindForwardMixin:
    """The HybridDeviceOptimizer's members for ``overlap_cpu_optimizer_step_with_forward``:
    starting the host part of a step on the worker, waiting for some parameters or for all.

    The host class provides the two options (``overlap_cpu_optimizer_step_with_forward``,
    ``host_step_order``), ``_host_plan``, ``_buckets``, ``_ring``, ``_load_guard``,
    ``inner_param_to_orig_param``, ``_start_step``, ``_after_host_step``,
    ``_group_steps_written_outside``, ``_mirror_group_steps`` and ``_list_created_state``.
    """

    # The step running behind the forward, if any.
    _pending_host_step: Optional[PendingHostStep] = None

    @property
    def state(self):
        """Each parameter's optimizer state (the sub-optimizer's own dict); read after a step
        running behind the forward has finished."""
        self.finish_step()
        return self.__dict__["state"]

    @state.setter
    def state(self, value):
        self.__dict__["state"] = value

    def _in_step_order(self, optimizers: List[torch.optim.Optimizer]):
        """The host sub-optimizers in ``host_step_order`` of their first parameter (as they
        are without one, or without the step behind the forward)."""
        key = self.host_step_order
        if key is None or not self.overlap_cpu_optimizer_step_with_forward:
            return optimizers
        orig = self.inner_param_to_orig_param

        def first_needed(optimizer):
            return min(key(orig[host]) for g in optimizer.param_groups for host in g["params"])

        return sorted(optimizers, key=first_needed)

    def _steps_behind_forward(self) -> bool:
        """Whether this step runs behind the forward: asked for, and planned with a ring slot
        for every bucket (a placement built before the option was set has fewer)."""
        plan = self._host_plan
        return (
            self.overlap_cpu_optimizer_step_with_forward
            and bool(self._buckets)
            and plan.slots >= len(plan.staged)
        )

    def _start_behind_forward(self, threads, lent, steps_before):
        """Queue every download and the in-place step, order the current stream after the
        downloads (whatever it runs next may free or zero the gradients), and start the host
        buckets on the worker."""
        ring = self._ring
        try:
            with threads_for_host_step(threads):
                self._start_step()  # every download: each bucket has a slot
            ring.order_after_downloads()
        except BaseException:
            ring.end_step()
            raise
        finally:
            for param in lent:
                param.grad = None
        if "_buckets_of_param" not in vars(self):
            orig = self.inner_param_to_orig_param
            self._buckets_of_param = buckets_of_params(
                [
                    [orig[host] for g in bucket.optimizer.param_groups for host in g["params"]]
                    for bucket in self._buckets
                ]
            )
            self._upload_events = [None] * len(self._buckets)
        index_of = {id(bucket): index for index, bucket in enumerate(self._buckets)}

        def step_bucket(index):
            bucket = self._buckets[index]
            ready = bucket.step(ring)
            self._after_host_step(bucket, ready)
            return [index_of[id(stepped)] for stepped in ready]

        # One intra-op thread fewer than the step would take: the calling thread runs the
        # forward meanwhile, and an OpenMP region one of whose threads it preempts waits for
        # that thread at every barrier.
        worker_threads = max(1, (threads or torch.get_num_threads()) - 1)

        def on_worker():
            if ring.h2d_stream is not None:
                torch.cuda.set_device(ring.h2d_stream.device)
            return threads_for_host_step(worker_threads)

        self._pending_steps_before = steps_before
        self._pending_host_step = PendingHostStep(
            step_bucket, len(self._buckets), ring.h2d_stream, self._upload_events, on_worker
        ).start()

    @property
    def host_step_pending(self) -> bool:
        """Whether a step is still running behind the forward (see ``finish_step``)."""
        return self._pending_host_step is not None

    def wait_for_params(self, params: Iterable[torch.Tensor], block: bool = True) -> bool:
        """Wait for the host buckets of ``params`` (public parameters) of a step running
        behind the forward, and order the current stream after their uploads.

        Args:
            params: the parameters about to be read.
            block: wait until they are up; False only looks.

        Returns:
            Whether they are up (always True with ``block``, or with no step behind).

        Raises:
            HostStepFailed: the host step failed (the optimizer then refuses to step or save).
        """
        pending = self._pending_host_step
        if pending is None or pending.on_worker():
            return True
        found = self._buckets_of_param
        indices = sorted({index for param in params for index in found.get(id(param), ())})
        if not block and not pending.is_up(indices):
            return False
        try:
            pending.wait_up(indices)
        except HostStepFailed:
            self.finish_step()  # marks the optimizer and raises the failure
            raise
        return True

    def finish_step(self):
        """Wait for a step running behind the forward, if any, and finish it: the group steps
        mirrored, the state it created listed.

        Raises:
            HostStepFailed: the host step failed; the optimizer then refuses to step or save
                until a complete load, since some parameters and state were stepped and others
                not.
        """
        pending = self._pending_host_step
        if pending is None or pending.on_worker():
            return
        self._pending_host_step = None
        try:
            pending.join()
        except HostStepFailed as failure:
            self._load_guard.pending(f"{failure}; load a checkpoint to go on")
            raise
        finally:
            self._ring.end_step()
        # A step a client wrote into a public group meanwhile (a reset) is kept for the next
        # step to hand over, rather than overwritten by the one the sub-groups took.
        self._mirror_group_steps(
            self._pending_steps_before, keep=self._group_steps_written_outside()
        )
        self._list_created_state()
