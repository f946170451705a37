# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The ranks-per-host benchmark runs end to end, tiny, and reports what its table says (CPU)."""

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if not (BENCHMARKS / "ranks_per_host.py").is_file():
    pytest.skip("no benchmarks/ here (a vendored tree)", allow_module_level=True)
# Its ranks are spawned processes that import it (and its siblings) by name from this path.
sys.path.insert(0, str(BENCHMARKS))

import ranks_per_host  # noqa: E402  pylint: disable=wrong-import-position
from hdo_cases import case_numels  # noqa: E402  pylint: disable=wrong-import-position


def test_the_slowest_rank_sets_each_step_and_the_limit_counts_adam_and_copies():
    """A step takes its slowest rank's time; the limit is 28 B of AdamW per host-stepped
    element and 4 B per copied one, all ranks together, over the bandwidth."""
    assert ranks_per_host.slowest([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]]) == [3.0, 5.0, 2.5]
    stepped = {"times": {"policy": [0.2, 0.4]}, "threads": {"policy": 2}, "digest": "d"}
    stepped.update(host_elements=1_000_000, dma_elements=500_000)
    runs = {"fork": [{"fractions": {"1.0": stepped}}] * 2}
    row = ranks_per_host.row_of("gpt", 2, 1.0, "policy", runs, gbps=10.0)
    # Two ranks: 2M elements through AdamW (28 B) and 1M copied (4 B) at 10 GB/s.
    assert row["limit_s"] == pytest.approx((28 * 2e6 + 4 * 1e6) / 10e9)
    assert row["fork_median_s"] == pytest.approx(0.3)
    assert row["ratio_limit"] == pytest.approx(0.3 / row["limit_s"])
    assert row["params_equal"] is None  # nothing to compare with
    runs["upstream 0.19.2"] = [{"fractions": {"1.0": dict(stepped, digest="e")}}] * 2
    assert ranks_per_host.row_of("gpt", 2, 1.0, "policy", runs, 10.0)["params_equal"] is False


def test_the_benchmark_runs_two_ranks_and_writes_every_row_s_figures(tmp_path):
    """Two spawned ranks at a tiny scale: a row per fraction and setting, each step timed, the
    host step on one thread under omp=1 and on the policy's share under policy, every element
    stepped on the host (no CUDA here: nothing copied), and the JSON what ``main`` returned."""
    pytest.importorskip(
        "megatron.core.optimizer.cpu_offloading.host_step_threads",
        reason="the benchmark times the fork's thread policy",
    )
    scale, argv = 0.0005, ["--ranks", "2", "--repeats", "2", "--warmup", "1"]
    argv += ["--scale", str(scale), "--bandwidth-mib", "4", "--out", str(tmp_path)]
    report = ranks_per_host.main(argv)
    rows = report["rows"]
    assert [(r["fraction"], r["setting"]) for r in rows] == [
        (0.5, "omp=1"),
        (0.5, "policy"),
        (1.0, "omp=1"),
        (1.0, "policy"),
    ]
    elements = sum(sum(case_numels("gpt", 2, scale, rank=rank)) for rank in range(2))
    policy = max(1, report["usable_cores"] // 2)
    for row in rows:
        assert row["ranks"] == 2 and row["case"] == "gpt"
        assert row["fork_threads"] == (1 if row["setting"] == "omp=1" else policy)
        assert len(row["fork_steps_s"]) == 2
        assert 0 < row["fork_min_s"] <= row["fork_median_s"] <= row["fork_max_s"]
        assert row["bandwidth_gbps"] == max(row["bandwidth_gbps_each"].values()) > 0
        assert row["limit_s"] > 0 and min(row["run_s"].values()) > 0
        assert row["ratio_limit"] == pytest.approx(row["fork_median_s"] / row["limit_s"])
        if "upstream_median_s" not in row:  # upstream's HDO needs CUDA
            assert row["host_elements"] == elements and row["dma_elements"] == 0
            assert row["params_equal"] is None
        else:
            assert row["params_equal"] is True
    saved = json.loads((tmp_path / f"ranks_per_host_{report['device_kind']}.json").read_text())
    assert saved["rows"] == rows and saved["default_threads"] >= 1


def test_the_benchmark_tells_ranks_sharing_the_gpu_through_mps_from_time_slicing(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert ranks_per_host.gpu_sharing("cpu") == "none"
    assert ranks_per_host.gpu_sharing("cuda") == "time-sliced"
    (tmp_path / "control").touch()  # what the daemon leaves while it runs
    assert ranks_per_host.gpu_sharing("cuda") == "MPS"
