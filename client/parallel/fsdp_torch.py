"""``pp.FSDP`` over a ``torch.nn.Module`` (CPU or CUDA tensors): the same flat units, driven by torch's hooks.

Each trainable torch parameter is seen through a ``TorchFlatParam``: the flat buffers are numpy arrays
(cupy arrays for a CUDA module, whose collectives the hooks enqueue on torch's current stream) and a parameter's tensor is re-pointed, zero-copy, at its piece of the gathered buffer, or, while sharded,
at a zero-stride placeholder of NaNs of its shape: a computation that reads a sharded parameter yields NaN,
never plausible values, and a forward that did not call some unit's module raises naming the unit.

Units (``units=``): by default every element of the outermost ``nn.ModuleList``s (a transformer's blocks,
as torchtitan applies ``fully_shard`` per block), the root unit keeping the rest (embeddings, final norm,
a tied head); a model without a ModuleList gets one unit per child with parameters of an ``nn.Sequential``
(or of a module with several). ``pp.units_by_class(Block)`` makes every module of those classes a unit
(torch's ``ModuleWrapPolicy``); units may nest (the inner unit owns its parameters, the outer the rest).
A parameter is owned by the innermost unit around the modules that register it; one registered by modules
of several units (tied weights: ``lm_head.weight is wte.weight``) is owned by the root unit, which is
gathered for the whole forward and backward.

The hooks do what ``FSDP``'s wrapped ``forward``/``backward`` do for paramplane modules:

- a unit's forward pre-hook gathers it and prefetches the next unit; its forward hook reshards it
  (full_shard, hybrid_shard) and hooks its outputs' gradients, which gather it again just before its
  backward (and prefetch the previous unit: ``backward_prefetch="pre"``);
- each parameter's post-accumulate-grad hook counts the unit's gradients: when the last one has landed,
  every use of the unit's parameters is done, so its flat gradient is reduce-scattered at once,
  overlapping the rest of ``loss.backward()``;
- the first of these hooks in a synchronised backward queues ``finish_gradient_sync`` to run when the
  backward ends (as torch's FSDP2 does): when ``loss.backward()`` returns every shard's ``grad`` is reduced
  and set (units some of whose parameters got no gradient included), so ``fsdp.clip_grad_norm_`` can run
  before ``step()``. ``attach(opt)`` is optional.

The shards are torch Parameters over the numpy shards (``fsdp.parameters()``): a ``torch.optim``
optimizer steps them in place. ``state_dict()`` has ``module.state_dict()``'s keys (tied aliases,
persistent buffers and frozen parameters included) with CPU tensors as values.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from paramplane.nn.module import Parameter, RemovableHandle
from paramplane.parallel.fsdp import FSDP
from paramplane.parallel.fsdp_units import FlatUnit, UnitsByClass
from paramplane.parallel.sharding import ShardedArray
from paramplane.parallel.torch_params import (
    TorchFlatParam,
    TorchParam,
    queue_backward_callback,
    to_array,
    to_tensor,
    to_torch,
    torch_buffers,
    torch_stream,
)

__all__ = ["TorchFSDP"]


def _tensors(value: Any) -> list[Any]:
    """The tensors in a module's output (a tensor, tuples, lists, dicts and ``ModelOutput``s of them)."""
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):  # transformers' ModelOutput is an OrderedDict
        return [t for v in value.values() for t in _tensors(v)]
    return [value] if hasattr(value, "register_hook") else []


def _torch_dtype(dtype: Any) -> Any:
    return to_torch(np.zeros(0, dtype)).dtype


def _as_numpy(value: Any, key: str) -> Any:
    """A state-dict value (torch tensor or array) as an array the shards can be filled from."""
    if hasattr(value, "detach") and hasattr(value, "device"):
        return to_array(value.detach().contiguous(), f"state dict value {key!r}")
    return np.asarray(value)


