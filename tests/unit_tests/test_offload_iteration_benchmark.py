# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The offload iteration benchmark: its command line, the variants and environments it starts,
the arithmetic of its table on made-up worker figures, and a tiny host-only run end to end."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if not (BENCHMARKS / "offload_iteration.py").is_file():
    pytest.skip("no benchmarks/ here (a vendored tree)", allow_module_level=True)
sys.path.insert(0, str(BENCHMARKS))  # the benchmark imports its worker as a sibling module

import offload_iteration as bench  # noqa: E402  pylint: disable=wrong-import-position


def process(variant, round_, iteration, phases=(0.5, 0.3, 1.0, 0.2), **extra):
    """Made-up figures of one worker process: ``phases`` are the breakdown's forward after a
    step, forward, forward+backward and step, the same in each of its breakdown iterations."""
    breakdown = {phase: [seconds] * 3 for phase, seconds in zip(bench.PHASES, phases)}
    figures = {
        "variant": variant,
        "round": round_,
        "iteration_s": iteration,
        "breakdown": breakdown,
        "pinned_peak": 0,
        "gpu_peak": 0,
        "gpu_reserved_peak": 0,
        "loss": 6.0,
        "steps_succeeded": True,
        "digest": "d",
    }
    figures.update(extra)
    return figures


def test_help_runs_and_every_option_says_what_it_does():
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "offload_iteration.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--variants" in done.stdout and "--no-deterministic" in done.stdout
    for action in bench.build_parser()._actions:  # pylint: disable=protected-access
        if action.dest not in ("help", "worker"):
            assert action.help, action.dest
            assert any(option in done.stdout for option in action.option_strings)


def test_defaults_are_the_issue_s_run_and_build_over_a_billion_parameters():
    args = bench.parse_args([])
    assert (args.warmup, args.iterations, args.rounds) == (3, 8, 2)
    assert args.bucket_size == 40_000_000 and args.fractions == [0.5, 1.0]
    assert bench.variant_names(args.variants, args.fractions) == [
        "gpu",
        "upstream@0.5",
        "fork@0.5",
        "fork-overlap@0.5",
        "upstream@1.0",
        "fork@1.0",
        "fork-overlap@1.0",
    ]
    hidden, ffn = args.hidden, args.ffn
    # Per layer: QKV and projection with biases, two MLP matrices with biases, two LayerNorms;
    # then the tied word embedding, the position embedding and the final LayerNorm.
    layer = 4 * hidden * hidden + 4 * hidden + 2 * hidden * ffn + ffn + hidden + 4 * hidden
    total = args.layers * layer + (args.vocab + args.seq_length) * hidden + 2 * hidden
    assert total >= 1_000_000_000


