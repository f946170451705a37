# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Resume check for the DistributedOptimizer: save with one implementation, load with another.

The command line of :mod:`resume_harness.cli` (``--help`` lists the options, the outputs and the
exit codes); the harness itself is the ``resume_harness`` package beside ``tools/``. Run it
under torchrun for one side, or without torchrun naming both sides::

    torchrun --nproc-per-node 2 tools/distopt_resume.py --save-with fork --ckpt-dir D
    python tools/distopt_resume.py --save-with upstream --load-with fork --out result.json
"""

import sys
from pathlib import Path

# Started as a script, this folder is on sys.path, not the repository root that holds the
# harness package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# pylint: disable=wrong-import-position,unused-import
from resume_harness import (  # noqa: E402
    Case,
    Shape,
    control_failure,
    drive,
    product,
    report,
    te_unavailable,
    with_controls,
)
from resume_harness.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
