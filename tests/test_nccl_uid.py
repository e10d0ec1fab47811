"""The NCCL unique id survives the coordinator's key/value store whichever signedness cupy uses."""

from __future__ import annotations

import pytest

from paramplane.node.nccl import pack_unique_id, unpack_unique_id


@pytest.mark.parametrize(
    "uid", [tuple(range(-64, 64)), tuple(range(128, 256)), tuple([0] * 128), bytes(range(128, 256))]
)
def test_unique_id_round_trips(uid: bytes | tuple[int, ...]) -> None:
    raw = pack_unique_id(uid)
    assert len(raw) == 129
    assert unpack_unique_id(raw) == uid


def test_malformed_unique_id_is_refused() -> None:
    with pytest.raises(ValueError, match="128 bytes"):
        pack_unique_id((1, 2, 3))
    with pytest.raises(ValueError, match="malformed"):
        unpack_unique_id(b"\x00" * 128)
    with pytest.raises(ValueError, match="malformed"):
        unpack_unique_id(b"\x07" + b"\x00" * 128)
