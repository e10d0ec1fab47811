"""FSDP against one process where it used to differ: prefetched gathers that outlived an optimizer step,
frozen parameters in the state dicts, replicated state at wrap time, the mixed-precision compute dtype.

Usage: ``fsdp_edges.py prefetch|frozen|sync|mixed`` (world 2).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import BF16, Report, run_rank

import paramplane as pp
from paramplane.nn import CrossEntropyLoss, Linear, Module, Parameter, ReLU, Sequential
from paramplane.optim import SGD

GLOBAL = 8  # rows per step; rank r trains on rows [r * GLOBAL / N, (r + 1) * GLOBAL / N)
RTOL = 1e-10


def _data(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((GLOBAL, 6)), rng.integers(0, 6, GLOBAL)


def _rows(world: Any) -> slice:
    k = GLOBAL // world.world_size
    return slice(world.rank * k, (world.rank + 1) * k)


class Net(Module):
    """Three Linear children registered in ``order`` and always called a, b, (c): c only when ``use_c``."""

    def __init__(self, order: str) -> None:
        super().__init__()
        for name in order:
            setattr(self, name, Linear(6, 6, dtype=np.float64, rng=ord(name)))
        self.use_c = True

    def forward(self, x: Any) -> Any:
        h = self.b.forward(self.a.forward(x))
        return self.c.forward(h) if self.use_c else h

    def backward(self, g: Any) -> Any:
        if self.use_c:
            g = self.c.backward(g)
        return self.a.backward(self.b.backward(g))


def _native_case(
    world: Any, rep: Report, name: str, order: str, uses: list[bool], kw: dict[str, Any]
) -> None:
    """FSDP (prefetching) trains like one process on the whole batch when units are skipped in some steps
    or called in another order than registered; no gather is left pending across an optimizer step."""
    ref, model = Net(order), Net(order)
    ref_opt = SGD(ref.parameters(), lr=0.1, momentum=0.9)
    fsdp = pp.FSDP(model, world.group, **kw)
    opt = SGD(fsdp.parameters(), lr=0.1, momentum=0.9)
    fsdp.attach(opt)
    crit, ref_crit = CrossEntropyLoss(), CrossEntropyLoss()
    for step, use_c in enumerate(uses):
        x, y = _data(step)
        ref.use_c = model.use_c = use_c
        want = float(ref_crit.forward(ref.forward(x), y))
        ref.backward(ref_crit.backward())
        for p in ref.parameters():  # a flat shard steps an unused parameter with a zero gradient (README)
            if p.grad is None:
                p.grad = np.zeros_like(p.data)
        ref_opt.step()
        ref_opt.zero_grad()
        local = float(crit.forward(fsdp(x[_rows(world)]), y[_rows(world)]))
        fsdp.backward(crit.backward())
        opt.step()
        opt.zero_grad()
        got = float(world.group.all_reduce(np.array([local]), "sum")[0]) / world.world_size
        rep.check(f"{name} step {step} loss", abs(got - want) <= RTOL * abs(want), f"{got!r} vs {want!r}")
        pending = [u.name for u in fsdp.units if u.gather_work is not None]
        rep.check(f"{name} step {step}: no gather pending after opt.step()", not pending, str(pending))
    now, want_sd = fsdp.state_dict(), ref.state_dict()
    for key, value in want_sd.items():
        rep.equal(f"{name} {key}", now[key], value, rtol=RTOL)


def _torch_order_case(world: Any, rep: Report) -> None:
    import torch

    class TNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.b = torch.nn.Linear(6, 6).double()  # registered first, called second
            self.a = torch.nn.Linear(6, 6).double()

        def forward(self, x: Any) -> Any:
            return self.b(torch.tanh(self.a(x)))

    ref, model = TNet(), TNet()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    fsdp = pp.FSDP(model, world.group, "full_shard")
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1, momentum=0.9)
    fsdp.attach(opt)
    for step in range(4):
        x, y = (torch.from_numpy(a) for a in _data(step))
        loss = torch.nn.functional.cross_entropy(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        local = torch.nn.functional.cross_entropy(fsdp(x[_rows(world)]), y[_rows(world)])
        local.backward()
        opt.step()
        opt.zero_grad()
        got = float(world.group.all_reduce(np.array([float(local.detach())]), "sum")[0]) / world.world_size
        want = float(loss.detach())
        rep.check(f"torch step {step} loss", abs(got - want) <= RTOL * abs(want), f"{got!r} vs {want!r}")
    now = fsdp.state_dict()
    for key, value in ref.state_dict().items():
        rep.equal(f"torch {key}", np.asarray(now[key]), value.numpy(), rtol=RTOL)


def prefetch(world: Any, rep: Report) -> None:
    skips = [True, False, True, True, False, True]
    _native_case(world, rep, "skipped unit", "abc", skips, {})
    _native_case(world, rep, "registered b,c,a", "bca", [True] * 4, {})
    _native_case(world, rep, "registered b,c,a post", "bca", [True] * 4, {"backward_prefetch": "post"})
    _native_case(world, rep, "c,b,a shard_grad_op", "cba", skips, {"strategy": "shard_grad_op"})
    _torch_part(rep, _torch_order_case, world)


def _torch_part(rep: Report, case: Any, *args: Any) -> None:
    """``case(*args, rep)``'s checks where torch is installed (the cross-checks against torch skip without it,
    as under Python 3.13); ``torch_checks`` counts them for the test's lower bound."""
    if importlib.util.find_spec("torch") is None:
        return
    before = rep.num_checks
    case(*args, rep)
    rep.values["torch_checks"] = rep.values.get("torch_checks", 0) + rep.num_checks - before


