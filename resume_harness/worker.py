# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Inside a torchrun job: pick the implementation, build the probe and the optimizer Megatron
builds for a case, train on fixed data, and save or load a checkpoint in the case's format."""

import datetime
import gc
import importlib
import os
from pathlib import Path

import torch

from .cases import Shape, optimizer_options, te_unavailable

MODULE = "megatron.core.optimizer.distrib_optimizer"
BATCH = 8
TRAIN_STREAM, FOLLOW_UP_STREAM = 1, 2
SAVE_SEED, LOAD_SEED = 1, 7
FORK_TREE_ENV = "RESUME_HARNESS_FORK_TREE"
"""A checkout whose ``megatron/`` folder serves the fork's modules in this job instead of the
installed overlay's (another commit's code, timed beside the current one)."""


def select_implementation(implementation):
    """Route ``megatron.core.optimizer`` to the requested code and prove it did.

    Must run before anything imports ``megatron.core.optimizer``.
    """
    import megatron_optimizer_fork as overlay

    if implementation == "upstream":
        os.environ[overlay.ENV_VAR] = "0"
    elif not overlay.is_enabled():
        raise SystemExit(f"--*-with fork, but {overlay.ENV_VAR} switches the overlay off")
    else:
        tree = os.environ.get(FORK_TREE_ENV)
        if tree:
            try:
                overlay.serve_from(tree)
            except ValueError as error:
                raise SystemExit(f"{FORK_TREE_ENV}={error}") from None
        overlay.install()
    module = importlib.import_module(MODULE)
    path = Path(module.__file__).resolve()
    fork_dir = Path(overlay.fork_package_dir("megatron.core.optimizer")).resolve()
    if (path.parent == fork_dir) != (implementation == "fork"):
        raise SystemExit(f"asked for the {implementation} implementation, got {path}")
    return str(path)


class Rank:
    """This process's place in the job, and the process groups Megatron needs."""

    def __init__(self, timeout_s):
        self.local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(self.local)
        torch.distributed.init_process_group(
            "nccl",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=torch.device("cuda", self.local),
        )
        self.rank = torch.distributed.get_rank()
        self.world = torch.distributed.get_world_size()
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel()

    def barrier(self):
        """Wait for every rank."""
        torch.distributed.barrier(device_ids=[self.local])

    @staticmethod
    def close():
        """Tear the groups down so the launcher sees a clean exit."""
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _probe_class(shape):
    from megatron.core.transformer.module import MegatronModule

    class ResumeProbe(MegatronModule):
        """Three linear layers and a norm; the middle one without bias."""

        def __init__(self, config):
            super().__init__(config)
            self.inp = torch.nn.Linear(shape.hidden, shape.ffn)
            self.mid = torch.nn.Linear(shape.ffn, shape.ffn, bias=False)
            self.out = torch.nn.Linear(shape.ffn, shape.hidden)
            self.norm = torch.nn.LayerNorm(shape.hidden)

        def forward(self, x):  # pylint: disable=missing-function-docstring
            hidden = torch.tanh(self.mid(torch.nn.functional.gelu(self.inp(x))))
            return self.norm(self.out(hidden) + x)

    return ResumeProbe


def _torch_dtype(case):
    return torch.bfloat16 if case.dtype == "bf16" else torch.float32


def inner_settings(case, optimizer):
    """The inner optimizers' class and precision settings; raises where ``case`` asked for
    something else, so that no figure is recorded for an optimizer the case does not name."""
    wanted = case.kind.inner_settings()
    settings = {}
    for dist in distributed_optimizers(optimizer):
        inner = dist.optimizer
        name = f"{type(inner).__module__}.{type(inner).__name__}"
        if case.kind.te and not name.startswith("transformer_engine."):
            raise RuntimeError(f"{case.name} asked for TE FusedAdam, megatron-core built {name}")
        found = {key: getattr(inner, key, None) for key in wanted}
        wrong = {key: value for key, value in found.items() if value != wanted[key]}
        if wrong:
            raise RuntimeError(f"{case.name}: {name} has {wrong}, expected {wanted}")
        settings[name] = {key: str(value) for key, value in found.items()}
    return settings


def build(case, seed, shape=Shape()):
    """DDP-wrapped probe model of ``shape`` and the optimizer Megatron builds for ``case``."""
    from megatron.core.transformer import TransformerConfig

    problem = te_unavailable(case)
    if problem:
        raise RuntimeError(f"{case.name} not run: {problem}")
    bf16, dtype = case.dtype == "bf16", _torch_dtype(case)
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=1, hidden_size=shape.hidden, num_attention_heads=1, bf16=bf16, params_dtype=dtype
    )
    module = _probe_class(shape)(config).cuda().to(dtype)
    model, optimizer = wrap_for_training(
        config, module, case, shape.bucket_size, lr=1e-3, clip_grad=1.0
    )
    return model, optimizer


