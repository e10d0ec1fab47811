"""Pipeline scenarios: every schedule equals the unpipelined model on the whole batch.

Usage: ``pipeline.py SCHEDULE MICROBATCHES CHUNKS REDUCTION [MICROBATCH_GROUP]``, or ``pipeline.py SCENARIO``
(errors, bad_shape, kill, dp_pp, digits_3d, large).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp
from paramplane.nn import GELU, CrossEntropyLoss, Linear, Module, MSELoss, Sequential

IN, HIDDEN, CLASSES, PER_MB = 6, 8, 3, 2
POLL_US = int(os.environ.get("TEST_PIPELINE_POLL_US", "0"))  # the transfer threads' polling slice


def stage_module(s: int, num_stages: int) -> Module:
    rng = np.random.default_rng(100 + s)
    if s == num_stages - 1:
        return Linear(IN if s == 0 else HIDDEN, CLASSES, dtype=np.float64, rng=rng)
    return Sequential(Linear(IN if s == 0 else HIDDEN, HIDDEN, dtype=np.float64, rng=rng), GELU())


def equivalence(
    world: Any, rep: Report, schedule: str, m: int, v: int, reduction: str, group: int | None = None
) -> None:
    """Two steps, the second with microbatches of another size (activations change shape between steps):
    each step's gradients and losses equal one process on the whole batch."""
    g = world.group
    p = g.size
    stages = p * v
    mine = list(range(g.rank, stages, p))
    modules = [stage_module(s, stages) for s in mine]
    pipe = pp.Pipeline(
        modules if v > 1 else modules[0],
        g,
        schedule,
        m,
        CrossEntropyLoss(reduction),
        scale_grads=reduction == "mean",
        microbatch_group=group,
        poll_us=POLL_US,
    )
    ref = Sequential(*[stage_module(s, stages) for s in range(stages)])
    for step, per_mb in enumerate((PER_MB, PER_MB + 1)):
        rng = np.random.default_rng(7 + step)
        x, y = rng.standard_normal((m * per_mb, IN)), rng.integers(0, CLASSES, m * per_mb)
        for module in [*modules, ref]:
            module.zero_grad()
        losses = pipe.step(x if g.rank == 0 else None, y if pipe.is_last else None)
        crit = CrossEntropyLoss(reduction)
        crit.forward(ref.forward(x), y)
        ref.backward(crit.backward())
        for s, module in zip(mine, modules):
            for (name, got), (_, want) in zip(module.named_parameters(), ref[s].named_parameters()):
                rep.equal(f"step {step} stage {s} {name} grad", got.grad, want.grad, rtol=1e-10)
        if pipe.is_last:
            assert losses is not None
            want_losses = [
                float(
                    CrossEntropyLoss(reduction).forward(
                        ref.forward(x[i * per_mb : (i + 1) * per_mb]), y[i * per_mb : (i + 1) * per_mb]
                    )
                )
                for i in range(m)
            ]
            rep.equal(f"step {step} losses", np.array(losses), np.array(want_losses), rtol=1e-12)
        if step == 0:
            rep.values["memory"] = pipe.memory_stats()
    out = pipe.eval_step(x if g.rank == 0 else None)
    if pipe.is_last:
        rep.equal("eval output", out, ref.forward(x), rtol=1e-12)
    rep.values["table"] = pipe.schedule_table()


def kill(world: Any, rep: Report) -> None:
    """Rank 1 dies after its first forward; rank 0 learns which rank it lost, without hanging."""
    g = world.group
    module = stage_module(g.rank, 2)
    if g.rank == 1:
        original = module.forward

        def dying(x: Any) -> Any:
            original(x)
            os._exit(9)

        object.__setattr__(module, "forward", dying)
    pipe = pp.Pipeline(module, g, "1f1b", 4, CrossEntropyLoss(), poll_us=POLL_US)
    x, y = np.ones((8, IN)), np.zeros(8, np.int64)
    rep.raises(
        "peer lost",
        pp.PeerLost,
        lambda: pipe.step(x if g.rank == 0 else None, y if g.rank == 1 else None),
        "rank 1",
    )