class Scale(Module):
    """``x * w + running`` with a buffer ``running``."""

    def __init__(self, n: int, seed: int) -> None:
        super().__init__()
        self.w = Parameter(np.random.default_rng(seed).standard_normal(n))
        self.register_buffer("running", np.full(n, float(seed) + 0.5))

    def forward(self, x: Any) -> Any:
        self._save(x=x)
        return x * self.w.data + self.running

    def backward(self, g: Any) -> Any:
        x = self._take_saved()["x"]
        self.w.accumulate_grad((g * x).sum(0))
        return g * self.w.data


def _frozen_model(seed: int) -> Sequential:
    """A model whose first bias is frozen (and a buffer): every value depends on ``seed``."""
    m = Sequential(
        Linear(6, 5, dtype=np.float64, rng=seed),
        ReLU(),
        Scale(5, seed),
        Linear(5, 6, dtype=np.float64, rng=seed + 7),
    )
    m[0].bias.requires_grad = False
    return m


def frozen(world: Any, rep: Report) -> None:
    """Frozen parameters are replicated module state: in every state dict, loaded, checkpointed, used."""
    model, ref = _frozen_model(0), _frozen_model(0)
    fsdp = pp.FSDP(model, world.group)
    want = ref.state_dict()
    sd = fsdp.state_dict()
    rep.check("state_dict keys", sorted(sd) == sorted(want), f"{sorted(sd)} vs {sorted(want)}")
    for key, value in want.items():
        rep.equal(f"state_dict {key}", sd.get(key), value)
    changed = {k: v + 1.0 for k, v in want.items()}
    fsdp.load_state_dict(changed)
    rep.equal("loaded frozen bias", np.array(model[0].bias.data), changed["0.bias"])
    rep.equal("loaded frozen bias round trip", fsdp.state_dict()["0.bias"], changed["0.bias"])
    sharded = fsdp.sharded_state_dict()
    whole = sharded.get("0.bias")
    rep.check("sharded frozen bias is a whole array", isinstance(whole, np.ndarray), type(whole).__name__)
    rep.check("sharded keys", sorted(sharded) == sorted(want), str(sorted(sharded)))
    fsdp.load_sharded_state_dict({**sharded, "0.bias": want["0.bias"]})
    rep.equal("sharded-loaded frozen bias", np.array(model[0].bias.data), want["0.bias"])
    root = Path(os.environ["PARAMPLANE_TEST_OUT"]) / "ckpt"
    fsdp.load_state_dict(want)
    path = pp.checkpoint.save({"model": fsdp}, root / "frozen", world.group)
    model[0].bias.data[...] = 0.0
    pp.checkpoint.load({"model": fsdp}, path, world.group)
    rep.equal("checkpoint restores the frozen bias", np.array(model[0].bias.data), want["0.bias"])
    # Training uses the frozen bias and never changes it, like one process on the whole batch.
    opt = SGD(fsdp.parameters(), lr=0.1)
    fsdp.attach(opt)
    ref_opt = SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    crit, ref_crit = CrossEntropyLoss(), CrossEntropyLoss()
    for step in range(2):
        x, y = _data(step)
        ref_crit.forward(ref.forward(x), y)
        ref.backward(ref_crit.backward())
        ref_opt.step()
        ref_opt.zero_grad()
        crit.forward(fsdp(x[_rows(world)]), y[_rows(world)])
        fsdp.backward(crit.backward())
        opt.step()
        opt.zero_grad()
    now = fsdp.state_dict()
    for key, value in ref.state_dict().items():
        rep.equal(f"trained {key}", now[key], value, rtol=RTOL)
    _torch_part(rep, _torch_frozen, world)


