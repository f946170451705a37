# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""One rank of a multi-process world, on CPU and gloo or on GPU and NCCL, and every stand-in
that lets megatron-core's GPU-only code run on a CPU-only host.

:func:`join_world` starts the process group and megatron-core's model-parallel groups for one
spawned rank; :func:`quiet` silences the import-time warnings of megatron-core and its
optional dependencies, so that a spawned world prints only what fails.

The stand-ins (:func:`install_cpu_stand_ins`, installed only for ``device == "cpu"``; the NCCL
world runs megatron-core untouched) and why each is needed:

``torch.cuda.current_device``
    DDP, the optimizer and dist_checkpointing name ``torch.cuda.current_device()`` as the
    device of buffers they create: returns 0, which the device mode below maps to the CPU.
``torch.cuda.current_stream``, ``torch.cuda.Stream``, ``torch.cuda.stream``
    the grad-reduce path waits on CUDA-graph events of the current stream, and a stream is made
    for several optimizer instances: a stream object whose waits and synchronise are no-ops (a
    CPU runs in program order), and a context that does nothing.
``torch.cuda.synchronize``, ``torch.cuda.empty_cache``
    called between phases to free memory: no-ops.
:class:`CudaOnCpu`, a ``TorchFunctionMode``
    megatron-core creates small tensors with ``device="cuda"`` (the optimizer's ``found_inf``,
    the loss scale, dist_checkpointing's exchange buffers) and moves tensors with ``.cuda()``:
    the mode rewrites a CUDA device argument to the CPU and makes ``.cuda()`` a no-op.
    The distributed optimizer takes only parameters whose ``Tensor.type()`` is
    ``torch.cuda.FloatTensor``, ``torch.cuda.HalfTensor`` or ``torch.cuda.BFloat16Tensor``:
    the mode answers ``type()`` (without arguments) with the CUDA name of a CPU tensor's type.
    ``is_cuda`` stays False, so code that chooses between a host and a device path (the
    HybridDeviceOptimizer, the fork's loaders) takes the host path, as on a CPU-only machine.

``filesystem_async._process_memory`` (both devices, only where psutil is not installed)
    dist_checkpointing's writer measures its memory with psutil for a debug log line and fails
    the save without it: the stand-in reports 0 bytes. psutil is no dependency of this project.

gloo itself is enough for the collectives the path uses: ``all_gather_into_tensor``,
``reduce_scatter_tensor`` and ``_coalescing_manager`` run on it; ``ReduceOp.AVG`` does not, which
is why the harness keeps megatron-core's default of scaling before a summing collective.
"""

import contextlib
import datetime
import importlib.util
import logging
import os
import warnings

import torch
from torch.overrides import TorchFunctionMode

# Type names the distributed optimizer accepts, by the CPU tensor type they stand for.
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}
_QUIET_LOGGERS = ("megatron", "torch.distributed", "torch.distributed.checkpoint")


def _is_cuda_device(value):
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.startswith("cuda")
    # A bare index names a CUDA device (torch.cuda.current_device() returns one).
    return isinstance(value, int) and not isinstance(value, bool)


class CudaOnCpu(TorchFunctionMode):
    """Runs code written for CUDA tensors on CPU tensors (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda_device(arg) else arg for arg in args)
        return func(*args, **kwargs)


class _HostStream:
    """A stream of a CPU: work runs in program order, so there is nothing to wait for."""

    def __init__(self, *args, **kwargs):
        del args, kwargs

    def wait_stream(self, stream):  # pylint: disable=missing-function-docstring
        del stream

    def wait_event(self, event):  # pylint: disable=missing-function-docstring
        del event

    def synchronize(self):  # pylint: disable=missing-function-docstring
        pass

    def record_event(self, event=None):  # pylint: disable=missing-function-docstring
        return event


def cpu_world_problem():
    """Why a CPU world cannot run in this environment, or None.

    Where Transformer Engine is installed, megatron-core clips gradients (and scales them) with
    TE's multi-tensor kernels, which run on CUDA memory only; a CPU world's tensors would reach
    them. Such a host runs the NCCL world instead (``MULTIRANK_DEVICE=cuda``).
    """
    if importlib.util.find_spec("transformer_engine") is not None:
        return (
            "Transformer Engine is installed: megatron-core would run its CUDA multi-tensor "
            "kernels on the CPU world's tensors (use MULTIRANK_DEVICE=cuda)"
        )
    return None


def install_cpu_stand_ins():
    """Install the stand-ins of the module docstring in this process (for good).

    Returns:
        The active :class:`CudaOnCpu` mode (entered; it stays active for the process).
    """
    host_stream = _HostStream()
    torch.cuda.current_device = lambda: 0
    torch.cuda.current_stream = lambda *args, **kwargs: host_stream
    torch.cuda.Stream = _HostStream
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda: None
    mode = CudaOnCpu()
    mode.__enter__()  # pylint: disable=unnecessary-dunder-call
    return mode


def stand_in_for_psutil():
    """Let dist_checkpointing save where psutil is not installed (see the module docstring)."""
    try:
        import psutil  # pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
        # pylint: disable-next=import-outside-toplevel
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        filesystem_async._process_memory = lambda: 0  # pylint: disable=protected-access


def quiet():
    """Silence warnings and library logging below errors in this process."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


class World:
    """This process's rank in a spawned world and megatron-core's groups over it.

    Args:
        rank: this process's global rank.
        size: the number of processes.
        port: the rendezvous port on localhost.
        device: ``"cpu"`` (gloo, with the stand-ins) or ``"cuda"`` (NCCL, one GPU per rank).
        tensor_parallel: tensor-model-parallel size; data-parallel size is the rest.
        timeout_s: collective timeout.
    """

    def __init__(self, rank, size, port, device="cpu", tensor_parallel=1, timeout_s=300):
        self.rank, self.size, self.device = rank, size, device
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        timeout = datetime.timedelta(seconds=timeout_s)
        if device == "cpu":
            install_cpu_stand_ins()
            torch.distributed.init_process_group(
                "gloo", rank=rank, world_size=size, timeout=timeout
            )
        else:
            torch.cuda.set_device(rank % torch.cuda.device_count())
            torch.distributed.init_process_group(
                "nccl",
                rank=rank,
                world_size=size,
                timeout=timeout,
                device_id=torch.device("cuda", torch.cuda.current_device()),
            )
        stand_in_for_psutil()
        self.tensor_parallel = tensor_parallel
        self.set_parallelism(tensor_parallel)

    @staticmethod
    def set_parallelism(tensor_parallel):
        """(Re)build megatron-core's model-parallel groups with this tensor-parallel size."""
        from megatron.core import parallel_state  # pylint: disable=import-outside-toplevel

        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)

    @property
    def data_parallel(self):
        """Data-parallel size of the current groups."""
        from megatron.core import parallel_state  # pylint: disable=import-outside-toplevel

        return parallel_state.get_data_parallel_world_size()

    def barrier(self):
        """Wait for every rank."""
        torch.distributed.barrier()

    @staticmethod
    def close():
        """Tear the groups down."""
        from megatron.core import parallel_state  # pylint: disable=import-outside-toplevel

        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
