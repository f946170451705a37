# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Finds megatron-core 0.19.2's own copies of the two modules the fork replaces, for the tests
that compare the fork with them.

With the fork installed or on the path, ``megatron_optimizer_fork.load_upstream_module`` loads
upstream's file beside the fork's module. A vendored Megatron-LM tree has no such package and
no separate copy of upstream's files: the file next to ``megatron.core`` is the fork's. There the
module ``megatron.core`` imports stands in only while it is still upstream's; a fork's module is
never handed out as upstream's, since every comparison would then be one with itself.

The test files import this module through ``optimizer_table.sibling`` (as ``upstream_modules``
here, as ``tests.unit_tests.upstream_modules`` in Megatron-LM, whose ``tests/`` is a package).
"""

import importlib

import pytest

DISTRIB_OPTIMIZER = "megatron.core.optimizer.distrib_optimizer"
HYBRID_OPTIMIZER = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer"


def is_upstreams(module):
    """Tells whether a loaded module is megatron-core's own rather than the fork's.

    Each of the fork's two modules sets ``FORK_IMPLEMENTATION``; upstream's do not.

    Args:
        module (module): A loaded ``distrib_optimizer`` or ``hybrid_optimizer`` module.

    Returns:
        bool: True for upstream's module, False for the fork's.
    """
    return not getattr(module, "FORK_IMPLEMENTATION", False)


def load(name=DISTRIB_OPTIMIZER):
    """Returns upstream's copy of module ``name``, or None where no copy of it is at hand.

    Args:
        name (str): :data:`DISTRIB_OPTIMIZER` or :data:`HYBRID_OPTIMIZER`.

    Returns:
        module or None: The module loaded through ``megatron_optimizer_fork`` when that package
        is importable, otherwise the imported ``megatron.core`` module; None when what either
        gives is the fork's (a vendored tree).
    """
    try:
        import megatron_optimizer_fork  # pylint: disable=import-outside-toplevel
    except ModuleNotFoundError:
        module = importlib.import_module(name)
    else:
        module = megatron_optimizer_fork.load_upstream_module(name)
    return module if is_upstreams(module) else None


def hybrid_optimizer_class():
    """Upstream's ``HybridDeviceOptimizer``; skips the calling test where only the fork's is at
    hand."""
    module = load(HYBRID_OPTIMIZER)
    if module is None:
        pytest.skip("no copy of upstream's hybrid_optimizer beside the fork's (a vendored tree)")
    return module.HybridDeviceOptimizer


def as_with_torch_adam(module, monkeypatch):
    """Puts upstream's ``distrib_optimizer`` in the mode it runs torch Adam in: neither TE nor
    Apex imported.

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
