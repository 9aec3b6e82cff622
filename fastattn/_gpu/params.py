"""The one argument of every GPU launch: ``Params`` of ``kernels/common.cuh`` as a numpy structured scalar.

A call fills one record from its problem (:func:`from_problem`: sizes, scale, softcap, the
visibility rules, dropout) and sets the addresses of its arrays (:func:`set_operand`,
:func:`set_pointer`); every launch of the call then passes that record, which CuPy (and the SIMT
emulator) hand to the kernel by value.  :data:`PARAMS` mirrors the C++ struct field for field with
C alignment (``align=True``); ``tests/emulator/test_params.py`` compiles the struct and checks every
offset and the size against this dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._codes import MASK_CODES
from .._dropout import keep_scale
from .._problem import AttentionExtras, AttentionProblem
from . import _launch

_POINTER = np.uint64

OPERAND = np.dtype([("data", _POINTER), ("sb", np.int64), ("sh", np.int64), ("ss", np.int64)], align=True)
VISIBILITY = np.dtype(
    [
        ("causal", np.int32), ("offset", np.int32), ("window_left", np.int32), ("window_right", np.int32),
        ("mask", _POINTER), ("mask_kind", np.int32),
        ("m_sb", np.int64), ("m_sh", np.int64), ("m_sq", np.int64), ("m_sk", np.int64),
        ("key_lengths", _POINTER),
    ],
    align=True,
)  # fmt: skip
DROPOUT = np.dtype(
    [("key", np.uint32, (2,)), ("offset", np.uint32), ("keep_scale", np.float32), ("threshold", np.uint64)],
    align=True,
)
#: The operands of Params, in the struct's order.
OPERANDS = ("q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv")
#: The float32 scratch pointers of Params, in the struct's order.
SCRATCH = ("lse2", "delta", "dq_accum", "partial_out", "partial_lse")
PARAMS = np.dtype(
    [
        *((name, OPERAND) for name in OPERANDS),
        *((name, _POINTER) for name in SCRATCH),
        ("rows", np.int64),
        *((name, np.int32) for name in (
            "batch", "heads_q", "heads_kv", "seq_q", "seq_k", "head_dim", "head_dim_v", "group", "keys_per_split",
        )),
        ("scale", np.float32), ("softcap", np.float32),
        ("rules", VISIBILITY),
        ("dropout", DROPOUT),
    ],
    align=True,
)  # fmt: skip
#: The GPU kernels read every mask kind but float64 (the cuda backend declines it).
MASK_KINDS = {name: code for name, code in MASK_CODES.items() if name not in (None, "float64")}


def from_problem(problem: AttentionProblem, extras: AttentionExtras) -> Any:
    """A ``Params`` record for one call with every field the problem decides; addresses still 0.

    The mask and key_lengths addresses come from ``extras`` (they are arrays of the call).
    """
    record = np.zeros((), PARAMS)
    record["rows"] = problem.batch * problem.heads_q * problem.seq_q
    for name in ("batch", "heads_q", "heads_kv", "seq_q", "seq_k", "head_dim", "head_dim_v"):
        record[name] = getattr(problem, name)
    record["group"] = problem.group_size
    record["scale"] = problem.scale
    record["softcap"] = problem.softcap or 0.0
    rules = record["rules"]
    rules["causal"] = problem.causal is not None
    rules["offset"] = problem.key_offset
    rules["window_left"], rules["window_right"] = problem.window if problem.window is not None else (-1, -1)
    mask = extras.mask
    if mask is not None:
        rules["mask"] = _launch.address(mask)
        rules["mask_kind"] = MASK_KINDS[mask.dtype.name]
        for axis, field in enumerate(("m_sb", "m_sh", "m_sq", "m_sk")):
            rules[field] = 0 if mask.shape[axis] == 1 else mask.strides[axis] // mask.itemsize
    if extras.key_lengths is not None:
        rules["key_lengths"] = _launch.address(extras.key_lengths)
    dropout = extras.dropout
    if dropout is not None:
        record["dropout"]["key"] = dropout.key
        record["dropout"]["offset"] = dropout.offset
        record["dropout"]["keep_scale"] = keep_scale(dropout.p)
        record["dropout"]["threshold"] = dropout.threshold
    return record


def set_operand(record: Any, name: str, array: Any) -> None:
    """Point operand ``name`` of ``record`` at ``array`` ((B, H, S, ...) or (B, H, S) lse-shaped)."""
    operand = record[name]
    operand["data"] = _launch.address(array)
    operand["sb"], operand["sh"], operand["ss"] = (stride // array.itemsize for stride in array.strides[:3])


def set_pointer(record: Any, name: str, array: Any) -> None:
    """Point scratch field ``name`` (one of :data:`SCRATCH`) at a contiguous float32 ``array``."""
    record[name] = _launch.address(array)


def argument(record: Any) -> tuple[Any]:
    """The launch argument tuple: the record as a structured scalar (copied: later edits of the
    record do not reach a launch already made)."""
    return (record[()].copy(),)
