"""Every PARAMPLANE_* variable the package reads is documented once: in ``paramplane.world.ENV_VARS`` (what
``pp.init`` reads, shown by the CLI) or as set by the launcher, and in the README's table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from paramplane.world import ENV_VARS

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"PARAMPLANE_[A-Z][A-Z_]*[A-Z](?![A-Z_{])")
SET_BY_LAUNCHER = {"PARAMPLANE_LOCAL_RANK", "PARAMPLANE_RESTART_COUNT"}
TEST_HOOKS = {"PARAMPLANE_TEST_CRASH_IN_SAVE"}


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
    covered = {name for _f, name, _k in cli.FIELD_FLAGS} | {"world_size"} | by_file | internal
    assert {f.name for f in dataclasses.fields(CoordinatorConfig)} == covered
    assert set(docs) >= covered - internal


def test_launcher_options_are_its_config_fields() -> None:
    """Every ``paramplane launch`` option sets the LaunchConfig field of the same name, with that field's
    docstring as its help; every field but the token (read from --token-file) has an option."""
    import dataclasses

    from paramplane.launch import LaunchConfig, _parser
    from paramplane.protos.fields import field_docs

    parser = _parser()
    docs = field_docs(LaunchConfig)
    dests = {a.dest: a for a in parser._actions if a.dest not in ("help", "token_file")}
    fields = {f.name for f in dataclasses.fields(LaunchConfig)}
    assert set(dests) == fields - {"token"}
    for name, action in dests.items():
        assert action.help is not None and docs[name] in action.help, name
        default = next(f.default for f in dataclasses.fields(LaunchConfig) if f.name == name)
        if action.default is not None and not action.required:
            assert action.default == default, name
