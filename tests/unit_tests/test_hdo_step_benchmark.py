# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The HDO step benchmark's arithmetic: both limits and the ratios it prints (CPU)."""

import sys
from pathlib import Path

import pytest

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    from fork_tools import load_tool
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests.fork_tools import load_tool

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if not (BENCHMARKS / "hdo_step.py").is_file():
    pytest.skip("no benchmarks/ here (a vendored tree)", allow_module_level=True)
sys.path.insert(0, str(BENCHMARKS))  # the benchmark imports its cases as a sibling module
benchmark = load_tool("../benchmarks/hdo_step.py", "hdo_step_benchmark")


def test_the_contended_limit_takes_adam_as_timed_beside_the_copies():
    floor = {"adam": 0.10, "d2h": 0.02, "h2d": 0.03, "adam_beside_copies": 0.125}
    result = {"step": 0.15, "step_min": 0.14, "step_max": 0.16, "outside": 0.0}
    result.update(pinned_held=0, pinned_live=0)
    row = benchmark.row_of("stress", 0.5, True, "fork", result, floor, True)
    assert row["floor_s"] == pytest.approx(0.15) and row["limit_s"] == 0.10
    assert row["limit_contended_s"] == 0.125
    assert row["ratio_limit"] == pytest.approx(1.5)
    assert row["ratio_contended"] == pytest.approx(1.2)
    # Copies slower than AdamW even beside them: the copies are the limit.
    slow_bus = dict(floor, d2h=0.2)
    assert benchmark.row_of("x", 1.0, True, "fork", result, slow_bus, True)[
        "limit_contended_s"
    ] == pytest.approx(0.2)
