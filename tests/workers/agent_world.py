"""A rank under ``paramplane launch`` with host agents: train, then wait for the test's word or a failure.

argv: DIR MODE. Trains a few all-reduce steps with a world barrier and a group's unique-id fan-out (KV), prints
``trained`` then, per MODE: ``finish`` waits for DIR/finish and exits; ``kill3`` has rank 3 SIGKILL itself
while the others keep reducing until they fail; ``run`` keeps reducing until it fails (the test kills a
launcher). A failure prints ``failed <type> rank=<named rank>: <message>`` and exits 3.
"""

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import paramplane as pp
from paramplane.node.errors import PlaneError

folder, mode = Path(sys.argv[1]), sys.argv[2]
world = pp.init()
try:
    for step in range(5):
        out = world.group.all_reduce(np.full(4, float(world.rank + 1 + step)))
        assert np.allclose(out, sum(r + 1 + step for r in range(world.world_size))), out
    world.barrier("trained")
    pair = world.new_group([0, 1])  # its unique id goes through the KV store (waiting gets)
    if pair is not None:
        assert np.allclose(pair.all_reduce(np.ones(2)), 2.0)
    print(f"trained rank={world.rank}", flush=True)
    deadline = time.monotonic() + 90
    if mode == "finish":
        while not (folder / "finish").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    elif mode == "kill3" and world.rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        while time.monotonic() < deadline:
            world.group.all_reduce(np.ones(4))
            time.sleep(0.05)
except PlaneError as e:
    first = str(e).splitlines()[0] if str(e) else ""
    print(f"failed {type(e).__name__} rank={getattr(e, 'rank', None)}: {first}", flush=True)
    os._exit(3)
world.shutdown()
