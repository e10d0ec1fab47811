"""A user's install: the built wheel in a fresh venv runs the CLI's commands, examples included."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(1380)  # its own bounds (1320 s), not the global 120 s
def test_the_wheel_runs_the_demo_outside_the_checkout(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    # The test venv's setuptools builds it when it has one (a build-isolation env costs ~5 s to make).
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") is not None else []
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(wheels), str(REPO)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    [wheel] = wheels.glob("paramplane-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir)  # installed into by this pip (``--python``): ensurepip costs ~7 s
    py = env_dir / "bin" / "python"
    subprocess.run(  # no byte-compiling of numpy, scipy, scikit-learn and matplotlib at install (~20 s here)
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-compile", f"{wheel}[demo]"],
        check=True,
        timeout=600,
        capture_output=True,
    )
    cli = env_dir / "bin" / "paramplane"
    version = subprocess.run(
        [str(cli), "--version"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert version.returncode == 0 and version.stdout.startswith("paramplane "), version
    demo = subprocess.run(
        [str(cli), "demo", "--epochs", "1", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    match = re.search(r"test accuracy: (\d\.\d+)", demo.stdout)
    assert match and float(match.group(1)) > 0.3, demo.stdout
    assert (
        str(REPO)
        not in subprocess.run(
            [str(py), "-c", "import paramplane; print(paramplane.__file__)"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        ).stdout
    )
