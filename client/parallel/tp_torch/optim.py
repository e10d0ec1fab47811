"""A ``torch.optim`` optimizer over a tensor-parallel module as checkpoint state that reshards across tp sizes
(``model.optim_state(opt)`` on what ``pp.parallelize`` returned, or ``pp.tp_optim_state(model, opt)``).

The optimizer steps this rank's pieces, so its per-parameter tensors (Adam's ``exp_avg`` / ``exp_avg_sq``,
SGD's ``momentum_buffer``, ...) are pieces split like their parameters. Each is offered to the checkpoint as
the dense array it is a piece of, exactly as the parameter is (``TPShard.entry``: in place for a row split,
each rank's equal range of the gathered dense array otherwise), keyed ``state.<parameter name>.<state name>``; a replicated
parameter's state is offered whole. The checkpoint thus holds the dense optimizer state: it loads at any
tensor-parallel size and into the plain model's optimizer (``pp.tp_optim_state(plain_model, opt)``), and its
keys are those of ``fsdp.optim_state(opt)`` and of ``paramplane.optim`` optimizers. Scalar state (Adam's
``step``) is saved once as ``scalar.<name>`` and set on every parameter's state at load; the param groups'
hyperparameters (learning rate, betas, ...) are saved as ``param_groups`` and set at load, as FSDP's are.

torch optimizers create their state at the first ``step()``; to load into a fresh one, the state tensors are
created as zeros first: those named in ``STATE_ARRAYS`` for the optimizer's class, or ``state_arrays=``.
"""

from __future__ import annotations

from typing import Any

from paramplane.parallel.fsdp.optim_state import (
    load_param_groups,
    param_groups_of,
    state_arrays_of,
    zero_state,
)

__all__ = ["TPOptimState", "tp_optim_state"]


class TPOptimState:
    """Checkpoint state (``sharded_state_dict`` / ``load_sharded_state_dict``) of ``optimizer`` over the
    parameters of ``module`` (split by ``pp.parallelize`` or plain) that it steps."""

    def __init__(self, module: Any, optimizer: Any, state_arrays: tuple[str, ...] | None = None) -> None:
        import torch

        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"tp_optim_state takes a torch.optim optimizer, got {type(optimizer).__name__}")
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self._params = [(n, p) for n, p in module.named_parameters() if id(p) in stepped]
        if not self._params:
            raise ValueError(
                f"the optimizer steps none of the parameters of {type(module).__name__}: build it over "
                "model.parameters() after pp.parallelize"
            )
        self.optimizer = optimizer
        self.state_arrays = state_arrays_of(optimizer, state_arrays)

    def _ensure_state(self) -> None:
        zero_state(self.optimizer, [p for _, p in self._params], self.state_arrays, "optim_state()")

    def _arrays(self, p: Any) -> list[tuple[str, Any]]:
        """The parameter's state tensors shaped like it, in name order (the same order on every rank)."""
        state = self.optimizer.state[p]
        return [
            (name, v)
            for name, v in sorted(state.items())
            if v is not None and hasattr(v, "shape") and tuple(v.shape) == tuple(p.shape)
        ]

    def sharded_state_dict(self) -> dict[str, Any]:
        """Every state tensor as its dense array (a collective over each split parameter's group)."""
        self._ensure_state()
        out: dict[str, Any] = {}
        for pname, p in self._params:
            spec = getattr(p, "tp_shard", None)
            arrays = self._arrays(p)
            for name, value in arrays:
                if not value.is_contiguous():
                    raise ValueError(f"optimizer state {name!r} of {pname!r} is not contiguous")
                out[f"state.{pname}.{name}"] = spec.entry(value) if spec is not None else value
            shaped = {name for name, _ in arrays}
            for name, value in self.optimizer.state[p].items():
                if name not in shaped and value is not None:  # the same for every parameter (a step count)
                    out[f"scalar.{name}"] = float(value)
        out["param_groups"] = param_groups_of(self.optimizer)
        return out

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Finish what the loader filled: split pieces' ranges are gathered and cut again; scalars and the
        param groups' hyperparameters set."""
        if "param_groups" in state:
            load_param_groups(self.optimizer, state["param_groups"])
        for pname, p in self._params:
            spec = getattr(p, "tp_shard", None)
            for name, value in self._arrays(p):
                key = f"state.{pname}.{name}"
                if spec is not None and key in state:
                    spec.load(value, state[key])
            for name, value in list(self.optimizer.state[p].items()):
                key = f"scalar.{name}"
                if key not in state:
                    continue
                if hasattr(value, "fill_"):
                    value.fill_(state[key])
                else:
                    self.optimizer.state[p][name] = type(value)(state[key])


def tp_optim_state(
    module: Any, optimizer: Any, *, state_arrays: tuple[str, ...] | None = None
) -> TPOptimState:
    """``optimizer``'s state over ``module`` (split by ``pp.parallelize``, or the plain model) as checkpoint
    state that loads at any tensor-parallel size: ``pp.checkpoint.save({"model": model, "optim":
    pp.tp_optim_state(model, opt)}, path, group)``. ``state_arrays`` names the optimizer's per-parameter
    state tensors where paramplane does not know them (to load into an optimizer that has not stepped)."""
    return TPOptimState(module, optimizer, state_arrays)
