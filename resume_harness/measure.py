# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""What a load costs: GPU memory per load phase, the optimizer state by place, and the path the
fork's FusedAdam loader logs.

With ``RESUME_HARNESS_PROFILE_PHASES=1`` in the environment (``load_memory.py --profile`` sets
it) each load phase also runs under ``torch.profiler`` and ``cProfile``, and the job's result
holds their tables (``load_phase_profiles``); the phase times of such a job include the
profilers' overhead. With ``RESUME_HARNESS_WARM_PAGE_CACHE=1`` (``load_memory.py``'s default)
a load job reads its checkpoint's files once before it is timed (:func:`warm_page_cache`), so
that its load time measures the load rather than what the disk and page cache happen to hold."""

import contextlib
import cProfile
import gc
import io
import logging
import os
import pstats
import time
from pathlib import Path

import torch

from . import table
from .worker import distributed_optimizers

PLAN_LOGGER = "megatron.core.optimizer.fused_adam_state_load"
PROFILE_ENV = "RESUME_HARNESS_PROFILE_PHASES"
PROFILE_ROWS = 15
PAGE_CACHE_ENV = "RESUME_HARNESS_WARM_PAGE_CACHE"
_WARM_CHUNK = 16 << 20


class PhasePeaks:
    """Peak GPU memory of each phase of a load, what stays allocated after it (both above what
    was allocated when the load started), and its wall time up to its last kernel.

    The peak counter is reset as each phase begins, so the largest phase peak is the peak of
    the whole load.

    Args:
        profile: also profile each phase (:func:`profile_tables`, kept in ``profiles``);
            None asks the environment (:data:`PROFILE_ENV`).
    """

    def __init__(self, profile=None):
        torch.cuda.synchronize()
        self.start = torch.cuda.memory_allocated()
        self.peaks = {}
        self.after = {}
        self.seconds = {}
        self.profile = os.environ.get(PROFILE_ENV) == "1" if profile is None else profile
        self.profiles = {}

    @contextlib.contextmanager
    def phase(self, name):
        """Measure the block as phase ``name``."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with profiled(self.profile) as profilers:
            began = time.perf_counter()
            yield
            torch.cuda.synchronize()
            self.seconds[name] = time.perf_counter() - began
        self.peaks[name] = torch.cuda.max_memory_allocated() - self.start
        self.after[name] = torch.cuda.memory_allocated() - self.start
        if profilers:
            self.profiles[name] = profile_tables(*profilers)


class GcClock:
    """Collections the garbage collector ran while installed, with their time, by generation:
    a collection runs inside whatever call allocated the object that set it off, so profilers
    charge its time to that call."""

    def __init__(self):
        self.collections = {}
        self._began = None

    def _track(self, event, info):
        if event == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            count, seconds = self.collections.get(info["generation"], (0, 0.0))
            self.collections[info["generation"]] = (
                count + 1,
                seconds + time.perf_counter() - self._began,
            )
            self._began = None

    def __enter__(self):
        gc.callbacks.append(self._track)
        return self

    def __exit__(self, *exc_info):
        gc.callbacks.remove(self._track)

    def text(self):
        """One line: each generation's collections and their time, or that none ran."""
        if not self.collections:
            return "gc: no collection"
        return "gc: " + ", ".join(
            f"generation {generation}: {count} in {seconds * 1000:.1f} ms"
            for generation, (count, seconds) in sorted(self.collections.items())
        )


@contextlib.contextmanager
def profiled(enabled):
    """``(torch profiler, cProfile, GcClock)`` running over the block, or ``()`` when not
    ``enabled``."""
    if not enabled:
        yield ()
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    python = cProfile.Profile()
    with torch.profiler.profile(activities=activities) as ops, GcClock() as collections:
        python.enable()
        try:
            yield ops, python, collections
        finally:
            python.disable()


def profile_tables(ops, python, collections=None, rows=PROFILE_ROWS):
    """What a profiled phase spent its time on, as text: ``"ops"``, the torch operators and
    CUDA runtime calls by their own host time (and by their own device time where CUDA was
    profiled), and ``"python"``, the Python functions by their own time, after the line of
    the garbage collections that ran (:class:`GcClock`)."""
    averages = ops.key_averages()
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=rows)]
    if torch.cuda.is_available():
        tables.append(averages.table(sort_by="self_cuda_time_total", row_limit=rows))
    text = io.StringIO()
    if collections is not None:
        text.write(collections.text() + "\n")
    pstats.Stats(python, stream=text).sort_stats("tottime").print_stats(rows)
    return {"ops": "\n".join(tables), "python": text.getvalue()}


def warm_page_cache(folder, enabled=None):
    """Read every file under ``folder`` once, into the operating system's page cache.

    Args:
        folder: a checkpoint folder.
        enabled: None asks the environment (:data:`PAGE_CACHE_ENV`).

    Returns:
        int: the bytes read (0 when not enabled).
    """
    if not (os.environ.get(PAGE_CACHE_ENV) == "1" if enabled is None else enabled):
        return 0
    chunk = bytearray(_WARM_CHUNK)
    total = 0
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file():
            with open(path, "rb", buffering=0) as stream:
                while read := stream.readinto(chunk):
                    total += read
    return total


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