def _torch_model(seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2)).double()
    m[1].running_mean.fill_(float(seed) + 0.5)
    m[0].bias.requires_grad_(False)
    return m


def _torch_frozen(world: Any, rep: Report) -> None:
    model, ref = _torch_model(0), _torch_model(0)
    fsdp = pp.FSDP(model, world.group)
    want = {k: v.numpy().copy() for k, v in ref.state_dict().items()}
    sd = fsdp.state_dict()
    rep.check("torch state_dict keys", sorted(sd) == sorted(want), f"{sorted(sd)} vs {sorted(want)}")
    for key, value in want.items():
        rep.equal(f"torch state_dict {key}", np.asarray(sd.get(key)), value)
    fsdp.load_state_dict({k: v * 2.0 for k, v in want.items()})
    rep.equal("torch loaded frozen bias", model[0].bias.detach().numpy(), want["0.bias"] * 2.0)
    rep.check("torch sharded keys", sorted(fsdp.sharded_state_dict()) == sorted(want), "")


def sync(world: Any, rep: Report) -> None:
    """sync_module_states=True makes every rank's frozen parameters and buffers group rank 0's."""
    model = _frozen_model(world.rank)  # different on every rank
    fsdp = pp.FSDP(model, world.group)
    want = _frozen_model(0).state_dict()  # what rank 0 built
    sd = fsdp.state_dict()
    for key, value in want.items():
        rep.equal(f"synced {key}", sd.get(key), value)
    rep.equal("synced buffer in the module", np.array(model[2].running), want["2.running"])
    rep.equal("synced frozen bias in the module", np.array(model[0].bias.data), want["0.bias"])
    own = _frozen_model(world.rank)
    pp.FSDP(own, world.group, sync_module_states=False)
    rep.equal("unsynced buffer stays", np.array(own[2].running), _frozen_model(world.rank)[2].running)
    _torch_part(rep, _torch_synced, world)


def _torch_synced(world: Any, rep: Report) -> None:
    tmodel = _torch_model(world.rank)
    tfsdp = pp.FSDP(tmodel, world.group)
    tsd = tfsdp.state_dict()
    for key, value in _torch_model(0).state_dict().items():
        rep.equal(f"torch synced {key}", np.asarray(tsd[key]), value.numpy())
    rep.equal("torch synced running_mean", tmodel[1].running_mean.numpy(), np.full(3, 0.5))


def mixed(world: Any, rep: Report) -> None:
    """Mixed precision computes in param_dtype: floating inputs are cast to it, as one process computing in
    param_dtype does (numpy: float16 outputs float16; bfloat16 matmuls return float32); output_dtype casts."""

    def make() -> Sequential:
        return Sequential(Linear(6, 5, rng=0), ReLU(), Linear(5, 4, rng=1))  # float32 master

    x = np.random.default_rng(world.rank).standard_normal((4, 6)).astype(np.float32)
    for param, out, want_dtype in (
        ("float16", None, np.dtype(np.float16)),
        ("bfloat16", None, np.dtype(np.float32)),
        ("float16", "float32", np.dtype(np.float32)),
    ):
        name = f"param {param}, output {out}"
        ref = make()
        for p in ref.parameters():
            p.data = p.data.astype(param if param != "bfloat16" else BF16)
        compute = np.dtype(param) if param != "bfloat16" else BF16
        expected = ref.forward(x.astype(compute))
        expected = expected.astype(out) if out is not None else expected
        mp = pp.MixedPrecision(param_dtype=param, reduce_dtype="float32", output_dtype=out)
        fsdp = pp.FSDP(make(), world.group, mixed_precision=mp)
        y = fsdp(x)
        rep.check(f"{name}: output dtype", y.dtype == want_dtype, f"{y.dtype} vs {want_dtype}")
        rep.equal(f"{name}: output equals one process computing in {param}", y, expected)
        fsdp.backward(np.ones_like(y) / y.size)
        fsdp.finish_gradient_sync()
        grads = [p.grad for p in fsdp.parameters()]
        rep.check(
            f"{name}: float32 gradients on the master shards",
            all(g is not None and g.dtype == np.float32 and np.isfinite(g).all() for g in grads),
            str([None if g is None else g.dtype for g in grads]),
        )


def main() -> None:
    which = sys.argv[1]
    scenarios = {"prefetch": prefetch, "frozen": frozen, "sync": sync, "mixed": mixed}
    run_rank(scenarios[which])


if __name__ == "__main__":
    main()
