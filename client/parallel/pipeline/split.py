"""``pipeline_split``: cut a torch transformer whose blocks live in a ``ModuleList`` into pipeline stages.

Usage::

    stages = pp.pipeline_split(model, [2])          # blocks [0, 2) with the embedding, [2, n) with the head
    pipe = pp.Pipeline(stages[mesh.coordinate("pp")], mesh.group("pp"), "1f1b", 8, loss_fn=pp.causal_lm_loss)
    losses = pipe.step(input_ids, target=labels, attention_mask=mask)

``boundaries`` are the block indices where stages 1, 2, ... begin (strictly increasing, inside the list), so
``len(boundaries) + 1`` stages. Stage 0 also holds the token (and position) embedding, the last stage the
final norm and the output head, and returns the logits. Each stage keeps the full model's parameter names
(``transformer.h.3.attn.c_attn.weight``), so its ``state_dict()`` is a piece of the model's. Every stage
takes ``attention_mask`` (``(batch, seq)``, 1 = attend) and builds the model's own causal mask from it; a
Llama stage computes the rotary embedding itself.

Supported: ``transformers`` GPT-2 (``GPT2LMHeadModel``: ``transformer.h``) and Llama (``LlamaForCausalLM``:
``model.layers``) with the models laid out as it (``LLAMA_LIKE``: Mistral, Qwen2 and Qwen3, their sliding-window
layers masked as their own forward does), and models with ``wte``/``wpe``/``blocks``/``ln_f``/``lm_head`` whose blocks take the
hidden states alone (the project's ``examples/train_gpt.py`` ``TinyGPT``). Other models: a ValueError.

Tied weights (GPT-2's and Llama's ``tie_word_embeddings``: the embedding is the head's weight) sit on the
first and the last stage; each stage's ``StageInfo`` names them, and the ``Pipeline`` sums their gradients over
the two stages' ranks after every step (Megatron's embedding all-reduce), which keeps the copies equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from paramplane.parallel.pipeline.torch_stage import STAGE_ATTR


@dataclass(frozen=True)
class StageInfo:
    """What ``pipeline_split`` records on each stage module (``module._paramplane_stage``)."""

    index: int
    """This stage's index, 0 .. ``num_stages - 1``."""
    num_stages: int
    """How many stages the model was cut into."""
    tied: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    """Per tied parameter (by its first name in the model): its name in this stage and every stage holding it."""

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.num_stages:
            raise ValueError(f"stage index {self.index} outside [0, {self.num_stages})")


_FAMILIES = {
    # name: (blocks path, first-stage modules, last-stage modules, every-stage modules)
    "gpt2": ("transformer.h", ("transformer.wte", "transformer.wpe", "transformer.drop"),
             ("transformer.ln_f", "lm_head"), ()),
    "llama": ("model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"), ("model.rotary_emb",)),
    "tinygpt": ("blocks", ("wte", "wpe"), ("ln_f", "lm_head"), ()),
}  # fmt: skip


LLAMA_LIKE = ("Llama", "Mistral", "Qwen2", "Qwen3")
"""transformers' causal LMs laid out as Llama (``model.embed_tokens/layers/norm/rotary_emb``, ``lm_head``) whose
forward adds nothing between those: the ``"llama"`` family (their sliding-window layers included)."""


def _family(model: Any) -> str:
    name = type(model).__name__
    if name.startswith("GPT2") and hasattr(model, "transformer") and hasattr(model, "lm_head"):
        return "gpt2"
    if (
        name.endswith("ForCausalLM")
        and name.removesuffix("ForCausalLM") in LLAMA_LIKE
        and hasattr(model, "model")
        and hasattr(model, "lm_head")
    ):
        return "llama"
    if all(hasattr(model, a) for a in ("wte", "wpe", "blocks", "ln_f", "lm_head")):
        return "tinygpt"
    raise ValueError(
        f"pipeline_split knows transformers GPT2LMHeadModel and {', '.join(f'{n}ForCausalLM' for n in LLAMA_LIKE)} "
        f"and models with wte/wpe/blocks/ln_f/lm_head; got {name}"
    )


def _get(root: Any, path: str) -> Any:
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _put(root: Any, path: str, module: Any) -> None:
    """Attach ``module`` at ``path`` under ``root``, making empty containers on the way."""
    import torch

    *parents, leaf = path.split(".")
    for part in parents:
        if not hasattr(root, part):
            root.add_module(part, torch.nn.Module())
        root = getattr(root, part)
    root.add_module(leaf, module)


