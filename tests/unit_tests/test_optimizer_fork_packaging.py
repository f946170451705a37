# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Tests for how the fork reaches users: the import overlay, the wheel and vendoring.

The overlay tests expect the fork to be installed in the running environment
(``scripts/run_tests.sh`` reinstalls the working tree first). Where the ``megatron_optimizer_fork``
package cannot be imported at all (the tests copied into a Megatron-LM checkout, say) the whole
module is skipped. Tests that import megatron-core in a child process take a few seconds each,
since megatron-core imports torch.
"""

import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

fork = pytest.importorskip(
    "megatron_optimizer_fork", reason="megatron-core-optimizer-fork is not importable here"
)

DIST_NAME = "megatron-core-optimizer-fork"
REPO_ROOT = Path(__file__).resolve().parents[2]
HDO_RELATIVE = Path("megatron", "core", "optimizer", "cpu_offloading", "hybrid_optimizer.py")
UPSTREAM_ONLY_INITS = (
    "megatron/__init__.py",
    "megatron/core/__init__.py",
    "megatron/core/optimizer/__init__.py",
    "megatron/core/optimizer/cpu_offloading/__init__.py",
    # Megatron-LM's own test configuration, which a vendored rsync would overwrite.
    "tests/__init__.py",
    "tests/unit_tests/__init__.py",
    "tests/unit_tests/conftest.py",
)
RESULT_MARKER = "FORK_TEST_RESULT="
CHILD_TIMEOUT_S = 180

# Child-process snippet: reports where HybridDeviceOptimizer and megatron.core came from.
REPORT_HDO_ORIGIN = textwrap.dedent("""
    import importlib, inspect, json
    import megatron.core
    import megatron.core.optimizer as opt
    import megatron.core.optimizer.cpu_offloading as offloading
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    module = importlib.import_module(HybridDeviceOptimizer.__module__)
    print("FORK_TEST_RESULT=" + json.dumps({
        "hdo_file": inspect.getfile(HybridDeviceOptimizer),
        "core_file": megatron.core.__file__,
        "optimizer_path": list(opt.__path__),
        "offloading_path": list(offloading.__path__),
        "fork_marker": bool(getattr(module, "FORK_IMPLEMENTATION", False)),
        "same_class": module.HybridDeviceOptimizer is HybridDeviceOptimizer,
        "reexport_same": opt.HybridDeviceOptimizer is HybridDeviceOptimizer,
    }))
    """)


def _child_env(**overrides):
    """Copies this process's environment without the overlay switch, then applies overrides."""
    env = {key: value for key, value in os.environ.items() if key != fork.ENV_VAR}
    env.update(overrides)
    return env


def _run_child(code, cwd, **env_overrides):
    """Runs ``code`` in a fresh interpreter and returns the JSON it reported.

    Args:
        code (str): Python source that prints one line starting with ``RESULT_MARKER``.
        cwd (Path): Working folder for the child (kept away from the checkout).
        **env_overrides: Environment variables to set for the child.

    Returns:
        Any: The decoded JSON payload.
    """
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=_child_env(**env_overrides),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER) :])
    pytest.fail(
        f"child interpreter reported nothing (exit code {done.returncode})\n"
        f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    )
    return None


def _upstream_megatron_dir():
    """Returns megatron-core's installed ``megatron/`` folder, found without importing torch."""
    spec = importlib.util.find_spec("megatron.core")
    assert spec is not None and spec.origin, "megatron-core is not installed"
    return Path(spec.origin).resolve().parent.parent


def _core_search_path():
    """Returns ``megatron.core``'s search locations, found without importing torch."""
    return list(importlib.util.find_spec("megatron.core").submodule_search_locations)


def _site_dirs():
    """Returns this environment's site-packages folders, resolved."""
    return [Path(d).resolve() for d in site.getsitepackages() + [site.getusersitepackages()]]


def _is_under(path, folder):
    """Tells whether ``path`` lies inside ``folder`` (both resolved)."""
    return Path(path).resolve().is_relative_to(Path(folder).resolve())


