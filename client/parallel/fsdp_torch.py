"""``pp.FSDP`` over a ``torch.nn.Module`` (CPU tensors): the same flat units, driven by torch's hooks.

Each trainable torch parameter is seen through a ``TorchFlatParam``: the flat buffers are numpy arrays
and a parameter's tensor is re-pointed, zero-copy, at its piece of the gathered buffer (or at a one-element
zero-stride placeholder of its shape while sharded). The hooks do what ``FSDP``'s wrapped
``forward``/``backward`` do for paramplane modules:

- a unit's forward pre-hook gathers it and prefetches the next unit; its forward hook reshards it
  (full_shard, hybrid_shard) and hooks its outputs' gradients, which gather it again just before its
  backward (and prefetch the previous unit: ``backward_prefetch="pre"``);
- each parameter's post-accumulate-grad hook counts the unit's gradients: when the last one has landed,
  every use of the unit's parameters is done, so its flat gradient is reduce-scattered at once,
  overlapping the rest of ``loss.backward()`` (a unit some of whose parameters got no gradient is
  reduced by ``finish_gradient_sync``).

A unit is gathered when its module is *called*: a forward that reads a unit's parameters without calling
its module would compute with placeholders, so it is refused after the fact (as torch's FSDP requires).
The shards are torch Parameters over the numpy shards (``fsdp.parameters()``): a ``torch.optim``
optimizer steps them in place; ``attach`` it, or call ``finish_gradient_sync()`` before ``step()``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from paramplane.nn.module import Parameter, RemovableHandle
from paramplane.parallel.fsdp import FSDP
from paramplane.parallel.fsdp_units import FlatUnit
from paramplane.parallel.torch_params import TorchFlatParam, TorchParam, to_numpy, to_torch, torch_buffers

__all__ = ["TorchFSDP"]


def _tensors(value: Any) -> list[Any]:
    """The tensors in a module's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return [value] if hasattr(value, "register_hook") else []


def _torch_dtype(dtype: Any) -> Any:
    return to_torch(np.zeros(0, dtype)).dtype


