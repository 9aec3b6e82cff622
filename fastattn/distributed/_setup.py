"""The collective start of a sharded attention call: validate on every rank, agree, plan.

Every rank validates its own shards, then one all-reduce tells each rank every other rank's
verdict and sizes, so that either all ranks go on with one plan or all raise (a rank that raised
alone would leave the others waiting).  The plan says which global positions each rank's queries
and keys hold, and the options every block shares.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from .. import _arrays, _validation
from .._options import AttentionOptions
from ..backends.registry import UnsupportedError
from ._comm import Communicator
from ._sharding import Chunk, check_sharding, sequence_chunks

#: Columns of the all-reduced table of every rank's verdict and sizes.
_FIELDS = ("failed", "dtype", "batch", "heads_q", "heads_kv", "head_dim", "head_dim_v", "seq_q", "seq_k")


class ShardedCall(NamedTuple):
    """One rank's validated share of a sharded attention call.

    Attributes
    ----------
    comm : Communicator
    call : PreparedCall
        This rank's shards, validated (native ``(B, H, S, D)`` views, origin, problem).
    query_chunks, key_chunks : list of list of Chunk
        Every rank's query and key positions.
    aligned_offset : int
        ``Sk - Sq`` of the whole sequence under bottom-right alignment, else 0.
    causal : bool
    window : (int, int) or None
    key_lengths : int64 numpy array (B,) or None
        Global valid key counts, on the host.
    block_options : AttentionOptions
        scale, softcap and backend of every block, layout ``"bhsd"``.
    shapes : numpy array (R, len(_FIELDS))
        Every rank's sizes.
    """

    comm: Communicator
    call: Any
    query_chunks: list[list[Chunk]]
    key_chunks: list[list[Chunk]]
    aligned_offset: int
    causal: bool
    window: tuple[int, int] | None
    key_lengths: np.ndarray | None
    block_options: AttentionOptions
    shapes: np.ndarray

    def seq_k(self, rank: int) -> int:
        """Number of key positions rank ``rank`` holds."""
        return int(self.shapes[rank, _FIELDS.index("seq_k")])


def check_communicator(comm: Any) -> Communicator:
    """Return ``comm`` if it is a :class:`Communicator`, else raise ``TypeError``."""
    if not isinstance(comm, Communicator):
        raise TypeError(
            "comm: expected a fastattn.distributed communicator (MPICommunicator, TorchCommunicator, "
            f"SimulatedCommunicator), received {_arrays.describe_value(comm)}"
        )
    return comm


def decline(name: str, mask: Any, dropout_p: Any) -> None:
    """Raise :class:`UnsupportedError` for the options sharded attention does not run."""
    reasons = []
    if mask is not None:
        reasons.append(
            "a dense mask: its (Sq, Sk) blocks would have to travel with K/V; use causal, window or "
            "key_lengths, or run the call on one process"
        )
    if dropout_p != 0:
        reasons.append("dropout: the mask's counters are per call, not per block of a sharded call")
    if reasons:
        raise UnsupportedError(f"{name}: a sequence split across ranks cannot run these options", reasons)


def sharded_options(
    causal: Any, scale: Any, window: Any, softcap: Any, key_lengths: Any, layout: Any, backend: Any
) -> AttentionOptions:
    """The options of a sharded call (those whole-sequence attention shares), checked by :func:`start`."""
    return AttentionOptions(
        causal=causal, scale=scale, key_lengths=key_lengths, window=window, softcap=softcap, layout=layout,
        backend=backend,
    )  # fmt: skip


def hand_back(native: Any, plan: ShardedCall) -> Any:
    """A native ``(B, H, S, D)`` result in the inputs' dtype, layout and framework (itself, with no
    copy, where it already has the dtype and the layout is ``"bhsd"``)."""
    call = plan.call
    dtype, layout = call.arrays["q"].dtype, call.problem.layout
    if native.dtype != dtype or layout != "bhsd":
        result = _arrays.empty_bhsd(_arrays.namespace(native), native.shape, dtype, layout)
        result[...] = native
        native = _arrays.swap_layout(result, layout)
    return _arrays.from_native(native, call.origin)


def _local_row(call: Any) -> np.ndarray:
    p = call.problem
    dtype = _arrays.SUPPORTED_DTYPES.index(p.dtype)
    return np.array(
        [0, dtype, p.batch, p.heads_q, p.heads_kv, p.head_dim, p.head_dim_v, p.seq_q, p.seq_k], dtype=np.int64
    )


def start(
    name: str,
    comm: Any,
    direction: str,
    arrays: dict[str, Any],
    options: AttentionOptions,
    sharding: Any,
) -> ShardedCall:
    """Validate this rank's shards, agree with every rank, and plan the call.

    Raises
    ------
    ValueError, TypeError
        On the rank whose input is wrong, that error; on the others a ``RuntimeError`` naming it.
        Also (on every rank) when the ranks' sizes disagree or do not follow ``sharding``.
    """
    comm = check_communicator(comm)
    error: Exception | None = None
    row = np.zeros(len(_FIELDS), dtype=np.int64)
    try:
        check_sharding(sharding)
        call = _validation.prepare(direction, arrays, options._replace(key_lengths=None))  # type: ignore[arg-type]
        row = _local_row(call)
    except (TypeError, ValueError, UnsupportedError) as caught:
        error = caught
        row[0] = 1
    table = np.zeros((comm.size, len(_FIELDS)), dtype=np.int64)
    table[comm.rank] = row
    shapes = comm.allreduce(table)
    if error is not None:
        raise error
    failed = [rank for rank in range(comm.size) if shapes[rank, 0]]
    if failed:
        raise RuntimeError(f"{name}: rank(s) {failed} rejected their inputs (their error says why)")
    for column in range(1, len(_FIELDS) - 2):
        if (shapes[:, column] != shapes[0, column]).any():
            raise ValueError(
                f"{name}: expected every rank to have the same {_FIELDS[column]}, received "
                f"{shapes[:, column].tolist()} on ranks 0..{comm.size - 1}"
            )
    lengths: dict[str, int] = {}
    chunks: dict[str, list[list[Chunk]]] = {}
    for axis, field in (("q", "seq_q"), ("k", "seq_k")):
        held = shapes[:, _FIELDS.index(field)]
        lengths[axis] = int(held.sum())
        chunks[axis] = sequence_chunks(lengths[axis], comm.size, sharding)
        expected = [sum(chunk.size for chunk in rank_chunks) for rank_chunks in chunks[axis]]
        if held.tolist() != expected:
            raise ValueError(
                f"{name}: expected {axis} shards of {expected} positions on ranks 0..{comm.size - 1} "
                f"({sharding} sharding of {lengths[axis]} positions), received {held.tolist()}"
            )
    causal = _validation.causal_mode(options.causal)
    key_lengths = _host_lengths(options.key_lengths, shapes[0, _FIELDS.index("batch")], lengths["k"])
    block_options = AttentionOptions(scale=options.scale, softcap=options.softcap, backend=options.backend)
    if block_options.scale is None:
        block_options = block_options._replace(scale=1.0 / math.sqrt(int(shapes[0, _FIELDS.index("head_dim")])))
    window = None if options.window is None else (int(options.window[0]), int(options.window[1]))
    return ShardedCall(
        comm,
        call,
        chunks["q"],
        chunks["k"],
        _validation.aligned_offset(causal, lengths["q"], lengths["k"]),
        causal is not None,
        window,
        key_lengths,
        block_options,
        shapes,
    )


def _host_lengths(key_lengths: Any, batch: int, seq_k: int) -> np.ndarray | None:
    """The global key_lengths as a host int64 array, checked as :func:`fastattn.attention` checks
    them, against the whole key sequence."""
    if key_lengths is None:
        return None
    native, _ = _arrays.to_native(key_lengths, "key_lengths")
    _validation._key_lengths(native, batch)
    host = (native.get() if hasattr(native, "get") else np.asarray(native)).astype(np.int64)
    _validation._lengths_in_range(host, seq_k)
    return host
