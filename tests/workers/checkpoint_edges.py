"""Checkpoint edge cases (see tests/test_checkpoint.py). Usage: ``checkpoint_edges.py MODE DIR``.

retry     a save into the directory of a crashed attempt (its per-rank lists and an error file left behind)
          commits only with this attempt's lists, and loads back.
fail_io   rank 1 cannot write (ENOSPC): every rank fails at once, rank 0 naming rank 1 and the error.
fail_json a plain value JSON cannot hold: every rank raises CheckpointError naming the key, nothing written.
values    save_async copies plain values; numpy scalars are plain values; a non-contiguous target loads.
bf16      bfloat16 arrays round-trip (stored as uint16 files).
fsync     every data file is fsynced before it is renamed into place, and the directory before the commit.
names     keys that make the same safe file name ("lr sched", "lr_sched") keep separate files.
sync      live sync fills non-contiguous targets (small ones, packed, and large ones, sent alone).
crc       a damaged file only rank 1 reads: every rank refuses the load before modifying anything.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp
from paramplane.nn import Linear, Sequential
from paramplane.optim import AdamW
from paramplane.parallel.sharding import ShardedArray


def _piece(world: Any, fill: float) -> ShardedArray:
    """This rank's half of a 10-element array."""
    a, b = 5 * world.rank, 5 * world.rank + 5
    return ShardedArray((10,), a, np.arange(a, b, dtype=np.float64) + fill)


def retry(world: Any, rep: Report, root: Path) -> None:
    g, path = world.group, root / "step_2"
    if world.rank == 0:  # what a crashed attempt left: both ranks' lists and a stale error report
        path.mkdir(parents=True)
        stale = {
            "meta": None,
            "pieces": [{"key": "w", "start": 5, "stop": 10, "file": "gone.npy", "crc32": 0}],
        }
        (path / ".rank-1.json").write_text(json.dumps({**stale, "save_id": "old"}))
        (path / ".rank-1.error").write_text(json.dumps({"save_id": "old", "rank": 1, "error": "old"}))
    g.barrier()
    if world.rank == 1:  # a slow disk: rank 0 must wait for this rank's list, not commit with the stale one
        real = np.save

        def slow_save(*args: Any, **kwargs: Any) -> Any:
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline and not (path / "manifest.json").exists():
                time.sleep(0.01)
            rep.check("no commit before rank 1 wrote its pieces", not (path / "manifest.json").exists())
            return real(*args, **kwargs)

        np.save = slow_save  # type: ignore[assignment]
    pp.checkpoint.save({"w": _piece(world, 0.5), "step": 2}, path, g)
    target = _piece(world, -100.0)
    got = pp.checkpoint.load({"w": target, "step": 0}, path, g)
    rep.equal("loaded this attempt's pieces", target.local, _piece(world, 0.5).local)
    rep.check("values", got["step"] == 2, str(got))
    rep.check("no list or error left", not list(path.glob(".rank-*")), str(list(path.iterdir())))


def fail_io(world: Any, rep: Report, root: Path) -> None:
    if world.rank == 1:

        def full(*args: Any, **kwargs: Any) -> Any:
            raise OSError(errno.ENOSPC, "No space left on device")

        np.save = full  # type: ignore[assignment]
    start = time.monotonic()
    exc = rep.raises(
        "every rank fails",
        pp.checkpoint.CheckpointError if world.rank == 0 else OSError,
        lambda: pp.checkpoint.save({"w": _piece(world, 0.0), "step": 1}, root / "s", world.group),
        *(["group rank 1", "No space left on device"] if world.rank == 0 else []),
    )
    rep.values["error"] = f"{type(exc).__name__}: {exc}"
    rep.check("at once, not after the group timeout", time.monotonic() - start < 10.0)
    rep.check("nothing committed", not (root / "s" / "manifest.json").exists())


def fail_json(world: Any, rep: Report, root: Path) -> None:
    start = time.monotonic()
    rep.raises(
        "a value JSON cannot hold",
        pp.checkpoint.CheckpointError,
        lambda: pp.checkpoint.save({"w": _piece(world, 0.0), "tags": {"a"}}, root / "s", world.group),
        "'tags'",
    )
    rep.check("at once", time.monotonic() - start < 10.0)
    rep.check("nothing written", not (root / "s").exists() or not list((root / "s").iterdir()))


def values(world: Any, rep: Report, root: Path) -> None:
    g = world.group
    data = {"epoch": 1, "seen": [3, 5]}
    blob = np.ones(1 << 18)  # 2 MB to write first: the thread is still writing when the caller changes data
    handle = pp.checkpoint.save_async({"data": data, "step": np.int64(7), "blob": blob}, root / "a", g)
    data["seen"].append(9)  # after save_async returned: not part of the checkpoint
    data["epoch"] = 2
    handle.wait(30)
    saved = pp.checkpoint.read_manifest(root / "a")["values"]
    rep.check("save_async staged a copy", saved["data"] == {"epoch": 1, "seen": [3, 5]}, str(saved))
    # numpy scalars are plain values (an lr from np.cos, a step counter); targets that are not contiguous load.
    model = Sequential(Linear(3, 2, dtype=np.float64, rng=np.random.default_rng(0)))
    table = np.arange(6.0).reshape(2, 3)
    state = {"optim": AdamW(model.parameters(), lr=np.float64(0.05)), "step": np.int64(7), "table": table}
    pp.checkpoint.save(state, root / "b", g)
    rep.check("scalars are values", pp.checkpoint.read_manifest(root / "b")["values"]["step"] == 7)
    opt = AdamW(model.parameters(), lr=1e-3)
    strided = np.zeros((3, 2)).T
    got = pp.checkpoint.load({"optim": opt, "step": np.int64(0), "table": strided}, root / "b", g)
    rep.check("lr", opt.lr == 0.05, str(opt.lr))
    rep.check("step", got["step"] == 7, str(got))
    rep.equal("a transposed target is filled", strided, table)
    # Older versions saved a numpy scalar as a 0-d array: such a checkpoint still loads into a scalar's place.
    pp.checkpoint.save({"step": np.array(7)}, root / "c", g)
    rep.check(
        "a 0-d array for a plain value",
        pp.checkpoint.load({"step": np.int64(0)}, root / "c", g) == {"step": 7},
    )


