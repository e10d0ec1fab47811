"""The module protocol the parallel wrappers work on: Parameter and Module.

Modules run an explicit ``forward(x)`` / ``backward(grad_out)`` pair instead of
an autograd tape. ``forward`` caches what ``backward`` needs on the module
itself; ``backward`` consumes that cache, accumulates parameter gradients
through :meth:`Parameter.accumulate_grad` (which fires the gradient hooks) and
returns the gradient with respect to the input.

Consequences of the explicit design, which callers rely on:

- One instance caches one forward at a time: using the same module instance
  twice inside one forward is not supported. Pipelines that run several
  micro-batches through one stage move each micro-batch's cache out with
  :meth:`Module.take_forward_state` and back with
  :meth:`Module.restore_forward_state` before its backward.
- A parameter shared by two layers (weight tying) receives two
  ``accumulate_grad`` calls per backward, so its hooks fire twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, NamedTuple, TypeAlias

import numpy as np

from paramplane.node.arrays import array_module, cupy_module, to_host

Array: TypeAlias = Any
"""A numpy or cupy ndarray (the two libraries share no static type)."""

GradHook: TypeAlias = Callable[["Parameter"], None]


class RemovableHandle:
    """Returned by ``register_*_hook``; ``remove()`` unregisters the hook (idempotent)."""

    _next_id = 0

    def __init__(self, registry: dict[int, Any]) -> None:
        self._registry = registry
        self.id = RemovableHandle._next_id
        RemovableHandle._next_id += 1

    def remove(self) -> None:
        self._registry.pop(self.id, None)


class Parameter:
    """A trainable array with its gradient.

    ``grad`` is None until the first backward that reaches the parameter; later
    backwards add into it in place (so a caller may preset ``grad`` to a view of
    a larger buffer, e.g. a DDP bucket, and the layers write through it).
    """

    def __init__(self, data: Array, *, requires_grad: bool = True, name: str = "") -> None:
        if not hasattr(data, "shape") or not hasattr(data, "dtype"):
            raise ValueError(f"Parameter data must be a numpy or cupy array, got {type(data).__name__}")
        self.data: Array = data
        self.grad: Array | None = None
        self.requires_grad = requires_grad
        self.name = name
        self.layout: Any = None
        """Set by sharding wrappers (FSDP) on a flat shard: a ``paramplane.parallel.sharding.FlatLayout``
        mapping it onto the original parameters. None for an ordinary parameter."""
        self.shard: Any = None
        """Set by tensor-parallel layers on a parameter that is this rank's slice of a dense array: a
        ``paramplane.parallel.tensor.TensorShard``, which checkpoints use to save and load the dense array's
        pieces (:meth:`Module.sharded_state_dict`). None for an ordinary parameter."""
        self._grad_hooks: dict[int, GradHook] = {}
        self._pre_grad_hooks: dict[int, GradHook] = {}

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return np.dtype(self.data.dtype)

    @property
    def size(self) -> int:
        return int(self.data.size)

    def register_grad_hook(self, fn: GradHook) -> RemovableHandle:
        """Call ``fn(param)`` each time a backward has finished this parameter's gradient.

        Hooks run in registration order, synchronously inside ``backward``, right
        after the layer that owns the parameter added its contribution.
        """
        handle = RemovableHandle(self._grad_hooks)
        self._grad_hooks[handle.id] = fn
        return handle

    def register_grad_pre_hook(self, fn: GradHook) -> RemovableHandle:
        """Call ``fn(param)`` each time a backward is about to add to this parameter's gradient, before it does
        (``grad`` still holds what was there: None on the first contribution after ``zero_grad``)."""
        handle = RemovableHandle(self._pre_grad_hooks)
        self._pre_grad_hooks[handle.id] = fn
        return handle

    def accumulate_grad(self, g: Array, *, take: bool = False) -> None:
        """Add ``g`` into ``grad`` (creating it on first use), then fire the grad hooks.

        The single entry point layers use for parameter gradients. ``take=True``
        says ``g`` is a fresh array the caller will not touch again, so it may be
        stored without a copy. Ignored when ``requires_grad`` is False.
        """
        if not self.requires_grad:
            return
        if tuple(g.shape) != self.shape:
            raise ValueError(
                f"gradient for parameter {self.name or '<unnamed>'} has shape {tuple(g.shape)}, "
                f"expected {self.shape}"
            )
        if self._pre_grad_hooks:  # none in most training: no list built per contribution
            for hook in list(self._pre_grad_hooks.values()):
                hook(self)
        if self.grad is None:
            if take and g.dtype == self.data.dtype:
                self.grad = g
            else:
                self.grad = g.astype(self.data.dtype, copy=True)
        else:
            self.grad += g
        for hook in list(self._grad_hooks.values()):
            hook(self)

    def __repr__(self) -> str:
        return f"Parameter(name={self.name!r}, shape={self.shape}, dtype={self.dtype})"


class LoadResult(NamedTuple):
    """Keys that ``load_state_dict(strict=False)`` skipped."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _resolve_xp(target: ModuleType | str) -> ModuleType:
    if isinstance(target, ModuleType):
        if target.__name__ in ("numpy", "cupy"):
            return target
        raise ValueError(f"to() takes numpy, cupy, 'cpu' or 'cuda', got module {target.__name__}")
    if target in ("cpu", "numpy"):
        return np
    if target in ("cuda", "gpu", "cupy"):
        cp = cupy_module()
        if cp is None:
            raise ValueError("to('cuda') needs cupy and a CUDA device; neither was found")
        return cp
    raise ValueError(f"to() takes numpy, cupy, 'cpu' or 'cuda', got {target!r}")


