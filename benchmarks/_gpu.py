"""What a peer's ranks need to share GPUs the way paramplane's ranks do (benchmarks on one GPU)."""

from __future__ import annotations

from collections.abc import Callable


def peer_rank_env(impl: str, num_ranks: int, num_gpus: int) -> Callable[[int], dict[str, str]]:
    """Per-rank environment for ``impl``'s ranks. Where ranks outnumber GPUs, NCCL refuses two ranks of one
    communicator on one device unless each names another host (``NCCL_HOSTID``; its socket transport on
    ``lo`` then joins them): paramplane's runtime sets exactly this for its own ranks, so a peer gets the
    same and all run the same NCCL transport. Nothing is set otherwise."""
    shared = num_gpus < num_ranks

    def rank_env(rank: int) -> dict[str, str]:
        if impl == "paramplane" or not shared:
            return {}
        return {"NCCL_HOSTID": f"bench-rank{rank}", "NCCL_SOCKET_IFNAME": "lo"}

    return rank_env
