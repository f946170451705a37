# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""CPU tests of the resume harness's own logic: which results upstream's bugs excuse, how its
torchrun jobs share the GPUs, and that its one table is what every tool, benchmark and test
reads."""

import dataclasses
import gc
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    import optimizer_table
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests import optimizer_table

_fork_tools = optimizer_table.sibling("fork_tools")
import_harness = _fork_tools.import_harness
load_tool = _fork_tools.load_tool

tool = import_harness()
orchestrator = import_harness("orchestrator")
jobs = import_harness("jobs")
results_files = import_harness("results")
table = import_harness("table")
cli = import_harness("cli")
main_job = import_harness("main_job")


def test_only_upstreams_own_failures_are_excused():
    save_error = "save failed on rank 0: ValueError: can't optimize a non-leaf Tensor"
    results = {
        "w1-fp32-off0.5-legacy-upstream2fork": {"error": save_error},
        "w1-bf16-off0.5-legacy-upstream2fork": {"error": "KeyError: 'step'"},
        "w1-bf16-off0-legacy-fork2upstream": {"error": "KeyError: 'step'"},
        "w1-bf16-off0-legacy-upstream2upstream": {"error": "KeyError: 'step'", "exact": False},
        "w1-bf16-off1-legacy-fork2upstream": {"error": "boom"},
        "w1-bf16-off1-legacy-upstream2upstream": {"exact": True, "common_equal": True},
        "w1-bf16-off1-legacy-fork2fork": {"error": save_error},
    }
    excuse = tool.control_failure
    assert "cannot write" in excuse(results, "w1-fp32-off0.5-legacy-upstream2fork")
    # A failure of the fork's load is never excused, nor is the fork's own save.
    assert excuse(results, "w1-bf16-off0.5-legacy-upstream2fork") is None
    assert excuse(results, "w1-bf16-off1-legacy-fork2fork") is None
    assert "fails too" in excuse(results, "w1-bf16-off0-legacy-fork2upstream")
    # Upstream passing its own checkpoint leaves the fork's checkpoint to blame.
    assert excuse(results, "w1-bf16-off1-legacy-fork2upstream") is None


@pytest.mark.parametrize(
    "visible,nproc,jobs,side_by_side,expected",
    [
        (["0", "1"], 1, 2, True, [["0"], ["1"]]),
        (["0", "1"], 2, 2, True, [None, None]),  # not enough GPUs: one after the other
        (["0", "1"], 1, 2, False, [None, None]),
        (["4", "5", "6", "7"], 2, 2, True, [["4", "5"], ["6", "7"]]),
        (["0", "1"], 1, 1, True, [None]),
    ],
)
def test_jobs_run_side_by_side_only_on_gpus_of_their_own(
    monkeypatch, visible, nproc, jobs, side_by_side, expected
):
    seen, running, overlap = {}, [0], [False]
    lock = threading.Lock()

    def launch(role, implementation, n, extra, log, timeout, devices=None):
        assert (role, n, extra, timeout) == ("save", nproc, [], 60)
        with lock:
            running[0] += 1
            overlap[0] |= running[0] > 1
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        seen[implementation] = devices
        return 0 if implementation != "job1" else 3

    monkeypatch.setattr(orchestrator, "_launch", launch)
    monkeypatch.setattr(orchestrator, "_visible_devices", lambda: visible)
    job_list = [("save", f"job{i}", [], f"log{i}") for i in range(jobs)]
    codes = orchestrator._run_side_by_side(
        job_list, nproc, 60, side_by_side
    )  # pylint: disable=protected-access
    assert codes == [0, 3][:jobs]
    assert [seen[f"job{i}"] for i in range(jobs)] == expected
    assert overlap[0] == (expected[0] is not None)


class _Died(BaseException):
    """Stands for a CUDA error that ends the process: no ``except Exception`` stops it."""


@pytest.mark.parametrize("dies", ["in_the_case", "after_its_result"])
def test_a_load_job_killed_by_one_case_restarts_after_it(monkeypatch, tmp_path, dies):
    """Every case but the one that killed the job gets its result, and that one an error
    naming the exit code and the log's cause (or its own result, when the job died in the
    clean-up after it); a case is run once. The cold-start figures measured before the load
    that killed the job are kept."""
    names = ["bf16-off0-legacy", "bf16-off0.5-legacy", "bf16-off0-dp_reshardable"]
    root = tmp_path / "saved_by_upstream"
    root.mkdir()
    manifest = {"save_with": "upstream", "world": 1, "module_file": "m", "steps_after": 1}
    manifest["cases"] = [vars(tool.Case.parse(name)) for name in names]
    (root / tool.MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")
    killer = tool.Case.parse(names[1]).key(1, "upstream", "upstream")
    runs = []

    def load_one(case, folder, args, rank, manifest, result, built):
        # pylint: disable=unused-argument,too-many-arguments
        runs.append(case.name)
        result.update(error=None, pinned_cold_bytes=1000 + len(runs))
        built(result)
        if case.key(1, "upstream", "upstream") == killer:
            if dies == "in_the_case":
                raise _Died()
            result.update(error="RuntimeError: CUDA error", params_exact=False)
            return result
        result.update(params_exact=True, state_exact=True)
        return result

    def release():
        if dies == "after_its_result" and runs[-1] == names[1] and runs.count(names[1]) == 1:
            runs.append("released")  # die once, in the clean-up after the killer's result
            raise _Died()

    class Rank:
        rank, world = 0, 1

        @staticmethod
        def barrier():
            pass

    def launch(role, implementation, nproc, extra, log, timeout, devices=None):
        assert (role, implementation, nproc, devices) == ("load", "upstream", 1, None)
        Path(log).write_text("frame #0: c10::Error::Error\nRuntimeError: CUDA error\n")
        args = tool.parse_args(["--load-with", "upstream", "--ckpt-dir", str(root), *extra])
        try:
            jobs.run_load(args, Rank(), "m")
        except _Died:
            return 1
        return 0

    monkeypatch.setattr(jobs, "load_one", load_one)
    monkeypatch.setattr(jobs, "release", release)  # no CUDA here
    monkeypatch.setattr(orchestrator, "_launch", launch)
    out = tmp_path / "loaded_by_upstream.json"
    job = ("load", "upstream", ["--out", str(out)], tmp_path / "load.log")
    assert launch(*job[:2], 1, job[2], job[3], 60) == 1
    assert orchestrator._load_until_done(job, 1, 60, 1) == 0  # pylint: disable=protected-access
    assert [name for name in runs if name != "released"] == names
    results = json.loads(out.read_text(encoding="utf-8"))
    assert sorted(results) == sorted(
        tool.Case.parse(name).key(1, "upstream", "upstream") for name in names
    )
    expected = {"in_the_case": "died in this case (exit 1): RuntimeError: CUDA error"}
    assert expected.get(dies, "RuntimeError: CUDA error") in results[killer]["error"]
    assert ("died" in results[killer]["error"]) == (dies == "in_the_case")
    assert all(results[key]["exact"] for key in results if key != killer)
    # The killer ran second: its cold-start figure survives the process it ended.
    assert results[killer]["pinned_cold_bytes"] == 1002
    assert not results[killer]["exact"]


def test_drive_runs_save_then_load_jobs_and_collects_every_case(monkeypatch, tmp_path):
    """The driver's own path from jobs to results, with torchrun faked: each saving job writes
    its manifest, each loading job its result; a load job that died once is restarted, and
    stale result files of an earlier run in the same folder are not read."""
    cases = [tool.Case.parse("bf16-off0-legacy"), tool.Case.parse("bf16-off0.5-legacy")]
    pairs = [("fork", "fork"), ("upstream", "fork")]
    # A merged result of an earlier run in the same folder, which the driver would read first.
    (tmp_path / "work").mkdir()
    stale = tmp_path / "work" / "loaded_by_fork.json"
    stale.write_text('{"w1-bf16-off0-legacy-fork2fork": {"error": "stale"}}', encoding="utf-8")
    starts = []

    def launch(role, implementation, nproc, extra, log, timeout, devices=None):
        starts.append((role, implementation, "--continue-load" in extra))
        Path(log).write_text("RuntimeError: CUDA error: an illegal memory access\n")
        # Both jobs get the collective timeout; the save job the probe's widths.
        assert extra[extra.index("--collective-timeout") + 1] == "45"
        if role == "save":
            assert extra[extra.index("--hidden") + 1 :][:3] == ["64", "--ffn", "96"]
            root = Path(extra[extra.index("--ckpt-dir") + 1])
            root.mkdir(parents=True)
            manifest = {"save_with": implementation, "world": nproc, "module_file": "m"}
            manifest.update(steps_after=1, cases=[vars(case) for case in cases])
            (root / tool.MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")
            return 0
        out = extra[extra.index("--out") + 1]
        part = results_files.rank_file(out, 0)
        results = json.loads(part.read_text()) if "--continue-load" in extra else {}
        for saver in ("fork", "upstream"):
            for case in cases:
                key = case.key(nproc, saver, implementation)
                if key in results:
                    continue
                if saver == "upstream" and case.offload == 0.5 and "--continue-load" not in extra:
                    marker = results_files.current_file(out, 0)
                    marker.write_text(json.dumps({"case": key}))
                    return 1  # the first start dies in this case
                results[key] = {"error": None, "params_exact": True, "state_exact": True}
                part.write_text(json.dumps(results))
        return 0

    monkeypatch.setattr(orchestrator, "_launch", launch)
    monkeypatch.setattr(orchestrator, "te_unavailable", lambda case: None)
    logs = tmp_path / "logs"
    results = tool.drive(
        cases,
        pairs,
        nproc=1,
        workdir=str(tmp_path / "work"),
        side_by_side=False,
        shape=tool.Shape(64, 96),
        collective_timeout=45,
        log_dir=logs,
    )
    assert starts == [
        ("save", "fork", False),
        ("save", "upstream", False),
        ("load", "fork", False),
        ("load", "fork", True),
    ]
    died = "w1-bf16-off0.5-legacy-upstream2fork"
    assert sorted(results) == sorted(case.key(1, s, "fork") for case in cases for s, _ in pairs)
    assert "died in this case (exit 1): RuntimeError: CUDA error" in results[died]["error"]
    assert all(results[key]["exact"] for key in results if key != died), results
    # Every job's log, the restart's too, is kept beside the results.
    assert sorted(p.name for p in logs.iterdir()) == [
        "load_fork.log",
        "load_fork.log.restart1",
        "save_fork.log",
        "save_upstream.log",
    ]


def test_drive_reuses_a_clean_save_and_redoes_a_failed_one(monkeypatch, tmp_path):
    """With ``reuse_saves`` a saving implementation whose save job ended cleanly in the same
    folder is not run again (its checkpoints are read again); one whose save job failed is."""
    cases = [tool.Case.parse("bf16-off0-legacy")]
    starts, save_codes = [], {"fork": 0, "upstream": 1}

    def launch(role, implementation, nproc, extra, log, timeout, devices=None):
        starts.append((role, implementation))
        Path(log).write_text("")
        if role == "save":
            root = Path(extra[extra.index("--ckpt-dir") + 1])
            root.mkdir(parents=True, exist_ok=True)
            manifest = {"save_with": implementation, "world": nproc, "module_file": "m"}
            manifest.update(steps_after=1, cases=[vars(case) for case in cases])
            (root / tool.MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")
            return save_codes[implementation]
        out = extra[extra.index("--out") + 1]
        keys = [case.key(nproc, s, implementation) for case in cases for s in ("fork", "upstream")]
        result = {"error": None, "params_exact": True, "state_exact": True}
        results_files.rank_file(out, 0).write_text(json.dumps({key: result for key in keys}))
        return 0

    monkeypatch.setattr(orchestrator, "_launch", launch)
    monkeypatch.setattr(orchestrator, "te_unavailable", lambda case: None)
    pairs = [("fork", "fork"), ("upstream", "fork")]
    for _ in range(2):
        results = tool.drive(
            cases, pairs, nproc=1, workdir=str(tmp_path), side_by_side=False, reuse_saves=True
        )
        assert results[cases[0].key(1, "fork", "fork")]["exact"]
        assert "save job exited 1" in results[cases[0].key(1, "upstream", "fork")]["error"]
    assert starts == [
        ("save", "fork"),
        ("save", "upstream"),
        ("load", "fork"),
        ("save", "upstream"),
        ("load", "fork"),
    ]


def test_probe_shape_keeps_several_buckets():
    """The small probe keeps the bucket size the matrix was written for; a wide one (the main
    job's) still gets several buckets, not thousands."""
    small, wide = tool.Shape(), tool.Shape(1024, 4096)
    assert small.bucket_size == tool.BUCKET_SIZE and small.numel < 3 * tool.BUCKET_SIZE
    assert 3 <= wide.numel / wide.bucket_size <= tool.BUCKETS_PER_MODEL + 1
    # The count matches the module the probe builds (three linears, one without bias, a norm).
    layers = [
        torch.nn.Linear(1024, 4096),
        torch.nn.Linear(4096, 4096, bias=False),
        torch.nn.Linear(4096, 1024),
        torch.nn.LayerNorm(1024),
    ]
    assert wide.numel == sum(p.numel() for layer in layers for p in layer.parameters())


def test_ranks_merge_into_one_result_judged_by_the_worst_rank():
    """Exact only where every rank was; each figure and each load phase's peak is the largest
    any rank reported, a phase only one rank had included."""
    parts = [
        {
            "error": None,
            "params_exact": True,
            "state_exact": True,
            "common_equal": True,
            "pinned_cold_bytes": 5,
            "load_peak_gpu_extra_bytes": 30,
            "load_phase_peak_gpu_extra_bytes": {"is_loading": 10, "read": 30},
        },
        {
            "error": None,
            "params_exact": True,
            "state_exact": False,
            "common_equal": True,
            "pinned_cold_bytes": 9,
            "load_peak_gpu_extra_bytes": 25,
            "load_phase_peak_gpu_extra_bytes": {"is_loading": 20, "load_state_dict": 25},
            "mismatches": ["state x: max |diff| 1"],
        },
    ]
    merged = tool.merge_case(parts)
    assert not merged["exact"] and merged["params_exact"] and not merged["state_exact"]
    assert merged["pinned_cold_bytes"] == 9 and merged["load_peak_gpu_extra_bytes"] == 30
    assert merged["load_phase_peak_gpu_extra_bytes"] == {
        "is_loading": 20,
        "read": 30,
        "load_state_dict": 25,
    }
    assert merged["mismatches"] == ["state x: max |diff| 1"]
    assert [rank["pinned_cold_bytes"] for rank in merged["per_rank"]] == [5, 9]


def test_optimizer_state_bytes_counts_each_tensor_once_by_place():
    shared = torch.zeros(8, dtype=torch.bfloat16)
    inner = SimpleNamespace(
        state={
            "a": {"exp_avg": shared, "exp_avg_sq": torch.zeros(8, dtype=torch.bfloat16)},
            "b": {"exp_avg": shared, "master_param": torch.zeros(8, dtype=torch.int16)},
            "c": {"step": 3},
        }
    )
    found = tool.optimizer_state_bytes(
        SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=inner)])
    )
    assert found == {"gpu_moments": 0, "gpu_all": 0, "host_moments": 32, "host_all": 48}


