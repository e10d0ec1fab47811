"""Attention under tensor parallel, per model family, and ready plans (``tp_plan_for``).

A column-parallel q/k/v projection gives each rank whole heads (head_dim stays, the head count divides by
tp); the attention code then runs unchanged on the local heads, and the row-parallel output projection sums
the ranks' parts. What each family needs, as torchtitan's ``parallelize_llama`` adjusts ``n_heads``:

- transformers GPT-2 (``GPT2Attention``): the fused ``c_attn`` Conv1D holds q, k and v side by side, so it
  is split as 3 blocks (``ColwiseParallel(parts=3)``): each rank keeps its heads of q, of k and of v. The
  module's ``num_heads``, ``embed_dim`` and ``split_size`` (read by its forward) are divided by tp.
- transformers Llama (and the families with the same q/k/v/o projections and ``head_dim``: Mistral, Qwen2):
  the forward reshapes with ``-1`` heads, so nothing but the projections changes; grouped-query attention
  keeps its ratio (``num_key_value_groups``) when both head counts divide by tp. ``num_heads`` /
  ``num_key_value_heads`` attributes, where a version has them, are divided too.
- transformers BART (``BartAttention``: q/k/v projections and ``out_proj``, the forward reshapes with ``-1``
  heads): the encoder's and the decoder's self-attention and the decoder's cross-attention (``encoder_attn``:
  queries from the decoder, keys and values from the encoder's output, which reaches every rank whole) are
  split like Llama's; ``fc1``/``fc2`` column/row; the shared embedding (and its tied head) over the
  vocabulary, its ``embed_scale`` kept. ``num_heads`` and ``embed_dim`` are divided by tp. No sequence
  parallel plan for this family.
- transformers T5 (``T5Attention``: ``q``/``k``/``v``/``o``, reshaped with ``-1`` heads): self-attention of the
  encoder and decoder and the decoder's ``EncDecAttention`` split by heads, ``n_heads`` and ``inner_dim``
  divided by tp; the first layer's ``relative_attention_bias`` (an embedding of one column per head) keeps
  this rank's heads' columns (no communication: each rank's heads use only their own); the feed-forward
  ``wi`` (or gated ``wi_0``/``wi_1``) column-wise and ``wo`` row-wise; the shared embedding and tied head over
  the vocabulary. No sequence- or loss-parallel plan.

- transformers GPT-2 with cross-attention (``GPT2Config(add_cross_attention=True)``: each block's
  ``crossattention`` attends from the decoder's states to ``encoder_hidden_states``): its ``q_attn`` (queries)
  is split column-wise, its fused ``c_attn`` (keys and values from the encoder's states) as 2 blocks
  (``ColwiseParallel(parts=2)``), its ``c_proj`` row-wise; the same attributes are divided by tp. The
  encoder's states reach every rank whole (their gradient is all-reduced like any column layer's input).
  Under sequence parallel only the decoder's states are split along the sequence; ``ln_cross_attn`` is a
  sequence-parallel norm and the cross ``c_attn`` reads the whole encoder states.

- timm Vision Transformers (``timm.layers.Attention``: a fused ``qkv`` Linear read as (3, heads, head_dim),
  ``proj``): ``qkv`` split as 3 blocks (``ColwiseParallel(parts=3)``), ``proj`` row-wise, the blocks' ``Mlp``
  ``fc1``/``fc2`` column/row; ``num_heads`` and ``attn_dim`` (read by its forward) divided by tp. The patch
  embedding, class token, position embedding, norms and classifier head stay replicated. Attention with a norm
  over all heads' outputs (``scale_norm``) or a gate (``gated``) is refused (both span every head). No
  sequence-, vocabulary- or loss-parallel plan.

Other attention modules are not adjusted (a plan that splits the projections of an unknown one does not
know its head count: write it with care, or add the family here).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any

from paramplane.group import ProcessGroup
from paramplane.parallel.tp_torch.state import TPShard
from paramplane.parallel.tp_torch.styles import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    Style,
    VocabParallel,
    _swap,
)

__all__ = ["adjust_attention", "check_attention", "tp_plan_for"]

_QKV = ("q_proj", "k_proj", "v_proj")


def _family(module: Any) -> str | None:
    names = {n for n, _ in module.named_children()}
    if (
        type(module).__module__.startswith("timm.")
        and {"qkv", "proj"} <= names
        and all(hasattr(module, a) for a in ("num_heads", "head_dim", "attn_dim"))
    ):
        return "timm"
    if type(module).__name__.startswith("T5Attention") and {"q", "k", "v", "o"} <= names:
        return "t5"
    if type(module).__name__.startswith("GPT2Attention") and "c_attn" in names:
        return "gpt2"
    if set(_QKV) <= names and names & {"o_proj", "out_proj"} and hasattr(module, "head_dim"):
        return "qkvo"
    return None


def _style_of(styles: dict[str, Style], name: str) -> Style | None:
    return styles.get(name)


def _heads_error(where: str, what: str, heads: int, tp: int) -> ValueError:
    return ValueError(
        f"attention {where!r} has {heads} {what}, which do not split over tp={tp} tensor-parallel ranks: "
        f"the {what} must be divisible by the tensor-parallel size"
    )


def _check_cross(name: str, prefix: str, styles: dict[str, Style], kv: Style) -> None:
    """GPT-2's cross-attention: ``q_attn`` (queries, from the decoder) and ``c_attn`` (keys and values side by
    side, from the encoder's states) split column-wise together, by heads."""
    q = _style_of(styles, prefix + "q_attn")
    if not isinstance(kv, ColwiseParallel) or kv.parts != 2 or kv.gather_output:
        raise ValueError(
            f"{name!r}: GPT-2's cross-attention c_attn holds k and v side by side; split it with "
            "pp.ColwiseParallel(parts=2) (see pp.tp_plan_for)"
        )
    if not isinstance(q, ColwiseParallel) or q.parts != 1 or q.gather_output:
        raise ValueError(f"{name!r}: split the cross-attention's q_attn column-wise with its c_attn")


