"""Checkpoint edge cases (see tests/recovery/test_checkpoint.py). Usage: ``checkpoint_edges.py MODE DIR``.

retry     a save into the directory of a crashed attempt (its per-rank lists, an error file, data files and
          a temporary left behind) commits only with this attempt's lists and files, and loads back; rank 0
          does not commit while rank 1 is held before writing its pieces (until rank 0 has looked for rank
          1's list and goes on waiting).
fail_io   rank 1 cannot write (ENOSPC): every rank fails at once, rank 0 naming rank 1 and the error; rank 0
          removes its complete data file (nothing will reference it).
fail_json a plain value JSON cannot hold: every rank raises CheckpointError naming the key, nothing written.
values    save_async copies plain values; numpy scalars are plain values; a non-contiguous target loads.
bf16      bfloat16 arrays round-trip (their raw bytes in the data file, read back as the manifest's dtype).
fsync     the rank's one data file is fsynced before it is renamed into place, the directory before the commit.
names     keys that make the same safe file name ("lr sched", "lr_sched") keep separate pieces.
sync      live sync fills non-contiguous targets (small ones, packed, and large ones, sent alone).
crc       a flipped byte in one piece only rank 1 reads, then a truncated data file: every rank refuses the
          load before modifying anything.
old       a checkpoint in the previous layout (format 1: one .npy file per piece, records without an offset,
          bfloat16 as uint16) loads, resharded, into FSDP + AdamW and plain arrays; a damaged one is refused.
kinds     ranks staging another dtype or global shape for a key: every rank refuses the save naming the key,
          the ranks and what differs, before anything is written.
reads     a data file cut short after the load checked it (no SIGBUS), and a read error while checking (EIO):
          a CheckpointError naming the file; the load's files are closed either way.
records   a manifest record that is valid JSON but not a record (float stop, no crc32, a bool offset, ...) of a
          piece only rank 1 reads: every rank refuses the load, naming the key.
late      rank 1 gives the save up (a timeout) after rank 0 decided to commit: it keeps its data file (rank 0
          writes the manifest only once rank 1's save has returned), and the committed checkpoint loads.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp
from paramplane.checkpoint import commit, reader
from paramplane.nn import Linear, Sequential
from paramplane.optim import AdamW
from paramplane.parallel.sharding import ShardedArray


def _wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` seconds pass (a bound far above what it needs, below
    the world's timeout); whether it held."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _tell_when_rank_0_waits_for_rank_1(marker: Path) -> Callable[[], None]:
    """Rank 0 creates ``marker`` once it has looked for rank 1's list of this save (and not found it) and
    goes on waiting for it; returns what undoes the wrapping."""
    real_await, real_check = commit._await, commit._check_failures
    polls = {"awaiting rank 1": 0, "of rank 1's list": 0}

    def await_list(file: Path, *args: Any) -> Any:
        polls["awaiting rank 1"] = int(file.name == ".rank-1.json")
        return real_await(file, *args)

    def check(target: Path, save_id: str) -> None:  # the first thing each poll of a wait does
        if polls["awaiting rank 1"]:
            polls["of rank 1's list"] += 1
            if polls["of rank 1's list"] == 2:  # the first poll found no list of this save
                marker.touch()
        real_check(target, save_id)

    commit._await, commit._check_failures = await_list, check

    def undo() -> None:
        commit._await, commit._check_failures = real_await, real_check

    return undo


def _piece(world: Any, fill: float) -> ShardedArray:
    """This rank's half of a 10-element array."""
    a, b = 5 * world.rank, 5 * world.rank + 5
    return ShardedArray((10,), a, np.arange(a, b, dtype=np.float64) + fill)


