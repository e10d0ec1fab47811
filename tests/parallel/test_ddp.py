"""DDP: N ranks on 1/N of the batch end where one process on the whole batch ends.

Three real worlds run every check of ``tests/_ddp_world.py``: 2 ranks on shared memory
(even batch), 3 ranks over gRPC (uneven batch, ``reduce_op="sum"``) and 4 ranks on two
fake hosts (hierarchical all-reduce). A third, traced,
shows bucket all-reduces running while backward is still going.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _ddp_world import CONFIGS, SpareMLP, check_ok, run_world, train_reference

import paramplane as pp
from paramplane.nn import CrossEntropyLoss, Linear, Parameter, ReLU, Sequential
from paramplane.optim import SGD
from paramplane.parallel.ddp import DDP
from paramplane.parallel.ddp_buckets import MIB, Bucket, assign_buckets, shard_range

# world size -> (env for every rank, per-rank env, global batch). World 3 runs on gRPC streams (lanes off: the
# path TLS uses); world 4 spans two fake hosts (2 host ids x 2 ranks), so its gradient all-reduces take the
# hierarchical path (shm + lanes).
WORLDS: dict[int, tuple[dict[str, str], Any, int]] = {
    2: ({}, None, 12),
    3: ({"PARAMPLANE_TRANSPORT": "grpc", "PARAMPLANE_TCP_LANE": "0"}, None, 13),
    4: ({"PARAMPLANE_TRANSPORT": "auto"}, lambda r: {"PARAMPLANE_HOST_ID": f"host{r // 2}"}, 16),
}


@pytest.fixture(scope="module", params=sorted(WORLDS), ids=lambda n: f"world{n}")
def world_run(request: Any, tmp_path_factory: Any) -> tuple[int, int, Path]:
    num_ranks = request.param
    env, rank_env, global_batch = WORLDS[num_ranks]
    out = tmp_path_factory.mktemp(f"ddp{num_ranks}")
    check_ok(run_world(num_ranks, "equiv", out, env=env, per_rank_env=rank_env))
    return num_ranks, global_batch, out


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_ranks_match_one_process(world_run: tuple[int, int, Path], cfg: tuple[Any, ...]) -> None:
    num_ranks, global_batch, out = world_run
    tol = 1e-6 if cfg[1] == np.float64 else 1e-4
    ref = train_reference(cfg, global_batch)
    start = SpareMLP(0, cfg[1]).state_dict()
    ranks = [np.load(out / f"rank{r}.npz") for r in range(num_ranks)]
    for key, want in ref.items():
        got0 = ranks[0][f"{cfg[0]}/{key}"]
        if key.startswith("net."):
            assert not np.allclose(want, start[key]), f"{key} did not train: the check would be vacuous"
        err = np.abs(got0 - want).max() / max(np.abs(want).max(), 1e-30)
        assert err <= tol, f"{cfg[0]} {key}: rel. error {err:.3g} against one process (tolerance {tol})"
        for r in range(1, num_ranks):
            np.testing.assert_array_equal(
                ranks[r][f"{cfg[0]}/{key}"], got0, err_msg=f"rank {r} differs: {key}"
            )


def test_bucket_all_reduce_overlaps_backward(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    check_ok(run_world(2, "overlap", tmp_path, env={"PARAMPLANE_TRACE": str(trace)}))
    for rank in range(2):
        events = json.loads((trace / f"rank-{rank}.json").read_text())["traceEvents"]
        backwards = [e for e in events if e["name"] == "backward"]
        first_layer_done = [e["ts"] for e in events if e["name"] == "grad 0.weight"]
        assert len(backwards) == 3 and len(first_layer_done) == 3
        # From the second step on (the first only learns the hook counts), buckets' all-reduces are issued
        # before the first layer's backward runs: counted by the engine, not timed, so busy cores cannot
        # make it flake (how much they overlap is benchmarks/ddp.py's to measure).
        issued = eval((tmp_path / f"issued{rank}.txt").read_text())
        for at_backward, at_first_layer in issued[1:]:
            assert at_first_layer > at_backward, (
                f"rank {rank}: no all-reduce issued during backward: {issued}"
            )
        buckets = eval((tmp_path / f"buckets{rank}.txt").read_text())
        assert buckets[0][0] == "8.bias" and buckets[-1][-1] == "0.weight", buckets


# -- single-rank world: the rules that need no peers ----------------------------------------------
def _mlp(seed: int = 0) -> Sequential:
    rng = np.random.default_rng(seed)
    return Sequential(Linear(4, 6, rng=rng), ReLU(), Linear(6, 3, rng=rng))


def test_second_backward_without_sync_is_an_error(solo: pp.World) -> None:
    ddp = DDP(_mlp(), solo.group, bucket_mb=25)
    crit = CrossEntropyLoss()
    x, y = np.ones((2, 4), np.float32), np.array([0, 1])
    for _ in range(2):  # the second round launches buckets during backward
        crit.forward(ddp.forward(x), y)
        ddp.backward(crit.backward())
        ddp.finish_gradient_sync()
    crit.forward(ddp.forward(x), y)
    ddp.backward(crit.backward())
    crit.forward(ddp.forward(x), y)
    with pytest.raises(RuntimeError, match="no_sync"):
        ddp.backward(crit.backward())


def test_finish_is_idempotent_and_attach_runs_it(solo: pp.World) -> None:
    model = _mlp()
    ddp = DDP(model, solo.group, reduce_op="sum")
    opt = SGD(ddp.parameters(), lr=0.1)
    handle = ddp.attach(opt)
    crit = CrossEntropyLoss()
    issued = solo.group._e.progress()[0]
    crit.forward(ddp.forward(np.ones((3, 4), np.float32)), np.array([0, 1, 2]))
    ddp.backward(crit.backward())
    grads = [p.grad.copy() for p in model.parameters()]
    opt.step()  # attach runs the sync before the update
    synced = solo.group._e.progress()[0]
    assert synced > issued, "no reduction was issued for the step"
    ddp.finish_gradient_sync()  # nothing left to do: no second reduction (one rank's sum would hide it)
    assert solo.group._e.progress()[0] == synced
    for p, g in zip(model.parameters(), grads):
        np.testing.assert_array_equal(p.grad, g)
    handle.remove()


def test_bad_arguments(solo: pp.World) -> None:
    with pytest.raises(ValueError, match="bucket_mb"):
        DDP(_mlp(), solo.group, bucket_mb=0)
    with pytest.raises(ValueError, match="reduce_op"):
        DDP(_mlp(), solo.group, reduce_op="max")
    with pytest.raises(ValueError, match="Module"):
        DDP(object(), solo.group)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="optimizer"):
        DDP(_mlp(), solo.group).attach(object())  # type: ignore[arg-type]


def test_shard_range_splits_like_array_split() -> None:
    for total, parts in ((13, 3), (12, 2), (5, 5), (100, 7)):
        sizes = [len(s) for s in np.array_split(np.arange(total), parts)]
        got = [shard_range(total, parts, i) for i in range(parts)]
        assert [b - a for a, b in got] == sizes
        assert got[0][0] == 0 and got[-1][1] == total
    with pytest.raises(ValueError, match="at least one"):
        shard_range(2, 3, 0)
    with pytest.raises(ValueError, match="index"):
        shard_range(10, 3, 3)


def test_buckets_reverse_order_by_dtype_and_size() -> None:
    params = [
        Parameter(np.zeros(1000, np.float32)),  # 4000 B
        Parameter(np.zeros(10, np.float64)),
        Parameter(np.zeros(500, np.float32)),  # 2000 B
        Parameter(np.zeros(600, np.float32)),  # 2400 B
        Parameter(np.zeros(3, np.float64)),
    ]
    # A bucket closes once it reaches the limit, keeping the parameter that reached it (torch's rule).
    assert assign_buckets(params, 4400) == [[4, 1], [3, 2], [0]]
    assert assign_buckets(params, 4401) == [[4, 1], [3, 2, 0]]
    assert assign_buckets(params, 25 * MIB) == [[4, 1], [3, 2, 0]]
    # A small first bucket per dtype, then the usual size.
    assert assign_buckets(params, 25 * MIB, first_bucket_bytes=2000) == [[4, 1], [3], [2, 0]]
    with pytest.raises(ValueError):
        assign_buckets(params, 0)
    with pytest.raises(ValueError):
        assign_buckets(params, MIB, first_bucket_bytes=0)


@pytest.mark.parametrize("limits", [(25 * MIB, MIB), (MIB, MIB), (3000, 800), (1, 1), (2000, 800, 5000)])
def test_buckets_are_torch_ddps(limits: tuple[int, ...]) -> None:
    """The assignment is torch DDP's (``_compute_bucket_assignment_by_size`` on the parameters in backward
    order, as DDP's reducer rebuilds its buckets after the first step), mixed dtypes included."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    rng = np.random.default_rng(0)
    dtypes = [np.float32, np.float32, np.float64, np.float16]
    arrays = [
        np.zeros(int(rng.integers(1, 400_000)) // rng.choice([1, 1000]) + 1, rng.choice(dtypes))
        for _ in range(40)
    ]
    if len(limits) == 2:
        bucket_bytes, first = limits
        torch_limits = [first, bucket_bytes] if first < bucket_bytes else [bucket_bytes]
    else:  # a limit per bucket (torch's bucket_cap_mb_list), the last one for the rest
        torch_limits = list(limits)
    in_backward_order = [torch.from_numpy(a) for a in reversed(arrays)]
    theirs, _ = dist._compute_bucket_assignment_by_size(
        in_backward_order, torch_limits, [False] * len(arrays)
    )
    last = len(arrays) - 1
    expected = [[last - j for j in bucket] for bucket in theirs]
    arrays_as_params = [Parameter(a) for a in arrays]
    got = (
        assign_buckets(arrays_as_params, bucket_bytes, first)
        if len(limits) == 2
        else assign_buckets(arrays_as_params, torch_limits)
    )
    assert got == expected
    assert len(got) > 3  # several buckets of each dtype: the comparison is not trivial


def test_default_buckets_start_with_a_small_one(solo: pp.World) -> None:
    """``bucket_mb=None`` (the default) is torch's: a 1 MiB first bucket, then 25 MiB; a given size holds from
    the first bucket."""
    rng = np.random.default_rng(0)
    layers: list[Any] = []
    for _ in range(8):
        layers += [Linear(1024, 1024, rng=rng), ReLU()]  # 4 MiB weights
    model = Sequential(*layers[:-1])
    names = [[n.split(".")[0] for n in b] for b in DDP(model, solo.group).bucket_params()]
    # The last layer's bias and weight reach 1 MiB; the other seven layers' weights (28 MiB) pass 25 MiB only
    # with the first layer's.
    assert names == [
        ["14", "14"],
        ["12"] * 2 + ["10"] * 2 + ["8"] * 2 + ["6"] * 2 + ["4"] * 2 + ["2"] * 2 + ["0"] * 2,
    ]
    assert len(DDP(model, solo.group, bucket_mb=4).bucket_params()) == 8


@pytest.mark.parametrize("mode", ["mismatch", "sum_untouched", "buffers"])
def test_ddp_edges(mode: str) -> None:
    """Ranks wrapping different models fail at wrap time; a "sum" reduction keeps an untouched gradient; buffers
    follow rank 0 on training forwards only outside no_sync."""
    from _world import run_world

    world = run_world(2, "ddp_edges.py", args=[mode], env={"PARAMPLANE_TIMEOUT": "30"}, timeout=60)
    world.check_ok(min_checks=2)


def test_ddp_gradient_compression_moves_half_precision_and_stays_close() -> None:
    from _world import run_world

    world = run_world(2, "ddp_compress.py", env={"PARAMPLANE_TIMEOUT": "30"}, timeout=90)
    assert all(r["num_checks"] >= 10 for r in world.check_ok())


_RELEASE_PROBE = """
import numpy as np
from paramplane.parallel.ddp_buckets import release_freed_memory

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

blocks = [np.ones(8192) for _ in range(1600)]  # 64 KiB each (heap blocks, below glibc's mmap threshold)
keep = blocks.pop()  # the newest block pins the heap's top: freeing the rest leaves its pages resident
del blocks
held = rss()
print(release_freed_memory(), held - rss(), float(keep.sum()))
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads Linux's /proc")
def test_release_freed_memory_returns_heap_pages_a_temporary_left_resident() -> None:
    """What DDP calls after its wrap-time broadcast: freed heap memory (here ~100 MB of 64 KiB blocks below a
    live one, which glibc's own trimming at the heap's top never reaches) leaves the resident set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", _RELEASE_PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    if out[0] != "True":
        pytest.skip("the C library has no malloc_trim (not glibc)")
    assert int(out[1]) > 60 * MIB, f"released {int(out[1]) / MIB:.1f} MiB of ~100"


def _vma_flags(address: int) -> list[str]:
    """The kernel's VmFlags of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_host_buckets_are_made_without_huge_pages() -> None:
    """A host bucket's buffer, made anew each step, asks the kernel for no transparent huge pages (numpy asks
    for them at 4 MiB and more; their faults made pp.DDP's CPU per step 1.2x torch DDP's, torch_models.py)."""
    from paramplane.parallel.ddp_buckets import host_buffer

    big = host_buffer(4 * MIB, np.float32)  # 16 MiB
    assert big.shape == (4 * MIB,) and big.dtype == np.float32
    inner = -(-big.ctypes.data // (2 * MIB)) * (2 * MIB)  # a huge-page-aligned address inside it
    assert "nh" in _vma_flags(inner)
    plain = np.empty(4 * MIB, np.float32)
    assert "nh" not in _vma_flags(-(-plain.ctypes.data // (2 * MIB)) * (2 * MIB))
    bucket = Bucket.build(0, [0], [Parameter(np.zeros(4 * MIB, np.float32))])
    assert not bucket.flat.any()
    bucket.hand_over()
    assert "nh" in _vma_flags(-(-bucket.flat.ctypes.data // (2 * MIB)) * (2 * MIB))
