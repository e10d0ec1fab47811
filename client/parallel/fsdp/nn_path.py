"""What ``FSDP`` composes per kind of module: the ``ModulePath`` interface and ``NNPath``, the path of a
``paramplane.nn.Module`` (``torch_adapter.TorchPath`` is a ``torch.nn.Module``'s).

The wrapper (``wrapper.py``) owns the units, their gathers (``gather.py``) and reductions (``reduce.py``);
a path says how to see the module's parameters, buffers and frozen parameters, which modules are units by
default and which unit owns each parameter, how a unit's use is bracketed (wrapped ``forward``/``backward``
here, torch's hooks there), how the module is called, which optimizers ``attach`` takes, and how its state
dict looks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from paramplane.nn.layers import Sequential
from paramplane.nn.module import Array, LoadResult, Module, Parameter, RemovableHandle
from paramplane.node.arrays import is_floating
from paramplane.optim.optimizer import Optimizer
from paramplane.parallel.fsdp.units import FlatUnit, UnitGroup, UnitsByClass, choose_units, owned_units

if TYPE_CHECKING:
    from paramplane.parallel.fsdp.wrapper import FSDP

__all__ = ["ModulePath", "NNPath"]


class ModulePath(Protocol):
    module: Any

    def trainable(self) -> list[tuple[str, Parameter]]:
        """The trainable parameters by name (what FSDP shards)."""
        ...

    def unit_groups(
        self, named: list[tuple[str, Parameter]], units: Sequence[Any] | UnitsByClass | None
    ) -> list[UnitGroup]:
        """The units (``units``, or the default ones) and the parameters each owns."""
        ...

    def adopt(self, units: list[FlatUnit]) -> None:
        """The units are built (before any is wrapped)."""
        ...

    def wrap(self, unit: FlatUnit) -> None:
        """Bracket each use of ``unit``'s module: gather before its forward and backward, and so on."""
        ...

    def wrap_root(self, units: list[FlatUnit]) -> None:
        """Every unit is wrapped: bracket the module's own forward (a torch module's root hooks)."""
        ...

    @property
    def forward(self) -> Callable[..., Any]:
        """Runs the module (``fsdp(...)``'s arguments), each unit gathered when it is used."""
        ...

    def backward(self, grad_out: Any) -> Any: ...

    def norm(self, norm: float) -> Any:
        """What ``clip_grad_norm_`` returns for the global norm ``norm``."""
        ...

    def named_parameters(self, units: list[FlatUnit]) -> list[tuple[str, Any]]:
        """What ``parameters()`` hands an optimizer: each unit's shard (or, torch ``use_orig_params``, one
        view of it per original parameter), by name."""
        ...

    def before_grad_sync(self, units: list[FlatUnit]) -> None:
        """Before the shards' gradients are set or added to (what the optimizer's parameters say of them)."""
        ...

    def after_grad_change(self, units: list[FlatUnit]) -> None:
        """The shards' gradients were set or dropped (the optimizer's parameters follow)."""
        ...

    def optim_slots(self, units: list[FlatUnit]) -> list[tuple[Any, Callable[[Any], dict[str, Any]]]]:
        """Each optimizer parameter with the cut of an array shaped like it into ``ShardedArray``s by key."""
        ...

    def attach(self, optimizer: Any) -> RemovableHandle: ...

    def optim_bytes(self) -> int:
        """The attached optimizer's state bytes for this wrapper's shards."""
        ...

    def frozen(self) -> list[tuple[str, Array]]:
        """The frozen parameters' arrays (not sharded: replicated like buffers)."""
        ...

    def buffers(self) -> list[tuple[str, Array]]: ...

    def replicated(self) -> dict[str, Array]:
        """Frozen parameters and buffers by state-dict key: the module state every rank holds whole."""
        ...

    def state_dict(self, values: dict[str, Array]) -> dict[str, Any]:
        """The full state dict from the sharded parameters' full ``values`` and the replicated state."""
        ...

    def canonical_state(
        self, state: dict[str, Any], strict: bool
    ) -> tuple[dict[str, Array], LoadResult | None]:
        """A full state dict to load as arrays under the sharded parameters' names and ``replicated()``'s
        keys, and the keys skipped under the user's names (None: the same names, ``load_full`` tells)."""
        ...

    def add_aliases(self, out: dict[str, Any]) -> dict[str, Any]:
        """The sharded state dict under every state-dict key."""
        ...


