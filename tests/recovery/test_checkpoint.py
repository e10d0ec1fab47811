"""Sharded checkpoints in real worlds: reshard N -> M across strategies, atomic commit, damage detection.

FSDP full_shard at world 4 saves after 3 steps; fresh worlds of 2 (full_shard), 3 (shard_grad_op),
1 (no_shard), 4 on two fake hosts (hybrid_shard) and 1 without FSDP load it: every parameter equals the
saved one bit for bit, the optimizer state and plain values come back, and 3 more steps equal a single
process trained 6 steps (float64, 1e-10).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from _world import run_world

from paramplane.checkpoint import latest, prune, read_manifest

ENV = {"PARAMPLANE_TIMEOUT": "60"}
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    run_world(4, "checkpoint.py", args=["save", str(root)], env=ENV, timeout=180).check_ok()
    return root


def test_manifest_records_every_piece(saved: Path) -> None:
    m = read_manifest(saved / "step_3")
    assert m["world_size"] == 4 and m["values"]["step"] == 3
    weight = m["arrays"]["model/0.weight"]
    assert weight["global_shape"] == [7, 13] and weight["dtype"] == "float64"
    ranges = sorted((p["start"], p["stop"]) for p in weight["pieces"])
    assert ranges[0][0] == 0 and ranges[-1][1] == 91
    assert all(b == c for (_, b), (c, _) in itertools.pairwise(ranges))  # the pieces tile the array
    assert any(k.startswith("optim/state.0.weight.exp_avg") for k in m["arrays"])
    assert not list((saved / "step_3").glob(".rank-*")), "per-rank lists are removed at commit"


def test_each_rank_writes_one_data_file(saved: Path) -> None:
    """One data file per rank (not one per piece), nothing else but the manifest; each piece at an aligned
    offset inside it, none overlapping another."""
    folder = saved / "step_3"
    m = read_manifest(folder)
    assert m["format"] == 2
    names = [f"rank-{r}.data" for r in range(4)]
    assert sorted(p.name for p in folder.iterdir()) == sorted([*names, "manifest.json"])
    spans: dict[str, list[tuple[int, int]]] = {name: [] for name in names}
    for entry in m["arrays"].values():
        size = np.dtype(entry["dtype"]).itemsize
        for rec in entry["pieces"]:
            assert rec["offset"] % 64 == 0, rec
            spans[rec["file"]].append((rec["offset"], rec["offset"] + (rec["stop"] - rec["start"]) * size))
    for name, used in spans.items():
        used.sort()
        assert used and all(b <= c for (_, b), (c, _) in itertools.pairwise(used)), name
        assert used[-1][1] == (folder / name).stat().st_size, name


@pytest.mark.timeout(240)  # its own bounds (180 s), not the global 120 s
@pytest.mark.parametrize(
    ("n", "strategy", "hosts"),
    [
        (2, "full_shard", False),
        (3, "shard_grad_op", False),
        (1, "no_shard", False),
        (4, "hybrid_shard", True),
    ],
)
def test_load_reshards_and_training_continues(saved: Path, n: int, strategy: str, hosts: bool) -> None:
    rank_env = {r: {"PARAMPLANE_HOST_ID": f"host{r // 2}"} for r in range(n)} if hosts else None
    world = run_world(
        n, "checkpoint.py", args=["load", str(saved), strategy], env=ENV, rank_env=rank_env, timeout=180
    )
    assert all(r["num_checks"] >= 10 for r in world.check_ok())


@pytest.mark.timeout(420)  # its own bounds (2 x 180 s), not the global 120 s
def test_a_hybrid_shard_zero2_checkpoint_loads_at_another_shard_size(tmp_path: Path) -> None:
    """hybrid_shard_zero2 at world 4 on two hosts (shards of 2, two replicas) saves after 3 AdamW steps;
    world 2 with a rank per host (shards of 1, two replicas) loads it as hybrid_shard_zero2: every parameter
    equals the saved one bit for bit, AdamW's state is at step 3, and 3 more steps equal one process trained 6."""
    hosts = {r: {"PARAMPLANE_HOST_ID": f"host{r // 2}"} for r in range(4)}
    args = ["save", str(tmp_path), "hybrid_shard_zero2"]
    run_world(4, "checkpoint.py", args=args, env=ENV, rank_env=hosts, timeout=180).check_ok()
    m = read_manifest(tmp_path / "step_3")
    assert m["world_size"] == 4
    for key, entry in m["arrays"].items():  # the two replicas' shards are written once: pieces tile the array
        ranges = sorted((p["start"], p["stop"]) for p in entry["pieces"])
        assert ranges[0][0] == 0 and all(b == c for (_, b), (c, _) in itertools.pairwise(ranges)), key
        assert ranges[-1][1] == int(np.prod(entry["global_shape"])), key
    apart = {r: {"PARAMPLANE_HOST_ID": f"host{r}"} for r in range(2)}
    args = ["load", str(tmp_path), "hybrid_shard_zero2"]
    world = run_world(2, "checkpoint.py", args=args, env=ENV, rank_env=apart, timeout=180)
    assert all(r["num_checks"] >= 10 for r in world.check_ok())


