"""torch stages that pass several tensors to the next stage (a tuple: the next stage's positional arguments),
as ``torch.distributed.pipelining`` allows, against one process on the whole batch.

Usage: ``pipeline_tuple.py`` (world 2). The first stage takes two positional arguments (``step((x, ids))``:
each split into the microbatches, as torch's ``schedule.step(x, ids)``). Each stage but the last returns ``(hidden, residual, ids)``: two
float64 tensors and an int64 one (no gradient flows back for it); the last stage does not use ``residual``
(its gradient goes back as zeros). Every schedule (interleaved 1F1B with a middle stage per rank), three AdamW
steps: per-step losses, gradients and final parameters equal one process (1e-12), and ``eval_step`` gives the
one process's output. Then a stage that returns a dict, and one whose number of outputs changes between steps,
are ValueErrors on their rank and a TransportError on the other, not a hang. And model code the project did
not write: transformers' Llama cut by hand into two stages passing ``(hidden_states, cos, sin)`` (``llama_stages``),
GPipe and 1F1B, three AdamW steps: losses (1e-5), gradients and final parameters (1e-4; Llama computes its norm
and rotary embedding in float32) equal the whole model in one process.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torch_models as tm
from _common import Report, run_rank

import paramplane as pp

STEPS, MICROBATCHES, PER_MB, WIDTH = 3, 4, 2, 6
TOL = 1e-12


def stage_modules(num_stages: int) -> list[Any]:
    import torch

    class First(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(WIDTH, WIDTH, dtype=torch.float64)

        def forward(self, x: Any, ids: Any) -> Any:
            return torch.tanh(self.lin(x)), x * 0.5, ids

    class Middle(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(WIDTH, WIDTH, dtype=torch.float64)
            self.table = torch.nn.Parameter(torch.randn(2, WIDTH, dtype=torch.float64))

        def forward(self, h: Any, r: Any, ids: Any) -> Any:
            return torch.tanh(self.lin(h)) + r + self.table[ids.clamp(0, 1)], h, ids

    class Last(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(WIDTH, WIDTH, dtype=torch.float64)
            self.table = torch.nn.Parameter(torch.randn(2, WIDTH, dtype=torch.float64))

        def forward(self, h: Any, r: Any, ids: Any) -> Any:  # r unused: its gradient is zeros
            return self.lin(h) + self.table[ids.clamp(0, 1)]

    # ids are 0 or 1; the clamp is for torch's pipelining (pipeline_peer.py), which infers its messages' shapes
    # by running each stage once on uninitialised tensors.
    torch.manual_seed(0)
    return [First(), *[Middle() for _ in range(num_stages - 2)], Last()]


def run_chain(stages: list[Any], x: tuple[Any, ...]) -> Any:
    out = stages[0](*x)
    for s in stages[1:]:
        out = s(*out)
    return out


def batch(step: int) -> tuple[tuple[Any, Any], Any]:
    """The first stage's two positional arguments (features and int64 ids), and the target."""
    import torch

    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(MICROBATCHES * PER_MB, WIDTH, generator=gen, dtype=torch.float64)
    ids = (x[:, 0] > 0).long()
    return (x, ids), torch.randn(MICROBATCHES * PER_MB, WIDTH, generator=gen, dtype=torch.float64)


def equivalence(world: Any, rep: Report, schedule: str) -> None:
    import torch

    g = world.group
    p = g.size
    v = 2 if schedule == "interleaved_1f1b" else 1
    stages = stage_modules(p * v)
    ref = copy.deepcopy(stages)
    mine = stages[g.rank :: p]
    loss_fn = torch.nn.functional.mse_loss
    pipe = pp.Pipeline(mine if v > 1 else mine[0], g, schedule, MICROBATCHES, loss_fn=loss_fn)
    opt = torch.optim.AdamW([q for s in mine for q in s.parameters()], lr=1e-2)
    ref_opt = torch.optim.AdamW([q for s in ref for q in s.parameters()], lr=1e-2)
    for step in range(STEPS):
        x, y = batch(step)
        losses = pipe.step(x if pipe.is_first else None, target=y if pipe.is_last else None)
        want = loss_fn(run_chain(ref, x), y)
        want.backward()
        if pipe.is_last:
            assert losses is not None
            rep.close(
                f"{schedule} loss {step}", np.array(np.mean(losses)), np.array(float(want.detach())), TOL
            )
        for s_mine, s_ref in zip(mine, ref[g.rank :: p], strict=True):
            for (n, q), (_, r) in zip(s_mine.named_parameters(), s_ref.named_parameters(), strict=True):
                if not rep.check(f"{schedule} {n} has a gradient {step}", q.grad is not None):
                    continue
                rep.close(f"{schedule} grad {n} {step}", q.grad.numpy(), r.grad.numpy(), TOL)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    for s_mine, s_ref in zip(mine, ref[g.rank :: p], strict=True):
        for (n, q), (_, r) in zip(s_mine.named_parameters(), s_ref.named_parameters(), strict=True):
            rep.close(f"{schedule} final {n}", q.detach().numpy(), r.detach().numpy(), TOL)
    x, _ = batch(STEPS)
    got = pipe.eval_step(x if pipe.is_first else None)
    if pipe.is_last:
        with torch.no_grad():
            rep.close(f"{schedule} eval", got.numpy(), run_chain(ref, x).numpy(), TOL)


