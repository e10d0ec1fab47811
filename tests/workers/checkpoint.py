"""Checkpoint scenarios (see tests/recovery/test_checkpoint.py). Usage: ``checkpoint.py MODE DIR [STRATEGY]``.

save    FSDP at this world (STRATEGY, default full_shard) trains 3 steps, saves DIR/step_3 (model, optimizer,
        plain values).
load    a fresh FSDP (any world, STRATEGY) loads DIR/step_3: parameters equal the saved ones bit for bit;
        3 more steps equal a single process trained 6 steps on the same global batches.
dense   a plain model and AdamW (no FSDP) load DIR/step_3: parameters, moments and AdamW's step come back
        from the flat shards' layout; 3 more steps equal a single process trained 6 steps.
plain   DDP + SGD state and plain values round-trip; a mismatching model is refused before any change;
        save_async overlaps further training.
crash   save step_1, then a save during which rank 1 dies after writing its shards (its data file, durable),
        before it lists them for the commit: the test wraps the writer of that list.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank
from fsdp import BATCH, batch, make_model, make_opt, reference

import paramplane as pp
from paramplane.checkpoint import commit
from paramplane.nn import CrossEntropyLoss, Linear, ReLU, Sequential
from paramplane.optim import SGD
from paramplane.parallel.ddp import shard_range


def train_steps(world: Any, fsdp: Any, opt: Any, steps: range) -> None:
    """Shards may be uneven (world 3): a sum loss scaled by N / B makes FSDP's average the global mean."""
    crit = CrossEntropyLoss(reduction="sum")
    a, b = shard_range(BATCH, world.world_size, world.rank)
    for step in steps:
        x, y = batch(step, np.float64)
        crit.forward(fsdp(x[a:b]), y[a:b])
        fsdp.backward(crit.backward(grad_scale=world.world_size / BATCH))
        opt.step()
        opt.zero_grad()


def fsdp_run(world: Any, strategy: str) -> tuple[Any, Any]:
    # Hybrid strategies shard over the ranks of a host (PARAMPLANE_HOST_ID, set by the test).
    fsdp = pp.FSDP(make_model(np.float64), world.group, strategy)
    opt = make_opt("adamw", fsdp.parameters())
    fsdp.attach(opt)
    return fsdp, opt


def save(world: Any, rep: Report, root: Path, strategy: str) -> None:
    fsdp, opt = fsdp_run(world, strategy)
    train_steps(world, fsdp, opt, range(3))
    saved = fsdp.state_dict()
    path = pp.checkpoint.save(
        {"model": fsdp, "optim": opt, "step": 3, "data": {"epoch": 1, "seen": [3, 5]}},
        root / "step_3",
        world.group,
    )
    rep.check("committed", pp.checkpoint.latest(root) == path, str(pp.checkpoint.latest(root)))
    if world.rank == 0:
        np.savez(root / "saved_model.npz", **saved)
    rep.raises(
        "no overwrite", FileExistsError, lambda: pp.checkpoint.save({"step": 3}, path, world.group), "already"
    )


def load(world: Any, rep: Report, root: Path, strategy: str) -> None:
    fsdp, opt = fsdp_run(world, strategy)
    # A fresh model of another seed: the load must overwrite every value.
    _load_and_resume(world, rep, root, fsdp, opt, len(fsdp.units), "")


def dense(world: Any, rep: Report, root: Path) -> None:
    model = make_model(np.float64)
    for p in model.parameters():
        p.data[...] = 0
    opt = make_opt("adamw", model.parameters())
    _load_and_resume(world, rep, root, model, opt, len(opt.params), "dense ")


