# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""CPU tests of the main job (``tools/resume_check.py`` over ``resume_harness``): its
distributed-optimizer part with the torchrun driver faked (what it runs in which order and what
it shows before it finishes), its tables, command line and verdict."""

import json
from argparse import Namespace

import pytest

try:  # pytest puts this folder on sys.path while tests/ is no package (this repository)
    from fork_tools import import_harness, load_tool
except ModuleNotFoundError:  # Megatron-LM's tests/ is a package
    from tests.unit_tests.fork_tools import import_harness, load_tool

main_job = import_harness("main_job")
distopt_report = import_harness("distopt_report")
hdo_report = import_harness("hdo_report")


@pytest.fixture(name="command_line", scope="module")
def fixture_command_line():
    return load_tool("resume_check.py", "resume_check_cpu")


class FakeDriver:
    """Stands in for the harness's driver: records its calls, gives one result a case."""

    def __init__(self, json_path, te_problem=None):
        self.json_path = json_path
        self.te_problem = te_problem
        self.calls = []
        self.settings = []

    class Shape:  # the probe's widths, as the real tool records them
        def __init__(self, hidden, ffn):
            self.hidden, self.ffn, self.numel = hidden, ffn, hidden * ffn

    @staticmethod
    def product(dtypes, offloads, formats, optimizers=("default",)):
        return [
            (d, o, f, opt) for d in dtypes for o in offloads for f in formats for opt in optimizers
        ]

    def te_unavailable(self, case):  # pylint: disable=unused-argument
        return self.te_problem

    def drive(self, cases, pairs, nproc, side_by_side=True, **settings):
        # pylint: disable=unused-argument
        self.settings.append(settings)
        written = json.loads(self.json_path.read_text()) if self.json_path.exists() else {}
        self.calls.append(("drive", [tuple(pair) for pair in pairs], len(cases), sorted(written)))
        save, load = pairs[0]
        return {
            f"{'-'.join(map(str, case))}-{save}2{load}": {
                "exact": save == "fork",
                "pinned_cold_bytes": 2**20 * (3 if save == "fork" else 7),
            }
            for case in cases
        }

    def report(self, results):
        self.calls.append(("report", sorted(results)))


@pytest.mark.parametrize("te_problem", [None, "Transformer Engine not importable"])
def test_the_forks_side_is_shown_and_kept_before_upstreams_runs(tmp_path, te_problem):
    """A main job cut short while upstream's side runs still shows and keeps the fork's."""
    json_path = tmp_path / "distributed.json"
    driver = FakeDriver(json_path, te_problem)
    args = Namespace(distributed="auto", offload_fraction=0.5, dist_hidden=64, dist_ffn=96)
    results = main_job.distributed_check(args, "cuda", str(json_path), tool=driver)

    cases = 4 + (0 if te_problem else 3)  # offload 0 and 0.5 x two formats (+ TE variants)
    fork_keys = sorted(k for k in results if k.endswith("fork2fork"))
    assert len(fork_keys) == cases and len(results) == 2 * cases
    assert driver.calls == [
        ("drive", [("fork", "fork")], cases, []),
        ("report", fork_keys),
        # Upstream's side starts with the fork's results already written and printed.
        ("drive", [("upstream", "upstream")], cases, fork_keys),
        ("report", sorted(results)),
    ]
    assert json.loads(json_path.read_text()) == results
    # Both sides train the same model, and keep their jobs' logs beside the results.
    assert [(s["shape"].hidden, s["shape"].ffn) for s in driver.settings] == [(64, 96)] * 2
    assert [s["log_dir"] for s in driver.settings] == [
        str(tmp_path / "logs_fork"),
        str(tmp_path / "logs_upstream"),
    ]


