# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
# pylint: disable=bad-builtin
"""Host AdamW beside the HDO's copies' DMA, and AdamW with bf16 copies converted on the host.

Three questions about the offloaded step's limit. First, how much slower fused host AdamW runs
while the copies of a pipelined step move through host memory beside it: AdamW steps the
tensors one by one while, per tensor, the next one's gradient comes down and the previous one's
master goes up, in fp32 (what the HDO moves: fp32 masters, gradients widened on the device) or
in bf16 (what the floor counts), both ways or one. Second, whether moving bf16 gradients and
widening them on the host would pay: AdamW over chunks of each tensor, each chunk's gradient
widened into a small fp32 buffer first, against AdamW over the whole tensor with fp32
gradients. Third, whether moving bf16 masters up would pay: each master narrowed on the host
right after its step (while it may still be in the last-level cache) and half the bytes
uploaded, against the fp32 upload beside AdamW. Prints one line per measurement (median ms over
``--repeats``); without CUDA only the host-only ones. ``--threads`` times the first question at
several host thread counts in one process: whether AdamW with a core left free (for a thread
that queues the copies) runs as fast, alone and beside them, as with every core.
"""

import argparse
import statistics
import time
from typing import Callable, Dict, List

import torch

KERNEL_SETTINGS = dict(
    amsgrad=False, lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.01, eps=1e-8, maximize=False
)


