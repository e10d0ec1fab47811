"""``paramplane demo --diloco``: examples/train_diloco.py on two emulated hosts of 2 ranks each.

An embedded coordinator on 127.0.0.1 and one ``paramplane launch -n 2 --coordinator ... --host-id ...``
per host: ranks of one host talk over shared memory, the hosts over TCP on loopback, as two machines would.
"""

from __future__ import annotations

import subprocess
import sys
import time

from paramplane.demo import DILOCO_EXAMPLE

HOSTS = ("demo-host-a", "demo-host-b")
RANKS_PER_HOST = 2


def run(steps: int, sync_every: int, timeout: float) -> int:
    """Train; returns 0 when every rank of both hosts finished."""
    if not DILOCO_EXAMPLE.is_file():
        print(f"paramplane demo: {DILOCO_EXAMPLE} is missing from this installation", file=sys.stderr)
        return 1
    from paramplane.coordinator.server import CoordinatorConfig, CoordinatorThread

    world = RANKS_PER_HOST * len(HOSTS)
    coord = CoordinatorThread(CoordinatorConfig(world_size=world, host="127.0.0.1", port=0))
    address = coord.start()
    print(
        f"paramplane demo: DiLoCo every {sync_every} steps across {len(HOSTS)} emulated hosts "
        f"of {RANKS_PER_HOST} ranks (FSDP inside a host)",
        flush=True,
    )
    started = time.monotonic()
    launchers: list[subprocess.Popen[bytes]] = []
    try:
        for host in HOSTS:
            cmd = [sys.executable, "-m", "paramplane.cli", "launch", "-n", str(RANKS_PER_HOST)]
            cmd += ["--coordinator", address, "--world-size", str(world), "--host-id", host]
            cmd += ["--timeout", str(timeout), "--no-prefix", str(DILOCO_EXAMPLE)]
            cmd += ["--steps", str(steps), "--sync-every", str(sync_every)]
            launchers.append(subprocess.Popen(cmd))
        deadline = started + timeout + 60
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in launchers]
    except subprocess.TimeoutExpired:
        print("paramplane demo: the hosts did not finish in time", file=sys.stderr)
        codes = [1]
    finally:
        for p in launchers:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
        coord.stop()
    code = max(codes)
    if code == 0:
        print(f"paramplane demo: done in {time.monotonic() - started:.1f} s", flush=True)
    return code
