"""A ``torch.optim`` optimizer over FSDP's shards as checkpoint state that reshards (``fsdp.optim_state(opt)``).

The optimizer steps this rank's flat shards (``fsdp.parameters()``), so its per-parameter tensors (Adam's
``exp_avg``, SGD's ``momentum_buffer``, ...) are flat shards too. Each is cut along the unit's layout into one
``ShardedArray`` per module parameter, keyed ``state.<module parameter name>.<state name>`` as a
``paramplane.optim`` optimizer's are: a checkpoint saved at one world size loads at another, and
``pp.checkpoint.load`` writes straight into the optimizer's tensors. Scalar state (Adam's ``step``) is saved
once as ``scalar.<name>`` (every shard holds the same count) and set on every shard at load.

torch optimizers create their state at the first ``step()``; to load into a fresh one, the state arrays are
created as zeros first: those named in ``STATE_ARRAYS`` for the optimizer's class, or ``state_arrays=``.

The hyperparameters of every param group (learning rate, betas, weight decay, ...: what torch's
``optimizer.state_dict()["param_groups"]`` holds, less the parameter ids) are saved as the plain (JSON)
value ``param_groups`` and set on the optimizer's groups at load (``param_groups_of`` /
``load_param_groups``, which tensor parallel's optimizer state uses too), so a resumed run continues at
the saved schedule's values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paramplane.parallel.sharding import ShardedArray
from paramplane.parallel.torch_params import to_array

__all__ = [
    "STATE_ARRAYS",
    "TorchOptimState",
    "load_param_groups",
    "param_groups_of",
    "state_arrays_of",
    "zero_state",
]

STATE_ARRAYS: dict[str, tuple[str, ...]] = {
    "Adam": ("exp_avg", "exp_avg_sq"),
    "AdamW": ("exp_avg", "exp_avg_sq"),
    "SGD": ("momentum_buffer",),
    "RMSprop": ("square_avg",),
    "Adagrad": ("sum",),
}
"""Per-parameter state tensors of torch optimizers by class name (Adam's ``max_exp_avg_sq`` with amsgrad)."""


def state_arrays_of(optimizer: Any, given: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """The per-parameter state tensors of ``optimizer``: ``given``, else ``STATE_ARRAYS``' for its class (with
    ``max_exp_avg_sq`` under amsgrad), else None (unknown)."""
    if given is not None:
        return given
    known = STATE_ARRAYS.get(type(optimizer).__name__)
    if known is not None and any(g.get("amsgrad") for g in optimizer.param_groups):
        return (*known, "max_exp_avg_sq")
    return known


def zero_state(optimizer: Any, tensors: list[Any], state_arrays: tuple[str, ...] | None, call: str) -> None:
    """Zero state for the ``tensors`` the optimizer has not stepped yet (a fresh optimizer a checkpoint fills);
    ``call`` names the user's call in the error when the state tensors are unknown."""
    import torch

    missing = [t for t in tensors if not optimizer.state.get(t)]
    if not missing:
        return
    if state_arrays is None:
        raise ValueError(
            f"{type(optimizer).__name__} has no state yet and paramplane does not know its state "
            f"tensors: pass state_arrays=(...) to {call}, or take one step before loading"
        )
    for t in missing:
        optimizer.state[t] = {
            "step": torch.tensor(0.0),
            **{name: torch.zeros_like(t, memory_format=torch.contiguous_format) for name in state_arrays},
        }


def _plain_value(value: Any, where: str) -> Any:
    """A hyperparameter as JSON: tensors as numbers (or lists), tuples as lists."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "tolist") and hasattr(value, "shape"):  # a tensor (a capturable lr)
        return value.detach().cpu().tolist()
    if isinstance(value, (tuple, list)):
        return [_plain_value(v, where) for v in value]
    raise ValueError(
        f"optimizer hyperparameter {where} is a {type(value).__name__}: only numbers, strings, None, "
        "tensors and tuples of them can be saved"
    )


def param_groups_of(optimizer: Any) -> list[dict[str, Any]]:
    """The hyperparameters of every param group of ``optimizer`` as JSON values (``param_groups`` of torch's
    ``state_dict()`` without ``params``)."""
    return [
        {k: _plain_value(v, f"{k!r} of param group {i}") for k, v in sorted(group.items()) if k != "params"}
        for i, group in enumerate(optimizer.param_groups)
    ]


def _restored(current: Any, saved: Any) -> Any:
    """``saved`` (JSON) in the form of ``current``: a tensor filled in place, a tuple again."""
    import torch

    if isinstance(current, torch.Tensor):
        with torch.no_grad():
            current.copy_(torch.as_tensor(saved, dtype=current.dtype))
        return current
    if isinstance(current, tuple) and isinstance(saved, list) and len(saved) == len(current):
        return tuple(_restored(c, s) for c, s in zip(current, saved, strict=True))
    if isinstance(saved, list):
        return tuple(saved)  # torch keeps sequences of hyperparameters (betas) as tuples
    return saved


def load_param_groups(optimizer: Any, saved: Any) -> None:
    """Set the hyperparameters ``param_groups_of`` saved on ``optimizer``'s groups (ValueError when the
    number of groups differs)."""
    groups = optimizer.param_groups
    if not isinstance(saved, list) or len(saved) != len(groups):
        num = len(saved) if isinstance(saved, list) else "no list of"
        raise ValueError(
            f"the checkpoint holds {num} optimizer param groups, {type(optimizer).__name__} has {len(groups)}"
        )
    for group, values in zip(groups, saved, strict=True):
        for key, value in values.items():
            if key != "params":
                group[key] = _restored(group.get(key), value)


class TorchOptimState:
    """Checkpoint state (``sharded_state_dict`` / ``load_sharded_state_dict``) of ``optimizer`` over an FSDP's
    ``slots``: each parameter it steps (a shard, or a piece of one) with the cut of an array shaped like it into
    ``ShardedArray``s by module parameter name."""

    def __init__(
        self,
        optimizer: Any,
        slots: list[tuple[Any, Callable[[Any], dict[str, ShardedArray]]]],
        state_arrays: tuple[str, ...] | None = None,
    ) -> None:
        import torch

        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optim_state takes a torch.optim optimizer, got {type(optimizer).__name__}")
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self._slots = [(tensor, cut) for tensor, cut in slots if id(tensor) in stepped]
        if not self._slots:
            raise ValueError(
                "the optimizer steps none of this FSDP's parameters: build it over fsdp.parameters()"
            )
        self.optimizer = optimizer
        self.state_arrays = state_arrays_of(optimizer, state_arrays)

    def _ensure_state(self) -> None:
        zero_state(self.optimizer, [t for t, _ in self._slots], self.state_arrays, "fsdp.optim_state()")

    def sharded_state_dict(self) -> dict[str, ShardedArray | Any]:
        self._ensure_state()
        out: dict[str, ShardedArray | Any] = {}
        for tensor, cut in self._slots:
            for name, value in sorted(self.optimizer.state[tensor].items()):
                if value is None:  # e.g. SGD's momentum_buffer without momentum
                    continue
                if hasattr(value, "shape") and tuple(value.shape) == tuple(tensor.shape):
                    flat = to_array(value, f"optimizer state {name!r}").reshape(-1)
                    for key, piece in cut(flat).items():
                        out[f"state.{key}.{name}"] = piece
                else:  # the same on every shard (a step count): saved once
                    out[f"scalar.{name}"] = float(value)
        out["param_groups"] = param_groups_of(self.optimizer)
        return out

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """The state arrays were written in place by the loader; scalar state is set on every shard and the
        saved hyperparameters on the param groups."""
        if "param_groups" in state:
            load_param_groups(self.optimizer, state["param_groups"])
        for tensor, _ in self._slots:
            for name, value in self.optimizer.state[tensor].items():
                key = f"scalar.{name}"
                if key in state and hasattr(value, "fill_"):
                    value.fill_(state[key])
                elif key in state:
                    self.optimizer.state[tensor][name] = type(value)(state[key])
