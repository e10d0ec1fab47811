"""pp.DiLoCo in a world of 4 ranks on 2 emulated hosts: every rank checks DiLoCo against a single-process
simulation of all replicas (written here in numpy, independent of the class), against DDP at H = 1, the
fragment schedule and the wire dtypes (through a spying group), checkpoints, FSDP inside a host and a torch
module with a torch inner optimizer."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp
from paramplane.group import ProcessGroup
from paramplane.nn import GELU, Linear, Module, MSELoss, Sequential
from paramplane.optim import SGD

F64 = np.float64
IN, HID, OUT, BATCH = 5, 8, 3, 4
# Parameter sizes: 40, 8, 24, 3 (75 elements)
FRAGS = {1: [[0, 1, 2, 3]], 2: [[0], [1, 2, 3]], 4: [[0], [1], [2], [3]]}


def make_model(seed: int = 3) -> Module:
    rng = np.random.default_rng(seed)
    return Sequential(Linear(IN, HID, dtype=F64, rng=rng), GELU(), Linear(HID, OUT, dtype=F64, rng=rng))


def data(step: int, who: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 * step + who)
    return rng.standard_normal((BATCH, IN)), rng.standard_normal((BATCH, OUT))


def train_step(model: Any, opt: Any, x: np.ndarray, y: np.ndarray) -> None:
    crit = MSELoss()
    crit(model.forward(x), y)
    model.backward(crit.backward())
    opt.step()
    opt.zero_grad()


class Spy(ProcessGroup):
    """The same group, recording ``(inner step, op, dtype, elements)`` of each collective DiLoCo issues."""

    now: int
    log: list[tuple[int, str, str, int]]

    @classmethod
    def of(cls, group: ProcessGroup) -> Spy:
        spy = object.__new__(cls)
        spy.__dict__.update(group.__dict__)
        spy.now, spy.log = 0, []
        return spy

    def all_reduce(self, x: Any, op: str = "sum", *, async_op: bool = False) -> Any:
        self.log.append((self.now, "all_reduce", str(x.dtype), int(x.size)))
        return super().all_reduce(x, op, async_op=async_op)

    def all_gather(self, x: Any, *, out: Any = None, async_op: bool = False) -> Any:
        self.log.append((self.now, "all_gather", str(x.dtype), int(x.size)))
        return super().all_gather(x, out=out, async_op=async_op)


class Sim:
    """DiLoCo over ``replicas`` in one process: arrays per replica, Nesterov (or plain) outer SGD in numpy."""

    def __init__(
        self,
        params: list[list[np.ndarray]],
        h: int,
        k: int,
        overlap: bool,
        lr: float,
        mom: float,
        alpha: float | None = None,
    ):
        self.params, self.h, self.k, self.overlap, self.lr, self.mom = params, h, k, overlap, lr, mom
        self.alpha = alpha
        self.last = [a.copy() for a in params[0]]
        self.buf: list[np.ndarray | None] = [None] * len(self.last)
        self.pending: tuple[list[int], list[np.ndarray], list[list[np.ndarray]]] | None = None
        self.step = 0

    def after_inner(self) -> None:
        self.step += 1
        if self.pending is not None:
            self._apply(*self.pending)
            self.pending = None
        every = self.h // self.k
        if self.step % every == 0:
            frag = FRAGS[self.k][(self.step // every - 1) % self.k]
            means = [np.mean([self.last[i] - rep[i] for rep in self.params], axis=0) for i in frag]
            snaps = [[rep[i].copy() for i in frag] for rep in self.params]
            if self.overlap:
                self.pending = (frag, means, snaps)
            else:
                self._apply(frag, means, snaps)

    def _apply(self, frag: list[int], means: list[np.ndarray], snaps: list[list[np.ndarray]]) -> None:
        for j, i in enumerate(frag):
            g = means[j]
            if self.mom:
                buf = self.buf[i]
                self.buf[i] = buf = g.copy() if buf is None else self.mom * buf + g
                g = g + self.mom * buf
            new = self.last[i] - self.lr * g
            for rep, snap in zip(self.params, snaps, strict=True):
                if self.overlap and self.alpha is not None:
                    rep[i][...] = self.alpha * rep[i] + (1 - self.alpha) * new
                else:
                    rep[i][...] = new + (rep[i] - snap[j])
            self.last[i] = new


def nn_sim(
    steps: int,
    h: int,
    k: int,
    overlap: bool,
    lr: float,
    mom: float,
    replicas: int,
    batch_of: Callable[..., Any],
    alpha: float | None = None,
) -> list[list[list[np.ndarray]]]:
    """Every replica's parameters after each step."""
    models = [make_model() for _ in range(replicas)]
    opts = [SGD(m.parameters(), lr=0.1) for m in models]
    sim = Sim([[p.data for p in m.parameters()] for m in models], h, k, overlap, lr, mom, alpha)
    out = []
    for step in range(steps):
        for r, (m, o) in enumerate(zip(models, opts, strict=True)):
            train_step(m, o, *batch_of(step, r))
        sim.after_inner()
        out.append([[p.data.copy() for p in m.parameters()] for m in models])
    return out


