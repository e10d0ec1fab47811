"""Expert parallel (the ``"experts"`` style of ``pp.parallelize``) on transformers' Mixtral at a tiny config.

``train DIR`` (world 2): each rank keeps half of every layer's experts, trains under ``pp.DDP`` on its half
of the batch with AdamW and ``ddp.clip_grad_norm_``, and checks every step against one process training the
whole model on the whole batch (float64, the model's eager expert loop): the mean of the ranks' losses (to
float32's precision: transformers computes the loss on float32 logits), the
clipped norm (clipping active), the final parameters (``full_state_dict``: the dense experts gathered) and
this rank's block of each expert tensor; that torch's own ``clip_grad_norm_`` would see a different norm on
each rank (the README's warning); the same for one step in float32 with the model's default (grouped
matmul) expert code; two steps of Qwen3-MoE (another family, the same fused experts); a checkpoint of the split model and its AdamW state (``pp.tp_optim_state``) that loads into the plain model and a fresh AdamW, equal to one process's moments. Errors: experts
that do not split over the ranks, a module that is not a fused experts module (nothing changed after either),
``pp.FSDP`` of the split model, ``DDP.join()`` over it, a pipeline stage of it. And the split experts module alone against the dense
one (``dispatch_edges``): tokens that stay on their rank, a rank with no tokens, a padding choice, no token
choosing a rank's experts (they still get a gradient, of zeros, as the dense tensors do).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp

VOCAB, SEQ, ROWS, STEPS = 32, 8, 4, 3
PLAN = {"*mlp.experts": "experts"}


def build(seed: int = 0, *, experts: int = 4, eager: bool = True, family: str = "mixtral") -> Any:
    """A tiny ``family`` model ("mixtral", or "qwen3_moe": another family whose fused experts module has the
    same shape), float64 with the eager expert loop, or float32 with the model's default expert code."""
    import torch
    import transformers as t

    warnings.filterwarnings("ignore")
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=SEQ,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
        **({"experts_implementation": "eager"} if eager else {}),
    )
    if family == "mixtral":
        model = t.MixtralForCausalLM(t.MixtralConfig(num_local_experts=experts, **common))
    else:
        cfg = t.Qwen3MoeConfig(num_experts=experts, moe_intermediate_size=12, norm_topk_prob=True, **common)
        model = t.Qwen3MoeForCausalLM(cfg)
    return model.double() if eager else model.float()


def batch(step: int) -> Any:
    import torch

    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(100 + step))


def _local_norm(model: Any) -> float:
    return float(
        sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None) ** 0.5
    )


