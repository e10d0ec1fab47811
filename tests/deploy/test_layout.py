"""The package layout of DESIGN.md: every package folder is mapped and importable."""

from __future__ import annotations

import importlib
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def _mapping() -> dict[str, str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["setuptools"]["package-dir"]


def test_every_package_folder_is_listed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    mapping = _mapping()
    assert listed == set(mapping), "packages and package-dir must name the same packages"
    folders = {str(p.parent.relative_to(ROOT)) for p in ROOT.glob("*/**/__init__.py")}
    folders = {
        f
        for f in folders
        if f.split("/")[0] in {"client", "node", "coordinator", "protos", "examples", "benchmarks"}
    }
    assert folders == set(mapping.values()), f"unlisted package folders: {folders - set(mapping.values())}"


def test_every_package_imports_from_its_folder() -> None:
    for package, folder in _mapping().items():
        module = importlib.import_module(package)
        assert Path(module.__file__ or "").resolve().parent == (ROOT / folder).resolve(), package


def test_errors_share_one_base() -> None:
    import paramplane as pp

    for name in ("RendezvousError", "AuthError", "CollectiveTimeout", "PeerLost", "CollectiveMismatch"):
        assert issubclass(getattr(pp, name), pp.PlaneError)
