# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""Inner-optimizer doubles shared by the test files.

Imported as ``optimizer_doubles`` (pytest puts this folder on ``sys.path``) or as
``tests.unit_tests.optimizer_doubles`` from a checkout whose ``tests/`` is a package.
"""

import contextlib
import sys

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = None


_ID_AUDITS = {"installed": False, "listening": False, "count": 0}


def _count_id_audits(event, _args):
    if _ID_AUDITS["listening"] and event == "builtins.id":
        _ID_AUDITS["count"] += 1


@contextlib.contextmanager
def counting_id_audits():
    """Count the calls of ``id`` inside the block: yields a dict whose ``count`` holds them.

    Each ``id`` raises an audit event, and where an audit hook is installed (filelock, which
    torch and megatron import, installs one) every such event runs that hook in Python. The
    hook installed here stays for the process (hooks cannot be removed) and counts only inside
    such a block. Blocks do not nest: an inner one restarts the count and ends the outer one's.
    """
    if not _ID_AUDITS["installed"]:
        sys.addaudithook(_count_id_audits)
        _ID_AUDITS["installed"] = True
    _ID_AUDITS.update(listening=True, count=0)
    try:
        yield _ID_AUDITS
    finally:
        _ID_AUDITS["listening"] = False


def te_fused_adam():
    """Transformer Engine's FusedAdam class, or None where TE does not import."""
    try:
        from transformer_engine.pytorch.optimizers import (  # pylint: disable=import-outside-toplevel
            FusedAdam,
        )
    except ImportError:
        return None
    return FusedAdam


