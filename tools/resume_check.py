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
per case (tools/distopt_resume.py under torchrun; world size = visible GPUs, at most 2).
Where Transformer Engine imports it adds TE FusedAdam with fp32 moments and the
precision-aware optimizer (bf16 moments, fp32 master weights, with and without
store_param_remainders) on the dist-checkpoint format, whose load figures cover both passes
(the ``is_loading`` sharded state dict and the load); without TE it says so and measures none.

On a host without CUDA the fork runs on the CPU (its offloaded share on plain host
copies); upstream's column shows why it cannot run there.
"""

import argparse
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import torch

from megatron_optimizer_fork import load_upstream_module
from megatron_optimizer_fork.memory import pinned_bytes_held

# Megatron without TE/Apex uses torch AdamW on both halves; "adam" gives the in-place half
# another class, which upstream needs because it places loaded state by class.
GPU_OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}
# A torch.save format and a dist-checkpoint format Megatron-LM writes by default.
DISTRIBUTED_FORMATS = ["legacy", "dp_reshardable"]
# Inner-optimizer variants of tools/distopt_resume.py measured only on TE FusedAdam.
TE_VARIANTS = ["fused_adam", "precision_aware", "precision_aware_remainders"]
COLLECTIVE_TIMEOUT_S = 120
PHASES = [
    "cold start",
    "trained",
    "saved",
    "resumed: cold start",
    "resumed: loaded",
    "resumed: stepped",
]


def upstream_class():
    """megatron-core 0.19.2's HybridDeviceOptimizer, loaded from its own file."""
    module = load_upstream_module("optimizer.cpu_offloading.hybrid_optimizer")
    return module.HybridDeviceOptimizer


def fork_class():
    """The fork's HybridDeviceOptimizer, as ``megatron.core`` resolves it."""
    # pylint: disable=import-outside-toplevel
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    if not getattr(hybrid_optimizer, "FORK_IMPLEMENTATION", False):
        raise RuntimeError(
            "megatron.core resolves upstream's HybridDeviceOptimizer: install the fork "
            "(pip install .) and leave MEGATRON_OPTIMIZER_FORK unset"
        )
    return hybrid_optimizer.HybridDeviceOptimizer


class Memory:
    """Reads the memory figures the check reports."""

    def __init__(self, device):
        self.cuda = device == "cuda"

    @staticmethod
    def pinned():
        """Bytes of pinned host memory this process holds, the allocator's cache included
        (0 where there is no CUDA)."""
        return pinned_bytes_held()

    def device(self):
        """Bytes allocated on the accelerator."""
        return torch.cuda.memory_allocated() if self.cuda else 0

    @staticmethod
    def resident():
        """Resident set size of this process in bytes."""
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def sample(self):
        """All figures at once, in bytes, after dropping unreachable objects."""
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
        return {"pinned": self.pinned(), "device": self.device(), "rss": self.resident()}


def build(hdo_class, device, args, seed):
    """A bf16 MLP and an HDO over its parameters, as Megatron configures CPU offload."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).to(device=device, dtype=torch.bfloat16)
    params = list(model.parameters())
    fused = True if device == "cuda" else None
    optimizer = hdo_class(
        [{"params": params[0::2]}, {"params": params[1::2], "weight_decay": 0.0}],
        offload_fraction=args.offload_fraction,
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=GPU_OPTIMIZERS[args.gpu_optimizer],
        param_update_in_fp32=True,
        lr=1e-3,
        weight_decay=0.01,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=fused,
    )
    return model, optimizer


def train(model, optimizer, device, args, steps, seed):
    """Regress random targets for ``steps`` steps with a fixed data stream."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        inputs = torch.randn(args.batch, args.hidden, generator=generator).to(
            device, torch.bfloat16
        )
        target = torch.randn(args.batch, args.hidden, generator=generator).to(
            device, torch.bfloat16
        )
        loss = (model(inputs).float() - target.float()).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def run(hdo_class, device, args, folder):
    """Train, save, go on, resume from the checkpoint; return figures for the report."""
    memory = Memory(device)
    result = {"phases": {}}
    model, optimizer = build(hdo_class, device, args, seed=1)
    result["phases"]["cold start"] = memory.sample()
    train(model, optimizer, device, args, args.steps, seed=2)
    result["phases"]["trained"] = memory.sample()
    path = os.path.join(folder, "checkpoint.pt")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    result["phases"]["saved"] = memory.sample()
    train(model, optimizer, device, args, args.resume_steps, seed=3)
    expected = [p.detach().clone() for p in model.parameters()]
    del model, optimizer

    model, optimizer = build(hdo_class, device, args, seed=4)
    result["phases"]["resumed: cold start"] = memory.sample()
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        result["weights_only"] = True
    except Exception:  # pylint: disable=broad-except
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        result["weights_only"] = False
    model.load_state_dict(checkpoint["model"])
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = memory.device()
    start = time.perf_counter()
    optimizer.load_state_dict(checkpoint["optimizer"])
    if device == "cuda":
        torch.cuda.synchronize()
    result["load_seconds"] = time.perf_counter() - start
    result["load_peak_device_extra"] = (
        torch.cuda.max_memory_allocated() - before if device == "cuda" else 0
    )
    del checkpoint
    result["phases"]["resumed: loaded"] = memory.sample()
    train(model, optimizer, device, args, args.resume_steps, seed=3)
    result["phases"]["resumed: stepped"] = memory.sample()
    actual = [p.detach() for p in model.parameters()]
    diffs = [(a.float() - e.float()).abs().max().item() for a, e in zip(actual, expected)]
    result["exact"] = all(torch.equal(a, e) for a, e in zip(actual, expected))
    result["max_abs_diff"] = max(diffs)
    return result


