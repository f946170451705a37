# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Pinned host memory figures, as tests, tools and benchmarks report them.

torch's caching host allocator keeps freed pinned blocks for reuse, so it distinguishes
blocks handed out to tensors from all the blocks it owns (*held*: handed out plus cached,
rounded up to powers of two as the allocator asks CUDA for them). What a process pins is
what it holds; what an optimizer needs is the pinned storage its tensors use (*in use*).
"""

import gc

import torch


def pinned_bytes_in_use() -> int:
    """Bytes of pinned host storage that live tensors reference, each storage once.

    Counted from the tensors themselves: the allocator's own in-use figure only drops once
    it next processes the events of freed blocks, so it lags behind frees.
    """
    if not torch.cuda.is_available():
        return 0
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.is_pinned():
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def pinned_bytes_held() -> int:
    """Bytes of pinned host memory the allocator owns, cached blocks included."""
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0)


def release_cached_pinned_memory() -> None:
    """Collect garbage and give cached pinned blocks back to CUDA, so that what is held
    afterwards is what live tensors use."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch._C._host_emptyCache()  # pylint: disable=protected-access