def wrap_for_training(config, module, case, bucket_size, lr, clip_grad):
    """``module`` in megatron-core's DDP with the distributed optimizer, and the optimizer
    ``get_megatron_optimizer`` builds for ``case`` (its Megatron-LM flags): ``(model,
    optimizer)``."""
    # pylint: disable=import-outside-toplevel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    bf16 = case.dtype == "bf16"
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=bf16, bucket_size=bucket_size
    )
    model = DistributedDataParallel(config, ddp_config, module)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=lr,
            weight_decay=0.01,
            bf16=bf16,
            params_dtype=_torch_dtype(case),
            use_distributed_optimizer=True,
            clip_grad=clip_grad,
            **optimizer_options(case),
        ),
        [model],
    )
    return model, optimizer


def distributed_optimizers(optimizer):
    """The DistributedOptimizers behind Megatron's (possibly chained) optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def train(model, optimizer, case, stream, steps, rank, shape=Shape()):
    """``steps`` optimizer steps on data fixed by (stream, step, rank)."""
    dtype = _torch_dtype(case)
    for step in range(steps):
        generator = torch.Generator(device="cuda")
        generator.manual_seed(1_000_003 * stream + 1_009 * step + rank)
        size = (BATCH, shape.hidden)
        inputs = torch.randn(size, generator=generator, device="cuda", dtype=dtype)
        target = torch.randn(size, generator=generator, device="cuda", dtype=dtype)
        train_step(model, optimizer, inputs, target)


def train_step(model, optimizer, inputs, target):
    """One step of Megatron's loop: gradients through DDP's buffers, then the optimizer."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = (model(inputs).float() - target.float()).pow(2).mean()
    loss.backward()
    model.finish_grad_sync()
    optimizer.step()


def save_checkpoint(case, model, optimizer, folder, rank):
    """Write ``case.fmt`` into ``folder`` the way Megatron-LM's checkpointing does."""
    if case.fmt == "legacy":
        optimizer.save_parameter_state(str(folder / "param_state.pt"))
        common = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        if rank.rank == 0:
            torch.save(common, folder / "common.pt")
        return
    from megatron.core import dist_checkpointing

    model_sd = model.sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": case.fmt}
    state = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, metadata=metadata),
    }
    target = folder / "dist"
    if rank.rank == 0:
        target.mkdir()
    rank.barrier()
    dist_checkpointing.save(state, str(target))


def needs_priming(case, implementation, optimizer, policy):
    """Whether ``optimizer`` gets state before the load (``--prime``: auto, never, always)."""
    if policy != "auto":
        return policy == "always"
    # Upstream 0.19.2 without TE/Apex reads a 'step' from every state entry while describing
    # itself for a dist-checkpoint load, so it cannot describe an optimizer that never stepped.
    # The fork is never primed: loading into a fresh optimizer is part of what is tested.
    # With TE or Apex FusedAdam upstream allocates the state inside its own is_loading pass, so
    # priming it would only hide that allocation from the load's peak.
    if implementation != "upstream" or case.fmt == "legacy":
        return False
    return any(
        not dist.optimizer.state and not _is_fused_adam(dist.optimizer)
        for dist in distributed_optimizers(optimizer)
    )


def _is_fused_adam(inner):
    return type(inner).__module__.startswith(("transformer_engine.", "apex."))


def prime(optimizer):
    """Materialise optimizer state with upstream's own helpers (values are overwritten)."""
    for dist in distributed_optimizers(optimizer):
        if dist.optimizer.state:
            continue
        if hasattr(dist.optimizer, "dummy_step"):
            dist.optimizer.dummy_step()
        else:
            dist._init_optimizer_states_with_dummy_values()  # pylint: disable=protected-access


def load_checkpoint(case, model, optimizer, folder, peaks):
    """Read ``case.fmt`` from ``folder`` into a fresh model and optimizer, each phase measured
    by ``peaks`` (:class:`PhasePeaks`)."""
    if case.fmt == "legacy":
        with peaks.phase("state_dict"):
            common = torch.load(folder / "common.pt", map_location="cpu", weights_only=False)
            model.load_state_dict(common["model"])
            optimizer.load_state_dict(common["optimizer"])
        with peaks.phase("param_state"):
            optimizer.load_parameter_state(str(folder / "param_state.pt"))
        return
    from megatron.core import dist_checkpointing

    model_sd = model.sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": case.fmt}
    # The first load pass: describing the optimizer for the load builds its state scaffold.
    with peaks.phase("is_loading"):
        state = {
            "model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata),
        }
    with peaks.phase("read"):
        loaded = dist_checkpointing.load(state, str(folder / "dist"))
    with peaks.phase("load_state_dict"):
        # The sharded keys carry the DDP wrapper's "module." prefix; its load_state_dict not.
        model.load_state_dict({k.removeprefix("module."): v for k, v in loaded["model"].items()})
        optimizer.load_state_dict(loaded["optimizer"])


def release():
    """Free what the last case left: unreachable objects, then the GPU allocator's cache."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