def _multiply_for_the_profile(matrix):
    return torch.mm(matrix, matrix)


def test_a_profiled_phase_names_the_operators_and_functions_it_ran(monkeypatch):
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, **kwargs: None)
    for name in ("memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, **kwargs: 0)
    monkeypatch.setenv(tool.PROFILE_ENV, "1")
    peaks = tool.PhasePeaks()
    with peaks.phase("read"):
        _multiply_for_the_profile(torch.ones(32, 32))
    with peaks.phase("load_state_dict"):
        gc.collect()
    assert "aten::mm" in peaks.profiles["read"]["ops"]
    assert "_multiply_for_the_profile" in peaks.profiles["read"]["python"]
    assert peaks.seconds["read"] > 0 and peaks.peaks["read"] == 0
    assert "gc: generation 2: 1 in" in peaks.profiles["load_state_dict"]["python"]

    monkeypatch.delenv(tool.PROFILE_ENV)
    quiet = tool.PhasePeaks()
    with quiet.phase("read"):
        _multiply_for_the_profile(torch.ones(32, 32))
    assert not quiet.profile and quiet.profiles == {} and quiet.seconds["read"] > 0


def test_load_memory_prints_the_profile_of_each_phase():
    benchmark = load_tool("../benchmarks/load_memory.py", "load_memory_cpu")
    assert benchmark.build_parser().parse_args(["--profile"]).profile
    assert not benchmark.build_parser().parse_args([]).profile
    profiles = {"read": {"ops": "aten::copy_ 12 ms", "python": "write 3 ms"}}
    table = {
        "bf16-dp_reshardable": {
            "fork": {"raw": {"load_phase_profiles": profiles}},
            "upstream": {"raw": {}},
        }
    }
    out = io.StringIO()
    benchmark.report_profiles(table, out)
    printed = out.getvalue()
    assert "=== profile bf16-dp_reshardable fork read" in printed
    assert "aten::copy_ 12 ms" in printed and "write 3 ms" in printed
    assert "upstream" not in printed


def test_load_jobs_read_their_checkpoint_into_the_page_cache_unless_told_not_to(
    monkeypatch, tmp_path
):
    sizes = {"dist/a.distcp": 3 << 20, "dist/nested/b.distcp": 17 << 20, "dist/.metadata": 5}
    for name, size in sizes.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * size)
    assert tool.warm_page_cache(tmp_path / "dist", enabled=False) == 0
    monkeypatch.setenv(tool.PAGE_CACHE_ENV, "1")
    assert tool.warm_page_cache(tmp_path / "dist") == sum(sizes.values())
    monkeypatch.setenv(tool.PAGE_CACHE_ENV, "0")
    assert tool.warm_page_cache(tmp_path / "dist") == 0
    benchmark = load_tool("../benchmarks/load_memory.py", "load_memory_cpu")
    monkeypatch.setattr(benchmark.torch.cuda, "is_available", lambda: False)
    assert benchmark.main([]) == 2 and os.environ[tool.PAGE_CACHE_ENV] == "1"
    assert benchmark.main(["--page-cache", "as-left"]) == 2
    assert os.environ[tool.PAGE_CACHE_ENV] == "0"


