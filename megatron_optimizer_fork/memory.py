# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Pinned host memory figures, as tests, tools and benchmarks report them.

torch's caching host allocator keeps freed pinned blocks for reuse, so it distinguishes
blocks handed out to tensors (*in use*) from all the blocks it owns (*held*: in use plus
cached). What a process pins is what it holds; what an optimizer needs is what it has in
use. Both are rounded up to powers of two, as the allocator asks CUDA for them.
"""

import gc

import torch


def pinned_bytes_in_use() -> int:
    """Bytes of pinned host blocks handed out to live tensors (0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.memory.host_memory_stats().get("active_bytes.current", 0)


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
