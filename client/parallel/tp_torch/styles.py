"""The tensor-parallel styles a plan names, and what each does to one torch module.

A style keeps the module (its class, its parameter names, the user's hooks): it swaps the module's parameters
for this rank's pieces (each carrying a ``TPShard``), sets the size attributes the module's own code reads
(``out_features``, Conv1D's ``nf``, ...) to the local sizes, and binds a forward that adds the communication:

- ``ColwiseParallel``: output features split; forward f (identity, gradient all-reduced) then the local
  product; ``gather_output`` all-gathers the output (else it stays split, e.g. heads or vocabulary logits).
- ``RowwiseParallel``: input features split; forward the local product then g (all-reduce), the replicated
  bias added once; ``input_is_parallel=False`` splits a full input first.
- ``VocabParallel``: an embedding's rows split; ids outside this rank's range look up zeros, then g.
- ``ExpertParallel`` (``"experts"``): a fused mixture-of-experts module's experts split over a group whose
  ranks hold different tokens, each token sent to its experts' ranks and back (``experts.py``).
- ``SequenceParallel`` (Megatron sequence parallel, for LayerNorm / RMSNorm / dropout between the column/row
  pairs): the module runs unchanged on this rank's part of the sequence (dimension 1); its parameters'
  gradients are all-reduced over the group (each rank's covers its part of the sequence). With
  ``sequence_parallel=True`` a column layer all-gathers its sequence-split input (backward: reduce-scatter)
  instead of f, and a row layer (or the vocabulary embedding) reduce-scatters its output along the sequence
  instead of all-reducing it (backward: all-gather): the same bytes as the all-reduce, with the activations
  between the pairs split over tp. ``SequenceParallel(scatter_input=True)`` starts the region (it splits a
  full-sequence input: put it on the first block) and ``SequenceParallel(gather_output=True)`` ends it (the
  final norm: its output is all-gathered).

They apply to ``torch.nn.Linear`` and transformers' ``Conv1D`` (GPT-2's linear with a transposed weight,
``(in, out)``); ``VocabParallel`` to ``torch.nn.Embedding``.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

from paramplane.group import ProcessGroup
from paramplane.parallel.tp_torch.comm import (
    SharedCopy,
    all_reduce_,
    gather_last,
    gather_seq,
    leave_seq,
    reduce_from,
    reduce_scatter_seq,
    scatter_last,
    split_seq,
)
from paramplane.parallel.tp_torch.experts import (
    ExpertParallel,
    bind_experts,
    check_experts,
    expert_params,
    expert_shard,
)
from paramplane.parallel.tp_torch.state import TPShard

__all__ = [
    "STYLES",
    "ColwiseParallel",
    "ExpertParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "Style",
    "VocabParallel",
    "resolve_style",
]


@dataclass(frozen=True)
class ColwiseParallel:
    """Split a linear layer's output features over the tensor-parallel group."""

    gather_output: bool = False
    """All-gather the output along its last dimension (the full output on every rank)."""
    parts: int = 1
    """The output features are this many equal blocks, each split separately (3 for a fused q/k/v
    projection such as GPT-2's ``c_attn``, so that every rank holds whole heads of q, k and v)."""
    sequence_parallel: bool = False
    """The input is split along the sequence (a ``SequenceParallel`` region): all-gather it first."""
    input_gathered: bool = False
    """The input was all-gathered along the sequence by a ``SequenceParallel(gather_input=True)`` parent (whose
    backward reduce-scatters the input gradient): no f here."""

    def __post_init__(self) -> None:
        if isinstance(self.parts, bool) or not isinstance(self.parts, int) or self.parts < 1:
            raise ValueError(f"ColwiseParallel.parts must be a positive integer, got {self.parts!r}")


@dataclass(frozen=True)
class RowwiseParallel:
    """Split a linear layer's input features over the tensor-parallel group (its output all-reduced)."""

    input_is_parallel: bool = True
    """The input is already this rank's slice (a column layer's split output); False: split a full input."""
    sequence_parallel: bool = False
    """Reduce-scatter the output along the sequence (into a ``SequenceParallel`` region), not all-reduce it."""


@dataclass(frozen=True)
class VocabParallel:
    """Split an embedding's rows (the vocabulary) over the tensor-parallel group."""

    sequence_parallel: bool = False
    """Reduce-scatter the output along the sequence (into a ``SequenceParallel`` region), not all-reduce it."""


@dataclass(frozen=True)
class SequenceParallel:
    """Run a LayerNorm / RMSNorm / dropout on this rank's part of the sequence (gradients all-reduced)."""

    scatter_input: bool = False
    """The input holds the whole sequence (the region starts here): keep this rank's part of it."""
    gather_output: bool = False
    """The region ends here: all-gather the output along the sequence (replicated after it)."""
    gather_input: bool = False
    """All-gather the first input (positional, or ``hidden_states=``) along the sequence for the column layers
    inside (``ColwiseParallel(input_gathered=True)``), for module code that reshapes by the input's length
    (Llama's attention); backward reduce-scatters its gradient."""


Style = ColwiseParallel | RowwiseParallel | VocabParallel | SequenceParallel | ExpertParallel
STYLES: dict[str, Style] = {
    "colwise": ColwiseParallel(),
    "rowwise": RowwiseParallel(),
    "vocab": VocabParallel(),
    "sequence": SequenceParallel(),
    "experts": ExpertParallel(),
}