def _repo_fork_modules():
    """Lists the fork's module files in the checkout, relative to the checkout's root."""
    tree = REPO_ROOT / "megatron" / "core" / "optimizer"
    return sorted(
        path.relative_to(REPO_ROOT)
        for path in tree.rglob("*.py")
        if "__pycache__" not in path.parts
    )


@pytest.mark.parametrize("value", ["0", "off", "false", "no", "OFF", " False ", "No"])
def test_switch_values_turn_the_overlay_off(monkeypatch, value):
    """Each false-like value of the environment switch disables the overlay."""
    monkeypatch.setenv(fork.ENV_VAR, value)
    assert not fork.is_enabled()
    assert not fork.is_active()


@pytest.mark.parametrize("value", [None, "", "1", "on", "yes", "true"])
def test_other_switch_values_leave_the_overlay_on(monkeypatch, value):
    """An unset switch, or any other value, keeps the overlay enabled."""
    if value is None:
        monkeypatch.delenv(fork.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(fork.ENV_VAR, value)
    assert fork.is_enabled()


def test_install_is_idempotent():
    """Installing twice leaves exactly one finder, at the front of sys.meta_path."""
    saved = list(sys.meta_path)
    try:
        fork.uninstall()
        first = fork.install()
        second = fork.install()
        assert first is second
        assert sys.meta_path[0] is first
        marked = [f for f in sys.meta_path if getattr(f, "is_megatron_optimizer_fork_finder", 0)]
        assert marked == [first]
    finally:
        sys.meta_path[:] = saved


def test_finder_leaves_other_modules_alone(monkeypatch):
    """Only the two overlaid package names are handled; everything else falls through."""
    monkeypatch.delenv(fork.ENV_VAR, raising=False)
    finder = fork.ForkOverlayFinder()
    core_path = _core_search_path()
    assert finder.find_spec("megatron.core", None) is None
    assert finder.find_spec("megatron.core.optimizer.optimizer", core_path) is None
    assert finder.find_spec("megatron.core.optimizer.cpu_offloading.hybrid_optimizer", []) is None


def test_finder_puts_fork_folder_first(monkeypatch):
    """The spec is upstream's package with the fork's folder ahead of upstream's folder."""
    monkeypatch.delenv(fork.ENV_VAR, raising=False)
    finder = fork.ForkOverlayFinder()
    core_path = _core_search_path()
    parent = finder.find_spec("megatron.core.optimizer", core_path)
    upstream = importlib.machinery.PathFinder.find_spec("megatron.core.optimizer", core_path)
    assert parent.origin == upstream.origin, "the package's own __init__ must stay upstream's"
    fork_dir = fork.fork_package_dir("megatron.core.optimizer")
    assert os.path.isdir(fork_dir), f"fork folder missing: {fork_dir}"
    assert parent.submodule_search_locations == [fork_dir] + upstream.submodule_search_locations

    child = finder.find_spec(
        "megatron.core.optimizer.cpu_offloading", parent.submodule_search_locations
    )
    upstream_child_init = Path(upstream.origin).parent / "cpu_offloading" / "__init__.py"
    assert Path(child.origin) == upstream_child_init
    assert child.submodule_search_locations[0] == fork.fork_package_dir(
        "megatron.core.optimizer.cpu_offloading"
    )
    assert len(child.submodule_search_locations) == 2


def test_serve_from_points_the_finder_at_another_checkout(monkeypatch, tmp_path):
    """``serve_from`` makes the finder put another checkout's folder first (how a benchmark
    times one commit's modules against another's); a folder without the modules is refused
    and changes nothing."""
    monkeypatch.delenv(fork.ENV_VAR, raising=False)
    monkeypatch.setattr(fork, "_SERVED", {})  # this process's choice, undone after the test
    installed = fork.fork_root()
    with pytest.raises(ValueError, match="no megatron/core/optimizer"):
        fork.serve_from(str(tmp_path))
    assert fork.fork_root() == installed
    other = tmp_path / "other"
    (other / "megatron" / "core" / "optimizer").mkdir(parents=True)
    fork.serve_from(str(other))
    parent = fork.ForkOverlayFinder().find_spec("megatron.core.optimizer", _core_search_path())
    assert parent.submodule_search_locations[0] == str(other / "megatron" / "core" / "optimizer")


def test_finder_steps_aside_when_switched_off(monkeypatch):
    """With the switch off the finder answers None, so upstream's own spec is used."""
    monkeypatch.setenv(fork.ENV_VAR, "0")
    finder = fork.ForkOverlayFinder()
    assert finder.find_spec("megatron.core.optimizer", _core_search_path()) is None


def test_finder_refuses_an_unsupported_megatron_core(monkeypatch):
    """A megatron-core release other than 0.19.2 is refused with a clear message."""
    monkeypatch.delenv(fork.ENV_VAR, raising=False)
    monkeypatch.setattr(
        fork, "imported_megatron_core_version", lambda: ("0.18.1", "/checkouts/Megatron-LM")
    )
    with pytest.raises(ImportError) as caught:
        fork.ForkOverlayFinder().find_spec("megatron.core.optimizer", _core_search_path())
    message = str(caught.value)
    assert "0.18.1" in message and "0.19.2" in message and f"{fork.ENV_VAR}=0" in message
    assert "/checkouts/Megatron-LM" in message


@pytest.mark.parametrize("version", [None, "0.19.2", "0.19.2+3f2a1bc"])
def test_finder_accepts_supported_or_unknown_versions(monkeypatch, version):
    """The supported release (a local label aside) passes, and so does no megatron-core."""
    monkeypatch.delenv(fork.ENV_VAR, raising=False)
    monkeypatch.setattr(fork, "imported_megatron_core_version", lambda: (version, None))
    spec = fork.ForkOverlayFinder().find_spec("megatron.core.optimizer", _core_search_path())
    assert spec is not None


def test_supported_version_constant():
    """The overlay is pinned to the release the fork's modules are written against."""
    assert fork.SUPPORTED_MEGATRON_CORE == "0.19.2"
    assert importlib.metadata.version("megatron-core") == fork.SUPPORTED_MEGATRON_CORE


def test_interpreter_start_installs_finder_without_heavy_imports(tmp_path):
    """The .pth hook installs the finder and imports neither torch nor megatron."""
    code = textwrap.dedent("""
        import json, sys
        finders = [getattr(f, "__name__", type(f).__name__) for f in sys.meta_path]
        print("FORK_TEST_RESULT=" + json.dumps({
            "finders": finders,
            "heavy": sorted(m for m in ("torch", "megatron", "numpy") if m in sys.modules),
        }))
        """)
    report = _run_child(code, tmp_path)
    assert report["heavy"] == []
    assert "ForkOverlayFinder" in report["finders"], "is the fork installed (pip install .)?"
    assert report["finders"].index("ForkOverlayFinder") < report["finders"].index("PathFinder")


def test_overlay_serves_the_fork_modules():
    """With the overlay on, megatron-core itself uses the fork's HybridDeviceOptimizer."""
    if not fork.is_enabled():
        pytest.skip(f"the overlay is switched off by {fork.ENV_VAR}")
    assert fork.is_active(), "the overlay finder is not installed: run scripts/run_tests.sh"

    # pylint: disable=import-outside-toplevel
    import megatron.core
    import megatron.core.optimizer
    import megatron.core.optimizer.cpu_offloading
    import megatron.core.optimizer.cpu_offloading.hybrid_optimizer
    import megatron.core.optimizer.distrib_optimizer

    # pylint: enable=import-outside-toplevel

    offloading = megatron.core.optimizer.cpu_offloading
    hdo = offloading.hybrid_optimizer.HybridDeviceOptimizer
    assert offloading.HybridDeviceOptimizer is hdo
    assert megatron.core.optimizer.HybridDeviceOptimizer is hdo
    assert megatron.core.optimizer.distrib_optimizer.HybridDeviceOptimizer is hdo
    assert getattr(offloading.hybrid_optimizer, "FORK_IMPLEMENTATION", False)

    root = fork.fork_root()
    upstream_core = Path(megatron.core.__file__).parent
    hdo_file = offloading.hybrid_optimizer.__file__
    assert _is_under(hdo_file, root), hdo_file
    assert not _is_under(hdo_file, upstream_core), hdo_file
    assert Path(hdo_file).resolve() == (Path(root) / HDO_RELATIVE).resolve()
    assert megatron.core.optimizer.__path__[0] == fork.fork_package_dir("megatron.core.optimizer")

    # Every module the fork ships is the one that is imported; the packages stay upstream's.
    for relative in _repo_fork_modules():
        name = ".".join(relative.with_suffix("").parts)
        module = importlib.import_module(name)
        assert _is_under(module.__file__, root), f"{name} came from {module.__file__}"
    assert _is_under(megatron.core.optimizer.__file__, upstream_core)
    assert _is_under(offloading.__file__, upstream_core)


def test_switch_off_serves_upstream_modules(tmp_path):
    """With MEGATRON_OPTIMIZER_FORK=0 the class comes from megatron-core's own file."""
    report = _run_child(REPORT_HDO_ORIGIN, tmp_path, **{fork.ENV_VAR: "0"})
    upstream = _upstream_megatron_dir()
    assert Path(report["core_file"]).resolve().parent.parent == upstream
    assert Path(report["hdo_file"]).resolve() == upstream / HDO_RELATIVE.relative_to("megatron")
    # megatron-core's own distribution holds that folder, wherever pip put it (site-packages,
    # or a --target folder a .pth file adds).
    installed = Path(importlib.metadata.distribution("megatron-core").locate_file("megatron"))
    assert upstream == installed.resolve(), f"{upstream} is not megatron-core's {installed}"
    assert not report["fork_marker"]
    assert report["same_class"] and report["reexport_same"]
    assert not any(_is_under(entry, fork.fork_root()) for entry in report["optimizer_path"])
    assert not any(_is_under(entry, fork.fork_root()) for entry in report["offloading_path"])


def test_unsupported_megatron_core_is_refused_at_import(tmp_path):
    """A megatron-core tree of another release first on the path (a Megatron-LM checkout
    beside the installed 0.19.2) is refused at import, naming both versions and the tree."""
    tree = tmp_path / "Megatron-LM"
    core = tree / "megatron" / "core"
    core.mkdir(parents=True)
    (tree / "megatron" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("from megatron.core import package_info\n")
    (core / "package_info.py").write_text(
        "MAJOR = 0\nMINOR = 18\nPATCH = 0\nPRE_RELEASE = ''\n__version__ = '0.18.0'\n"
    )
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(tree)!r})
        try:
            import megatron.core.optimizer
        except ImportError as error:
            outcome = {{"error": str(error)}}
        else:
            outcome = {{"error": None}}
        print("FORK_TEST_RESULT=" + json.dumps(outcome))
        """)
    report = _run_child(code, tmp_path)
    assert report["error"], "an unsupported megatron-core was accepted"
    for needle in ("0.18.0", "0.19.2", f"{fork.ENV_VAR}=0", str(core)):
        assert needle in report["error"]


def test_the_imported_tree_is_what_is_checked(monkeypatch, tmp_path):
    """The version comes from the tree ``megatron.core`` was imported from, read as text when
    its ``package_info`` is not imported."""
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("")
    (core / "package_info.py").write_text("MAJOR = 0\nMINOR = 20\nPATCH = 1\nPRE_RELEASE = 'rc2'\n")
    monkeypatch.setitem(
        sys.modules, "megatron.core", SimpleNamespace(__file__=str(core / "__init__.py"))
    )
    monkeypatch.delitem(sys.modules, "megatron.core.package_info", raising=False)
    assert fork.imported_megatron_core_version() == ("0.20.1rc2", str(core))


def test_installed_files_keep_out_of_megatron():
    """The installed distribution owns no file under a top-level ``megatron/`` folder."""
    # Ask the site folders only: build metadata left in the checkout must not answer.
    found = list(
        importlib.metadata.distributions(name=DIST_NAME, path=[str(d) for d in _site_dirs()])
    )
    if not found:
        pytest.skip(f"{DIST_NAME} is not installed in this environment")
    assert len(found) == 1, [str(dist.locate_file("")) for dist in found]
    files = found[0].files
    assert files, "the installed distribution has no RECORD"
    tops = {file.parts[0] for file in files}
    assert "megatron" not in tops, sorted(str(f) for f in files if f.parts[0] == "megatron")

    pth = [file for file in files if file.suffix == ".pth"]
    assert [str(file) for file in pth] == ["megatron_optimizer_fork.pth"]
    assert pth[0].read_text().strip() == "import megatron_optimizer_fork._pth_hook"

    overlay = Path("megatron_optimizer_fork", "_overlay")
    shipped = {
        Path(*file.parts).relative_to(overlay): file
        for file in files
        if file.suffix == ".py" and file.parts[:2] == overlay.parts
    }
    assert sorted(shipped) == _repo_fork_modules(), "the overlay does not match the checkout"
    for relative, file in shipped.items():
        assert (
            Path(file.locate()).read_bytes() == (REPO_ROOT / relative).read_bytes()
        ), f"installed {relative} is stale: reinstall with scripts/run_tests.sh"


def test_checkout_ships_no_upstream_package_files():
    """Vendoring must not clobber upstream's package ``__init__`` files."""
    present = [name for name in UPSTREAM_ONLY_INITS if (REPO_ROOT / name).exists()]
    assert not present, f"these would overwrite upstream files when vendored: {present}"


