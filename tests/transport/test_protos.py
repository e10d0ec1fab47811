"""Generated protobuf modules are fresh: regenerating them changes nothing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    sys.modules["gen_protos"] = gen
    spec.loader.exec_module(gen)
    written = gen.generate(tmp_path)
    assert written, "no modules generated"
    committed = {p.name for p in (ROOT / "protos").iterdir() if p.name.endswith(gen.GENERATED_SUFFIXES)}
    assert {p.name for p in written} == committed
    for path in written:
        assert path.read_text() == (ROOT / "protos" / path.name).read_text(), (
            f"protos/{path.name} is stale: run `make protos` and commit the result"
        )
