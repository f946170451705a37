# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The distributed optimizer's side of an offloaded step that runs behind the next forward.

With ``overlap_cpu_optimizer_step_with_forward`` (an ``OptimizerConfig`` field where the config
has it, else the environment variable :data:`ENV_VAR`) and ``overlap_param_gather``, the
HybridDeviceOptimizer's ``step()`` returns once its downloads and in-place step are queued, and
steps and uploads its host buckets in the order the next forward gathers the DDP bucket groups.
:class:`StepBehindForward` then holds back each bucket group's parameter sync (its all-gather,
which the forward pre-hook of the group's first layer waits for) until that group's own host
buckets are up, and copies the group's main pieces into the parameter buffer first:

- a forward pre-hook, and a forced sync (evaluation, checkpointing: DDP's
  ``disable_forward_pre_hook``), wait for the group;
- the prefetch of the next group's all-gather is dispatched if the group is up and otherwise
  left to that group's own pre-hook, so the forward never waits for a group it does not need
  yet;
- whatever reads or steps the optimizer as a whole waits for every group (:meth:`finish`).

The groups' collectives keep their order on every rank: a group's all-gather is dispatched
before the next one's, whichever call dispatches it.
"""

import dataclasses
import math
import os
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

# Turns the step behind the forward on where the config has no field for it (megatron-core
# 0.19.2's OptimizerConfig): "1" or "true".
ENV_VAR = "MEGATRON_HDO_OVERLAP_STEP_WITH_FORWARD"

# The config field, as an upstream change would add it.
CONFIG_FIELD = "overlap_cpu_optimizer_step_with_forward"


def asked_for(config: Any, environ=None) -> bool:
    """Whether the config, or else the environment, asks for the step behind the forward."""
    if getattr(config, CONFIG_FIELD, False):
        return True
    environ = os.environ if environ is None else environ
    return environ.get(ENV_VAR, "").strip().lower() in ("1", "true")


def unsuitable(config: Any, ddp_config: Any) -> Optional[str]:
    """Why this configuration cannot run the step behind the forward, or None."""
    if not ddp_config.overlap_param_gather:
        return "it needs overlap_param_gather, whose forward pre-hooks wait for each bucket"
    checks = (
        (ddp_config.use_megatron_fsdp, "Megatron-FSDP"),
        (getattr(ddp_config, "fp8_param_gather", False), "fp8_param_gather"),
        (getattr(ddp_config, "fp4_param_gather", False), "fp4_param_gather"),
        (getattr(config, "reuse_grad_buf_for_mxfp8_param_ag", False), "MXFP8 gathers"),
        (
            getattr(config, "overlap_param_gather_with_optimizer_step", False),
            "overlap_param_gather_with_optimizer_step",
        ),
    )
    for present, name in checks:
        if present:
            return f"it does not support {name}"
    return None


def warn_off(reason: str):
    """Say once why the step stays where it is."""
    warnings.warn(f"{CONFIG_FIELD} is off: {reason}", stacklevel=3)


@dataclasses.dataclass
class GatedGroup:
    """One DDP bucket group and what its parameter sync waits for.

    Attributes:
        bucket_group: DDP's ``_ParamAndGradBucketGroup``.
        position: its place in the next forward (smaller first).
        stepped: the inner optimizer's parameters of the group (its main or 16-bit pieces).
        pairs: ``(model parameter, main piece)`` to copy into the parameter buffer once the
            group is up (none where the inner optimizer writes the model parameters itself).
    """

    bucket_group: Any
    position: float
    stepped: List[torch.Tensor]
    pairs: List[Tuple[torch.nn.Parameter, torch.Tensor]]


def forward_order(model_chunks: Iterable[Any]) -> List[Tuple[Any, float]]:
    """Each DDP bucket group of ``model_chunks`` with its place in the next forward: chunk by
    chunk, and within a chunk's dense or expert groups the last first (DDP gathers them in
    that order, since buckets are laid out from the last layer)."""
    placed = []
    for chunk_index, chunk in enumerate(model_chunks):
        for chain in (chunk.bucket_groups, chunk.expert_parallel_bucket_groups):
            count = len(chain)
            for index, bucket_group in enumerate(chain):
                placed.append((bucket_group, chunk_index + (count - 1 - index) / count))
    return placed


class StepBehindForward:
    """Holds back each bucket group's parameter sync until its host buckets are up.

    Args:
        groups: the bucket groups with parameters of this optimizer.
        wait_for_params: the inner optimizer's ``wait_for_params(params, block) -> bool``.
        pending: whether the inner optimizer has a step running behind the forward.
        finish_step: the inner optimizer's ``finish_step()``.
        copy_pairs: copies ``(model parameter, main piece)`` pairs into the parameter buffer.
    """

    def __init__(
        self,
        groups: List[GatedGroup],
        wait_for_params: Callable[[List[torch.Tensor], bool], bool],
        pending: Callable[[], bool],
        finish_step: Callable[[], None],
        copy_pairs: Callable[[List[Tuple[torch.nn.Parameter, torch.Tensor]]], None],
    ):
        self.groups = sorted(groups, key=lambda group: group.position)
        self._wait_for_params = wait_for_params
        self._pending = pending
        self._finish_step = finish_step
        self._copy_pairs = copy_pairs
        self._armed: Dict[int, GatedGroup] = {}

    def step_order(self) -> Callable[[torch.Tensor], float]:
        """The key the inner optimizer steps its host buckets by: the place of each stepped
        parameter's bucket group in the next forward."""
        place = {id(p): group.position for group in self.groups for p in group.stepped}
        return lambda param: place.get(id(param), math.inf)

    def arm(self) -> bool:
        """After the inner step: if it runs behind the forward, hold back every group's
        parameter sync until the group is up; returns whether it does."""
        if not self._pending():
            return False
        for group in self.groups:
            if id(group) not in self._armed:
                self._hold_back(group)
        return True

    def _hold_back(self, group: GatedGroup):
        bucket_group = group.bucket_group
        cls = type(bucket_group)

        def start_param_sync(force_sync: bool = False):
            # A forced sync needs the parameters now; a prefetch waits for nothing.
            if self._open(group, block=force_sync):
                return cls.start_param_sync(bucket_group, force_sync=force_sync)
            return None

        def finish_param_sync(skip_next_bucket_dispatch: bool = False):
            self._open(group, block=True)
            return cls.finish_param_sync(
                bucket_group, skip_next_bucket_dispatch=skip_next_bucket_dispatch
            )

        bucket_group.start_param_sync = start_param_sync
        bucket_group.finish_param_sync = finish_param_sync
        self._armed[id(group)] = group

    def _open(self, group: GatedGroup, block: bool) -> bool:
        """Let ``group``'s sync through once its host buckets are up (waiting for them with
        ``block``), after copying its main pieces into the parameter buffer."""
        if id(group) not in self._armed:
            return True
        try:
            if not self._wait_for_params(group.stepped, block):
                return False
        except BaseException:
            # The step failed (the inner optimizer says so and refuses to go on): no sync is
            # held back any longer, so nothing waits for a step that will not come.
            for armed in list(self._armed.values()):
                self._let_through(armed)
            raise
        self._let_through(group)
        if group.pairs:
            with torch.no_grad():
                self._copy_pairs(group.pairs)
        return True

    def _let_through(self, group: GatedGroup):
        del self._armed[id(group)]
        bucket_group = group.bucket_group
        del bucket_group.start_param_sync, bucket_group.finish_param_sync

    def finish(self):
        """Wait for the whole step: open every group still held back (in forward order), then
        let the inner optimizer finish."""
        for group in self.groups:
            self._open(group, block=True)
        self._finish_step()
