"""Fuzzing at scale: thousands of random and mutated requests at a coordinator process, and the memory it holds.

    python benchmarks/robustness.py [--calls 10000] [--out benchmarks/results/robustness.jsonl]

A coordinator runs as its own process (``paramplane coordinator``, port 0, a token). One client sends
``--calls`` requests in rounds: random bytes and mutated protobufs to every unary method, half with a bad
token; every answer must be a proper status (never UNKNOWN), counted by code. The coordinator's resident
memory (VmRSS) is read after a warm-up round and after each round: a leak shows as growth that keeps
rising with the calls. Last, a well-formed Status must still answer. One JSON line per round.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc

from paramplane.benchmarks._fuzz import COORD, MESSAGES, UNARY, call, mutated
from paramplane.benchmarks._jsonl import emit
from paramplane.protos import coordinator_pb2
from paramplane.protos.auth import token_metadata

TOKEN = "robustness-token"


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _round(channel: grpc.Channel, rng: random.Random, num_calls: int, codes: Counter[str]) -> None:
    good, bad = token_metadata(TOKEN), token_metadata(TOKEN + "x")
    for i in range(num_calls):
        method = rng.choice(UNARY)
        payload = (
            mutated(rng, MESSAGES[method])
            if i % 2 and method in MESSAGES
            else rng.randbytes(rng.randrange(300))
        )
        codes[call(channel, method, payload, bad if i % 4 == 3 else good, timeout=10).name] += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=20261122)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    per_round = max(1, args.calls // args.rounds)
    lines = []
    with tempfile.TemporaryDirectory(prefix="pp-robust-") as scratch:
        token_file, port_file = Path(scratch) / "token", Path(scratch) / "port"
        token_file.write_text(TOKEN)
        cmd = [sys.executable, "-m", "paramplane.cli", "coordinator", "--host", "127.0.0.1", "--port", "0"]
        cmd += ["--world-size", "2", "--token-file", str(token_file), "--port-file", str(port_file)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while not (port_file.exists() and port_file.read_text().strip()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the coordinator did not start")
                time.sleep(0.05)
            address = f"127.0.0.1:{port_file.read_text().strip()}"
            with grpc.insecure_channel(address) as channel:
                codes: Counter[str] = Counter()
                _round(channel, rng, min(500, per_round), codes)  # warm-up: caches, allocator arenas
                base = _rss_kib(proc.pid)
                sent = 0
                for r in range(args.rounds):
                    start = time.perf_counter()
                    _round(channel, rng, per_round, codes)
                    sent += per_round
                    rss = _rss_kib(proc.pid)
                    lines.append(
                        json.dumps(
                            {
                                "bench": "robustness",
                                "target": "coordinator",
                                "round": r,
                                "calls": sent,
                                "calls_per_s": per_round / (time.perf_counter() - start),
                                "rss_base_kib": base,
                                "rss_kib": rss,
                                "growth_kib": rss - base,
                                "codes": dict(codes),
                            }
                        )
                    )
                status = channel.unary_unary(
                    COORD + "Status",
                    request_serializer=coordinator_pb2.StatusRequest.SerializeToString,
                    response_deserializer=coordinator_pb2.StatusResponse.FromString,
                )
                status(coordinator_pb2.StatusRequest(), metadata=token_metadata(TOKEN), timeout=10)
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