def retry(world: Any, rep: Report, root: Path) -> None:
    g, path = world.group, root / "step_2"
    if world.rank == 0:  # what a crashed attempt (of 4 ranks) left: lists, an error, data files, a temporary
        path.mkdir(parents=True)
        stale = {
            "meta": None,
            "pieces": [{"key": "w", "start": 5, "stop": 10, "file": "rank-1.data", "offset": 0, "crc32": 0}],
        }
        (path / ".rank-1.json").write_text(json.dumps({**stale, "save_id": "old"}))
        (path / ".rank-1.error").write_text(json.dumps({"save_id": "old", "rank": 1, "error": "old"}))
        (path / ".verdict-old").write_text("abort")
        for name in (
            "rank-1.data",
            "rank-3.data",
            ".rank-2.data.0badf00d.tmp",
            ".manifest.json.0badf00d.tmp",
        ):
            (path / name).write_bytes(b"stale" * 20)
    g.barrier()
    # A slow disk: rank 1 is held before its pieces are durable until rank 0 has looked for rank 1's list and
    # goes on waiting for it (or, wrongly, committed): rank 0 must not commit with the stale list.
    waits, real, undo = root / "rank0-waits-for-rank1", os.fsync, None
    if world.rank == 0:
        undo = _tell_when_rank_0_waits_for_rank_1(waits)
    else:

        def slow_fsync(fd: int) -> None:  # its data file's: the first
            os.fsync = real
            _wait_for(lambda: waits.exists() or (path / "manifest.json").exists())
            rep.check("rank 0 waits for rank 1's list", waits.exists())
            rep.check("no commit before rank 1 wrote its pieces", not (path / "manifest.json").exists())
            real(fd)

        os.fsync = slow_fsync
    try:
        pp.checkpoint.save({"w": _piece(world, 0.5), "step": 2}, path, g)
    finally:
        os.fsync = real
        if undo is not None:
            undo()
    target = _piece(world, -100.0)
    got = pp.checkpoint.load({"w": target, "step": 0}, path, g)
    rep.equal("loaded this attempt's pieces", target.local, _piece(world, 0.5).local)
    rep.check("values", got["step"] == 2, str(got))
    left = sorted(p.name for p in path.iterdir())
    rep.check(
        "only this attempt's files left", left == ["manifest.json", "rank-0.data", "rank-1.data"], str(left)
    )