def _vendored_tree(tmp_path, *folders):
    """Upstream's installed ``megatron/`` with the checkout's ``folders`` rsynced over it, as
    the README vendors the fork into a Megatron-LM tree; skips without rsync."""
    rsync = shutil.which("rsync")
    if rsync is None:
        pytest.skip("rsync is not installed")
    vendored = tmp_path.resolve() / "vendor"
    shutil.copytree(_upstream_megatron_dir(), vendored / "megatron", symlinks=True)
    subprocess.run(
        [rsync, "-a", "--relative", *(f"{folder}/" for folder in folders), f"{vendored}/"],
        cwd=REPO_ROOT,
        check=True,
        timeout=CHILD_TIMEOUT_S,
    )
    return vendored


def test_vendored_tree_uses_the_fork(tmp_path):
    """rsync of the checkout's megatron/ over upstream's tree gives the fork's class."""
    vendored = _vendored_tree(tmp_path, "megatron")
    report = _run_child(
        REPORT_HDO_ORIGIN, tmp_path, PYTHONPATH=str(vendored), **{fork.ENV_VAR: "0"}
    )
    assert Path(report["core_file"]).resolve() == vendored / "megatron" / "core" / "__init__.py"
    assert Path(report["hdo_file"]).resolve() == vendored / HDO_RELATIVE
    assert report["fork_marker"], "the vendored module is not the fork's"
    assert report["same_class"] and report["reexport_same"]


