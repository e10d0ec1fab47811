"""The optimizer base class: parameter list, per-parameter state, step hooks, state_dict."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar, TypeAlias

import numpy as np

from paramplane.nn.module import Array, Parameter, RemovableHandle
from paramplane.node.arrays import array_module, to_host

StepHook: TypeAlias = Callable[["Optimizer"], None]


def _copy_value(value: Any) -> Any:
    return value.copy() if hasattr(value, "shape") else value


class Optimizer:
    """Updates a fixed list of parameters from their ``grad``.

    Subclasses list their hyper-parameter attribute names in ``HYPERPARAMS``
    (saved by ``state_dict``; assign e.g. ``opt.lr = 0.01`` to change one),
    check them in ``_validate`` and update one parameter in ``_update``.
    Per-parameter state lives in ``state[index]`` where ``index`` is the
    parameter's position in ``params``; parameters whose grad is None are
    skipped and get no state.
    """

    HYPERPARAMS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, params: Iterable[Parameter]) -> None:
        self.params: list[Parameter] = list(params)
        if not self.params:
            raise ValueError(f"{type(self).__name__} got an empty parameter list")
        seen: set[int] = set()
        for i, p in enumerate(self.params):
            if not isinstance(p, Parameter):
                raise ValueError(
                    f"{type(self).__name__}: params[{i}] is a {type(p).__name__}, expected a Parameter"
                )
            if id(p) in seen:
                raise ValueError(f"{type(self).__name__}: parameter {p.name or i} appears twice")
            seen.add(id(p))
        self.state: dict[int, dict[str, Any]] = {}
        self._pre_hooks: dict[int, StepHook] = {}
        self._post_hooks: dict[int, StepHook] = {}

    def _validate(self) -> None:
        """Raise ValueError for a bad hyper-parameter."""

    def _update(self, index: int, param: Parameter, grad: Array) -> None:
        raise NotImplementedError

    def register_step_pre_hook(self, fn: StepHook) -> RemovableHandle:
        """Call ``fn(optimizer)`` at the start of every ``step()``, before any parameter changes.

        DDP waits for its gradient all-reduces here.
        """
        handle = RemovableHandle(self._pre_hooks)
        self._pre_hooks[handle.id] = fn
        return handle

    def register_step_post_hook(self, fn: StepHook) -> RemovableHandle:
        """Call ``fn(optimizer)`` at the end of every ``step()``, after all parameters changed."""
        handle = RemovableHandle(self._post_hooks)
        self._post_hooks[handle.id] = fn
        return handle

    def step(self) -> None:
        """Run the pre-hooks, update every parameter that has a grad, run the post-hooks."""
        for hook in list(self._pre_hooks.values()):
            hook(self)
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self._update(i, p, p.grad)
        for hook in list(self._post_hooks.values()):
            hook(self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop gradients (``grad = None``), or zero them in place when ``set_to_none=False``."""
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad[...] = 0

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {index: {name: copy}}, "hyperparams": {name: value}}``."""
        return {
            "state": {i: {k: _copy_value(v) for k, v in s.items()} for i, s in self.state.items()},
            "hyperparams": {name: getattr(self, name) for name in self.HYPERPARAMS},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore state and hyper-parameters saved by ``state_dict`` (arrays are copied).

        Arrays move to the array module of the parameter they belong to. A
        ValueError names anything that does not fit this optimizer.
        """
        name = type(self).__name__
        if set(state_dict) != {"state", "hyperparams"}:
            raise ValueError(
                f"{name}.load_state_dict needs keys 'state' and 'hyperparams', got {sorted(state_dict)}"
            )
        hyper = state_dict["hyperparams"]
        if set(hyper) != set(self.HYPERPARAMS):
            raise ValueError(
                f"{name}.load_state_dict: hyper-parameters {sorted(hyper)} do not match {sorted(self.HYPERPARAMS)}"
            )
        new_state: dict[int, dict[str, Any]] = {}
        for index, entry in state_dict["state"].items():
            if not isinstance(index, (int, np.integer)) or not 0 <= index < len(self.params):
                raise ValueError(
                    f"{name}.load_state_dict: state index {index!r} is not in [0, {len(self.params)})"
                )
            param = self.params[int(index)]
            xp = array_module(param.data)
            restored: dict[str, Any] = {}
            for key, value in entry.items():
                if hasattr(value, "shape"):
                    if tuple(value.shape) != param.shape:
                        raise ValueError(
                            f"{name}.load_state_dict: state[{index}][{key!r}] has shape {tuple(value.shape)}, "
                            f"parameter {param.name or index} has shape {param.shape}"
                        )
                    restored[key] = to_host(value).copy() if xp is np else xp.array(value, copy=True)
                else:
                    restored[key] = value
            new_state[int(index)] = restored
        old = {k: getattr(self, k) for k in self.HYPERPARAMS}
        for key, value in hyper.items():
            setattr(self, key, value)
        try:
            self._validate()
        except ValueError:
            for key, value in old.items():
                setattr(self, key, value)
            raise
        self.state = new_state

    def param_key(self, index: int) -> str:
        """The name of parameter ``index``'s state in checkpoints: the parameter's ``name`` (its index when it has
        none); a later parameter of the same name (the chunks of a pipeline name theirs alike) gets
        ``name#n`` for the n-th repeat, so no two parameters share state."""
        return self.param_keys()[index]

    def param_keys(self) -> list[str]:
        """:meth:`param_key` of every parameter, in order (one pass)."""
        keys: list[str] = []
        repeats: dict[str, int] = {}
        for i, p in enumerate(self.params):
            base = p.name or str(i)
            n = repeats.get(base, 0)
            repeats[base] = n + 1
            keys.append(f"{base}#{n}" if n else base)
        return keys

    def _state_keys(self, index: int, param: Parameter, key: str) -> dict[str, str]:
        """``{checkpoint key: state name}`` of ``param``'s state (see :meth:`sharded_state_dict`)."""
        out: dict[str, str] = {}
        for name, value in self.state.get(index, {}).items():
            if hasattr(value, "shape") and param.layout is not None:
                out.update({f"state.{e.key}.{name}": name for e in param.layout.entries})
            else:
                out[f"state.{key}.{name}"] = name
        return out

    def sharded_state_dict(self) -> dict[str, Any]:
        """State and hyper-parameters for checkpoints, keyed ``state.<param>.<name>`` / ``hyperparams.<name>``
        (``<param>`` is :meth:`param_key`).

        Arrays of a parameter with a ``layout`` (an FSDP flat shard) become per-original-parameter
        ``ShardedArray`` views (keyed by the original names, so they reshard); those of a tensor-parallel
        slice (``Parameter.shard``) the dense array's piece this rank writes (a collective for a slice of the
        last axis); other arrays are whole (replicated). Values are live: a loader writes into them.
        """
        out: dict[str, Any] = {f"hyperparams.{k}": getattr(self, k) for k in self.HYPERPARAMS}
        for i, (p, key) in enumerate(zip(self.params, self.param_keys(), strict=True)):
            # Sorted: ranks that created state in another order still run a sliced array's collectives alike.
            for name, value in sorted(self.state.get(i, {}).items()):
                if hasattr(value, "shape") and p.layout is not None:
                    for original, piece in p.layout.views(value.reshape(-1)).items():
                        out[f"state.{original}.{name}"] = piece
                elif hasattr(value, "shape") and getattr(p, "shard", None) is not None:
                    out[f"state.{key}.{name}"] = p.shard.entry(value)
                else:
                    out[f"state.{key}.{name}"] = value
        return out

    def ensure_state(self, index: int, arrays: Iterable[str], values: dict[str, Any]) -> None:
        """Give parameter ``index`` zero arrays named ``arrays`` and the scalar ``values`` if it has no state
        (a checkpoint loader fills them in place afterwards)."""
        if index in self.state:
            return
        p = self.params[index]
        xp = array_module(p.data)
        self.state[index] = {**{n: xp.zeros_like(p.data) for n in sorted(arrays)}, **values}

    def load_sharded_state_dict(self, state: dict[str, Any], *, drop: Iterable[str] = ()) -> None:
        """Take hyper-parameters and scalar state from ``state`` (arrays were loaded in place; a tensor-parallel
        slice's from the dense array, a collective like :meth:`sharded_state_dict`).

        ``drop`` names state keys the checkpoint did not have: those parameters get no state. A parameter
        whose scalar state (AdamW's ``step``) the checkpoint names under another layout (an FSDP flat shard
        loaded unsharded, or back) takes the value every saved parameter has; ValueError if they differ.
        """
        for key in self.HYPERPARAMS:
            if f"hyperparams.{key}" in state:
                value = state[f"hyperparams.{key}"]
                setattr(self, key, tuple(value) if isinstance(value, list) else value)
        self._validate()
        dropped = set(drop)
        saved: dict[str, list[Any]] = {}  # scalar state name -> every value saved under it
        for key, value in state.items():
            if (
                key.startswith("state.")
                and not hasattr(value, "shape")
                and not hasattr(value, "global_shape")
            ):
                saved.setdefault(key.rsplit(".", 1)[1], []).append(value)
        for i, (p, key) in enumerate(zip(self.params, self.param_keys(), strict=True)):
            if set(self._state_keys(i, p, key)) & dropped:
                self.state.pop(i, None)
                continue
            if i not in self.state:
                continue
            mine = self.state[i]
            for name, value in sorted(mine.items()):
                if hasattr(value, "shape") and getattr(p, "shard", None) is not None and p.layout is None:
                    p.shard.load(value, state[f"state.{key}.{name}"])
            for name, values in saved.items():
                if f"state.{key}.{name}" in state:
                    mine[name] = state[f"state.{key}.{name}"]
                elif all(v == values[0] for v in values):
                    mine[name] = values[0]
                else:
                    raise ValueError(
                        f"{type(self).__name__}: the checkpoint has no {name!r} for parameter {key} and the "
                        f"saved ones differ ({sorted(set(map(str, values)))[:4]})"
                    )

    def __repr__(self) -> str:
        hyper = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.HYPERPARAMS)
        return f"{type(self).__name__}({len(self.params)} params, {hyper})"
