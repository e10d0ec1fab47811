"""The parallel wrappers, side by side: DDP, FSDP, pipeline and tensor parallel, and the rank mesh.

Each strategy pairs its algorithm (``ddp.py``, ``fsdp.py``, ``pipeline/``, ``tensor.py``) with
its communication helpers; every group comes from one ``Mesh`` (``mesh.py``) passed explicitly.
``sharding.py`` holds the description of sharded state that checkpoints read.
"""
