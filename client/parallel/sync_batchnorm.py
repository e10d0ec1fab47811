"""``pp.SyncBatchNorm``: BatchNorm whose training statistics cover the whole group's batch, as torch's
``torch.nn.SyncBatchNorm`` (which needs a torch process group) does over a paramplane group.

Usage (torchvision's reference scripts' ``--sync-bn``)::

    model = pp.convert_sync_batchnorm(model, world.group)   # every BatchNorm1d/2d/3d, before wrapping
    ddp = pp.DDP(model, world.group)

In training mode each layer's forward all-gathers every rank's per-channel mean and sum of squared
deviations and its count (one collective of ``2C + 1`` float64 values; computed in float32 at least) and combines
them exactly (Chan's parallel variance), so the normalisation and the running statistics (unbiased variance, torch's momentum rule) are
those of one process on the concatenated batch; the backward all-reduces the per-channel sums of the
output gradient and of its product with the centred input (one collective of ``2C``), which gives each
rank the input gradient of the sum of every rank's loss, as torch's ``SyncBatchNorm`` does. The weight and
bias gradients stay local: DDP (or FSDP) averages them with the others. In eval mode, or with a group of
one, it is a plain BatchNorm. Every rank must run each layer the same number of times in the same order
(the collectives pair up by order), as with torch's.

torch is imported when the class is first used (``pp.SyncBatchNorm``) or a model is converted.
"""

from __future__ import annotations

import functools
from typing import Any

from paramplane.group import ProcessGroup
from paramplane.parallel.torch_params import torch_stream

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]  # noqa: F822 (SyncBatchNorm: the module __getattr__)


def _stats_dims(x: Any) -> list[int]:
    if x.dim() < 2:
        raise ValueError(
            f"SyncBatchNorm expects an input of at least 2 dimensions (N, C, ...), got {x.dim()}"
        )
    return [0, *range(2, x.dim())]


def _combine(gathered: Any, channels: int) -> tuple[Any, Any, Any]:
    """Every rank's (mean, M2, count) rows → the group's mean, biased variance and count (Chan et al.),
    as tensors where ``gathered`` is (on its device: no host round trip on CUDA)."""
    rows = gathered.reshape(-1, 2 * channels + 1)
    means, m2s, counts = rows[:, :channels], rows[:, channels:-1], rows[:, -1:]
    total = counts.sum()
    mean = (counts * means).sum(0) / total
    m2 = m2s.sum(0) + (counts * (means - mean) ** 2).sum(0)
    return mean, m2 / total, total