# Child-process snippet: pytest over a vendored tree's tests, with the overlay package gone
# (a vendored Megatron-LM has no megatron_optimizer_fork), reporting what it collected.
COLLECT_VENDORED_TESTS = textwrap.dedent("""
    import json, sys
    sys.modules["megatron_optimizer_fork"] = None  # import now fails, as where it is absent
    import pytest

    class Report:
        def __init__(self):
            self.files, self.errors = {}, []

        def pytest_collection_modifyitems(self, items):
            for item in items:
                name = item.nodeid.split("::")[0]
                self.files[name] = self.files.get(name, 0) + 1

        def pytest_collectreport(self, report):
            if report.failed:
                self.errors.append(report.nodeid + ": " + str(report.longrepr)[-300:])

    report = Report()
    code = pytest.main(
        ["-q", "--collect-only", "-p", "no:cacheprovider", "tests/unit_tests"], plugins=[report]
    )
    print("FORK_TEST_RESULT=" + json.dumps(
        {"code": int(code), "files": report.files, "errors": report.errors}
    ))
    """)


def test_vendored_tests_collect_without_the_overlay_package(tmp_path):
    """Copied into a Megatron-LM tree (a ``tests`` package, no overlay package, no tools/),
    every test file imports; those that need what is missing skip rather than error."""
    vendored = _vendored_tree(tmp_path, "megatron", "tests")
    for package in ("tests", "tests/unit_tests"):  # Megatron-LM's tests/ is a package
        (vendored / package / "__init__.py").touch()
    report = _run_child(
        COLLECT_VENDORED_TESTS, vendored, PYTHONPATH=str(vendored), **{fork.ENV_VAR: "0"}
    )
    assert report["errors"] == [] and report["code"] == 0, report["errors"]
    for name in (
        "test_optimizer_cpu_offloading.py",
        "test_distrib_optimizer_core.py",
        "test_distrib_optimizer_param_state.py",
    ):
        assert report["files"].get(f"tests/unit_tests/{name}", 0) > 0, (name, report["files"])


