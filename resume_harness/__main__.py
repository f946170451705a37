# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""``python -m resume_harness``: the DistributedOptimizer resume check (what the orchestrator
starts under torchrun; ``tools/distopt_resume.py`` is the same command)."""

from resume_harness.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