def test_load_memory_reports_phases_in_state_sets():
    benchmark = load_tool("../benchmarks/load_memory.py", "load_memory_cpu")
    mib = 2**20
    result = {
        "optimizer_state_bytes": {"gpu_moments": 4 * mib, "gpu_all": 6 * mib},
        "load_phase_peak_gpu_extra_bytes": {"is_loading": 6 * mib, "read": 7 * mib},
        "load_phase_after_gpu_extra_bytes": {"is_loading": 6 * mib, "read": 6 * mib},
        "load_peak_gpu_extra_bytes": 7 * mib,
        "load_seconds": 1.5,
        "load_phase_seconds": {"is_loading": 0.25, "read": 1.0},
        "exact": True,
    }
    found = benchmark.figures(result)
    assert (found["state_set_mib"], found["state_sets"], found["peak"]) == (4, 1.5, 1.75)
    assert (found["read_peak"], found["read_after"], found["read_peak_mib"]) == (1.75, 1.5, 7)
    assert found["load_state_dict_peak"] is None
    assert (found["is_loading_s"], found["read_s"], found["load_state_dict_s"]) == (0.25, 1, None)
    # Offloaded state: no state set on the GPU, so only MiB.
    offloaded = benchmark.figures(dict(result, optimizer_state_bytes={"host_moments": 4 * mib}))
    assert offloaded["read_peak"] is None and offloaded["read_peak_mib"] == 7


