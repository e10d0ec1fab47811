"""FSDP in real multi-process worlds: every strategy equals one process on the whole batch.

The workers (tests/workers/fsdp.py) check losses, every parameter after several steps
(float64 within 1e-10 relative, float32 within 2e-5), collective counts per step, no
communication inside no_sync, clip_grad_norm_ against the single-process norm, a
state_dict round trip, and that parameters hold no memory between uses.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from _world import run_world

HOSTS = {0: "hostA", 1: "hostA", 2: "hostB", 3: "hostB"}


def _run(
    n: int,
    args: list[str],
    target: str = "fsdp.py",
    min_checks: int = 20,
    env: dict[str, str] | None = None,
    **kw: object,
) -> list[dict[str, object]]:
    env = {"PARAMPLANE_TIMEOUT": "60", **(env or {})}
    world = run_world(n, target, args=args, env=env, timeout=240, **kw)  # type: ignore[arg-type]
    results = world.check_ok()
    assert all(int(r["num_checks"]) >= min_checks for r in results), [r["num_checks"] for r in results]  # type: ignore[call-overload]
    assert world.shm_leaks() == set()
    return results


def test_every_strategy_world_2() -> None:
    _run(2, ["full_shard,shard_grad_op,no_shard"])


@pytest.mark.slow
def test_full_shard_and_no_shard_world_4() -> None:
    _run(4, ["full_shard,no_shard", "--quick"])


def test_hybrid_strategies_on_two_hosts() -> None:
    """2 fake hosts x 2 ranks: shard inside a host (shm), replicate across hosts (gRPC). hybrid_shard also with
    AdamW, no_sync accumulation, clipping by the 2-norm and the inf-norm, and float32; hybrid_shard_zero2 with SGD."""
    rank_env = {r: {"PARAMPLANE_HOST_ID": h} for r, h in HOSTS.items()}
    _run(4, ["hybrid_shard"], rank_env=rank_env, min_checks=80)
    _run(4, ["hybrid_shard_zero2", "--quick"], rank_env=rank_env)


@pytest.mark.timeout(300)  # its own bounds (240 s), not the global 120 s
def test_hybrid_shard_across_hosts_on_grpc_streams() -> None:
    """The same across hosts with lanes off: the replicas' all-reduces ride gRPC streams (the path TLS uses)."""
    _run(
        4,
        ["hybrid_shard", "--quick"],
        env={"PARAMPLANE_TCP_LANE": "0"},
        rank_env={r: {"PARAMPLANE_HOST_ID": h} for r, h in HOSTS.items()},
    )


def test_errors_sharded_state_summon_and_mixed_precision() -> None:
    results = _run(2, ["basics"], target="fsdp_extras.py")
    assert all(float(r["values"]["mp_relative_loss_gap"]) < 3e-2 for r in results)  # type: ignore[index]


def test_full_shard_memory_is_measured_and_sharded() -> None:
    results = _run(4, ["memory"], target="fsdp_extras.py", min_checks=6)
    for r in results:
        mem = r["values"]["memory"]  # type: ignore[index]
        assert mem["peak"] <= mem["bound"], mem


def _overlaps(trace: Path, rank: int) -> dict[str, int]:
    """All-gathers that started while a unit's forward or backward computed, per pass."""
    events = json.loads((trace / f"rank-{rank}.json").read_text())["traceEvents"]
    gathers = [e for e in events if e.get("name") == "all_gather"]
    spans = [e for e in events if str(e.get("name", "")).startswith("fsdp ")]
    out = {"forward": 0, "backward": 0}
    for span in spans:
        kind = span["name"].split()[1]
        lo, hi = span["ts"], span["ts"] + span["dur"]
        out[kind] += sum(1 for g in gathers if lo < g["ts"] < hi)
    assert spans, "no FSDP compute spans traced"
    return out


def test_prefetch_overlaps_the_next_gather_with_compute(tmp_path: Path) -> None:
    """With prefetch each unit's compute starts with the next unit's gather already issued (counted by the
    engine, not timed: busy cores cannot flake it; benchmarks/fsdp.py measures what the overlap buys);
    without it every gather finishes before its unit computes. The gradients agree."""
    grads, issued = {}, {}
    for mode in ("on", "off"):
        trace = tmp_path / mode
        world = run_world(
            2,
            "fsdp_extras.py",
            args=["prefetch", mode],
            env={"PARAMPLANE_TIMEOUT": "60", "PARAMPLANE_TRACE": str(trace)},
            timeout=120,
        )
        results = world.check_ok(min_checks=1)
        grads[mode] = [r["values"]["grads"] for r in results]
        issued[mode] = [r["values"]["issued"] for r in results]
        if mode == "off":
            for rank in range(2):
                assert _overlaps(trace, rank) == {"forward": 0, "backward": 0}
    for rank in range(2):
        for kind in ("forward", "backward"):
            on, off = issued["on"][rank][kind], issued["off"][rank][kind]
            ahead = [a - b for a, b in zip(on, off)]
            # Four layers, two steps: every layer but the pass's last computes with the next gather in flight.
            assert len(on) == len(off) == 8 and set(ahead) == {0, 1} and ahead.count(1) == 6, (kind, on, off)
    assert grads["on"] == grads["off"], "prefetch changed the gradients"


def test_cpu_offload_moves_data_as_documented_without_a_gpu() -> None:
    """Offload on a recording device module: shards, gradients and optimizer state on the host, gathered
    parameters and outputs on the 'device', one host-to-device copy per shard per gather, same training."""
    world = run_world(2, "fsdp_offload.py", env={"PARAMPLANE_TIMEOUT": "60"}, timeout=120)
    results = world.check_ok()
    assert all(r["num_checks"] >= 30 for r in results), [r["num_checks"] for r in results]


def _fixed(scenario: str, min_checks: int, torch_checks: int = 0) -> None:
    """``min_checks`` checks without torch, and ``torch_checks`` more of the torch wrapper where it is installed."""
    results = _run(2, [scenario], target="fsdp_edges.py", min_checks=min_checks)
    if torch_checks and importlib.util.find_spec("torch") is not None:
        counts = [r["values"].get("torch_checks", 0) for r in results]  # type: ignore[attr-defined]
        assert all(c >= torch_checks for c in counts), counts


def test_prefetched_gathers_never_outlive_an_optimizer_step() -> None:
    """A unit skipped in some steps, or called in another order than registered (native and torch): training
    with prefetch equals one process, and no gather is pending after opt.step()."""
    _fixed("prefetch", 64, torch_checks=8)


def test_frozen_parameters_are_in_every_state_dict_and_checkpoint() -> None:
    _fixed("frozen", 19, torch_checks=12)


def test_sync_module_states_broadcasts_buffers_and_frozen_parameters() -> None:
    _fixed("sync", 9, torch_checks=10)


def test_mixed_precision_casts_inputs_to_param_dtype() -> None:
    _fixed("mixed", 9)
