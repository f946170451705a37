# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The in-process NCCL world of one rank that the GPU tests of DDP and the distributed
optimizer run in, as a module-scoped pytest fixture.

Imported as ``single_rank`` (pytest puts this folder on ``sys.path``) or as
``tests.unit_tests.single_rank`` from a checkout whose ``tests/`` is a package; a test module
imports :func:`fixture_parallel_state` and asks for ``parallel_state``.
"""

import os
import socket

import pytest
import torch


def _free_port():
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


@pytest.fixture(name="parallel_state", scope="module")
def fixture_parallel_state():
    """One NCCL rank with Megatron's model-parallel groups (all of size one); yields
    ``megatron.core.parallel_state``."""
    from megatron.core import parallel_state  # pylint: disable=import-outside-toplevel

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "localhost")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        torch.cuda.set_device(0)
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield parallel_state
    parallel_state.destroy_model_parallel()
