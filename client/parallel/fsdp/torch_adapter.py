"""``pp.FSDP`` over a ``torch.nn.Module`` (CPU or CUDA tensors): the same flat units, driven by torch's hooks.

Each trainable torch parameter is seen through a ``TorchFlatParam``: the flat buffers are numpy arrays
(cupy arrays for a CUDA module, whose collectives the hooks enqueue on torch's current stream) and a parameter's tensor is re-pointed, zero-copy, at its piece of the gathered buffer, or, while sharded,
at a zero-stride placeholder of NaNs of its shape: a computation that reads a sharded parameter yields NaN,
never plausible values, and a forward that did not call some unit's module raises naming the unit.

Units (``units=``): by default every element of the outermost ``nn.ModuleList``s (a transformer's blocks,
as torchtitan applies ``fully_shard`` per block; or ``nn.ModuleDict``s: a ``pipeline_split`` stage's blocks), and
of the outermost ``nn.Sequential``s of two or more blocks of one class defined outside ``torch.nn`` (timm's
ViT ``blocks``, torchvision's ResNet ``layer1``..``layer4``), the root unit keeping the rest (embeddings,
final norm, a tied head); a model with neither gets one unit per child with parameters of an ``nn.Sequential``
(or of a module with several). ``pp.units_by_class(Block)`` makes every module of those classes a unit
(torch's ``ModuleWrapPolicy``); units may nest (the inner unit owns its parameters, the outer the rest).
A parameter is owned by the innermost unit around the modules that register it; one registered by modules
of several units (tied weights: ``lm_head.weight is wte.weight``) is owned by the root unit, which is
gathered for the whole forward and backward.

``TorchPath`` is the module path ``FSDP`` composes for a torch module (``pp.FSDP(torch_module, ...)`` is a
``TorchFSDP``, the wrapper with this path). Its hooks do what ``NNPath``'s wrapped ``forward``/``backward`` do
for paramplane modules:

- the module's own forward pre-hook and forward hook are the wrapper's forward (as FSDP2's root hooks), so
  ``fsdp.module(...)`` and ``fsdp.generate(...)`` gather as ``fsdp(...)`` does; a submodule whose parameters are
  sharded refuses to run alone, and to give its state dict (placeholders are never read silently);
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
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from paramplane.nn.module import LoadResult, Parameter, RemovableHandle
from paramplane.parallel.fsdp import frozen
from paramplane.parallel.fsdp.optim_guard import guard
from paramplane.parallel.fsdp.units import FlatUnit, UnitGroup, UnitsByClass, choose_units
from paramplane.parallel.sharding import LayoutEntry, ShardedArray
from paramplane.parallel.torch_params import (
    EndOfBackward,
    TorchFlatParam,
    TorchParam,
    check_still_frozen,
    check_wrappable,
    claim_parameters,
    frozen_tensors,
    output_tensors,
    to_array,
    to_tensor,
    to_torch,
    torch_buffers,
    torch_stream,
)

if TYPE_CHECKING:
    from paramplane.parallel.fsdp.wrapper import FSDP

__all__ = ["TorchPath"]


def _torch_dtype(dtype: Any) -> Any:
    return to_torch(np.zeros(0, dtype)).dtype


def _as_numpy(value: Any, key: str) -> Any:
    """A state-dict value (torch tensor or array) as an array the shards can be filled from."""
    if hasattr(value, "detach") and hasattr(value, "device"):
        return to_array(value.detach().contiguous(), f"state dict value {key!r}")
    return np.asarray(value)


def _whole_piece(entry: LayoutEntry) -> Callable[[Any], dict[str, ShardedArray]]:
    """The cut of an array shaped like ``entry``'s piece: that piece of its global array, whole."""
    return lambda flat: {entry.key: ShardedArray(entry.global_shape, entry.start, flat)}


