"""The ``paramplane`` console script: help, version, dispatch and errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import paramplane
from paramplane.cli import SUBCOMMANDS, main


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: paramplane" in out
    for name in ("coordinator", "launch"):
        assert name in SUBCOMMANDS
        assert f"\n  {name} " in out, f"{name} missing from --help"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"paramplane {paramplane.__version__}"


@pytest.mark.parametrize("argv", [["trian"], ["--bogus"], []])
def test_bad_invocation_exits_2_with_a_helpful_message(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: paramplane" in err
    if argv == ["trian"]:
        assert "unknown command 'trian'; choose from coordinator, launch" in err


def test_subcommands_get_the_rest_of_argv(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--help"]) == 0
    assert "paramplane launch" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:  # the coordinator's own argparse: its --help exits 0
        main(["coordinator", "--help"])
    assert exit_.value.code == 0
    assert "--world-size" in capsys.readouterr().out


@pytest.mark.timeout(180)  # its own bounds (120 s), not the global 120 s
def test_console_script_starts_without_importing_subcommands() -> None:
    probe = "import sys, paramplane.cli; print(sorted(m for m in sys.modules if m.startswith('paramplane.')))"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert "paramplane.launch" not in loaded.stdout and "paramplane.coordinator" not in loaded.stdout
    script = Path(sys.executable).parent / "paramplane"
    if not script.exists():
        pytest.skip("the paramplane console script is not installed next to this interpreter")
    unknown = subprocess.run([str(script), "nope"], capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2 and "unknown command 'nope'" in unknown.stderr
