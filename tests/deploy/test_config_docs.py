"""Every PARAMPLANE_* variable the package reads is documented once: in ``paramplane.world.ENV_VARS`` (what
``pp.init`` reads, shown by the CLI) or as set by the launcher, and in the README's table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from paramplane.world import ENV_VARS

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"PARAMPLANE_[A-Z][A-Z_]*[A-Z](?![A-Z_{])")
SET_BY_LAUNCHER = {"PARAMPLANE_LOCAL_RANK", "PARAMPLANE_RESTART_COUNT"}
TEST_HOOKS: set[str] = set()  # none: tests inject faults by wrapping functions in their workers


def _read_by_package() -> set[str]:
    names: set[str] = set()
    for folder in ("client", "node", "coordinator", "protos"):
        for path in (ROOT / folder).rglob("*.py"):
            if not path.name.endswith("_pb2.py"):
                names |= set(NAME.findall(path.read_text()))
    return names - TEST_HOOKS


def _readme_table() -> set[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    return set(NAME.findall(section))


def test_every_variable_is_documented_in_the_readme_table() -> None:
    missing = _read_by_package() - _readme_table()
    assert not missing, f"read by the package but not in the README's table: {sorted(missing)}"


def test_the_readme_table_lists_nothing_the_package_ignores() -> None:
    stale = _readme_table() - _read_by_package()
    assert not stale, f"in the README's table but read nowhere: {sorted(stale)}"


def test_init_documents_what_it_reads() -> None:
    undocumented = _read_by_package() - set(ENV_VARS) - SET_BY_LAUNCHER
    assert not undocumented, f"not in paramplane.world.ENV_VARS: {sorted(undocumented)}"


def test_coordinator_flags_come_from_its_config_dataclass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each coordinator flag that sets a CoordinatorConfig field takes that field's default and docstring,
    and every field is reachable from the command line (or deliberately set another way)."""
    import dataclasses

    from paramplane.coordinator import cli
    from paramplane.coordinator.server import CoordinatorConfig
    from paramplane.protos.fields import field_docs

    for name in ("PARAMPLANE_TOKEN", "PARAMPLANE_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    parser = cli._parser()
    args = parser.parse_args(["--world-size", "3"])
    config = cli._config(args)
    assert config == CoordinatorConfig(world_size=3)
    help_text = " ".join(parser.format_help().split())
    docs = field_docs(CoordinatorConfig)
    for _flag, name, _kind in cli.FIELD_FLAGS:
        assert docs[name] in help_text, name
    by_file = {"token", "tls_cert", "tls_key"}  # --token-file, --tls-cert, --tls-key read files
    internal = {"max_message_bytes"}
    switches = {"http_public"}  # --http-public (store_true)
    assert docs["http_public"] in help_text
    covered = {name for _f, name, _k in cli.FIELD_FLAGS} | {"world_size"} | by_file | internal | switches
    assert {f.name for f in dataclasses.fields(CoordinatorConfig)} == covered
    assert set(docs) >= covered - internal


def test_launcher_options_are_its_config_fields() -> None:
    """Every ``paramplane launch`` option sets the LaunchConfig field of the same name, with that field's
    docstring as its help; every field but the token (read from --token-file) and the two that ``--slurm`` sets
    from the job (first_rank, restart_base) has an option."""
    import dataclasses

    from paramplane.launch import LaunchConfig, _parser
    from paramplane.protos.fields import field_docs

    parser = _parser()
    docs = field_docs(LaunchConfig)
    dests = {a.dest: a for a in parser._actions if a.dest not in ("help", "token_file", "slurm")}
    fields = {f.name for f in dataclasses.fields(LaunchConfig)}
    assert set(dests) == fields - {"token", "first_rank", "restart_base"}
    for name, action in dests.items():
        assert action.help is not None and docs[name] in action.help, name
        default = next(f.default for f in dataclasses.fields(LaunchConfig) if f.name == name)
        if action.default is not None and not action.required:
            assert action.default == default, name


def test_init_reads_each_runtime_field_from_its_variable_and_arguments_win(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every plain RuntimeConfig field has a PARAMPLANE_* variable, parsed by the field's type; the rest
    (token, TLS, tracer) come from the documented file variables."""
    import dataclasses

    from paramplane.node.runtime import ENV_OF, RuntimeConfig
    from paramplane.world import runtime_config

    special = {"token", "tls", "coordinator_root_cert", "tracer"}
    assert {f.name for f in dataclasses.fields(RuntimeConfig)} == set(ENV_OF) | special
    values = {
        "coordinator": ("127.0.0.1:1234", "127.0.0.1:1234"),
        "world_size": ("3", 3),
        "rank_hint": ("2", 2),
        "host_id": ("box-7", "box-7"),
        "timeout_s": ("12.5", 12.5),
        "join_timeout_s": ("7", 7.0),
        "replacement": ("1", True),
        "bind_host": ("127.0.0.2", "127.0.0.2"),
        "advertise_host": ("127.0.0.3", "127.0.0.3"),
        "transport": ("grpc", "grpc"),
        "shm_slot_mb": ("2", 2.0),
        "tcp_lane": ("0", False),
        "unix_lane": ("0", False),
        "agent": ("unix:/run/agent.sock", "unix:/run/agent.sock"),
    }
    assert set(values) == set(ENV_OF)
    for name, (raw, _) in values.items():
        monkeypatch.setenv(ENV_OF[name], raw)
    config = runtime_config()
    for name, (_, want) in values.items():
        assert getattr(config, name) == want, name
    assert runtime_config(timeout_s=1.0, transport="shm").timeout_s == 1.0
    for var, bad, needle in (
        ("PARAMPLANE_TIMEOUT", "soon", "PARAMPLANE_TIMEOUT must be a number"),
        ("PARAMPLANE_TCP_LANE", "maybe", "PARAMPLANE_TCP_LANE must be 0 or 1"),
        ("PARAMPLANE_TRANSPORT", "pigeon", "PARAMPLANE_TRANSPORT"),
        # "no timeout" is a long finite one: every wait hands it to the OS
        ("PARAMPLANE_TIMEOUT", "inf", "at most 31536000"),
        ("PARAMPLANE_TIMEOUT", "0", "must be a finite number of seconds > 0"),
        ("PARAMPLANE_JOIN_TIMEOUT", "1e12", "PARAMPLANE_JOIN_TIMEOUT"),
    ):
        with monkeypatch.context() as m:
            m.setenv(var, bad)
            with pytest.raises(ValueError, match=needle):
                runtime_config()
    monkeypatch.delenv("PARAMPLANE_COORDINATOR")
    with pytest.raises(ValueError, match="no coordinator"):
        runtime_config()
