# Copyright (c) 2026, Megatron optimizer fork contributors. All rights reserved.
"""A process-group double and megatron-core's own parameter buffers, built on the CPU.

Imported as ``buffer_doubles`` (pytest puts this folder on ``sys.path``) or as
``tests.unit_tests.buffer_doubles`` from a checkout whose ``tests/`` is a package.
"""

from types import SimpleNamespace
from unittest import mock

from megatron.core.distributed import param_and_grad_buffer as pgb


class FakeGroup:
    """The ``rank()`` and ``size()`` of a process group, all the range code calls."""

    def __init__(self, rank, size):
        self.rank_value, self.size_value = rank, size

    def rank(self):  # pylint: disable=missing-function-docstring
        return self.rank_value

    def size(self):  # pylint: disable=missing-function-docstring
        return self.size_value


def param_and_grad_buffers(params, names, layout, config, bucket_size, group_of, device="cpu"):
    """One ``_ParamAndGradBuffer`` per buffer key of ``layout``, as megatron-core builds it.

    Its CUDA allocations go to ``device`` and its logging, which needs torch.distributed, is
    silenced; everything the distributed optimizer reads is megatron-core's own.

    Args:
        params: the parameters, in model order.
        names: parameter -> name.
        layout: a ``FullParamLayout`` for ``params``.
        config: the ``DistributedDataParallelConfig``.
        bucket_size: elements per bucket, or None.
        group_of: buffer key -> the (fake) data-parallel group of that buffer.
        device: where the buffers' storage goes.
    """
    buffers = []
    with (
        mock.patch("torch.cuda.current_device", return_value=device),
        mock.patch.object(pgb, "log_on_each_pipeline_stage"),
    ):
        grouped = pgb.group_params_for_buffers(params, config.grad_reduce_in_fp32)
        for key, (key_params, indices) in grouped.items():
            group = group_of(key)
            buffers.append(
                pgb._ParamAndGradBuffer(  # pylint: disable=protected-access
                    config,
                    key.param_dtype,
                    key.grad_dtype,
                    [(param, names[param]) for param in key_params],
                    group,
                    bucket_size,
                    names,
                    1.0,
                    indices,
                    False,
                    SimpleNamespace(tp=FakeGroup(0, 1), dp_cp=group),
                    param_layout=layout.layouts[key],
                )
            )
    return buffers
