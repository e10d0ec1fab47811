"""Rank 1's script dies of an exception while rank 0 waits for a message from it (argv[1]).

with      the exception leaves ``with pp.init()``
uncaught  the script called ``pp.init()`` without ``with``; the exception reaches ``sys.excepthook``
finally   as the examples do: ``world.shutdown()`` in a ``finally`` while the exception propagates
clean     no exception: rank 1's script ends without sending what rank 0 waits for

Rank 0 must fail with WorldAborted naming the exception (clean: PeerLost naming rank 1), long before its
group timeout, rather than wait for a rank that is gone without being lost (it left the world on its way out).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp


def wait_for_rank_1(world: Any, rep: Report) -> None:
    if sys.argv[1] == "clean":
        started = time.monotonic()
        rep.raises(
            "a peer that left without sending is named",
            pp.PeerLost,
            lambda: world.group.recv_array(1),
            "rank 1 left the world without sending anything more on group",
        )
        # Rank 1 leaves as the world forms and has nothing to flush: 1 s after its leaving, with slack for a
        # busy machine (it was 15 s when a rank left before flushing and its peers allowed for that).
        waited = time.monotonic() - started
        rep.check("the receive failed soon after rank 1 left", waited < 8.0, f"after {waited:.1f} s")
        return
    rep.raises(
        "a crashed peer's exception reaches the rank waiting for it",
        pp.WorldAborted,
        lambda: world.group.recv_array(1),
        "rank 1 exited with ValueError: bad batch at step 3",
    )


if __name__ == "__main__":
    if os.environ["PARAMPLANE_RANK"] != "1":
        run_rank(wait_for_rank_1)
    elif sys.argv[1] == "clean":
        with pp.init():
            pass
    elif sys.argv[1] == "with":
        with pp.init():
            raise ValueError("bad batch at step 3")
    elif sys.argv[1] == "finally":
        world = pp.init()
        try:
            raise ValueError("bad batch at step 3")
        finally:
            world.shutdown()
    else:
        world = pp.init()
        raise ValueError("bad batch at step 3")
