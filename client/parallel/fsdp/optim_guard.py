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
from collections.abc import Callable
from typing import Any

_sharded: dict[int, tuple[weakref.ref[Any], str]] = {}  # id(tensor) -> (the tensor, its name in the module)
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
        _sharded[id(tensor)] = (weakref.ref(tensor, _forget(id(tensor))), name)


def _forget(key: int) -> Callable[[weakref.ref[Any]], None]:
    def forget(_ref: weakref.ref[Any]) -> None:
        _sharded.pop(key, None)

    return forget


def _check(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _checked.get(optimizer) == count:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _sharded.get(id(p))
            if entry is not None and entry[0]() is p:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds the module's parameter {entry[1]!r}, which pp.FSDP "
                    "shards: its gradient goes to the shard, so this step would change nothing. Build the "
                    "optimizer after wrapping, from the wrapper's parameters: "
                    f"torch.optim.{type(optimizer).__name__}(fsdp.parameters(), ...)"
                )
    _checked[optimizer] = count
