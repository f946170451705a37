# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The resume harness: checkpoint, resume and compare megatron-core's optimizers, upstream 0.19.2
beside the fork. ``tools/distopt_resume.py``, ``tools/resume_check.py`` and the benchmarks are
thin command lines over it; tests import it (it lives beside ``tools/`` and is not installed).

Modules, in the order a run meets them:

- ``table``: the one table of dtypes, offload fractions, formats and optimizer kinds with their
  ``OptimizerConfig`` options; every tool, benchmark and test picks its rows from it;
- ``cases``: :class:`Case`, the probe's :class:`Shape`, :func:`product`, TE availability;
- ``cli``: the DistributedOptimizer resume command line (``python -m resume_harness``);
- ``orchestrator``: :func:`drive`, torchrun jobs side by side, restarts, collected results;
- ``controls``: the upstream2upstream control and what it excuses;
- ``jobs``: the save and load jobs' bodies, one process per rank;
- ``worker``: inside a job: implementation, process groups, build, train, save, load;
- ``measure``: GPU peaks per load phase, optimizer state by place, the loader's log;
- ``snapshots``: snapshots of a run and their bit-exact comparison;
- ``results``: the files the jobs write, and the merge of the ranks' parts;
- ``distopt_report``: tables of DistributedOptimizer resume results, upstream beside the fork;
- ``hdo_check``, ``hdo_report``: the main job's single-process HybridDeviceOptimizer check,
  its table and plot; ``main_job``: its DistributedOptimizer part and the verdict.

The names below are what tools, benchmarks and tests use; the modules hold the rest.
"""

from .cases import (
    BUCKET_SIZE,
    BUCKETS_PER_MODEL,
    FFN,
    HIDDEN,
    Case,
    Shape,
    optimizer_options,
    product,
    selected_cases,
    te_unavailable,
)
from .cli import main, parse_args
from .controls import CONTROL_PAIR, control_failure, with_controls
from .distopt_report import report, side_by_side
from .jobs import load_one, run_load, run_save
from .measure import (
    PAGE_CACHE_ENV,
    PROFILE_ENV,
    LoadPlanLog,
    PhasePeaks,
    optimizer_state_bytes,
    warm_page_cache,
)
from .orchestrator import drive
from .results import MANIFEST, merge_case, merge_rank_files
from .snapshots import compare, snapshot
from .table import DTYPES, IMPLEMENTATIONS, MOMENT_KEYS, OFFLOAD_FRACTIONS
from .worker import (
    FOLLOW_UP_STREAM,
    FORK_TREE_ENV,
    LOAD_SEED,
    SAVE_SEED,
    TRAIN_STREAM,
    Rank,
    build,
    distributed_optimizers,
    inner_settings,
    load_checkpoint,
    prime,
    release,
    save_checkpoint,
    train,
)

# The name the GPU tests call it by.
_release = release
