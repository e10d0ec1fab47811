"""Every collective over TCP lanes, gRPC streams and shared memory, in real multi-process worlds.

One world per (world size, transport) runs many checks inside tests/workers/collectives.py
against numpy references built from deterministic per-rank data; here we assert that every
rank passed every check, that all ranks hold bitwise-identical all_reduce results, and that
nothing is left in /dev/shm.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _world import run_world

CASES = [
    # (world size, transport, extra env); every world runs every op at every size, plus the
    # point-to-point ring (and, in worlds of 4, the subgroup and two-groups-in-flight checks).
    pytest.param(2, "grpc", {}, id="2-grpc"),
    # TCP lanes between processes of one machine (Unix lanes off), as between hosts.
    pytest.param(2, "grpc", {"PARAMPLANE_UNIX_LANE": "0"}, id="2-grpc-tcp-lanes"),
    # The same frames on gRPC streams instead of raw TCP lanes (what TLS uses).
    pytest.param(2, "grpc", {"PARAMPLANE_TCP_LANE": "0"}, id="2-grpc-streams"),
    pytest.param(3, "grpc", {"PARAMPLANE_TCP_LANE": "0"}, id="3-grpc-streams"),
    pytest.param(2, "shm", {}, id="2-shm"),
    pytest.param(3, "grpc", {}, id="3-grpc"),
    # A small shm slot makes the 1 MiB + 1 payloads take several rounds.
    pytest.param(3, "shm", {"PARAMPLANE_SHM_SLOT_MB": "0.25"}, id="3-shm-small-slot"),
    pytest.param(4, "grpc", {}, id="4-grpc"),
    pytest.param(4, "shm", {"PARAMPLANE_SHM_SLOT_MB": "0.25"}, id="4-shm-small-slot"),
]


@pytest.mark.parametrize(("n", "transport", "env"), CASES)
def test_every_collective_matches_numpy(n: int, transport: str, env: dict[str, str]) -> None:
    world = run_world(
        n,
        "collectives.py",
        args=["--full-big", "--extras"],
        env={"PARAMPLANE_TRANSPORT": transport, "PARAMPLANE_TIMEOUT": "30", **env},
        timeout=100,
    )
    results = world.check_ok()
    assert all(r["num_checks"] > 100 for r in results), [r["num_checks"] for r in results]
    digests = [r["digests"] for r in results]
    assert digests[0], "no all_reduce digests recorded"
    for key, value in digests[0].items():
        others = {d.get(key) for d in digests}
        assert others == {value}, f"ranks disagree bitwise on {key}: {others}"
    assert world.shm_leaks() == set()
    if transport == "grpc":
        if env.get("PARAMPLANE_TCP_LANE") == "0":
            want = "grpc-stream"
        else:
            want = "lane-tcp" if env.get("PARAMPLANE_UNIX_LANE") == "0" else "lane-unix"
        assert {tuple(r["values"]["streams"]) for r in results} == {(want,)}
        assert not any(r["values"]["shm_used"] for r in results)
    else:  # the collectives went through shared memory
        assert all(r["values"]["shm_used"] for r in results)


def test_hierarchical_all_reduce_of_hosts_that_disagree_on_the_shape_is_a_mismatch() -> None:
    """5 against 6 elements make equal pieces per local rank: the cross-host step still compares shapes."""
    world = run_world(
        4,
        "hierarchy.py",
        args=["mismatch"],
        env={"PARAMPLANE_TRANSPORT": "auto", "PARAMPLANE_TIMEOUT": "30"},
        rank_env={r: {"PARAMPLANE_HOST_ID": "hostA" if r < 2 else "hostB"} for r in range(4)},
        timeout=60,
    )
    world.check_ok(min_checks=1)


def test_hierarchical_all_reduce_two_hosts(tmp_path: Path) -> None:
    """2 host ids x 2 local ranks with transport auto: intra-host shm + cross-host gRPC."""
    hosts = {0: "hostA", 1: "hostA", 2: "hostB", 3: "hostB"}
    trace = tmp_path / "trace"
    world = run_world(
        4,
        "hierarchy.py",
        env={"PARAMPLANE_TRANSPORT": "auto", "PARAMPLANE_TIMEOUT": "30", "PARAMPLANE_TRACE": str(trace)},
        rank_env={r: {"PARAMPLANE_HOST_ID": h} for r, h in hosts.items()},
        timeout=60,
    )
    results = world.check_ok()
    assert [r["values"]["host_id"] for r in results] == [hosts[r] for r in range(4)]
    assert results[0]["digests"], "no results to compare"
    for key, value in results[0]["digests"].items():
        assert {r["digests"][key] for r in results} == {value}, key
    # The all_reduces really took the hierarchical path.
    for rank in range(4):
        events = json.loads((trace / f"rank-{rank}.json").read_text())["traceEvents"]
        transports = {e["args"]["transport"] for e in events if e.get("name") == "all_reduce"}
        assert transports == {"hier"}, transports
    assert world.shm_leaks() == set()


def test_stale_shm_segments_are_swept_and_held_or_young_ones_kept() -> None:
    """A segment nobody holds a lock on (its creator was killed during setup) is removed by the next setup's
    sweep; one a live process holds, or one just created, is kept."""
    import os
    import subprocess
    import sys
    import uuid

    from paramplane.node.transports.shm import SEGMENT_PREFIX, SHM_DIR, sweep_stale_segments

    tag = uuid.uuid4().hex[:8]
    stale, held, young = (f"{SEGMENT_PREFIX}test-{tag}-{kind}" for kind in ("stale", "held", "young"))
    old = 3600.0
    for name in (stale, held, young):
        with open(os.path.join(SHM_DIR, name), "wb") as f:
            f.truncate(4096)
    for name in (stale, held):
        os.utime(os.path.join(SHM_DIR, name), (os.path.getmtime(os.path.join(SHM_DIR, name)) - old,) * 2)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
            "fcntl.lockf(fd, fcntl.LOCK_EX, 1, 0); print('locked', flush=True); sys.stdin.read()",
            os.path.join(SHM_DIR, held),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        removed = sweep_stale_segments()
        assert stale in removed and held not in removed and young not in removed
        assert not os.path.exists(os.path.join(SHM_DIR, stale))
        assert os.path.exists(os.path.join(SHM_DIR, held)) and os.path.exists(os.path.join(SHM_DIR, young))
    finally:
        holder.communicate("", timeout=30)
        for name in (stale, held, young):
            if os.path.exists(os.path.join(SHM_DIR, name)):
                os.unlink(os.path.join(SHM_DIR, name))
