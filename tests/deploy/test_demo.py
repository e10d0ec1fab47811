"""``paramplane demo``: a real 4-rank DDP run on digits, kept short here (2 epochs); ``--torch``'s GPT."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def _losses(stdout: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"step (\d+)/\d+: loss (\d+\.\d+)", stdout)}


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_demo_torch_trains_a_gpt_checkpoints_and_resumes_where_it_stopped(tmp_path: Path) -> None:
    def run(*flags: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "paramplane.demo", "--torch", "--out", str(tmp_path), *flags]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    first = run("--steps", "16", "--checkpoint-every", "12")
    losses = _losses(first.stdout)
    assert sorted(losses) == list(range(1, 17)), first.stdout
    assert losses[16] < losses[1] - 1.0, losses  # the pattern is being learned
    ckpt = tmp_path / "gpt_checkpoints"
    assert sorted(d.name for d in ckpt.iterdir()) == ["step_000012", "step_000016"]
    assert all((ckpt / d / "manifest.json").is_file() for d in ("step_000012", "step_000016"))

    # Starting over where checkpoints exist is refused; the run "dies" after step 12's checkpoint.
    assert demo.main(["--torch", "--out", str(tmp_path)]) == 2
    shutil.rmtree(ckpt / "step_000016")
    second = run("--steps", "16", "--resume")
    assert f"resumed from {ckpt / 'step_000012'} at step 12" in second.stdout
    resumed = _losses(second.stdout)
    assert sorted(resumed) == [13, 14, 15, 16], second.stdout
    # Same data, model and AdamW state: the resumed steps are the uninterrupted run's.
    for step, loss in resumed.items():
        assert loss == pytest.approx(losses[step], abs=2e-4), (step, resumed, losses)
    assert (ckpt / "step_000016" / "manifest.json").is_file()


def test_demo_torch_without_torch_prints_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        demo.importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
    )
    assert demo.main(["--torch"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install torch" in err and "paramplane[test]" in err


@pytest.mark.parametrize("missing", ["sklearn", "tqdm", "matplotlib"])
def test_demo_without_the_demo_extra_says_what_to_install_in_one_line(
    missing: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pip install paramplane` then `paramplane demo`: one line naming the extra, no rank started (no
    traceback per rank)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        demo.importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a)
    )
    started: list[object] = []
    monkeypatch.setattr("paramplane.launch.launch", lambda config: started.append(config) or 0)
    for argv in ([], ["--fsdp"]):
        assert demo.main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and missing in err and "paramplane[demo]" in err, err
    assert not started


def test_demo_diloco_trains_on_two_emulated_hosts_and_syncs_every_h_steps() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "paramplane.demo", "--diloco", "--steps", "60", "--sync-every", "20"],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "2 hosts x 2 ranks; DiLoCo(sync_every=20" in proc.stdout, proc.stdout
    losses = {int(s): float(v) for s, v in re.findall(r"step (\d+): loss (\d+\.\d+)", proc.stdout)}
    assert sorted(losses) == [20, 40, 60], proc.stdout  # one line per sync
    assert losses[60] < losses[20], losses
    sent = re.search(r"sent ~(\d+) kB .* every step: ~(\d+) kB", proc.stdout)
    assert sent and int(sent.group(2)) == pytest.approx(20 * int(sent.group(1)), rel=0.05), proc.stdout
