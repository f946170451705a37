# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
# pylint: disable=bad-builtin
"""The main job's table and plot of the single-process HybridDeviceOptimizer check."""

import torch

from .hdo_check import GPU_OPTIMIZERS

PHASES = [
    "cold start",
    "trained",
    "saved",
    "resumed: cold start",
    "resumed: loaded",
    "resumed: stepped",
]


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
