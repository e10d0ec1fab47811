"""FSDP scenarios: every strategy against a single-process reference run on the whole batch.

Each rank trains the same seeded model twice: once alone on the whole global batch (the
reference) and once under FSDP on its ``shard_range`` of the batch, then checks losses,
every full parameter, gradient norms and collective counts. Usage:
``fsdp.py STRATEGY[,STRATEGY...] [--dtype float64] [--intra N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp
from paramplane.group import ProcessGroup
from paramplane.nn import CrossEntropyLoss, Linear, Module, Parameter, ReLU, Sequential
from paramplane.optim import SGD, AdamW
from paramplane.parallel.ddp import shard_range

BATCH = 8
FEATURES, HIDDEN, MIDDLE, CLASSES = 13, 7, 11, 5


def make_model(dtype: Any, *, root_param: bool = False) -> Module:
    rng = np.random.default_rng(7)
    seq = Sequential(
        Linear(FEATURES, HIDDEN, dtype=dtype, rng=rng),  # 7x13: uneven over 2 and 4 ranks
        ReLU(),
        Linear(HIDDEN, MIDDLE, dtype=dtype, rng=rng),
        ReLU(),
        Linear(MIDDLE, CLASSES, dtype=dtype, rng=rng),
    )
    return WithRoot(seq, dtype) if root_param else seq


class WithRoot(Module):
    """A Sequential plus parameters of the top module itself (FSDP's root unit): one scales the
    output, one is never used (its gradient must stay zero on every rank)."""

    def __init__(self, seq: Sequential, dtype: Any) -> None:
        super().__init__()
        self.body = seq
        self.scale = Parameter(np.full(CLASSES, 1.5, dtype))
        self.unused = Parameter(np.ones(3, dtype))

    def forward(self, x: Any) -> Any:
        h = self.body.forward(x)
        self._save(h=h)
        return h * self.scale.data

    def backward(self, grad: Any) -> Any:
        h = self._take_saved()["h"]
        self.scale.accumulate_grad((grad * h).sum(axis=0))
        return self.body.backward(grad * self.scale.data)


def batch(step: int, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return rng.standard_normal((BATCH, FEATURES)).astype(dtype), rng.integers(0, CLASSES, BATCH)


def make_opt(name: str, params: list[Parameter], decay: float = 0.01) -> Any:
    """Flat shards apply weight decay to every element, also of parameters without a gradient
    (like torch FSDP's flat parameters), so scenarios with an unused parameter use no decay."""
    if name == "sgd":
        return SGD(params, lr=0.1, momentum=0.9, weight_decay=decay)
    return AdamW(params, lr=0.01, weight_decay=decay)


def reference(
    dtype: Any,
    opt_name: str,
    steps: int,
    accum: int,
    root: bool,
    clip: float | None,
    norm_type: float = 2.0,
) -> dict[str, Any]:
    model = make_model(dtype, root_param=root)
    opt = make_opt(opt_name, model.parameters(), 0.0 if root else 0.01)
    crit = CrossEntropyLoss()
    losses, norms = [], []
    for step in range(steps):
        x, y = batch(step, dtype)
        model.zero_grad()
        total = 0.0
        for idx in np.array_split(np.arange(BATCH), accum):
            total += float(crit.forward(model.forward(x[idx]), y[idx]))
            model.backward(crit.backward(grad_scale=1.0 / accum) if accum > 1 else crit.backward())
        losses.append(total / accum)
        if clip is not None:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if norm_type == math.inf:
                norm = max(float(np.abs(g).max()) for g in grads)
            else:
                norm = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads))
            norms.append(norm)
            if clip / (norm + 1e-6) < 1:
                for g in grads:
                    g *= clip / (norm + 1e-6)
        opt.step()
    return {"losses": losses, "norms": norms, "state": model.state_dict()}


class Counting:
    """Counts the collectives every ProcessGroup issues (patched onto the class)."""

    OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.dtypes: dict[str, set[str]] = {op: set() for op in self.OPS}
        self.on = False
        for op in self.OPS:
            original = getattr(ProcessGroup, op)

            def wrapped(group: ProcessGroup, *a: Any, _op: str = op, _orig: Any = original, **k: Any) -> Any:
                if self.on and group.size > 1:
                    self.counts[_op] += 1
                    self.dtypes[_op].add(str(a[0].dtype))
                return _orig(group, *a, **k)

            setattr(ProcessGroup, op, wrapped)