def bf16(world: Any, rep: Report, root: Path) -> None:
    w = (np.arange(6) / 3).astype(ml_dtypes.bfloat16)
    pp.checkpoint.save({"w": w}, root / "s", world.group)
    (rec,) = pp.checkpoint.read_manifest(root / "s")["arrays"]["w"]["pieces"]
    rep.check("stored as uint16", np.load(root / "s" / rec["file"]).dtype == np.uint16)
    target = np.zeros(6, ml_dtypes.bfloat16)
    pp.checkpoint.load({"w": target}, root / "s", world.group)
    rep.equal("bfloat16 round trip", target, w)


def fsync(world: Any, rep: Report, root: Path) -> None:
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def record_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def record_replace(src: Any, dst: Any) -> None:
        events.append(("rename", f"{src} -> {dst}"))
        real_replace(src, dst)

    os.fsync, os.replace = record_fsync, record_replace  # type: ignore[assignment]
    try:
        pp.checkpoint.save({"w": np.arange(1000.0), "b": np.ones(3), "step": 1}, root / "s", world.group)
    finally:
        os.fsync, os.replace = real_fsync, real_replace  # type: ignore[assignment]
    data = [p.name for p in (root / "s").glob("*.npy")]
    rep.check("two data files", len(data) == 2, str(data))
    commit = next(i for i, (k, t) in enumerate(events) if k == "rename" and t.endswith("/manifest.json"))
    for name in data:
        renamed = [i for i, (k, t) in enumerate(events) if k == "rename" and t.endswith(f"/{name}")]
        synced = [
            i
            for i, (k, t) in enumerate(events)
            if k == "fsync" and t.rsplit("/", 1)[1].startswith(f".{name}.")
        ]
        rep.check(
            f"{name} fsynced, then renamed, before the commit",
            bool(renamed and synced) and synced[0] < renamed[0] < commit,
            str(events),
        )
    last = max(i for i, (k, t) in enumerate(events) if k == "rename" and t.endswith(".npy"))
    rep.check(
        "directory fsynced after the data files",
        any(k == "fsync" and t == str(root / "s") for k, t in events[last:commit]),
        str(events),
    )


def names(world: Any, rep: Report, root: Path) -> None:
    pp.checkpoint.save({"lr sched": np.arange(4.0), "lr_sched": np.ones(4)}, root / "s", world.group)
    a, b = np.zeros(4), np.zeros(4)
    pp.checkpoint.load({"lr sched": a, "lr_sched": b}, root / "s", world.group)
    rep.equal("lr sched", a, np.arange(4.0))
    rep.equal("lr_sched", b, np.ones(4))


def sync(world: Any, rep: Report, root: Path) -> None:
    small, big = (
        np.arange(6.0).reshape(2, 3),
        np.arange(512 * 256.0).reshape(512, 256),
    )  # big: 1 MB, sent alone
    if world.rank == 0:
        state = {"small": small, "big": big, "lr": np.float64(0.5)}
    else:
        state = {"small": np.zeros((3, 2)).T, "big": np.zeros((256, 512)).T, "lr": np.float64(0.0)}
    got = pp.checkpoint.sync(state, world.group, has_state=world.rank == 0)
    rep.equal("small transposed target", state["small"], small)
    rep.equal("big transposed target", state["big"], big)
    rep.check("scalar", got["lr"] == 0.5, str(got))


def crc(world: Any, rep: Report, root: Path) -> None:
    g = world.group
    fsdp = pp.FSDP(Sequential(Linear(4, 4, dtype=np.float64, rng=np.random.default_rng(1))), g)
    opt = AdamW(fsdp.parameters(), lr=0.01)
    fsdp.attach(opt)
    y = fsdp(np.ones((2, 4)))
    fsdp.backward(np.ones_like(y))
    opt.step()
    opt.zero_grad()
    pp.checkpoint.save({"model": fsdp, "optim": opt}, root / "s", g)
    if world.rank == 0:  # the bias's state lies in rank 1's half of the flat shard
        (victim,) = (root / "s").glob("optim__state.0.bias.exp_avg.*.npy")
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0xFF
        victim.write_bytes(bytes(data))
    g.barrier()
    fresh = pp.FSDP(Sequential(Linear(4, 4, dtype=np.float64, rng=np.random.default_rng(9))), g)
    fresh_opt = AdamW(fresh.parameters(), lr=0.5)
    before = fresh.units[0].shard.data.copy()
    rep.raises(
        "every rank refuses",
        pp.checkpoint.CheckpointError,
        lambda: pp.checkpoint.load({"model": fresh, "optim": fresh_opt}, root / "s", g),
        "corrupted",
        "nothing was modified",
        "group rank 1",
    )
    rep.equal("model unchanged", fresh.units[0].shard.data, before)
    rep.check("optimizer unchanged", not fresh_opt.state and fresh_opt.lr == 0.5, str(fresh_opt.state))


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    modes = {"retry": retry, "fail_io": fail_io, "fail_json": fail_json, "values": values, "bf16": bf16}
    modes.update({"fsync": fsync, "names": names, "sync": sync, "crc": crc})
    run_rank(lambda world, rep: modes[mode](world, rep, root))


if __name__ == "__main__":
    main()