def train(
    rep: Report, world: Any, root: Path, *, eager: bool, steps: int, rtol: float, family: str = "mixtral"
) -> None:
    import torch

    g = world.group
    r, n = g.rank, g.size
    what = f"{family} " + ("float64 eager" if eager else "float32 grouped")
    ref, model = build(eager=eager, family=family), build(eager=eager, family=family)
    pp.parallelize(model, g, PLAN)
    experts = model.model.layers[0].mlp.experts
    dense = ref.model.layers[0].mlp.experts
    rep.check(
        f"{what}: local experts", experts.num_experts == 4 // n and experts.gate_up_proj.shape[0] == 4 // n
    )
    block = slice(r * (4 // n), (r + 1) * (4 // n))
    rep.check(
        f"{what}: this rank's block", bool(torch.equal(experts.down_proj.detach(), dense.down_proj[block]))
    )
    ddp = pp.DDP(model, g)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    clipped = 0
    for step in range(steps):
        ids = batch(step)
        mine = ids[r * (ROWS // n) : (r + 1) * (ROWS // n)]
        loss = ddp(input_ids=mine, labels=mine).loss
        loss.backward()
        own = _local_norm(model)  # what torch.nn.utils.clip_grad_norm_ would use on this rank
        norm = ddp.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        mean = loss.detach().double().reshape(1).clone()
        g.all_reduce(mean.numpy(), "mean")
        # transformers computes the causal LM loss on float32 logits (loss_utils: logits.float())
        rep.close(f"{what}: step {step} loss", float(mean[0]), float(ref_loss), max(rtol, 1e-6))
        rep.close(f"{what}: step {step} clipped norm", float(norm), float(ref_norm), rtol)
        clipped += float(ref_norm) > 0.5
        owns = g.all_gather(torch.tensor([own], dtype=torch.float64).numpy())
        rep.check(
            f"{what}: step {step} torch's local norm differs per rank and from the model's",
            abs(owns[0] - owns[1]) > 1e-6 and all(abs(o - float(ref_norm)) > 1e-6 for o in owns),
            f"{owns} against {float(ref_norm)}",
        )
    rep.check(f"{what}: clipping was active", clipped == steps, f"{clipped} of {steps}")
    full = model.full_state_dict()
    want = ref.state_dict()
    rep.check(f"{what}: keys", sorted(full) == sorted(want))
    for k, v in want.items():
        rep.close(f"{what}: final {k}", full[k].numpy(), v.detach().numpy(), rtol)
    if eager and family == "mixtral":
        path = root / "ep2"
        pp.checkpoint.save({"model": model, "optim": pp.tp_optim_state(model, opt)}, path, g)
        plain = build(seed=5)
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)  # fresh: no state, another learning rate
        pp.checkpoint.load({"model": plain, "optim": pp.tp_optim_state(plain, plain_opt)}, path, g)
        for k, v in plain.state_dict().items():
            rep.check(f"checkpoint into the plain model: {k}", bool(torch.equal(v, full[k])))
        # AdamW's moments of the split experts come back as the dense model's (one process's) after the steps
        ref_params, plain_params = dict(ref.named_parameters()), dict(plain.named_parameters())
        for name, p in ref_params.items():
            want_state, got_state = ref_opt.state[p], plain_opt.state[plain_params[name]]
            for key in ("exp_avg", "exp_avg_sq"):
                rep.close(
                    f"optimizer state {name}.{key}", got_state[key].numpy(), want_state[key].numpy(), rtol
                )
            rep.check(
                f"optimizer step count {name}", float(got_state["step"]) == float(want_state["step"]) == steps
            )
        rep.check("optimizer learning rate", plain_opt.param_groups[0]["lr"] == 1e-2)


def dispatch_edges(rep: Report, world: Any) -> None:
    """The split experts module alone against the dense one, on this rank's tokens: every choice on this
    rank's own experts (nothing sent to the other rank), no tokens at all on rank 0, a padding choice
    (``num_experts``, which Mixtral's own forward skips); outputs and the gradients of the hidden states and
    router weights equal, and the experts' gradients summed over the ranks equal the dense one's."""
    import torch

    g = world.group
    r = g.rank
    dense = build().model.layers[0].mlp.experts
    split = build().model.layers[0].mlp.experts
    holder = torch.nn.ModuleDict({"experts": split})
    pp.parallelize(holder, g, {"experts": "experts"})
    gen = torch.Generator().manual_seed(7 + r)
    cases = {
        "own experts only": torch.tensor([[2 * r, 2 * r + 1]] * 3),
        "no tokens here": torch.zeros((0, 2), dtype=torch.long) if r == 0 else torch.tensor([[0, 3], [1, 2]]),
        "a padding choice": torch.tensor([[0, 4], [3, 1], [4, 2]]),
        "no token chooses rank 0's experts": torch.tensor([[2, 3], [3, 2]]),
    }
    for what, idx in cases.items():
        x = torch.randn((idx.shape[0], 16), generator=gen, dtype=torch.float64)
        w = torch.rand(idx.shape, generator=gen, dtype=torch.float64)
        outs, grads = [], []
        for module in (holder["experts"], dense):
            module.zero_grad()
            xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            out = module(xi, idx, wi)
            if out.requires_grad:  # the dense module on no tokens builds no graph; the split one must (below)
                (out * torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
            elif module is not dense:
                rep.check(
                    f"{what}: the split module's output is in the graph (its backward exchanges)", False
                )
            outs.append(out.detach())
            if module is not dense:  # torch's dense tensors get a gradient whenever any expert is chosen
                rep.check(f"{what}: the split experts have a gradient", module.down_proj.grad is not None)
            grads.append(
                tuple(
                    t.grad if t.grad is not None else torch.zeros_like(t) for t in (xi, wi, module.down_proj)
                )
            )
        rep.close(f"{what}: output", outs[0].numpy(), outs[1].numpy(), 1e-12)
        rep.close(f"{what}: hidden states' gradient", grads[0][0].numpy(), grads[1][0].numpy(), 1e-12)
        rep.close(f"{what}: router weights' gradient", grads[0][1].numpy(), grads[1][1].numpy(), 1e-12)
        total = grads[1][2].detach().clone().contiguous()
        g.all_reduce(total.numpy(), "sum")
        mine = total[2 * r : 2 * r + 2]
        rep.close(f"{what}: experts' gradient", grads[0][2].numpy(), mine.numpy(), 1e-12)


def errors(rep: Report, world: Any) -> None:
    g = world.group
    rep.raises(
        "experts that do not split",
        ValueError,
        lambda: pp.parallelize(build(experts=3), g, PLAN),
        "3 experts, which do not split over 2 expert-parallel ranks",
    )
    rep.raises(
        "not a fused experts module",
        ValueError,
        lambda: pp.parallelize(build(), g, {"*mlp.gate": "experts"}),
        "ExpertParallel applies to a fused experts module",
    )
    untouched = build(experts=3)
    before = untouched.model.layers[0].mlp.experts.gate_up_proj
    try:
        pp.parallelize(untouched, g, PLAN)
    except ValueError:
        pass
    rep.check("a refused plan changes nothing", untouched.model.layers[0].mlp.experts.gate_up_proj is before)
    split = pp.parallelize(build(), g, PLAN)
    rep.raises(
        "FSDP of the split model", ValueError, lambda: pp.FSDP(split, g), "does not shard expert-parallel"
    )
    rep.raises(
        "DDP.join with split experts",
        ValueError,
        lambda: pp.DDP(split, g).join().__enter__(),
        "cannot take part in the other ranks' token exchanges",
    )
    rep.raises(
        "a pipeline stage of the split model",
        ValueError,
        lambda: pp.Pipeline(split, g, "gpipe", 2),
        "does not run expert-parallel stages",
    )


def scenario(world: Any, rep: Report) -> None:
    root = Path(sys.argv[2])
    train(rep, world, root, eager=True, steps=STEPS, rtol=1e-9)
    train(rep, world, root, eager=False, steps=1, rtol=1e-5)
    train(rep, world, root, eager=True, steps=2, rtol=1e-9, family="qwen3_moe")
    dispatch_edges(rep, world)
    errors(rep, world)


if __name__ == "__main__":
    run_rank(scenario)