def train(
    world: Any,
    rep: Report,
    counter: Counting,
    strategy: str,
    dtype: Any,
    opt_name: str,
    *,
    steps: int = 3,
    accum: int = 1,
    root: bool = False,
    clip: float | None = None,
    norm_type: float = 2.0,
    intra: int | None = None,
    comm_dtype: str | None = None,
) -> None:
    tag = (
        f"{strategy}/{np.dtype(dtype).name}/{opt_name}/accum{accum}/root{int(root)}/clip{clip}/"
        f"norm{norm_type}/{comm_dtype}"
    )
    rtol = 1e-10 if np.dtype(dtype) == np.float64 else 2e-5
    if comm_dtype is not None:
        rtol = 1e-2  # gradients cross hosts in bfloat16
        counter.dtypes["all_reduce"].clear()
    want = reference(dtype, opt_name, steps, accum, root, clip, norm_type)
    model = make_model(dtype, root_param=root)
    fsdp = pp.FSDP(model, world.group, strategy, intra_size=intra, comm_dtype=comm_dtype)
    opt = make_opt(opt_name, fsdp.parameters(), 0.0 if root else 0.01)
    fsdp.attach(opt)
    crit = CrossEntropyLoss()
    a, b = shard_range(BATCH, world.world_size, world.rank)
    num_units = sum(1 for u in fsdp.units if u.module is not None)
    for step in range(steps):
        x, y = batch(step, dtype)
        xs, ys = x[a:b], y[a:b]
        counter.counts.clear()
        counter.on = True
        local = 0.0
        pieces = np.array_split(np.arange(b - a), accum)
        for i, idx in enumerate(pieces):
            ctx = fsdp.no_sync() if i < accum - 1 else contextlib.nullcontext()
            with ctx:
                if i < accum - 1:
                    before = counter.counts["reduce_scatter"] + counter.counts["all_reduce"]
                local += float(crit.forward(fsdp(xs[idx]), ys[idx]))
                fsdp.backward(crit.backward(grad_scale=1.0 / accum) if accum > 1 else crit.backward())
                if i < accum - 1:
                    grad_ops = counter.counts["reduce_scatter"] + counter.counts["all_reduce"]
                    rep.check(
                        f"{tag}: no gradient collective inside no_sync",
                        grad_ops == before,
                        str(counter.counts),
                    )
        fsdp.finish_gradient_sync()
        counter.on = False
        if step == 0 and not root and accum == 1:
            _check_counts(rep, tag, strategy, num_units, counter.counts, fsdp)
        if clip is not None:
            norm = fsdp.clip_grad_norm_(clip, norm_type)
            rep.check(
                f"{tag}: norm step {step}",
                abs(norm - want["norms"][step]) <= 1e-9 * want["norms"][step],
                f"{norm} vs {want['norms'][step]}",
            )
        loss = np.array([local / accum])
        world.group.all_reduce(loss, "mean")
        rep.check(
            f"{tag}: loss step {step}",
            abs(loss[0] - want["losses"][step]) <= rtol * abs(want["losses"][step]) + 1e-12,
            f"{loss[0]} vs {want['losses'][step]}",
        )
        opt.step()
        opt.zero_grad()
    if comm_dtype is not None:
        rep.check(
            f"{tag}: the replicate all-reduce ran in {comm_dtype}",
            counter.dtypes["all_reduce"] >= {comm_dtype},
            str(counter.dtypes["all_reduce"]),
        )
    got = fsdp.state_dict()
    rep.check(f"{tag}: state keys", list(got) == list(want["state"]), f"{list(got)}")
    for key, value in want["state"].items():
        rep.equal(f"{tag}: {key}", got[key], value, rtol=rtol)
    # A state_dict round trip through load_state_dict changes nothing.
    fsdp.load_state_dict(got)
    again = fsdp.state_dict()
    rep.check(f"{tag}: round trip", all(np.array_equal(again[k], got[k]) for k in got), "values changed")
    # Between uses every parameter holds no memory of its own.
    rep.check(
        f"{tag}: resharded",
        all(p.data.strides == (0,) * p.data.ndim for p in model.parameters()),
        "a parameter still holds its full values",
    )


def _check_counts(rep: Report, tag: str, strategy: str, k: int, counts: Counter[str], fsdp: Any) -> None:
    s, r = fsdp.shard_group.size, fsdp.replicate_group.size
    gathers = 0 if s == 1 else (2 * k if fsdp.reshard_after_forward else k)
    want = {"all_gather": gathers, "reduce_scatter": k if s > 1 else 0, "all_reduce": k if r > 1 else 0}
    got = {op: counts[op] for op in want}
    rep.check(f"{tag}: collectives per step", got == want, f"got {got}, want {want}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("strategies")
    parser.add_argument("--intra", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="one optimizer, no extras")
    args = parser.parse_args()
    counter = Counting()

    def scenario(world: Any, rep: Report) -> None:
        for strategy in args.strategies.split(","):
            intra = args.intra if strategy.startswith("hybrid") else None
            train(world, rep, counter, strategy, np.float64, "sgd", intra=intra)
            if strategy.startswith("hybrid"):
                train(world, rep, counter, strategy, np.float64, "sgd", intra=intra, comm_dtype="bfloat16")
            if args.quick:
                continue
            train(world, rep, counter, strategy, np.float64, "adamw", accum=2, intra=intra)
            train(world, rep, counter, strategy, np.float64, "adamw", root=True, clip=0.5, intra=intra)
            train(world, rep, counter, strategy, np.float32, "adamw", intra=intra)
            if strategy.startswith("hybrid"):  # the largest gradient element over both hosts' shards
                train(
                    world,
                    rep,
                    counter,
                    strategy,
                    np.float64,
                    "adamw",
                    clip=0.05,
                    norm_type=math.inf,
                    intra=intra,
                )
        rep.values["num_checks"] = rep.num_checks

    run_rank(scenario)


if __name__ == "__main__":
    main()
