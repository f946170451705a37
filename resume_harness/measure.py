# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""What a load costs: GPU memory per load phase, the optimizer state by place, and the path the
fork's FusedAdam loader logs."""

import contextlib
import logging
import time

import torch

from . import table
from .worker import distributed_optimizers

PLAN_LOGGER = "megatron.core.optimizer.fused_adam_state_load"


class PhasePeaks:
    """Peak GPU memory of each phase of a load, what stays allocated after it (both above what
    was allocated when the load started), and its wall time up to its last kernel.

    The peak counter is reset as each phase begins, so the largest phase peak is the peak of
    the whole load.
    """

    def __init__(self):
        torch.cuda.synchronize()
        self.start = torch.cuda.memory_allocated()
        self.peaks = {}
        self.after = {}
        self.seconds = {}

    @contextlib.contextmanager
    def phase(self, name):
        """Measure the block as phase ``name``."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        yield
        torch.cuda.synchronize()
        self.seconds[name] = time.perf_counter() - began
        self.peaks[name] = torch.cuda.max_memory_allocated() - self.start
        self.after[name] = torch.cuda.memory_allocated() - self.start


def optimizer_state_bytes(optimizer):
    """Bytes of the inner optimizers' per-parameter state, by device kind: ``"moments"``
    (exp_avg and exp_avg_sq in their stored dtype: one state set) and ``"all"`` (every
    state tensor: master copies or remainders, scales, step counters too)."""
    found = {f"{place}_{what}": 0 for place in ("gpu", "host") for what in ("moments", "all")}
    for dist in distributed_optimizers(optimizer):
        seen = set()
        for entry in dist.optimizer.state.values():
            for key, value in entry.items():
                if not isinstance(value, torch.Tensor) or value.data_ptr() in seen:
                    continue
                seen.add(value.data_ptr())
                size = value.numel() * value.element_size()
                place = "gpu" if value.is_cuda else "host"
                found[f"{place}_all"] += size
                if key in table.MOMENT_KEYS:
                    found[f"{place}_moments"] += size
    return found


class LoadPlanLog(logging.Handler):
    """Collects what the fork's FusedAdam loader logs about the path it took, while in a
    ``with`` block (INFO is let through that one logger for the time being)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []
        self._logger = logging.getLogger(PLAN_LOGGER)
        self._level = None

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        self._level = self._logger.level
        if self._logger.getEffectiveLevel() > logging.INFO:
            self._logger.setLevel(logging.INFO)
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc_info):
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)
