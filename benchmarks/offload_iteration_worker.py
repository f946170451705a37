# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""One variant of ``offload_iteration.py``, measured in a process of its own.

The process builds what Megatron-LM builds for a GPT model on one GPU with ``--bf16
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather`` (and, for the
offloaded variants, ``--optimizer-cpu-offload --use-precision-aware-optimizer
--overlap-cpu-optimizer-d2h-h2d``): megatron-core's ``GPTModel`` in ``Float16Module`` and DDP,
the optimizer ``get_megatron_optimizer`` returns, the model config's hooks as Megatron-LM's
``train`` sets them, and its ``train_step``: zero the grad buffers, the forward and backward
passes of every micro-batch through megatron-core's schedule, ``optimizer.step()``. The data is
random tokens, drawn once from ``--seed``, with every token counted in the loss.

Which implementation of the optimizer modules runs is decided when they are first imported,
by the environment the parent gives this process (``MEGATRON_OPTIMIZER_FORK``); the worker
checks that it got the one its variant names.

Without CUDA (``--smoke``) the same code runs a tiny model on the CPU with the resume harness's
stand-ins for CUDA-only calls; its figures are host-only and say nothing about offloading.
"""

import argparse
import functools
import gc
import hashlib
import os
import sys
import time
from pathlib import Path

import torch

from megatron_optimizer_fork.memory import pinned_bytes_held

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    # Appended: the root's megatron/ holds no __init__.py, so the installed megatron-core wins.
    sys.path.append(str(REPO_ROOT))

OVERLAP_STEP_ATTRIBUTE = "overlap_cpu_optimizer_step_with_forward"
"""The OptimizerConfig attribute that turns on the fork's step behind the next forward (0.19.2's
dataclass has no such field; the benchmark sets it on the instance)."""

PHASES = ("forward_after_step", "forward", "forward_backward", "step")
"""Phases of a breakdown iteration, in the order they run, each between two synchronizes:
a forward-only pass right after the previous step (it waits for whatever of that step is still
running), a second forward-only pass, the training passes (forward and backward of every
micro-batch) and ``optimizer.step()``."""

FULL_RECOMPUTE = {
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
}
"""The TransformerConfig fields of ``--recompute``: each layer's activations recomputed in the
backward, so that only its input stays between the passes."""

PROFILED_ITERATIONS = 3
"""Training iterations recorded in a ``--profile`` trace."""


def progress(message: str) -> None:
    """One line on stderr, for the person watching the run."""
    # pylint: disable-next=bad-builtin
    print(f"[offload_iteration] {message}", file=sys.stderr, flush=True)


def sync(device: str) -> None:
    """Wait for the accelerator, if any."""
    if device == "cuda":
        torch.cuda.synchronize()


def wall_time(work, device: str) -> float:
    """Seconds ``work()`` takes, the accelerator synchronized before and after it."""
    sync(device)
    start = time.perf_counter()
    work()
    sync(device)
    return time.perf_counter() - start


def make_deterministic() -> None:
    """Ask every library on the path for run-to-run identical results, so that the digests of
    two processes differ only where their optimizers do (megatron-core's embedding, for one,
    accumulates its gradient with atomics otherwise). Set before CUDA starts: cuBLAS reads
    its workspace setting when it creates a handle."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"  # megatron-core insists with TE
    torch.use_deterministic_algorithms(True, warn_only=True)
    # Filling every new tensor would add a memset to each allocation, inside the timed passes.
    torch.utils.deterministic.fill_uninitialized_memory = False


def join_world(device: str) -> None:
    """torch.distributed with this process alone (NCCL on CUDA, gloo with the CPU stand-ins
    without it) on a free local port, and megatron-core's model-parallel groups (TP 1, PP 1)."""
    # pylint: disable=import-outside-toplevel
    from resume_harness.cpu_world import World
    from resume_harness.multirank import free_port

    World(rank=0, size=1, port=free_port(), device=device)


def leave_world() -> None:
    """Take down megatron-core's groups and the process group, as a training script ends."""
    # pylint: disable-next=import-outside-toplevel
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def check_implementation(kind: str) -> dict:
    """The optimizer modules this process imported, checked to be the ones ``kind`` runs."""
    # pylint: disable=import-outside-toplevel
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    modules = {"distrib_optimizer": distrib_optimizer, "hybrid_optimizer": hybrid_optimizer}
    for name, module in modules.items():
        fork = bool(getattr(module, "FORK_IMPLEMENTATION", False))
        if fork == (kind == "upstream"):
            raise RuntimeError(f"variant {kind} imported {name} from {module.__file__}")
    return {name: module.__file__ for name, module in modules.items()}