class GroupStepAdamW(torch.optim.Optimizer):
    """Test double for TE/Apex FusedAdam's bookkeeping: AdamW that counts its step in
    ``param_group["step"]`` (once per group and step) instead of in the per-parameter state.
    A lost group step restarts bias correction, which changes the very next update."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):  # pylint: disable=unused-argument
        for group in self.param_groups:
            live = [p for p in group["params"] if p.grad is not None]
            if not live:
                continue
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            correction1 = 1 - beta1 ** group["step"]
            correction2 = 1 - beta2 ** group["step"]
            for param in live:
                state = self.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                state["exp_avg"].lerp_(param.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
                param.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (state["exp_avg_sq"] / correction2).sqrt_().add_(group["eps"])
                param.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / correction1)


def _int_wrap(values, bits):
    """Reinterprets non-negative int64 values as signed integers of ``bits`` bits."""
    return torch.where(values >= 2 ** (bits - 1), values - 2**bits, values)


def join_remainders(param, remainders):
    """Rebuilds fp32 master values from bf16 parameters and their int16 low halves."""
    high = (param.detach().view(torch.int16).to(torch.int64) & 0xFFFF) << 16
    low = remainders.to(torch.int64) & 0xFFFF
    return _int_wrap(high | low, 32).to(torch.int32).view(torch.float32)


def split_remainders(master):
    """Splits fp32 master values into bf16 high halves and int16 low halves (exact round trip)."""
    bits = master.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    high = _int_wrap(bits >> 16, 16).to(torch.int16).view(torch.bfloat16)
    low = _int_wrap(bits & 0xFFFF, 16).to(torch.int16)
    return high, low


class FusedAdamDouble(torch.optim.Optimizer):
    """A CPU stand-in for Transformer Engine FusedAdam's state-loading contract.

    It mirrors what the loader under test relies on, not TE's kernels:

    * constructor flags ``master_weights``, ``master_weight_dtype``, ``exp_avg_dtype``,
      ``exp_avg_sq_dtype``, ``store_param_remainders`` (kept only for fp32 master weights) and
      ``capturable``; ``name_to_dtype_map``, ``dtype_to_range_map`` and ``_scales`` (one fp32
      ``[1]`` scale per non-fp32 state of a parameter);
    * ``_initialize_state`` allocates one tensor shaped like the parameter in the mapped dtype
      (int16 zeros for remainders) and a fresh scale for non-fp32 dtypes;
    * ``set_scaled_state`` takes an fp32 value (int16 for remainders), allocates the state if
      it is absent, then copies: a plain copy for fp32, a cast for bf16, and for fp16 (and
      uint8, standing in for fp8) a scale of absmax over the dtype's range, with the input
      divided by it in place before the copy;
    * ``state_dict`` returns unscaled values (fp32, or the int16 remainders), the fp32 state
      tensors themselves;
    * ``load_state_dict`` runs torch's base load (which casts to each parameter's dtype), then
      empties each parameter's state and sets every incoming value again through
      ``set_scaled_state``, so each state is allocated anew next to the incoming tensor.

    ``step`` keeps the Adam step in ``param_group["step"]``, creates the state of every
    parameter it visits (with a gradient or not, as TE does) and does a plain AdamW update in
    fp32 (from master weights where kept) of those with a gradient. Not reproduced:
    Float8Tensor (uint8 states are plain uint8 tensors), DTensor re-wrapping of allocated
    state, tensor learning rates of capturable mode, and the fused kernels' arithmetic.
    """

    RANGES = {torch.float16: torch.finfo(torch.float16).max / 2.0, torch.uint8: 448.0}

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        *,
        bias_correction=True,
        capturable=False,
        master_weights=False,
        master_weight_dtype=torch.float32,
        exp_avg_dtype=torch.float32,
        exp_avg_sq_dtype=torch.float32,
        store_param_remainders=False,
    ):
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction
        )
        super().__init__(params, defaults)
        self.capturable = capturable
        self.master_weights = master_weights
        self.name_to_dtype_map = {
            "exp_avg": exp_avg_dtype,
            "exp_avg_sq": exp_avg_sq_dtype,
            "master_param": master_weight_dtype,
        }
        self._scales = {}
        self.dtype_to_range_map = {
            dtype: torch.full([1], limit, dtype=torch.float32)
            for dtype, limit in self.RANGES.items()
        }
        self.store_param_remainders = (
            store_param_remainders and master_weights and master_weight_dtype == torch.float32
        )

    def _keeps_remainders(self, param, name):
        """Whether state ``name`` of ``param`` holds int16 remainders."""
        return (
            self.store_param_remainders and name == "master_param" and param.dtype == torch.bfloat16
        )

    def _initialize_state(self, param, state_name, zero_buffer, store_param_remainders=False):
        """Allocates one state tensor for ``param`` (and its scale when not fp32)."""
        dtype = self.name_to_dtype_map[state_name]
        if store_param_remainders:
            data = torch.zeros(param.shape, dtype=torch.int16, device=param.device)
        else:
            data = torch.empty(param.shape, dtype=dtype, device=param.device)
            if zero_buffer:
                data.zero_()
        self.state[param][state_name] = data
        if dtype != torch.float32:
            self._scales.setdefault(param, {})[state_name] = torch.ones(
                [1], dtype=torch.float32, device=param.device
            )

    def initialize_state(self, param, store_param_remainders):
        """Creates zero moments and, with master weights, the master copy of ``param``."""
        self._initialize_state(param, "exp_avg", True)
        self._initialize_state(param, "exp_avg_sq", True)
        if self.master_weights:
            self._initialize_state(param, "master_param", False, store_param_remainders)
            if not store_param_remainders:
                self.set_scaled_state(param, "master_param", param.detach().float().clone())

    def set_scaled_state(self, param, state_name, unscaled_state):
        """Writes an unscaled value into the state, allocating it first if it is absent."""
        remainders = self._keeps_remainders(param, state_name)
        expected = torch.int16 if remainders else torch.float32
        assert unscaled_state.dtype == expected, (state_name, unscaled_state.dtype)
        if state_name not in self.state[param]:
            self._initialize_state(param, state_name, False, remainders)
        target = self.state[param][state_name]
        dtype = self.name_to_dtype_map[state_name]
        if dtype in (torch.float32, torch.bfloat16) or remainders:
            target.copy_(unscaled_state)
            return
        scale = self._scales[param][state_name]
        absmax = unscaled_state.abs().max().to(torch.float32)
        scale.copy_(absmax / self.RANGES[dtype])
        inverse = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
        unscaled_state.mul_(inverse)
        target.copy_(unscaled_state)

    def get_unscaled_state(self, param, state_name):
        """Returns the state as fp32 values (int16 remainders and fp32 states as they are)."""
        value = self.state[param][state_name]
        dtype = self.name_to_dtype_map[state_name]
        if dtype == torch.float32:
            return value
        if dtype == torch.float16:
            return value.float() * self._scales[param][state_name]
        return value.float()

    def state_dict(self):
        """Torch's state dict with every state replaced by its unscaled value."""
        result = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        ids = [i for group in result["param_groups"] for i in group["params"]]
        by_id = dict(zip(ids, params))
        for key, entry in result["state"].items():
            param = by_id[key]
            result["state"][key] = {name: self.get_unscaled_state(param, name) for name in entry}
        return result

    def load_state_dict(self, state_dict):
        """Torch's base load, then every state set again (and so allocated again)."""
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        by_id = dict(zip(ids, params))
        for key, entry in state_dict["state"].items():
            if key not in by_id:
                continue
            param = by_id[key]
            self.state[param] = {}
            for name, value in entry.items():
                if value is None:
                    continue
                if DTensor is not None and isinstance(value, DTensor):
                    value = value.to_local()
                if self._keeps_remainders(param, name):
                    self.set_scaled_state(param, name, value)
                else:
                    self.set_scaled_state(param, name, value.float())

    @torch.no_grad()
    def step(self, closure=None):  # pylint: disable=unused-argument
        """One AdamW step in fp32; the step count lives in each param group."""
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            count = group["step"]
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            fix1 = 1.0 - beta1 ** count if group["bias_correction"] else 1.0
            fix2 = 1.0 - beta2 ** count if group["bias_correction"] else 1.0
            for param in group["params"]:
                state = self.state[param]
                remainders = self._keeps_remainders(param, "master_param")
                if not state:
                    self.initialize_state(param, remainders)
                if param.grad is None:
                    continue
                grad = param.grad.float()
                exp_avg = self.get_unscaled_state(param, "exp_avg")
                exp_avg_sq = self.get_unscaled_state(param, "exp_avg_sq")
                if not self.master_weights:
                    master = param.data if param.dtype == torch.float32 else param.float()
                elif remainders:
                    master = join_remainders(param, state["master_param"])
                else:
                    master = self.get_unscaled_state(param, "master_param")
                exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                master.mul_(1.0 - lr * decay)
                denom = (exp_avg_sq / fix2).sqrt_().add_(eps)
                master.addcdiv_(exp_avg, denom, value=-lr / fix1)
                for name, value in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
                    if self.name_to_dtype_map[name] != torch.float32:
                        self.set_scaled_state(param, name, value)
                if remainders:
                    high, low = split_remainders(master)
                    param.copy_(high)
                    state["master_param"].copy_(low)
                    continue
                if self.master_weights and self.name_to_dtype_map["master_param"] != torch.float32:
                    self.set_scaled_state(param, "master_param", master.clone())
                if master is not param.data:
                    param.copy_(master)
