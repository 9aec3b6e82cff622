"""A preallocated key/value cache for incremental decoding, with a length per batch row.

The cache shows ``(batch, max_seq, num_kv_heads, head_dim)`` arrays: ``"bshd"`` order, the order in
which :class:`~fastattn.nn.MultiheadAttention` projects keys and values, so appending is a slice
assignment and attention reads views of the buffers (sliced to the longest row) without a copy.
Positions at or beyond a row's length are padding: attention is told the per-row lengths and never
sees them.  The buffers start zeroed, so padding is always finite.

The memory behind those views is head-major, ``(batch, num_kv_heads, max_seq, head_dim)``: each kv
head's tokens lie back to back, so a decode streams one run of bytes per head.  Token-major memory
(the views' own order) puts a head's consecutive tokens ``num_kv_heads * head_dim`` elements apart,
a pattern the memory system reads at about two thirds of its contiguous speed (a streaming read on
a 2-core Zen 5: 29-33 against 48-65 GB/s); the float16 C6 decode through the cache went from 7.43
to 2.34-3.55 ms there (benchmarks/README.md).  Host buffers also start on a cache line (numpy puts
large arrays 16 bytes past one, and every row then spans one line more).
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from .. import _arrays
from ._checks import device_name, float_dtype, positive_int
from ._device import array_module, host_ints, native_input

#: Bytes a host buffer's start is a multiple of: a cache line.
LINE_BYTES = 64


def zeros_on_lines(xp: Any, shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """A zeroed ``shape`` array of ``dtype`` that starts on a cache line (numpy: a view into a
    slightly larger byte buffer; CuPy's allocations already start on 256 bytes)."""
    if xp is not np:
        return xp.zeros(shape, dtype=dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(nbytes + LINE_BYTES, dtype=np.uint8)
    start = -raw.ctypes.data % LINE_BYTES
    return raw[start : start + nbytes].view(dtype).reshape(shape)


class KVCache:
    """Keys and values of the tokens seen so far, for one attention layer.

    Parameters
    ----------
    batch : int
        Number of sequences decoded together.
    max_seq : int
        Capacity in tokens per sequence.
    num_kv_heads : int
        Key/value heads of the layer (``num_kv_heads`` of :class:`MultiheadAttention`).
    head_dim : int
        Size of each head.
    dtype : numpy dtype
        float16, bfloat16, float32 or float64: the layer's dtype.
    device : {"cpu", "cuda"}
        numpy buffers on the host, CuPy buffers on the GPU.

    Attributes
    ----------
    keys, values : array, dtype (batch, max_seq, num_kv_heads, head_dim)
        The whole buffers, as views of head-major memory (see the module's notes: not
        C-contiguous); row b holds valid tokens at positions ``[0, lengths[b])``.
    """

    def __init__(
        self,
        batch: int,
        max_seq: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: Any = np.float32,
        device: str = "cpu",
    ) -> None:
        self.batch = positive_int("batch", batch)
        self.max_seq = positive_int("max_seq", max_seq)
        self.num_kv_heads = positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = positive_int("head_dim", head_dim)
        self.dtype = float_dtype("dtype", dtype)
        self.device = device_name("device", device)
        xp = array_module(self.device)
        head_major = (self.batch, self.num_kv_heads, self.max_seq, self.head_dim)
        self.keys = zeros_on_lines(xp, head_major, self.dtype).transpose(0, 2, 1, 3)
        self.values = zeros_on_lines(xp, head_major, self.dtype).transpose(0, 2, 1, 3)
        self._lengths = np.zeros(self.batch, dtype=np.int64)

    def __repr__(self) -> str:
        return (
            f"KVCache(batch={self.batch}, max_seq={self.max_seq}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype.name}, device={self.device!r}, "
            f"lengths={self._lengths.tolist()})"
        )

    @property
    def lengths(self) -> np.ndarray:
        """int64 (batch,): tokens held by each row (a copy, on the host)."""
        return self._lengths.copy()

    @property
    def max_length(self) -> int:
        """The longest row's length: how far :meth:`view` reaches."""
        return int(self._lengths.max())

    @property
    def nbytes(self) -> int:
        """Bytes of the two preallocated buffers."""
        return int(self.keys.nbytes + self.values.nbytes)

    def view(self) -> tuple[Any, Any]:
        """Return views ``(keys, values)`` of the buffers, ``(batch, max_length, Hkv, D)`` each."""
        used = self.max_length
        return self.keys[:, :used], self.values[:, :used]

    def append(self, keys: Any, values: Any, counts: Any = None) -> np.ndarray:
        """Write new tokens after each row's last one.

        Parameters
        ----------
        keys, values : array, (batch, S, num_kv_heads, head_dim)
            numpy, CuPy or DLPack array on the cache's device, in the cache's dtype.
        counts : int array (batch,), optional
            How many of the S new tokens are real in each row (the rest, at the end, are padding
            and are not stored); all S by default.

        Returns
        -------
        numpy.ndarray, int64 (batch,)
            The position of each row's first new token (its length before the call).
        """
        new_keys, _ = native_input("keys", keys, self.device)
        new_values, _ = native_input("values", values, self.device)
        expected = (self.batch, None, self.num_kv_heads, self.head_dim)
        for name, array in (("keys", new_keys), ("values", new_values)):
            if array.ndim != 4 or any(size not in (None, got) for size, got in zip(expected, array.shape)):
                raise ValueError(
                    f"{name}: expected shape ({self.batch}, S, {self.num_kv_heads}, {self.head_dim}) "
                    f"(batch, S, num_kv_heads, head_dim), received {tuple(array.shape)}"
                )
            if array.dtype != self.dtype:
                raise TypeError(
                    f"{name}: expected dtype {self.dtype.name} (the cache's), "
                    f"received {_arrays.dtype_name(array.dtype)}"
                )
        steps = new_keys.shape[1]
        if new_values.shape[1] != steps:
            raise ValueError(
                f"values: expected {steps} tokens like keys, received shape {tuple(new_values.shape)}"
            )
        if steps < 1:
            raise ValueError(f"keys: expected at least one token, received shape {tuple(new_keys.shape)}")
        row_counts = self._counts(counts, steps)
        starts = self._lengths.copy()
        ends = starts + row_counts
        if int(ends.max()) > self.max_seq:
            row = int(np.argmax(ends))
            raise ValueError(
                f"keys: expected room for {int(row_counts[row])} tokens in row {row}, which holds "
                f"{int(starts[row])} of max_seq={self.max_seq}"
            )
        if counts is None and int(starts.min()) == int(starts.max()):
            start = int(starts[0])
            self.keys[:, start : start + steps] = new_keys
            self.values[:, start : start + steps] = new_values
        else:
            for row, (start, end) in enumerate(zip(starts.tolist(), ends.tolist())):
                self.keys[row, start:end] = new_keys[row, : end - start]
                self.values[row, start:end] = new_values[row, : end - start]
        self._lengths = ends
        return starts

    def _counts(self, counts: Any, steps: int) -> np.ndarray:
        if counts is None:
            return np.full(self.batch, steps, dtype=np.int64)
        host = host_ints("counts", counts, self.batch)
        if int(host.min()) < 0 or int(host.max()) > steps:
            raise ValueError(
                f"counts: expected values in [0, {steps}] (the tokens given), received values in "
                f"[{int(host.min())}, {int(host.max())}]"
            )
        return host

    def truncate(self, lengths: Any) -> None:
        """Forget every token at or beyond ``lengths`` (an int, or an int array (batch,)).

        Each new length must be at most the row's current one; the data stays in the buffer but is
        never seen again.
        """
        if isinstance(lengths, numbers.Integral) and not isinstance(lengths, bool):
            new = np.full(self.batch, int(lengths), dtype=np.int64)
        else:
            new = host_ints("lengths", lengths, self.batch)
        if int(new.min()) < 0 or bool(np.any(new > self._lengths)):
            raise ValueError(
                f"lengths: expected values in [0, current length] per row (current "
                f"{self._lengths.tolist()}), received {new.tolist()}"
            )
        self._lengths = new

    def reset(self) -> None:
        """Empty every row (lengths back to 0); the buffers are kept."""
        self._lengths = np.zeros(self.batch, dtype=np.int64)