def layer_spec():
    """``(name, spec)``: Transformer Engine's layer spec where TE imports, else the local one."""
    # pylint: disable=import-outside-toplevel
    from megatron.core.models.gpt import gpt_layer_specs

    try:
        import transformer_engine  # noqa: F401  pylint: disable=unused-import
    except Exception:  # pylint: disable=broad-except
        # TE fails to import in more ways than ImportError (missing CUDA libraries, ABI).
        return "local", gpt_layer_specs.get_gpt_layer_local_spec()
    return "te", gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()


def transformer_config(args, device: str):
    """The model's TransformerConfig: bf16 parameters, Megatron-LM's dropout and init."""
    # pylint: disable-next=import-outside-toplevel
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        # The CPU stand-ins have no CUDA generator to initialize weights with.
        use_cpu_initialization=device == "cpu",
        deterministic_mode=args.deterministic,
        **(FULL_RECOMPUTE if args.recompute else {}),
    )


def build_model(args, config, spec):
    """The GPT model as Megatron-LM wraps it for bf16 training with the distributed optimizer:
    on the GPU, in ``Float16Module``, in megatron-core's DDP (built on a side stream, as
    Megatron-LM builds it)."""
    # pylint: disable=import-outside-toplevel
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.vocab,
        max_sequence_length=args.seq_length,
        position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=True,
    )
    for param in gpt.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    gpt.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        grad_reduce_in_fp32=True,
        bucket_size=args.bucket_size,
    )
    side_stream = torch.cuda.Stream()
    side_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_stream):
        model = DistributedDataParallel(
            config=config, ddp_config=ddp_config, module=Float16Module(config, gpt)
        )
    torch.cuda.current_stream().wait_stream(side_stream)
    return model


def build_optimizer(args, model):
    """``get_megatron_optimizer`` for the variant: Adam, bf16, the distributed optimizer, and
    the offload flags of the project's table (``resume_harness.table``) for its fraction."""
    # pylint: disable=import-outside-toplevel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from resume_harness import table

    config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        weight_decay=0.1,
        bf16=True,
        params_dtype=torch.bfloat16,
        clip_grad=1.0,
        use_distributed_optimizer=True,
        overlap_param_gather=True,
        overlap_cpu_optimizer_d2h_h2d=True,
        **table.optimizer_kind("default").options(args.fraction),
    )
    if args.overlap_step:
        setattr(config, OVERLAP_STEP_ATTRIBUTE, True)
    return get_megatron_optimizer(config, [model])


def set_training_hooks(model, optimizer) -> None:
    """The model config's hooks as Megatron-LM's ``train`` sets them for one model chunk with
    ``overlap_grad_reduce`` (and its default ``align_grad_reduce``). ``param_sync_func`` stays
    unset: Megatron-LM sets it only with ``align_param_gather``, which it turns off without
    virtual pipeline stages, leaving the parameter gather to the forward pre-hooks."""
    # pylint: disable=import-outside-toplevel
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model.no_sync
    config.grad_sync_func = model.start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads


def mock_batches(args, device: str):
    """``--micro-batches`` micro-batches of random tokens from ``--seed``: the inputs, the
    next tokens as labels, positions, and a loss mask that counts every token. The attention
    mask is left to the model (``None``: both layer specs apply a causal mask then)."""
    generator = torch.Generator(device=device).manual_seed(args.seed)
    shape = (args.micro_batch_size, args.seq_length)
    positions = torch.arange(args.seq_length, device=device).unsqueeze(0).expand(*shape)
    batches = []
    for _ in range(args.micro_batches):
        tokens = torch.randint(
            0, args.vocab, (shape[0], shape[1] + 1), generator=generator, device=device
        )
        batches.append(
            {
                "tokens": tokens[:, :-1].contiguous(),
                "labels": tokens[:, 1:].contiguous(),
                "position_ids": positions,
                "loss_mask": torch.ones(shape, dtype=torch.float32, device=device),
            }
        )
    return batches


def masked_loss(loss_mask, output_tensor):
    """Summed token losses under ``loss_mask``, the tokens counted, and the pair for logging:
    the three values megatron-core's schedule takes from a loss function (it divides by the
    tokens and the micro-batches)."""
    mask = loss_mask.view(-1).float()
    loss = torch.sum(output_tensor.float().view(-1) * mask)
    tokens = mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.detach().float()])}


