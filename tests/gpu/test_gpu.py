"""NCCL transport on cupy arrays (skipped where cupy finds no CUDA device)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from paramplane.node.arrays import cupy_module

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cupy_module() is None, reason="cupy finds no CUDA device")]


@pytest.mark.timeout(180)  # its own bounds (120 s), not the global 120 s
def test_collectives_on_cupy_two_ranks(tmp_path: Path) -> None:
    from paramplane import local_world

    cupy = cupy_module()
    assert cupy is not None
    worker = str(Path(__file__).with_name("_gpu_worker.py"))
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    world = local_world.run_world(2, lambda r: [sys.executable, worker, str(outs[r])], timeout_s=120)
    assert not world.timed_out and all(r.returncode == 0 for r in world.ranks), [
        r.output for r in world.ranks
    ]
    for out in outs:
        result = json.loads(out.read_text())
        assert len(result) == 41, result
        assert all(result.values()), [k for k, ok in result.items() if not ok]


@pytest.mark.timeout(360)  # its own bounds (300 s), not the global 120 s
def test_fsdp_on_cupy_with_nccl() -> None:
    """FSDP full_shard on cupy arrays (float32, float16 mixed precision, CPU offload) and DDP, two ranks (one GPU each, or
    two ranks sharing one GPU, which world.use_gpu arranges)."""
    from _world import run_world

    cupy = cupy_module()
    assert cupy is not None
    world = run_world(2, "fsdp_gpu.py", env={"PARAMPLANE_TIMEOUT": "120"}, timeout=300)
    results = world.check_ok()
    assert all(r["num_checks"] >= 20 for r in results)


@pytest.mark.timeout(360)  # its own bounds (300 s), not the global 120 s
def test_hybrid_shard_on_cupy_across_two_hosts() -> None:
    """hybrid_shard on cupy over two emulated hosts of two ranks: NCCL shards inside a host, the
    replicas all-reduce across hosts over gRPC (staged through host memory)."""
    from _world import run_world

    rank_env = {r: {"PARAMPLANE_HOST_ID": f"gpu-host-{r // 2}"} for r in range(4)}
    world = run_world(
        4,
        "fsdp_gpu.py",
        args=["hybrid_shard"],
        env={"PARAMPLANE_TIMEOUT": "120", "NCCL_SOCKET_IFNAME": "lo"},
        rank_env=rank_env,
        timeout=300,
    )
    results = world.check_ok()
    assert all(r["num_checks"] >= 12 for r in results)


@pytest.mark.timeout(210)  # its own bounds (150 s), not the global 120 s
def test_nccl_work_behind_a_dead_peer_is_released() -> None:
    """A peer dies while an NCCL all_reduce waits for it: the world's NCCL communicators are aborted, the
    stream returns, and the next op raises PeerLost (no hang)."""
    from _world import run_world

    world = run_world(
        2,
        "nccl_abort.py",
        env={"PARAMPLANE_TIMEOUT": "120"},
        heartbeat_timeout_s=3.0,
        heartbeat_interval_s=0.5,
        timeout=150,
    )
    assert not world.timed_out, world.describe()
    assert world.ranks[1].returncode == -9, world.describe()
    r0 = world.ranks[0].result
    assert r0 is not None and r0["failures"] == [] and r0["num_checks"] == 3, world.describe()


def _torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.timeout(360)  # its own bounds (300 s), not the global 120 s
@pytest.mark.skipif(not _torch_cuda(), reason="needs torch's CUDA build")
def test_torch_cuda_modules_under_ddp_and_fsdp() -> None:
    """pp.DDP and every FSDP strategy over a torch module on CUDA (two ranks, NCCL inside the host): the
    standard loop with clipping equals one process on the whole batch on the GPU, the optimizer's parameters
    stay on the device."""
    from _world import run_world

    kinds = ["ddp", "full_shard", "shard_grad_op", "no_shard"]
    world = run_world(2, "torch_gpu.py", args=kinds, env={"PARAMPLANE_TIMEOUT": "120"}, timeout=300)
    results = world.check_ok()
    assert all(r["num_checks"] >= len(kinds) * 5 for r in results), [r["num_checks"] for r in results]


@pytest.mark.timeout(360)  # its own bounds (300 s), not the global 120 s
@pytest.mark.skipif(not _torch_cuda(), reason="needs torch's CUDA build")
def test_torch_cuda_module_under_hybrid_shard_across_two_hosts() -> None:
    """hybrid_shard over a torch CUDA module on two emulated hosts of two ranks: NCCL shards inside a host,
    replicas all-reduce across hosts."""
    from _world import run_world

    rank_env = {r: {"PARAMPLANE_HOST_ID": f"gpu-host-{r // 2}"} for r in range(4)}
    world = run_world(
        4,
        "torch_gpu.py",
        args=["hybrid_shard"],
        env={"PARAMPLANE_TIMEOUT": "120", "NCCL_SOCKET_IFNAME": "lo"},
        rank_env=rank_env,
        timeout=300,
    )
    results = world.check_ok()
    assert all(r["num_checks"] >= 5 for r in results), [r["num_checks"] for r in results]


@pytest.mark.timeout(360)  # its own bounds (300 s), not the global 120 s
@pytest.mark.skipif(not _torch_cuda(), reason="needs torch's CUDA build")
def test_torch_distributed_calls_on_cuda_tensors_over_the_backend() -> None:
    """``dist.*`` on CUDA tensors after ``pp.init_torch_distributed`` (NCCL inside the host, host staging for
    all_to_all), and torch's own DDP on a CUDA module over the backend, equal to one process."""
    from _world import run_world

    world = run_world(2, "torch_dist_gpu.py", env={"PARAMPLANE_TIMEOUT": "120"}, timeout=300)
    world.check_ok(min_checks=9)