def _convert(x: Array, xp: ModuleType) -> Array:
    """``x`` as an array of ``xp`` (a copy only when it has to move)."""
    if xp is np:
        return to_host(x)
    return xp.asarray(x)


class Module:
    """Base class: subclasses define ``forward`` and ``backward``.

    Parameters, buffers and submodules are registered by attribute assignment
    (``self.weight = Parameter(...)``, ``self.fc = Linear(...)``) or explicitly
    (``add_module``, ``register_buffer``), in registration order.
    """

    training: bool

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_buffers", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "_saved", None)
        object.__setattr__(self, "training", True)

    # --- registration -------------------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        if "_parameters" not in self.__dict__:
            raise AttributeError(
                f"{type(self).__name__}: call super().__init__() before assigning attributes"
            )
        params: dict[str, Parameter] = self.__dict__["_parameters"]
        buffers: dict[str, Array] = self.__dict__["_buffers"]
        modules: dict[str, Module] = self.__dict__["_modules"]
        if isinstance(value, Parameter):
            buffers.pop(name, None)
            modules.pop(name, None)
            value.name = name
            params[name] = value
        elif isinstance(value, Module):
            params.pop(name, None)
            buffers.pop(name, None)
            modules[name] = value
            for sub_name, p in value.named_parameters():
                p.name = f"{name}.{sub_name}"
        elif name in buffers:
            if value is None:
                del buffers[name]
            else:
                buffers[name] = value
        else:
            params.pop(name, None)
            modules.pop(name, None)
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        for registry in ("_parameters", "_buffers", "_modules"):
            self.__dict__[registry].pop(name, None)
        object.__delattr__(self, name)

    def add_module(self, name: str, module: Module) -> None:
        """Register ``module`` as a child called ``name`` (a valid, non-empty name without dots)."""
        if not isinstance(module, Module):
            raise ValueError(f"add_module({name!r}) needs a Module, got {type(module).__name__}")
        if not name or "." in name:
            raise ValueError(f"module name {name!r} must be non-empty and contain no '.'")
        setattr(self, name, module)

    def register_buffer(self, name: str, value: Array) -> None:
        """Register non-trainable state (saved in ``state_dict``, not in ``parameters()``)."""
        if not name or "." in name:
            raise ValueError(f"buffer name {name!r} must be non-empty and contain no '.'")
        if not hasattr(value, "shape"):
            raise ValueError(f"buffer {name!r} must be an array, got {type(value).__name__}")
        self.__dict__["_buffers"][name] = value
        self.__dict__["_parameters"].pop(name, None)
        self.__dict__["_modules"].pop(name, None)
        object.__setattr__(self, name, value)

    # --- traversal ----------------------------------------------------------------------------------
    def named_children(self) -> Iterator[tuple[str, Module]]:
        yield from self.__dict__["_modules"].items()

    def children(self) -> list[Module]:
        return [m for _, m in self.named_children()]

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        """This module (named ``prefix``) and every descendant, depth-first, each once."""
        seen: set[int] = set()

        def walk(mod: Module, path: str) -> Iterator[tuple[str, Module]]:
            if id(mod) in seen:
                return
            seen.add(id(mod))
            yield path, mod
            for name, child in mod.named_children():
                yield from walk(child, f"{path}.{name}" if path else name)

        yield from walk(self, prefix)

    def named_parameters(self) -> list[tuple[str, Parameter]]:
        """``(dotted name, parameter)`` in registration order, depth-first; a shared parameter once."""
        out: list[tuple[str, Parameter]] = []
        seen: set[int] = set()
        for path, mod in self.named_modules():
            for name, p in mod.__dict__["_parameters"].items():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((f"{path}.{name}" if path else name, p))
        return out

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def named_buffers(self) -> list[tuple[str, Array]]:
        out: list[tuple[str, Array]] = []
        for path, mod in self.named_modules():
            for name, b in mod.__dict__["_buffers"].items():
                out.append((f"{path}.{name}" if path else name, b))
        return out

    def buffers(self) -> list[Array]:
        return [b for _, b in self.named_buffers()]

    # --- computation --------------------------------------------------------------------------------
    def forward(self, x: Array) -> Array:
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    def backward(self, grad_out: Array) -> Array:
        raise NotImplementedError(f"{type(self).__name__} does not define backward()")

    def __call__(self, x: Array) -> Array:
        return self.forward(x)

    def _save(self, **values: Any) -> None:
        """Cache what backward needs (replaces the previous forward's cache)."""
        object.__setattr__(self, "_saved", values)

    def _take_saved(self) -> dict[str, Any]:
        """The cache of the last forward, removed from the module (backward consumes it)."""
        saved: dict[str, Any] | None = self.__dict__["_saved"]
        if saved is None:
            raise RuntimeError(
                f"{type(self).__name__}.backward() called without a forward() since the last backward"
            )
        object.__setattr__(self, "_saved", None)
        return saved

    def take_forward_state(self) -> dict[str, dict[str, Any]]:
        """Move every forward cache of this module tree out (keyed by module path) and clear them."""
        if not self.__dict__["_modules"]:  # a leaf (a pipeline calls this between every two computes)
            saved = self.__dict__["_saved"]
            object.__setattr__(self, "_saved", None)
            return {"": saved} if saved is not None else {}
        state: dict[str, dict[str, Any]] = {}
        for path, mod in self.named_modules():
            saved = mod.__dict__["_saved"]
            if saved is not None:
                state[path] = saved
                object.__setattr__(mod, "_saved", None)
        return state

    def restore_forward_state(self, state: dict[str, dict[str, Any]]) -> None:
        """Put back caches from :meth:`take_forward_state`, so the next backward uses them."""
        if not self.__dict__["_modules"] and state.keys() <= {""}:
            object.__setattr__(self, "_saved", state.get(""))
            return
        modules = dict(self.named_modules())
        unknown = sorted(set(state) - set(modules))
        if unknown:
            raise ValueError(f"forward state names modules this tree does not have: {unknown}")
        for path, mod in modules.items():
            object.__setattr__(mod, "_saved", state.get(path))

    # --- modes and gradients ------------------------------------------------------------------------
    def train(self, mode: bool = True) -> Module:
        for _, mod in self.named_modules():
            object.__setattr__(mod, "training", mode)
        return self

    def eval(self) -> Module:
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop gradients (``grad = None``), or zero them in place when ``set_to_none=False``."""
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad[...] = 0

    # --- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Array]:
        """Copies of every parameter and buffer, keyed by dotted name."""
        out: dict[str, Array] = {name: p.data.copy() for name, p in self.named_parameters()}
        for name, b in self.named_buffers():
            out[name] = b.copy()
        return out

    def load_state_dict(self, state: dict[str, Array], strict: bool = True) -> LoadResult:
        """Copy values into the existing arrays (in place, so views of them stay valid).

        Every value present must match the target's shape and dtype exactly
        (ValueError naming the key). With ``strict=True`` missing or unexpected
        keys are a ValueError too; otherwise they are returned.
        """
        targets: dict[str, tuple[Module, str, Array]] = {}
        for path, mod in self.named_modules():
            for kind in ("_parameters", "_buffers"):
                for name, item in mod.__dict__[kind].items():
                    key = f"{path}.{name}" if path else name
                    arr = item.data if isinstance(item, Parameter) else item
                    targets.setdefault(key, (mod, name, arr))
        # A shared (tied) array is loaded through any of its names: state_dict gives only the first.
        given = {id(targets[k][2]) for k in state if k in targets}
        missing = [k for k in targets if k not in state and id(targets[k][2]) not in given]
        unexpected = [k for k in state if k not in targets]
        if strict and (missing or unexpected):
            raise ValueError(
                f"load_state_dict: missing keys {missing}, unexpected keys {unexpected} "
                "(pass strict=False to load the matching subset)"
            )
        for key, value in state.items():
            if key not in targets:
                continue
            _, _, arr = targets[key]
            if not hasattr(value, "shape") or not hasattr(value, "dtype"):
                raise ValueError(f"load_state_dict: value for {key!r} is not an array")
            if tuple(value.shape) != tuple(arr.shape):
                raise ValueError(
                    f"load_state_dict: {key!r} has shape {tuple(value.shape)}, the module expects "
                    f"{tuple(arr.shape)}"
                )
            if np.dtype(value.dtype) != np.dtype(arr.dtype):
                raise ValueError(
                    f"load_state_dict: {key!r} has dtype {np.dtype(value.dtype)}, the module expects "
                    f"{np.dtype(arr.dtype)}; cast it first"
                )
        for key, value in state.items():
            if key in targets:
                _, _, arr = targets[key]
                arr[...] = _convert(value, array_module(arr))
        return LoadResult(missing, unexpected)

    def sharded_state_dict(self) -> dict[str, Any]:
        """``state_dict`` as checkpoints save it (``pp.checkpoint``): a parameter that is this rank's slice of a
        dense array (``Parameter.shard``, tensor parallel) appears as the ``ShardedArray`` piece of the dense
        array this rank writes, so a checkpoint holds the dense model whatever the tensor-parallel size; the
        rest as in :meth:`state_dict` (replicated). Collective where such a parameter is split along its last
        axis: every rank of its group calls this at the same point."""
        out: dict[str, Any] = {}
        for name, p in self.named_parameters():
            out[name] = p.shard.entry(p.data) if p.shard is not None else p.data.copy()
        for name, b in self.named_buffers():
            out[name] = b.copy()
        return out

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`sharded_state_dict` gave, refilled by a checkpoint loader (collective like it)."""
        sliced = {name: p for name, p in self.named_parameters() if p.shard is not None}
        absent = sorted(set(sliced) - set(state))
        result = self.load_state_dict({k: v for k, v in state.items() if k not in sliced}, strict=False)
        missing = [k for k in result.missing_keys if k not in sliced] + absent
        if missing or result.unexpected_keys:
            raise ValueError(
                f"load_sharded_state_dict: missing keys {missing}, unexpected keys {result.unexpected_keys}"
            )
        for name, p in sliced.items():
            p.shard.load(p.data, state[name])

    def to(self, target: ModuleType | str) -> Module:
        """Move parameters, their grads and buffers to numpy (``'cpu'``) or cupy (``'cuda'``).

        Arrays are replaced, not updated in place: re-create optimizers after moving.
        """
        xp = _resolve_xp(target)
        for _, mod in self.named_modules():
            for p in mod.__dict__["_parameters"].values():
                p.data = _convert(p.data, xp)
                if p.grad is not None:
                    p.grad = _convert(p.grad, xp)
            for name, b in list(mod.__dict__["_buffers"].items()):
                setattr(mod, name, _convert(b, xp))
        return self

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        children = [f"  ({n}): " + repr(m).replace("\n", "\n  ") for n, m in self.named_children()]
        head = f"{type(self).__name__}({self.extra_repr()}"
        return head + ("\n" + "\n".join(children) + "\n)" if children else ")")
