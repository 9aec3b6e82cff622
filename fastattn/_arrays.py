"""The array layer: which framework and device an input lives on, and zero-copy conversion.

Backends see only two kinds of array: ``numpy.ndarray`` (host) and ``cupy.ndarray`` (CUDA).
Everything else that speaks DLPack (PyTorch tensors, JAX arrays, ...) is viewed as one of those
without a copy, and results are handed back in the caller's framework and on its device.

bfloat16 is ``ml_dtypes.bfloat16`` on the host, imported the first time a bfloat16 array or name
is met, not by ``import fastattn`` (ml_dtypes' extension took 1.6 s of a 2.1 s ``import
fastattn`` on a 2-core EPYC Zen 1 with numpy 2.4, ``python -X importtime``).  numpy cannot import
a bfloat16 DLPack tensor, so a torch bfloat16 CPU tensor crosses as its int16 bit pattern and is
re-viewed on the other side (still no copy).  Framework detection goes through
``array_api_compat``, which never imports a framework the caller has not imported already.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any, NamedTuple

import array_api_compat
import numpy as np

from . import _dlpack

_bfloat16: np.dtype | None = None


def bfloat16_dtype() -> np.dtype:
    """Return numpy's bfloat16 dtype (``ml_dtypes.bfloat16``), importing ml_dtypes on first use."""
    global _bfloat16
    if _bfloat16 is None:
        import ml_dtypes

        _bfloat16 = np.dtype(ml_dtypes.bfloat16)
    return _bfloat16


def is_bfloat16(dtype: np.dtype) -> bool:
    """Whether a numpy dtype is bfloat16, without importing ml_dtypes for the other dtypes.

    ml_dtypes' types are of kind ``"V"``, numpy's floats of kind ``"f"``: only the former need the
    comparison, and an array of one means its caller has imported ml_dtypes already.
    """
    return dtype.kind == "V" and dtype == bfloat16_dtype()


def __getattr__(name: str) -> Any:
    """``bfloat16``: the dtype of :func:`bfloat16_dtype`, made on first access."""
    if name == "bfloat16":
        return bfloat16_dtype()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

#: The input dtypes every backend is asked about, by name.
SUPPORTED_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32", "float64")

_DLPACK_CPU = 1
_DLPACK_CUDA = 2
_DLPACK_CUDA_MANAGED = 13


class ArrayOrigin(NamedTuple):
    """Where a caller's array came from, so that results can be handed back the same way.

    Attributes
    ----------
    framework : str
        ``"numpy"``, ``"cupy"``, ``"torch"``, ``"jax"`` or the top-level module name of another
        DLPack producer.
    device : str
        ``"cpu"`` or ``"cuda"``.
    device_id : int
        Device ordinal (0 on the host).
    """

    framework: str
    device: str
    device_id: int

    def describe(self) -> str:
        """Return e.g. ``"torch (cuda:0)"``."""
        where = "cpu" if self.device == "cpu" else f"{self.device}:{self.device_id}"
        return f"{self.framework} ({where})"


#: The origin of every numpy array.
NUMPY_ORIGIN = ArrayOrigin("numpy", "cpu", 0)