class TorchFSDP(FSDP):
    """``pp.FSDP(torch_module, group, ...)``: see the module docstring; the arguments are FSDP's.

    ``cpu_offload`` changes nothing (the tensors are in host memory already); ``mixed_precision`` gathers
    and computes in ``param_dtype`` (the forward's floating-point inputs are cast to it) and reduces in
    ``reduce_dtype``, with float32 (or float64) master shards.
    """

    # -- construction ------------------------------------------------------------------------------
    def _trainable(self, module: Any) -> list[tuple[str, Parameter]]:
        self._by_tensor: dict[int, TorchFlatParam] = {}
        named: list[tuple[str, Parameter]] = []
        for name, tensor in module.named_parameters():
            if tensor.requires_grad:
                p = TorchFlatParam(name, tensor)
                self._by_tensor[id(tensor)] = p
                named.append((name, cast(Parameter, p)))
        return named

    def _children(self, module: Any) -> list[tuple[str, Any]]:
        import torch

        children = [(n, m) for n, m in module.named_children() if any(True for _ in m.parameters())]
        sequence = isinstance(module, (torch.nn.Sequential, torch.nn.ModuleList))
        return children if sequence or len(children) > 1 else []

    def _members(self, module: Any) -> list[Parameter]:
        return [
            cast(Parameter, self._by_tensor[id(t)]) for t in module.parameters() if id(t) in self._by_tensor
        ]

    def _build_units(self, module: Any, named: Any, units: Any, sync: bool) -> list[FlatUnit]:
        import torch

        built = super()._build_units(module, named, units, sync)
        for unit in built:
            shard = TorchParam(unit.shard.name, torch.nn.Parameter(to_torch(unit.shard.data)))
            shard.layout = unit.shard.layout  # type: ignore[attr-defined]
            unit.shard = cast(Parameter, shard)
            for p in unit.params:
                cast(TorchParam, p).tensor.register_post_accumulate_grad_hook(self._grad_hook(unit))
        return built

    def _wrap(self, unit: FlatUnit) -> None:
        m = cast(Any, unit.module)

        def before(_m: Any, _args: Any) -> None:
            self._enter_unit(unit)
            unit.extra["forward_start"] = time.monotonic()

        def after(_m: Any, _args: Any, output: Any) -> None:
            self._mark(f"forward {unit.name}", unit.extra.pop("forward_start"))
            unit.forward_done = True
            if self.reshard_after_forward:
                self._release(unit)
            unit.extra["pre_backward"] = False
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda _g: self._pre_backward(unit))

        m.register_forward_pre_hook(before)
        m.register_forward_hook(after)

    # -- forward / backward ------------------------------------------------------------------------
    def _pre_backward(self, unit: FlatUnit) -> None:
        if unit.extra.get("pre_backward"):
            return
        unit.extra["pre_backward"] = True
        unit.extra["backward_start"] = time.monotonic()
        self._ensure_gathered(unit)
        if self.backward_prefetch == "pre":
            self._prefetch(self._prev_in_forward(unit))

    def _grad_hook(self, unit: FlatUnit) -> Callable[[Any], None]:
        def ready(_tensor: Any) -> None:
            count = unit.extra.get("ready", 0) + 1
            if count < len(unit.params):
                unit.extra["ready"] = count
                return
            unit.extra["ready"] = 0
            if "backward_start" in unit.extra:
                self._mark(f"backward {unit.name}", unit.extra.pop("backward_start"))
            self._post_backward(unit)
            if self.backward_prefetch == "post" and unit.module is not None:
                self._prefetch(self._prev_in_forward(unit))

        return ready

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the torch module; each unit is gathered when its module is called (and prefetched)."""
        import torch

        for u in self.units:
            u.forward_done = False
            u.extra["ready"] = 0
        self._begin_forward()
        if self.param_dtype != self.master_dtype:
            compute = _torch_dtype(self.param_dtype)
            args = tuple(a.to(compute) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
        y = self.module(*args, **kwargs)
        missed = [u.name for u in self._wrapped if not u.forward_done]
        if missed:
            raise RuntimeError(
                f"FSDP: the forward did not call the module of unit(s) {missed}; a unit is gathered when its "
                "module is called, so its parameters held placeholders. Call those modules, or pass units= "
                "naming the modules the forward calls"
            )
        self._forward_open = torch.is_grad_enabled()
        if self.output_dtype is not None and torch.is_tensor(y) and y.is_floating_point():
            y = y.to(_torch_dtype(self.output_dtype))
        return y

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def backward(self, grad_out: Any) -> Any:
        raise RuntimeError(
            "FSDP over a torch module runs torch's backward: call loss.backward() (each unit's gradient "
            "reduction starts from its parameters' gradient hooks)"
        )

    # -- optimizer ---------------------------------------------------------------------------------
    def parameters(self) -> list[Any]:
        """This rank's flat shards as torch Parameters (hand them to a torch optimizer)."""
        return [cast(TorchParam, u.shard).tensor for u in self.units]

    def named_parameters(self) -> list[tuple[str, Any]]:
        return [(u.shard.name, cast(TorchParam, u.shard).tensor) for u in self.units]

    def attach(self, optimizer: Any) -> RemovableHandle:
        """Make the torch optimizer's ``step()`` call :meth:`finish_gradient_sync` first."""
        import torch

        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"FSDP over a torch module attaches a torch.optim optimizer, got {type(optimizer).__name__}"
            )
        self._torch_optimizer = optimizer
        optimizer.register_step_post_hook(lambda *_: self.memory.update())
        return cast(RemovableHandle, optimizer.register_step_pre_hook(lambda *_: self.finish_gradient_sync()))

    def _optim_bytes(self) -> int:
        opt = getattr(self, "_torch_optimizer", None)
        if opt is None:
            return 0
        return sum(
            int(v.nbytes)
            for p in self.parameters()
            for v in opt.state.get(p, {}).values()
            if hasattr(v, "nbytes") and v.dim() > 0
        )

    def _buffers(self) -> list[tuple[str, Any]]:
        return torch_buffers(self.module)

    def _frozen(self) -> list[tuple[str, Any]]:
        return [
            (n, to_numpy(t, f"parameter {n!r}"))
            for n, t in self.module.named_parameters()
            if not t.requires_grad
        ]