def median_ms(fn: Callable[[], None], repeats: int) -> float:
    """Median wall time of ``fn`` in ms after one untimed call (the accelerator synced)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


class HostAdam:
    """``tensors`` fp32 host tensors of ``numel`` elements with gradients and moments, stepped
    by torch's fused AdamW kernel one tensor at a time (pinned where CUDA exists)."""

    def __init__(self, tensors: int, numel: int):
        pin = torch.cuda.is_available()
        self.params = [self._host(torch.randn(numel), pin) for _ in range(tensors)]
        # bf16 values in fp32, so that the widened bf16 gradients are the same gradients.
        self.grads = [
            self._host((torch.randn(numel) * 1e-3).bfloat16().float(), pin) for _ in range(tensors)
        ]
        self.exp_avgs = [torch.zeros(numel) for _ in range(tensors)]
        self.exp_avg_sqs = [torch.zeros(numel) for _ in range(tensors)]
        self.steps = [torch.zeros(()) for _ in range(tensors)]

    @staticmethod
    def _host(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
        return tensor.pin_memory() if pin else tensor

    def step_one(self, index: int, grad=None, span=slice(None)):
        """AdamW on tensor ``index`` (elements ``span``), with its own or the given gradient."""
        torch._fused_adamw_(  # pylint: disable=protected-access
            [self.params[index][span]],
            [self.grads[index][span] if grad is None else grad],
            [self.exp_avgs[index][span]],
            [self.exp_avg_sqs[index][span]],
            [],
            [self.steps[index]],
            **KERNEL_SETTINGS,
        )

    def step_all(self):
        """One AdamW step of every tensor, each with its own counter."""
        for index in range(len(self.params)):
            self.steps[index] += 1
            self.step_one(index)


def beside_copies(adam: HostAdam, dtype: torch.dtype, directions: str) -> Callable[[], None]:
    """AdamW tensor by tensor, each step beside the next gradient's D2H and the previous
    master's H2D (``directions``: ``"du"``, ``"d"`` or ``"u"``) of one tensor's size in
    ``dtype``, each on its own stream, as the HDO's pipeline moves them."""
    numel, count = adam.params[0].numel(), len(adam.params)
    device = [torch.empty(numel, device="cuda", dtype=dtype) for _ in range(2)]
    host = [torch.empty(numel, dtype=dtype).pin_memory() for _ in range(2)]
    down, up = torch.cuda.Stream(), torch.cuda.Stream()

    def run():
        for index in range(count):
            if "d" in directions:
                with torch.cuda.stream(down):
                    target = adam.grads[(index + 1) % count] if dtype == torch.float32 else host[0]
                    target.copy_(device[0], non_blocking=True)
            adam.steps[index] += 1
            adam.step_one(index)
            if "u" in directions:
                with torch.cuda.stream(up):
                    source = adam.params[index] if dtype == torch.float32 else host[1]
                    device[1].copy_(source, non_blocking=True)

    return run


def narrowed_uploads(adam: HostAdam, down: bool) -> Callable[[], None]:
    """AdamW tensor by tensor, each stepped master then narrowed to bf16 on the host, into one
    of two pinned buffers, and uploaded from there (where CUDA exists): half the bytes of an
    fp32 upload cross the bus, at the cost of a host pass over the master right after its step,
    while it may still be in the last-level cache. With ``down`` the next gradient comes down
    in fp32 beside each step, as in :func:`beside_copies`. The buffers are ``run.staged``."""
    numel, count = adam.params[0].numel(), len(adam.params)
    cuda = torch.cuda.is_available()
    staged = [torch.empty(numel, dtype=torch.bfloat16, pin_memory=cuda) for _ in range(2)]
    if cuda:
        device_params = torch.empty(numel, device="cuda", dtype=torch.bfloat16)
        device_grads = torch.empty(numel, device="cuda")
        down_stream, up_stream = torch.cuda.Stream(), torch.cuda.Stream()
        uploaded = [torch.cuda.Event(), torch.cuda.Event()]

    def run():
        for index in range(count):
            if cuda and down:
                with torch.cuda.stream(down_stream):
                    adam.grads[(index + 1) % count].copy_(device_grads, non_blocking=True)
            adam.steps[index] += 1
            adam.step_one(index)
            buffer = staged[index % 2]
            if cuda:
                uploaded[index % 2].synchronize()  # its last upload has read the buffer
            buffer.copy_(adam.params[index])
            if cuda:
                with torch.cuda.stream(up_stream):
                    device_params.copy_(buffer, non_blocking=True)
                    uploaded[index % 2].record(up_stream)
        if cuda:
            up_stream.synchronize()

    run.staged = staged
    return run


def widened_in_chunks(adam: HostAdam, tensors: int, chunk: int) -> Callable[[], None]:
    """AdamW over the first ``tensors`` tensors with bf16 gradients, each chunk of ``chunk``
    elements widened into one fp32 buffer before its kernel call."""
    numel = adam.params[0].numel()
    bf16_grads = [grad.to(torch.bfloat16) for grad in adam.grads[:tensors]]
    scratch = torch.empty(chunk)

    def run():
        for index in range(tensors):
            adam.steps[index] += 1
            for start in range(0, numel, chunk):
                stop = min(numel, start + chunk)
                widened = scratch[: stop - start].copy_(bf16_grads[index][start:stop])
                adam.step_one(index, widened, slice(start, stop))

    return run


def beside(adam: HostAdam, repeats: int, suffix: str = "") -> Dict[str, float]:
    """AdamW alone and beside each kind of copies (where CUDA exists), by label, in ms."""
    results = {f"adam alone, {len(adam.params)} tensors{suffix}": median_ms(adam.step_all, repeats)}
    if torch.cuda.is_available():
        for dtype in (torch.float32, torch.bfloat16):
            for directions in ("du", "d", "u"):
                label = f"adam beside {str(dtype).split('.')[-1]} copies, {directions}{suffix}"
                results[label] = median_ms(beside_copies(adam, dtype, directions), repeats)
    return results


def measure(args) -> Dict[str, float]:
    """Every measurement, by label, in ms."""
    adam = HostAdam(args.tensors, args.numel)
    # Every count in one process, so that the tensors and the host's state are the same.
    default, results = torch.get_num_threads(), {}
    try:
        for threads in args.threads or [default]:
            torch.set_num_threads(threads)
            suffix = f", {threads} threads" if args.threads else ""
            results.update(beside(adam, args.repeats, suffix))
    finally:
        torch.set_num_threads(default)
    if args.beside_only:
        return results
    cuda = torch.cuda.is_available()
    ways = [(False, "adam, ")] + [(True, "adam beside float32 copies, d, ")] * cuda
    for down, label in ways:
        label += "bfloat16 u narrowed on the host"
        results[label] = median_ms(narrowed_uploads(adam, down), args.repeats)
    few = min(args.chunk_tensors, args.tensors)
    whole = lambda: [adam.step_one(i) for i in range(few)]  # noqa: E731
    results[f"adam whole, fp32 grads, {few} tensors"] = median_ms(whole, args.repeats)
    for chunk in args.chunks:
        label = f"adam widened in chunks of {chunk}, {few} tensors"
        results[label] = median_ms(widened_in_chunks(adam, few, chunk), args.repeats)
    return results


def parse_args(argv: List[str] = None):
    """The command line (``--help`` lists it)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--tensors", type=int, default=32, help="host tensors AdamW steps")
    parser.add_argument(
        "--numel", type=int, default=536_000_000 // 32, help="elements of each tensor"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement")
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[],
        help="time AdamW alone and beside the copies at each of these host thread counts "
        "(torch.set_num_threads), in this order; empty: at torch's own count only",
    )
    parser.add_argument(
        "--beside-only",
        action="store_true",
        help="only AdamW alone and beside the copies: skip the host narrowing and widening",
    )
    parser.add_argument(
        "--chunk-tensors", type=int, default=8, help="tensors the chunked widening steps"
    )
    parser.add_argument(
        "--chunks",
        type=int,
        nargs="+",
        default=[256 << 10, 1 << 20, 4 << 20],
        help="chunk sizes (elements) of the widening",
    )
    return parser.parse_args(argv)


def main(argv: List[str] = None) -> Dict[str, float]:
    """Measure, print one line per measurement, and return the figures (ms by label)."""
    args = parse_args(argv)
    print(f"host threads {torch.get_num_threads()}; CUDA {torch.cuda.is_available()}")
    results = measure(args)
    for label, ms in results.items():
        print(f"{label}: {ms:.1f} ms")
    return results


if __name__ == "__main__":
    main()