def pipeline_split(model: Any, boundaries: Sequence[int]) -> list[Any]:
    """``model`` cut into ``len(boundaries) + 1`` stage modules (sharing its parameters; see the module
    docstring). Every rank builds the same model and keeps the stages it runs: ``stages[rank]``, or
    ``stages[rank::p]`` for interleaved 1F1B."""
    import torch

    family = _family(model)
    blocks_path, first_paths, last_paths, every_paths = _FAMILIES[family]
    blocks = _get(model, blocks_path)
    if not isinstance(blocks, torch.nn.ModuleList):
        raise ValueError(f"{blocks_path} is a {type(blocks).__name__}, not a ModuleList")
    cuts = [int(b) for b in boundaries]
    if any(not 0 < b < len(blocks) for b in cuts) or sorted(set(cuts)) != cuts:
        raise ValueError(
            f"boundaries must increase strictly inside (0, {len(blocks)}) (the block where each later stage "
            f"begins); got {list(boundaries)}"
        )
    edges = [0, *cuts, len(blocks)]
    n = len(edges) - 1
    stages = []
    for s in range(n):
        stage = _Stage(family, getattr(model, "config", None), s == 0, s == n - 1)
        for path in (first_paths if s == 0 else ()) + every_paths + (last_paths if s == n - 1 else ()):
            _put(stage, path, _get(model, path))
        _put(
            stage,
            blocks_path,
            torch.nn.ModuleDict({str(i): blocks[i] for i in range(edges[s], edges[s + 1])}),
        )
        stage.block_path = blocks_path
        stages.append(stage)
    _record_ties(model, stages)
    return stages


def _record_ties(model: Any, stages: list[Any]) -> None:
    """``StageInfo`` on each stage, naming the parameters it shares with other stages."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    holders: dict[int, dict[int, str]] = {}
    for s, stage in enumerate(stages):
        for name, p in stage.named_parameters(remove_duplicate=False):
            holders.setdefault(id(p), {}).setdefault(s, name)
    for s, stage in enumerate(stages):
        tied = {
            names[pid][0]: (where[s], tuple(sorted(where)))
            for pid, where in holders.items()
            if len(where) > 1 and s in where
        }
        setattr(stage, STAGE_ATTR, StageInfo(s, len(stages), tied))


def causal_lm_loss(logits: Any, labels: Any) -> Any:
    """Next-token cross-entropy (``labels`` shifted by one inside, -100 ignored, mean over the rest), in the
    logits' dtype: transformers' causal-LM loss without its upcast to float32 (so float64 stays float64)."""
    import torch

    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100
    )


_STAGE_CLASS: list[Any] = []


def _Stage(family: str, config: Any, first: bool, last: bool) -> Any:
    """A stage module of ``family`` (its class made on first use: torch is imported only when a model is split)."""
    if not _STAGE_CLASS:
        _STAGE_CLASS.append(_stage_class())
    return _STAGE_CLASS[0](family, config, first, last)


def _stage_class() -> Any:
    import torch

    class PipelineStage(torch.nn.Module):
        """One pipeline stage: ``forward(x, attention_mask=None)`` (token ids on the first stage, hidden states
        after it) returns hidden states, or the logits on the last stage."""

        def __init__(self, family: str, config: Any, first: bool, last: bool) -> None:
            super().__init__()
            self.family, self.config, self.first, self.last = family, config, first, last
            self.block_path = ""

        def forward(self, x: Any, attention_mask: Any = None) -> Any:
            return _forward(self, x, attention_mask)

    return PipelineStage


def _forward(stage: Any, x: Any, attention_mask: Any) -> Any:
    import torch

    family = stage.family
    blocks = _get(stage, stage.block_path).values()
    t = x.shape[1]
    position_ids = torch.arange(t, device=x.device).unsqueeze(0)
    if family == "tinygpt":
        h = stage.wte(x) + stage.wpe(position_ids[0]) if stage.first else x
        for block in blocks:
            h = block(h)
        return stage.lm_head(stage.ln_f(h)) if stage.last else h
    from transformers.masking_utils import create_causal_mask

    if family == "gpt2":
        tr = stage.transformer
        h = tr.drop(tr.wte(x) + tr.wpe(position_ids)) if stage.first else x
        mask = create_causal_mask(stage.config, h, attention_mask, None, position_ids)
        for block in blocks:
            h = block(h, None, mask, None, use_cache=False, position_ids=position_ids)
        return stage.lm_head(tr.ln_f(h)) if stage.last else h
    inner = stage.model
    h = inner.embed_tokens(x) if stage.first else x
    masks = _llama_masks(stage.config, h, attention_mask, position_ids)
    rotary = inner.rotary_emb(h, position_ids=position_ids)
    for index, layer in _get(stage, stage.block_path).items():
        h = layer(
            h,
            attention_mask=masks(int(index)),
            position_embeddings=rotary,
            position_ids=position_ids,
            use_cache=False,
        )
    return stage.lm_head(inner.norm(h)) if stage.last else h


def _llama_masks(config: Any, h: Any, attention_mask: Any, position_ids: Any) -> Any:
    """Each layer's attention mask (by its index in the model) as the model's own forward builds it: per
    ``config.layer_types`` (Qwen2, Qwen3: full or sliding-window attention), else sliding for every layer when
    ``config.sliding_window`` is set (Mistral), else causal (Llama)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    args = (config, h, attention_mask, None, position_ids)
    types = getattr(config, "layer_types", None)
    if types is not None:
        made = {t: (create_sliding_window_causal_mask if t == "sliding_attention" else create_causal_mask)(*args)
                for t in set(types)}  # fmt: skip
        return lambda i: made[types[i]]
    mask = (create_causal_mask if getattr(config, "sliding_window", None) is None
            else create_sliding_window_causal_mask)(*args)  # fmt: skip
    return lambda _i: mask
