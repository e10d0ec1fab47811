"""Config dataclasses document each field with a docstring under it; this reads those back, so command-line
help and generated docs come from the one place that defines the field (kept beside the protos so the
coordinator may import it)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
from typing import Any


def field_docs(cls: type[Any]) -> dict[str, str]:
    """``{field name: its docstring}`` for the dataclass ``cls`` (fields without one are left out)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def default_of(cls: type[Any], name: str) -> Any:
    """The declared default of field ``name`` of the dataclass ``cls``."""
    (f,) = [f for f in dataclasses.fields(cls) if f.name == name]
    if f.default is dataclasses.MISSING:
        raise KeyError(f"{cls.__name__}.{name} has no default")
    return f.default
