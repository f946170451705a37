# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The pipeline every load of the distributed optimizer's state runs: plan, agree, write, finish.

A checkpoint's share of the state differs per data-parallel rank, so a fault may show on one
rank alone. :class:`PlannedParamStateLoadMixin` makes a load transactional across the ranks:
each rank checks its share against the optimizer without changing anything, the ranks agree on
the outcome (one failure refuses the load everywhere), then each writes its share under the
optimizer's :class:`~megatron.core.optimizer.state_load_checks.LoadGuard`, and they agree once
more that every rank wrote. Every load site (``load_state_dict``, each format's public loader,
the distributed-checkpoint and Megatron-FSDP loads) goes through
:meth:`PlannedParamStateLoadMixin._plan_agree_write`.
"""

from typing import Any, Callable, Optional

import torch

from megatron.core.optimizer import state_load_checks as checks

__all__ = ["PlannedParamStateLoadMixin"]


def _collective_device(group: torch.distributed.ProcessGroup) -> torch.device:
    """Where tensors must live to travel over ``group`` (NCCL only moves GPU memory)."""
    if str(torch.distributed.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Errors a rank re-raises under their own type when another rank met them; anything else
# (from torch.load, say) becomes a RuntimeError carrying its name.
_PORTABLE_ERRORS = {
    error.__name__: error
    for error in (ValueError, KeyError, TypeError, RuntimeError, FileNotFoundError)
}


_REFUSED = "refused its share of the checkpoint, so no rank loads it"
_FAILED_WRITING = (
    "failed while writing its share of the checkpoint, so the state is partly the "
    "checkpoint's on every rank"
)


def _raise_if_any_rank_fails(
    problem: Optional[BaseException],
    group: torch.distributed.ProcessGroup,
    device: torch.device,
    failed: str = _REFUSED,
) -> None:
    """Raise on every rank of ``group`` when any rank's plan failed.

    Each rank checks the pieces it owns (a dp_zero state only rank 0, which holds it), so a
    fault in one rank's share of a checkpoint is seen there alone; without this the other
    ranks would write their shares and train on, or wait forever in a scatter rank 0 never
    joins. A rank that failed raises its own error; the others raise the first failing
    rank's, under its type where that is a plain one, naming the rank.
    """
    if group.size() > 1:
        verdict = None if problem is None else (type(problem).__name__, str(problem))
        verdicts = [None] * group.size()
        gather = torch.distributed.all_gather_object
        if device.type == "cuda":
            with torch.cuda.device(device):
                gather(verdicts, verdict, group=group)
        else:
            gather(verdicts, verdict, group=group)
        failures = [(rank, found) for rank, found in enumerate(verdicts) if found is not None]
        if problem is None and failures:
            rank, (name, text) = failures[0]
            raise _PORTABLE_ERRORS.get(name, RuntimeError)(
                f"data-parallel rank {rank} {failed} ({len(failures)} of {group.size()} ranks "
                f"failed): {name}: {text}"
            )
    if problem is not None:
        raise problem


class PlannedParamStateLoadMixin:
    """The two halves every parameter-state load runs: a plan (each format checks its state
    against the optimizer and returns a writer) and the writes (run under the optimizer's
    :class:`~megatron.core.optimizer.state_load_checks.LoadGuard`).

    The host class supplies ``inner_state``, ``_load_guard`` and
    ``_set_main_param_and_optimizer_states``, and where the offloaded step can run behind the
    forward its gates as ``_step_behind``
    (:class:`~megatron.core.optimizer.distrib_optimizer_behind.StepBehindForward`).
    """

    def _finish_step_behind(self) -> None:
        """Wait for a step running behind the forward, if any: every parameter sync it held
        back is let through and the inner optimizer finishes."""
        gates = getattr(self, "_step_behind", None)
        if gates is not None:
            gates.finish()

    def _ready_for(self, what: str) -> None:
        """Before reading or stepping the optimizer as a whole: a step running behind the
        forward finishes, and a failed load refuses ``what``."""
        self._finish_step_behind()
        self._load_guard.check(what)

    def _begin_param_state_load(self) -> None:
        """Give every parameter its state tensors, so a load can write into them in place."""
        self.inner_state.materialise()

    def _param_state_writer(self, writes, step: Optional[int] = None) -> Callable[[], None]:
        """What writes a checked plan: state created where missing, every owned piece copied
        in place, the step count restored, the inner optimizer told the load is done.

        The plan's tensors are scanned for non-finite values first (``state_load_checks``).

        Args:
            writes: ``(model param, {"param": ..., <state key>: ...})`` per owned piece.
            step: the checkpoint's step count, where the format carries one.
        """
        for model_param, tensors in writes:
            self._check_main_param_and_optimizer_states(model_param, tensors)
        checks.scan_nonfinite(
            (
                (f"a piece of the parameter of shape {tuple(model_param.shape)}", key, value)
                for model_param, tensors in writes
                for key, value in tensors.items()
            ),
            "the checkpoint's parameter state",
        )

        @torch.no_grad()
        def write():
            self._begin_param_state_load()
            for model_param, tensors in writes:
                self._set_main_param_and_optimizer_states(model_param, tensors)
            if step is not None:
                self.inner_state.set_step(step)
            self.inner_state.finish_load()

        return write

    def _check_main_param_and_optimizer_states(self, model_param, tensors) -> None:
        """Raise, writing nothing, if ``tensors`` cannot be written for ``model_param`` (the
        host class checks what its inner optimizer takes; nothing is checked here)."""

    def _agree_on_plan(self, problem: Optional[BaseException], failed: str = _REFUSED) -> None:
        """Raise ``problem`` here and a failure on every other data-parallel rank if any rank
        has one (outside ``torch.distributed`` only ``problem`` is raised); ``failed`` says
        what the failing rank did, for the others' message."""
        group = getattr(self, "data_parallel_group", None)
        if isinstance(group, torch.distributed.ProcessGroup) and torch.distributed.is_initialized():
            _raise_if_any_rank_fails(problem, *self._param_state_group(), failed)
        elif problem is not None:
            raise problem

    def _plan_agree_write(
        self,
        what: str,
        plan: Callable[[], Callable[[], Any]],
        on_refusal: Optional[Callable[[], None]] = None,
    ) -> Any:
        """The pipeline every load of the optimizer's state runs; returns what the writer does.

        1. Plan: ``plan()`` checks the loaded state against this optimizer, changing nothing,
           and returns the writer of what it checked.
        2. Agree: every data-parallel rank learns whether any rank's plan failed; then every
           rank raises (after ``on_refusal``), and no rank has written anything.
        3. Write: the writer runs under the load guard, which marks the optimizer unusable
           where it fails.
        4. Finish: the ranks agree that each wrote its share. A failure on one rank marks every
           rank, so that none steps or saves a state that is partly the checkpoint's.

        A pipeline that runs inside another's writes (a client's wrapper of a public loader,
        called by ``load_state_dict``) leaves the last agreement to the outer one.

        Args:
            what: the load, as its messages name it.
            plan: step 1; it raises where the state cannot load.
            on_refusal: what to do when a rank refused, before raising.
        """
        self._finish_step_behind()  # the plan reads the live state
        problem = write = None
        try:
            write = plan()
        except Exception as error:  # pylint: disable=broad-exception-caught
            problem = error
        try:
            self._agree_on_plan(problem)
        except Exception:
            if on_refusal is not None:
                on_refusal()
            raise
        outermost = not self._load_guard.busy
        failure = written = None
        try:
            with self._load_guard.writing(what):
                written = write()
        except Exception as error:  # pylint: disable=broad-exception-caught
            failure = error
        if outermost:
            try:
                self._agree_on_plan(failure, _FAILED_WRITING)
            except Exception as error:
                if failure is None:
                    self._load_guard.pending(f"{what} failed on another data-parallel rank")
                raise error
        if failure is not None:
            raise failure
        return written

    def _param_state_group(self, use_gloo_comm: bool = True):
        """The data-parallel group to move shards over, and the device they travel on.

        The gloo group keeps the traffic in host memory; without one, the main (NCCL) group
        is used and the shards pass through the GPU.
        """
        gloo = getattr(self, "data_parallel_group_gloo", None)
        group = gloo if use_gloo_comm and gloo is not None else self.data_parallel_group
        if group is None:
            raise ValueError("the distributed optimizer has no data-parallel group")
        return group, _collective_device(group)
