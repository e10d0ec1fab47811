"""Model code the project did not write, for the torch drop-in tests: tiny configs built from scratch.

``transformers`` GPT-2 and Llama (tied input embedding and output head, attention masks, keyword arguments,
``ModelOutput`` results) and ResNet (BatchNorm buffers, keyword arguments); ``torchvision``'s ResNet-18 itself
(``resnet18``: BatchNorm buffers, in-place ReLUs, one positional input, plain logits out; the loss is the
training loop's ``cross_entropy``); ``timm``'s Vision Transformer (``vit``: parameters on the root module itself,
the class token and position embedding, blocks in an ``nn.Sequential``, fused QKV attention, logits out). torchvision 0.28 is the release paired with torch 2.13; its compiled
operators (detection ops such as ``nms``) do not load into torch 2.13's CPU build, so ``torchvision_models``
imports it without their fake-kernel registrations, which the classification models never use.

Every rank can build every other rank's batch (seeded by step and rank), so a rank checks the wrapper
against one process on the whole global batch without extra communication. ``init_gloo`` starts torch's
own process group beside the paramplane world (a file store in the test's output folder) for comparing
with torch's DDP and FSDP2.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

VOCAB = 64
SEQ = 8
IMAGE_SIDE = {"resnet": 16, "resnet18": 64, "vit": 16}
"""Image side in pixels per image model (see ``batch``; the ViT cuts 16 px into 4x4 patches of 4 px)."""
TORCHVISION = Path(sys.prefix) / "torchvision"
"""Where ``make install`` puts torchvision 0.28 (torch 2.13's pair): a folder of its own, outside site-packages,
because transformers imports torchvision wherever it finds one, and this one fails to import as it is."""
TIMM = Path(sys.prefix) / "timm"
"""Where ``make install`` puts timm (``--no-deps``: it requires torchvision, which lives in ``TORCHVISION``)."""
_HAS_TORCHVISION = (TORCHVISION / "torchvision").is_dir()
MODELS = (
    ("gpt2", "llama", "resnet")
    + (("resnet18",) if _HAS_TORCHVISION else ())
    + (("vit",) if _HAS_TORCHVISION and (TIMM / "timm").is_dir() else ())
)
"""torchvision's ResNet-18 and timm's ViT where ``make install`` installed them (as torch: the cross-checks'
peers)."""
IMAGE_MODELS = ("resnet", "resnet18", "vit")
"""The models that take images (and labels for a cross-entropy)."""
BATCHNORM_MODELS = ("resnet", "resnet18")
"""The models with BatchNorm: statistics are per rank under DDP (torch's too)."""


def torchvision_models() -> Any:
    """``torchvision.models`` from ``TORCHVISION``. Its compiled operators (detection ops such as ``nms``) do not
    load into torch 2.13's CPU build, and ``torchvision._meta_registrations`` (their fake kernels) would fail
    the import ("operator torchvision::nms does not exist"): it is imported without that module. The model
    definitions are plain torch code and never use those operators."""
    import types

    if "torchvision" not in sys.modules:
        sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
        sys.path.append(str(TORCHVISION))
    import torchvision

    return torchvision.models


def timm_module() -> Any:
    """``timm`` from ``TIMM``, after ``torchvision`` (which it imports) from ``TORCHVISION``."""
    torchvision_models()
    if str(TIMM) not in sys.path:
        sys.path.append(str(TIMM))
    import timm

    return timm


def build(name: str, seed: int = 0, dtype: Any = None, layers: int = 2) -> Any:
    """A fresh model ``name`` (one of ``MODELS``) with weights from ``seed``, in ``dtype`` (float64 default);
    ``layers`` transformer blocks."""
    import torch

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.manual_seed(seed)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            n_layer=layers,
            n_embd=16,
            n_head=2,
            vocab_size=VOCAB,
            n_positions=SEQ,
            bos_token_id=0,
            eos_token_id=0,
        )
        cfg.attn_pdrop = cfg.resid_pdrop = cfg.embd_pdrop = 0.0
        model = GPT2LMHeadModel(cfg)
    elif name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            num_hidden_layers=layers,
            hidden_size=16,
            intermediate_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=SEQ,
            tie_word_embeddings=True,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        model = LlamaForCausalLM(cfg)
    elif name in (
        "mistral",
        "qwen2",
    ):  # Llama's layout with sliding-window attention (pipeline_split's tests)
        from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

        common = dict(
            num_hidden_layers=layers,
            hidden_size=16,
            intermediate_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=SEQ,
            tie_word_embeddings=True,
            sliding_window=SEQ // 2,  # shorter than the sequence: the window changes the result
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        if name == "mistral":  # every layer sliding
            model = MistralForCausalLM(MistralConfig(**common))
        else:  # the first layer full, the rest sliding (per-layer masks)
            model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=True, max_window_layers=1))
    elif name == "resnet":
        from transformers import ResNetConfig, ResNetForImageClassification

        cfg = ResNetConfig(
            num_labels=5, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic"
        )
        model = ResNetForImageClassification(cfg)
    elif name == "resnet18":
        model = torchvision_models().resnet18(num_classes=5)
    elif name == "vit":
        model = timm_module().create_model(
            "vit_tiny_patch16_224",
            pretrained=False,
            img_size=IMAGE_SIDE["vit"],
            patch_size=4,
            embed_dim=16,
            depth=layers,
            num_heads=2,
            num_classes=5,
        )
    else:
        raise ValueError(f"unknown model {name!r}; one of {MODELS}")
    return model.to(dtype or torch.float64)


