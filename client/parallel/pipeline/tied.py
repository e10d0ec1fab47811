"""Parameters tied across pipeline stages (``pipeline_split`` of a model whose embedding is its head's weight):
each holder keeps a copy, and the copies stay bit-identical because every holder gets the same gradient bits.

The gradient of a tied weight is its holders' sum (Megatron's embedding all-reduce), averaged over the
data-parallel replicas. Reducing it with the rest of each stage would not give the copies equal bits: the
holders' stages reduce over different dp groups, inside flat buffers where the weight sits at different
offsets, and a ring (or NCCL) groups an element's dp addends by the chunk it falls in, so at dp >= 3 the two
copies would be summed in different orders and drift apart in the last bits, step after step. So the tied
gradients are held out of the stages' dp reduction (DDP's flat: left out; FSDP's: zeros in their place) and
reduced on their own, in an order the same on every holder: an all-reduce over the stage's dp group (one
collective: every member gets the same bits), then an all-reduce over the holders (the same inputs on every
holder and dp replica), then the mean's division. The result is set as the parameter's gradient, or, for a
``pp.FSDP`` stage, added into each piece of the shards' gradients that the parameter occupies.
Cost: under FSDP the tied weight's gradient is all-reduced over dp besides its (zero) part of the
reduce-scatter; under DDP it is the same bytes, in a collective of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from paramplane.group import ProcessGroup
from paramplane.parallel.fsdp.torch_adapter import _torch_dtype
from paramplane.parallel.pipeline.torch_stage import STAGE_ATTR
from paramplane.parallel.torch_params import to_array, to_tensor


class TiedWeights:
    """This rank's parameters that ``pipeline_split`` also left on another rank (module docstring): ``hold``
    before the stages' data-parallel reduction, ``reduce`` after it."""

    def __init__(self, stages: Sequence[Any], group: ProcessGroup) -> None:
        self.syncs: list[tuple[ProcessGroup, list[tuple[Any, Any, str]]]] = []
        """Per set of holder ranks: its group and (tensor, the FSDP around its stage or None, its name there)."""
        p = group.size
        mine: dict[str, list[tuple[Any, Any, str]]] = {}
        holders: dict[str, tuple[int, ...]] = {}
        for stage in stages:
            info = getattr(stage.module, STAGE_ATTR, None)
            if info is None:
                continue
            params = dict(stage.module.named_parameters(remove_duplicate=False))
            for key, (name, stage_ids) in sorted(info.tied.items()):
                if id(params[name]) not in {id(t) for t, _, _ in mine.get(key, [])}:
                    mine.setdefault(key, []).append((params[name], stage.fsdp, name))
                holders[key] = stage_ids
        by_ranks: dict[tuple[int, ...], list[tuple[Any, Any, str]]] = {}
        for key in sorted(holders):
            ranks = tuple(sorted({s % p for s in holders[key]}))
            if len(ranks) > 1:
                by_ranks.setdefault(ranks, []).extend(mine[key])
        for ranks, tensors in sorted(by_ranks.items()):
            self.syncs.append((group.new_subgroup(list(ranks)), tensors))

    def hold(self) -> list[Any]:
        """Take the tied gradients (accumulated over the microbatches) out of the parameters, so that the
        stages' dp reduction leaves them out (DDP) or reduces zeros in their place (FSDP); one flat tensor per
        holder set, for ``reduce``."""
        import torch

        held = []
        for _, entries in self.syncs:
            grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t, _, _ in entries]
            # an FSDP stage's in its master dtype (float32 under bfloat16 compute), as FSDP reduces it
            dtypes = [t.dtype if f is None else _torch_dtype(f.master_dtype) for t, f, _ in entries]
            held.append(torch.cat([g.reshape(-1).to(d) for g, d in zip(grads, dtypes)]))
            for t, _, _ in entries:
                t.grad = None
        return held

    def reduce(self, held: list[Any], dp: ProcessGroup | None) -> None:
        """After the stages' dp reduction: sum ``held`` over ``dp``, then over the holders, divide by the dp
        size, and give each parameter its gradient (an FSDP stage: added into its shards' gradient pieces)."""
        for (sub, entries), flat in zip(self.syncs, held):
            replicas = dp.size if dp is not None else 1
            if replicas > 1:
                assert dp is not None
                dp.all_reduce(to_array(flat, "tied gradients"), "sum")
            sub.all_reduce(to_array(flat, "tied gradients"), "sum")
            if replicas > 1:
                flat /= replicas
            start = 0
            for t, fsdp, name in entries:
                piece = flat[start : start + t.numel()]
                start += t.numel()
                if fsdp is None:
                    t.grad = piece.view_as(t).to(t.dtype, copy=True)
                else:
                    _add_to_shards(fsdp, name, piece)


def _add_to_shards(fsdp: Any, name: str, grad: Any) -> None:
    """Add ``grad`` (the parameter ``name``'s whole flat gradient) into this rank's pieces of it in ``fsdp``'s
    shard gradients (which the dp reduction just set)."""
    for unit in fsdp.units:
        for e in unit.shard.layout.entries:
            if e.key != name or not e.size:
                continue
            assert unit.shard.grad is not None, "the FSDP stage's gradient sync ran before the tied gradients"
            g = to_tensor(unit.shard.grad)
            g[e.offset : e.offset + e.size] += grad[e.start : e.start + e.size].to(g.dtype)
