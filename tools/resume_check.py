# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
# pylint: disable=bad-builtin
"""Resume check: train, checkpoint, resume, and compare upstream's HDO with the fork's.

For each implementation (megatron-core 0.19.2's HybridDeviceOptimizer and the fork's) the
check trains a small bf16 MLP with CPU offload, saves model and optimizer state, goes on
for a few steps, then builds a fresh model and optimizer, loads the checkpoint and takes
the same steps. It prints, side by side: whether the resumed parameters are bit-exact,
pinned host memory at cold start and after the load, peak accelerator memory during the
load, and the load time; and it plots memory over the phases to a PNG.

Where CUDA exists it then resumes a DDP + DistributedOptimizer run (offload off and on, a
torch.save and a dist-checkpoint format), upstream beside the fork, with the same figures
per case (torchrun jobs of the resume harness; world size = visible GPUs, at most 2).
Where Transformer Engine imports it adds TE FusedAdam with fp32 moments and the
precision-aware optimizer (bf16 moments, fp32 master weights, with and without
store_param_remainders) on the dist-checkpoint format, whose load figures cover both passes
(the ``is_loading`` sharded state dict and the load); without TE it says so and measures none.

On a host without CUDA the fork runs on the CPU (its offloaded share on plain host
copies); upstream's column shows why it cannot run there.

The check itself is the ``resume_harness`` package beside ``tools/`` (``hdo_check``,
``hdo_report``, ``main_job``); this file is its command line.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

# Started as a script, this folder is on sys.path, not the repository root that holds the
# harness package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=wrong-import-position
import torch  # noqa: E402

from resume_harness.hdo_check import CLASSES, GPU_OPTIMIZERS, attempt  # noqa: E402
from resume_harness.hdo_report import plot, report  # noqa: E402
from resume_harness.main_job import distributed_check, verdict  # noqa: E402


def run_in_own_process(name, device, log_path):
    """Run one implementation in a fresh interpreter, so that neither sees the other's
    allocator caches, and return its figures. What the interpreter writes to stderr (among it
    megatron-core's warnings about missing Transformer Engine and Apex) goes to ``log_path``
    rather than between the progress lines."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "result.json")
        command = [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
        command += ["--device", device, "--implementation", name, "--result-file", path]
        with open(log_path, "w", encoding="utf-8") as log:
            finished = subprocess.run(command, stderr=log, check=False)
        if finished.returncode != 0 or not os.path.exists(path):
            error = f"the {name} run exited with {finished.returncode} (log: {log_path})"
            return {"error": error, "name": name}
        with open(path, encoding="utf-8") as result:
            return json.load(result)


EPILOG = """\
outputs (in --out):
  resume_check_<device>_<optimizer>_<fraction>.json   both implementations' figures, written
                                                      before the plot
  resume_check_<device>_<optimizer>_<fraction>.png    memory over the phases (needs matplotlib)
  resume_check_<device>_<optimizer>_<fraction>_<implementation>.log
                                                      each implementation's stderr (warnings)
  resume_check_distributed_<...>.json, logs_fork/, logs_upstream/
                                                      the DDP + DistributedOptimizer part (CUDA)

exit codes:
  0  PASS: the fork resumed bit-exactly in every case it ran
  1  FAIL: the fork did not resume exactly, or could not run (the last line says which)
  2  bad command line
"""


def build_parser():
    """The command line: every option with its help and default."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    option = parser.add_argument

    def default(text):
        return text + " (default: %(default)s)"

    option(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help=default("where the model and the in-place optimizer live; auto picks CUDA if any"),
    )
    option("--hidden", type=int, default=512, help=default("width of the MLP's layers"))
    option("--layers", type=int, default=4, help=default("number of linear layers"))
    option("--batch", type=int, default=32, help=default("batch size of each step"))
    option("--steps", type=int, default=5, help=default("steps before the checkpoint"))
    option("--resume-steps", type=int, default=3, help=default("steps after it, on both runs"))
    option(
        "--offload-fraction",
        type=float,
        default=0.5,
        help=default("share of the parameters the HDO steps on the host"),
    )
    option(
        "--gpu-optimizer",
        choices=sorted(GPU_OPTIMIZERS),
        default="adamw",
        help=default("torch optimizer of the in-place half"),
    )
    option("--out", default="results", help=default("folder for the JSON, PNG and logs"))
    option(
        "--dist-hidden",
        type=int,
        default=1024,
        help=default("width of the distributed run's model"),
    )
    option(
        "--dist-ffn",
        type=int,
        default=4096,
        help=default("inner width of the distributed run's model"),
    )
    option(
        "--distributed",
        choices=["auto", "off"],
        default="auto",
        help=default("also resume a DDP + DistributedOptimizer run (needs CUDA)"),
    )
    option("--implementation", choices=sorted(CLASSES), help=argparse.SUPPRESS)
    option("--result-file", help=argparse.SUPPRESS)
    return parser


def progress(message):
    """A line saying which phase starts, shown at once."""
    print(f"[resume check] {message}", flush=True)


def main(argv=None):
    """Parse arguments, run both implementations, report, write the results, plot."""
    args = build_parser().parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"

    if args.implementation:  # one side of the comparison, in a process of its own
        result = attempt(args.implementation, CLASSES[args.implementation], device, args)
        with open(args.result_file, "w", encoding="utf-8") as out:
            json.dump(result, out)
        return 0
    os.makedirs(args.out, exist_ok=True)
    tag = f"{device}_{args.gpu_optimizer}_{args.offload_fraction}"
    results = {}
    for index, name in enumerate(CLASSES, 1):
        progress(f"{index}/{len(CLASSES)}: {name}: train, checkpoint, resume on {device}")
        log_path = os.path.join(args.out, f"resume_check_{tag}_{name.split()[0]}.log")
        results[name] = run_in_own_process(name, device, log_path)
    report(results, device, args)
    json_path = os.path.join(args.out, f"resume_check_{tag}.json")
    with open(json_path, "w", encoding="utf-8") as out:
        json.dump({"device": device, "args": vars(args), "results": results}, out, indent=1)
    print(f"\nresults: {json_path}")
    png = os.path.join(args.out, f"resume_check_{tag}.png")
    skipped = plot(results, png, device, args)
    print(f"plot: {png}" if skipped is None else skipped)
    if args.distributed != "off":
        progress("distributed optimizer: DDP + DistributedOptimizer resume, fork then upstream")
    distributed = distributed_check(
        args, device, os.path.join(args.out, f"resume_check_distributed_{tag}.json")
    )
    passed, why = verdict(results, distributed)
    print(f"\n{'PASS' if passed else 'FAIL'}: {why}")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
