"""Collective algorithms written once over transport interfaces.

``ring``: direct exchange and ring reduce-scatter / all-gather over any point-to-point
frame channel (``FrameChannel``; the gRPC transport provides one). ``hierarchical``:
an all-reduce across hosts composed of any intra-host ``Comm`` and any cross-host ``Comm``.
"""
