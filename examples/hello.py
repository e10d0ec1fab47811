"""Hello, world: every rank says who it is, then all ranks meet at a barrier.

Run it on one host with four ranks and an embedded coordinator:

    paramplane launch --standalone -n 4 examples/hello.py
"""

from __future__ import annotations

import socket

import paramplane as pp


def main() -> None:
    world = pp.init()  # reads PARAMPLANE_COORDINATOR, _TOKEN, ... set by `paramplane launch`
    try:
        print(
            f"rank {world.rank}/{world.world_size} local_rank {world.local_rank} "
            f"node_rank {world.node_rank} host {socket.gethostname()}"
        )
        world.group.barrier()  # nobody leaves before everyone has said hello
    finally:
        world.shutdown()


if __name__ == "__main__":
    main()
