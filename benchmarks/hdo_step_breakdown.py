# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Where the fork's HDO step spends its time: wall time of each of its parts, per step.

Used by ``hdo_step.py --breakdown`` after the timed steps (and after the parameters' digest,
since these steps change them). The parts are the fork's own methods, so an upstream
optimizer, or one without them, gets no breakdown. Each part is timed with the time it waits
(for a download to land, for the last upload), so the parts add up to about the step.
"""

import collections
import contextlib
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from resume_harness import measure  # noqa: E402  pylint: disable=wrong-import-position

PARTS = {
    # The whole in-place side: the clones' widened gradients, the in-place optimizer's step
    # (flat or not) and the clones' copy back. Its own methods, not the in-place optimizer's
    # step: wrapping that would hide the optimizer from the HDO's flat in-place step.
    "_step_in_place_whole": "in-place step",
    "_download": "download queueing",
}
"""The HDO's methods timed, and the name each is reported under."""

BUCKET_PARTS = {
    # Copies of pageable host copies into their slots, on the host.
    "stage_upload": "upload staging",
    "queue_upload": "upload queueing",
}
"""The host buckets' methods timed, and the name each is reported under."""

WAITS = {
    # The host waits for each bucket's gradients to land before stepping it (the host step is
    # the only caller of an event's synchronize), and for the last uploads at the end of the
    # step (a stream's); time spent there is time the pipeline did not hide.
    torch.cuda.Event: "download wait",
    torch.cuda.Stream: "last upload wait",
}
"""Where CUDA exists, the classes whose ``synchronize`` is timed, and the name each wait is
reported under."""


@contextlib.contextmanager
def _timing(target, name: str, label: str, totals: Dict[str, float]) -> Iterator[None]:
    """Replace ``target.name`` by a wrapper adding its wall time to ``totals[label]``."""
    original = getattr(target, name)
    own = name in vars(target)  # an instance attribute, or the class's method

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - start

    setattr(target, name, timed)
    try:
        yield
    finally:
        if own:
            setattr(target, name, original)
        else:
            delattr(target, name)  # the class's method shows again


def breakdown(optimizer, before: Callable[[], None], steps: int = 3) -> Dict[str, float]:
    """Milliseconds per step of each part of ``optimizer.step()`` over ``steps`` steps.

    Args:
        optimizer: the fork's HybridDeviceOptimizer, already stepped at least once.
        before: what runs ahead of each step (handing out gradients), not timed.
        steps: steps to average over.

    Returns:
        ``{part: ms per step}`` with ``step`` (the whole step), ``host step`` (the host
        buckets' sub-optimizer steps) and, where CUDA exists, the waits (``WAITS``); empty
        where the optimizer has none of the fork's parts.
    """
    buckets = getattr(optimizer, "_buckets", None)
    if buckets is None or not all(hasattr(optimizer, name) for name in PARTS):
        return {}
    totals: Dict[str, float] = collections.defaultdict(float)
    with contextlib.ExitStack() as stack:
        for name, label in PARTS.items():
            stack.enter_context(_timing(optimizer, name, label, totals))
        if torch.cuda.is_available():
            for waiter, label in WAITS.items():
                stack.enter_context(_timing(waiter, "synchronize", label, totals))
        timed = set()
        for bucket in buckets:
            # The parts of a large copy share one sub-optimizer, which their part step calls
            # when it gathers them: time each part step, or each sub-optimizer, once.
            parted = getattr(bucket, "parted", None)
            owner, name = (bucket.optimizer, "step") if parted is None else (parted, "step_part")
            if id(owner) not in timed:
                timed.add(id(owner))
                stack.enter_context(_timing(owner, name, "host step", totals))
            for name, label in BUCKET_PARTS.items():
                stack.enter_context(_timing(bucket, name, label, totals))
            if getattr(bucket, "flat", None) is not None:
                stack.enter_context(_timing(bucket.flat, "step", "host step", totals))
        for _ in range(steps):
            before()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            optimizer.step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            totals["step"] += time.perf_counter() - start
    return {label: 1e3 * total / steps for label, total in totals.items()}


def profile(
    optimizer, before: Callable[[], None], steps: int = 2, rows: int = 25
) -> Dict[str, str]:
    """What ``steps`` more steps of ``optimizer`` spent their time on, as text tables.

    ``"ops"``: torch operators and CUDA runtime calls by their own host time, and by their own
    device time where CUDA is there (the copies' DMA shows as ``Memcpy`` rows); ``"python"``:
    Python functions by their own time. Both include the profilers' overhead, so they say where
    the time goes, not how long a step takes.
    """
    with measure.profiled(True) as (ops, python, collections_):
        for _ in range(steps):
            before()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            optimizer.step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    return measure.profile_tables(ops, python, collections_, rows=rows)