def describe_value(value: Any) -> str:
    """Return a short description of a value for error messages."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{type(value).__module__}.{type(value).__name__} of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"{type(value).__name__} {value!r}"[:120]


def is_array(value: Any) -> bool:
    """Return True for anything the array layer can take: numpy, CuPy or a DLPack producer."""
    if isinstance(value, np.ndarray):
        return True
    if hasattr(value, "__dlpack__") and hasattr(value, "__dlpack_device__"):
        return True
    return bool(array_api_compat.is_cupy_array(value))


def _cupy(name: str = "array") -> ModuleType:
    try:
        return importlib.import_module("cupy")
    except ImportError as error:
        raise TypeError(
            f"{name}: expected a host array, or CuPy installed for arrays on a CUDA device "
            "(pip install 'fastattn[gpu]'); received an array on a CUDA device"
        ) from error


def _import_dlpack(module: Any, value: Any, name: str) -> Any:
    """``module.from_dlpack(value)``, with a refusal turned into a TypeError naming the argument."""
    try:
        return module.from_dlpack(value)
    except (BufferError, RuntimeError, TypeError, ValueError) as error:
        raise TypeError(
            f"{name}: expected a dense array of a supported dtype that DLPack can share, "
            f"received {describe_value(value)} ({type(error).__name__}: {error})"
        ) from error


def to_native(value: Any, name: str) -> tuple[Any, ArrayOrigin]:
    """View a caller's array as a numpy or CuPy array, without copying.

    Parameters
    ----------
    value : array-like
        numpy array, CuPy array, or any object with ``__dlpack__`` and ``__dlpack_device__``.
    name : str
        The argument's name, used in error messages.

    Returns
    -------
    native : numpy.ndarray or cupy.ndarray
        The same memory, same shape and strides.
    origin : ArrayOrigin
        What to hand results back as.
    """
    if isinstance(value, np.ndarray):
        return value, NUMPY_ORIGIN
    if (_torch is not None and type(value) is _torch_tensor) or array_api_compat.is_torch_array(value):
        return _torch_to_native(value, name)
    if array_api_compat.is_cupy_array(value):
        return value, ArrayOrigin("cupy", "cuda", int(value.device.id))
    if not is_array(value):
        raise TypeError(
            f"{name}: expected a numpy array, a CuPy array or a DLPack-capable tensor, "
            f"received {describe_value(value)}"
        )
    framework = type(value).__module__.split(".")[0]
    device_type, device_id = value.__dlpack_device__()
    if device_type == _DLPACK_CPU:
        return _import_dlpack(np, value, name), ArrayOrigin(framework, "cpu", 0)
    if device_type in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED):
        return _import_dlpack(_cupy(name), value, name), ArrayOrigin(framework, "cuda", int(device_id))
    raise TypeError(
        f"{name}: expected an array on the CPU or a CUDA device, received one on DLPack device "
        f"type {device_type} ({describe_value(value)})"
    )


#: The origin of every torch CPU tensor.
TORCH_CPU = ArrayOrigin("torch", "cpu", 0)
#: torch, its Tensor type and its DLPack export, once the first tensor has come through
#: (``import fastattn`` never imports torch).
_torch: Any = None
_torch_tensor: Any = None
_to_dlpack: Any = None


def _import_torch() -> None:
    global _torch, _torch_tensor, _to_dlpack
    import torch
    import torch.utils.dlpack

    _torch, _torch_tensor, _to_dlpack = torch, torch.Tensor, torch.utils.dlpack.to_dlpack


def _torch_to_native(tensor: Any, name: str) -> tuple[Any, ArrayOrigin]:
    if _torch is None:
        _import_torch()
    native = _dlpack.tensor_view(tensor, _torch_tensor, _to_dlpack)
    if native is not None:
        return native, TORCH_CPU
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_cpu:
        if tensor.is_cuda:
            native = _import_dlpack(_cupy(name), tensor, name)
            return native, ArrayOrigin("torch", "cuda", int(tensor.device.index or 0))
        raise TypeError(f"{name}: expected a torch tensor on cpu or cuda, received one on {tensor.device}")
    # Tensor.numpy() shares the memory like DLPack, at a quarter of its cost per call (the dtypes and
    # cases _dlpack.host_view does not view).
    bits = tensor.view(_torch.int16) if tensor.dtype is _torch.bfloat16 else tensor
    try:
        native = bits.numpy()
    except (RuntimeError, TypeError, ValueError) as error:
        raise TypeError(
            f"{name}: expected a dense array of a supported dtype that DLPack can share, "
            f"received {describe_value(tensor)} ({type(error).__name__}: {error})"
        ) from error
    return (native.view(bfloat16_dtype()) if bits is not tensor else native), TORCH_CPU


def natives_of(arrays: dict[str, Any], labels: dict[str, str]) -> tuple[dict[str, Any], Any]:
    """View every array of a call as a numpy or CuPy array, without copying.

    Parameters
    ----------
    arrays : dict of str to array-like
        The call's arrays by name, as the caller passed them.
    labels : dict of str to str
        The caller's names of the arrays, for error messages (a name without one is its own).

    Returns
    -------
    natives : dict of str to array
        The native arrays, by the same names.
    origins : ArrayOrigin or dict of str to ArrayOrigin
        One origin shared by every array (a call of torch CPU tensors), or each array's own.
    """
    if _torch is not None:  # once a tensor has come through: a call of torch CPU tensors, in C
        views = _dlpack.tensor_views(arrays, _torch_tensor, _to_dlpack)
        if views is not None:
            return views, TORCH_CPU
    natives: dict[str, Any] = {}
    origins: dict[str, ArrayOrigin] = {}
    for name, value in arrays.items():
        natives[name], origins[name] = to_native(value, labels.get(name, name))
    return natives, origins


def from_native(native: Any, origin: ArrayOrigin) -> Any:
    """Hand a numpy or CuPy result back in the caller's framework, without copying.

    Parameters
    ----------
    native : numpy.ndarray or cupy.ndarray
        A result computed by a backend on ``origin``'s device.
    origin : ArrayOrigin
        As returned by :func:`to_native` for the caller's input.
    """
    if origin is TORCH_CPU and not is_bfloat16(native.dtype):  # the common torch case, first
        return _torch.from_numpy(native)
    if origin.framework in ("numpy", "cupy"):
        return native
    if origin.framework == "torch":  # _torch_to_native has imported torch
        if origin.device == "cuda":
            return _torch.from_dlpack(native)
        if is_bfloat16(native.dtype):
            return _torch.from_numpy(native.view(np.int16)).view(_torch.bfloat16)
        return _torch.from_numpy(native)
    if origin.framework == "jax":
        import jax.numpy as jnp

        return jnp.from_dlpack(native)
    module = sys.modules.get(origin.framework)
    converter = getattr(module, "from_dlpack", None)
    return converter(native) if converter is not None else native


def namespace(native: Any) -> ModuleType:
    """Return the array module (numpy or cupy) of a native array."""
    return np if isinstance(native, np.ndarray) else _cupy()


_DTYPE_NAMES: dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """Return the canonical name of a numpy/CuPy dtype (``"bfloat16"`` for ml_dtypes')."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = np.dtype(dtype).name
    return name


def numpy_dtype(name: str) -> np.dtype:
    """Return the numpy dtype for one of :data:`SUPPORTED_DTYPES`."""
    return bfloat16_dtype() if name == "bfloat16" else np.dtype(name)


def accumulation_dtype(name: str) -> np.dtype:
    """float64 for float64 inputs, float32 for every other supported dtype (the contract's rule)."""
    return np.dtype(np.float64) if name == "float64" else np.dtype(np.float32)


def last_axis_contiguous(native: Any) -> Any:
    """Return ``native`` itself when its last axis is contiguous, else a contiguous copy."""
    if native.shape[-1] <= 1 or native.strides[-1] == native.itemsize:
        return native
    return namespace(native).ascontiguousarray(native)


def empty_bhsd(xp: ModuleType, shape: tuple[int, int, int, int], dtype: Any, layout: str) -> Any:
    """Allocate a ``(B, H, S, D)``-shaped result whose memory is contiguous in ``layout``.

    For ``"bshd"`` the buffer is ``(B, S, H, D)`` and a swapped view is returned, so handing it back
    to the caller in their layout is again a view.
    """
    batch, heads, seq, dim = shape
    if layout == "bshd":
        return xp.empty((batch, seq, heads, dim), dtype=dtype).swapaxes(1, 2)
    return xp.empty(shape, dtype=dtype)


def swap_layout(native: Any, layout: str) -> Any:
    """Move between ``layout`` order and ``(B, H, S, D)`` order (a view, never a copy).

    For ``"bshd"`` this swaps axes 1 and 2, which is its own inverse, so the same call turns a
    caller's ``bshd`` input into the ``bhsd`` view backends take and a ``bhsd`` result back.
    """
    return native.swapaxes(1, 2) if layout == "bshd" else native
