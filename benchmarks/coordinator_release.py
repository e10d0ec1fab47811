"""The coordinator's own cost of a barrier release, in process: no network, no simulated ranks.

A world of ``hosts`` x ``per_host`` ranks is formed in a ``CoordinatorState``; each host is a host-lane session
of the real ``HostStreams`` (its answers written to a stand-in connection that serializes them). Every round,
each host's arrivals come as one ``HostCall``; the figure is the time the coordinator takes to handle the last
host's call, which releases everyone: the state's release, the waiter groups settled and one answer per host
written. ``control_plane.py`` measures the whole path with processes and sockets; this isolates the part that
grows with the world on the coordinator's one core. JSON lines: median and 90th percentile over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from paramplane.benchmarks._jsonl import emit
from paramplane.coordinator.model import Joiner
from paramplane.coordinator.service import CoordinatorService
from paramplane.coordinator.state import CoordinatorState
from paramplane.protos import coordinator_pb2 as pb


class _Lane:
    """A host lane's context as ``HostStreams`` uses it: answers are serialized, as a socket write would."""

    def __init__(self) -> None:
        self.answers = 0

    def send(self, answer: pb.HostAnswer) -> None:
        answer.SerializeToString()
        self.answers += 1

    async def write(self, answer: pb.HostAnswer) -> None:
        self.send(answer)


async def release_cost(hosts: int, per_host: int, rounds: int) -> dict[str, Any]:
    n = hosts * per_host
    state = CoordinatorState(n, join_timeout_s=600, heartbeat_timeout_s=600, progress_timeout_s=0)
    for r in range(n):
        joiner = Joiner(f"sim-{r}", f"host-{r // per_host}", f"10.0.0.1:{7000 + r}", r, n, 1000 + r)
        state.join(joiner, waiter=-1 - r, now=time.monotonic())
    state.take_effects()
    service = CoordinatorService(state, heartbeat_interval_s=1.0, heartbeat_timeout_s=600)
    streams = service.host_streams
    lanes = [_Lane() for _ in range(hosts)]
    sessions = [streams.open_lane(f"session-{h}", lanes[h]) for h in range(hosts)]
    times = []
    for i in range(rounds + 1):
        for h in range(hosts):
            call = pb.HostCall(
                call_id=i + 1,
                barrier=pb.BarrierHostRequest(
                    epoch=state.epoch,
                    name=f"round-{i}",
                    arriving=range(h * per_host, (h + 1) * per_host),
                    timeout_s=60,
                ),
            )
            before = [lane.answers for lane in lanes]
            start = time.perf_counter()
            streams.take(sessions[h], lanes[h], call)
            took = time.perf_counter() - start
        if [lane.answers - b for lane, b in zip(lanes, before, strict=True)] != [1] * hosts:
            raise RuntimeError("the last host's arrivals did not release every host at once")
        if i:
            times.append(took)
        await asyncio.sleep(0)  # the calls' tasks end
    times.sort()
    return {
        "bench": "coordinator_release",
        "world_size": n,
        "hosts": hosts,
        "release_s_median": statistics.median(times),
        "release_s_p90": times[int(0.9 * (len(times) - 1))],
        "rounds": rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--per-host", type=int, nargs="+", default=[8, 64], help="ranks per host")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--label", default="", help="kept in each row (e.g. which code ran)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lines = []
    for hosts in args.hosts:
        for per_host in args.per_host:
            row = asyncio.run(release_cost(hosts, per_host, args.rounds))
            lines.append(json.dumps({**row, "label": args.label}))
    emit(lines, args.out)


if __name__ == "__main__":
    main()