MORE_MODELS = ("bert", "t5", "mixtral", "gptneox", "albert")
"""transformers' models checked once each under DDP and FSDP (``build_more``): BERT's masked LM (decoder tied to
the embedding), T5 (the shared embedding tied three ways, encoder and decoder), Mixtral (a mixture of experts:
experts unused on some ranks in a step), GPT-NeoX (untied head, parallel attention and MLP) and ALBERT (one layer
group shared by every layer: FSDP's unit for it runs three times in each forward and backward)."""


def build_more(name: str, seed: int = 0) -> Any:
    """A fresh tiny ``name`` (one of ``MORE_MODELS``): float64, but Mixtral in float32 (its grouped expert
    matmul has no float64 kernel)."""
    import torch
    import transformers as t

    warnings.filterwarnings("ignore")
    torch.manual_seed(seed)
    ids = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}
    if name == "bert":
        model = t.BertForMaskedLM(
            t.BertConfig(
                vocab_size=VOCAB,
                hidden_size=16,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=32,
                max_position_embeddings=SEQ,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        )
    elif name == "t5":
        model = t.T5ForConditionalGeneration(
            t.T5Config(
                vocab_size=VOCAB,
                d_model=16,
                d_kv=8,
                d_ff=32,
                num_layers=2,
                num_heads=2,
                dropout_rate=0.0,
                decoder_start_token_id=0,
                pad_token_id=0,
            )
        )
    elif name == "mixtral":
        model = t.MixtralForCausalLM(
            t.MixtralConfig(
                vocab_size=VOCAB,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_local_experts=4,
                num_experts_per_tok=1,
                max_position_embeddings=SEQ,
                **ids,
            )
        )
        return model.float()
    elif name == "gptneox":
        model = t.GPTNeoXForCausalLM(
            t.GPTNeoXConfig(
                vocab_size=VOCAB,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                max_position_embeddings=SEQ,
                **ids,
            )
        )
    elif name == "albert":
        model = t.AlbertForMaskedLM(
            t.AlbertConfig(
                vocab_size=VOCAB,
                embedding_size=8,
                hidden_size=16,
                num_hidden_layers=3,
                num_attention_heads=2,
                intermediate_size=32,
                max_position_embeddings=SEQ,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
                classifier_dropout_prob=0.0,
                **ids,
            )
        )
    else:
        raise ValueError(f"unknown model {name!r}; one of {MORE_MODELS}")
    return model.double()  # fmt: skip


def more_batch(name: str, step: int, rank: int, size: int = 2) -> dict[str, Any]:
    """Rank ``rank``'s keyword arguments for a ``MORE_MODELS`` model (T5: its own decoder targets)."""
    import torch

    rng = np.random.default_rng(step * 1000 + rank)
    ids = torch.from_numpy(rng.integers(1, VOCAB, (size, SEQ)))
    labels = torch.from_numpy(rng.integers(1, VOCAB, (size, SEQ))) if name == "t5" else ids.clone()
    return {"input_ids": ids, "labels": labels}


def block_class(model: Any) -> type:
    """The transformer block (or ResNet stage layer) class: the unit class FSDP users wrap by."""
    name = type(model).__name__
    if name.startswith("GPT2"):
        return type(model.transformer.h[0])
    if name.startswith("Llama"):
        return type(model.model.layers[0])
    if name == "ResNet":  # torchvision's: BasicBlock
        return type(model.layer1[0])
    if name == "VisionTransformer":  # timm's: Block
        return type(model.blocks[0])
    return type(model.resnet.encoder.stages[0].layers[0])


def batch(name: str, step: int, rank: int, size: int = 2) -> dict[str, Any]:
    """Rank ``rank``'s keyword arguments for step ``step``: the model's inputs and labels (float64 images)."""
    import torch

    rng = np.random.default_rng(step * 1000 + rank)
    if name in IMAGE_MODELS:
        # ResNet-18 downsamples 32x: at 64 px its last BatchNorms see 2x2 positions an image. At 16 px they would
        # see one, two images' values normalised to +-1: gradient norms near 1e6, where the summation order of
        # three ranks' gradients (paramplane's against gloo's) shows in the third digit after two Adam steps.
        side = IMAGE_SIDE[name]
        images = torch.from_numpy(rng.standard_normal((size, 3, side, side)))
        labels = torch.from_numpy(rng.integers(0, 5, size))
        # transformers' keyword; torchvision's and timm's take the images alone (``images``: see ``image_loss``)
        return {"pixel_values" if name == "resnet" else "images": images, "labels": labels}
    ids = torch.from_numpy(rng.integers(0, VOCAB, (size, SEQ)))
    mask = torch.ones(size, SEQ, dtype=torch.long)
    mask[0, -2:] = 0  # padding in one row: the attention mask is honoured
    labels = ids.clone()
    labels[0, -2:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def image_loss(model: Any, kwargs: dict[str, Any]) -> Any:
    """An image model's loss on a batch as its library's users compute it: transformers' ResNet takes the batch
    as keywords and returns a ``ModelOutput`` with the loss; torchvision's and timm's take the images
    positionally and return logits, and the loop applies ``cross_entropy``."""
    import torch

    if "images" in kwargs:
        return torch.nn.functional.cross_entropy(model(kwargs["images"]), kwargs["labels"])
    return model(**kwargs).loss


def loss64(model: Any, kwargs: dict[str, Any]) -> Any:
    """The model's loss on a batch; a language model's in the model's dtype (transformers casts the logits to
    float32 first, so its own ``.loss`` of a float64 model is float32-exact only)."""
    import torch

    if "input_ids" not in kwargs:
        return image_loss(model, kwargs)
    kw = dict(kwargs)
    labels = kw.pop("labels")
    logits = model(**kw).logits  # a ModelOutput
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def image_logits(model: Any, kwargs: dict[str, Any]) -> Any:
    """An image model's logits on a batch (see ``image_loss``)."""
    return model(kwargs["images"]) if "images" in kwargs else model(**kwargs).logits


def left_padded_batch(seed: int, rows: int, pad_every: int = 2) -> dict[str, Any]:
    """A causal-LM batch of ``rows`` sequences with two left-padded positions in every ``pad_every``-th row
    (labels -100 there): a pipeline's microbatches of ``pad_every`` rows each count as many tokens."""
    import torch

    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(rng.integers(0, VOCAB, (rows, SEQ)))
    mask = torch.ones(rows, SEQ, dtype=torch.long)
    mask[::pad_every, :2] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def global_batch(name: str, step: int, num_ranks: int, size: int = 2) -> dict[str, Any]:
    """Every rank's batch of ``step`` concatenated: what one process trains on."""
    import torch

    parts = [batch(name, step, r, size) for r in range(num_ranks)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def flat_params(model: Any) -> np.ndarray:
    """Every parameter of ``model`` (named_parameters order), flattened into one float64 vector."""
    return np.concatenate([p.detach().double().reshape(-1).numpy() for p in model.parameters()])


def flat_grads(model: Any) -> np.ndarray:
    """Every gradient of ``model`` (those that are not None), flattened into one float64 vector."""
    return np.concatenate(
        [p.grad.detach().double().reshape(-1).numpy() for p in model.parameters() if p.grad is not None]
    )


def init_gloo(world: Any) -> Any:
    """torch.distributed (gloo) over the same ranks, through a file store in the test's output folder."""
    import torch.distributed as dist

    if not dist.is_initialized():
        store = Path(os.environ["PARAMPLANE_TEST_OUT"]) / "gloo-store"
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=world.rank, world_size=world.world_size
        )
    return dist


def clipped_reference_step(ref: Any, opt: Any, batch: dict[str, Any], clip: float) -> tuple[float, float]:
    """The pipeline tests' one-process step on the whole batch: the LM loss, its backward, the gradient norm
    clipped to ``clip`` (torch's ``clip_grad_norm_``), the optimizer step. Returns (loss, norm before clipping)."""
    import torch

    import paramplane as pp

    loss = pp.causal_lm_loss(
        ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, batch["labels"]
    )
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss), norm
