"""Generate the protobuf and gRPC modules under protos/ (pinned: grpcio-tools 1.85.1, mypy-protobuf 5.1.0).

Usage: python scripts/gen_protos.py [--out DIR]

The .proto files are staged as paramplane/protos/*.proto so that generated
imports read ``from paramplane.protos import ...`` and work as installed.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def _plugin(name: str) -> str:
    found = shutil.which(name) or str(Path(sysconfig.get_path("scripts")) / name)
    if not Path(found).exists():
        raise SystemExit(f"{name} not found: install the dev extra (pip install -e '.[dev]')")
    return found


def generate(out_dir: Path) -> list[Path]:
    """Generate every module for protos/*.proto into out_dir; returns the files written."""
    from grpc_tools import protoc  # type: ignore[import-untyped]

    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp) / "src" / "paramplane" / "protos"
        stage.mkdir(parents=True)
        build = Path(tmp) / "build"
        build.mkdir()
        sources = sorted(PROTOS.glob("*.proto"))
        for src in sources:
            shutil.copy(src, stage / src.name)
        include = str(Path(protoc.__file__).parent / "_proto")
        args = [
            "protoc",
            f"-I{Path(tmp) / 'src'}",
            f"-I{include}",
            f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
            f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
            f"--python_out={build}",
            f"--grpc_python_out={build}",
            f"--mypy_out={build}",
            f"--mypy_grpc_out={build}",
            *[f"paramplane/protos/{s.name}" for s in sources],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for f in sorted((build / "paramplane" / "protos").iterdir()):
            if f.name.endswith(GENERATED_SUFFIXES):
                shutil.copy(f, out_dir / f.name)
                written.append(out_dir / f.name)
        return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=PROTOS, help="output folder (default: protos/)")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    sys.exit(0)


if __name__ == "__main__":
    main()
