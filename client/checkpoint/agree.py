"""Agreement between a group's ranks before anything is written or modified.

A save gathers every rank's offer (the pieces it holds, each key's global shape and dtype, fingerprints of
what it holds as a replica, digests of its plain values, any problem staging them) and every rank refuses
the save, naming the key, the ranks and what differs, when they disagree: the data files hold raw bytes,
so a rank staging another dtype or global shape for a key would be read back as another rank's without a
word, and ranks holding one replica with different contents would have one rank's copy loaded everywhere.
A load (and a live sync) gathers every rank's problems and fails every rank when any rank has one.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from paramplane.checkpoint.files import CheckpointError, _raw
from paramplane.group import ProcessGroup


def _gather_json(group: ProcessGroup, obj: Any) -> list[Any]:
    """Every group rank's ``obj`` (JSON), in group order."""
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = group.all_gather(np.array([data.size], np.int64))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    every = group.all_gather(padded).reshape(group.size, -1)
    return [json.loads(bytes(every[r, : int(sizes[r])]).decode()) for r in range(group.size)]


def _agree(group: ProcessGroup, problems: list[str], what: str) -> None:
    """Raise CheckpointError on every rank if any rank has a problem (before anything is modified)."""
    reports = _gather_json(group, problems[:5])
    failing = {r: p for r, p in enumerate(reports) if p}
    if failing:
        text = "; ".join(f"group rank {r}: {', '.join(p)}" for r, p in failing.items())
        raise CheckpointError(f"{what} (nothing was modified): {text}")


def _check_offers(claimed: list[dict[str, Any]], target: Path) -> None:
    """Raise CheckpointError on every rank when the ranks' save offers (``claimed``, in group order) show a
    staging problem or disagree about a key's kind or a replica's contents."""
    failing: dict[str, list[int]] = {}
    for r, c in enumerate(claimed):
        if c["problem"]:
            failing.setdefault(c["problem"], []).append(r)
    texts = [f"group rank {', '.join(map(str, r))}: {p}" for p, r in failing.items()]
    texts += _kind_conflicts([c["kinds"] for c in claimed])
    texts += _replica_conflicts([c["replicated"] for c in claimed], "array")
    texts += _replica_conflicts([c["values"] for c in claimed], "value")
    if texts:
        raise CheckpointError(f"cannot save {target} (nothing was written): {'; '.join(texts)}")


def _lowest_holders(held: Sequence[Iterable[Hashable]]) -> dict[Hashable, int]:
    """Each item -> the lowest group rank holding it (``held``: every rank's items, in group order)."""
    out: dict[Hashable, int] = {}
    for r, items in enumerate(held):
        for item in items:
            out.setdefault(item, r)
    return out


def _differing(held: Sequence[Mapping[str, Hashable]]) -> dict[str, dict[Any, list[int]]]:
    """Each key that group ranks hold with different contents (``held``: every rank's key -> content, in
    group order): content -> the ranks holding it."""
    seen: dict[str, dict[Any, list[int]]] = {}
    for r, mine in enumerate(held):
        for key, content in mine.items():
            seen.setdefault(key, {}).setdefault(content, []).append(r)
    return {key: by_content for key, by_content in seen.items() if len(by_content) > 1}


def _kind_conflicts(kinds: list[dict[str, Any]]) -> list[str]:
    """Each key that group ranks stage with different global shapes or dtypes (``kinds``: every rank's, in
    group order): the key, what differs, and which ranks have what."""
    out = []
    shaped = [{k: (tuple(kind["global_shape"]), kind["dtype"]) for k, kind in mine.items()} for mine in kinds]
    for key, by_kind in _differing(shaped).items():
        differs = [
            what
            for what, values in (
                ("global shape", {s for s, _ in by_kind}),
                ("dtype", {d for _, d in by_kind}),
            )
            if len(values) > 1
        ]
        held = "; ".join(
            f"{dtype} {shape} on group rank {', '.join(map(str, ranks))}"
            for (shape, dtype), ranks in by_kind.items()
        )
        out.append(f"{key!r} has a different {' and '.join(differs)} on different ranks: {held}")
    return out


def _fingerprint(a: np.ndarray) -> str:
    """A checksum of ``a``'s bytes, sampled where it is large (up to 16 spread blocks of 64 KiB): what tells
    apart arrays that are not replicas at all (two pipeline stages saved under one key) without reading every
    replicated array on every rank; it does not prove replicas bit for bit equal."""
    raw = _raw(a)
    block = 1 << 16
    if raw.size <= 16 * block:
        return f"{raw.size}:{zlib.crc32(raw.data)}"
    crc = 0
    for start in np.linspace(0, raw.size - block, 16).astype(np.int64):
        crc = zlib.crc32(raw[start : start + block].data, crc)
    return f"{raw.size}:{crc}"


def _digest(value: Any) -> str:
    return hashlib.blake2s(json.dumps(value, sort_keys=True).encode(), digest_size=8).hexdigest()


def _replica_conflicts(held: list[dict[str, str]], what: str) -> list[str]:
    """Each key (or piece) that group ranks hold with different contents (``held``: every rank's fingerprints,
    in group order) although they hold it as replicas."""
    return [
        f"{what} {key!r} differs between group ranks "
        f"{' / '.join(', '.join(map(str, ranks)) for ranks in by_content.values())}, which hold it as replicas: "
        "a key that is not sharded (or a piece several ranks hold) must hold the same on every rank that has it; "
        "state that differs per rank (a pipeline stage's module and optimizer) needs keys of its own, e.g. "
        "{f'stage{stage}': module, f'optim{stage}': optimizer}"
        for key, by_content in _differing(held).items()
    ]
