"""A recording stand-in for cupy: numpy arrays of a subclass that the plane treats as device arrays.

``MODULE.asarray`` is the host-to-device copy and ``DeviceArray.get`` the device-to-host copy; both
count into ``RECORD``, and ``asarray`` of an array whose id is in ``WATCH`` counts as ``watched_h2d``.
Importing this module registers it with ``paramplane.node.arrays``.
"""

from __future__ import annotations

import types
from collections import Counter
from typing import Any

import numpy as np

from paramplane.node.arrays import register_device_module

RECORD: Counter[str] = Counter()
WATCH: set[int] = set()


class DeviceArray(np.ndarray):  # type: ignore[type-arg]
    """An array 'on the device' (host memory underneath)."""

    def get(self, out: np.ndarray | None = None) -> np.ndarray:
        RECORD["d2h"] += 1
        host = np.array(self.view(np.ndarray))
        if out is None:
            return host
        out[...] = host
        return out


def _wrap(value: Any) -> Any:
    if isinstance(value, np.ndarray) and not isinstance(value, DeviceArray):
        return value.view(DeviceArray)
    return value


class _FakeDeviceModule(types.ModuleType):
    """numpy's API whose array results are DeviceArrays."""

    def asarray(self, a: Any, dtype: Any = None) -> DeviceArray:
        if isinstance(a, DeviceArray):
            return a if dtype is None else a.astype(dtype)
        RECORD["h2d"] += 1
        if id(a) in WATCH:
            RECORD["watched_h2d"] += 1
        return np.array(a, dtype=dtype).view(DeviceArray)

    def __getattr__(self, name: str) -> Any:
        value = getattr(np, name)
        if not callable(value) or isinstance(value, type):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            return _wrap(value(*args, **kwargs))

        return call


MODULE = _FakeDeviceModule("fake_device_xp")
register_device_module(__name__, MODULE)
