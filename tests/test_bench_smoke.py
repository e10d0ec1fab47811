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

ROOT = Path(__file__).resolve().parent.parent
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
    cases = {(r["transport"], r["op"], r["bytes"]) for r in rows}
    expected = {
        (t, op, size) for t in bench.DEFAULT_TRANSPORTS for op in bench.OPS for size in bench.QUICK_SIZES
    }
    assert cases == expected and len(rows) == len(expected)
    assert [json.loads(line) for line in out.read_text().splitlines()] == lines


@pytest.mark.skipif(not bench.torch_available(), reason="torch.distributed not installed")
def test_quick_run_with_gloo_adds_peer_rows_and_ratios() -> None:
    _, lines = _run("--quick", "--transports", "shm", "--ops", "all_reduce", "--sizes", "4K")
    rows = {r["impl"]: r for r in lines if r["bench"] == "collectives"}
    assert set(rows) == {"paramplane", "gloo", "rawtcp"}
    for row in rows.values():
        _check_row(row)
    (summary,) = [r for r in lines if r["bench"] == "collectives_summary"]
    pp, gloo, raw = rows["paramplane"], rows["gloo"], rows["rawtcp"]
    # Rows are rounded to 4 significant digits, the ratios computed before rounding.
    assert summary["busbw_vs_gloo"] == pytest.approx(pp["busbw_GBps"] / gloo["busbw_GBps"], rel=1e-2)
    assert summary["p50_vs_gloo"] == pytest.approx(pp["p50_us"] / gloo["p50_us"], rel=1e-2)
    assert summary["busbw_vs_rawtcp"] == pytest.approx(pp["busbw_GBps"] / raw["busbw_GBps"], rel=1e-2)


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
    with pytest.raises(ValueError, match="repeats"):
        bench.BenchConfig(repeats=0)