@pytest.mark.timeout(180)  # its own bounds (120 s), not the global 120 s
def test_a_plain_model_and_adamw_load_the_fsdp_checkpoint_and_train_on(saved: Path) -> None:
    """No FSDP on the loading side: parameters, moments and AdamW's step (saved under the flat shards) come
    back, and 3 more steps equal a single process trained 6 steps."""
    world = run_world(1, "checkpoint.py", args=["dense", str(saved)], env=ENV, timeout=120)
    assert all(r["num_checks"] >= 10 for r in world.check_ok())


@pytest.mark.timeout(180)  # its own bounds (120 s), not the global 120 s
def test_plain_state_mismatch_and_async(tmp_path: Path) -> None:
    env = {**ENV, "PARAMPLANE_TRACE": str(tmp_path / "trace")}
    world = run_world(2, "checkpoint.py", args=["plain", str(tmp_path)], env=env, timeout=120)
    results = world.check_ok()
    assert all(r["num_checks"] >= 10 and r["values"]["async_traced"] for r in results)


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    world = run_world(
        2,
        "checkpoint.py",
        args=["crash", str(tmp_path)],
        env={**ENV, "PARAMPLANE_TIMEOUT": "20"},
        heartbeat_timeout_s=3.0,
        timeout=90,
    )
    assert not world.timed_out, world.describe()
    assert world.ranks[1].returncode == 17, world.describe()  # died after writing its shards
    r0 = world.ranks[0].result
    assert r0 is not None and r0["values"].get("saved_step_1") and r0["failures"] == [], world.describe()
    assert r0["values"].get("save_error") in ("PeerLost", "WorldAborted"), r0
    assert latest(tmp_path) == tmp_path / "step_1"
    assert (tmp_path / "step_2").is_dir() and not (tmp_path / "step_2" / "manifest.json").exists()
    # Rank 0 saw the lost peer and removed its own data file (nothing references it); rank 1 died.
    assert not (tmp_path / "step_2" / "rank-0.data").exists(), sorted(os.listdir(tmp_path / "step_2"))
    assert read_manifest(tmp_path / "step_1")["values"]["step"] == 1


def test_inspect_consolidate_corruption_and_prune(saved: Path, tmp_path: Path) -> None:
    out = _cli("inspect", saved / "step_3")
    assert out.returncode == 0 and "written by 4 ranks" in out.stdout and "model/0.weight" in out.stdout, out
    npz = tmp_path / "full.npz"
    out = _cli("consolidate", saved / "step_3", npz)
    assert out.returncode == 0, out.stderr
    full, want = np.load(npz), np.load(saved / "saved_model.npz")
    for key in want.files:
        assert np.array_equal(full[f"model/{key}"], want[key]), key
    # One flipped byte inside one piece of a rank's data file: caught by that piece's checksum.
    broken = tmp_path / "broken" / "step_3"
    shutil.copytree(saved / "step_3", broken)
    rec = min(read_manifest(broken)["arrays"]["model/0.weight"]["pieces"], key=lambda p: p["start"])
    victim = broken / rec["file"]
    data = bytearray(victim.read_bytes())
    data[rec["offset"] + 8] ^= 0xFF  # in its second float64
    victim.write_bytes(bytes(data))
    out = _cli("consolidate", broken, tmp_path / "x.npz")
    assert out.returncode == 1 and f"{victim} is corrupted" in out.stderr, out
    assert "'model/0.weight'[0:" in out.stderr, out
    # A data file cut short, or missing: a CheckpointError naming it, not a crash.
    victim.write_bytes(bytes(data[: rec["offset"] + 4]))
    out = _cli("consolidate", broken, tmp_path / "x.npz")
    assert out.returncode == 1 and f"{victim} is truncated" in out.stderr, out
    victim.unlink()
    out = _cli("consolidate", broken, tmp_path / "x.npz")
    assert out.returncode == 1 and f"{victim} cannot be read" in out.stderr, out
    # prune keeps the newest K complete checkpoints; a directory without a manifest is not one.
    root = tmp_path / "many"
    for i in range(3):
        shutil.copytree(saved / "step_3", root / f"step_{i}")
    newest = root / "step_1" / "manifest.json"
    manifest = json.loads(newest.read_text())
    manifest["saved_at"] += 1000.0  # the newest, whatever its name
    newest.write_text(json.dumps(manifest))
    (root / "partial").mkdir()
    deleted = prune(root, keep=1)
    assert latest(root) == root / "step_1"
    assert sorted(d.name for d in deleted) == ["step_0", "step_2"]
    assert (root / "partial").is_dir() and not (root / "step_0").exists()