class NNPath:
    """A ``paramplane.nn.Module``: ``fsdp(x)`` and ``fsdp.backward(grad)``; each unit module's ``forward``
    and ``backward`` are replaced by ones that gather the unit around the original and, after its backward,
    launch the unit's gradient reduction."""

    def __init__(self, module: Module, fsdp: FSDP) -> None:
        self.module = module
        self.fsdp = fsdp
        self.optimizer: Optimizer | None = None
        self.originals: list[tuple[Module, Any, Any]] = []

    # -- construction ------------------------------------------------------------------------------
    def trainable(self) -> list[tuple[str, Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def _children(self) -> list[tuple[str, Module]]:
        """The default units: the children with parameters of a Sequential (or of a module with several)."""
        children = [(n, m) for n, m in self.module.named_children() if m.parameters()]
        return children if isinstance(self.module, Sequential) or len(children) > 1 else []

    def unit_groups(
        self, named: list[tuple[str, Parameter]], units: Sequence[Any] | UnitsByClass | None
    ) -> list[UnitGroup]:
        return owned_units(choose_units(self.module, units, self._children), named)

    def adopt(self, units: list[FlatUnit]) -> None:
        pass

    def wrap_root(self, units: list[FlatUnit]) -> None:
        """Nothing: ``FSDP.forward`` brackets the module's forward."""

    def wrap(self, unit: FlatUnit) -> None:
        m = unit.module
        assert m is not None
        fsdp, gather = self.fsdp, self.fsdp._gather
        orig_forward, orig_backward = m.forward, m.backward

        def forward(x: Array) -> Array:
            gather.enter_unit(unit)
            start = time.monotonic()
            y = orig_forward(x)
            fsdp._mark(f"forward {unit.name}", start)
            unit.forward_done = True
            if fsdp.reshard_after_forward:
                gather.release(unit)
            return y

        def backward(grad: Array) -> Array:
            gather.ensure_gathered(unit)
            if fsdp.backward_prefetch == "pre":
                gather.prefetch(gather.prev_in_forward(unit))
            start = time.monotonic()
            grad_in = orig_backward(grad)
            fsdp._mark(f"backward {unit.name}", start)
            fsdp._reducer.post_backward(unit)
            if fsdp.backward_prefetch == "post":
                gather.prefetch(gather.prev_in_forward(unit))
            return grad_in

        self.originals.append((m, orig_forward, orig_backward))
        object.__setattr__(m, "forward", forward)
        object.__setattr__(m, "backward", backward)

    # -- forward / backward ------------------------------------------------------------------------
    def forward(self, x: Array) -> Array:
        """Run the module unit by unit: each unit is gathered for its forward (and prefetched).

        With mixed precision a floating-point ``x`` is cast to ``param_dtype`` (the compute dtype); the output
        is cast to ``output_dtype`` when one is set.
        """
        fsdp = self.fsdp
        fsdp._gather.begin_forward()
        y = self.module.forward(self._cast_input(x))
        fsdp._forward_open = True
        return y.astype(fsdp.output_dtype) if fsdp.output_dtype is not None else y

    def _cast_input(self, x: Any) -> Any:
        """A floating-point input in ``param_dtype`` when mixed precision computes in another dtype."""
        fsdp = self.fsdp
        if fsdp.param_dtype == fsdp.master_dtype or not hasattr(x, "dtype") or not is_floating(x.dtype):
            return x
        return x if x.dtype == fsdp.param_dtype else x.astype(fsdp.param_dtype)

    def backward(self, grad_out: Array) -> Array:
        """Run the module's backward; each unit's gradient reduce-scatter starts as soon as it is ready."""
        fsdp = self.fsdp
        if not fsdp._forward_open:
            raise ValueError("FSDP.backward() called without a forward() since the last backward")
        fsdp._forward_open = False
        grad_out = grad_out.astype(fsdp.param_dtype) if grad_out.dtype != fsdp.param_dtype else grad_out
        grad_in = self.module.backward(grad_out)
        if fsdp._root is not None:
            fsdp._reducer.post_backward(fsdp._root)
        return grad_in

    def norm(self, norm: float) -> float:
        return norm

    # -- optimizer ---------------------------------------------------------------------------------
    def named_parameters(self, units: list[FlatUnit]) -> list[tuple[str, Any]]:
        return [(u.shard.name, u.shard) for u in units]

    def before_grad_sync(self, units: list[FlatUnit]) -> None:
        pass

    def after_grad_change(self, units: list[FlatUnit]) -> None:
        pass

    def optim_slots(self, units: list[FlatUnit]) -> list[tuple[Any, Callable[[Any], dict[str, Any]]]]:
        return [(u.shard, u.shard.layout.views) for u in units]

    def attach(self, optimizer: Any) -> RemovableHandle:
        if not isinstance(optimizer, Optimizer):
            raise ValueError(f"attach() takes a paramplane.optim optimizer, got {type(optimizer).__name__}")
        fsdp = self.fsdp
        self.optimizer = optimizer
        optimizer.register_step_post_hook(lambda _opt: fsdp.memory.update())
        return optimizer.register_step_pre_hook(lambda _opt: fsdp.finish_gradient_sync())

    def optim_bytes(self) -> int:
        if self.optimizer is None:
            return 0
        mine = {id(u.shard) for u in self.fsdp.units}
        opt = self.optimizer
        return sum(
            int(v.nbytes)
            for i, state in opt.state.items()
            if id(opt.params[i]) in mine
            for v in state.values()
            if hasattr(v, "nbytes")
        )

    # -- state -------------------------------------------------------------------------------------
    def frozen(self) -> list[tuple[str, Array]]:
        return [(n, p.data) for n, p in self.module.named_parameters() if not p.requires_grad]

    def buffers(self) -> list[tuple[str, Array]]:
        return list(self.module.named_buffers())

    def replicated(self) -> dict[str, Array]:
        return {**dict(self.frozen()), **dict(self.buffers())}

    def state_dict(self, values: dict[str, Array]) -> dict[str, Any]:
        frozen = dict(self.frozen())
        out = {}
        for name, _ in self.module.named_parameters():
            if name in values:
                out[name] = values[name]
            elif name in frozen:
                out[name] = frozen[name].copy()
        for name, buf in self.buffers():
            out[name] = buf.copy()
        return out

    def canonical_state(
        self, state: dict[str, Any], strict: bool
    ) -> tuple[dict[str, Array], LoadResult | None]:
        return state, None

    def add_aliases(self, out: dict[str, Any]) -> dict[str, Any]:
        return out
