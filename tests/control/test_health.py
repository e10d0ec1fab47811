"""``paramplane health``: SERVING from a live coordinator (the health RPC needs no token, like a liveness
probe), and a clear, bounded failure where nothing serves."""

from __future__ import annotations

import socket

import pytest

from paramplane import health
from paramplane.coordinator.server import CoordinatorConfig, CoordinatorThread


def test_health_needs_the_token_and_a_server(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("PARAMPLANE_TOKEN_FILE", raising=False)
    monkeypatch.delenv("PARAMPLANE_TLS_CA", raising=False)
    with CoordinatorThread(
        CoordinatorConfig(host="127.0.0.1", port=0, world_size=2, token="s3cret")
    ) as coord:
        monkeypatch.setenv("PARAMPLANE_TOKEN", "s3cret")
        assert health.main([coord.address]) == 0
        assert "SERVING" in capsys.readouterr().out
        monkeypatch.delenv("PARAMPLANE_TOKEN")
        assert health.main([coord.address]) == 0
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert health.main([f"127.0.0.1:{free}", "--timeout", "1"]) == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err or "DEADLINE_EXCEEDED" in err, err


def test_status_before_and_after_the_world_forms(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from _world import run_world

    from paramplane import status

    monkeypatch.delenv("PARAMPLANE_TOKEN_FILE", raising=False)
    with CoordinatorThread(CoordinatorConfig(host="127.0.0.1", port=0, world_size=2, token="tok")) as coord:
        monkeypatch.setenv("PARAMPLANE_TOKEN", "tok")
        assert status.main([coord.address]) == 0
        assert "not formed yet: 0/2 joined" in capsys.readouterr().out
        monkeypatch.setenv("PARAMPLANE_TOKEN", "wrong")
        assert status.main([coord.address]) == 1  # the status RPC needs the job token
        assert "AuthError" in capsys.readouterr().err
    world = run_world(2, "status.py", token="tok2", timeout=60)
    results = world.check_ok()
    assert results[0]["num_checks"] == 4
    assert "host " in results[0]["values"]["text"]