@functools.cache
def _sync_bn_class() -> type:
    import torch

    class _SyncBatchNormFn(torch.autograd.Function):
        @staticmethod
        def forward(
            ctx: Any,
            x: Any,
            weight: Any,
            bias: Any,
            running_mean: Any,
            running_var: Any,
            eps: float,
            momentum: float,
            group: ProcessGroup,
        ) -> Any:
            dims, channels = _stats_dims(x), x.shape[1]
            if x.numel() == 0:
                raise ValueError("SyncBatchNorm: an empty batch (every rank needs samples)")
            # statistics in float32 at least (float64 for float64 inputs), combined in float64
            cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
            shape = (1, -1, *[1] * (x.dim() - 2))
            xc = x.detach().to(cdt)
            local_mean = xc.mean(dims)
            local_m2 = ((xc - local_mean.view(shape)) ** 2).sum(dims)
            count = torch.full((1,), float(x.numel() // channels), dtype=torch.float64, device=x.device)
            row = torch.cat([local_mean.double(), local_m2.double(), count])
            with torch_stream(x):
                gathered = group.all_gather(row)
            mean, var, total = _combine(gathered, channels)
            invstd = torch.rsqrt(var + eps)
            if running_mean is not None:
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            if running_var is not None:
                unbiased = var * total / (total - 1).clamp(min=1)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
            xhat = (xc - mean.to(cdt).view(shape)) * invstd.to(cdt).view(shape)
            y = xhat if weight is None else xhat * weight.to(cdt).view(shape) + bias.to(cdt).view(shape)
            ctx.save_for_backward(xhat, weight, invstd.to(cdt))
            ctx.group, ctx.total, ctx.dims, ctx.shape = group, total, dims, shape
            return y.to(x.dtype)

        @staticmethod
        def backward(ctx: Any, dy: Any) -> Any:
            xhat, weight, invstd = ctx.saved_tensors
            dims, shape, channels = ctx.dims, ctx.shape, xhat.shape[1]
            dyc = dy.to(xhat.dtype)
            grad_weight = grad_bias = None
            if weight is not None:
                grad_weight = (dyc * xhat).sum(dims).to(weight.dtype)
                grad_bias = dyc.sum(dims).to(weight.dtype)
                dyc = dyc * weight.detach().to(xhat.dtype).view(shape)
            sums = torch.cat([dyc.sum(dims), (dyc * xhat).sum(dims)]).double()
            with torch_stream(dy):
                ctx.group.all_reduce(sums, "sum")
            means = (sums / ctx.total).to(xhat.dtype)
            dx = (dyc - means[:channels].view(shape) - xhat * means[channels:].view(shape)) * invstd.view(
                shape
            )
            return dx.to(dy.dtype), grad_weight, grad_bias, None, None, None, None, None

    class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
        """``torch.nn.SyncBatchNorm`` over a paramplane group (module docstring): ``num_features`` channels of
        an ``(N, C, ...)`` input; the other arguments are BatchNorm's."""

        def __init__(
            self,
            num_features: int,
            group: ProcessGroup,
            eps: float = 1e-5,
            momentum: float | None = 0.1,
            affine: bool = True,
            track_running_stats: bool = True,
            device: Any = None,
            dtype: Any = None,
        ) -> None:
            if not isinstance(group, ProcessGroup):
                raise ValueError(f"SyncBatchNorm needs a ProcessGroup, got {type(group).__name__}")
            super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
            self.group = group

        def _check_input_dim(self, x: Any) -> None:
            _stats_dims(x)

        def forward(self, x: Any) -> Any:
            self._check_input_dim(x)
            if x.shape[1] != self.num_features:
                raise ValueError(f"SyncBatchNorm({self.num_features}) got {x.shape[1]} channels")
            factor = 0.0 if self.momentum is None else self.momentum
            if self.training and self.track_running_stats and self.num_batches_tracked is not None:
                self.num_batches_tracked.add_(1)
                if self.momentum is None:  # a cumulative moving average, as torch's
                    factor = 1.0 / float(self.num_batches_tracked)
            batch_stats = self.training or (self.running_mean is None and self.running_var is None)
            tracked = not self.training or self.track_running_stats
            running_mean = self.running_mean if tracked else None
            running_var = self.running_var if tracked else None
            if not (batch_stats and self.training and self.group.size > 1):
                return torch.nn.functional.batch_norm(
                    x, running_mean, running_var, self.weight, self.bias, batch_stats, factor, self.eps
                )
            return _SyncBatchNormFn.apply(
                x, self.weight, self.bias, running_mean, running_var, self.eps, factor, self.group
            )

        @classmethod
        def convert_sync_batchnorm(cls, module: Any, group: ProcessGroup) -> Any:
            """``pp.convert_sync_batchnorm(module, group)`` (torch's classmethod's call shape)."""
            return convert_sync_batchnorm(module, group)

    return SyncBatchNorm


def convert_sync_batchnorm(module: Any, group: ProcessGroup) -> Any:
    """``module`` with every ``BatchNorm1d/2d/3d`` replaced by a ``SyncBatchNorm`` over ``group`` holding the
    same parameters (the same tensors) and buffers, in the same mode; returns the module (a new one when
    ``module`` itself is a BatchNorm), as torch's ``SyncBatchNorm.convert_sync_batchnorm``. Convert before
    wrapping in ``pp.DDP`` / ``pp.FSDP``."""
    import torch

    if not isinstance(group, ProcessGroup):
        raise ValueError(f"convert_sync_batchnorm needs a ProcessGroup, got {type(group).__name__}")
    sync_cls = _sync_bn_class()
    out = module
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(module, sync_cls):
        out = sync_cls(
            module.num_features, group, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        if module.affine:
            with torch.no_grad():
                out.weight = module.weight
                out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, group))
    return out


def __getattr__(name: str) -> Any:
    if name == "SyncBatchNorm":
        return _sync_bn_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
