"""A ``torch.optim`` optimizer over FSDP's shards as checkpoint state that reshards (``fsdp.optim_state(opt)``).

The optimizer steps this rank's flat shards (``fsdp.parameters()``), so its per-parameter tensors (Adam's
``exp_avg``, SGD's ``momentum_buffer``, ...) are flat shards too. Each is cut along the unit's layout into one
``ShardedArray`` per module parameter, keyed ``state.<module parameter name>.<state name>`` as a
``paramplane.optim`` optimizer's are: a checkpoint saved at one world size loads at another, and
``pp.checkpoint.load`` writes straight into the optimizer's tensors. Scalar state (Adam's ``step``) is saved
once as ``scalar.<name>`` (every shard holds the same count) and set on every shard at load.

torch optimizers create their state at the first ``step()``; to load into a fresh one, the state arrays are
created as zeros first: those named in ``STATE_ARRAYS`` for the optimizer's class, or ``state_arrays=``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paramplane.parallel.sharding import ShardedArray
from paramplane.parallel.torch_params import to_array

__all__ = ["STATE_ARRAYS", "TorchOptimState", "state_arrays_of", "zero_state"]

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
        return out

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """The state arrays were written in place by the loader; scalar state is set on every shard."""
        for tensor, _ in self._slots:
            for name, value in self.optimizer.state[tensor].items():
                key = f"scalar.{name}"
                if key in state and hasattr(value, "fill_"):
                    value.fill_(state[key])
                elif key in state:
                    self.optimizer.state[tensor][name] = type(value)(state[key])
