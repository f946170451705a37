# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Parameter lists the HDO step benchmark runs: what a DistributedOptimizer hands its HDO.

A model's parameters lie in one contiguous buffer, in reverse order of definition (as
megatron-core's DDP lays out its grad buffer); the buffer is padded to a multiple of the
data-parallel size and cut into equal ranges, and rank 0's HDO gets the pieces of every
parameter that fall into its range, as 1-D shards. With ``dp == 1`` that is every parameter,
flattened.
"""

from typing import Callable, Dict, List


def gpt_numels(hidden=1536, layers=24, vocab=50304) -> List[int]:
    """A GPT: embedding, per layer two LayerNorms (weight, bias), QKV, projection and two MLP
    matrices with their biases, a final LayerNorm. 757M parameters with the defaults."""
    per_layer = [
        hidden,
        hidden,  # input LayerNorm weight, bias
        3 * hidden * hidden,
        3 * hidden,  # QKV
        hidden * hidden,
        hidden,  # projection
        hidden,
        hidden,  # MLP LayerNorm
        4 * hidden * hidden,
        4 * hidden,  # fc1
        4 * hidden * hidden,
        hidden,  # fc2
    ]
    return [vocab * hidden] + per_layer * layers + [hidden, hidden]


def moe_numels(hidden=1024, layers=24, experts=64, expert_ffn=160, vocab=50304) -> List[int]:
    """A fine-grained MoE: attention as in :func:`gpt_numels`, a router and ``experts`` expert
    MLPs (two matrices each) per layer. 657M parameters in 3,291 tensors with the defaults."""
    attention = [hidden, hidden, 3 * hidden * hidden, 3 * hidden, hidden * hidden, hidden]
    moe = [hidden, hidden, experts * hidden] + [expert_ffn * hidden] * (2 * experts)
    return [vocab * hidden] + (attention + moe) * layers + [hidden, hidden]


def llama_numels(hidden=1536, layers=24, ffn=4096, kv_heads=4, heads=16, vocab=32000):
    """A Llama-style model: an embedding and an untied output layer; per layer an RMSNorm
    weight, grouped-query attention (Q, K and V with ``kv_heads`` of ``heads``, the output
    projection), an RMSNorm weight and a SwiGLU MLP (gate, up, down); a final RMSNorm; no
    biases. 693M parameters with the defaults."""
    kv = hidden * hidden * kv_heads // heads
    per_layer = [hidden, hidden * hidden, kv, kv, hidden * hidden, hidden] + [hidden * ffn] * 3
    return [vocab * hidden] + per_layer * layers + [hidden, vocab * hidden]


def dense_numels(numel=536e6, tensors=32) -> List[int]:
    """``tensors`` equal tensors holding ``numel`` elements together."""
    return [int(numel) // tensors] * tensors


def stress_numels() -> List[int]:
    """4,096 tensors of 65,536 elements (268M)."""
    return [65536] * 4096


CASES: Dict[str, Callable[..., List[int]]] = {
    "dense32": dense_numels,
    "gpt": gpt_numels,
    "llama": llama_numels,
    "moe": moe_numels,
    "stress": stress_numels,
}


def rank_shards(numels: List[int], dp: int, rank: int = 0) -> List[int]:
    """Sizes of the shards of ``numels`` that data-parallel ``rank`` of ``dp`` owns."""
    total = sum(numels)
    per_rank = -(-total // dp)
    start, end = rank * per_rank, (rank + 1) * per_rank
    shards, offset = [], 0
    for numel in reversed(numels):  # the buffer holds the parameters back to front
        low, high = max(start, offset), min(end, offset + numel)
        if high > low:
            shards.append(high - low)
        offset += numel
    return shards


def case_numels(name: str, dp: int = 1, scale: float = 1.0, rank: int = 0, **dense) -> List[int]:
    """The shard sizes data-parallel ``rank``'s HDO steps in case ``name``, each scaled by
    ``scale``."""
    numels = CASES[name](**dense) if name == "dense32" else CASES[name]()
    return [max(1, round(n * scale)) for n in rank_shards(numels, dp, rank)]