def forward_step(data_iterator, model):
    """The schedule's forward step: the model's per-token losses on the next micro-batch."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(masked_loss, batch["loss_mask"])


class Trainer:
    """Megatron-LM's training step over the mock micro-batches.

    As Megatron-LM starts training, the forward pre-hooks that gather parameters are off for
    the first iteration and turned on once its step has succeeded.
    """

    def __init__(self, model, optimizer, batches, args):
        # pylint: disable-next=import-outside-toplevel
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.model, self.optimizer, self.batches = model, optimizer, batches
        self.forward_backward_func = get_forward_backward_func()
        self.seq_length, self.micro_batch_size = args.seq_length, args.micro_batch_size
        self.pre_hook_on = False
        self.successes, self.grad_norm, self.losses = [], None, []
        model.disable_forward_pre_hook(param_sync=False)

    def zero_grads(self):
        """Clear the DDP grad buffers and the optimizer's gradients."""
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def passes(self, forward_only: bool):
        """Every micro-batch through megatron-core's schedule; the losses it reports."""
        self.losses = self.forward_backward_func(
            forward_step_func=forward_step,
            data_iterator=iter(self.batches),
            model=[self.model],
            num_microbatches=len(self.batches),
            seq_length=self.seq_length,
            micro_batch_size=self.micro_batch_size,
            forward_only=forward_only,
        )
        return self.losses

    def step(self):
        """``optimizer.step()``; the pre-hooks go on after the first step that succeeds."""
        success, grad_norm, _ = self.optimizer.step()
        self.successes.append(bool(success))
        self.grad_norm = None if grad_norm is None else float(grad_norm)
        if success and not self.pre_hook_on:
            self.model.enable_forward_pre_hook()
            self.pre_hook_on = True

    def iteration(self):
        """One training iteration, as Megatron-LM's ``train_step``."""
        self.zero_grads()
        self.passes(forward_only=False)
        self.step()

    def last_loss(self) -> float:
        """Mean token loss of the last training passes."""
        totals = torch.stack([reported["lm loss"] for reported in self.losses]).sum(dim=0)
        return (totals[0] / totals[1].clamp(min=1)).item()


def bring_parameters_up_to_date(trainer: Trainer, device: str) -> None:
    """Bring the parameters up to date the way Megatron-LM does before it reads them (eval,
    checkpoints, the end of training): the pre-hooks off with a synchronous parameter gather.
    The caller turns them on again to train on."""
    trainer.optimizer.prepare_model_params_for_param_sync()
    trainer.model.disable_forward_pre_hook(param_sync=True)
    sync(device)


def parameters_digest(trainer: Trainer, device: str) -> str:
    """sha256 of the model's parameter bytes, once they are up to date."""
    bring_parameters_up_to_date(trainer, device)
    digest = hashlib.sha256()
    for param in trainer.model.parameters():
        digest.update(param.detach().reshape(-1).view(torch.uint8).cpu().numpy())
    trainer.model.enable_forward_pre_hook()
    return digest.hexdigest()


def breakdown(trainer: Trainer, device: str, count: int) -> dict:
    """Wall times of each phase of :data:`PHASES` over ``count`` iterations."""
    work = {
        "forward_after_step": lambda: trainer.passes(forward_only=True),
        "forward": lambda: trainer.passes(forward_only=True),
        "forward_backward": lambda: trainer.passes(forward_only=False),
        "step": trainer.step,
    }
    times = {phase: [] for phase in PHASES}
    for _ in range(count):
        trainer.zero_grads()
        for phase in PHASES:
            times[phase].append(wall_time(work[phase], device))
    return times


