"""benchmarks/diloco.py at a tiny size: its JSON rows, the bytes it sees crossing the link (in two network
namespaces where this runs as root, else on 127.0.0.1 without a link), and its arithmetic. No timing asserts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from paramplane.benchmarks import diloco as bench

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "diloco.py"
KEYS = {
    "bench", "link", "shaping", "variant", "steps", "num_params", "link_bytes_per_step",
    "bytes_reduction_vs_hybrid", "train_s", "target_val_loss", "time_to_target_s",
    "time_to_target_ratio_vs_hybrid", "final_val_loss", "final_loss_ratio_vs_hybrid", "curve",
}  # fmt: skip


def _netns() -> bool:
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        return False
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, timeout=10)
    return probe.returncode == 0


@pytest.mark.timeout(600)  # its own bounds (540 s: 8 torch processes start), not the global 120 s
def test_tiny_run_emits_a_row_per_variant_with_the_bytes_that_crossed(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    netns = _netns()
    out = tmp_path / "rows.jsonl"
    args = ["--steps", "10", "--dim", "32", "--layers", "3", "--eval-every", "5", "--val-windows", "16"]
    args += ["--corpus-bytes", "200000", "--variants", "hybrid_shard,diloco_h10", "--out", str(out)]
    args += ["--links", "1gbit"] if netns else ["--no-netns"]
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=540)
    finally:
        if proc.poll() is None:  # SIGTERM first: the benchmark then deletes its namespaces
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    assert proc.returncode == 0, stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert [r["variant"] for r in rows] == ["hybrid_shard", "diloco_h10"]
    for row in rows:
        assert row.keys() >= KEYS and row["bench"] == "diloco" and row["steps"] == 10
        assert [step for step, _, _ in row["curve"]] == [5, 10]
        assert row["final_val_loss"] == row["curve"][-1][2] < 5.0  # below ln(128) = 4.85 after 10 steps
        assert row["train_s"] > 0
    hybrid, diloco = rows
    assert diloco["sync_every"] == 10 and hybrid["target_val_loss"] == round(
        1.03 * hybrid["final_val_loss"], 5
    )
    listed = (
        subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
        if netns
        else ""
    )
    assert f"ppdl-{proc.pid}-" not in listed  # the namespaces are gone
    if not netns:
        assert hybrid["link"] == "none" and hybrid["link_bytes_per_step"] is None
        return
    # HybridShard all-reduces the float32 gradient across the hosts every step: each host sends about
    # 4 bytes per parameter (2 ranks, half a shard each, twice: reduce-scatter and all-gather of a pair).
    n = hybrid["num_params"]
    assert 7 * n < hybrid["link_bytes_per_step"] < 12 * n, hybrid
    # DiLoCo H = 10: the same once in 10 steps.
    assert 5 < diloco["bytes_reduction_vs_hybrid"] < 12, diloco
    assert "1gbit" in hybrid["shaping"]


def _result(curve: list[list[float]], link_bytes: int | None) -> dict[str, Any]:
    return {"num_params": 100, "train_s": curve[-1][1], "curve": curve, "final_val_loss": curve[-1][2],
            "link_bytes": link_bytes}  # fmt: skip


def test_summary_ratios_and_time_to_the_target_loss() -> None:
    results = {
        "hybrid_shard": _result([[10, 4.0, 3.0], [20, 8.0, 2.0]], 20_000),
        "diloco_h10": _result([[10, 1.0, 3.1], [20, 2.0, 2.06]], 400),
        "diloco_h50": _result([[10, 1.0, 3.1], [20, 2.0, 2.5]], None),
    }
    rows = {r["variant"]: r for r in bench.summarise("100mbit", results, 20)}
    assert rows["hybrid_shard"]["target_val_loss"] == 2.06
    assert rows["hybrid_shard"]["time_to_target_s"] == 8.0
    assert rows["diloco_h10"]["time_to_target_s"] == 2.0  # the first evaluation at or below the target
    assert rows["diloco_h10"]["time_to_target_ratio_vs_hybrid"] == pytest.approx(0.25)
    assert rows["diloco_h10"]["bytes_reduction_vs_hybrid"] == pytest.approx(50.0)
    assert rows["diloco_h10"]["final_loss_ratio_vs_hybrid"] == pytest.approx(1.03)
    assert rows["diloco_h50"]["time_to_target_s"] is None  # never reached: no ratio
    assert rows["diloco_h50"]["time_to_target_ratio_vs_hybrid"] is None
    assert rows["diloco_h50"]["link_bytes_per_step"] is None


def test_corpus_is_the_standard_library_as_ascii_ids() -> None:
    train, val = bench.corpus(100_000)
    assert len(train) + len(val) == 100_000 and len(val) == 5_000
    assert train.max() < bench.VOCAB and train.min() >= 0
    text = bytes(train.astype("uint8")).decode("ascii")
    assert "def " in text and "import " in text  # Python source