def attempt(name, factory, device, args):
    """Run one implementation; an error becomes part of the report instead of a crash."""
    try:
        hdo_class = factory()
        with tempfile.TemporaryDirectory() as folder:
            return run(hdo_class, device, args, folder)
    except Exception as error:  # pylint: disable=broad-except
        last = traceback.extract_tb(error.__traceback__)[-1]
        where = f"{os.path.basename(last.filename)}:{last.lineno}"
        return {
            "error": f"{type(error).__name__}: {error} ({where})".replace("\n", " "),
            "name": name,
        }


def mib(value):
    """Bytes as MiB with one decimal."""
    return f"{value / 2**20:.1f} MiB"


def describe(result, device):
    """The rows of the side-by-side table for one implementation."""
    if "error" in result:
        reason = "cannot run on a CPU-only host" if device == "cpu" else "failed"
        return {"resumed bit-exactly": f"{reason}: {result['error'][:150]}"}
    phases = result["phases"]
    return {
        "resumed bit-exactly": (
            "yes" if result["exact"] else f"NO (max |diff| {result['max_abs_diff']:.3g})"
        ),
        "checkpoint loads with weights_only=True": "yes" if result["weights_only"] else "no",
        "pinned host memory, cold start": mib(phases["resumed: cold start"]["pinned"]),
        "pinned host memory, after the load": mib(phases["resumed: loaded"]["pinned"]),
        "pinned host memory, after resumed steps": mib(phases["resumed: stepped"]["pinned"]),
        "peak accelerator memory added by the load": mib(result["load_peak_device_extra"]),
        "load time": f"{result['load_seconds'] * 1000:.1f} ms",
        "process RSS after resumed steps": mib(phases["resumed: stepped"]["rss"]),
    }


def report(results, device, args):
    """Print the side-by-side table."""
    columns = {name: describe(result, device) for name, result in results.items()}
    rows = []
    for column in columns.values():
        rows += [row for row in column if row not in rows]
    width = max(len(row) for row in rows) + 2
    names = list(columns)
    col = 46
    print(
        f"\nResume check on {device}: bf16 MLP {args.layers}x{args.hidden}, "
        f"offload fraction {args.offload_fraction}, in-place optimizer torch "
        f"{GPU_OPTIMIZERS[args.gpu_optimizer].__name__}, {args.steps} steps, checkpoint, "
        f"{args.resume_steps} more steps; torch {torch.__version__}"
    )
    print("".ljust(width) + "".join(n.ljust(col) for n in names))
    for row in rows:
        cells = [str(columns[n].get(row, "-"))[: col - 2].ljust(col) for n in names]
        print(row.ljust(width) + "".join(cells))
    for name in names:
        if "error" in results[name]:
            print(f"\n{name}: {results[name]['error']}")


def plot(results, path, device="cuda", args=None):
    """Memory over the phases, one line per implementation and figure.

    Returns:
        str or None: None when the PNG was written, else why not (no matplotlib here).
    """
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    except ImportError as error:
        return f"no plot: matplotlib is not importable ({error})"

    figure, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    config = ""
    if args is not None:
        config = (
            f": bf16 MLP {args.layers}x{args.hidden}, offload fraction {args.offload_fraction}, "
            f"{args.steps} steps, checkpoint, {args.resume_steps} more"
        )
    absent = [name for name, result in results.items() if "error" in result]
    figure.suptitle(
        f"Resume check on {device}{config}"
        + (f" ({', '.join(absent)}: could not run, see the JSON)" if absent else "")
    )
    for axis, (key, title) in zip(
        axes,
        [
            ("pinned", "pinned host memory"),
            ("device", "accelerator memory"),
            ("rss", "process RSS"),
        ],
    ):
        measured = key == "rss" or device == "cuda"
        for name, result in results.items():
            if "error" in result or not measured:
                continue
            values = [result["phases"][phase][key] / 2**20 for phase in PHASES]
            axis.plot(range(len(PHASES)), values, marker="o", label=name)
        if not measured:
            axis.text(
                0.5,
                0.5,
                "not measured: this host has no CUDA device",
                ha="center",
                va="center",
                transform=axis.transAxes,
            )
        axis.set_title(title)
        axis.set_ylabel("MiB")
        axis.set_xticks(range(len(PHASES)))
        axis.set_xticklabels(PHASES, rotation=30, ha="right", fontsize=8)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None


