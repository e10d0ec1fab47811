"""benchmarks/collectives.py: a --quick run emits well-formed, self-consistent JSON lines; its arithmetic."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "collectives.py"
ROW_KEYS = {"bench", "impl", "transport", "op", "world_size", "bytes", "p50_us", "algbw_GBps", "busbw_GBps"}


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_collectives", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _load()


def _run(*args: str, timeout: float = 90.0) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    return proc, lines


def _check_row(row: dict[str, Any]) -> None:
    assert row.keys() >= ROW_KEYS
    assert row["p50_us"] > 0 and row["algbw_GBps"] > 0 and row["busbw_GBps"] > 0
    # algbw is bytes over the median time, busbw the nccl-tests factor times algbw (both rounded on output)
    assert row["algbw_GBps"] == pytest.approx(row["bytes"] / (row["p50_us"] * 1e-6) / 1e9, rel=2e-3)
    factor = bench.bus_factor(row["op"], row["world_size"])
    assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * factor, rel=2e-3)


def test_quick_run_emits_one_valid_row_per_case(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    _, lines = _run("--quick", "--no-gloo", "--no-rawtcp", "--out", str(out))
    rows = [r for r in lines if r["bench"] == "collectives"]
    for row in rows:
        _check_row(row)
        assert row["impl"] == "paramplane" and row["world_size"] == 2
        # Both ways of timing a small message: back to back (the p50) and each call after a barrier.
        assert row["hot_p50_us"] == row["p50_us"] and row["cold_p50_us"] > 0
    cases = {(r["transport"], r["op"], r["bytes"]) for r in rows}
    expected = {
        (t, op, size) for t in bench.DEFAULT_TRANSPORTS for op in bench.OPS for size in bench.QUICK_SIZES
    }
    assert cases == expected and len(rows) == len(expected)
    assert [json.loads(line) for line in out.read_text().splitlines()] == lines


@pytest.mark.skipif(not bench.torch_available(), reason="torch.distributed not installed")
def test_quick_run_with_gloo_adds_peer_rows_and_ratios() -> None:
    _, lines = _run(
        "--quick", "--transports", "shm", "--ops", "all_reduce", "--sizes", "4K", "--torch-backend"
    )
    rows = {r["impl"]: r for r in lines if r["bench"] == "collectives"}
    assert set(rows) == {"paramplane", "paramplane-torch", "gloo", "rawtcp"}
    for row in rows.values():
        _check_row(row)
    assert (
        rows["paramplane-torch"]["transport"] == "shm"
    )  # gloo's calls, over the backend on paramplane's shm
    summaries = {r["impl"]: r for r in lines if r["bench"] == "collectives_summary"}
    assert set(summaries) == {"paramplane", "paramplane-torch"}
    summary = summaries["paramplane"]
    pp, gloo, raw = rows["paramplane"], rows["gloo"], rows["rawtcp"]
    # Rows are rounded to 4 significant digits, the ratios computed before rounding.
    assert summary["busbw_vs_gloo"] == pytest.approx(pp["busbw_GBps"] / gloo["busbw_GBps"], rel=1e-2)
    assert summary["p50_vs_gloo"] == pytest.approx(pp["p50_us"] / gloo["p50_us"], rel=1e-2)
    assert summary["busbw_vs_rawtcp"] == pytest.approx(pp["busbw_GBps"] / raw["busbw_GBps"], rel=1e-2)
    for key in ("cold", "hot"):
        assert summary[f"{key}_p50_vs_gloo"] == pytest.approx(
            pp[f"{key}_p50_us"] / gloo[f"{key}_p50_us"], rel=1e-2
        )


def test_bus_factors_follow_nccl_tests() -> None:
    assert bench.bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bench.bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert bench.bus_factor("reduce_scatter", 2) == pytest.approx(0.5)
    assert bench.bus_factor("broadcast", 8) == 1.0
    with pytest.raises(ValueError, match="unknown op"):
        bench.bus_factor("alltoall", 2)


def test_schedule_runs_fewer_iterations_at_large_sizes_within_bounds() -> None:
    cfg = bench.BenchConfig()
    timed = [cfg.schedule(size, 2)[1] for size in cfg.sizes]
    assert timed == sorted(timed, reverse=True) and timed[0] > timed[-1]
    assert all(cfg.min_iters <= t <= cfg.max_iters for t in timed)
    assert cfg.schedule(64 << 20, 4)[1] <= cfg.schedule(64 << 20, 2)[1]
    assert bench.BenchConfig(iters=7).schedule(64 << 20, 4)[1] == 7


def test_summary_pairs_rows_with_gloo_at_same_case() -> None:
    def row(impl: str, transport: str, nbytes: int, p50_s: float) -> dict[str, Any]:
        made: dict[str, Any] = bench.make_row(impl, transport, "all_reduce", 2, nbytes, p50_s, 10)
        return made

    rows = [
        row("paramplane", "shm", 4096, 1e-4),
        row("gloo", "gloo", 4096, 4e-4),
        row("paramplane", "grpc", 8192, 1e-3),
    ]
    (line,) = bench.summarize(rows)
    assert line["transport"] == "shm" and line["bytes"] == 4096
    assert line["busbw_vs_gloo"] == pytest.approx(4.0, rel=2e-3) and line["p50_vs_gloo"] == pytest.approx(
        0.25, rel=2e-3
    )
    table = bench.markdown(rows)
    assert "| 4 KiB |" in table and "| 8 KiB |" in table and "—" in table


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ops", "alltoall"], "ops must be"),
        (["--transports", "nccl"], "transports must be"),
        (["--worlds", "1"], "world sizes must be"),
        (["--iters", "0"], "iters must be"),
    ],
)
def test_bad_arguments_are_refused_with_a_message(args: list[str], message: str, capsys: Any) -> None:
    bounded = ["--no-gloo", "--sizes", "4K", "--worlds", "2", "--timeout", "20"]  # were the check to regress
    with pytest.raises(SystemExit) as exc:
        bench.main([*bounded, *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_repeats_keep_the_median_round_of_each_case() -> None:
    rounds = [
        [bench.make_row("gloo", "gloo", "broadcast", 2, 4096, p50_s, 10)] for p50_s in (3e-4, 1e-4, 9e-4)
    ]
    (row,) = bench.combine(rounds)
    assert row["p50_us"] == pytest.approx(300.0) and row["repeats"] == 3
    # Cold and hot latencies: each the median of its own rounds (not those of the round with the median p50).
    timed = [(3e-4, 5e-4), (1e-4, 9e-4), (9e-4, 7e-4)]
    rounds = [[bench.make_row("gloo", "gloo", "all_reduce", 2, 4096, hot, 10, cold)] for hot, cold in timed]
    (row,) = bench.combine(rounds)
    assert row["hot_p50_us"] == pytest.approx(300.0) and row["cold_p50_us"] == pytest.approx(700.0)
    assert row["cold_rounds_us"] == pytest.approx([500.0, 900.0, 700.0])
    with pytest.raises(ValueError, match="repeats"):
        bench.BenchConfig(repeats=0)


TORCH_MODELS = ROOT / "benchmarks" / "torch_models.py"
TINY_GPT = ["--layers", "1", "--embd", "32", "--vocab", "128", "--seq", "16", "--local-batch", "2"]


def _load_torch_models() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_torch_models", TORCH_MODELS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)  # its own bounds (240 s), not the global 120 s
@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None,
    reason="torch and transformers not installed",
)
def test_torch_models_tiny_run_sets_pp_fsdp_beside_torch_fsdp2_on_one_gpt(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    args = [
        "--models",
        "gpt2",
        "--modes",
        "fsdp",
        "--worlds",
        "2",
        "--steps",
        "2",
        "--warmup",
        "1",
        *TINY_GPT,
        "--torch-backend",
    ]
    proc = subprocess.run(
        [sys.executable, str(TORCH_MODELS), *args, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,  # 100 s seen alone on two cores shared with other jobs (load 30)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
    assert [(r["impl"], r["wrapper"]) for r in rows] == [
        ("paramplane", "pp.FSDP full_shard"),
        ("torch", "torch FSDP2 fully_shard (gloo)"),
        ("torch-paramplane", "torch FSDP2 fully_shard (paramplane backend)"),
    ]
    ours, theirs, backend = rows
    assert ours["params"] == theirs["params"] == backend["params"] > 0  # the same model on every side
    assert backend["step_vs_torch"] == pytest.approx(backend["step_s_median"] / theirs["step_s_median"])
    for row in rows:
        assert row["model"] == "gpt2" and row["world_size"] == 2 and row["steps"] == 2
        assert 0 < row["step_s_min"] <= row["step_s_median"] and row["train_rss_peak_max"] > 0
        assert 0 < row["rss_growth_max"] < row["rss_peak_max"]
    assert theirs["malloc_env"] is False and ours["malloc_env"] is True  # torch runs at its own defaults
    assert ours["step_vs_torch"] == pytest.approx(ours["step_s_median"] / theirs["step_s_median"])
    assert ours["train_peak_vs_torch"] == pytest.approx(
        ours["train_rss_peak_max"] / theirs["train_rss_peak_max"]
    )


def test_torch_models_ratios_pair_rows_of_the_same_model_mode_and_world() -> None:
    tm = _load_torch_models()

    def row(impl: str, model: str, mode: str, world: int, step: float, peak: int) -> dict[str, Any]:
        keys = {"impl": impl, "model": model, "mode": mode, "world_size": world}
        return {**keys, "step_s_median": step, "rss_peak_max": peak, "train_rss_peak_max": peak}

    rows = [
        row("paramplane", "gpt2", "ddp", 2, 1.0, 100),
        row("torch", "gpt2", "fsdp", 2, 4.0, 400),
        row("torch", "gpt2", "ddp", 4, 8.0, 800),
        row("torch", "gpt2", "ddp", 2, 2.0, 50),
        row("paramplane", "resnet", "ddp", 2, 1.0, 100),  # no torch row: no ratio
    ]
    tm.add_ratios(rows)
    assert rows[0]["step_vs_torch"] == pytest.approx(0.5) and rows[0]["train_peak_vs_torch"] == pytest.approx(
        2.0
    )
    assert "step_vs_torch" not in rows[4] and "step_vs_torch" not in rows[1]


def test_torch_models_repeats_pair_within_a_repeat_and_summarize_the_medians() -> None:
    tm = _load_torch_models()

    def row(impl: str, repeat: int, step: float, peak: int) -> dict[str, Any]:
        keys = {"impl": impl, "model": "gpt2", "mode": "ddp", "world_size": 4, "device": "cpu"}
        return {
            **keys,
            "repeat": repeat,
            "step_s_median": step,
            "rss_peak_max": peak,
            "train_rss_peak_max": peak,
        }

    rows = [
        row("paramplane", 0, 1.0, 100),
        row("torch", 0, 2.0, 100),
        row("torch", 1, 1.0, 100),  # torch first in odd repeats
        row("paramplane", 1, 1.5, 150),
        row("paramplane", 2, 3.0, 100),
        row("torch", 2, 4.0, 200),
    ]
    tm.add_ratios(rows)
    assert [r["step_vs_torch"] for r in rows if r["impl"] == "paramplane"] == pytest.approx([0.5, 1.5, 0.75])
    (summary,) = tm.summarize(rows)
    assert summary["summary"] is True and summary["repeats"] == 3
    assert (summary["model"], summary["mode"], summary["world_size"]) == ("gpt2", "ddp", 4)
    assert summary["step_vs_torch_median"] == pytest.approx(0.75)
    assert summary["step_vs_torch_range"] == pytest.approx([0.5, 1.5])
    assert summary["train_peak_vs_torch_median"] == pytest.approx(1.0)
    assert tm.summarize(rows[:2]) == []  # one repeat: nothing to summarize


@pytest.mark.parametrize(
    "args, message",
    [
        (["--models", "vgg"], "--models takes"),
        (["--modes", "zero3"], "--modes takes"),
        (["--worlds", "two"], "--worlds takes"),
        (["--steps", "0"], "must be positive"),
        (["--repeats", "0"], "must be positive"),
    ],
)
def test_torch_models_bad_arguments_are_refused_with_a_message(
    args: list[str], message: str, capsys: Any
) -> None:
    with pytest.raises(SystemExit) as exc:
        _load_torch_models().main(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


CONTROL_PLANE = ROOT / "benchmarks" / "control_plane.py"


@pytest.mark.timeout(240)
def test_control_plane_tiny_run_measures_every_phase_and_detects_the_silent_rank(tmp_path: Path) -> None:
    """16 simulated ranks on 8 hosts against a real coordinator process, ranks calling it themselves and ranks
    calling their host's agent on its Unix socket: a row each with every figure, failure detection within the
    heartbeat timeout (plus a heartbeat interval and a tick)."""
    out = tmp_path / "cp.jsonl"
    proc = subprocess.run(
        [sys.executable, str(CONTROL_PLANE), "--sizes", "16", "--impls", "paramplane", "agent-hop",
         "--heartbeat-timeout", "5", "--steady", "2", "--rounds", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=230, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["impl"] for r in rows] == ["paramplane", "paramplane-agent-hop"], rows
    for row in rows:
        assert (row["world_size"], row["hosts"]) == (16, 8)
        for key in ("join_s", "barrier_s", "uid_world_s", "uid_host_s", "barrier_first_s", "rss_mb"):
            assert row[key] > 0, (key, row)
        assert row["rounds"] == len(row["barrier_rounds_s"]) == len(row["uid_host_rounds_s"]) == 2, row
        assert 0 <= row["cpu_steady"] < 2, row  # clock-tick resolution: a tiny world can read 0 over 1 s
        assert 5 - 1.5 <= row["detect_s"] <= 5 + 3, row
