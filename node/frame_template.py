"""A small frame kept as bytes: a ``FrameHeader`` serialized but for its sequence number and inline payload.

A frame of a known kind is then written without building a header (``frame_bytes``), and a received one
that matches byte for byte is taken without parsing it (``DirectLane.next_message``). Protobuf fields may come
in any order, so the sequence number and the payload are appended after the rest of the header.
"""

from __future__ import annotations

from paramplane.node.lane import FRAME_LENGTH
from paramplane.protos import peer_pb2

SEQ_TAG = bytes([peer_pb2.FrameHeader.SEQ_FIELD_NUMBER << 3])  # varint
PAYLOAD_TAG = bytes([peer_pb2.FrameHeader.INLINE_PAYLOAD_FIELD_NUMBER << 3 | 2])  # length-delimited


def varint(n: int) -> bytes:
    """``n`` (non-negative) as a protobuf varint."""
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def template_bytes(header: peer_pb2.FrameHeader) -> tuple[bytes, bytes]:
    """(head, tail) of frames like ``header`` (its seq and inline payload unset; ``header.nbytes`` the payload's
    size): a frame is ``head``, the sequence number as a varint, ``tail``, then the payload."""
    nbytes = header.nbytes
    return header.SerializeToString() + SEQ_TAG, PAYLOAD_TAG + varint(nbytes) if nbytes else b""


def frame_bytes(head: bytes, tail: bytes, seq: int, payload: bytes | memoryview) -> bytes:
    """The frame of message ``seq`` of the template (``head``, ``tail``) carrying ``payload``, length-prefixed
    for a lane."""
    number = varint(seq)
    size = len(head) + len(number) + len(tail) + len(payload)
    return b"".join((FRAME_LENGTH.pack(size), head, number, tail, payload))