class Scale(Module):
    """Multiplies by ``factor``; remembers the gradients its backward received."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor
        self.grads: list[Any] = []

    def forward(self, x: Any) -> Any:
        self._save(mark=True)
        return x * self.factor

    def backward(self, grad: Any) -> Any:
        self._take_saved()
        self.grads.append(grad)
        return grad * self.factor


def large(world: Any, rep: Report) -> None:
    """GPipe with 24 MiB activations per microbatch: all four microbatches' activations (96 MiB) are in flight
    before the last stage reads one, and gradients as many the other way; nothing waits for buffer space."""
    g, m, width = world.group, 4, 3 << 20
    module = Scale(2.0 if g.rank == 0 else 3.0)
    pipe = pp.Pipeline(module, g, "gpipe", m, MSELoss())
    x, target = np.ones((m, width)), np.full((m, width), 5.0)
    losses = pipe.step(x if g.rank == 0 else None, target if g.rank == 1 else None)
    if g.rank == 1:
        rep.check("large: losses", losses == [1.0] * m, str(losses))  # (2 * 3 * 1 - 5) ** 2
    else:
        # d mean((6x - 5)^2) / d(stage 0 output) = 3 * 2 * (6 - 5) / width, divided by the 4 microbatches.
        want = np.full((1, width), 3 * 2 * 1.0 / width / m)
        rep.check(
            "large: every gradient reached stage 0 whole",
            len(module.grads) == m and all(np.allclose(got, want, rtol=1e-12) for got in module.grads),
            f"{len(module.grads)} gradients",
        )


def bad_shape(world: Any, rep: Report) -> None:
    """Stage 0's output changes shape at microbatch 2 of 4 (step time, after microbatch 0 set the shape):
    both ranks end with CollectiveMismatch naming the shapes, within the deadline, not a hang."""
    g = world.group
    module = stage_module(g.rank, 2)
    if g.rank == 0:
        original, calls = module.forward, [0]

        def drifting(x: Any) -> Any:
            calls[0] += 1
            y = original(x)
            return np.concatenate([y, y[:1]]) if calls[0] == 3 else y

        object.__setattr__(module, "forward", drifting)
    pipe = pp.Pipeline(module, g, "1f1b", 4, CrossEntropyLoss())
    x, y = np.ones((4 * PER_MB, IN)), np.zeros(4 * PER_MB, np.int64)
    rep.raises(
        "shape change at microbatch 2",
        pp.CollectiveMismatch,
        lambda: pipe.step(x if g.rank == 0 else None, y if g.rank == 1 else None),
        "shape",
    )
    rep.raises(
        "the next step fails at once with the group's error",
        pp.CollectiveMismatch,
        lambda: pipe.step(x if g.rank == 0 else None, y if g.rank == 1 else None),
        "shape",
    )


def dp_pp(world: Any, rep: Report) -> None:
    """A 2 (dp) x 2 (pp) mesh trains 3 SGD steps exactly like one process on the whole batch."""
    from paramplane.optim import SGD

    mesh = pp.Mesh(world, dp=2, pp=2)
    s = mesh.coordinate("pp")
    module = stage_module(s, 2)
    pipe = pp.Pipeline(module, mesh.group("pp"), "1f1b", 2, CrossEntropyLoss(), dp_group=mesh.group("dp"))
    opt = SGD(module.parameters(), lr=0.5, momentum=0.9)
    ref = Sequential(stage_module(0, 2), stage_module(1, 2))
    ref_opt = SGD(ref.parameters(), lr=0.5, momentum=0.9)
    crit = CrossEntropyLoss()
    d = mesh.coordinate("dp")
    for step in range(3):
        rng = np.random.default_rng(step)
        x, y = rng.standard_normal((8, IN)), rng.integers(0, CLASSES, 8)
        crit.forward(ref.forward(x), y)
        ref.backward(crit.backward())
        ref_opt.step()
        ref_opt.zero_grad()
        xs, ys = x[d * 4 : (d + 1) * 4], y[d * 4 : (d + 1) * 4]
        pipe.step(xs if pipe.is_first else None, ys if pipe.is_last else None)
        opt.step()
        opt.zero_grad()
    for (name, got), (_, want) in zip(module.named_parameters(), ref[s].named_parameters()):
        rep.equal(f"stage {s} {name}", got.data, want.data, rtol=1e-10)


def digits_3d(world: Any, rep: Report) -> None:
    """dp 2 x pp 2 on 4 ranks trains the digits MLP of examples/train_ddp.py (split after its first ReLU) with
    the per-step losses of DDP over the same 4 ranks: same initial weights, optimizer and batches."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from train_ddp import build_model, load_data, train

    from paramplane.optim import AdamW

    batch, m, lr = 128, 4, 3e-3
    ddp_losses = train(world, epochs=1, batch_size=batch, lr=lr, progress=False)["losses"]
    mesh = pp.Mesh(world, dp=2, pp=2)
    s, d = mesh.coordinate("pp"), mesh.coordinate("dp")
    layers = list(build_model(0))  # DDP starts from rank 0's build_model(0) too
    stage = Sequential(*(layers[:2] if s == 0 else layers[2:]))
    pipe = pp.Pipeline(stage, mesh.group("pp"), "1f1b", m, CrossEntropyLoss(), dp_group=mesh.group("dp"))
    opt = AdamW(stage.parameters(), lr=lr, weight_decay=1e-4)
    x_train, y_train, _, _ = load_data(0)
    order = np.random.default_rng(0).permutation(len(x_train))  # train()'s epoch 0 order
    losses = []
    for start in range(0, len(x_train) - batch + 1, batch):  # whole batches: each replica takes half
        mine = order[start : start + batch][d * batch // 2 : (d + 1) * batch // 2]
        out = pipe.step(x_train[mine] if pipe.is_first else None, y_train[mine] if pipe.is_last else None)
        opt.step()
        opt.zero_grad()
        if out is not None:
            losses.append(float(np.mean(out)))
    if pipe.is_last:
        mean = np.array(losses)
        mesh.group("dp").all_reduce(mean, op="mean")  # the two replicas' halves: the global batch's mean
        rep.check("3-D: every whole batch trained", len(losses) == len(x_train) // batch, str(len(losses)))
        rep.equal("3-D: per-step losses equal DDP's", mean, np.array(ddp_losses[: len(losses)]), rtol=1e-4)
        rep.check("3-D: the loss fell", mean[-1] < 0.9 * mean[0], f"{mean[0]:.3f} -> {mean[-1]:.3f}")


def errors(world: Any, rep: Report) -> None:
    g = world.group
    module = stage_module(g.rank, 2)
    pipe = pp.Pipeline(module, g, "1f1b", 4, CrossEntropyLoss())
    x, y = np.ones((6, IN)), np.zeros(6, np.int64)
    rep.raises(
        "uneven batch",
        ValueError,
        lambda: pipe.step(x if g.rank == 0 else None, y if g.rank == 1 else None),
        "do not split into 4 equal microbatches",
    )
    if g.rank == 0:
        rep.raises("missing input", ValueError, lambda: pipe.step(None, None), "needs the batch")
    else:
        rep.raises("missing target", ValueError, lambda: pipe.step(None, None), "needs step(..., target=...)")
    for bad in (-1, True, 0.5, 10**6):
        rep.raises(
            f"poll_us={bad!r}",
            ValueError,
            lambda bad=bad: pp.Pipeline(module, g, "1f1b", 4, CrossEntropyLoss(), poll_us=bad),
            "poll_us must be an int",
        )
    rep.raises(
        "too few microbatches",
        ValueError,
        lambda: pp.Pipeline(module, g, "1f1b", 1, CrossEntropyLoss()),
        "at least as many microbatches",
    )
    # A stage that raises ends the step with its error; the pipeline then refuses to run on out of step.
    solo = world.new_group([g.rank])
    boom = Scale(1.0)
    object.__setattr__(boom, "forward", lambda x: (_ for _ in ()).throw(ArithmeticError("stage blew up")))
    broken = pp.Pipeline(boom, solo, "gpipe", 2, MSELoss())
    rep.raises(
        "a stage's error", ArithmeticError, lambda: broken.step(np.ones((2, 1)), np.ones((2, 1))), "blew up"
    )
    rep.raises(
        "then a clear refusal",
        RuntimeError,
        lambda: broken.step(np.ones((2, 1)), np.ones((2, 1))),
        "earlier step of this pipeline failed",
    )
    # Ranks that disagree on what to build are told so on every rank (no hang, no silently mislabeled
    # messages): the schedule and chunks, the microbatches, interleaved 1F1B's microbatch group; a rank whose
    # own arguments are refused raises its ValueError and the others learn of it.
    chunks = (
        [stage_module(g.rank, 4), stage_module(g.rank + 2, 4)] if g.rank == 0 else stage_module(g.rank, 4)
    )
    rep.raises(
        "schedule mismatch",
        pp.CollectiveMismatch,
        lambda: pp.Pipeline(chunks, g, "interleaved_1f1b" if g.rank == 0 else "1f1b", 2, CrossEntropyLoss()),
        "disagree on schedule",
    )
    rep.raises(
        "microbatch mismatch",
        pp.CollectiveMismatch,
        lambda: pp.Pipeline(module, g, "1f1b", 4 if g.rank == 0 else 2, CrossEntropyLoss()),
        "disagree on microbatches",
    )
    both = [stage_module(g.rank, 4), stage_module(g.rank + 2, 4)]
    rep.raises(
        "microbatch group mismatch",
        pp.CollectiveMismatch,
        lambda: pp.Pipeline(
            both, g, "interleaved_1f1b", 8, CrossEntropyLoss(), microbatch_group=2 if g.rank == 0 else 4
        ),
        "disagree on microbatch_group",
    )
    rep.raises(
        "one rank's bad arguments",
        ValueError if g.rank == 0 else pp.CollectiveMismatch,
        lambda: pp.Pipeline(module, g, "1f1b", 1 if g.rank == 0 else 4, CrossEntropyLoss()),
        "at least as many microbatches" if g.rank == 0 else "refuses",
    )
    # A stage that raises tells its neighbours at once (not after their timeout, 30 s here).
    pair = world.new_group([0, 1])
    failing = Scale(1.0)
    if g.rank == 1:
        object.__setattr__(
            failing, "forward", lambda x: (_ for _ in ()).throw(ArithmeticError("rank 1 blew up"))
        )
    told = pp.Pipeline(failing, pair, "1f1b", 2, MSELoss())
    start = time.monotonic()
    rep.raises(
        "a neighbour's error",
        ArithmeticError if g.rank == 1 else pp.TransportError,
        lambda: told.step(np.ones((2, 1)) if g.rank == 0 else None, np.ones((2, 1)) if g.rank == 1 else None),
        "blew up",
    )
    rep.check("told before the timeout", time.monotonic() - start < 20, f"{time.monotonic() - start:.1f} s")
    world.barrier()  # rank 1 stays (as a script that caught its error would) until rank 0 was told
    # memory_stats describe the last training step, whatever eval_step ran since.
    kept = pp.Pipeline([Scale(1.0), Scale(2.0)], solo, "interleaved_1f1b", 2, MSELoss())
    kept.step(np.ones((2, 3)), np.ones((2, 3)))
    trained = kept.memory_stats()
    kept.eval_step(np.ones((2, 3)))
    rep.check(
        "memory_stats after eval_step",
        kept.memory_stats() == trained and trained["peak_activation_sets"] > 0,
        str((trained, kept.memory_stats())),
    )


def main() -> None:
    if sys.argv[1] == "errors":
        run_rank(errors)
        return
    if sys.argv[1] == "bad_shape":
        run_rank(bad_shape)
        return
    if sys.argv[1] == "large":
        run_rank(large)
        return
    if sys.argv[1] == "kill":
        run_rank(kill)
        return
    if sys.argv[1] == "dp_pp":
        run_rank(dp_pp)
        return
    if sys.argv[1] == "digits_3d":
        run_rank(digits_3d)
        return
    schedule, m, v, reduction = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    group = int(sys.argv[5]) if len(sys.argv) > 5 else None
    run_rank(lambda world, rep: equivalence(world, rep, schedule, m, v, reduction, group))


if __name__ == "__main__":
    main()