class TorchFSDP(FSDP):
    """``pp.FSDP(torch_module, group, ...)``: see the module docstring; the arguments are FSDP's.

    ``cpu_offload`` changes nothing (the tensors are in host memory already); ``mixed_precision`` gathers
    and computes in ``param_dtype`` (the forward's floating-point inputs are cast to it) and reduces in
    ``reduce_dtype``, with float32 (or float64) master shards.
    """

    _finish_queued = False

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
        """The default units: the elements of the outermost ModuleLists, else the children of a Sequential."""
        import torch

        paths = {id(m): path for path, m in module.named_modules()}
        lists: list[Any] = []

        def find(m: Any) -> None:
            for child in m.children():
                if isinstance(child, torch.nn.ModuleList):
                    lists.append(child)
                else:
                    find(child)

        find(module)
        blocks = [(paths[id(b)], b) for lst in lists for b in lst if any(True for _ in b.parameters())]
        if blocks:
            return blocks
        children = [(n, m) for n, m in module.named_children() if any(True for _ in m.parameters())]
        sequence = isinstance(module, (torch.nn.Sequential, torch.nn.ModuleList))
        return children if sequence or len(children) > 1 else []

    def _unit_groups(
        self, module: Any, named: list[tuple[str, Parameter]], units: Sequence[Any] | UnitsByClass | None
    ) -> list[tuple[str, Any, list[tuple[str, Parameter]]]]:
        """Each parameter goes to the innermost unit around the modules that register it; one registered
        in several units (tied weights) goes to the root unit (module docstring)."""
        chosen = self._chosen(module, units)
        unit_of = {id(m): path for path, m in chosen}
        users: dict[int, set[str]] = {}

        def walk(m: Any, current: str) -> None:
            current = unit_of.get(id(m), current)
            for t in m._parameters.values():
                if t is not None and id(t) in self._by_tensor:
                    users.setdefault(id(t), set()).add(current)
            for child in m.children():
                walk(child, current)

        walk(module, "<root>")
        owner = {
            id(p): (
                next(iter(users[id(cast(Any, p).tensor)]))
                if len(users[id(cast(Any, p).tensor)]) == 1
                else "<root>"
            )
            for _, p in named
        }
        groups: list[tuple[str, Any, list[tuple[str, Parameter]]]] = []
        for path, m in [*chosen, ("<root>", None)]:
            mine = [(n, p) for n, p in named if owner[id(p)] == path]
            if mine:
                groups.append((path, m, mine))
        return groups

    def _build_units(self, module: Any, named: Any, units: Any, sync: bool) -> list[FlatUnit]:
        import torch

        built = super()._build_units(module, named, units, sync)
        for unit in built:
            shard = TorchParam(unit.shard.name, torch.nn.Parameter(to_tensor(unit.shard.data)))
            shard.layout = unit.shard.layout  # type: ignore[attr-defined]
            unit.shard = cast(Parameter, shard)
            for p in unit.params:
                cast(TorchParam, p).tensor.register_post_accumulate_grad_hook(self._grad_hook(unit))
        return built

    def _wrap(self, unit: FlatUnit) -> None:
        m = cast(Any, unit.module)

        def before(_m: Any, _args: Any) -> None:
            with self._stream():
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
    def _queue_finish(self) -> None:
        """From inside a synchronised backward: finish the gradient sync when that backward ends."""
        if self._no_sync or self._finish_queued:
            return
        self._finish_queued = True

        def finish() -> None:
            self._finish_queued = False
            with self._stream():
                self.finish_gradient_sync()

        queue_backward_callback(finish)

    def _pre_backward(self, unit: FlatUnit) -> None:
        self._queue_finish()
        if unit.extra.get("pre_backward"):
            return
        unit.extra["pre_backward"] = True
        unit.extra["backward_start"] = time.monotonic()
        with self._stream():
            self._ensure_gathered(unit)
            if self.backward_prefetch == "pre":
                self._prefetch(self._prev_in_forward(unit))

    def _stream(self) -> contextlib.AbstractContextManager[None]:
        """Collectives issued inside run on torch's current stream (CUDA modules; see torch_params)."""
        return torch_stream(cast(TorchParam, self.units[0].params[0]).tensor)

    def _grad_hook(self, unit: FlatUnit) -> Callable[[Any], None]:
        def ready(_tensor: Any) -> None:
            self._queue_finish()
            count = unit.extra.get("ready", 0) + 1
            if count < len(unit.params):
                unit.extra["ready"] = count
                return
            unit.extra["ready"] = 0
            if "backward_start" in unit.extra:
                self._mark(f"backward {unit.name}", unit.extra.pop("backward_start"))
            with self._stream():
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
        self._finish_queued = False
        with self._stream():
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

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Any:
        """The global gradient norm over every rank's shards (a tensor, as torch's FSDP1); clips to it.

        ``torch.nn.utils.clip_grad_norm_(fsdp.parameters(), c)`` would use this rank's shards only."""
        import torch

        norm = super().clip_grad_norm_(max_norm, norm_type)
        return torch.tensor(norm, dtype=_torch_dtype(self.master_dtype))

    # -- optimizer ---------------------------------------------------------------------------------
    def parameters(self) -> list[Any]:
        """This rank's flat shards as torch Parameters (hand them to a torch optimizer)."""
        return [cast(TorchParam, u.shard).tensor for u in self.units]

    def named_parameters(self) -> list[tuple[str, Any]]:
        return [(u.shard.name, cast(TorchParam, u.shard).tensor) for u in self.units]

    def attach(self, optimizer: Any) -> RemovableHandle:
        """Make the torch optimizer's ``step()`` call :meth:`finish_gradient_sync` first (optional: a
        synchronised backward finishes the sync itself)."""
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

    # -- state -------------------------------------------------------------------------------------
    def _buffers(self) -> list[tuple[str, Any]]:
        return torch_buffers(self.module)

    def _frozen(self) -> list[tuple[str, Any]]:
        return [
            (n, to_array(t, f"parameter {n!r}"))
            for n, t in self.module.named_parameters()
            if not t.requires_grad
        ]

    def _state_keys(self) -> dict[str, Any]:
        """``module.state_dict()``'s keys: the trainable parameter's name (its owner's, for a tied alias)
        or, for persistent buffers and frozen parameters, the tensor."""
        out: dict[str, Any] = {}
        for key, t in cast(Any, self.module).state_dict(keep_vars=True).items():
            p = self._by_tensor.get(id(t))
            out[key] = p.name if p is not None else t
        return out

    def _replicated(self) -> dict[str, Any]:
        return {
            k: to_array(v, f"state {k!r}") for k, v in self._state_keys().items() if not isinstance(v, str)
        }

    def state_dict(self) -> dict[str, Any]:
        """The full state (``module.state_dict()``'s keys, CPU torch tensors) on every rank:
        ``plain.load_state_dict(fsdp.state_dict(), strict=True)`` loads it."""
        values: dict[str, Any] = {}
        for unit in self.units:
            full = self._gather_master(unit)
            for name, p, off in zip(unit.names, unit.params, unit.offsets):
                values[name] = to_tensor(full[off : off + p.size].reshape(p.shape).copy())
        return {
            k: values[v] if isinstance(v, str) else v.detach().clone() for k, v in self._state_keys().items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a full state dict (``module.state_dict()``'s keys; torch tensors or arrays), strictly."""
        keys = self._state_keys()
        missing, unexpected = sorted(set(keys) - set(state)), sorted(set(state) - set(keys))
        if missing or unexpected:
            raise ValueError(
                f"FSDP.load_state_dict: missing keys {missing}, unexpected keys {unexpected} (the keys are "
                "module.state_dict()'s)"
            )
        canonical: dict[str, Any] = {}
        replicated: dict[str, Any] = {}
        for key, target in keys.items():  # a tied alias and its owner: the later key wins, as in torch
            (canonical if isinstance(target, str) else replicated)[
                target if isinstance(target, str) else key
            ] = _as_numpy(state[key], key)
        super().load_state_dict({**canonical, **replicated})

    def sharded_state_dict(self) -> dict[str, ShardedArray | Any]:
        """The shards' pieces under every state-dict key (a tied alias shares its owner's pieces)."""
        out = super().sharded_state_dict()
        for key, target in self._state_keys().items():
            if isinstance(target, str) and key not in out:
                out[key] = out[target]
        return out