def run_nn(rep: Report, name: str, group: Any, h: int, k: int = 1, overlap: bool = False, **kw: Any) -> Any:
    """DiLoCo over ``group`` (world.group: replica = rank) for 8 steps, against the simulation each step."""
    world_rank = group.ranks[group.rank]
    model = make_model(seed=3 + world_rank)  # unequal: DiLoCo's init_sync makes them group rank 0's
    opt = SGD(model.parameters(), lr=0.1)
    d = pp.DiLoCo(model, opt, group, sync_every=h, fragments=k, overlap=overlap, **kw)
    rep.check(f"{name} fragments", d.fragment_indices == FRAGS[k], str(d.fragment_indices))
    outer = kw.get("outer_optimizer")
    lr, mom = (outer.lr, outer.momentum) if outer is not None else (0.7, 0.9)
    want = nn_sim(9, h, k, overlap, lr, mom, group.size, data, kw.get("alpha"))
    if isinstance(group, Spy):
        group.log.clear()
    for step in range(9):
        if isinstance(group, Spy):
            group.now = step + 1
        train_step(model, opt, *data(step, world_rank))
        if kw.get("outer_dtype") is None:
            for i, p in enumerate(model.parameters()):
                rep.equal(f"{name} step {step} param {i}", p.data, want[step][world_rank][i], rtol=1e-10)
    rep.check(f"{name} counted steps", d.step == 9, str(d.step))
    return model, d, want


