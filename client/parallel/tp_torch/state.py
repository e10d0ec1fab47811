"""How a tensor-parallel torch parameter relates to the dense one, and the dense / checkpoint views of a module.

A sharded parameter carries ``tp_shard`` (a ``TPShard``): the dense tensor's dimension ``dim`` is ``parts``
equal blocks (1, or 3 for GPT-2's fused q/k/v projection), and each block is split into ``group.size`` equal
pieces; a rank holds its piece of every block, concatenated. Everything else in the module is replicated.

``tp_full_state_dict(module)`` gives the dense state under the plain model's keys (a collective over each
sharded parameter's group). ``tp_sharded_state_dict`` / ``tp_load_sharded_state_dict`` are what
``pp.checkpoint`` reads: a parameter split along rows (``dim`` 0, one block) is a contiguous range of the
dense array and is described in place; any other sharded parameter (a column split, a fused q/k/v block) is
gathered over the group and each rank describes its equal range of the dense flat array (on load: each
rank reads its range, and the ranges are gathered and cut into pieces again), so no rank writes or reads
the whole array. The checkpoint holds the dense model, so it loads at any tensor-parallel size and into the
plain model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paramplane.group import ProcessGroup
from paramplane.parallel.sharding import ShardedArray
from paramplane.parallel.torch_params import to_array, to_tensor, torch_stream

__all__ = ["TPShard", "tp_full_state_dict", "tp_load_sharded_state_dict", "tp_sharded_state_dict"]


@dataclass(frozen=True, eq=False)
class TPShard:
    """This rank's piece of a dense tensor of ``global_shape`` (see the module docstring)."""

    global_shape: tuple[int, ...]
    """The dense tensor's shape."""
    dim: int
    """The split dimension."""
    parts: int
    """Equal blocks of ``dim`` split separately (3 for a fused q/k/v projection)."""
    group: ProcessGroup
    """The tensor-parallel group."""
    experts: bool = False
    """Expert parallel (``experts.py``): the ranks of ``group`` hold different tokens, and each rank's piece
    (its experts) gets its gradient from every rank's tokens; a data-parallel wrapper over ``group`` does not
    average it over the group."""

    def __post_init__(self) -> None:
        n = self.global_shape[self.dim]
        if n % (self.parts * self.group.size):
            raise ValueError(
                f"dimension {self.dim} of size {n} does not split into {self.parts} block(s) over "
                f"{self.group.size} tensor-parallel ranks"
            )

    @property
    def piece(self) -> int:
        """The size of this rank's piece of one block."""
        return self.global_shape[self.dim] // (self.parts * self.group.size)

    def same_as(self, other: TPShard) -> bool:
        return (self.global_shape, self.dim, self.parts, self.group, self.experts) == (
            other.global_shape,
            other.dim,
            other.parts,
            other.group,
            other.experts,
        )

    def local_of(self, dense: Any) -> Any:
        """This rank's piece of ``dense`` (a new contiguous tensor)."""
        import torch

        block, k, r = self.global_shape[self.dim] // self.parts, self.piece, self.group.rank
        pieces = [dense.narrow(self.dim, j * block + r * k, k) for j in range(self.parts)]
        return torch.cat(pieces, self.dim).contiguous()

    def dense_of(self, local: Any) -> Any:
        """The dense tensor from every rank's ``local`` (a collective over ``group``)."""
        local = local.detach()
        if self.group.size == 1:
            return local.clone()
        front = local.movedim(self.dim, 0).contiguous()
        with torch_stream(front):
            gathered = to_tensor(self.group.all_gather(to_array(front, "a tensor-parallel parameter")))
        rest = tuple(front.shape[1:])
        blocks = gathered.reshape(self.group.size, self.parts, self.piece, *rest).transpose(0, 1)
        return blocks.reshape(-1, *rest).movedim(0, self.dim).contiguous()

    @property
    def in_place(self) -> bool:
        """Whether a rank's piece is one contiguous range of the dense tensor."""
        return self.dim == 0 and self.parts == 1

    def entry(self, local: Any) -> ShardedArray:
        """The piece of the dense array this rank offers a checkpoint: a view of ``local`` when in place,
        else this rank's equal range of the dense flat array (a collective over ``group``)."""
        if self.in_place:
            flat = to_array(local.detach(), "a tensor-parallel parameter").reshape(-1)
            return ShardedArray(self.global_shape, self.group.rank * int(local.numel()), flat)
        n = int(local.numel())  # the dense numel over group.size, as every piece
        mine = self.dense_of(local).reshape(-1)[self.group.rank * n : (self.group.rank + 1) * n].clone()
        return ShardedArray(
            self.global_shape, self.group.rank * n, to_array(mine, "a tensor-parallel parameter")
        )

    def load(self, local: Any, entry: ShardedArray) -> None:
        """Set ``local`` from ``entry`` (what ``entry`` gave, filled by a loader)."""
        if self.in_place:
            return  # filled in place through the view
        import torch

        mine = to_tensor(entry.local).to(device=local.device, dtype=local.dtype).contiguous()
        if self.group.size > 1:
            with torch_stream(mine):
                mine = to_tensor(self.group.all_gather(to_array(mine, "a tensor-parallel parameter")))
        with torch.no_grad():
            local.copy_(self.local_of(mine.reshape(self.global_shape)))


def _shard_of(t: Any) -> TPShard | None:
    return getattr(t, "tp_shard", None)


def tp_full_state_dict(module: Any) -> dict[str, Any]:
    """The dense ``state_dict`` of a module that ``pp.parallelize`` split, under the plain model's keys (a
    collective over the tensor-parallel group: every rank of it calls this). Tied tensors stay one tensor."""
    dense: dict[int, Any] = {}
    out: dict[str, Any] = {}
    for key, t in module.state_dict(keep_vars=True).items():
        spec = _shard_of(t)
        if spec is None:
            out[key] = t.detach()
            continue
        if id(t) not in dense:
            dense[id(t)] = spec.dense_of(t)
        out[key] = dense[id(t)]
    return out


def tp_sharded_state_dict(module: Any) -> dict[str, Any]:
    """What ``pp.checkpoint`` saves and fills for a tensor-parallel module: ShardedArrays for its sharded
    parameters, the replicated tensors whole (every key of the plain model's ``state_dict``)."""
    out: dict[str, Any] = {}
    for key, t in module.state_dict(keep_vars=True).items():
        spec = _shard_of(t)
        out[key] = spec.entry(t) if spec is not None else t.detach()
    return out


def tp_load_sharded_state_dict(module: Any, state: dict[str, Any]) -> None:
    """Finish loading what ``tp_sharded_state_dict`` gave a checkpoint loader (filled in place)."""
    for key, t in module.state_dict(keep_vars=True).items():
        spec = _shard_of(t)
        if spec is not None and key in state:
            spec.load(t, state[key])