def test_upstream_modules_with_relative_imports_load_beside_the_fork():
    """upstream's distrib_optimizer imports ``..dist_checkpointing`` relatively."""
    module = fork.load_upstream_module("megatron.core.optimizer.distrib_optimizer")
    assert module.__name__ == "megatron.core.optimizer._upstream_distrib_optimizer"
    assert os.path.realpath(module.__file__).startswith(
        os.path.realpath(os.path.dirname(importlib.import_module("megatron.core").__file__))
    )
    assert fork.load_upstream_module("optimizer.distrib_optimizer") is module


def test_a_vendored_tree_never_hands_the_fork_s_module_to_the_tests_as_upstreams(monkeypatch):
    """In a vendored Megatron-LM tree the file beside ``megatron.core`` is the fork's, so what
    ``load_upstream_module`` loads there is the fork: the tests' finder of upstream's copy then
    gives none, and the HDO comparisons skip rather than compare the fork with itself."""
    if not fork.is_active():
        pytest.skip("the overlay is off: megatron.core's modules are upstream's")
    upstream_modules = importlib.import_module("upstream_modules")  # this folder is on sys.path
    names = (upstream_modules.DISTRIB_OPTIMIZER, upstream_modules.HYBRID_OPTIMIZER)
    assert all(upstream_modules.load(name) is not None for name in names)
    monkeypatch.setattr(fork, "load_upstream_module", importlib.import_module)
    assert [upstream_modules.load(name) for name in names] == [None, None]
    with pytest.raises(pytest.skip.Exception):
        upstream_modules.hybrid_optimizer_class()


def test_a_fork_class_says_once_which_implementation_runs(monkeypatch, caplog):
    """The first HybridDeviceOptimizer of a process logs the fork, its version and its file;
    later ones stay quiet. The DistributedOptimizer module carries the fork's marker too."""
    fork_info = pytest.importorskip("megatron.core.optimizer.fork_info")
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    monkeypatch.setattr(fork_info, "_announced", set())
    params = [torch.nn.Parameter(torch.ones(4))]
    with caplog.at_level("INFO", logger=fork_info.__name__):
        HybridDeviceOptimizer(params, cpu_optimizer_cls=torch.optim.AdamW, lr=0.1)
        HybridDeviceOptimizer(params, cpu_optimizer_cls=torch.optim.AdamW, lr=0.1)
    lines = [r.getMessage() for r in caplog.records if r.name == fork_info.__name__]
    assert len(lines) == 1, lines
    assert lines[0].startswith("HybridDeviceOptimizer: megatron-core-optimizer-fork ")
    assert fork_info.fork_version() in lines[0] and "hybrid_optimizer.py" in lines[0]
    assert getattr(distrib_optimizer, "FORK_IMPLEMENTATION", False)
