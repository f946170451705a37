# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""How many intra-op threads the HDO's host step runs on.

Host AdamW is bound by the host's memory bandwidth, which every rank on a host shares with the
others, as it shares the cores. Neither of torch's defaults suits a node that runs several
ranks: ``torchrun`` starts each of them with ``OMP_NUM_THREADS=1`` (one core a rank, the rest
idle while the ranks step), and a process started without it gets one thread per core (each
rank then runs as many threads as the host has cores, and they fight for them). The host step
therefore runs on the cores this process may use (``os.sched_getaffinity``) shared out among
the ranks on this host (``LOCAL_WORLD_SIZE``, as ``torchrun`` sets it; 1 where it is unset),
at least one, and leaves the caller's own count as it found it.

An override, where given, wins over that share: a whole number of threads, or ``0`` to leave
the caller's count alone (torch's threads as the process set them). It comes from the HDO's
``host_step_threads`` attribute where that is not None, else from the environment variable
:data:`THREADS_ENV_VAR`.

The count is set for the step and set back after it, rather than left set, so that the
caller's own work keeps the threads it chose. The two calls take about a microsecond and the
OpenMP runtime keeps its threads between parallel regions, so the switch is small beside a
host step of tens of milliseconds; ``benchmarks/ranks_per_host.py`` reports what it adds on
the host it runs on (in its header) and times the policy with several ranks stepping at once.
"""

import contextlib
import os
from typing import Iterator, Mapping, Optional

import torch

THREADS_ENV_VAR = "MEGATRON_HDO_HOST_STEP_THREADS"
"""Environment variable that overrides the host step's thread count (``0``: leave it alone)."""

RANKS_ENV_VAR = "LOCAL_WORLD_SIZE"
"""Environment variable that holds the number of ranks on this host (``torchrun`` sets it)."""


def usable_cores() -> int:
    """The number of cores this process may run on (its affinity mask, where the platform
    has one; else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks here (macOS, Windows)
        return os.cpu_count() or 1


def _whole_number(text: str, source: str, least: int) -> int:
    """``text`` as an integer of at least ``least``, or a ValueError that names ``source``."""
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value < least:
        raise ValueError(f"{source}={text!r}: expected a whole number of at least {least}")
    return value


def ranks_on_host(environ: Optional[Mapping[str, str]] = None) -> int:
    """The number of ranks that share this host: ``LOCAL_WORLD_SIZE``, 1 where it is unset.

    Raises:
        ValueError: it is set to something other than a whole number of at least 1.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(RANKS_ENV_VAR, "")
    return _whole_number(text, RANKS_ENV_VAR, 1) if text.strip() else 1


def policy_threads(cores: Optional[int] = None, ranks: Optional[int] = None) -> int:
    """The host step's share of the host: ``cores // ranks``, at least one thread.

    Args:
        cores: cores this process may use; :func:`usable_cores` when None.
        ranks: ranks on this host; :func:`ranks_on_host` when None.
    """
    cores = usable_cores() if cores is None else cores
    ranks = ranks_on_host() if ranks is None else ranks
    return max(1, cores // max(1, ranks))


def host_step_threads(
    override: Optional[int] = None, environ: Optional[Mapping[str, str]] = None
) -> Optional[int]:
    """Threads for the host step, or None to leave the caller's count as it is.

    Args:
        override: the HDO's ``host_step_threads``: a number of threads, ``0`` to leave the
            caller's count alone, None to defer to the environment and then the policy.
        environ: the environment to read (``os.environ`` when None).

    Raises:
        ValueError: the override or :data:`THREADS_ENV_VAR` is not a whole number of at least
            0, or ``LOCAL_WORLD_SIZE`` is not one of at least 1.
    """
    environ = os.environ if environ is None else environ
    if override is not None:
        chosen = _whole_number(str(override), "host_step_threads", 0)
    elif environ.get(THREADS_ENV_VAR, "").strip():
        chosen = _whole_number(environ[THREADS_ENV_VAR], THREADS_ENV_VAR, 0)
    else:
        return policy_threads(ranks=ranks_on_host(environ))
    return chosen or None


@contextlib.contextmanager
def threads_for_host_step(threads: Optional[int]) -> Iterator[None]:
    """Run the body on ``threads`` intra-op threads, then give back the caller's count (also
    when the body raises). None, or the count already set, changes nothing."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