def test_variants_are_selected_by_kind_or_by_name_and_bad_ones_are_refused(capsys):
    assert bench.variant_names(["fork", "gpu"], [1.0, 0.5]) == ["gpu", "fork@0.5", "fork@1.0"]
    assert bench.variant_names(["fork-overlap@1", "upstream@0.5"], [0.25]) == [
        "upstream@0.5",
        "fork-overlap@1.0",
    ]
    assert bench.parse_variant("fork-overlap@0.5") == ("fork-overlap", 0.5)
    for bad in (["fork@0"], ["fork@1.5"], ["cpu"], ["gpu@0.5"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--variants", *bad])
    assert "variant" in capsys.readouterr().err


def test_each_kind_gets_its_implementation_switches_and_nothing_else_changes():
    base = {"PATH": "/bin", bench.FORK_SWITCH: "0", bench.OVERLAP_SWITCH: "1"}
    upstream = bench.worker_environment("upstream", base)
    assert upstream[bench.FORK_SWITCH] == "0" and bench.OVERLAP_SWITCH not in upstream
    overlap = bench.worker_environment("fork-overlap", base)
    assert bench.FORK_SWITCH not in overlap and overlap[bench.OVERLAP_SWITCH] == "1"
    for kind in ("gpu", "fork"):
        plain = bench.worker_environment(kind, base)
        assert plain == {"PATH": "/bin"}
    assert base[bench.FORK_SWITCH] == "0"  # the caller's mapping is left alone


def test_a_worker_is_told_its_variant_and_only_the_first_round_profiles(tmp_path):
    args = bench.parse_args(["--profile", str(tmp_path)])
    spec = bench.worker_spec(args, "fork-overlap@0.5", 0)
    assert (spec["kind"], spec["fraction"], spec["overlap_step"]) == ("fork-overlap", 0.5, True)
    assert spec["profile_path"] == str(tmp_path / "fork-overlap@0.5.json")
    assert spec["iterations"] == 8 and spec["layers"] == 24
    later = bench.worker_spec(args, "fork@1.0", 1)
    assert later["overlap_step"] is False and later["profile_path"] is None
    assert bench.worker_spec(args, "gpu", 0)["fraction"] == 0.0


SMALL_MODEL = {"layers": 2, "hidden": 64, "heads": 4, "ffn": 256}
"""Sizes that override the defaults where a test builds a config."""


def test_recompute_reaches_the_worker_s_model_as_full_recompute_of_each_layer():
    import argparse  # pylint: disable=import-outside-toplevel

    import offload_iteration_worker as worker  # pylint: disable=import-outside-toplevel

    for argv, expected in (([], None), (["--recompute"], "full")):
        spec = bench.worker_spec(bench.parse_args(argv), "fork@1.0", 0)
        config = worker.transformer_config(argparse.Namespace(**{**spec, **SMALL_MODEL}), "cpu")
        assert config.recompute_granularity == expected
        if expected:
            assert (config.recompute_method, config.recompute_num_layers) == ("uniform", 1)


def test_one_variant_s_processes_combine_into_medians_extremes_and_peaks():
    processes = [
        process("fork@1.0", 0, 2.0, phases=(0.9, 0.3, 1.0, 0.5), pinned_peak=5, gpu_peak=7),
        process("fork@1.0", 1, 1.0, phases=(0.6, 0.2, 0.9, 0.4), pinned_peak=9, gpu_peak=3),
        process("fork@1.0", 2, 4.0, phases=(0.7, 0.4, 1.6, 0.6), pinned_peak=1, gpu_peak=1),
        {"variant": "fork@1.0", "round": 3, "error": "exit code 1"},
    ]
    processes[1]["breakdown"]["step"] = [0.1, 0.55, 0.58]  # a process's median is its own
    figures = bench.combined(processes)
    assert figures["iteration_s"] == 2.0
    assert (figures["iteration_min_s"], figures["iteration_max_s"]) == (1.0, 4.0)
    assert figures["iteration_per_process_s"] == [2.0, 1.0, 4.0]
    assert figures["iteration_by_round"] == {0: 2.0, 1: 1.0, 2: 4.0}
    assert figures["forward_s"] == pytest.approx(0.3)
    # Backward per process: 0.7, 0.7, 1.2; the first forward's wait: 0.6, 0.4, 0.3.
    assert figures["backward_s"] == pytest.approx(0.7)
    assert figures["step_in_forward_s"] == pytest.approx(0.4)
    assert figures["step_s"] == pytest.approx(0.55)
    assert (figures["pinned_peak"], figures["gpu_peak"]) == (9, 7)
    assert figures["digest"] == "d" and figures["errors"] == ["exit code 1"]
    processes[2]["digest"] = "e"
    assert bench.combined(processes)["digest"] == bench.MIXED
    assert bench.combined(processes[3:]) == {"errors": ["exit code 1"]}


def two_rounds():
    """gpu, upstream, fork and fork-overlap at 1.0 over two rounds, and fork@0.5 once."""
    return {
        "gpu": [process("gpu", 0, 1.0), process("gpu", 1, 2.0)],
        "upstream@1.0": [process("upstream@1.0", 0, 4.0), process("upstream@1.0", 1, 5.5)],
        "fork@1.0": [process("fork@1.0", 0, 3.0), process("fork@1.0", 1, 3.5)],
        "fork-overlap@1.0": [
            process("fork-overlap@1.0", 0, 2.0, digest="x"),
            process("fork-overlap@1.0", 1, 2.5, digest="x"),
        ],
        "fork@0.5": [process("fork@0.5", 0, 1.2)],
    }


def test_exposed_time_and_ratios_are_held_against_the_gpu_and_fork_variants():
    rows = {row["variant"]: row for row in bench.summarize(two_rounds())}
    gpu, fork = rows["gpu"], rows["fork@1.0"]
    assert gpu["exposed_s"] == 0.0 and gpu["vs_gpu"] == 1.0 and gpu["vs_fork_exposed"] is None
    # Medians: gpu 1.5, fork 3.25, upstream 4.75, overlap 2.25.
    assert fork["exposed_s"] == pytest.approx(1.75)
    assert fork["vs_gpu"] == pytest.approx(3.25 / 1.5)
    assert fork["vs_fork_exposed"] == pytest.approx(1.0)
    # Each round against the gpu process of the same round: 3.0-1.0 and 3.5-2.0.
    assert (fork["exposed_min_s"], fork["exposed_max_s"]) == (1.5, 2.0)
    upstream, overlap = rows["upstream@1.0"], rows["fork-overlap@1.0"]
    assert upstream["exposed_s"] == pytest.approx(3.25)
    assert upstream["vs_fork_exposed"] == pytest.approx(3.25 / 1.75)
    assert overlap["exposed_s"] == pytest.approx(0.75)
    assert overlap["vs_fork_exposed"] == pytest.approx(0.75 / 1.75)
    assert (overlap["exposed_min_s"], overlap["exposed_max_s"]) == (0.5, 1.0)
    # fork@0.5 ran in round 0 only: its range is that round's.
    half = rows["fork@0.5"]
    assert half["exposed_s"] == pytest.approx(1.2 - 1.5)
    assert (half["exposed_min_s"], half["exposed_max_s"]) == pytest.approx((0.2, 0.2))
    assert half["vs_fork_exposed"] is None  # its own exposed time is not above zero


def test_digests_are_compared_with_the_reference_kind_at_the_same_fraction():
    results = two_rounds()
    results["fork@0.5"][0]["digest"] = "x"
    rows = {row["variant"]: row for row in bench.summarize(results)}
    assert rows["fork@1.0"]["equal_to"] == "upstream@1.0" and rows["fork@1.0"]["equal"] is True
    assert rows["fork-overlap@1.0"]["equal_to"] == "fork@1.0"
    assert rows["fork-overlap@1.0"]["equal"] is False  # "x" against "d"
    assert rows["fork@0.5"]["equal"] is None  # no upstream@0.5 ran
    assert rows["gpu"]["equal"] is None and rows["upstream@1.0"]["equal"] is None
    results["upstream@1.0"][1]["digest"] = "y"
    assert bench.summarize(results)[2]["equal"] is None  # upstream's own processes differ


def test_a_failed_or_missing_variant_leaves_dashes_and_says_why():
    results = two_rounds()
    results["fork@1.0"] = [{"variant": "fork@1.0", "round": 0, "error": "exit code 1, no"}]
    results["fork-overlap@1.0"][0]["exit_code"] = -6
    rows = {row["variant"]: row for row in bench.summarize(results)}
    assert rows["fork@1.0"]["exposed_s"] is None
    assert rows["fork-overlap@1.0"]["vs_fork_exposed"] is None  # no fork to hold it against
    text = bench.markdown_table(list(rows.values()))
    assert "- fork@1.0 failed: exit code 1, no" in text
    assert "- fork-overlap@1.0: a process exited with -6 after its figures" in text
    failed = next(line for line in text.splitlines() if line.startswith("| fork@1.0 "))
    assert set(failed.strip("| ").split(" | ")[1:]) == {"-"}
    del results["gpu"]
    assert all(row["exposed_s"] is None for row in bench.summarize(results))


def test_the_table_prints_each_row_s_figures():
    rows = {row["variant"]: row for row in bench.summarize(two_rounds())}
    rows["fork@1.0"]["pinned_peak"] = 3 << 30
    line = next(
        line
        for line in bench.markdown_table(list(rows.values())).splitlines()
        if line.startswith("| fork@1.0 ")
    )
    cells = dict(zip([name for name, _ in bench.COLUMNS], line.strip("| ").split(" | ")))
    assert cells["iteration s"] == "3.250" and cells["min-max s"] == "3.000-3.500"
    assert cells["per process s"] == "3.000/3.500" and cells["/ gpu"] == "2.17"
    assert cells["exposed s"] == "1.750" and cells["exposed range s"] == "1.500 to 2.000"
    assert cells["/ fork exposed"] == "1.00" and cells["pinned peak GiB"] == "3.00"
    assert cells["backward s"] == "0.700" and cells["step in fwd s"] == "0.200"
    assert cells["equal"] == "yes"


def test_rounds_start_every_variant_in_turn_in_a_rotated_order(monkeypatch):
    started = []

    def fake_worker(_args, variant, round_):
        started.append(variant)
        return process(variant, round_, 1.0)

    monkeypatch.setattr(bench, "run_worker", fake_worker)
    args = bench.parse_args(["--rounds", "3"])
    results = bench.measure(args, ["gpu", "fork@0.5", "fork@1.0"])
    assert started == ["gpu", "fork@0.5", "fork@1.0"] + ["fork@0.5", "fork@1.0", "gpu"] + [
        "fork@1.0",
        "gpu",
        "fork@0.5",
    ]
    assert [p["round"] for p in results["gpu"]] == [0, 1, 2]


def test_figures_printed_before_a_failing_exit_are_kept(monkeypatch):
    args = bench.parse_args([])
    outputs = {}

    def fake_run(command, **kwargs):
        spec = json.loads(command[command.index("--worker") + 1])
        assert kwargs["env"].get(bench.FORK_SWITCH) == ("0" if spec["kind"] == "upstream" else None)
        stdout, code = outputs[spec["variant"]]
        return subprocess.CompletedProcess(command, code, stdout=stdout)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    figures = process("fork@1.0", 0, 1.0)
    outputs["fork@1.0"] = ("noise\n" + json.dumps(figures) + "\n", -6)
    outputs["upstream@1.0"] = ("Traceback: no figures\n", 1)
    kept = bench.run_worker(args, "fork@1.0", 0)
    assert kept["iteration_s"] == 1.0 and kept["exit_code"] == -6
    lost = bench.run_worker(args, "upstream@1.0", 1)
    assert lost["error"].startswith("exit code 1") and lost["round"] == 1


def test_without_cuda_and_without_smoke_nothing_is_measured(monkeypatch, capsys):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench, "measure", lambda *_: pytest.fail("measured without CUDA"))
    assert bench.main([]) is None
    assert "no CUDA here" in capsys.readouterr().out


def test_main_prints_the_table_and_writes_the_json(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "measure", lambda _args, variants: two_rounds())
    path = tmp_path / "out.json"
    report = bench.main(["--variants", "gpu", "fork", "--json", str(path)])
    out = capsys.readouterr().out
    assert "Command: python benchmarks/offload_iteration.py --variants gpu fork --json" in out
    assert "| fork-overlap@1.0 | 2.250 |" in out and out.rstrip().endswith(bench.LEGEND)
    saved = json.loads(path.read_text())
    assert [row["variant"] for row in saved["rows"]] == [row["variant"] for row in report["rows"]]
    assert saved["args"]["iterations"] == 8 and "worker" not in saved["args"]


def test_a_tiny_host_only_run_trains_every_fork_kind_to_the_same_parameters(tmp_path):
    """``--smoke`` without CUDA: a process per variant builds megatron-core's GPT model, DDP
    and optimizer, trains, times the phases and reports; with every element stepped on the
    host the three kinds must end with identical parameters."""
    pytest.importorskip("megatron.core.models.gpt", reason="needs megatron-core")
    bench_torch = bench.torch
    if bench_torch.cuda.is_available():
        pytest.skip("the host-only smoke path is for machines without CUDA")
    argv = ["--smoke", "--variants", "gpu", "fork", "fork-overlap", "--fractions", "1.0"]
    report = bench.main(argv + ["--json", str(tmp_path / "smoke.json")])
    rows = {row["variant"]: row for row in report["rows"]}
    assert list(rows) == ["gpu", "fork@1.0", "fork-overlap@1.0"]
    for row in rows.values():
        assert not row["errors"] and not row["exit_codes"] and row["steps_succeeded"]
        assert row["iteration_s"] > 0 and row["forward_s"] > 0 and row["step_s"] > 0
        assert row["loss"] == pytest.approx(rows["gpu"]["loss"], rel=1e-3)
    assert rows["fork-overlap@1.0"]["equal"] is True
    assert len({row["digest"] for row in rows.values()}) == 1
    processes = report["processes"]["fork@1.0"]
    assert processes[0]["optimizer"] and processes[0]["layer_spec"] == "local"