def check_attention(root: Any, styles: dict[str, Style], tp: int) -> None:
    """ValueError (naming the head count and tp) for an attention module whose projections the plan splits
    but whose heads do not divide by ``tp``, or whose projections are split the wrong way."""
    for name, module in root.named_modules():
        family = _family(module)
        prefix = f"{name}." if name else ""
        if family == "gpt2":
            style = _style_of(styles, prefix + "c_attn")
            if style is None:
                continue
            if getattr(module, "is_cross_attention", False):
                _check_cross(name, prefix, styles, style)
            elif not isinstance(style, ColwiseParallel) or style.parts != 3 or style.gather_output:
                raise ValueError(
                    f"{name!r}: GPT-2's fused c_attn holds q, k and v side by side; split it with "
                    "pp.ColwiseParallel(parts=3) (see pp.tp_plan_for)"
                )
            if module.num_heads % tp:
                raise _heads_error(name, "attention heads", module.num_heads, tp)
        elif family == "timm":
            style = _style_of(styles, prefix + "qkv")
            if style is None:
                continue
            if not isinstance(style, ColwiseParallel) or style.parts != 3 or style.gather_output:
                raise ValueError(
                    f"{name!r}: timm's fused qkv holds q, k and v side by side; split it with "
                    "pp.ColwiseParallel(parts=3) (see pp.tp_plan_for)"
                )
            if not isinstance(styles.get(prefix + "proj"), RowwiseParallel):
                raise ValueError(f"{name!r}: split qkv column-wise and proj row-wise together")
            spanning = [
                a
                for a in ("norm", "gate")
                if type(getattr(module, a, None)).__name__ not in ("Identity", "NoneType")
            ]
            if spanning:
                raise ValueError(
                    f"{name!r}: its {' and '.join(spanning)} spans every head's output (timm's scale_norm / "
                    "gated attention), which tensor parallel does not split"
                )
            if module.num_heads % tp:
                raise _heads_error(name, "attention heads", module.num_heads, tp)
        elif family == "t5":
            split = [p for p in "qkv" if _style_of(styles, prefix + p) is not None]
            if not split:
                continue
            if len(split) < 3 or not isinstance(styles.get(prefix + "o"), RowwiseParallel):
                raise ValueError(f"{name!r}: split q, k and v column-wise and o row-wise together")
            if module.n_heads % tp:
                raise _heads_error(name, "attention heads", module.n_heads, tp)
        elif family == "qkvo":
            split = [p for p in _QKV if _style_of(styles, prefix + p) is not None]
            if not split:
                continue
            out = "o_proj" if hasattr(module, "o_proj") else "out_proj"
            if len(split) < 3 or not isinstance(styles.get(prefix + out), RowwiseParallel):
                raise ValueError(
                    f"{name!r}: split q_proj, k_proj and v_proj column-wise and {out} row-wise together"
                )
            hd = int(module.head_dim)
            heads, kv = module.q_proj.out_features // hd, module.k_proj.out_features // hd
            if heads % tp:
                raise _heads_error(name, "attention heads", heads, tp)
            if kv % tp:
                raise _heads_error(name, "key/value heads (grouped-query attention)", kv, tp)


