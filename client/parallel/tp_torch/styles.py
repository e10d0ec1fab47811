"""The tensor-parallel styles a plan names, and what each does to one torch module.

A style keeps the module (its class, its parameter names, the user's hooks): it swaps the module's parameters
for this rank's pieces (each carrying a ``TPShard``), sets the size attributes the module's own code reads
(``out_features``, Conv1D's ``nf``, ...) to the local sizes, and binds a forward that adds the communication:

- ``ColwiseParallel``: output features split; forward f (identity, gradient all-reduced) then the local
  product; ``gather_output`` all-gathers the output (else it stays split, e.g. heads or vocabulary logits).
- ``RowwiseParallel``: input features split; forward the local product then g (all-reduce), the replicated
  bias added once; ``input_is_parallel=False`` splits a full input first.
- ``VocabParallel``: an embedding's rows split; ids outside this rank's range look up zeros, then g.

They apply to ``torch.nn.Linear`` and transformers' ``Conv1D`` (GPT-2's linear with a transposed weight,
``(in, out)``); ``VocabParallel`` to ``torch.nn.Embedding``.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

from paramplane.group import ProcessGroup
from paramplane.parallel.tp_torch.comm import SharedCopy, gather_last, reduce_from, scatter_last
from paramplane.parallel.tp_torch.state import TPShard

__all__ = ["STYLES", "ColwiseParallel", "RowwiseParallel", "Style", "VocabParallel", "resolve_style"]


@dataclass(frozen=True)
class ColwiseParallel:
    """Split a linear layer's output features over the tensor-parallel group."""

    gather_output: bool = False
    """All-gather the output along its last dimension (the full output on every rank)."""
    parts: int = 1
    """The output features are this many equal blocks, each split separately (3 for a fused q/k/v
    projection such as GPT-2's ``c_attn``, so that every rank holds whole heads of q, k and v)."""

    def __post_init__(self) -> None:
        if isinstance(self.parts, bool) or not isinstance(self.parts, int) or self.parts < 1:
            raise ValueError(f"ColwiseParallel.parts must be a positive integer, got {self.parts!r}")


@dataclass(frozen=True)
class RowwiseParallel:
    """Split a linear layer's input features over the tensor-parallel group (its output all-reduced)."""

    input_is_parallel: bool = True
    """The input is already this rank's slice (a column layer's split output); False: split a full input."""


@dataclass(frozen=True)
class VocabParallel:
    """Split an embedding's rows (the vocabulary) over the tensor-parallel group."""


Style = ColwiseParallel | RowwiseParallel | VocabParallel
STYLES: dict[str, Style] = {
    "colwise": ColwiseParallel(),
    "rowwise": RowwiseParallel(),
    "vocab": VocabParallel(),
}


def resolve_style(value: Any, pattern: str) -> Style:
    if isinstance(value, (ColwiseParallel, RowwiseParallel, VocabParallel)):
        return value
    if isinstance(value, str) and value in STYLES:
        return STYLES[value]
    if value == "sequence":
        raise ValueError(
            f"plan entry {pattern!r}: the 'sequence' style (Megatron sequence parallel) is not implemented yet; "
            "leave LayerNorm/dropout regions replicated"
        )
    raise ValueError(
        f"plan entry {pattern!r}: unknown style {value!r}; use one of {sorted(STYLES)} or "
        "pp.ColwiseParallel(...) / pp.RowwiseParallel(...) / pp.VocabParallel()"
    )


def kind_of(module: Any) -> str:
    """'linear', 'conv1d' (transformers' transposed linear) or 'embedding'; ValueError for anything else."""
    import torch

    if isinstance(module, torch.nn.Linear):
        return "linear"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx"):
        return "conv1d"
    if isinstance(module, torch.nn.Embedding):
        return "embedding"
    return type(module).__name__


def _where(style: Style, kind: str) -> tuple[str, int, int]:
    """(size attribute, weight dimension split, bias dimension split or -1 for a replicated bias)."""
    col = isinstance(style, ColwiseParallel)
    if kind == "linear":
        return ("out_features", 0, 0) if col else ("in_features", 1, -1)
    return ("nf", 1, 0) if col else ("nx", 0, -1)  # conv1d: weight (in, out)


