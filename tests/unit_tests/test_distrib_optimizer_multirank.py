# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""megatron-core's DDP and DistributedOptimizer (torch AdamW, the HybridDeviceOptimizer at 0.5
and 1.0) trained, saved and resumed across real processes, in every checkpoint format.

Spawned worlds of ranks (``resume_harness.multirank``; CPU and gloo, with the stand-ins of
``resume_harness.cpu_world``) train on the same data on every rank without clipping, so the run
is independent of the data-parallel size: a resume, at the same or another size, must equal the
uninterrupted run bit for bit on every rank, and a resharded load must give the saved state in
model space element for element. Faults on one rank (another model's checkpoint, a truncated
file, a NaN, a failure while writing) must be refused by every rank.

One test per verdict; a world runs many cells, so the worlds are spawned once per session.
Upstream 0.19.2's cells (``upstream-...``) that fail are strict xfails carrying its error.

Commands (CPU):

    scripts/run_tests.sh -m multirank                                # the CI slice: DP 2 and 4
    MULTIRANK_FULL=1 scripts/run_tests.sh -m multirank               # the whole matrix, DP 8 too
    MULTIRANK_DEVICE=cuda MULTIRANK_FULL=1 scripts/run_tests.sh -m multirank   # NCCL, 8 GPUs
    MULTIRANK_FORK_TREE=.ab/<commit> scripts/run_tests.sh -m multirank    # two fork versions

``MULTIRANK_FORK_TREE`` (a checkout, or the folder ``scripts/fork_tree.sh <commit>`` writes)
replaces the matrix by the worlds in which this checkout's fork and that one's load each other's
checkpoints at the same and another data-parallel size (``multirank_plan.across_versions``):
what a user who updates the fork between a save and a resume meets.

``MULTIRANK_MAX_WORLD=4`` leaves out the worlds of more ranks (scripts/run_gpu_checks.sh
resume-w4 and resume-w8 run the matrix on 4 and 8 GPUs).
"""

import os
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.multirank

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core.optimizer.distrib_optimizer_formats")
# The harness lives beside tests/ in this repository; a vendored tree has none.
pytest.importorskip("resume_harness.multirank", reason="needs the repository's resume_harness")

import megatron_optimizer_fork  # noqa: E402  pylint: disable=wrong-import-position
import resume_harness  # noqa: E402  pylint: disable=wrong-import-position
from resume_harness.cpu_world import cpu_world_problem  # noqa: E402  pylint: disable=C0413
from resume_harness.multirank import run_world  # noqa: E402  pylint: disable=wrong-import-position
from resume_harness.multirank_plan import (  # noqa: E402  pylint: disable=C0413
    FULL_FAMILIES,
    SLICE_FAMILIES,
    across_versions,
    worlds,
)

FULL = os.environ.get("MULTIRANK_FULL") == "1"
DEVICE = os.environ.get("MULTIRANK_DEVICE", "cpu")
MAX_WORLD = int(os.environ.get("MULTIRANK_MAX_WORLD", "0")) or None
FORK_TREE = os.environ.get("MULTIRANK_FORK_TREE", "")

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("MULTIRANK_DEVICE=cuda without CUDA", allow_module_level=True)
if DEVICE == "cpu" and cpu_world_problem():
    pytest.skip(cpu_world_problem(), allow_module_level=True)

if FORK_TREE:
    try:
        megatron_optimizer_fork.fork_checkout(FORK_TREE)
    except ValueError as error:
        raise ValueError(
            f"MULTIRANK_FORK_TREE={error} (scripts/fork_tree.sh <commit> writes one)"
        ) from None
    PLAN = across_versions(FORK_TREE, FULL_FAMILIES if FULL else SLICE_FAMILIES, DEVICE)
else:
    PLAN = worlds(FULL, DEVICE, MAX_WORLD)

# Known failures, each a strict xfail so that a fix shows: (implementation, key fragments,
# reason). Upstream's are what megatron-core 0.19.2 raises on these hosts.
KNOWN_FAILURES = (
    (
        "upstream",
        ("-off0.5-", "-off1-", "-fault-"),
        "its HybridDeviceOptimizer cannot step on a CPU-only host (KeyError in "
        "_set_sub_optimizer_grads, or 'can't optimize a non-leaf Tensor')",
    ),
    (
        "upstream",
        ("-resume", "-from-dp"),
        "its loaders cannot fill torch AdamW's state (KeyError: 'step', or an in-place write "
        "into a leaf's view), and dp_reshardable loses the step",
    ),
)


def _known_failure(implementation, key):
    for owner, fragments, reason in KNOWN_FAILURES:
        if owner == implementation and any(fragment in key for fragment in fragments):
            return reason
    return None


@pytest.fixture(scope="session")
def verdicts(tmp_path_factory):
    """Every world of the plan, spawned in order; their verdicts merged."""
    root = tmp_path_factory.mktemp("multirank")
    merged = {}
    for spec, _ in PLAN:
        merged.update({f"{spec.tag}:{key}": value for key, value in run_world(spec, root).items()})
    return merged


def _param(spec, key):
    reason = _known_failure(spec.implementation, key)
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(spec.tag, key, id=key, marks=marks)


CELLS = [_param(spec, key) for spec, keys in PLAN for key in keys]


@pytest.mark.parametrize("tag,key", CELLS)
def test_cell(verdicts, tag, key):
    """The cell passed on every rank; a failure shows the first failing rank's error."""
    world_error = verdicts.get(f"{tag}:world")
    verdict = verdicts.get(f"{tag}:{key}", f"no verdict ({world_error or 'the world ended'})")
    assert verdict is None, verdict