def _load_and_resume(
    world: Any, rep: Report, root: Path, model: Any, opt: Any, num_states: int, tag: str
) -> None:
    """Load DIR/step_3 into ``model`` and ``opt``: values bit for bit, ``num_states`` optimizer states at step 3,
    plain values; then 3 more steps equal one process trained 6."""
    got = pp.checkpoint.load(
        {"model": model, "optim": opt, "step": 0, "data": None}, root / "step_3", world.group
    )
    rep.check(f"{tag}plain values", got == {"step": 3, "data": {"epoch": 1, "seen": [3, 5]}}, str(got))
    saved = np.load(root / "saved_model.npz")
    now = model.state_dict()
    for key in saved.files:
        rep.equal(f"{tag}loaded {key} bit for bit", now[key], saved[key])
    rep.check(
        f"{tag}optimizer state loaded",
        len(opt.state) == num_states and all(s["step"] == 3 for s in opt.state.values()),
        str({i: s.get("step") for i, s in opt.state.items()}),
    )
    train_steps(world, model, opt, range(3, 6))
    want = reference(np.float64, "adamw", 6, 1, False, None)["state"]
    final = model.state_dict()
    for key, value in want.items():
        rep.equal(f"{tag}resumed {key}", final[key], value, rtol=1e-10)


def _plain_model(hidden: int = 6) -> Sequential:
    rng = np.random.default_rng(3)
    return Sequential(
        Linear(4, hidden, dtype=np.float64, rng=rng), ReLU(), Linear(hidden, 2, dtype=np.float64, rng=rng)
    )


