"""The kill loop: rounds that each SIGKILL a random rank at a random moment of a random collective on a
random transport (gRPC lanes, shm, hierarchical); every survivor names the lost rank with PeerLost within
the heartbeat bound, no process is left behind and nothing stays in /dev/shm."""

from __future__ import annotations

import random

import pytest
from _world import run_world

HEARTBEAT_TIMEOUT_S = 3.0
SEED = 1122
NUM_ROUNDS = 10  # issue 11: ten rounds


def _rounds() -> list[tuple[str, int, str, int, int, float]]:
    rng = random.Random(SEED)
    rounds = []
    for _ in range(NUM_ROUNDS):
        transport = rng.choice(["grpc", "shm", "hier"])
        n = 4 if transport == "hier" else 3
        op = rng.choice(["all_reduce", "all_gather", "broadcast", "reduce_scatter"])
        rounds.append((transport, n, op, rng.randrange(n), rng.randrange(1, 6), rng.uniform(0.0, 8.0)))
    # One round on gRPC streams (lanes off: the path TLS uses) instead of raw lanes.
    rounds.append(("grpc-streams", 3, "all_reduce", 1, 3, 2.0))
    return rounds


@pytest.mark.parametrize(("transport", "n", "op", "victim", "kill_at", "delay_ms"), _rounds())
def test_a_killed_rank_is_named_to_every_survivor(
    transport: str, n: int, op: str, victim: int, kill_at: int, delay_ms: float
) -> None:
    env = {
        "PARAMPLANE_TRANSPORT": {"hier": "auto", "grpc-streams": "grpc"}.get(transport, transport),
        "PARAMPLANE_TCP_LANE": "0" if transport == "grpc-streams" else "1",
        "PARAMPLANE_TIMEOUT": "60",
        "KILL_RANK": str(victim),
        "KILL_AT": str(kill_at),
        "KILL_DELAY_MS": f"{delay_ms:.3f}",
        "KILL_OP": op,
    }
    rank_env = (
        {r: {"PARAMPLANE_HOST_ID": f"host-{r // 2}"} for r in range(n)} if transport == "hier" else None
    )
    world = run_world(
        n,
        "kill_loop.py",
        env=env,
        rank_env=rank_env,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        heartbeat_interval_s=0.5,
        timeout=60,
    )
    assert not world.timed_out, world.describe()  # every process ended on its own: no orphan
    dead = world.ranks[victim]
    assert dead.returncode == -9, world.describe()
    assert dead.result is not None, world.describe()
    killed_at = dead.result["values"]["killed_at"] + delay_ms / 1000
    for survivor in world.ranks:
        if survivor.rank == victim:
            continue
        assert survivor.returncode == 0 and survivor.result is not None, world.describe()
        values = survivor.result["values"]
        assert survivor.result["failures"] == [], survivor.result["failures"]
        seen = f"rank {survivor.rank} saw {values}"
        assert values.get("error_type") == "PeerLost", seen
        assert values.get("error_rank") == victim and f"rank {victim}" in values["error_text"], seen
        assert values["error_at"] - killed_at < HEARTBEAT_TIMEOUT_S + 10.0, values  # slack: a busy machine
    assert world.shm_leaks() == set()
