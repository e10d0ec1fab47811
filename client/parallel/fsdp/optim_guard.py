"""A torch optimizer that holds a module parameter which ``pp.FSDP`` shards refuses to step.

Under ``pp.FSDP`` the module's own parameters are views of the gathered buffers (placeholders while sharded);
their gradients go to the shards, which ``fsdp.parameters()`` are. An optimizer built from the module's
parameters (before wrapping, as a DDP script does, or after it through ``fsdp.module.parameters()`` or a model
method such as nanoGPT's ``configure_optimizers``, as an FSDP2 script does) never sees a gradient: every
``step()`` would silently change nothing. One process-wide optimizer step pre-hook (torch's
``register_optimizer_step_pre_hook``) raises instead, naming the parameter; each optimizer's parameters are
checked once (again when its param groups grow), so a step costs a count of its parameters.
"""

from __future__ import annotations

import weakref
from typing import Any

from paramplane.parallel.torch_params import TensorMap

_sharded = TensorMap()  # a module parameter pp.FSDP shards -> its name in the module
_checked: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # optimizer -> parameters seen
_installed = False


def guard(named: list[tuple[str, Any]]) -> None:
    """Refuse, from now on, any torch optimizer step over one of these module parameters (``(name, tensor)``)."""
    global _installed
    if not _installed:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_check)
        _installed = True
    for name, tensor in named:
        _sharded[tensor] = name


def _check(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _checked.get(optimizer) == count:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = _sharded.get(p)
            if name is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds the module's parameter {name!r}, which pp.FSDP "
                    "shards: its gradient goes to the shard, so this step would change nothing. Build the "
                    "optimizer after wrapping, from the wrapper's parameters: "
                    f"torch.optim.{type(optimizer).__name__}(fsdp.parameters(), ...)"
                )
    _checked[optimizer] = count