def check(name: str, module: Any, style: Style, tp: int) -> None:
    """ValueError unless ``style`` applies to ``module`` at tensor-parallel size ``tp``."""
    kind = kind_of(module)
    what = type(style).__name__
    if isinstance(style, VocabParallel):
        if kind != "embedding":
            raise ValueError(f"VocabParallel applies to torch.nn.Embedding; {name!r} is {kind}")
        if module.max_norm is not None:
            raise ValueError(
                f"VocabParallel: {name!r} has max_norm (renormalising in place) which is not supported"
            )
        if module.num_embeddings % tp:
            raise ValueError(
                f"vocabulary of {name!r} ({module.num_embeddings} rows) does not split over tp={tp} ranks: "
                f"pad the vocabulary to a multiple of {tp}"
            )
        return
    if kind not in ("linear", "conv1d"):
        raise ValueError(f"{what} applies to torch.nn.Linear and transformers' Conv1D; {name!r} is {kind}")
    attr, _, _ = _where(style, kind)
    parts = style.parts if isinstance(style, ColwiseParallel) else 1
    size = int(getattr(module, attr))
    if size % (parts * tp):
        blocks = f" in {parts} blocks" if parts > 1 else ""
        raise ValueError(
            f"{what}: {name!r} has {attr}={size}, which does not split{blocks} over tp={tp} ranks"
        )


def _swap(module: Any, attr: str, spec: TPShard, done: dict[int, Any]) -> None:
    """Replace ``module.<attr>`` by this rank's piece; a parameter tied to one already split shares its piece."""
    import torch

    old = getattr(module, attr)
    if id(old) in done:
        new, old_spec = done[id(old)]
        if not old_spec.same_as(spec):
            raise ValueError(
                f"a tied parameter ({attr} of {type(module).__name__}) is split two different ways by the plan"
            )
    else:
        with torch.no_grad():
            new = torch.nn.Parameter(spec.local_of(old.detach()), requires_grad=old.requires_grad)
        new.tp_shard = spec  # type: ignore[attr-defined]
        done[id(old)] = (new, spec)
    setattr(module, attr, new)


def apply(module: Any, style: Style, group: ProcessGroup, copy: SharedCopy, done: dict[int, Any]) -> None:
    """Split ``module`` (checked by ``check``) in place; ``done`` maps already-split parameters (ties)."""
    kind = kind_of(module)
    tp = group.size
    if isinstance(style, VocabParallel):
        _swap(module, "weight", TPShard(tuple(module.weight.shape), 0, 1, group), done)
        rows = module.num_embeddings // tp
        lo = group.rank * rows
        pad = module.padding_idx
        module.padding_idx = pad - lo if pad is not None and lo <= pad < lo + rows else None
        module.num_embeddings = rows
        module.forward = types.MethodType(_vocab_forward(group, lo), module)
        return
    attr, wdim, bdim = _where(style, kind)
    parts = style.parts if isinstance(style, ColwiseParallel) else 1
    _swap(module, "weight", TPShard(tuple(module.weight.shape), wdim, parts, group), done)
    if module.bias is not None and bdim >= 0:
        _swap(module, "bias", TPShard(tuple(module.bias.shape), bdim, parts, group), done)
    setattr(module, attr, int(getattr(module, attr)) // tp)
    if isinstance(style, ColwiseParallel):
        module.forward = types.MethodType(_col_forward(kind, copy, group, style.gather_output), module)
    else:
        module.forward = types.MethodType(_row_forward(kind, group, style.input_is_parallel), module)


def _product(kind: str, module: Any, x: Any, bias: Any) -> Any:
    import torch

    if kind == "linear":
        return torch.nn.functional.linear(x, module.weight, bias)
    out = x.reshape(-1, x.shape[-1]) @ module.weight  # Conv1D: weight (in, out)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], module.weight.shape[1])


def _col_forward(kind: str, copy: SharedCopy, group: ProcessGroup, gather: bool) -> Any:
    def forward(self: Any, x: Any) -> Any:
        y = _product(kind, self, copy(x), self.bias)
        return gather_last(y, group) if gather else y

    return forward


def _row_forward(kind: str, group: ProcessGroup, input_is_parallel: bool) -> Any:
    def forward(self: Any, x: Any) -> Any:
        if not input_is_parallel:
            x = scatter_last(x, group)
        y = reduce_from(_product(kind, self, x, None), group)
        return y + self.bias if self.bias is not None else y

    return forward


def _vocab_forward(group: ProcessGroup, lo: int) -> Any:
    def forward(self: Any, ids: Any) -> Any:
        import torch

        outside = (ids < lo) | (ids >= lo + self.num_embeddings)
        local = (ids - lo).masked_fill(outside, 0)
        out = torch.nn.functional.embedding(
            local, self.weight, self.padding_idx, None, self.norm_type, self.scale_grad_by_freq, self.sparse
        )
        return reduce_from(out.masked_fill(outside.unsqueeze(-1), 0), group)

    return forward