def llama_stages(model: Any) -> list[Any]:
    """transformers' Llama (``LlamaForCausalLM``, 2 layers) cut by hand into two stages that pass
    ``(hidden_states, cos, sin)``: the rotary embedding computed once, on the first stage, as the model's own
    forward does; each stage builds the causal mask with transformers' ``create_causal_mask``."""
    import torch
    from transformers.masking_utils import create_causal_mask

    inner = model.model

    def layer(index: int, h: Any, cos: Any, sin: Any) -> Any:
        positions = torch.arange(h.shape[1]).unsqueeze(0)
        mask = create_causal_mask(
            config=inner.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=positions
        )
        return inner.layers[index](
            h, attention_mask=mask, position_ids=positions, position_embeddings=(cos, sin)
        )

    class First(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens, self.rotary_emb, self.layer = (
                inner.embed_tokens,
                inner.rotary_emb,
                inner.layers[0],
            )

        def forward(self, ids: Any) -> Any:
            h = self.embed_tokens(ids)
            cos, sin = self.rotary_emb(h, position_ids=torch.arange(ids.shape[1]).unsqueeze(0))
            return layer(0, h, cos, sin), cos, sin

    class Last(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer, self.norm, self.lm_head = inner.layers[1], inner.norm, model.lm_head

        def forward(self, h: Any, cos: Any, sin: Any) -> Any:
            return self.lm_head(self.norm(layer(1, h, cos, sin)))

    return [First(), Last()]


def llama_equivalence(world: Any, rep: Report, schedule: str) -> None:
    """The hand-cut Llama under ``schedule`` against the whole model in one process: losses, gradients (the
    tied embedding/head summed over the two stages, as the test does by hand) and final AdamW parameters."""
    import torch

    g = world.group
    model, ref = tm.build("llama", layers=2), tm.build("llama", layers=2)
    stage = llama_stages(model)[g.rank]
    pipe = pp.Pipeline(stage, g, schedule, MICROBATCHES, loss_fn=pp.causal_lm_loss)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_params = dict(ref.named_parameters())
    mine = {n: q for n, q in model.named_parameters() if any(q is s for s in stage.parameters())}
    tied = model.lm_head.weight
    for step in range(STEPS):
        b = tm.left_padded_batch(step, MICROBATCHES * PER_MB, PER_MB)
        ids, labels = b["input_ids"], b["labels"]
        losses = pipe.step(ids if pipe.is_first else None, target=labels if pipe.is_last else None)
        g.all_reduce(tied.grad)  # the embedding's part (rank 0) plus the head's (rank 1)
        want = pp.causal_lm_loss(ref(input_ids=ids).logits, labels)
        want.backward()
        if pipe.is_last:
            assert losses is not None
            rep.close(f"llama {schedule} loss {step}", np.array(np.mean(losses)), np.array(float(want)), 1e-5)
        for n, q in sorted(mine.items()):
            assert q.grad is not None, n
            rep.close(f"llama {schedule} grad {n} {step}", q.grad.numpy(), ref_params[n].grad.numpy(), 1e-4)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    for n, q in sorted(mine.items()):
        rep.close(f"llama {schedule} final {n}", q.detach().numpy(), ref_params[n].detach().numpy(), 1e-4)


def misbehaving(world: Any, rep: Report, what: str) -> None:
    """Stage 0 returns a dict (``dict``), or three tensors and then two (``count``)."""
    import torch

    g = world.group.new_subgroup([0, 1])  # a pipeline's failure ends its group's messages: one group each
    stages = stage_modules(2)
    calls = [0]
    first_forward = stages[0].forward

    def forward(*x: Any) -> Any:
        calls[0] += 1
        h, r, ids = first_forward(*x)
        if what == "dict":
            return {"h": h, "r": r, "ids": ids}
        return (h, r, ids) if calls[0] <= MICROBATCHES else (h, r)

    stages[0].forward = forward
    pipe = pp.Pipeline(stages[g.rank], g, "1f1b", MICROBATCHES, loss_fn=torch.nn.functional.mse_loss)
    x, y = batch(0)

    def step() -> Any:
        return pipe.step(x if pipe.is_first else None, target=y if pipe.is_last else None)

    if what == "count":
        step()  # the first step sends three tensors
    if g.rank == 0:
        needle = "tuple of tensors" if what == "dict" else "was a tuple of 3 and is a tuple of 2 now"
        rep.raises(f"{what}: the stage's own rank", ValueError, step, needle)
    else:
        rep.raises(f"{what}: the other stage", pp.TransportError, step, "group rank 0 failed")


def scenario(world: Any, rep: Report) -> None:
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b"):
        equivalence(world, rep, schedule)
    for schedule in ("gpipe", "1f1b"):
        llama_equivalence(world, rep, schedule)
    misbehaving(world, rep, "dict")
    misbehaving(world, rep, "count")


if __name__ == "__main__":
    run_rank(scenario)
