# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Finds megatron-core 0.19.2's own ``distrib_optimizer`` module for the tests that compare with it.

With the fork installed or on the path, ``megatron_optimizer_fork.load_upstream_module`` loads
upstream's file beside the fork's module. A vendored Megatron-LM tree has no such package and
no separate copy of upstream's file; there the module ``megatron.core`` imports stands in, but
only while it is still upstream's (the fork's would make every comparison one with itself).

The test files import this module in one of two ways: as ``distrib_optimizer_upstream`` (pytest
puts this folder on ``sys.path`` while ``tests/`` is no package, as in this repository) or as
``tests.unit_tests.distrib_optimizer_upstream`` (Megatron-LM's ``tests/`` is a package).
"""

import importlib

MODULE = "megatron.core.optimizer.distrib_optimizer"


def is_upstreams(module):
    """Tells whether a ``distrib_optimizer`` module is megatron-core's own.

    Upstream's module defines ``Range`` itself; the fork's re-exports it from
    ``distrib_optimizer_ranges``.

    Args:
        module (module): A loaded ``distrib_optimizer`` module.

    Returns:
        bool: True for upstream's module, False for the fork's.
    """
    return module.Range.__module__ == module.__name__


def load():
    """Returns upstream's ``distrib_optimizer`` module, or None where no copy of it is at hand.

    Returns:
        module or None: The module loaded through ``megatron_optimizer_fork`` when that package
        is importable, otherwise the imported ``megatron.core`` module if it is upstream's; None
        when the only module available is the fork's.
    """
    try:
        import megatron_optimizer_fork  # pylint: disable=import-outside-toplevel
    except ModuleNotFoundError:
        module = importlib.import_module(MODULE)
    else:
        module = megatron_optimizer_fork.load_upstream_module(MODULE)
    return module if is_upstreams(module) else None


def as_with_torch_adam(module, monkeypatch):
    """Puts upstream's module in the mode it runs torch Adam in: neither TE nor Apex imported.

    0.19.2 decides at import (``HAVE_APEX_OR_TE``) whether its inner optimizer keeps the Adam
    step in its param groups, and only then leaves ``step`` out of its checkpoints. It builds
    torch Adam only where neither imports, so a comparison that gives it torch AdamW on a
    machine with Transformer Engine must switch that flag off, or upstream drops the step
    counter it needs.

    Args:
        module (module or None): What :func:`load` returned.
        monkeypatch (pytest.MonkeyPatch): Undoes the change after the test.
    """
    if module is not None and hasattr(module, "HAVE_APEX_OR_TE"):
        monkeypatch.setattr(module, "HAVE_APEX_OR_TE", False)
