# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Resume check for the DistributedOptimizer: save with one implementation, load with another.

A small Megatron model is wrapped in megatron-core's DistributedDataParallel (distributed
optimizer, several buckets) and given the optimizer ``get_megatron_optimizer`` builds for it:
without offload whatever Adam megatron-core picks (TE FusedAdam where Transformer Engine
imports, else Apex's, else torch AdamW), or the HybridDeviceOptimizer with precision-aware
state when a share of the state is offloaded. A case's ``optimizer`` can instead insist on one
of the TE kinds of :mod:`resume_harness.table` (TE FusedAdam with fp32 moments, Megatron-LM's
``--use-precision-aware-optimizer`` with bf16 or fp16 moments and fp32 master weights, with or
without ``store_param_remainders``); where TE cannot provide that the case is skipped with the
reason, never measured on another optimizer.

Each case trains ``--steps-before`` steps on fixed per-rank data, saves a checkpoint, and goes
on for ``--steps-after`` steps; the resulting parameters and optimizer state are the reference.
The load side builds a fresh model and optimizer (other initial weights), loads the
checkpoint, takes the same steps and compares everything with ``torch.equal``. It also records
pinned host memory the process holds at cold start, after the load and after the resumed
steps, the peak GPU memory each load phase added, the load time, and the path the fork's
FusedAdam loader logged.

Save and load are separate ``torchrun`` invocations sharing a checkpoint folder, so that each
can run either implementation (``upstream`` runs with ``MEGATRON_OPTIMIZER_FORK=0``)::

    torchrun --nproc-per-node 2 tools/distopt_resume.py --save-with fork --ckpt-dir D \\
        --dtype bf16 --offload-fraction 0.5 --format dp_reshardable fully_reshardable
    MEGATRON_OPTIMIZER_FORK=0 torchrun --nproc-per-node 2 tools/distopt_resume.py \\
        --load-with upstream --ckpt-dir D --out result.json

(``python -m resume_harness`` is the same command.) Without torchrun, naming both sides runs
the two invocations itself::

    python tools/distopt_resume.py --save-with upstream --load-with fork --nproc-per-node 1 \\
        --dtype fp32 bf16 --out result.json

Case names are ``<dtype>-off<fraction>-<format>[-<optimizer>]``, e.g.
``bf16-off0-dp_reshardable-precision_aware`` (``--cases``), or ``--optimizer`` beside
``--dtype``/``--offload-fraction``/``--format``.

Loading a fork checkpoint with upstream also runs the ``upstream2upstream`` control: a case
upstream fails with its own checkpoint too is reported, not counted against the fork.
"""

import argparse
import os

from . import table
from .cases import FFN, HIDDEN, Shape, selected_cases
from .controls import control_failure, with_controls
from .distopt_report import report
from .jobs import run_load, run_save
from .orchestrator import drive
from .results import write_json
from .worker import Rank, select_implementation

EPILOG = """\
formats: legacy (save_parameter_state/load_parameter_state plus the optimizer's state_dict) and
the distrib_optim_sharding_type values of megatron-core 0.19.2's sharded_state_dict;
fully_sharded_model_space is accepted, but 0.19.2's dist_checkpointing refuses its flattened
ShardedTensors, so it fails with either implementation.

outputs:
  both sides (no torchrun): a table on stdout; --out: the results by case id (JSON)
  --save-with under torchrun: --ckpt-dir/manifest.json and one folder per case
  --load-with under torchrun: --out.rank<r> per rank while it runs, then --out (merged)

exit codes (both sides): 0 every judged case resumed bit-exactly, 1 otherwise or nothing judged
(the upstream2upstream control, and a case that upstream fails too, are not judged);
2 bad command line. Under torchrun: 0 when the job ran to its end.
"""


def _help(text):
    return text + " (default: %(default)s)"


def build_parser():
    """The command line: every option with its help and default."""
    parser = argparse.ArgumentParser(
        prog="distopt_resume.py",
        description=__doc__.splitlines()[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    option = parser.add_argument
    sides = table.IMPLEMENTATIONS
    option("--save-with", choices=sides, help="implementation that trains and saves")
    option("--load-with", choices=sides, help="implementation that loads and resumes")
    option("--ckpt-dir", nargs="+", help="checkpoint folder(s); one to save into")
    option(
        "--dtype",
        nargs="+",
        choices=table.DTYPES,
        default=["bf16"],
        help=_help("parameter dtype(s)"),
    )
    option(
        "--offload-fraction",
        nargs="+",
        type=float,
        default=[0.5],
        help=_help(
            f"share(s) of the state the HDO keeps on the host, of {table.OFFLOAD_FRACTIONS}"
        ),
    )
    option(
        "--format",
        nargs="+",
        choices=table.format_names(),
        default=["dp_reshardable"],
        help=_help("checkpoint format(s)"),
    )
    option(
        "--optimizer",
        nargs="+",
        choices=table.kind_names(),
        default=["default"],
        help=_help("inner-optimizer kind(s); all but default need Transformer Engine, no offload"),
    )
    option("--cases", nargs="+", help="explicit case names (e.g. bf16-off0.5-legacy) instead")
    option("--hidden", type=int, default=HIDDEN, help=_help("probe width (save side)"))
    option("--ffn", type=int, default=FFN, help=_help("probe inner width (save side)"))
    option("--steps-before", type=int, default=3, help=_help("steps before the checkpoint"))
    option("--steps-after", type=int, default=2, help=_help("steps after it, on both sides"))
    option("--out", help="result JSON (load side, or both sides)")
    option(
        "--continue-load",
        action="store_true",
        help="restart of a load job that died: keep the cases already in its rank parts",
    )
    option("--nproc-per-node", type=int, default=1, help=_help("ranks when this starts torchrun"))
    option(
        "--prime",
        choices=("auto", "never", "always"),
        default="auto",
        help=_help("materialise optimizer state before a dist-checkpoint load (auto: upstream)"),
    )
    option(
        "--collective-timeout",
        type=int,
        default=300,
        help=_help("seconds a rank waits in a collective before it gives up"),
    )
    return parser


def parse_args(argv=None):
    """The parsed command line, checked against the table (see :func:`build_parser`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for fraction in args.offload_fraction:
        if fraction not in table.OFFLOAD_FRACTIONS:
            parser.error(f"--offload-fraction {fraction}: choose from {table.OFFLOAD_FRACTIONS}")
    if not (args.save_with or args.load_with):
        parser.error("name --save-with, --load-with, or both")
    try:
        selected_cases(args)
    except ValueError as error:
        parser.error(str(error))
    return args


def _both_sides(args):
    """Save and load jobs started from here; 0 only when every judged case was exact."""
    pair = (args.save_with, args.load_with)
    results = drive(
        selected_cases(args),
        with_controls([pair]),
        args.nproc_per_node,
        args.steps_before,
        args.steps_after,
        args.ckpt_dir[0] if args.ckpt_dir else None,
        shape=Shape(args.hidden, args.ffn),
        collective_timeout=args.collective_timeout,
    )
    for key, result in results.items():
        result["upstream_fails_too"] = control_failure(results, key)
    report(results)
    if args.out:
        write_json(args.out, results)
    # The control only excuses its fork2upstream counterpart; it is not judged itself.
    # A skipped case is not judged either; with nothing judged the run is not a pass.
    judged = [
        result
        for key, result in results.items()
        if key.endswith(f"-{pair[0]}2{pair[1]}")
        and not result["upstream_fails_too"]
        and not result.get("skipped")
    ]
    return 0 if judged and all(r.get("exact") for r in judged) else 1


def main(argv=None):
    """Entry point for both the torchrun workers and the two-sided driver."""
    args = parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        if not (args.save_with and args.load_with):
            raise SystemExit("outside torchrun, name both --save-with and --load-with")
        return _both_sides(args)
    if bool(args.save_with) == bool(args.load_with) or not args.ckpt_dir:
        raise SystemExit(
            "under torchrun, name exactly one of --save-with/--load-with and --ckpt-dir"
        )
    if args.load_with and not args.out:
        raise SystemExit("--load-with needs --out")
    module_file = select_implementation(args.save_with or args.load_with)
    rank = Rank(args.collective_timeout)
    try:
        if args.save_with:
            run_save(args, rank, module_file)
        else:
            run_load(args, rank, module_file)
    finally:
        Rank.close()
    return 0
