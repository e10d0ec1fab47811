"""Two hosts for real: ranks in two network namespaces joined by a veth pair.

Traffic between the hosts crosses an interface (not loopback): the coordinator
and two ranks live in namespace A, two ranks in namespace B, every rank binds
its namespace's address, and the job token is required because nothing binds
loopback. Skipped where ``ip netns`` is unavailable (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _world import listening_port

WORKERS = Path(__file__).resolve().parents[1] / "workers"
pytestmark = pytest.mark.netns


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def two_hosts() -> Iterator[tuple[tuple[str, str], tuple[str, str]]]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for ip netns")
    tag = f"pp{os.getpid() % 100000}"
    subnet = f"10.213.{random.randrange(1, 250)}"
    hosts = ((f"{tag}a", f"{subnet}.1"), (f"{tag}b", f"{subnet}.2"))
    try:
        _ip("netns", "add", hosts[0][0])
        _ip("netns", "add", hosts[1][0])
    except (subprocess.CalledProcessError, OSError) as exc:
        for ns, _ in hosts:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        pytest.skip(f"ip netns unavailable here: {exc}")
    try:
        _ip("link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb")
        for (ns, addr), dev in zip(hosts, (f"{tag}va", f"{tag}vb")):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for ns, _ in hosts:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


@pytest.mark.timeout(180)  # its own bounds (120 s), not the global 120 s
def test_hierarchical_all_reduce_across_namespaces(
    tmp_path: Path, two_hosts: tuple[tuple[str, str], ...]
) -> None:
    (ns_a, addr_a), (ns_b, addr_b) = two_hosts
    token = secrets.token_hex(16)
    base = dict(os.environ, PARAMPLANE_TOKEN=token, PYTHONUNBUFFERED="1")
    base.pop("PARAMPLANE_TRANSPORT", None)
    coordinator = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            ns_a,
            sys.executable,
            "-m",
            "paramplane.coordinator",
            "--host",
            addr_a,
            "--port",
            "0",
            "--world-size",
            "4",
            "--heartbeat-timeout",
            "5",
        ],
        env=base,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    ranks: list[subprocess.Popen[bytes]] = []
    try:
        port = listening_port(coordinator, time.monotonic() + 30)
        for r in range(4):
            ns, addr, host = (ns_a, addr_a, "hostA") if r < 2 else (ns_b, addr_b, "hostB")
            env = dict(
                base,
                PARAMPLANE_COORDINATOR=f"{addr_a}:{port}",
                PARAMPLANE_RANK=str(r),
                PARAMPLANE_WORLD_SIZE="4",
                PARAMPLANE_HOST_ID=host,
                PARAMPLANE_BIND=addr,
                PARAMPLANE_TIMEOUT="60",
                PARAMPLANE_TEST_OUT=str(tmp_path),
            )
            ranks.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", ns, sys.executable, str(WORKERS / "hierarchy.py")],
                    env=env,
                    cwd=WORKERS,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
            )
        outputs = []
        for p in ranks:
            out, _ = p.communicate(timeout=120)
            outputs.append(out.decode(errors="replace"))
        for r, p in enumerate(ranks):
            assert p.returncode == 0, f"rank {r} failed:\n{outputs[r][-4000:]}"
    finally:
        for p in [*ranks, coordinator]:
            if p.poll() is None:
                p.kill()
            p.wait(10)
    results = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(4)]
    for r, res in enumerate(results):
        assert res.get("failures", []) == [], f"rank {r}: {res.get('failures')}"
        assert res["values"]["host_id"] == ("hostA" if r < 2 else "hostB")
    assert results[0]["digests"], "no results to compare"
    assert len({json.dumps(res["digests"], sort_keys=True) for res in results}) == 1, (
        "ranks disagree on results"
    )