def test_the_last_table_puts_upstream_beside_the_fork(capsys):
    """One row per case and table, upstream's figures left of the fork's, each load phase's GPU
    peak in its column whatever the format calls it, skipped cases named."""
    mib = 2**20
    results = {
        "w2-bf16-off0.5-legacy-upstream2upstream": {"exact": False, "pinned_cold_bytes": 7 * mib},
        "w2-bf16-off0.5-legacy-fork2fork": {
            "exact": True,
            "pinned_cold_bytes": 3 * mib,
            "pinned_after_steps_bytes": 5 * mib,
            "load_seconds": 0.25,
            "load_phase_peak_gpu_extra_bytes": {"state_dict": mib, "param_state": 4 * mib},
            "load_peak_gpu_extra_bytes": 4 * mib,
        },
        "w2-bf16-off0-dist-upstream2upstream": {
            "exact": True,
            "load_phase_peak_gpu_extra_bytes": {
                "is_loading": 6 * mib,
                "read": 8 * mib,
                "load_state_dict": 9 * mib,
            },
            "load_peak_gpu_extra_bytes": 9 * mib,
        },
        "w2-bf16-off0-x-fork2fork": {"skipped": "no TE"},
        "w2-bf16-off0-x-upstream2upstream": {"skipped": "no TE"},
    }
    distopt_report.side_by_side(results)
    lines = capsys.readouterr().out.splitlines()

    def rows(name):
        return [line.split(" | ")[1:] for line in lines if line.startswith(f"{name} ")]

    host, gpu = rows("w2-bf16-off0.5-legacy")
    assert host[0].split() == ["NO", "7.0", "-", "-", "-"]
    assert host[1].split() == ["yes", "3.0", "-", "5.0", "250"]
    assert gpu[0].split() == ["-"] * 4
    assert gpu[1].split() == ["1.0", "-", "4.0", "4.0"]
    _, gpu = rows("w2-bf16-off0-dist")
    assert gpu[0].split() == ["6.0", "8.0", "9.0", "9.0"]
    for table in rows("w2-bf16-off0-x"):
        assert [cell.strip() for cell in table] == ["skipped", "skipped"]


def test_nothing_runs_without_cuda_or_when_switched_off(tmp_path, capsys):
    driver = FakeDriver(tmp_path / "distributed.json")
    on = Namespace(distributed="auto", offload_fraction=0.5, dist_hidden=64, dist_ffn=96)
    assert main_job.distributed_check(on, "cpu", None, tool=driver) is None
    assert "no figures are invented" in capsys.readouterr().out
    off = Namespace(distributed="off", offload_fraction=0.5, dist_hidden=64, dist_ffn=96)
    assert main_job.distributed_check(off, "cuda", None, tool=driver) is None
    assert not driver.calls


def test_every_option_has_help_with_its_default_and_the_epilog_names_outputs(command_line):
    parser = command_line.build_parser()
    shown = [a for a in parser._actions if a.help not in (None, "==SUPPRESS==")]
    for action in shown:
        if action.dest != "help":
            assert "%(default)s" in action.help, action.dest
    text = parser.format_help()
    for needle in ("exit codes", "PASS", "FAIL", ".json", ".png", "written\n"):
        assert needle in text, needle


def test_without_matplotlib_the_plot_says_why_and_nothing_crashes(monkeypatch, tmp_path):
    import builtins  # pylint: disable=import-outside-toplevel

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    reason = hdo_report.plot({"fork": {"error": "x"}}, str(tmp_path / "p.png"), "cpu")
    assert reason.startswith("no plot: matplotlib is not importable")
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize(
    "fork, distributed, passed, needle",
    [
        ({"exact": True}, None, True, "bit-exactly in the single-process check; upstream"),
        ({"exact": True}, {"a-fork2fork": {"exact": True}}, True, "in 1 distributed cases"),
        ({"exact": True}, {"a-fork2fork": {"exact": False}}, False, "['a-fork2fork']"),
        ({"exact": True}, {"a-fork2fork": {"skipped": "no TE"}}, True, "single-process check;"),
        ({"exact": False, "max_abs_diff": 0.5}, None, False, "differ (max |diff| 0.5)"),
        ({"error": "boom"}, None, False, "failed: boom"),
    ],
)
def test_the_verdict_says_pass_or_fail_and_why(fork, distributed, passed, needle):
    results = {"upstream 0.19.2": {"error": "cannot run"}, "fork": fork}
    outcome, why = main_job.verdict(results, distributed)
    assert outcome is passed and needle in why, why
