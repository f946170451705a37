# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
# pylint: disable=bad-builtin
"""docs/benchmarks.md's step table from ``hdo_step.py``'s JSON files, upstream beside the fork.

One markdown row per case, fraction and overlap setting in each file (a row without overlap
says so in its run cell): upstream's step with its min-max and pinned MiB, the floor and the
limit measured in that run, then the fork's step and its ratios (``/floor``, ``/limit``,
``/paired`` and ``/fp32`` where the run measured them). A fork step within both of the issue's
bounds (1.3x of the floor, 1.15x of the limit) is bold.
Rows of other implementations (``fork@PATH``, variants) are listed with ``--implementation``.

    python benchmarks/hdo_step_table.py results/hdo_step_cuda.json --run "H100 23"
"""

import argparse
import json
import sys
from typing import Dict, Iterable, List, Optional

FLOOR_BOUND = 1.3
LIMIT_BOUND = 1.15
UPSTREAM = "upstream 0.19.2"
HEADER = (
    "| case | fr. | run | upstream: step, pinned MiB | floor / limit | fork: step, pinned MiB "
    "| /floor | /limit | /paired | /fp32 |\n|---|---|---|---|---|---|---|---|---|---|"
)


def _ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _step(row: Dict, bold: bool = False) -> str:
    """``step (min-max), pinned``, the step in bold where asked."""
    step = f"{row['step_s']:.3f}"
    if bold:
        step = f"**{step}**"
    return f"{step} ({row['step_min_s']:.3f}-{row['step_max_s']:.3f}), {row['pinned_held_mib']:.1f}"


def within_bounds(row: Dict) -> bool:
    """Whether a row's step is within both bounds: the serial floor's and the overlap limit's."""
    return row["ratio"] <= FLOOR_BOUND and row["ratio_limit"] <= LIMIT_BOUND


def table_rows(rows: Iterable[Dict], run: str, implementation: str = "fork") -> List[str]:
    """The markdown rows for ``implementation`` against upstream's row of the same case,
    fraction and overlap setting (``-`` where the run has none, as with ``--skip-upstream``)."""
    rows = list(rows)
    upstream = {
        (r["case"], r["fraction"], r["overlap"]): r for r in rows if r["implementation"] == UPSTREAM
    }
    lines = []
    for row in rows:
        if row["implementation"] != implementation:
            continue
        key = (row["case"], row["fraction"], row["overlap"])
        theirs = upstream.get(key)
        cells = [
            row["case"],
            f"{row['fraction']:.1f}",
            run if row["overlap"] else f"{run}, overlap off".lstrip(", "),
            "-" if theirs is None else _step(theirs),
            f"{row['floor_s']:.3f} / {row['limit_s']:.3f}",
            _step(row, bold=within_bounds(row)),
            _ratio(row["ratio"]),
            _ratio(row["ratio_limit"]),
            _ratio(row.get("ratio_paired")),
            _ratio(row.get("ratio_fp32_contended")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", maxsplit=1)[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("files", nargs="+", help="hdo_step_<device>.json files, rows in order")
    parser.add_argument("--run", default="", help="the run's label in the table's run column")
    parser.add_argument(
        "--implementation",
        default="fork",
        help="the rows to set beside upstream's: fork, fork@PATH, or a variant's name",
    )
    parser.add_argument("--no-header", action="store_true", help="print the rows alone")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Print the table; exit code 0, or 1 where no row matched."""
    args = parse_args(argv)
    lines = []
    for path in args.files:
        with open(path, encoding="utf-8") as handle:
            lines += table_rows(json.load(handle)["rows"], args.run, args.implementation)
    if not args.no_header:
        print(HEADER)
    print("\n".join(lines))
    return 0 if lines else 1


if __name__ == "__main__":
    sys.exit(main())
