# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""A few spawned gloo ranks on the CPU that each run a test's body and hand back what it found.

The ranks are the resume harness's CPU world (``resume_harness.cpu_world``: gloo, and
stand-ins for the CUDA-only calls megatron-core makes), so a test that uses this is skipped
where the harness is absent (a vendored Megatron-LM tree) or cannot run (Transformer Engine
installed). Imported as ``cpu_ranks`` or ``tests.unit_tests.cpu_ranks`` (see
``optimizer_table.sibling``).
"""

import json

import pytest
import torch


def _rank_main(rank, port, folder, size, body):
    # pylint: disable=import-outside-toplevel
    from resume_harness.cpu_world import World, quiet

    quiet()
    world = World(rank, size, port)
    found = body(rank, world, folder)
    world.close()
    with open(f"{folder}/rank{rank}.json", "w", encoding="utf-8") as out:
        json.dump(found, out)


def results_on_cpu_ranks(body, folder, size=2):
    """Run ``body(rank, world, folder)`` on ``size`` spawned gloo ranks; returns each rank's
    result (a JSON value), in rank order.

    Args:
        body: a module-level function (it is pickled into the ranks).
        folder: where the ranks write their results (and ``body`` may write files).
        size: number of ranks.
    """
    # The harness lives beside tests/ in this repository; a vendored tree has none.
    pytest.importorskip("resume_harness.cpu_world", reason="needs the repository's resume_harness")
    # pylint: disable=import-outside-toplevel
    from resume_harness.cpu_world import cpu_world_problem
    from resume_harness.multirank import free_port

    if cpu_world_problem():
        pytest.skip(cpu_world_problem())
    torch.multiprocessing.start_processes(
        _rank_main, args=(free_port(), str(folder), size, body), nprocs=size, start_method="spawn"
    )
    results = []
    for rank in range(size):
        with open(f"{folder}/rank{rank}.json", encoding="utf-8") as found:
            results.append(json.load(found))
    return results
