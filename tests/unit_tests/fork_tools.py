# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Gives the tests this repository's resume harness (``resume_harness/``) and its ``tools/`` and
``benchmarks/`` scripts.

The harness is a package at the repository root, not installed; the scripts are loaded from their
files. A vendored Megatron-LM tree gets ``megatron/`` and ``tests/`` from this repository but
neither of those: there the tests that need them skip.

Imported as ``fork_tools`` (pytest puts this folder on ``sys.path``) or as
``tests.unit_tests.fork_tools`` from a checkout whose ``tests/`` is a package.
"""

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TOOLS = REPO_ROOT / "tools"
HARNESS = "resume_harness"


def import_harness(module=None):
    """The resume harness package, or its submodule ``module``; skips where it is absent.

    Args:
        module (str): a submodule's name, e.g. ``"drive"``; None for the package.
    """
    if not (REPO_ROOT / HARNESS / "__init__.py").is_file():
        pytest.skip(
            f"no {HARNESS}/ beside {REPO_ROOT / 'tests'} (a vendored tree)", allow_module_level=True
        )
    if str(REPO_ROOT) not in sys.path:
        # Appended: the root's megatron/ holds no __init__.py, so the installed megatron-core
        # still wins wherever it stands on the path.
        sys.path.append(str(REPO_ROOT))
    return importlib.import_module(f"{HARNESS}.{module}" if module else HARNESS)


def load_tool(file_name, module_name):
    """``tools/<file_name>`` loaded as a module named ``module_name``; skips where it is absent.

    Args:
        file_name (str): the script's file name, e.g. ``"resume_check.py"``.
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
