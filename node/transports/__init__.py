"""Transports: each implements the ``Comm`` interface of ``base.py``.

``grpc`` (framed raw-byte streams between any ranks), ``shm`` (a shared segment between
CPU ranks of one host), ``nccl`` (cupy arrays, GPU ranks of one host) and ``LocalComm``
(a group of one). The hierarchical composition lives in ``node/algorithms``; the engine
(``node/engine.py``) picks one per op from a single table.
"""
