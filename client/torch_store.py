"""torch's ``Store`` over the coordinator's key/value store, for paramplane's torch.distributed backend
(``torch_distributed.py``): keys under ``torch/``; ``set``, ``get`` (waits for the key), ``add`` and
``compare_set``, the four calls torch 2.13 lets a Python store serve."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paramplane.world import World


def kv_store(world: World) -> Any:
    """A torch ``Store`` over the coordinator's key/value store (keys under ``torch/``)."""
    import torch.distributed as dist

    kv, limit = world.kv, world.group.timeout

    store_base: Any = dist.Store  # torch's Python-subclassable store

    class KVStore(store_base):
        def __init__(self) -> None:
            super().__init__()
            self._timeout = limit  # a get waits as long as a collective

        def set(self, key: str, value: Any) -> None:
            kv.set("torch/" + key, _bytes(value))

        def get(self, key: str) -> bytes:
            value = kv.get("torch/" + key, wait=True, timeout=self._timeout)
            assert value is not None  # a waiting get answers the value or raises
            return value

        def add(self, key: str, amount: int) -> int:
            return kv.add("torch/" + key, int(amount))

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            want = _bytes(expected)
            _, after = kv.compare_set("torch/" + key, want if want else None, _bytes(desired))
            return after if after is not None else want

    return KVStore()


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)