def _copy_of_this_fork(folder):
    """A checkout holding this repository's ``megatron/`` folder, as scripts/fork_tree.sh
    writes one."""
    source = Path(resume_harness.__file__).resolve().parents[1] / "megatron"
    shutil.copytree(source, folder / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def test_a_world_given_a_fork_tree_imports_that_tree_s_modules(tmp_path):
    """The ranks of a world with ``fork_tree`` import the tree's modules, not the installed
    ones: a tree whose distrib_optimizer cannot be imported ends the world with its error."""
    tree = _copy_of_this_fork(tmp_path / "tree")
    module = tree / "megatron" / "core" / "optimizer" / "distrib_optimizer.py"
    module.write_text('raise ImportError("the fork tree\'s own distrib_optimizer")\n')
    (spec, _), *_ = across_versions(str(tree), SLICE_FAMILIES[:1], DEVICE)
    assert spec.fork_tree == str(tree) and spec.tag == "fork@tree-dp2"
    found = run_world(spec, tmp_path / "worlds")
    assert "the fork tree's own distrib_optimizer" in found["world"], found


def test_checkpoints_cross_between_two_fork_trees_both_ways(tmp_path):
    """across_versions: each side resumes the other's checkpoints at the same size and
    reshards them to another, here between this fork and a copy of it (one family; the whole
    slice against another commit: MULTIRANK_FORK_TREE)."""
    tree = _copy_of_this_fork(tmp_path / "copy")
    plan = across_versions(str(tree), SLICE_FAMILIES[1:2], DEVICE)
    found = {}
    for spec, keys in plan:
        verdicts = run_world(spec, tmp_path / "worlds")
        found.update({key: verdicts.get(key, verdicts.get("world", "no verdict")) for key in keys})
    loads = [key for key in found if "-from-" in key]
    assert {key.split("-loads-")[0] for key in loads} == {
        "fork-dp2",
        "fork-dp4",
        "fork@copy-dp2",
        "fork@copy-dp4",
    }
    assert all(key.endswith("-from-fork@copy-dp2") == key.startswith("fork-") for key in loads)
    assert not {key: error for key, error in found.items() if error is not None}