def scenario(world: Any, rep: Report) -> None:
    g = world.group
    me = world.rank
    # -- H = 1, inner SGD, outer SGD lr 1 without momentum == DDP with SGD -----------------------------
    ddp = pp.DDP(make_model(), g)
    ddp_opt = SGD(ddp.parameters(), lr=0.1)
    ddp.attach(ddp_opt)
    lone = make_model(seed=3 + me)
    lone_opt = SGD(lone.parameters(), lr=0.1)
    pp.DiLoCo(lone, lone_opt, g, sync_every=1, outer_optimizer=SGD(lone.parameters(), lr=1.0))
    for step in range(4):
        x, y = data(step, me)
        train_step(ddp, ddp_opt, x, y)
        train_step(lone, lone_opt, x, y)
        for i, (p, q) in enumerate(zip(lone.parameters(), ddp.parameters(), strict=True)):
            rep.equal(f"H=1 equals DDP step {step} param {i}", p.data, q.data, rtol=1e-10)
    # -- argument errors -------------------------------------------------------------------------------
    m = make_model()
    o = SGD(m.parameters(), lr=0.1)
    rep.raises("H 0", ValueError, lambda: pp.DiLoCo(m, o, g, sync_every=0), "sync_every")
    rep.raises("fragments divide", ValueError, lambda: pp.DiLoCo(m, o, g, 4, fragments=3), "divide")
    rep.raises("too many fragments", ValueError, lambda: pp.DiLoCo(m, o, g, 8, fragments=8), "only 4")
    rep.raises("alpha range", ValueError, lambda: pp.DiLoCo(m, o, g, 4, overlap=True, alpha=1.5), "[0, 1]")
    rep.raises("alpha no overlap", ValueError, lambda: pp.DiLoCo(m, o, g, 4, alpha=0.5), "overlap=True")
    rep.raises("outer dtype", ValueError, lambda: pp.DiLoCo(m, o, g, 4, outer_dtype="int4"), "int8")
    rep.raises("same optimizer", ValueError, lambda: pp.DiLoCo(m, o, g, 4, outer_optimizer=o), "second")
    other = SGD(make_model().parameters(), lr=1.0)
    rep.raises("foreign outer", ValueError, lambda: pp.DiLoCo(m, o, g, 4, outer_optimizer=other), "exactly")
    rep.raises("not a group", ValueError, lambda: pp.DiLoCo(m, o, object(), 4), "ProcessGroup")  # type: ignore[arg-type]
    rep.raises("wrapper over the replicas", ValueError, lambda: pp.DiLoCo(ddp, ddp_opt, g, 4), "mesh.group")
    # -- H = 4 with the default Nesterov outer optimizer; streaming: fragments and overlap --------------
    run_nn(rep, "nesterov H=4", g, 4)
    run_nn(rep, "fragments 4", g, 4, k=4)
    spy = Spy.of(g)
    model, d, want = run_nn(rep, "streaming", spy, 4, k=2, overlap=True)
    # Syncs after steps 2, 4, 6, 8 take fragments 0, 1, 0, 1 (40 and 35 elements): each once per 4 steps.
    want_log = [(s, "all_reduce", "float64", [40, 35][j % 2]) for j, s in enumerate([2, 4, 6, 8])]
    rep.check("streaming schedule", spy.log == want_log, f"{spy.log} != {want_log}")
    run_nn(rep, "alpha 0.5", g, 4, k=2, overlap=True, alpha=0.5)  # Streaming DiLoCo's mixing factor
    # sync_all after step 9 (the sync of step 8 was applied then): both fragments, one Nesterov step each.
    last = [a.copy() for a in d.last]
    bufs = [d.outer_optimizer.state[i]["momentum_buffer"].copy() for i in range(4)]
    d.sync_all()
    rep.check("sync_all syncs both fragments", [n for *_, n in spy.log[4:]] == [40, 35], f"{spy.log}")
    for i, p in enumerate(model.parameters()):
        grad = np.mean([last[i] - w[i] for w in want[-1]], axis=0)
        want_p = last[i] - 0.7 * (grad + 0.9 * (0.9 * bufs[i] + grad))
        rep.equal(f"sync_all param {i}", p.data, want_p, rtol=1e-10)
        rep.equal(f"sync_all last {i}", d.last[i], p.data)
    # -- quantised outer gradients: the wire dtype, error against float64 ---------------------------
    exact = nn_sim(9, 2, 1, False, 0.7, 0.9, g.size, data)[-1][me]
    errors = {}
    for wire, ops in (
        ("bfloat16", {("all_reduce", "bfloat16", 75)}),
        ("float16", {("all_reduce", "float16", 75)}),
        ("int8", {("all_gather", "int8", 256), ("all_gather", "float32", 1)}),
    ):
        spy = Spy.of(g)
        model, _, _ = run_nn(rep, wire, spy, 2, outer_dtype=wire)
        seen = {(op, dt, n) for _, op, dt, n in spy.log}
        rep.check(f"{wire} on the wire", seen == ops and len(spy.log) == 4 * len(ops), f"{spy.log}")
        err = max(float(np.abs(p.data - w).max()) for p, w in zip(model.parameters(), exact, strict=True))
        errors[wire] = err
        bound = {"bfloat16": 2e-2, "float16": 2e-3, "int8": 1e-2}[wire]
        rep.check(f"{wire} error bounded", 0 < err < bound, f"max abs error {err:.3g} (bound {bound})")
    rep.values["wire_errors"] = errors
    # -- checkpoint round trip (pp.checkpoint) and state_dict -----------------------------------------
    ckpt = Path(os.environ["PARAMPLANE_TEST_OUT"]) / "ckpt"
    model = make_model()
    opt = SGD(model.parameters(), lr=0.1)
    d = pp.DiLoCo(model, opt, g, sync_every=4)
    for step in range(6):
        train_step(model, opt, *data(step, me))
    # Between syncs the replicas' modules differ: under one key the save refuses them, naming the key.
    rep.raises(
        "one key mid-interval",
        pp.checkpoint.CheckpointError,
        lambda: pp.checkpoint.save({"model": model, "diloco": d}, ckpt, g),
        "'model",
    )
    # ... each under a key of its own (DiLoCo's state is replicated).
    pp.checkpoint.save({**d.per_replica({"model": model, "optim": opt}), "diloco": d}, ckpt, g)
    memory = d.state_dict()
    after = []
    for step in range(6, 10):
        train_step(model, opt, *data(step, me))
        after.append([p.data.copy() for p in model.parameters()])
    model2 = make_model(seed=99)
    opt2 = SGD(model2.parameters(), lr=0.1)
    d2 = pp.DiLoCo(model2, opt2, g, sync_every=4, init_sync=False)
    pp.checkpoint.load({**d2.per_replica({"model": model2, "optim": opt2}), "diloco": d2}, ckpt, g)
    rep.check("checkpoint step", d2.step == 6, str(d2.step))
    for step in range(6, 10):
        train_step(model2, opt2, *data(step, me))
        for i, p in enumerate(model2.parameters()):
            rep.equal(f"resumed step {step} param {i}", p.data, after[step - 6][i])
    m3 = make_model()
    d3 = pp.DiLoCo(m3, SGD(m3.parameters(), lr=0.1), g, 4)
    d3.load_state_dict(memory)
    for i, key in enumerate(d3.keys):
        rep.equal(f"state_dict last {key}", d3.last[i], memory["last"][key])
    rep.check("state_dict step", d3.step == 6)
    fsdp_scenario(world, rep)
    if importlib.util.find_spec("torch") is not None:  # torch is optional (not in the Python 3.13 run)
        torch_scenario(world, rep)
        rep.values["torch_checked"] = True


