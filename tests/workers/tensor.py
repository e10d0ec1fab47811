"""Tensor-parallel scenarios: the TP MLP equals the dense one; TP x DP trains like one process.

Usage: ``tensor.py tp`` (world 2: tp=2) or ``tensor.py tpdp DIR`` (world 4: dp=2 x tp=2; then a checkpoint in
DIR of the trained TP model and its optimizer loads into a fresh TP model and into the dense one).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp
from paramplane.nn import GELU, Linear, MSELoss, Sequential
from paramplane.optim import SGD, AdamW
from paramplane.parallel.ddp import shard_range

D, H = 8, 12
RTOL = 1e-12


def tp_mlp(group: Any, **kw: Any) -> Sequential:
    return Sequential(
        pp.ColumnParallelLinear(D, H, group, dtype=np.float64, rng=5, **kw.get("col", {})),
        GELU(),
        pp.RowParallelLinear(H, D, group, dtype=np.float64, rng=6, **kw.get("row", {})),
    )


def dense_mlp() -> Sequential:
    return Sequential(Linear(D, H, dtype=np.float64, rng=5), GELU(), Linear(H, D, dtype=np.float64, rng=6))


def tp(world: Any, rep: Report) -> None:
    g = world.group
    r, k = g.rank, H // g.size
    x = np.random.default_rng(1).standard_normal((4, 3, D))
    grad_y = np.random.default_rng(2).standard_normal((4, 3, D))
    dense, model = dense_mlp(), tp_mlp(g)
    y_dense, y = dense.forward(x), model.forward(x)
    rep.equal("output", y, y_dense, rtol=RTOL)
    gx_dense, gx = dense.backward(grad_y), model.backward(grad_y)
    rep.equal("input grad", gx, gx_dense, rtol=RTOL)
    rep.equal("col weight grad", model[0].weight.grad, dense[0].weight.grad[r * k : (r + 1) * k], rtol=RTOL)
    rep.equal("col bias grad", model[0].bias.grad, dense[0].bias.grad[r * k : (r + 1) * k], rtol=RTOL)
    model_row_grad = dense[2].weight.grad[:, r * k : (r + 1) * k]
    rep.equal("row weight grad", model[2].weight.grad, model_row_grad, rtol=RTOL)
    rep.equal("row bias grad", model[2].bias.grad, dense[2].bias.grad, rtol=RTOL)
    # The other paths: gathered column output, and a row layer that splits a full input itself.
    wide = tp_mlp(g, col={"gather_output": True}, row={"input_is_parallel": False})
    rep.equal("gathered path output", wide.forward(x), y_dense, rtol=RTOL)
    rep.equal("gathered path input grad", wide.backward(grad_y), gx_dense, rtol=RTOL)
    rep.equal(
        "gathered path row grad", wide[2].weight.grad, dense[2].weight.grad[:, r * k : (r + 1) * k], rtol=RTOL
    )
    # full_weight / load_full_weight
    for i in (0, 2):
        w, b = model[i].full_weight()
        rep.equal(f"full weight {i}", w, dense[i].weight.data)
        rep.equal(f"full bias {i}", b, dense[i].bias.data)
        model[i].load_full_weight(w * 2, b * 2)
        w2, _ = model[i].full_weight()
        rep.equal(f"loaded weight {i}", w2, dense[i].weight.data * 2)
    # Frozen shards get no gradient; the input gradient still flows (and still all-reduces).
    frozen = tp_mlp(g)
    frozen[0].weight.requires_grad = False
    frozen[2].bias.requires_grad = False
    frozen.forward(x)
    rep.equal("frozen input grad", frozen.backward(grad_y), gx_dense, rtol=RTOL)
    rep.check("frozen weight has no grad", frozen[0].weight.grad is None)
    rep.check("frozen bias has no grad", frozen[2].bias.grad is None)
    rep.equal("unfrozen grad", frozen[2].weight.grad, model_row_grad, rtol=RTOL)
    # Without a seed the ranks still slice one dense layer: the replicated bias is the same on each.
    unseeded = pp.RowParallelLinear(H, D, g, dtype=np.float64)
    biases = g.all_gather(unseeded.bias.data).reshape(g.size, -1)
    rep.check("unseeded bias replicated", bool(np.array_equal(biases[0], biases[1])), str(biases))
    no_bias = pp.ColumnParallelLinear(D, H, g, bias=False, rng=5)
    rep.raises(
        "bias for a layer without",
        ValueError,
        lambda: no_bias.load_full_weight(*wide[0].full_weight()),
        "no bias",
    )
    sharded = pp.FSDP(tp_mlp(g), world.new_group([world.rank]))
    rep.raises("fsdp over tp checkpoint", ValueError, sharded.sharded_state_dict, "tensor-parallel")
    rep.raises("uneven split", ValueError, lambda: pp.ColumnParallelLinear(D, 7, g), "out_features=7")
    rep.raises("uneven row", ValueError, lambda: pp.RowParallelLinear(7, D, g), "in_features=7")
    rep.raises("wrong slice", ValueError, lambda: model[2].forward(np.ones((2, H))), f"(..., {k})")
    attention(g, rep)
    # Ranks that disagree on the batch fail the tp group's all-reduce on both, naming the shapes.
    bad = np.ones((2 + r, D))
    rep.raises("mismatch", pp.CollectiveMismatch, lambda: model.forward(bad), "all_reduce")


def attention(g: Any, rep: Report) -> None:
    """pp.TensorParallelAttention equals pp.nn.MultiHeadAttention (heads split over tp): output, input
    gradient and every parameter gradient (q/k/v rows and output columns of this rank's heads), with one
    all-reduce forward and one backward."""
    from paramplane.nn import MultiHeadAttention

    heads, k = 4, D // g.size
    lo = g.rank * k
    dense = MultiHeadAttention(D, heads, dtype=np.float64, rng=7)
    attn = pp.TensorParallelAttention(D, heads, g, dtype=np.float64, rng=7)
    rep.check("attention local heads", attn.local_heads == heads // g.size, str(attn.local_heads))
    x = np.random.default_rng(3).standard_normal((2, 5, D))
    grad_y = np.random.default_rng(4).standard_normal((2, 5, D))
    calls = [0]
    inner = g.all_reduce

    def counting(x: Any, op: str = "sum", **kw: Any) -> Any:
        calls[0] += 1
        return inner(x, op, **kw)

    g.all_reduce = counting
    rep.equal("attention output", attn.forward(x), dense.forward(x), rtol=RTOL)
    rep.equal("attention input grad", attn.backward(grad_y), dense.backward(grad_y), rtol=RTOL)
    del g.all_reduce
    rep.check("attention all-reduces", calls[0] == 2, str(calls[0]))
    for name in ("q", "k", "v"):
        mine, full = getattr(attn, name), getattr(dense, name)
        rep.equal(f"attention {name} weight grad", mine.weight.grad, full.weight.grad[lo : lo + k], rtol=RTOL)
        rep.equal(f"attention {name} bias grad", mine.bias.grad, full.bias.grad[lo : lo + k], rtol=RTOL)
    rep.equal("attention o weight grad", attn.o.weight.grad, dense.o.weight.grad[:, lo : lo + k], rtol=RTOL)
    rep.equal("attention o bias grad", attn.o.bias.grad, dense.o.bias.grad, rtol=RTOL)
    names = [n for n, _ in attn.named_parameters()]
    rep.check(
        "attention keys are the dense keys", names == [n for n, _ in dense.named_parameters()], str(names)
    )
    rep.raises(
        "attention heads", ValueError, lambda: pp.TensorParallelAttention(D, 3, g), "num_heads=3", "2 ranks"
    )


def tpdp(world: Any, rep: Report) -> None:
    mesh = pp.Mesh(world, dp=2, tp=2)
    rep.check(
        "tp members", mesh.group("tp").ranks == [world.rank // 2 * 2, world.rank // 2 * 2 + 1], str(mesh)
    )
    rep.check("dp members", mesh.group("dp").ranks == [world.rank % 2, world.rank % 2 + 2], str(mesh))
    rep.check("coords", mesh.coords == {"dp": world.rank // 2, "tp": world.rank % 2}, str(mesh.coords))
    optimizers = {
        "sgd": lambda ps: SGD(ps, lr=0.1, momentum=0.9),
        "adamw": lambda ps: AdamW(ps, lr=1e-2, weight_decay=0.01),
    }
    for name, make_opt in optimizers.items():
        model = tp_mlp(mesh.group("tp"))
        ddp = pp.DDP(model, mesh.group("dp"))
        opt = make_opt(model.parameters())
        ddp.attach(opt)
        dense = dense_mlp()
        ref_opt = make_opt(dense.parameters())
        crit, ref_crit = MSELoss(), MSELoss()
        a, b = shard_range(8, 2, mesh.coordinate("dp"))
        for step in range(3):
            rng = np.random.default_rng(10 + step)
            x, t = rng.standard_normal((8, D)), rng.standard_normal((8, D))
            ref_loss = ref_crit.forward(dense.forward(x), t)
            dense.backward(ref_crit.backward())
            ref_opt.step()
            ref_opt.zero_grad()
            loss = crit.forward(ddp.forward(x[a:b]), t[a:b])
            ddp.backward(crit.backward())
            opt.step()
            opt.zero_grad()
            # Each dp replica's loss is its half's; their mean is the whole batch's.
            mean = mesh.group("dp").all_reduce(np.array([float(loss)]), "mean")
            rep.equal(f"{name} loss {step}", mean, np.array([float(ref_loss)]), rtol=1e-10)
        for i in (0, 2):
            w, bias = model[i].full_weight()
            rep.equal(f"{name} trained weight {i}", w, dense[i].weight.data, rtol=1e-10)
            rep.equal(f"{name} trained bias {i}", bias, dense[i].bias.data, rtol=1e-10)
    checkpoint_tp(world, mesh, model, ddp, opt, dense, ref_opt, Path(sys.argv[2]), rep)


def checkpoint_tp(
    world: Any, mesh: Any, model: Any, ddp: Any, opt: Any, dense: Any, ref_opt: Any, root: Path, rep: Report
) -> None:
    """The trained TP model and its AdamW, saved over the world, load into a fresh TP model (other seeds) and,
    on each rank alone, into the dense model: the checkpoint holds the dense arrays."""
    path = pp.checkpoint.save({"model": ddp, "opt": opt}, root / "tp", world.group)
    fresh = Sequential(
        pp.ColumnParallelLinear(D, H, mesh.group("tp"), dtype=np.float64, rng=7),
        GELU(),
        pp.RowParallelLinear(H, D, mesh.group("tp"), dtype=np.float64, rng=8),
    )
    fresh_opt = AdamW(fresh.parameters(), lr=1.0)
    pp.checkpoint.load({"model": fresh, "opt": fresh_opt}, path, world.group)
    for i in (0, 2):
        rep.equal(f"loaded tp weight {i}", fresh[i].weight.data, model[i].weight.data)
        rep.equal(f"loaded tp bias {i}", fresh[i].bias.data, model[i].bias.data)
    for j, p in enumerate(model.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            rep.equal(f"loaded tp {key} {p.name}", fresh_opt.state[j][key], opt.state[j][key])
        rep.check(f"loaded tp step {p.name}", fresh_opt.state[j]["step"] == opt.state[j]["step"])
    alone = world.new_group([world.rank])
    plain = dense_mlp()
    for p in plain.parameters():
        p.data[...] = 0
    plain_opt = AdamW(plain.parameters(), lr=1.0)
    pp.checkpoint.load({"model": plain, "opt": plain_opt}, path, alone)
    for (name, p), q in zip(plain.named_parameters(), dense.parameters(), strict=True):
        rep.equal(f"dense {name}", p.data, q.data, rtol=1e-10)
    for j in ref_opt.state:
        for key in ("exp_avg", "exp_avg_sq"):
            rep.equal(f"dense {key} {j}", plain_opt.state[j][key], ref_opt.state[j][key], rtol=1e-9)


if __name__ == "__main__":
    run_rank(tp if sys.argv[1] == "tp" else tpdp)