def adjust_attention(root: Any, styles: dict[str, Style], group: ProcessGroup) -> None:
    """Divide the head-count attributes the attention code reads by tp (after its projections were split);
    T5's relative position bias keeps this rank's heads."""
    tp = group.size
    for name, module in list(root.named_modules()):
        family = _family(module)
        prefix = f"{name}." if name else ""
        if family == "t5" and prefix + "q" in styles:
            module.n_heads //= tp
            module.inner_dim //= tp
            bias = getattr(module, "relative_attention_bias", None)
            if bias is not None:
                _swap(bias, "weight", TPShard(tuple(bias.weight.shape), 1, 1, group), {})
                bias.embedding_dim //= tp
        if family == "timm" and prefix + "qkv" in styles:
            module.num_heads //= tp
            module.attn_dim //= tp
        if family == "gpt2" and prefix + "c_attn" in styles:
            module.num_heads //= tp
            module.embed_dim //= tp
            module.split_size //= tp
        elif family == "qkvo" and prefix + "q_proj" in styles:
            for attr in ("num_heads", "num_key_value_heads", "embed_dim"):
                if isinstance(getattr(module, attr, None), int):
                    setattr(module, attr, getattr(module, attr) // tp)


_PLANS: dict[str, dict[str, Style]] = {
    "gpt2": {
        "*wte": VocabParallel(),
        "*attn.c_attn": ColwiseParallel(parts=3),
        "*attn.c_proj": RowwiseParallel(),
        "*crossattention.q_attn": ColwiseParallel(),
        "*crossattention.c_attn": ColwiseParallel(parts=2),
        "*crossattention.c_proj": RowwiseParallel(),
        "*mlp.c_fc": ColwiseParallel(),
        "*mlp.c_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(),
    },
    "llama": {
        "*embed_tokens": VocabParallel(),
        "*self_attn.q_proj": ColwiseParallel(),
        "*self_attn.k_proj": ColwiseParallel(),
        "*self_attn.v_proj": ColwiseParallel(),
        "*self_attn.o_proj": RowwiseParallel(),
        "*mlp.gate_proj": ColwiseParallel(),
        "*mlp.up_proj": ColwiseParallel(),
        "*mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(),
    },
    "bart": {
        "*shared": VocabParallel(),
        "*embed_tokens": VocabParallel(),
        **{f"*{attn}.{p}": ColwiseParallel() for attn in ("self_attn", "encoder_attn") for p in _QKV},
        "*self_attn.out_proj": RowwiseParallel(),
        "*encoder_attn.out_proj": RowwiseParallel(),
        "*fc1": ColwiseParallel(),
        "*fc2": RowwiseParallel(),
        "lm_head": ColwiseParallel(),
    },
    "t5": {
        "*shared": VocabParallel(),
        "*embed_tokens": VocabParallel(),
        **{f"*{attn}.{p}": ColwiseParallel() for attn in ("SelfAttention", "EncDecAttention") for p in "qkv"},
        "*SelfAttention.o": RowwiseParallel(),
        "*EncDecAttention.o": RowwiseParallel(),
        **{f"*DenseReluDense.{w}": ColwiseParallel() for w in ("wi", "wi_0", "wi_1")},
        "*DenseReluDense.wo": RowwiseParallel(),
        "lm_head": ColwiseParallel(),
    },
    "timm": {
        "*attn.qkv": ColwiseParallel(parts=3),
        "*attn.proj": RowwiseParallel(),
        "*mlp.fc1": ColwiseParallel(),
        "*mlp.fc2": RowwiseParallel(),
    },
}


_SEQUENCE = {
    "gpt2": ("GPT2Block", ("*ln_1", "*ln_2", "*ln_cross_attn"), "ln_f"),
    "llama": ("DecoderLayer", ("*input_layernorm", "*post_attention_layernorm"), "norm"),
}


def _sequence_plan(model: Any, family: str, plan: dict[str, Style]) -> dict[str, Style]:
    """Megatron sequence parallel on top of ``plan``: the region from the first block's input to the final
    norm's output, the norms inside it, the column layers gathering and the row layers reduce-scattering."""
    block, norms, final = _SEQUENCE[family]
    all_names = [n for n, _ in model.named_modules()]
    names = [n for n, m in model.named_modules() if type(m).__name__.endswith(block)]
    last = [n for n, _ in model.named_modules() if n == final or n.endswith(f".{final}")]
    if not names or not last:
        raise ValueError(
            "sequence_parallel needs the blocks and the final norm in the module (the region ends there); "
            f"{type(model).__name__} lacks {'the blocks' if not names else repr(final)}"
        )
    out: dict[str, Style] = {}
    for pattern, style in plan.items():
        if pattern in ("lm_head", "*crossattention.c_attn"):  # the head; the whole encoder states
            pass
        elif isinstance(style, RowwiseParallel) or (isinstance(style, ColwiseParallel) and family == "gpt2"):
            style = dataclasses.replace(style, sequence_parallel=True)
        elif isinstance(style, ColwiseParallel):  # Llama reshapes by its input's length: gather at the parent
            style = dataclasses.replace(style, input_gathered=True)
        out[pattern] = style
    if family == "llama":
        out.update(
            {"*self_attn": SequenceParallel(gather_input=True), "*mlp": SequenceParallel(gather_input=True)}
        )
    out[names[0]] = SequenceParallel(scatter_input=True)
    out.update({n: SequenceParallel() for n in norms if any(fnmatch.fnmatchcase(m, n) for m in all_names)})
    out[last[-1]] = SequenceParallel(gather_output=True)
    return out


def tp_plan_for(
    model: Any, *, loss_parallel: bool = False, vocab: bool = True, sequence_parallel: bool = False
) -> dict[str, Style]:
    """The tensor-parallel plan for a transformers GPT-2, Llama-family, BART or T5 model or a timm Vision
    Transformer (or a part of one: a pipeline stage holding some blocks), with only the entries that match a
    module of ``model``.

    ``loss_parallel``: the head's logits stay split over the vocabulary (for ``pp.vocab_parallel_cross_entropy``);
    by default they are gathered, so the model's own loss (``labels=``) works unchanged. ``vocab=False``
    keeps the embedding and head replicated. ``sequence_parallel``: Megatron sequence parallel between the
    first block and the final norm (``styles.SequenceParallel``; the sequence length must divide by tp).
    """
    names = [n for n, _ in model.named_modules()]
    families = {_family(m) for _, m in model.named_modules()} - {None}
    if not families:
        raise ValueError(
            f"tp_plan_for knows transformers GPT-2, Llama-family, BART and T5 and timm's ViT attention; "
            f"{type(model).__name__} has none: write the plan (module name globs -> 'colwise' / 'rowwise' / "
            "'vocab')"
        )
    bart = any(n.endswith("attn.out_proj") for n in names)
    family = next((f for f in ("gpt2", "t5", "timm") if f in families), "bart" if bart else "llama")
    if family in ("bart", "t5", "timm") and (sequence_parallel or loss_parallel):
        raise ValueError(
            f"tp_plan_for has no sequence-parallel or loss-parallel plan for {family.upper()} (BART adds "
            "final_logits_bias to the whole logits; a ViT has no vocabulary): use the defaults"
        )
    plan: dict[str, Style] = {}
    for pattern, style in _PLANS[family].items():
        if isinstance(style, VocabParallel) or pattern == "lm_head":
            if not vocab:
                continue
            if pattern == "lm_head" and not loss_parallel:
                style = ColwiseParallel(gather_output=True)
        if any(fnmatch.fnmatchcase(n, pattern) for n in names):
            plan[pattern] = style
    return _sequence_plan(model, family, plan) if sequence_parallel else plan