def fail_io(world: Any, rep: Report, root: Path) -> None:
    real = os.fsync
    if world.rank == 1:  # its data file's writeback fails

        def full(fd: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        os.fsync = full
    start = time.monotonic()
    try:
        exc = rep.raises(
            "every rank fails",
            pp.checkpoint.CheckpointError if world.rank == 0 else OSError,
            lambda: pp.checkpoint.save({"w": _piece(world, 0.0), "step": 1}, root / "s", world.group),
            *(["group rank 1", "No space left on device"] if world.rank == 0 else []),
        )
    finally:
        os.fsync = real
    rep.values["error"] = f"{type(exc).__name__}: {exc}"
    rep.check("at once, not after the group timeout (60 s)", time.monotonic() - start < 30.0)
    rep.check("nothing committed", not (root / "s" / "manifest.json").exists())
    world.group.barrier()  # both saves have returned
    left = sorted(p.name for p in (root / "s").iterdir())
    rep.check("no data file left behind", not [n for n in left if n.endswith(".data")], str(left))


def fail_json(world: Any, rep: Report, root: Path) -> None:
    start = time.monotonic()
    rep.raises(
        "a value JSON cannot hold",
        pp.checkpoint.CheckpointError,
        lambda: pp.checkpoint.save({"w": _piece(world, 0.0), "tags": {"a"}}, root / "s", world.group),
        "'tags'",
    )
    rep.check("at once, not after the group timeout (60 s)", time.monotonic() - start < 30.0)
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
    entry = pp.checkpoint.read_manifest(root / "s")["arrays"]["w"]
    (rec,) = entry["pieces"]
    raw = (root / "s" / rec["file"]).read_bytes()[rec["offset"] : rec["offset"] + 12]
    rep.check("its raw bytes, read as the manifest's dtype", entry["dtype"] == "bfloat16", str(entry))
    rep.equal("the bytes in the data file", np.frombuffer(raw, np.uint16), w.view(np.uint16))
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
    data = [p.name for p in (root / "s").iterdir() if p.name != "manifest.json"]
    rep.check("one data file for the rank's two arrays", data == ["rank-0.data"], str(data))
    synced = [t for k, t in events if k == "fsync" and ".data." in t]
    rep.check("fsynced once", len(synced) == 1, str(events))
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
    last = max(i for i, (k, t) in enumerate(events) if k == "rename" and t.endswith(".data"))
    rep.check(
        "directory fsynced after the data files",
        any(k == "fsync" and t == str(root / "s") for k, t in events[last:commit]),
        str(events),
    )


def names(world: Any, rep: Report, root: Path) -> None:
    pp.checkpoint.save({"lr sched": np.arange(4.0), "lr_sched": np.ones(4)}, root / "s", world.group)
    arrays = pp.checkpoint.read_manifest(root / "s")["arrays"]
    places = {(p["file"], p["offset"]) for a in arrays.values() for p in a["pieces"]}
    rep.check("two pieces at different offsets", len(places) == 2, str(places))
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


def _trained_fsdp(g: Any) -> tuple[Any, AdamW]:
    """A one-layer FSDP model and its AdamW after one step (optimizer state in every rank's shard)."""
    fsdp = pp.FSDP(Sequential(Linear(4, 4, dtype=np.float64, rng=np.random.default_rng(1))), g)
    opt = AdamW(fsdp.parameters(), lr=0.01)
    fsdp.attach(opt)
    y = fsdp(np.ones((2, 4)))
    fsdp.backward(np.ones_like(y))
    opt.step()
    opt.zero_grad()
    return fsdp, opt


def crc(world: Any, rep: Report, root: Path) -> None:
    g = world.group
    fsdp, opt = _trained_fsdp(g)
    pp.checkpoint.save({"model": fsdp, "optim": opt}, root / "s", g)
    if world.rank == 0:  # the bias's state lies in rank 1's half of the flat shard
        shutil.copytree(root / "s", root / "t")
        (rec,) = pp.checkpoint.read_manifest(root / "s")["arrays"]["optim/state.0.bias.exp_avg"]["pieces"]
        victim = root / "s" / rec["file"]
        data = bytearray(victim.read_bytes())
        data[rec["offset"] + 8 * (rec["stop"] - rec["start"]) - 1] ^= 0xFF  # its last byte
        victim.write_bytes(bytes(data))
        with open(root / "t" / "rank-1.data", "r+b") as f:  # a data file cut short (a full disk, a copy)
            f.truncate(f.seek(0, os.SEEK_END) - 1)
    g.barrier()
    fresh = pp.FSDP(Sequential(Linear(4, 4, dtype=np.float64, rng=np.random.default_rng(9))), g)
    fresh_opt = AdamW(fresh.parameters(), lr=0.5)
    before = fresh.units[0].shard.data.copy()
    rep.raises(
        "every rank refuses",
        pp.checkpoint.CheckpointError,
        lambda: pp.checkpoint.load({"model": fresh, "optim": fresh_opt}, root / "s", g),
        "corrupted",
        "rank-1.data",
        "optim/state.0.bias.exp_avg",
        "nothing was modified",
        "group rank 1",
    )
    rep.equal("model unchanged", fresh.units[0].shard.data, before)
    rep.check("optimizer unchanged", not fresh_opt.state and fresh_opt.lr == 0.5, str(fresh_opt.state))
    rep.raises(
        "a truncated data file: every rank refuses",
        pp.checkpoint.CheckpointError,
        lambda: pp.checkpoint.load({"model": fresh, "optim": fresh_opt}, root / "t", g),
        "rank-1.data is truncated",
        "nothing was modified",
        "group rank 1",
    )
    rep.equal("model unchanged", fresh.units[0].shard.data, before)
    rep.check("optimizer unchanged", not fresh_opt.state and fresh_opt.lr == 0.5, str(fresh_opt.state))


def _old_file_name(key: str, start: int, stop: int) -> str:
    """How the previous version named a piece's .npy file."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in key.replace("/", "__"))[:120]
    digest = hashlib.blake2s(key.encode(), digest_size=4).hexdigest()
    return f"{safe}.{digest}.{start}-{stop}.npy"


def _to_old_layout(new: Path, old: Path) -> None:
    """Rewrite the checkpoint at ``new`` as the previous version wrote it: format 1, every piece in a .npy file
    of its own (dtypes np.save cannot write, bfloat16, as same-size unsigned ints), records without offset."""
    old.mkdir()
    manifest = pp.checkpoint.read_manifest(new)
    for key, entry in manifest["arrays"].items():
        dtype = np.dtype(ml_dtypes.bfloat16) if entry["dtype"] == "bfloat16" else np.dtype(entry["dtype"])
        for rec in entry["pieces"]:
            count = rec["stop"] - rec["start"]
            piece = np.fromfile(new / rec.pop("file"), dtype, count, offset=rec.pop("offset"))
            name = _old_file_name(key, rec["start"], rec["stop"])
            stored = piece if piece.dtype.kind in "biufc" else piece.view(np.dtype(f"u{dtype.itemsize}"))
            np.save(old / name, stored, allow_pickle=False)
            rec["file"] = name
    (old / "manifest.json").write_text(json.dumps({**manifest, "format": 1}))


def old(world: Any, rep: Report, root: Path) -> None:
    g = world.group
    fsdp, opt = _trained_fsdp(g)
    h = (np.arange(6) / 3).astype(ml_dtypes.bfloat16)
    state = {"model": fsdp, "optim": opt, "w": _piece(world, 0.5), "h": h, "step": 4}
    pp.checkpoint.save(state, root / "new", g)
    if world.rank == 0:
        _to_old_layout(root / "new", root / "old")
    g.barrier()
    files = sorted(p.suffix for p in (root / "old").iterdir())
    rep.check(
        "the old layout", files == [".json"] + [".npy"] * (len(files) - 1) and len(files) > 6, str(files)
    )
    records = [r for a in pp.checkpoint.read_manifest(root / "old")["arrays"].values() for r in a["pieces"]]
    rep.check("records without an offset", not any("offset" in r for r in records), str(records))
    fresh = pp.FSDP(Sequential(Linear(4, 4, dtype=np.float64, rng=np.random.default_rng(9))), g)
    fresh_opt = AdamW(fresh.parameters(), lr=0.5)
    # w resharded: saved as halves [0, 5) and [5, 10), loaded as [0, 7) and [7, 10).
    a, b = (0, 7) if world.rank == 0 else (7, 10)
    w, h_back = ShardedArray((10,), a, np.zeros(b - a)), np.zeros(6, ml_dtypes.bfloat16)
    got = pp.checkpoint.load(
        {"model": fresh, "optim": fresh_opt, "w": w, "h": h_back, "step": 0}, root / "old", g
    )
    rep.check("plain values", got["step"] == 4, str(got))
    rep.equal("w resharded", w.local, np.arange(a, b, dtype=np.float64) + 0.5)
    rep.equal("bfloat16 from uint16 files", h_back, h)
    now = fresh.state_dict()
    for key, value in fsdp.state_dict().items():
        rep.equal(f"model {key}", now[key], value)
    for i, s in opt.state.items():
        for name, value in s.items():
            if isinstance(value, np.ndarray):
                rep.equal(f"optimizer {i} {name}", fresh_opt.state[i][name], value)
    rep.check("lr", fresh_opt.lr == 0.01, str(fresh_opt.lr))
    if world.rank == 0:  # a flipped byte in an old-layout file is still caught by its checksum
        shutil.copytree(root / "old", root / "damaged")
        victim = root / "damaged" / _old_file_name("w", 5, 10)
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0xFF
        victim.write_bytes(bytes(data))
    g.barrier()
    rep.raises(
        "a damaged old-layout file",
        pp.checkpoint.CheckpointError,
        lambda: pp.checkpoint.load({"w": ShardedArray((10,), a, np.zeros(b - a))}, root / "damaged", g),
        f"{_old_file_name('w', 5, 10)} is corrupted",
        "nothing was modified",
        "group rank 1",
    )


def kinds(world: Any, rep: Report, root: Path) -> None:
    g, r = world.group, world.rank
    # Same itemsize: without the check rank 1's int32 bytes would be read back as float32.
    w = ShardedArray((4,), 2 * r, np.array([2 * r + 1, 2 * r + 2], np.float32 if r == 0 else np.int32))
    rep.raises(
        "a dtype that differs between ranks",
        pp.checkpoint.CheckpointError,
        lambda: pp.checkpoint.save({"w": w, "b": np.ones(3)}, root / "a", g),
        "nothing was written",
        "'w' has a different dtype",
        "float32 (4,) on group rank 0",
        "int32 (4,) on group rank 1",
    )
    v = ShardedArray((10,) if r == 0 else (2, 5), 5 * r, np.arange(5.0))
    rep.raises(
        "a global shape that differs between ranks",
        pp.checkpoint.CheckpointError,
        lambda: pp.checkpoint.save({"v": v}, root / "b", g),
        "'v' has a different global shape",
        "float64 (10,) on group rank 0",
        "float64 (2, 5) on group rank 1",
    )
    table = np.zeros((2, 3) if r == 0 else (3, 2), np.float32 if r == 0 else np.float64)
    rep.raises(
        "a replicated array that differs between ranks",
        pp.checkpoint.CheckpointError,
        lambda: pp.checkpoint.save({"table": table}, root / "c", g),
        "'table' has a different global shape and dtype",
    )
    g.barrier()
    rep.check("nothing written", not any((root / d).exists() for d in "abc"), str(list(root.iterdir())))


def per_rank(world: Any, rep: Report, root: Path) -> None:
    """State that differs per rank (pipeline stages): keys only some ranks hold are saved by them and load
    back on each; a key every rank holds with different contents but not sharded fails every rank."""
    from paramplane.optim import SGD

    g, r = world.group, world.rank
    stage = Linear(3, 2, rng=10 + r)  # each rank's own stage: same parameter names, different weights
    opt = SGD(stage.parameters(), lr=0.1, momentum=0.9)
    stage.weight.accumulate_grad(np.full((2, 3), float(r + 1)))
    opt.step()
    state = {"shared": np.arange(4.0), f"stage{r}": stage, f"optim{r}": opt, f"note{r}": {"rank": r}}
    saved = pp.checkpoint.save(state, root / "ok", g)
    manifest = pp.checkpoint.read_manifest(saved)
    want = {"shared", "stage0/weight", "stage1/weight", "stage0/bias", "stage1/bias"}
    rep.check("every rank's keys saved", want <= set(manifest["arrays"]), str(sorted(manifest["arrays"])))
    rep.check(
        "every rank's values saved", {"note0", "note1"} <= set(manifest["values"]), str(manifest["values"])
    )
    fresh = Linear(3, 2, rng=99)
    fresh_opt = SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    plain = pp.checkpoint.load(
        {"shared": np.zeros(4), f"stage{r}": fresh, f"optim{r}": fresh_opt, f"note{r}": {}}, saved, g
    )
    rep.equal("this rank's stage loads its own weights", fresh.weight.data, stage.weight.data)
    rep.equal(
        "and its own optimizer state", fresh_opt.state[0]["momentum_buffer"], opt.state[0]["momentum_buffer"]
    )
    rep.check("and its own values", plain[f"note{r}"] == {"rank": r}, str(plain))
    rep.raises(
        "the same key with different weights on each rank",
        pp.checkpoint.CheckpointError,
        lambda: pp.checkpoint.save({"model": stage}, root / "clash", g),
        "nothing was written",
        "array 'model/weight' differs between group ranks 0 / 1, which hold it as replicas",
        "keys of its own",
    )
    rep.raises(
        "the same plain value with different contents",
        pp.checkpoint.CheckpointError,
        lambda: pp.checkpoint.save({"epoch": r}, root / "clash_value", g),
        "value 'epoch' differs between group ranks 0 / 1",
    )
    # Shards several ranks hold (replicas, as FSDP no_shard or hybrid) must hold the same too: two pipeline
    # stages, each sharded over its own group, saved under one key.
    clash = ShardedArray((4,), 0, np.full(4, float(r)))
    rep.raises(
        "the same shard with different contents",
        pp.checkpoint.CheckpointError,
        lambda: pp.checkpoint.save({"flat": clash}, root / "clash_shard", g),
        "array 'flat[0:4]' differs between group ranks 0 / 1",
    )
    # A rank alone holding something a checkpoint cannot hold fails every rank with the same error.
    odd = {"w": np.arange(3.0), **({"odd": np.array([1, None], dtype=object)} if r == 1 else {})}
    rep.raises(
        "one rank's unsupported array",
        pp.checkpoint.CheckpointError,
        lambda: pp.checkpoint.save(odd, root / "clash_odd", g),
        "nothing was written",
        "group rank 1",
    )
    # A DDP replica's buffers (BatchNorm statistics) move with its own batches until the next forward
    # re-broadcasts rank 0's: they may differ, and rank 0's copy is saved (as torch DDP with DCP).
    ddp = pp.DDP(Linear(3, 2, rng=5), g)
    ddp.module.register_buffer("running", np.full(2, float(r)))
    kept = pp.checkpoint.save({"model": ddp}, root / "buffers", g)
    again = Linear(3, 2, rng=6)
    again.register_buffer("running", np.full(2, 7.0))
    pp.checkpoint.load({"model": again}, kept, g)
    rep.equal("replica buffers may differ: rank 0's saved", again.running, np.zeros(2))
    rep.equal("and the parameters", again.weight.data, ddp.module.weight.data)
    big = np.zeros(3_000_000)
    big[-1] = r  # past the first blocks: the sampled fingerprint still covers the array's end
    rep.raises(
        "a large replicated array differing at its end",
        pp.checkpoint.CheckpointError,
        lambda: pp.checkpoint.save({"big": big}, root / "clash_big", g),
        "array 'big' differs",
    )
    g.barrier()
    rep.check(
        "nothing written for the clashes",
        not any(
            (root / d).exists() for d in ("clash", "clash_value", "clash_big", "clash_shard", "clash_odd")
        ),
        str(list(root.iterdir())),
    )


def _open_files(root: Path) -> list[str]:
    """The files under ``root`` this process holds open."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own fd)
            continue
        if target.startswith(str(root)):
            found.append(target)
    return found


def reads(world: Any, rep: Report, root: Path) -> None:
    g, n = world.group, 3 << 20  # 24 MiB a rank: checked and read in several chunks

    def big(fill: float) -> ShardedArray:
        return ShardedArray((2 * n,), n * world.rank, np.arange(n, dtype=np.float64) + fill)

    pp.checkpoint.save({"big": big(0.5), "small": np.ones(7)}, root / "s", g)
    data = root / "s" / f"rank-{world.rank}.data"
    # Rank 1's file cut short after the load checked it (a copy over it, a full disk): with a memory map,
    # reading it would kill the rank with SIGBUS.
    real_fill = reader._Reader.fill

    def cut_then_fill(self: Any, key: str, entry: Any, target: Any) -> None:
        if world.rank == 1 and data.stat().st_size > 4096:
            os.truncate(data, 4096)
        real_fill(self, key, entry, target)

    reader._Reader.fill = cut_then_fill  # type: ignore[method-assign]
    target = big(-100.0)
    try:
        if world.rank == 1:
            rep.raises(
                "a file cut short while loading",
                pp.checkpoint.CheckpointError,
                lambda: pp.checkpoint.load({"big": target, "small": np.zeros(7)}, root / "s", g),
                f"{data} is truncated",
            )
        else:
            pp.checkpoint.load({"big": target, "small": np.zeros(7)}, root / "s", g)
            rep.equal("rank 0 loads its own file", target.local, big(0.5).local)
    finally:
        reader._Reader.fill = real_fill  # type: ignore[method-assign]
    rep.check("its files closed after the failure", not _open_files(root), str(_open_files(root)))
    g.barrier()
    pp.checkpoint.save({"big": big(0.5), "small": np.ones(7)}, root / "t", g)
    # A read error (a bad disk, NFS) on rank 1 while checking: every rank refuses, nothing modified.
    real_preadv = os.preadv

    def eio(fd: int, buffers: Any, offset: int, *flags: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    if world.rank == 1:
        os.preadv = eio
    target = big(-100.0)
    try:
        rep.raises(
            "a read error",
            pp.checkpoint.CheckpointError,
            lambda: pp.checkpoint.load({"big": target, "small": np.zeros(7)}, root / "t", g),
            "nothing was modified",
            "group rank 1",
            "rank-1.data cannot be read",
            "Input/output error",
        )
    finally:
        os.preadv = real_preadv
    rep.equal("target unchanged", target.local, big(-100.0).local)
    rep.check("its files closed after the refusal", not _open_files(root), str(_open_files(root)))
    small = np.zeros(7)
    pp.checkpoint.load({"big": target, "small": small}, root / "t", g)
    rep.equal("then it loads", target.local, big(0.5).local)
    rep.equal("small", small, np.ones(7))
    rep.check("its files closed after the load", not _open_files(root), str(_open_files(root)))


def records(world: Any, rep: Report, root: Path) -> None:
    g = world.group
    pp.checkpoint.save({"w": _piece(world, 0.5)}, root / "s", g)
    damages: dict[str, Any] = {
        "a float stop": lambda rec: rec.update(stop=float(rec["stop"])),
        "no crc32": lambda rec: rec.pop("crc32"),
        "a bool offset": lambda rec: rec.update(offset=True),
        "a string start": lambda rec: rec.update(start="5"),
        "start after stop": lambda rec: rec.update(start=11),
        "a file that is not a name": lambda rec: rec.update(file=None),
    }
    for i, (what, damage) in enumerate(damages.items()):
        path = root / f"d{i}"
        if world.rank == 0:  # rank 1's piece: only rank 1 reads it, every rank must refuse
            shutil.copytree(root / "s", path)
            manifest = json.loads((path / "manifest.json").read_text())
            (rec,) = [p for p in manifest["arrays"]["w"]["pieces"] if p["start"] == 5]
            damage(rec)
            (path / "manifest.json").write_text(json.dumps(manifest))
        g.barrier()
        target = _piece(world, -100.0)
        rep.raises(
            what,
            pp.checkpoint.CheckpointError,
            lambda t=target, p=path: pp.checkpoint.load({"w": t}, p, g),
            "nothing was modified",
            "group rank 0",
            "group rank 1",
            "'w'",
        )
        rep.equal(f"{what}: unchanged", target.local, _piece(world, -100.0).local)


def late(world: Any, rep: Report, root: Path) -> None:
    g, path = world.group, root / "s"
    real_write_json, real_await = commit._write_json, commit._await
    returned = root / "rank1-save-returned"  # rank 1's save has given up and removed what it may

    def slow_commit(file: Path, obj: Any) -> None:  # rank 0 decided to commit; rank 1 gives up meanwhile
        if file.name == "manifest.json":
            rep.check("rank 1 gave up before the manifest was written", _wait_for(returned.exists))
        real_write_json(file, obj)

    def give_up(file: Path, target: Path, save_id: str, *args: Any) -> Any:
        if file.name == "manifest.json":
            rep.check("rank 0 decided to commit", _wait_for(lambda: bool(list(target.glob(".verdict-*")))))
            raise pp.CollectiveTimeout("gave up waiting for the commit (test)")
        return real_await(file, target, save_id, *args)

    if world.rank == 0:
        commit._write_json = slow_commit
    else:
        commit._await = give_up
    try:
        if world.rank == 0:
            rep.check("rank 0 commits", pp.checkpoint.save({"w": _piece(world, 0.5)}, path, g) == path)
        else:
            rep.raises(
                "rank 1 gave up",
                pp.CollectiveTimeout,
                lambda: pp.checkpoint.save({"w": _piece(world, 0.5)}, path, g),
                "gave up",
            )
    finally:
        commit._write_json, commit._await = real_write_json, real_await
        if world.rank == 1:
            returned.touch()
    g.barrier()
    rep.check("rank 1 kept its data file", (path / "rank-1.data").exists(), str(list(path.iterdir())))
    target = _piece(world, -100.0)
    pp.checkpoint.load({"w": target}, path, g)
    rep.equal("the committed checkpoint loads", target.local, _piece(world, 0.5).local)


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    modes = {"retry": retry, "fail_io": fail_io, "fail_json": fail_json, "values": values, "bf16": bf16}
    modes.update({"fsync": fsync, "names": names, "sync": sync, "crc": crc, "old": old})
    modes.update({"kinds": kinds, "reads": reads, "records": records, "late": late, "per_rank": per_rank})
    run_rank(lambda world, rep: modes[mode](world, rep, root))


if __name__ == "__main__":
    main()
