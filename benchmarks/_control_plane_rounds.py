"""What every simulated rank of ``control_plane.py`` does once joined, the same for every implementation.

Round 0 starts right after the joins; rounds 1..R are measured alike and reported as their median, round 0's
barrier as its own figure (``barrier_first_s``: it also waits behind the joins' tail). A round: a world
barrier (timed from the last arrival to the last release), a world unique id (set by rank 0 as it is
released), a second barrier, then one unique id per host (set by each host's first rank). One more barrier
closes the rounds. ``plan`` yields the calls to make, ``("barrier" | "set" | "get", name)``, and records the
times as the driver resumes it, so that a thread (TCPStore) and a coroutine (paramplane) drive the same plan.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from typing import Any

ROUNDS = 5


def new_out(rounds: int) -> dict[str, Any]:
    """One simulator process's records, per round (``rounds`` measured rounds after round 0)."""
    per_round = ("arrive", "release", "uid_world", "uid_host", "uid_host_set")
    out: dict[str, Any] = {key: [[] for _ in range(rounds + 1)] for key in per_round}
    out["uid_world_set"] = [None] * (rounds + 1)
    out["join"], out["abort"] = [], []
    return out


def plan(r: int, host: int, per_host: int, rounds: int, out: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """Rank ``r``'s calls after its join; the driver makes each one, then resumes the plan."""
    now = time.monotonic
    for i in range(rounds + 1):
        out["arrive"][i].append(now())
        yield "barrier", f"r{i}a"
        out["release"][i].append(now())
        if r == 0:
            out["uid_world_set"][i] = now()
        yield ("set" if r == 0 else "get"), f"uid/world/{i}"
        out["uid_world"][i].append(now())
        yield "barrier", f"r{i}b"
        if r % per_host == 0:
            out["uid_host_set"][i].append(now())
        yield ("set" if r % per_host == 0 else "get"), f"uid/host-{host}/{i}"
        out["uid_host"][i].append(now())
    yield "barrier", "end"


def summary(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one run from every simulator process's records: medians over rounds 1..R."""
    num_rounds = len(parts[0]["arrive"])

    def merged(key: str, i: int) -> list[float]:
        return [t for p in parts for t in p[key][i]]

    barriers, worlds, hosts = [], [], []
    for i in range(num_rounds):
        barriers.append(max(merged("release", i)) - max(merged("arrive", i)))
        world_set = next(p["uid_world_set"][i] for p in parts if p["uid_world_set"][i] is not None)
        worlds.append(max(merged("uid_world", i)) - world_set)
        hosts.append(max(merged("uid_host", i)) - min(merged("uid_host_set", i)))
    joins = [j for p in parts for j in p["join"]]
    return {
        "join_s": max(j[1] for j in joins) - min(j[0] for j in joins),
        "barrier_s": statistics.median(barriers[1:]),
        "uid_world_s": statistics.median(worlds[1:]),
        "uid_host_s": statistics.median(hosts[1:]),
        "barrier_first_s": barriers[0],
        "rounds": num_rounds - 1,
        "barrier_rounds_s": [round(b, 6) for b in barriers[1:]],
        "uid_world_rounds_s": [round(w, 6) for w in worlds[1:]],
        "uid_host_rounds_s": [round(h, 6) for h in hosts[1:]],
    }
