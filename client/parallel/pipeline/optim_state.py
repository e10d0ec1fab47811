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

``pp.FSDP`` over a tensor-parallel stage (3-D with FSDP over dp) shards the tp pieces: FSDP's pieces of a piece
are no part of the dense array. There each tensor-parallel parameter's moment is first made whole over the shard
group (the tp-local array, as ``summon_full_params`` makes the parameter whole for the model's save) and then
offered as ``pp.tp_optim_state`` offers it, as its piece of the dense array (``TPShard.entry``); at load the
loaded piece is gathered over tp and cut into the tp-local array again (``TPShard.load``), whose FSDP piece goes
back into the shard. So the optimizer state saved at dp x pp x tp under FSDP loads at any other factorisation
and wrapper, and the reverse. The price: while saving or loading, each such rank holds its stage's tp-local
moments whole, one copy per state tensor (FSDP's saving on the optimizer state is suspended for the save).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from paramplane.node.arrays import array_module
from paramplane.parallel.pipeline.torch_stage import STAGE_ATTR
from paramplane.parallel.sharding import ShardedArray
from paramplane.parallel.torch_params import to_tensor

__all__ = ["PipelineOptimState", "pipeline_optim_state"]


@dataclass(frozen=True)
class _Whole:
    """An FSDP stage's parameters whose optimizer state is offered whole rather than as FSDP's pieces."""

    group: Any
    """The FSDP shard group (the pieces are summed over it)."""
    names: set[str]
    """The tied parameters (the stages shard their copies differently) and the tensor-parallel ones."""
    specs: dict[str, Any]
    """The ``TPShard`` of each tensor-parallel parameter: its whole (tp-local) array is offered as the dense
    array's piece, as ``pp.tp_optim_state`` offers it."""


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
                part = stage.optim_state(optimizer, state_arrays=state_arrays)
                shards = {n: getattr(p, "tp_shard", None) for n, p in inner.named_parameters()}
                specs = {n: spec for n, spec in shards.items() if spec is not None}
                whole = _Whole(stage.shard_group, set(tied) | set(specs), specs) if tied or specs else None
            else:
                part, whole = tp_optim_state(inner, optimizer, state_arrays=state_arrays), None
            self._parts.append((part, _renamer(tied), _renamer(back), whole))
        self._whole: list[tuple[ShardedArray, Any, Any, Any]] = []
        """Per FSDP piece offered whole: the piece, its whole array, and for a tensor-parallel piece its
        ``TPShard`` and the dense array's piece offered for it (else None, None)."""

    def _offer_whole(self, whole: _Whole, name: str, value: ShardedArray) -> Any:
        """What stands for the FSDP piece ``value`` of ``name``'s state: the whole array (summed from the
        shards' disjoint pieces over the shard group), as the dense array's piece for a tensor-parallel one."""
        full = array_module(value.local).zeros(value.numel, value.dtype)
        full[value.start : value.stop] = value.local
        whole.group.all_reduce(full, "sum")
        spec = whole.specs.get(name)
        if spec is None:
            self._whole.append((value, full, None, None))
            return full.reshape(value.global_shape)
        entry = spec.entry(to_tensor(full).reshape(value.global_shape))
        self._whole.append((value, full, spec, entry))
        return entry

    def sharded_state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        self._whole = []
        for part, rename, _, tied in self._parts:
            for key, value in part.sharded_state_dict().items():
                name = rename(key)
                if tied is not None and _param(key) in tied.names and isinstance(value, ShardedArray):
                    value = self._offer_whole(tied, _param(key), value)
                out.setdefault(name, value)  # a weight two chunks of this rank share: once
        return out

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        for piece, full, spec, entry in self._whole:  # filled by the loader: this shard's piece of it
            if spec is not None:  # the dense array's piece: the tp-local array, gathered over tp
                spec.load(to_tensor(full).reshape(piece.global_shape), entry)
            piece.local[...] = full[piece.start : piece.stop]
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
