"""``pp.ShardedGradScaler``: torch's ``GradScaler`` for parameters that differ across a group's ranks.

float16 training scales the loss and skips an optimizer step whose gradients hold an inf or NaN. Under
``pp.DDP`` every rank holds the same averaged gradients, so torch's own ``torch.amp.GradScaler`` decides alike
everywhere. Under ``pp.FSDP`` (or a pipeline's stages, or tensor-parallel shards) each rank steps its own
piece: an overflow lands in the one shard that holds it, so with torch's scaler that rank skips its step and
halves its scale while the others step, and the ranks' parameters part silently. As torch's
``ShardedGradScaler`` (FSDP1) does over a torch process group, this one all-reduces (max) the inf/NaN flag
over ``process_group`` as it unscales, so every rank skips the same steps and keeps the same scale::

    scaler = pp.ShardedGradScaler("cpu", process_group=world.group)  # or fsdp.group, a subgroup
    with torch.autocast("cpu", dtype=torch.float16):
        loss = fsdp(**batch).loss
    scaler.scale(loss).backward()
    scaler.unscale_(opt)        # optional: before fsdp.clip_grad_norm_
    fsdp.clip_grad_norm_(1.0)
    scaler.step(opt)
    scaler.update()

``process_group`` is taken as by ``pp.FSDP``: a ``ProcessGroup`` or a torch group of paramplane's
torch.distributed backend; left out, torch's default group once ``pp.init_torch_distributed(world)`` made it (as
torch's ``ShardedGradScaler`` defaults to ``dist.group.WORLD``), else a ValueError.

Every rank of the group must unscale each optimizer (``unscale_`` or ``step``) the same number of times in
the same order (a collective each). torch is imported when the class is first used.
"""

from __future__ import annotations

import functools
from typing import Any

from paramplane.group import ProcessGroup
from paramplane.parallel.torch_params import torch_stream, wrapper_group

__all__ = ["ShardedGradScaler"]  # noqa: F822 (the module __getattr__)


@functools.cache
def _scaler_class() -> type:
    import torch

    class ShardedGradScaler(torch.amp.GradScaler):
        """``torch.amp.GradScaler`` whose inf/NaN check covers ``process_group`` (module docstring); the other
        arguments are torch's."""

        def __init__(
            self,
            device: str = "cuda",
            init_scale: float = 2.0**16,
            growth_factor: float = 2.0,
            backoff_factor: float = 0.5,
            growth_interval: int = 2000,
            enabled: bool = True,
            *,
            process_group: Any = None,
        ) -> None:
            group = wrapper_group("ShardedGradScaler", None, process_group)
            super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
            self.process_group: ProcessGroup = group

        def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
            super().unscale_(optimizer)
            if not self.is_enabled():
                return
            for found_inf in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
                with torch_stream(found_inf):
                    self.process_group.all_reduce(found_inf, "max")

    return ShardedGradScaler


def __getattr__(name: str) -> Any:
    if name == "ShardedGradScaler":
        return _scaler_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
