# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
# pylint: disable=bad-builtin
"""Can the HDO's host AdamW steps run on a worker thread while the caller queues its copies?

The HDO steps its host buckets on the caller's thread, between queueing each bucket's
downloads and uploads, so the caller's own work adds to the host steps. This times fused
torch AdamW over buckets laid out as the HDO lays them out (one flat fp32 block per bucket,
its parameters views into it) four ways: on the caller's thread alone; the caller's work
alone (a multi-tensor device copy and a device-to-host copy per bucket, as the HDO queues
them; skipped without CUDA); both one after the other on the caller's thread; and the steps
on a worker thread while the caller does its work, fed bucket by bucket through a queue (as
a threaded HDO would), with the caller idle too. Medians of ``--repeats`` runs, min-max.
"""

import argparse
import queue
import statistics
import threading
import time

import torch


class HostBuckets:
    """One fused AdamW per bucket of ``per_bucket`` views into a flat fp32 block."""

    def __init__(self, buckets: int, bucket_numel: int, per_bucket: int):
        self.optimizers = []
        generator = torch.Generator().manual_seed(0)
        for _ in range(buckets):
            views = torch.zeros(bucket_numel).split(bucket_numel // per_bucket)
            params = [torch.nn.Parameter(view) for view in views]
            for param in params:
                param.grad = torch.randn(param.shape, generator=generator) * 1e-3
            self.optimizers.append(torch.optim.AdamW(params, lr=1e-3, fused=True))
        self.step_all()  # creates the state

    def step_all(self):
        """Every bucket's step, on this thread."""
        for optimizer in self.optimizers:
            optimizer.step()


class CallerWork:
    """What the caller queues per bucket: device copies of ``tensors`` small tensors and one
    download of a bucket into pinned memory (nothing without CUDA)."""

    def __init__(self, bucket_numel: int, tensors: int = 2048, numel: int = 65536):
        self.enabled = torch.cuda.is_available()
        if not self.enabled:
            return
        self.sources = [torch.randn(numel, device="cuda") for _ in range(tensors)]
        self.targets = [torch.empty_like(t) for t in self.sources]
        self.device_bucket = torch.empty(bucket_numel, device="cuda")
        self.host_bucket = torch.empty(bucket_numel, pin_memory=True)

    def queue_bucket(self):
        """Queue one bucket's copies."""
        if self.enabled:
            for first in range(0, len(self.sources), 64):
                chunk = slice(first, first + 64)
                torch._foreach_copy_(  # pylint: disable=protected-access
                    self.targets[chunk], self.sources[chunk]
                )
            self.host_bucket.copy_(self.device_bucket, non_blocking=True)

    def finish(self):
        """Wait for what was queued."""
        if self.enabled:
            torch.cuda.synchronize()


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _on_worker(host: HostBuckets, caller: CallerWork, caller_works: bool):
    """The steps on a worker thread, each bucket handed over after the caller queued it."""
    handed = queue.Queue()

    def work():
        while (optimizer := handed.get()) is not None:
            optimizer.step()

    worker = threading.Thread(target=work)
    worker.start()
    for optimizer in host.optimizers:
        if caller_works:
            caller.queue_bucket()
        handed.put(optimizer)
    handed.put(None)
    worker.join()
    caller.finish()


def measure(buckets: int, bucket_numel: int, per_bucket: int, repeats: int) -> dict:
    """Seconds of each way over ``repeats`` runs: ``{name: [seconds, ...]}``."""
    host = HostBuckets(buckets, bucket_numel, per_bucket)
    caller = CallerWork(bucket_numel)

    def caller_alone():
        for _ in host.optimizers:
            caller.queue_bucket()
        caller.finish()

    def serial():
        for optimizer in host.optimizers:
            caller.queue_bucket()
            optimizer.step()
        caller.finish()

    ways = {
        "host steps, caller's thread": host.step_all,
        "caller's work alone": caller_alone,
        "both, caller's thread": serial,
        "steps on a worker, caller working": lambda: _on_worker(host, caller, True),
        "steps on a worker, caller idle": lambda: _on_worker(host, caller, False),
    }
    return {name: [_timed(run) for _ in range(repeats)] for name, run in ways.items()}


def build_parser():
    """The command line (``--help`` lists every option)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", maxsplit=1)[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--buckets", type=int, default=32, help="host buckets")
    parser.add_argument(
        "--bucket-numel", type=int, default=4 << 20, help="fp32 elements a bucket (16 MiB)"
    )
    parser.add_argument("--per-bucket", type=int, default=64, help="parameters a bucket")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each way")
    return parser


def main(argv=None):
    """Measure and print one line per way."""
    args = build_parser().parse_args(argv)
    print(
        f"{args.buckets} buckets of {args.bucket_numel} fp32 elements in {args.per_bucket} "
        f"parameters, {torch.get_num_threads()} intra-op threads, "
        f"CUDA {'on' if torch.cuda.is_available() else 'off'}"
    )
    times = measure(args.buckets, args.bucket_numel, args.per_bucket, max(1, args.repeats))
    for name, seconds in times.items():
        print(
            f"{name:36s} {statistics.median(seconds) * 1e3:8.1f} ms "
            f"({min(seconds) * 1e3:.1f}-{max(seconds) * 1e3:.1f})"
        )
    return times


if __name__ == "__main__":
    main()
