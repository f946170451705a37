# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Loads this repository's ``tools/`` scripts as modules, for the tests of their logic.

``tools/`` is no package, so each script is loaded from its file. A vendored Megatron-LM tree
gets ``megatron/`` and ``tests/`` from this repository but not its ``tools/``: there the tests
that need a script skip.

Imported as ``fork_tools`` (pytest puts this folder on ``sys.path``) or as
``tests.unit_tests.fork_tools`` from a checkout whose ``tests/`` is a package.
"""

import importlib.util
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(file_name, module_name):
    """``tools/<file_name>`` loaded as a module named ``module_name``; skips where it is absent.

    Args:
        file_name (str): the script's file name, e.g. ``"distopt_resume.py"``.
        module_name (str): the name the module gets (distinct per caller, so that state set
            by one test file does not leak into another's module).
    """
    path = TOOLS / file_name
    if not path.is_file():
        pytest.skip(f"{path} is not here (a vendored tree has no tools/)", allow_module_level=True)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