def _cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """``python -m paramplane.checkpoint ARGS``, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "paramplane.checkpoint", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _edge_case(n: int, mode: str, root: Path, **kw: Any) -> list[dict[str, Any]]:
    world = run_world(n, "checkpoint_edges.py", args=[mode, str(root)], env=ENV, timeout=60, **kw)
    return world.check_ok(min_checks=1)


def test_a_retried_save_ignores_the_lists_of_a_crashed_attempt(tmp_path: Path) -> None:
    _edge_case(2, "retry", tmp_path)


@pytest.mark.parametrize("mode", ["fail_io", "fail_json"])
def test_a_rank_that_cannot_write_fails_every_rank_at_once(tmp_path: Path, mode: str) -> None:
    results = _edge_case(2, mode, tmp_path)
    if mode == "fail_io":
        assert results[0]["values"]["error"].startswith("SaveFailed: "), results[0]


def test_save_async_copies_values_numpy_scalars_and_strided_targets_load(tmp_path: Path) -> None:
    _edge_case(1, "values", tmp_path)


@pytest.mark.timeout(180)  # its own bounds (120 s), not the global 120 s
def test_bfloat16_round_trips_and_consolidates(tmp_path: Path) -> None:
    _edge_case(1, "bf16", tmp_path)
    out = _cli("consolidate", tmp_path / "s", tmp_path / "f.npz")
    assert out.returncode == 0 and "float32" in out.stdout, out
    full = np.load(tmp_path / "f.npz")["w"]
    assert full.dtype == np.float32 and np.array_equal(
        full, (np.arange(6) / 3).astype(BF16).astype(np.float32)
    )


def test_data_files_are_fsynced_before_the_commit(tmp_path: Path) -> None:
    _edge_case(1, "fsync", tmp_path)


def test_keys_with_the_same_safe_name_keep_separate_files(tmp_path: Path) -> None:
    _edge_case(1, "names", tmp_path)


def test_sync_fills_non_contiguous_targets(tmp_path: Path) -> None:
    _edge_case(2, "sync", tmp_path)


def test_a_damaged_file_one_rank_needs_fails_every_rank_before_any_change(tmp_path: Path) -> None:
    _edge_case(2, "crc", tmp_path)


@pytest.mark.timeout(180)  # its own bounds (120 s), not the global 120 s
def test_a_checkpoint_of_the_previous_layout_loads(tmp_path: Path) -> None:
    """Format 1 (one .npy file per piece, records without an offset) loads, reshards and consolidates to the
    same arrays as the checkpoint it was made from."""
    _edge_case(2, "old", tmp_path)
    assert read_manifest(tmp_path / "old")["format"] == 1
    full = {}
    for name in ("new", "old"):
        out = _cli("consolidate", tmp_path / name, tmp_path / f"{name}.npz")
        assert out.returncode == 0, out.stderr
        full[name] = np.load(tmp_path / f"{name}.npz")
    assert sorted(full["old"].files) == sorted(full["new"].files) and "h" in full["old"].files
    for key in full["new"].files:
        assert np.array_equal(full["old"][key], full["new"][key]), key


def test_ranks_staging_different_dtypes_or_shapes_for_a_key_fail_the_save(tmp_path: Path) -> None:
    """The data files hold raw bytes and the manifest one dtype and global shape per key: a rank that
    disagrees would be read back as rank 0's kind, so every rank refuses before anything is written."""
    _edge_case(2, "kinds", tmp_path)


def test_state_that_differs_per_rank_is_saved_under_keys_of_its_own(tmp_path: Path) -> None:
    """Pipeline stages: keys only one rank holds (its stage, its optimizer, its values) are saved and load back
    on that rank; a key that is not sharded but differs between ranks (two stages under one name) fails the
    save on every rank instead of keeping rank 0's copy for both."""
    _edge_case(2, "per_rank", tmp_path)


def test_a_file_cut_short_or_unreadable_while_loading_is_a_checkpoint_error(tmp_path: Path) -> None:
    """Loads read with pread, not through a memory map: a file truncated after the check, or a read error,
    is a CheckpointError naming the file instead of a SIGBUS; the load's files are closed either way."""
    _edge_case(2, "reads", tmp_path)


def test_a_damaged_manifest_record_fails_every_rank(tmp_path: Path) -> None:
    _edge_case(2, "records", tmp_path)


def test_a_rank_giving_up_after_rank_0_decided_to_commit_keeps_its_data_file(tmp_path: Path) -> None:
    """Ranks remove their data file when a save fails, but only once it can no longer commit."""
    _edge_case(2, "late", tmp_path)
