"""A ``torch.optim`` optimizer over this rank's pipeline stages as checkpoint state that loads at any split
(``pp.pipeline_optim_state(stages, opt)``, or ``pipe.optim_state(opt)``).

Each stage is offered through the optimizer state its kind already has: a bare or tensor-parallel stage through
``pp.tp_optim_state`` (the dense array of each moment, in place or gathered on tp rank 0), an ``pp.FSDP``-wrapped
one through ``fsdp.optim_state`` (shards). A ``pipeline_split`` stage names its parameters as the whole model
does, so the keys (``state.<parameter name>.<state name>``, ``scalar.step``) are those of the dense model's
optimizer: a checkpoint saved at pp 2 loads at pp 1, at another cut or into the unsplit model's optimizer
(``pp.tp_optim_state(model, opt)``). A weight tied across stages (GPT-2's embedding and head) is saved under
its first name in the model (``transformer.wte.weight``) from every stage holding it: its copies step on the same
summed gradient, so their moments are replicas, written once (the checkpoint checks they agree). Under FSDP the
two stages cut the copies into different shards, so there each tied moment is offered whole (summed from the
shards over the FSDP shard group when offered; its piece taken back into the shard at load).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from paramplane.node.arrays import array_module
from paramplane.parallel.pipeline.torch_stage import STAGE_ATTR
from paramplane.parallel.sharding import ShardedArray

__all__ = ["PipelineOptimState", "pipeline_optim_state"]


def _renamer(names: dict[str, str]) -> Any:
    """``state.<name>.<state>`` keys with ``name`` replaced by ``names[name]`` where it is there."""

    def rename(key: str) -> str:
        if key.startswith("state."):
            param, _, what = key[len("state.") :].rpartition(".")
            if param in names:
                return f"state.{names[param]}.{what}"
        return key

    return rename


def _param(key: str) -> str:
    """The parameter name of a ``state.<name>.<state>`` key ("" for other keys)."""
    return key[len("state.") :].rpartition(".")[0] if key.startswith("state.") else ""


class PipelineOptimState:
    """Checkpoint state (``sharded_state_dict`` / ``load_sharded_state_dict``) of ``optimizer`` over this rank's
    stage modules (see the module docstring)."""

    def __init__(
        self, stages: Sequence[Any], optimizer: Any, state_arrays: tuple[str, ...] | None = None
    ) -> None:
        from paramplane.parallel.ddp import DDP
        from paramplane.parallel.fsdp import TorchFSDP
        from paramplane.parallel.tp_torch import tp_optim_state

        if not stages:
            raise ValueError(
                "pipeline_optim_state needs this rank's stage modules (one, or a list of chunks)"
            )
        self._parts: list[tuple[Any, Any, Any, Any]] = []
        for stage in stages:
            inner = stage.module if isinstance(stage, (DDP, TorchFSDP)) else stage
            info = getattr(inner, STAGE_ATTR, None)
            tied = {name: first for first, (name, _) in (info.tied if info is not None else {}).items()}
            back = {first: name for name, first in tied.items()}
            if isinstance(stage, TorchFSDP):
                if any(getattr(p, "tp_shard", None) is not None for p in inner.parameters()):
                    raise ValueError(
                        "pipeline_optim_state: optimizer state of pp.FSDP over a tensor-parallel stage is not "
                        "supported (its shards cut tp pieces, which do not reshard): use pp.DDP over dp there"
                    )
                part = stage.optim_state(optimizer, state_arrays=state_arrays)
            else:
                part = tp_optim_state(inner, optimizer, state_arrays=state_arrays)
            whole = (stage.shard_group, set(tied)) if isinstance(stage, TorchFSDP) and tied else None
            self._parts.append((part, _renamer(tied), _renamer(back), whole))
        self._whole: list[tuple[Any, Any]] = []  # (FSDP piece, the whole array offered for it)

    def sharded_state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        self._whole = []
        for part, rename, _, tied in self._parts:
            for key, value in part.sharded_state_dict().items():
                name = rename(key)
                if tied is not None and _param(key) in tied[1] and isinstance(value, ShardedArray):
                    group = tied[0]
                    whole = array_module(value.local).zeros(value.numel, value.dtype)
                    whole[value.start : value.stop] = value.local
                    group.all_reduce(whole, "sum")  # the shards' disjoint pieces: the whole moment
                    self._whole.append((value, whole))
                    value = whole.reshape(value.global_shape)
                out.setdefault(name, value)  # a weight two chunks of this rank share: once
        return out

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        for piece, whole in self._whole:  # filled by the loader: this shard's piece of it
            piece.local[...] = whole[piece.start : piece.stop]
        for part, _, back, _ in self._parts:
            part.load_sharded_state_dict({back(k): v for k, v in state.items()})


def pipeline_optim_state(
    stages: Any, optimizer: Any, *, state_arrays: tuple[str, ...] | None = None
) -> PipelineOptimState:
    """``optimizer``'s state over this rank's pipeline ``stages`` (a stage module or a list of chunks: bare,
    ``pp.parallelize``-d, or ``pp.FSDP``-wrapped, as given to ``pp.Pipeline``) as checkpoint state under the
    dense model's keys: ``pp.checkpoint.save({"model": stage, "optim": pp.pipeline_optim_state(stage, opt)},
    path, group)`` loads at another split or pipeline size. ``state_arrays`` names the optimizer's per-parameter
    state tensors where paramplane does not know them (to load into an optimizer that has not stepped)."""
    from paramplane.parallel.torch_params import is_torch_module

    single = is_torch_module(stages) or is_torch_module(getattr(stages, "module", None))
    return PipelineOptimState([stages] if single else list(stages), optimizer, state_arrays)
