# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""The main job's single-process check of the HybridDeviceOptimizer: train a small bf16 MLP with
CPU offload, checkpoint, go on, resume a fresh model and optimizer from the checkpoint, and
measure memory over the phases. Runs on a CPU-only host too (the fork's offloaded share on plain
host copies)."""

import gc
import os
import tempfile
import time
import traceback

import torch

from megatron_optimizer_fork import load_upstream_module
from megatron_optimizer_fork.memory import pinned_bytes_held

# Megatron without TE/Apex uses torch AdamW on both halves; "adam" gives the in-place half
# another class, which upstream needs because it places loaded state by class.
GPU_OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}


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


# Each side of the comparison: its name in the report -> the HybridDeviceOptimizer class.
CLASSES = {"upstream 0.19.2": upstream_class, "fork": fork_class}