def resolve_style(value: Any, pattern: str) -> Style:
    if isinstance(value, (ColwiseParallel, RowwiseParallel, VocabParallel, SequenceParallel, ExpertParallel)):
        return value
    if isinstance(value, str) and value in STYLES:
        return STYLES[value]
    raise ValueError(
        f"plan entry {pattern!r}: unknown style {value!r}; use one of {sorted(STYLES)} or pp.ColwiseParallel(...) "
        "/ pp.RowwiseParallel(...) / pp.VocabParallel(...) / pp.SequenceParallel(...) / pp.ExpertParallel()"
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
    if isinstance(style, ExpertParallel):
        check_experts(name, module, tp)
        return
    kind = kind_of(module)
    what = type(style).__name__
    if isinstance(style, SequenceParallel):
        return
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
    if isinstance(style, ExpertParallel):
        for pname, _ in expert_params(module):
            _swap(module, pname, expert_shard(module, pname, group), done)
        bind_experts(module, group)
        return
    kind = kind_of(module)
    tp = group.size
    if isinstance(style, SequenceParallel):
        _sequence(module, style, group)
        return
    if isinstance(style, VocabParallel):
        _swap(module, "weight", TPShard(tuple(module.weight.shape), 0, 1, group), done)
        rows = module.num_embeddings // tp
        lo = group.rank * rows
        pad = module.padding_idx
        module.padding_idx = pad - lo if pad is not None and lo <= pad < lo + rows else None
        module.num_embeddings = rows
        module.forward = types.MethodType(_vocab_forward(group, lo, style.sequence_parallel), module)
        return
    attr, wdim, bdim = _where(style, kind)
    parts = style.parts if isinstance(style, ColwiseParallel) else 1
    _swap(module, "weight", TPShard(tuple(module.weight.shape), wdim, parts, group), done)
    if module.bias is not None and bdim >= 0:
        _swap(module, "bias", TPShard(tuple(module.bias.shape), bdim, parts, group), done)
    elif module.bias is not None and isinstance(style, RowwiseParallel) and style.sequence_parallel:
        _sum_grads(module.bias, group)  # added to this rank's part of the sequence only
    setattr(module, attr, int(getattr(module, attr)) // tp)
    if isinstance(style, ColwiseParallel):
        mode = "none" if style.input_gathered else "sequence" if style.sequence_parallel else "copy"
        forward = _col_forward(kind, copy, group, style.gather_output, mode)
    else:
        forward = _row_forward(kind, group, style.input_is_parallel, style.sequence_parallel)
    module.forward = types.MethodType(forward, module)


def _product(kind: str, module: Any, x: Any, bias: Any) -> Any:
    import torch

    if kind == "linear":
        return torch.nn.functional.linear(x, module.weight, bias)
    out = x.reshape(-1, x.shape[-1]) @ module.weight  # Conv1D: weight (in, out)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], module.weight.shape[1])


def _col_forward(kind: str, copy: SharedCopy, group: ProcessGroup, gather: bool, mode: str) -> Any:
    def forward(self: Any, x: Any) -> Any:
        y = _product(kind, self, x if mode == "none" else copy(x, mode == "sequence"), self.bias)
        return gather_last(y, group) if gather else y

    return forward


def _row_forward(kind: str, group: ProcessGroup, input_is_parallel: bool, sequence: bool) -> Any:
    def forward(self: Any, x: Any) -> Any:
        if not input_is_parallel:
            x = scatter_last(x, group)
        y = _product(kind, self, x, None)
        y = reduce_scatter_seq(y, group) if sequence else reduce_from(y, group)
        return y + self.bias if self.bias is not None else y

    return forward


def _sum_grads(p: Any, group: ProcessGroup) -> None:
    if p.requires_grad and group.size > 1:
        p.register_hook(lambda g: all_reduce_(g.detach().clone().contiguous(), group))


def _sequence(module: Any, style: SequenceParallel, group: ProcessGroup) -> None:
    """Gradients of the module's own parameters summed over the group; the region's start and end."""
    for p in module.parameters(recurse=False):
        _sum_grads(p, group)
    if style.scatter_input:
        module.register_forward_pre_hook(lambda _m, args: (split_seq(args[0], group), *args[1:]))
    if style.gather_output:
        module.register_forward_hook(lambda _m, _args, out: leave_seq(out, group))
    if style.gather_input:

        def gather_first(_m: Any, args: Any, kwargs: Any) -> Any:
            if args:
                return (gather_seq(args[0], group), *args[1:]), kwargs
            if "hidden_states" not in kwargs:
                raise ValueError("SequenceParallel(gather_input=True): the module got no positional input")
            return args, {**kwargs, "hidden_states": gather_seq(kwargs["hidden_states"], group)}

        module.register_forward_pre_hook(gather_first, with_kwargs=True)


def _vocab_forward(group: ProcessGroup, lo: int, sequence: bool) -> Any:
    def forward(self: Any, ids: Any) -> Any:
        import torch

        outside = (ids < lo) | (ids >= lo + self.num_embeddings)
        local = (ids - lo).masked_fill(outside, 0)
        out = torch.nn.functional.embedding(
            local, self.weight, self.padding_idx, None, self.norm_type, self.scale_grad_by_freq, self.sparse
        )
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        scale = getattr(self, "embed_scale", None)  # transformers' scaled embeddings (BART, T5-like)
        out = out * scale if scale is not None else out
        return reduce_scatter_seq(out, group) if sequence else reduce_from(out, group)

    return forward
