# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Which implementation of megatron-core's optimizer modules a process runs.

The fork's classes say so once per process, on rank 0, the first time each is built: the
class, the fork's version (``vendored`` in a Megatron-LM tree it was copied into) and the file
it comes from, so a training log shows which optimizer code resumed the run.
"""

import inspect
import logging

from megatron.core.utils import log_single_rank

logger = logging.getLogger(__name__)

DISTRIBUTION = "megatron-core-optimizer-fork"

_announced = set()


def fork_version() -> str:
    """The installed fork's version, or ``vendored`` where the files were copied into a tree."""
    from importlib import metadata  # pylint: disable=import-outside-toplevel

    try:
        distribution = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "vendored"
    # Installed, but is it what is imported? The overlay serves files from its own folder.
    if "megatron_optimizer_fork" in __file__.replace("\\", "/"):
        return distribution.version
    return "vendored"


def announce(cls: type) -> None:
    """Log, once per class and process, on rank 0, that the fork's ``cls`` is in use."""
    if cls in _announced:
        return
    _announced.add(cls)
    log_single_rank(
        logger,
        logging.INFO,
        f"{cls.__name__}: {DISTRIBUTION} {fork_version()} (clean-room rewrite for "
        f"megatron-core 0.19.2) from {inspect.getfile(cls)}",
    )
