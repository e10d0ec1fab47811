"""``paramplane demo``: a real 4-rank DDP run on digits, kept short here (2 epochs)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from paramplane import demo


def test_demo_trains_and_saves_the_loss_curve(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "paramplane.demo", "--epochs", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    match = re.search(r"^test accuracy: (\d\.\d+)$", proc.stdout, re.M)
    assert match, proc.stdout
    # Two epochs already beat chance (0.1) by far; the default 20 reach >= 0.95.
    assert 0.5 < float(match.group(1)) <= 1.0
    png = out / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(png) in proc.stdout
    assert "epoch 2/2" in proc.stderr  # rank 0's progress bar


def test_demo_rejects_bad_arguments() -> None:
    assert demo.main(["--epochs", "0"]) == 2
    assert demo.main(["--world-size", "-1"]) == 2
    assert demo.main(["--no-such-flag"]) == 2


def test_demo_fsdp_trains_and_reports_sharded_memory() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "paramplane.demo", "--fsdp", "--epochs", "2"],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    match = re.search(r"test accuracy: (\d\.\d+)$", proc.stdout, re.M)
    assert match, proc.stdout
    assert 0.5 < float(match.group(1)) <= 1.0
    # Every rank reports its measured memory; each holds a quarter of the parameters.
    shards = re.findall(r'rank (\d) memory peak bytes \{"params_sharded": (\d+)', proc.stdout)
    assert sorted(int(r) for r, _ in shards) == [0, 1, 2, 3], proc.stdout
    estimate = re.search(r"estimate (\d+)", proc.stdout)
    assert estimate
    # The estimate is params + grads + two AdamW moments of a quarter; shards differ by padding only.
    quarter = int(estimate.group(1)) // 4
    assert all(0 <= int(b) - quarter <= 64 for _, b in shards), proc.stdout