def _load_memory_without_gpu(monkeypatch, name):
    """``load_memory.py`` with its torchrun jobs replaced: each records (implementation, the
    fork tree it was told, its work folder) and reports an exact 1 s load whose modules came
    from that tree (from ``installed`` where none was told). Returns (benchmark, jobs)."""
    benchmark = load_tool("../benchmarks/load_memory.py", name)
    jobs = []

    def drive(cases, pairs, *_, **settings):
        implementation = pairs[0][0]
        told = os.environ.get(tool.FORK_TREE_ENV)
        jobs.append((implementation, told, Path(settings["workdir"]).name))
        module = os.path.join(told or "installed", "megatron", "core", "optimizer", "d.py")
        state = {"gpu_moments": 2**20, "gpu_all": 2**20}
        result = {"optimizer_state_bytes": state, "load_seconds": 1.0, "exact": True}
        result["module_files"] = {"save": module, "load": module}
        return {case.key(1, implementation, implementation): result for case in cases}

    monkeypatch.setattr(benchmark.distopt_resume, "drive", drive)
    monkeypatch.setattr(benchmark.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(benchmark.torch.cuda, "get_device_name", lambda: "a test device")
    monkeypatch.delenv(tool.FORK_TREE_ENV, raising=False)
    return benchmark, jobs


def test_load_memory_skip_upstream_runs_only_the_fork_s_jobs(monkeypatch, capsys):
    """``--skip-upstream`` starts no upstream job, and the table says upstream was not run and
    where the fork's modules came from."""
    benchmark, jobs = _load_memory_without_gpu(monkeypatch, "load_memory_fork_alone")
    argv = ["--rows", "bf16-dp_reshardable", "--skip-upstream", "--repeats", "2"]
    assert benchmark.main(argv) == 0
    assert [implementation for implementation, _, _ in jobs] == ["fork", "fork"]
    printed = capsys.readouterr().out
    assert "upstream  not run" in printed and "fork" in printed
    folder = os.path.join("installed", "megatron", "core", "optimizer")
    assert f"fork modules from: {folder}\n" in printed and "upstream modules" not in printed


def test_load_memory_fork_tree_loads_with_that_tree_s_modules_in_turn(
    monkeypatch, capsys, tmp_path
):
    """``--fork-tree PATH`` adds a side whose jobs (and only theirs) are told to take the fork's
    modules from PATH, alternating with the fork's own; the table has a row for it and names
    the folder its modules came from."""
    benchmark, jobs = _load_memory_without_gpu(monkeypatch, "load_memory_fork_tree")
    tree = tmp_path / "before"
    (tree / "megatron" / "core" / "optimizer").mkdir(parents=True)
    argv = ["--rows", "bf16-dp_reshardable", "--skip-upstream", "--repeats", "2"]
    assert benchmark.main(argv + ["--fork-tree", str(tree)]) == 0
    fork, other = ("fork", None, "fork"), ("fork", str(tree), "fork_tree1")
    assert jobs == [fork, other, other, fork]
    assert tool.FORK_TREE_ENV not in os.environ
    printed = capsys.readouterr().out
    side = f"fork@{tree}"
    assert f"\n  {side} " in printed
    assert f"{side} modules from: {tree / 'megatron' / 'core' / 'optimizer'}\n" in printed
    folder = os.path.join("installed", "megatron", "core", "optimizer")
    assert f"fork modules from: {folder}\n" in printed
    with pytest.raises(SystemExit):
        benchmark.main(argv + ["--fork-tree", str(tmp_path / "nothing")])


def test_a_job_told_a_fork_tree_imports_the_fork_s_modules_from_it(tmp_path):
    """The worker routes ``megatron.core.optimizer`` to the tree's ``megatron/`` folder when
    the environment names one, and proves it did."""
    tree = tmp_path / "tree"
    shutil.copytree(_fork_tools.REPO_ROOT / "megatron", tree / "megatron")
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "from resume_harness.worker import select_implementation; "
        "print(select_implementation('fork'))"
    )
    env = dict(os.environ, **{tool.FORK_TREE_ENV: str(tree)})
    env.pop("MEGATRON_OPTIMIZER_FORK", None)
    found = subprocess.run(
        [sys.executable, "-c", script, str(_fork_tools.REPO_ROOT)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert found == str((tree / "megatron/core/optimizer/distrib_optimizer.py").resolve())


def test_load_memory_repeats_alternate_and_report_the_median_load_time(monkeypatch):
    """Repeated runs swap which implementation goes first; memory figures come from the first
    run that loaded, the load time is the median of the runs that loaded (a run whose resumed
    steps failed after its load among them), and a later run that fails or drifts shows in
    the row."""
    benchmark = load_tool("../benchmarks/load_memory.py", "load_memory_repeats")
    order = []

    workdirs = {}

    def drive(cases, pairs, *_, **settings):
        side = pairs[0][0]
        order.append(side)
        # Each implementation keeps one folder over its runs, and saves in the first only.
        assert settings["reuse_saves"] and settings["workdir"] == workdirs.setdefault(
            side, settings["workdir"]
        )
        state = {"gpu_moments": 2**20, "gpu_all": 2**20 * len(order)}
        result = {"optimizer_state_bytes": state, "load_seconds": float(len(order))}
        result["load_phase_seconds"] = {"read": len(order) / 2}
        result["exact"] = len(order) != 4  # upstream's second run drifts
        if len(order) == 3:  # the fork's second run fails to load
            result = {"error": "RuntimeError: injected"}
        if len(order) == 5:  # upstream's third run loads, then its resumed steps fail
            result["error"] = "RuntimeError: after the load"
        return {case.key(1, side, side): result for case in cases}

    monkeypatch.setattr(benchmark.distopt_resume, "drive", drive)
    row = "bf16-dp_reshardable"
    stream = io.StringIO()
    table = benchmark.run([row], None, 1, 2, 2, repeats=3, out=stream)
    assert order == ["upstream", "fork", "fork", "upstream", "upstream", "fork"]
    assert len(set(workdirs.values())) == 2
    # Each job's line is written as it ends, in the order the jobs ran.
    lines = stream.getvalue().splitlines()
    assert [line.split()[1:3] for line in lines] == [
        [str(n // 2 + 1), side] for n, side in enumerate(order)
    ]
    assert "load 1.000 s (phases -/0.50/- s)" in lines[0] and lines[0].endswith("exact yes")
    assert "error: RuntimeError: injected" in lines[2]
    assert lines[3].endswith("exact NO")
    assert "load 5.000 s" in lines[4] and lines[4].endswith(
        "then error: RuntimeError: after the load"
    )
    fork, upstream = table[row]["fork"], table[row]["upstream"]
    assert fork["load_s_all"] == [2.0, 6.0] and fork["load_s"] == 4.0
    assert fork["state_sets"] == 2.0  # the first run's figures
    assert not fork["exact"] and fork["error"] == "run 2: RuntimeError: injected"
    assert upstream["load_s_all"] == [1.0, 4.0, 5.0] and upstream["load_s"] == 4.0
    # Each phase's time is the median of the runs that loaded, like the whole load's.
    assert (upstream["read_s"], fork["read_s"], fork["is_loading_s"]) == (2.0, 2.0, None)
    assert not upstream["exact"] and upstream["error"] == "run 3: RuntimeError: after the load"


def test_one_table_feeds_the_command_line_the_main_job_and_the_benchmark(monkeypatch):
    """A row added to the table reaches the resume command line's choices, the cases it builds
    and the main job's selection, with nothing else edited: no consumer keeps a list of its own.
    The benchmark's rows are cases of the table."""
    new_format = table.Format("new_format", dist_checkpoint=True, default_of="torch_dist")
    new_kind = table.OptimizerKind("new_kind", te=True, moment_dtype=torch.float32)
    monkeypatch.setattr(table, "FORMAT_ROWS", (*table.FORMAT_ROWS, new_format))
    monkeypatch.setattr(table, "OPTIMIZER_KINDS", (*table.OPTIMIZER_KINDS, new_kind))
    monkeypatch.setattr(table, "DTYPES", ("bf16",))
    monkeypatch.setattr(table, "OFFLOAD_FRACTIONS", (0.0, 0.25, 0.5))

    choices = {action.dest: action.choices for action in cli.build_parser()._actions}
    assert choices["format"] == table.format_names() and choices["format"][-1] == "new_format"
    assert choices["optimizer"] == table.kind_names() and choices["optimizer"][-1] == "new_kind"
    assert choices["dtype"] == ("bf16",)
    args = cli.parse_args(["--save-with", "fork", "--offload-fraction", "0", "0.25"])
    assert [case.offload for case in tool.selected_cases(args)] == [0.0, 0.25]
    for refused in (["--offload-fraction", "1"], ["--dtype", "fp32"]):
        with pytest.raises(SystemExit):
            cli.parse_args(["--save-with", "fork", *refused])
    args = cli.parse_args(["--save-with", "fork", "--cases", "bf16-off0-new_format-new_kind"])
    assert tool.selected_cases(args)[0].kind is new_kind
    # The TE kind runs without offload only, as the table's field says.
    with pytest.raises(SystemExit):
        cli.parse_args(["--save-with", "fork", "--cases", "bf16-off0.25-new_format-new_kind"])

    assert main_job.formats() == ["legacy", "dp_reshardable", "new_format"]
    assert main_job.te_formats() == ["dp_reshardable", "new_format"]
    assert main_job.te_kinds()[-1] == "new_kind"
    assert "precision_aware_fp16" not in main_job.te_kinds()  # resume_matrix=False

    monkeypatch.undo()
    benchmark = load_tool("../benchmarks/load_memory.py", "load_memory_rows")
    for row, name in benchmark.ROWS.items():
        case = tool.Case.parse(name)
        assert case.fmt in table.format_names(dist_checkpoint=True), row
    # The tool keeps the same command line: its main is the package's.
    assert load_tool("distopt_resume.py", "distopt_resume_thin").main is cli.main


def test_each_optimizer_kind_sets_fields_megatron_has():
    """Every kind's options are OptimizerConfig fields, and precision-aware kinds spell out
    store_param_remainders (OptimizerConfig defaults it to True)."""
    from megatron.core.optimizer import OptimizerConfig  # pylint: disable=import-outside-toplevel

    fields = {field.name for field in dataclasses.fields(OptimizerConfig)}
    for kind in table.OPTIMIZER_KINDS:
        for offload in (0.0, 0.5):
            options = kind.options(offload)
            assert set(options) <= fields, (kind.name, set(options) - fields)
            assert options["optimizer_cpu_offload"] == (offload > 0)
        if kind.precision_aware:
            assert kind.options(0.0)["store_param_remainders"] is kind.remainders
            assert kind.inner_settings()["exp_avg_dtype"] is kind.moment_dtype
    assert table.optimizer_kind("default").inner_settings() == {}
    with pytest.raises(ValueError, match="choose from"):
        table.optimizer_kind("sgd")


def test_the_tables_dist_checkpoint_formats_are_sharding_types_the_fork_knows():
    """A format the harness saves through ``sharded_state_dict`` is a sharding type of the fork's
    format registry, so that a renamed one is caught here and not in a GPU run."""
    formats = pytest.importorskip("megatron.core.optimizer.distrib_optimizer_formats")
    for name in table.format_names(dist_checkpoint=True):
        assert formats.format_named(name).name == name
    assert "legacy" not in formats.FORMATS  # torch.save files, not a sharding type


def test_load_memory_writes_its_json_into_a_folder_given_as_out(tmp_path):
    benchmark = load_tool("../benchmarks/load_memory.py", "load_memory_cpu")
    assert benchmark.json_file(str(tmp_path)) == tmp_path / "load_memory.json"
    assert benchmark.json_file(str(tmp_path / "figures.json")) == tmp_path / "figures.json"
    assert benchmark.json_file(f"{tmp_path}/new/") == tmp_path / "new" / "load_memory.json"
    assert benchmark.json_file(str(tmp_path / "a" / "b.json")) == tmp_path / "a" / "b.json"
    assert (tmp_path / "new").is_dir() and (tmp_path / "a").is_dir()