class TorchPath:
    """A ``torch.nn.Module``'s path (module docstring): ``cpu_offload`` changes nothing (the tensors are in
    host memory already); ``mixed_precision`` gathers and computes in ``param_dtype`` (the forward's
    floating-point inputs are cast to it) and reduces in ``reduce_dtype``, with float32 (or float64) master
    shards."""

    def __init__(self, module: Any, fsdp: FSDP, use_orig_params: bool = False) -> None:
        check_wrappable(module, "pp.FSDP")
        for name, p in module.named_parameters():
            if getattr(getattr(p, "tp_shard", None), "experts", False):
                raise ValueError(
                    f"pp.FSDP does not shard expert-parallel experts ({name!r}): wrap a model with "
                    "ExpertParallel experts in pp.DDP over the expert-parallel group"
                )
        claim_parameters(module, fsdp, "pp.FSDP")
        self.module = module
        self.fsdp = fsdp
        self.use_orig_params = use_orig_params
        self.views: dict[int, list[tuple[LayoutEntry, Any]]] = {}
        """``use_orig_params``: per unit (by id), each original parameter's piece of the shard as a Parameter."""
        self.by_tensor: dict[int, TorchFlatParam] = {}
        self.optimizer: Any = None
        self._finish = EndOfBackward(self._finish_sync)
        self._frozen = frozen_tensors(module)

    # -- construction ------------------------------------------------------------------------------
    def trainable(self) -> list[tuple[str, Parameter]]:
        """The parameters to shard: the trainable ones; with ``use_orig_params`` the frozen ones too (FSDP1's
        rule: mixed ``requires_grad`` in a unit needs the original parameters, so an optimizer over the pieces
        never sees a frozen one's elements), so that a LoRA base model or a frozen teacher is sharded."""
        self.by_tensor = {}
        named: list[tuple[str, Parameter]] = []
        for name, tensor in self.module.named_parameters():
            if tensor.requires_grad or self.use_orig_params:
                p = TorchFlatParam(name, tensor)
                self.by_tensor[id(tensor)] = p
                named.append((name, cast(Parameter, p)))
        return named

    def _children(self) -> list[tuple[str, Any]]:
        """The default units: the elements of the outermost ModuleLists (ModuleDicts) and Sequentials of
        blocks, else the children of a Sequential."""
        import torch

        module = self.module
        paths = {id(m): path for path, m in module.named_modules()}
        lists: list[Any] = []

        def blocks_in_sequence(m: Any) -> bool:
            """A Sequential of two or more blocks (modules with parameters) of one class not from torch.nn."""
            if not isinstance(m, torch.nn.Sequential):
                return False
            blocks = [type(c) for c in m.children() if any(True for _ in c.parameters())]
            return (
                len(blocks) >= 2 and len(set(blocks)) == 1 and not blocks[0].__module__.startswith("torch.nn")
            )

        def find(m: Any) -> None:
            for child in m.children():
                if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)) or blocks_in_sequence(child):
                    lists.append(child)
                else:
                    find(child)

        find(module)
        blocks = [
            (paths[id(b)], b) for lst in lists for b in lst.children() if any(True for _ in b.parameters())
        ]
        if blocks:
            return blocks
        children = [(n, m) for n, m in module.named_children() if any(True for _ in m.parameters())]
        sequence = isinstance(module, (torch.nn.Sequential, torch.nn.ModuleList))
        return children if sequence or len(children) > 1 else []

    def unit_groups(
        self, named: list[tuple[str, Parameter]], units: Sequence[Any] | UnitsByClass | None
    ) -> list[UnitGroup]:
        """Each parameter goes to the innermost unit around the modules that register it; one registered
        in several units (tied weights) goes to the root unit (module docstring)."""
        chosen = choose_units(self.module, units, self._children)
        unit_of = {id(m): path for path, m in chosen}
        users: dict[int, set[str]] = {}

        def walk(m: Any, current: str) -> None:
            current = unit_of.get(id(m), current)
            for t in m._parameters.values():
                if t is not None and id(t) in self.by_tensor:
                    users.setdefault(id(t), set()).add(current)
            for child in m.children():
                walk(child, current)

        walk(self.module, "<root>")
        owner = {
            id(p): (
                next(iter(users[id(cast(Any, p).tensor)]))
                if len(users[id(cast(Any, p).tensor)]) == 1
                else "<root>"
            )
            for _, p in named
        }
        groups: list[UnitGroup] = []
        for path, m in [*chosen, ("<root>", None)]:
            mine = [(n, p) for n, p in named if owner[id(p)] == path]
            if mine:
                groups.append((path, m, mine))
        return groups

    def adopt(self, units: list[FlatUnit]) -> None:
        """The shards become torch Parameters; each parameter's post-accumulate-grad hook counts its unit's
        gradients."""
        import torch

        for unit in units:
            shard = TorchParam(unit.shard.name, torch.nn.Parameter(to_tensor(unit.shard.data)))
            shard.layout = unit.shard.layout  # type: ignore[attr-defined]
            unit.shard = cast(Parameter, shard)
            trainable = {p.name for p in unit.params if cast(TorchParam, p).tensor.requires_grad}
            unit.extra["num_trainable"] = len(trainable)
            if self.use_orig_params:  # leaves over the shard's memory: an optimizer step writes the shard
                flat = shard.tensor.detach()
                self.views[id(unit)] = [
                    (
                        e,
                        torch.nn.Parameter(
                            flat[e.offset : e.offset + e.size], requires_grad=e.key in trainable
                        ),
                    )
                    for e in cast(Any, shard).layout.entries
                ]
            for p in unit.params:
                if cast(TorchParam, p).tensor.requires_grad:
                    cast(TorchParam, p).tensor.register_post_accumulate_grad_hook(self._grad_hook(unit))
        guard([(p.name, cast(TorchParam, p).tensor) for unit in units for p in unit.params])

    def wrap(self, unit: FlatUnit) -> None:
        m = cast(Any, unit.module)
        fsdp, gather = self.fsdp, self.fsdp._gather

        def before(_m: Any, _args: Any) -> None:
            if fsdp._summoned:  # every unit is whole: nothing to gather or reshard
                return
            with self._stream():
                gather.enter_unit(unit)
            unit.extra["forward_start"] = time.monotonic()

        def after(_m: Any, _args: Any, output: Any) -> None:
            if fsdp._summoned:
                return
            fsdp._mark(f"forward {unit.name}", unit.extra.pop("forward_start"))
            unit.forward_done = True
            if fsdp.reshard_after_forward:
                gather.release(unit)
            unit.extra["pre_backward"] = False
            for t in output_tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda _g: self._pre_backward(unit))

        m.register_forward_pre_hook(before)
        m.register_forward_hook(after)
        if frozen.holds_frozen(unit):
            frozen.watch_inputs(m, unit, self._inputs_done)

    def _inputs_done(self, unit: FlatUnit) -> None:
        """A unit holding frozen parameters reshards once its module's input gradients, for every forward
        waiting, and its trainable parameters' gradients are done (:mod:`~paramplane.parallel.fsdp.frozen`)."""
        unit.extra["pending_inputs"] -= 1
        if unit.extra["pending_inputs"] == 0 and (
            unit.extra.get("grads_done") or unit.extra["num_trainable"] == 0
        ):
            unit.extra["pre_backward"] = False  # another microbatch's backward gathers it again
            with self._stream():
                self.fsdp._gather.release(unit)

    # -- forward / backward ------------------------------------------------------------------------
    def _queue_finish(self) -> None:
        """From inside a synchronised backward: finish the gradient sync when that backward ends."""
        if not self.fsdp._reducer.no_sync:
            self._finish.request()

    def _finish_sync(self) -> None:
        with self._stream():
            self.fsdp.finish_gradient_sync()
        check_still_frozen(self._frozen, "pp.FSDP")

    def _pre_backward(self, unit: FlatUnit) -> None:
        self._queue_finish()
        if unit.extra.get("pre_backward"):
            return
        unit.extra["pre_backward"] = True
        unit.extra["backward_start"] = time.monotonic()
        unit.extra["grads_done"] = False
        gather = self.fsdp._gather
        with self._stream():
            gather.ensure_gathered(unit)
            if self.fsdp.backward_prefetch == "pre":
                gather.prefetch(gather.prev_in_forward(unit))

    def _root_pre_backward(self, root: FlatUnit) -> None:
        self._queue_finish()  # from the outermost backward, which the root's output starts
        with self._stream():
            self.fsdp._gather.ensure_gathered(root)

    def reduce_accumulated(self) -> None:
        """``FSDP.reduce_accumulated_gradients``: launch every unit's reduction now and finish the sync."""
        self.fsdp._reducer.round_open = True
        self._finish_sync()

    def _stream(self) -> contextlib.AbstractContextManager[None]:
        """Collectives issued inside run on torch's current stream (CUDA modules; see torch_params)."""
        return torch_stream(cast(TorchParam, self.fsdp.units[0].params[0]).tensor)

    def _grad_hook(self, unit: FlatUnit) -> Callable[[Any], None]:
        def ready(_tensor: Any) -> None:
            self._queue_finish()
            count = unit.extra.get("ready", 0) + 1
            if count < unit.extra["num_trainable"]:
                unit.extra["ready"] = count
                return
            unit.extra["ready"] = 0
            unit.extra["pre_backward"] = False  # another microbatch's backward (a pipeline) gathers it again
            unit.extra["grads_done"] = True
            release = not frozen.holds_frozen(unit) or unit.extra.get("pending_inputs", 0) == 0
            fsdp, gather = self.fsdp, self.fsdp._gather
            if "backward_start" in unit.extra:
                fsdp._mark(f"backward {unit.name}", unit.extra.pop("backward_start"))
            with self._stream():
                fsdp._reducer.post_backward(unit, release=release)
                if fsdp.backward_prefetch == "post" and unit.module is not None:
                    gather.prefetch(gather.prev_in_forward(unit))

        return ready

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the torch module: its root hooks (``wrap_root``) gather and check around its forward."""
        return self.module(*args, **kwargs)

    def wrap_root(self, units: list[FlatUnit]) -> None:
        """The wrapper's forward is the module's own, as with FSDP2's root hooks: ``fsdp.module(...)`` and
        ``fsdp.module.generate(...)`` gather like ``fsdp(...)``. Every module that registers a parameter of a
        unit refuses to run, or to give or load a state dict, while that unit is sharded (its tensors are
        placeholders), so that a direct call of a submodule or ``module.state_dict()`` raises instead of
        computing with NaNs or saving them, and ``module.load_state_dict()`` names the way to load. Runs after every unit's hooks are registered."""
        module = self.module
        module.register_forward_pre_hook(self._root_pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._root_post_forward)
        unit_of = {id(cast(TorchParam, p).tensor): u for u in units for p in u.params}
        for name, sub in module.named_modules():
            owned = [(k, unit_of[id(t)]) for k, t in sub._parameters.items() if id(t) in unit_of]
            if owned:
                sub.register_forward_pre_hook(self._sharded_call_check(name, owned))
                sub.register_state_dict_post_hook(self._sharded_state_check(owned))
                sub.register_load_state_dict_pre_hook(self._sharded_load_check(owned))

    @staticmethod
    def _sharded_load_check(owned: list[tuple[str, FlatUnit]]) -> Callable[..., None]:
        def check(_m: Any, state: Any, prefix: str, *_rest: Any) -> None:
            for key, unit in owned:
                if not unit.gathered and prefix + key in state:
                    raise RuntimeError(
                        f"FSDP: module.load_state_dict() cannot write {prefix + key!r}, which is sharded (unit "
                        f"{unit.name!r}): use fsdp.load_state_dict(state) on every rank (each keeps its shard), "
                        "or load into the module inside fsdp.summon_full_params() (writes are kept)"
                    )

        return check

    def _root_pre_forward(self, _m: Any, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        import torch

        fsdp = self.fsdp
        if fsdp._summoned:
            if torch.is_grad_enabled():
                raise RuntimeError(
                    "FSDP: a forward inside summon_full_params() runs on the full parameters without "
                    "gathering, for inference on any rank alone (e.g. rank 0 sampling): wrap it in "
                    "torch.no_grad(); train outside the context"
                )
            return None
        self._finish.reset()
        for u in fsdp.units:
            u.forward_done = False
            u.extra["ready"] = 0
        with self._stream():
            fsdp._gather.begin_forward()
        if fsdp.param_dtype == fsdp.master_dtype:
            return None
        compute = _torch_dtype(fsdp.param_dtype)

        def cast_input(a: Any) -> Any:
            return a.to(compute) if torch.is_tensor(a) and a.is_floating_point() else a

        return tuple(cast_input(a) for a in args), {k: cast_input(v) for k, v in kwargs.items()}

    def _root_post_forward(self, _m: Any, _args: Any, y: Any) -> Any:
        import torch

        fsdp = self.fsdp
        if fsdp._summoned:
            return None
        missed = [u.name for u in fsdp._wrapped if not u.forward_done]
        if missed:
            raise RuntimeError(
                f"FSDP: the forward did not call the module of unit(s) {missed}; a unit is gathered when its "
                "module is called, so its parameters held placeholders. Call those modules, or pass units= "
                "naming the modules the forward calls"
            )
        fsdp._forward_open = torch.is_grad_enabled()
        root = fsdp._root
        if root is not None and fsdp._forward_open:  # gathered again for the backward of this output (the
            for t in output_tensors(y):  # backward of an earlier forward, as a pipeline runs, released it)
                if t.requires_grad:
                    t.register_hook(lambda _g: self._root_pre_backward(root))
        if fsdp.output_dtype is not None and torch.is_tensor(y) and y.is_floating_point():
            return y.to(_torch_dtype(fsdp.output_dtype))
        return None

    @staticmethod
    def _sharded_call_check(name: str, owned: list[tuple[str, FlatUnit]]) -> Callable[[Any, Any], None]:
        def check(_m: Any, _args: Any) -> None:
            for key, unit in owned:
                if not unit.gathered:
                    raise RuntimeError(
                        f"FSDP: {name or 'the root module'} was called while its parameter {key!r} is "
                        f"sharded (unit {unit.name!r} is not gathered: it holds a placeholder). Call the "
                        "wrapped model (fsdp(...) or fsdp.module(...)), whose forward gathers each unit, or "
                        "call it inside fsdp.summon_full_params() under torch.no_grad()"
                    )

        return check

    @staticmethod
    def _sharded_state_check(owned: list[tuple[str, FlatUnit]]) -> Callable[..., None]:
        def check(m: Any, state: Any, prefix: str, _meta: Any) -> None:
            for key, unit in owned:
                # keep_vars=True hands out the parameters themselves (who asks knows what they hold)
                if not unit.gathered and state.get(prefix + key) is not m._parameters[key]:
                    raise RuntimeError(
                        f"FSDP: module.state_dict() would hold a placeholder for {prefix + key!r}, which is "
                        f"sharded (unit {unit.name!r}). Use fsdp.state_dict() on every rank (the full state, "
                        "module.state_dict()'s keys), fsdp.sharded_state_dict() / pp.checkpoint, or "
                        "module.state_dict() inside fsdp.summon_full_params()"
                    )

        return check

    def backward(self, grad_out: Any) -> Any:
        raise RuntimeError(
            "FSDP over a torch module runs torch's backward: call loss.backward() (each unit's gradient "
            "reduction starts from its parameters' gradient hooks)"
        )

    def norm(self, norm: float) -> Any:
        """The global gradient norm as a tensor (as torch's FSDP1 returns it)."""
        import torch

        return torch.tensor(norm, dtype=_torch_dtype(self.fsdp.master_dtype))

    # -- optimizer ---------------------------------------------------------------------------------
    def named_parameters(self, units: list[FlatUnit]) -> list[tuple[str, Any]]:
        """The shards as torch Parameters, or with ``use_orig_params`` one 1-D piece per original parameter
        under its name (torch FSDP1's ``use_orig_params=True``: param groups by name)."""
        if not self.use_orig_params:
            return [(u.shard.name, cast(TorchParam, u.shard).tensor) for u in units]
        return [(e.key, view) for u in units for e, view in self.views[id(u)]]

    def before_grad_sync(self, units: list[FlatUnit]) -> None:
        """``use_orig_params``: pieces whose grads were all set to None (``opt.zero_grad()``) drop the
        shard's grad, so the next sync sets it instead of adding to the last step's."""
        if not self.use_orig_params:
            return
        for u in units:
            if u.shard.grad is not None and all(view.grad is None for _, view in self.views[id(u)]):
                u.shard.grad = None

    def after_grad_change(self, units: list[FlatUnit]) -> None:
        """``use_orig_params``: each piece's grad is its piece of the shard's grad (or None)."""
        if not self.use_orig_params:
            return
        for u in units:
            grad = cast(TorchParam, u.shard).tensor.grad
            for e, view in self.views[id(u)]:
                if view.requires_grad:  # a frozen piece keeps None: an optimizer given it skips it
                    view.grad = None if grad is None else grad[e.offset : e.offset + e.size]

    def optim_slots(self, units: list[FlatUnit]) -> list[tuple[Any, Callable[[Any], dict[str, Any]]]]:
        if not self.use_orig_params:
            return [(cast(TorchParam, u.shard).tensor, cast(Any, u.shard).layout.views) for u in units]
        return [(view, _whole_piece(e)) for u in units for e, view in self.views[id(u)] if view.requires_grad]

    def attach(self, optimizer: Any) -> RemovableHandle:
        """Make the torch optimizer's ``step()`` call ``finish_gradient_sync`` first (optional: a
        synchronised backward finishes the sync itself)."""
        import torch

        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"FSDP over a torch module attaches a torch.optim optimizer, got {type(optimizer).__name__}"
            )
        fsdp = self.fsdp
        self.optimizer = optimizer
        optimizer.register_step_post_hook(lambda *_: fsdp.memory.update())
        return cast(RemovableHandle, optimizer.register_step_pre_hook(lambda *_: fsdp.finish_gradient_sync()))

    def optim_bytes(self) -> int:
        opt = self.optimizer
        if opt is None:
            return 0
        return sum(
            int(v.nbytes)
            for p in self.fsdp.parameters()
            for v in opt.state.get(p, {}).values()
            if hasattr(v, "nbytes") and v.dim() > 0
        )

    # -- state -------------------------------------------------------------------------------------
    def buffers(self) -> list[tuple[str, Any]]:
        return torch_buffers(self.module)

    def frozen(self) -> list[tuple[str, Any]]:
        """The frozen parameters kept whole (replicated): all of them, unless ``use_orig_params`` shards them."""
        return [
            (n, to_array(t, f"parameter {n!r}"))
            for n, t in self.module.named_parameters()
            if not t.requires_grad and id(t) not in self.by_tensor
        ]

    def _state_keys(self) -> dict[str, Any]:
        """``module.state_dict()``'s keys: the trainable parameter's name (its owner's, for a tied alias)
        or, for persistent buffers and frozen parameters, the tensor."""
        out: dict[str, Any] = {}
        for key, t in self.module.state_dict(keep_vars=True).items():
            p = self.by_tensor.get(id(t))
            out[key] = p.name if p is not None else t
        return out

    def replicated(self) -> dict[str, Any]:
        return {
            k: to_array(v, f"state {k!r}") for k, v in self._state_keys().items() if not isinstance(v, str)
        }

    def state_dict(self, values: dict[str, Any]) -> dict[str, Any]:
        """``module.state_dict()``'s keys, CPU torch tensors: ``plain.load_state_dict(fsdp.state_dict(),
        strict=True)`` loads it."""
        tensors = {name: to_tensor(v) for name, v in values.items()}
        return {
            k: tensors[v] if isinstance(v, str) else v.detach().clone() for k, v in self._state_keys().items()
        }

    def canonical_state(self, state: dict[str, Any], strict: bool) -> tuple[dict[str, Any], LoadResult]:
        """``module.state_dict()``'s keys (torch tensors or arrays); a tied alias and its owner: the later key
        wins, as in torch. ``strict=False``: the keys present, and those skipped."""
        keys = self._state_keys()
        missing, unexpected = sorted(set(keys) - set(state)), sorted(set(state) - set(keys))
        if strict and (missing or unexpected):
            raise ValueError(
                f"FSDP.load_state_dict: missing keys {missing}, unexpected keys {unexpected} (the keys are "
                "module.state_dict()'s)"
            )
        canonical: dict[str, Any] = {}
        replicated: dict[str, Any] = {}
        for key, target in keys.items():
            if key in state:
                (canonical if isinstance(target, str) else replicated)[
                    target if isinstance(target, str) else key
                ] = _as_numpy(state[key], key)
        return {**canonical, **replicated}, LoadResult(missing, unexpected)

    def add_aliases(self, out: dict[str, ShardedArray | Any]) -> dict[str, ShardedArray | Any]:
        """The shards' pieces under every state-dict key (a tied alias shares its owner's pieces)."""
        for key, target in self._state_keys().items():
            if isinstance(target, str) and key not in out:
                out[key] = out[target]
        return out
