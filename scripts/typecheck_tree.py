"""Build .typecheck/paramplane: the installed package shape as symlinks, for mypy.

mypy cannot follow setuptools' package-dir mapping of an editable install, so
the Makefile's typecheck target points it at this tree (see pyproject [tool.mypy]).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / ".typecheck"


def build() -> Path:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    shutil.rmtree(TREE, ignore_errors=True)
    for package, folder in sorted(mapping.items()):
        target = TREE.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for src in (ROOT / folder).iterdir():
            if src.suffix in (".py", ".pyi") or src.name == "py.typed":
                (target / src.name).symlink_to(src)
    return TREE


if __name__ == "__main__":
    print(build())