def plain(world: Any, rep: Report, root: Path) -> None:
    g = world.group
    model = pp.DDP(_plain_model(), g)
    opt = SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.attach(opt)
    x = np.random.default_rng(world.rank).standard_normal((4, 4))
    for _ in range(2):
        y = model.forward(x)
        model.backward(np.ones_like(y))
        opt.step()
        opt.zero_grad()
    table = np.arange(6.0).reshape(2, 3)
    path = pp.checkpoint.save({"model": model, "optim": opt, "step": 2, "table": table}, root / "plain", g)
    # Rank 1's save returns once the manifest exists; rank 0 removes the commit's bookkeeping right after.
    g.barrier()
    files = sorted(p.name for p in path.iterdir() if p.name != "manifest.json")
    pieces = [rec for a in pp.checkpoint.read_manifest(path)["arrays"].values() for rec in a["pieces"]]
    rep.check(  # params, momenta, table: by group rank 0, in its one data file; rank 1 writes no file
        "replicated state written once",
        files == ["rank-0.data"] and len(pieces) == 4 + 4 + 1 and {r["file"] for r in pieces} == {files[0]},
        f"{files} {pieces}",
    )
    fresh = pp.DDP(_plain_model(), g)
    fresh_opt = SGD(fresh.parameters(), lr=0.5, momentum=0.0)
    got = pp.checkpoint.load(
        {"model": fresh, "optim": fresh_opt, "step": 0, "table": np.zeros((2, 3))}, path, g
    )
    rep.check("values", got["step"] == 2 and np.array_equal(got["table"], table), str(got))
    for (k, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        rep.equal(f"plain {k}", b, a)
    rep.check("hyperparameters", fresh_opt.lr == 0.1 and fresh_opt.momentum == 0.9, str(fresh_opt))
    rep.equal("momentum", fresh_opt.state[0]["momentum_buffer"], opt.state[0]["momentum_buffer"])
    # A different model is refused on every rank, naming the key, and changes nothing.
    other = _plain_model(hidden=5)
    before = other.state_dict()
    rep.raises(
        "mismatch",
        pp.checkpoint.CheckpointError,
        lambda: pp.checkpoint.load({"model": other}, path, g),
        "'model/0.weight'",
        "nothing was modified",
    )
    rep.check(
        "unchanged", all(np.array_equal(v, other.state_dict()[k]) for k, v in before.items()), "modified"
    )
    rep.raises(
        "missing key",
        pp.checkpoint.CheckpointError,
        lambda: pp.checkpoint.load({"model": fresh, "epoch": 0}, path, g),
        "'epoch'",
    )
    # save_async: training (collectives) goes on while the files are written; the result is the same.
    blob = np.arange(4 << 20, dtype=np.float32)  # 16 MB more to write: the write outlasts a training step
    staged = {k: np.array(v, copy=True) for k, v in model.state_dict().items()}
    # The data file's write waits (bounded) for a training step: the overlap checked below is then certain on a
    # busy machine, not a race with a fast disk; a save_async that blocked would wait it out and fail the check.
    stepped, write_data_file = threading.Event(), commit._write_data_file

    def write_after_a_step(path: Path, arrays: Any) -> Any:
        stepped.wait(30)
        return write_data_file(path, arrays)

    commit._write_data_file = write_after_a_step  # type: ignore[assignment]
    try:
        handle = pp.checkpoint.save_async({"model": model, "step": 3, "blob": blob}, root / "async", g)
        returned = time.monotonic()
        for _ in range(2):
            y = model.forward(x)
            model.backward(np.ones_like(y))
            opt.step()
            opt.zero_grad()
            stepped.set()
        handle.wait(60)
    finally:
        commit._write_data_file = write_data_file  # type: ignore[assignment]
    if (
        g.tracer is not None
    ):  # the trace shows the write in the background, overlapping training's collectives
        events = g.tracer.events
        (write,) = [e for e in events if e["name"] == "checkpoint write" and "async" in e["args"]["path"]]
        offset = (time.time() - time.monotonic()) * 1e6
        after = [e for e in events if e["cat"] == "collective" and e["ts"] >= returned * 1e6 + offset - 1e3]
        rep.check(
            "a training collective ran while the checkpoint was written",
            any(write["ts"] <= e["ts"] <= write["ts"] + write["dur"] for e in after),
            f"write {write['ts']:.0f}+{write['dur']:.0f} us, collectives at {[round(e['ts']) for e in after][:6]}",
        )
        rep.values["async_traced"] = True
    again, blob_back = pp.DDP(_plain_model(), g), np.zeros_like(blob)
    pp.checkpoint.load({"model": again, "blob": blob_back}, root / "async", g)
    rep.equal("a piece written in several chunks (CRC32 checked)", blob_back, blob)
    loaded = again.state_dict()
    rep.check("async saved every entry of the model", set(loaded) == set(staged), f"{sorted(loaded)}")
    for key, value in staged.items():
        rep.equal(f"async saved {key} as it was when save_async returned", loaded[key], value)
    rep.check(
        "training went on after save_async (so the check above can tell the staged state from the final one)",
        not all(np.array_equal(staged[k], v) for k, v in model.state_dict().items()),
        "",
    )


def crash(world: Any, rep: Report, root: Path) -> None:
    model = _plain_model()
    fsdp = pp.FSDP(model, world.group)
    pp.checkpoint.save({"model": fsdp, "step": 1}, root / "step_1", world.group)
    rep.values["saved_step_1"] = True
    if world.rank == 1:
        write_json = commit._write_json

        def die_before_listing(file: Path, obj: Any) -> None:
            if file == root / "step_2" / ".rank-1.json":
                os._exit(17)  # a rank killed after its shards were written, before the commit
            write_json(file, obj)

        commit._write_json = die_before_listing
    try:
        pp.checkpoint.save({"model": fsdp, "step": 2}, root / "step_2", world.group)
    except pp.PlaneError as exc:
        rep.values["save_error"] = type(exc).__name__
        return
    rep.check("the save with a dead rank failed", False, "it returned")


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])

    def scenario(world: Any, rep: Report) -> None:
        if mode == "save":
            save(world, rep, root, sys.argv[3] if len(sys.argv) > 3 else "full_shard")
        elif mode == "load":
            load(world, rep, root, sys.argv[3])
        elif mode == "dense":
            dense(world, rep, root)
        elif mode == "plain":
            plain(world, rep, root)
        else:
            crash(world, rep, root)

    run_rank(scenario)


if __name__ == "__main__":
    main()