IMPLEMENTATIONS = {"upstream 0.19.2": upstream_class, "fork": fork_class}


def run_in_own_process(name, device):
    """Run one implementation in a fresh interpreter, so that neither sees the other's
    allocator caches, and return its figures."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "result.json")
        command = [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
        command += ["--device", device, "--implementation", name, "--result-file", path]
        finished = subprocess.run(command, check=False)
        if finished.returncode != 0 or not os.path.exists(path):
            return {"error": f"the {name} run exited with {finished.returncode}", "name": name}
        with open(path, encoding="utf-8") as result:
            return json.load(result)


def _load_distopt_tool():
    """``tools/distopt_resume.py`` as a module (``tools/`` is no package)."""
    spec = importlib.util.spec_from_file_location(
        "distopt_resume",
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "distopt_resume.py"),
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def distributed_check(args, device, json_path=None, tool=None):
    """DDP + DistributedOptimizer resume, upstream 0.19.2 beside the fork, each resuming its own
    checkpoint (``tools/distopt_resume.py`` under torchrun, one job per side).

    The fork's side runs first and is printed, and written to ``json_path``, as soon as it is
    done, so a run cut short (a time limit, upstream's load job dying again and again) still
    shows the fork's figures; the table of both sides follows at the end.

    Args:
        args: the parsed command line.
        device: ``"cuda"`` or ``"cpu"``.
        json_path: where the results so far are written after each side, if given.
        tool: the ``distopt_resume`` module (loaded from ``tools/`` when not given).

    Returns:
        dict or None: the results by case id, or None where it cannot run here.
    """
    if args.distributed == "off":
        return None
    tool = tool or _load_distopt_tool()
    te_cases = tool.product(["bf16"], [0.0], ["dp_reshardable"], TE_VARIANTS)
    missing = tool.te_unavailable(te_cases[0])
    if missing:
        print(f"\n{missing}; no TE FusedAdam or precision-aware figures are measured")
    if device != "cuda":
        print(
            "\ndistributed optimizer: skipped, megatron-core's DDP buffers need a CUDA device "
            "(this host has none); no figures are invented for it"
        )
        return None
    cases = tool.product(["bf16"], sorted({0.0, args.offload_fraction}), DISTRIBUTED_FORMATS)
    if not missing:
        # A variant this TE cannot give (e.g. remainders on TE < 2.1) is listed as skipped.
        cases += te_cases
    nproc = min(torch.cuda.device_count(), 2)
    shape = tool.Shape(args.dist_hidden, args.dist_ffn)
    print(
        f"\ndistributed optimizer: DDP world size {nproc}, bf16, {shape.numel / 1e6:.1f}M "
        "parameters, offload on and off"
        + ("" if missing else f"; TE FusedAdam variants {', '.join(TE_VARIANTS)}")
    )
    results = {}
    for side in ("fork", "upstream"):
        # One job at a time: the load times of the two implementations are compared.
        done = tool.drive(
            cases,
            [(side, side)],
            nproc,
            side_by_side=False,
            shape=shape,
            # A rank left waiting by another rank's error gives up after this long.
            collective_timeout=COLLECTIVE_TIMEOUT_S,
            log_dir=json_path and os.path.join(os.path.dirname(json_path), f"logs_{side}"),
        )
        results.update(done)
        if json_path:
            with open(json_path, "w", encoding="utf-8") as out:
                json.dump(results, out, indent=1, default=str)
        if side == "fork":
            print("\nfork, resuming its own checkpoints:")
            tool.report(done)
    print("\nupstream 0.19.2 beside the fork, each resuming its own checkpoints:")
    tool.report(results)
    side_by_side(results)
    return results


def _phase_peak(*names):
    """The figure of the first of ``names`` (phases of one format or another) a result has."""

    def show(result):
        phases = result.get("load_phase_peak_gpu_extra_bytes") or {}
        return _mib_or_dash(next((phases[n] for n in names if n in phases), None))

    return show


# Host side of the resume, then the GPU peak of each load phase above the start of the load:
# dist-checkpoint formats describe the optimizer for the load (is_loading: the scaffold, the
# first pass), read, then load (the second pass); legacy loads the common state dict, then
# the parameter state.
SIDE_BY_SIDE_TABLES = [
    (
        "exactness, pinned host memory (MiB, largest rank)",
        [
            ("exact", lambda r: "yes" if r.get("exact") else "NO"),
            ("pin cold", lambda r: _mib_or_dash(r.get("pinned_cold_bytes"))),
            ("pin load", lambda r: _mib_or_dash(r.get("pinned_after_load_bytes"))),
            ("pin step", lambda r: _mib_or_dash(r.get("pinned_after_steps_bytes"))),
            ("load ms", lambda r: _ms_or_dash(r.get("load_seconds"))),
        ],
    ),
    (
        "GPU memory the load adds, peak per phase (MiB, largest rank)",
        [
            ("pass 1", _phase_peak("is_loading", "state_dict")),
            ("read", _phase_peak("read")),
            ("pass 2", _phase_peak("load_state_dict", "param_state")),
            ("peak", lambda r: _mib_or_dash(r.get("load_peak_gpu_extra_bytes"))),
        ],
    ),
]


def side_by_side(results):
    """One row per case: upstream's figures beside the fork's (both resuming their own)."""
    names = sorted({key.rsplit("-", 1)[0] for key in results})
    width = max([30, *map(len, names)])
    for title, figures in SIDE_BY_SIDE_TABLES:
        heads = "".join(f"{head:>11}" for head, _ in figures)
        print(f"\n{title}")
        print(f"{'':{width}} | {'upstream 0.19.2':{len(heads)}} | fork")
        print(f"{'case':{width}} | {heads} | {heads}")
        for name in names:
            row = []
            for side in ("upstream", "fork"):
                result = results.get(f"{name}-{side}2{side}", {})
                if result.get("skipped"):
                    row.append(f"{'skipped':>11}" + " " * (len(heads) - 11))
                else:
                    row.append("".join(f"{show(result):>11}" for _, show in figures))
            print(f"{name:{width}} | {row[0]} | {row[1]}")


def _mib_or_dash(value):
    return "-" if value is None else f"{value / 2**20:.1f}"


def _ms_or_dash(value):
    return "-" if value is None else f"{value * 1000:.0f}"


EPILOG = """\
outputs (in --out):
  resume_check_<device>_<optimizer>_<fraction>.json   both implementations' figures, written
                                                      before the plot
  resume_check_<device>_<optimizer>_<fraction>.png    memory over the phases (needs matplotlib)
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
    option("--implementation", choices=sorted(IMPLEMENTATIONS), help=argparse.SUPPRESS)
    option("--result-file", help=argparse.SUPPRESS)
    return parser


def verdict(results, distributed):
    """``(passed, why)``: the fork resumed exactly in the single-process check and in every
    distributed case it ran."""
    fork = results.get("fork", {})
    if "error" in fork:
        return False, f"the fork's resume check failed: {fork['error'][:200]}"
    if not fork.get("exact"):
        return (
            False,
            f"the fork's resumed parameters differ (max |diff| {fork.get('max_abs_diff')})",
        )
    ran = {
        k: r for k, r in (distributed or {}).items() if "fork2fork" in k and not r.get("skipped")
    }
    inexact = sorted(k for k, r in ran.items() if not r.get("exact"))
    if inexact:
        return (
            False,
            f"the fork did not resume exactly in {len(inexact)} distributed cases: {inexact}",
        )
    upstream = results.get("upstream 0.19.2", {})
    beside = (
        "upstream could not run"
        if "error" in upstream
        else (
            "upstream "
            + ("resumed exactly too" if upstream.get("exact") else "did not resume exactly")
        )
    )
    scope = f" and in {len(ran)} distributed cases" if ran else ""
    return True, f"the fork resumed bit-exactly in the single-process check{scope}; {beside}"


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
        result = attempt(args.implementation, IMPLEMENTATIONS[args.implementation], device, args)
        with open(args.result_file, "w", encoding="utf-8") as out:
            json.dump(result, out)
        return 0
    results = {}
    for index, name in enumerate(IMPLEMENTATIONS, 1):
        progress(f"{index}/{len(IMPLEMENTATIONS)}: {name}: train, checkpoint, resume on {device}")
        results[name] = run_in_own_process(name, device)
    report(results, device, args)
    os.makedirs(args.out, exist_ok=True)
    tag = f"{device}_{args.gpu_optimizer}_{args.offload_fraction}"
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
