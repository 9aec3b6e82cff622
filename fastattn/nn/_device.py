"""Where a layer's arrays live: numpy on ``"cpu"``, CuPy on ``"cuda"``, and moving values there.

Callers' arrays (numpy, CuPy, or any DLPack producer such as a torch tensor) are viewed through
fastattn's array layer without a copy; results go back in the caller's framework.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import numpy as np

from .. import _arrays


def array_module(device: str) -> ModuleType:
    """numpy for ``"cpu"``, CuPy for ``"cuda"`` (imported only then)."""
    if device == "cpu":
        return np
    try:
        return importlib.import_module("cupy")
    except ImportError as error:
        raise ValueError(
            "device: expected 'cpu', or CuPy installed for 'cuda' (pip install 'fastattn[gpu]'); "
            "received 'cuda' without CuPy"
        ) from error


def native_input(name: str, value: Any, device: str) -> tuple[Any, _arrays.ArrayOrigin]:
    """View a caller's array as numpy/CuPy without copying; it must live on ``device``."""
    native, origin = _arrays.to_native(value, name)
    if origin.device != device:
        raise ValueError(
            f"{name}: expected an array on the layer's device ({device!r}), "
            f"received one on {origin.describe()}"
        )
    return native, origin


def to_device(value: Any, name: str, device: str, dtype: Any = None) -> Any:
    """Return a numpy/CuPy copy of ``value`` (any supported array) on ``device``, in ``dtype``."""
    native, origin = _arrays.to_native(value, name)
    xp = array_module(device)
    if origin.device != device:
        native = native.get() if origin.device == "cuda" else xp.asarray(native)
    return xp.array(native, dtype=dtype, copy=True)


def to_host(native: Any) -> np.ndarray:
    """A numpy view (host array) or copy (device array) of a numpy/CuPy array."""
    return native if isinstance(native, np.ndarray) else native.get()


def host_ints(name: str, value: Any, size: int) -> np.ndarray:
    """Return ``value`` (a sequence or an int array of any framework) as host int64 of shape (size,)."""
    native = _arrays.to_native(value, name)[0] if _arrays.is_array(value) else np.asarray(value)
    host = to_host(native)
    if host.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, received {_arrays.describe_value(host)}")
    if host.shape != (size,):
        raise ValueError(f"{name}: expected shape ({size},), received {tuple(host.shape)}")
    return host.astype(np.int64)