def fsdp_scenario(world: Any, rep: Report) -> None:
    """FSDP inside each host, DiLoCo across the hosts (replica = host, trained on both ranks' batches)."""
    mesh = pp.Mesh(world.group, dims=[("replicate", 2), ("shard", 2)])
    fsdp = pp.FSDP(make_model(), mesh.group("shard"), strategy="full_shard")
    opt = SGD(fsdp.parameters(), lr=0.1)
    fsdp.attach(opt)
    d = pp.DiLoCo(fsdp, opt, mesh.group("replicate"), sync_every=2)

    def host_batch(step: int, host: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = data(step, 2 * host), data(step, 2 * host + 1)
        return np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]])

    want = nn_sim(5, 2, 1, False, 0.7, 0.9, 2, host_batch)
    host = world.rank // 2
    for step in range(5):
        train_step(fsdp, opt, *data(step, world.rank))
        full = fsdp.state_dict()
        for i, (key, _) in enumerate(make_model().named_parameters()):
            rep.equal(f"fsdp step {step} {key}", np.asarray(full[key]), want[step][host][i], rtol=1e-10)
    # Mid-interval (5 steps, H = 2): each host's module and inner optimizer under keys of its own.
    ckpt = Path(os.environ["PARAMPLANE_TEST_OUT"]) / "ckpt-fsdp"
    pp.checkpoint.save({**d.per_replica({"model": fsdp, "optim": opt}), "diloco": d}, ckpt, world.group)
    fsdp2 = pp.FSDP(make_model(seed=5), mesh.group("shard"), strategy="full_shard")
    opt2 = SGD(fsdp2.parameters(), lr=0.1)
    fsdp2.attach(opt2)
    d2 = pp.DiLoCo(fsdp2, opt2, mesh.group("replicate"), 2, init_sync=False)
    pp.checkpoint.load({**d2.per_replica({"model": fsdp2, "optim": opt2}), "diloco": d2}, ckpt, world.group)
    for step in range(5, 8):  # the resumed job goes on exactly as the one that was saved
        train_step(fsdp, opt, *data(step, world.rank))
        train_step(fsdp2, opt2, *data(step, world.rank))
        full, full2 = fsdp.state_dict(), fsdp2.state_dict()
        for key in full:
            rep.equal(f"fsdp resumed step {step} {key}", np.asarray(full2[key]), np.asarray(full[key]))
    for i in range(len(d.last)):
        rep.equal(f"fsdp last {i} restored", d2.last[i], d.last[i])
        rep.equal(
            f"fsdp momentum {i} restored",
            d2.outer_optimizer.state[i]["momentum_buffer"],
            d.outer_optimizer.state[i]["momentum_buffer"],
        )


def torch_scenario(world: Any, rep: Report) -> None:
    """A torch MLP with torch.optim.Adam inside, the default (torch Nesterov SGD) outer optimizer."""
    import torch

    def build() -> Any:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, OUT)
        ).double()

    def step_on(model: Any, opt: Any, step: int, who: int) -> None:
        x, y = (torch.from_numpy(a) for a in data(step, who))
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    g = world.group
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    d = pp.DiLoCo(model, opt, g, sync_every=2)
    refs = [build() for _ in range(g.size)]
    ref_opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in refs]
    sim = Sim([[p.detach().numpy() for p in m.parameters()] for m in refs], 2, 1, False, 0.7, 0.9)
    for step in range(5):
        step_on(model, opt, step, world.rank)
        for r, (m, o) in enumerate(zip(refs, ref_opts, strict=True)):
            step_on(m, o, step, r)
        sim.after_inner()
        for i, (p, q) in enumerate(zip(model.parameters(), refs[world.rank].parameters(), strict=True)):
            rep.equal(f"torch step {step} param {i}", p.detach().numpy(), q.detach().numpy(), rtol=1e-10)
    ckpt = Path(os.environ["PARAMPLANE_TEST_OUT"]) / "ckpt-torch"
    pp.checkpoint.save({"diloco": d}, ckpt, g)
    model2 = build()
    d2 = pp.DiLoCo(model2, torch.optim.Adam(model2.parameters(), lr=1e-2), g, 2, init_sync=False)
    pp.checkpoint.load({"diloco": d2}, ckpt, g)
    for i, (p, q) in enumerate(zip(model.parameters(), model2.parameters(), strict=True)):
        rep.equal(f"torch last {i} restored", d2.last[i], d.last[i])
        rep.equal(
            f"torch momentum {i} restored",
            d2.outer_optimizer.state[q]["momentum_buffer"].numpy(),
            d.outer_optimizer.state[p]["momentum_buffer"].numpy(),
        )


if __name__ == "__main__":
    run_rank(scenario)