def write_profile(trainer: Trainer, device: str, path: str) -> dict:
    """A chrome trace (CPU, and CUDA where there is one) of a few training iterations; returns
    seconds an iteration of what the trace shows of the step behind the forward: the calling
    thread blocked in the HDO's waits for parameters, the worker's host buckets, and the GPU's
    kernels (what is left of the iteration is GPU idle time)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    # The host buckets run on the HDO's worker thread, which the profiler follows only so.
    every_thread = torch._C._profiler._ExperimentalConfig(  # pylint: disable=protected-access
        profile_all_threads=True
    )
    with torch.profiler.profile(
        activities=activities, experimental_config=every_thread
    ) as recorded:
        started = time.perf_counter()
        for _ in range(PROFILED_ITERATIONS):
            trainer.iteration()
        sync(device)
        wall = time.perf_counter() - started
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    recorded.export_chrome_trace(path)
    totals = {"iteration": wall, "waits_for_params": 0.0, "host_buckets": 0.0, "gpu_kernels": 0.0}
    names = {"HybridDeviceOptimizer.wait_for_params": "waits_for_params"}
    names["HybridDeviceOptimizer.host_bucket"] = "host_buckets"
    for event in recorded.key_averages():
        if event.key in names:
            totals[names[event.key]] += event.cpu_time_total / 1e6
        totals["gpu_kernels"] += getattr(event, "self_device_time_total", 0) / 1e6
    return {name: seconds / PROFILED_ITERATIONS for name, seconds in totals.items()}


def memory_figures(device: str) -> dict:
    """Peak pinned host memory, pinned memory held now and peak GPU memory, in bytes."""
    if device != "cuda":
        return dict.fromkeys(("pinned_peak", "pinned_held", "gpu_peak", "gpu_reserved_peak"), 0)
    host = torch.cuda.memory.host_memory_stats()
    return {
        "pinned_peak": host.get("allocated_bytes.peak", 0),
        "pinned_held": pinned_bytes_held(),
        "gpu_peak": torch.cuda.max_memory_allocated(),
        "gpu_reserved_peak": torch.cuda.max_memory_reserved(),
    }


def timed_iterations(trainer: Trainer, device: str, count: int) -> float:
    """Seconds for ``count`` iterations back to back, synchronized only at the two ends: an
    optimizer step that returns early is paid for by the next iteration's forward."""
    sync(device)
    start = time.perf_counter()
    for _ in range(count):
        trainer.iteration()
    sync(device)
    return time.perf_counter() - start


def setup(args, device: str):
    """World, seeds, model, optimizer and hooks: ``(trainer, facts about the build)``."""
    # pylint: disable-next=import-outside-toplevel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    join_world(device)
    modules = check_implementation(args.kind)
    torch.manual_seed(args.seed)
    # Without CUDA there are no CUDA generators to track; the inference tracker tracks none.
    model_parallel_cuda_manual_seed(args.seed, inference_rng_tracker=device == "cpu")
    config = transformer_config(args, device)
    spec_name, spec = layer_spec()
    model = build_model(args, config, spec)
    optimizer = build_optimizer(args, model)
    set_training_hooks(model, optimizer)
    trainer = Trainer(model, optimizer, mock_batches(args, device), args)
    facts = {
        "layer_spec": spec_name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "modules": modules,
        "optimizer": type(optimizer).__name__,
    }
    return trainer, facts


def run(spec: dict) -> dict:
    """Measure the variant ``spec`` describes (the parent's options plus ``variant``,
    ``kind``, ``fraction``, ``overlap_step``, ``round`` and ``profile_path``).

    Returns:
        The figures as plain values: ``iteration_s`` (the steady-state iteration),
        ``breakdown`` (each phase's times), memory peaks in bytes, the parameters' ``digest``
        after the warm-up and timed iterations, and what was built.
    """
    args = argparse.Namespace(**spec)
    started = time.perf_counter()
    if args.deterministic:
        make_deterministic()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    trainer, facts = setup(args, device)
    label = f"{args.variant} round {args.round}"
    progress(f"{label}: built, {facts['parameters']:,} parameters ({facts['layer_spec']} spec)")
    for _ in range(args.warmup):
        trainer.iteration()
    sync(device)
    gc.collect()  # what the warm-up left for the collector is not collected in a timed iteration
    progress(f"{label}: {args.warmup} warm-up iterations done")
    total = timed_iterations(trainer, device, args.iterations)
    result = {
        "variant": args.variant,
        "round": args.round,
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else "CPU",
        "host_threads": torch.get_num_threads(),
        "iteration_s": total / args.iterations,
        **memory_figures(device),
        "loss": trainer.last_loss(),
        "grad_norm": trainer.grad_norm,
        "steps_succeeded": all(trainer.successes),
        **facts,
    }
    result["digest"] = parameters_digest(trainer, device)
    progress(f"{label}: {result['iteration_s']:.3f} s an iteration; timing the phases")
    # The digest waited for the last step: one more, so that the first phase of every timed
    # breakdown iteration follows a step the way the first forward of a training iteration does.
    trainer.iteration()
    result["breakdown"] = breakdown(trainer, device, args.breakdown_iterations)
    if args.profile_path:
        result["profile_s"] = write_profile(trainer, device, args.profile_path)
        result["profile"] = args.profile_path
    # As Megatron-LM ends training: nothing of the last step is left running at exit.
    bring_parameters_up_to_date(trainer, device)
    leave_world()
    result["worker_s"] = time.perf_counter() - started
    return result
