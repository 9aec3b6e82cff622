"""``Params`` (kernels/common.cuh) against its numpy mirror (fastattn/_gpu/params.py), field by field.

A probe kernel, compiled by the emulator from the same header text NVRTC gets, writes the struct's
size and the byte offset of every (nested) field; each must equal the numpy dtype's.  The host
compiler lays the struct out as nvcc does (CUDA keeps the host ABI's layout for such structs), so a
field added, removed, reordered or retyped on one side only fails here instead of feeding a kernel
shifted arguments.
"""

from __future__ import annotations

import numpy as np

from fastattn import _validation
from fastattn._gpu import _launch, emulator, params
from fastattn._options import AttentionOptions


def _fields(dtype: np.dtype, prefix: str = "", base: int = 0) -> list[tuple[str, int]]:
    """``("rules.mask", offset)`` for every leaf field of a structured dtype, in order."""
    leaves = []
    assert dtype.fields is not None
    for name, (field, offset) in dtype.fields.items():
        path = f"{prefix}{name}"
        if field.fields is not None:
            leaves.extend(_fields(field, f"{path}.", base + offset))
        else:
            leaves.append((path, base + offset))
    return leaves


def test_params_layout_matches_the_kernels_struct() -> None:
    fields = _fields(params.PARAMS)
    body = "".join(
        f"    out[{index + 1}] = reinterpret_cast<const char*>(&p.{path}) - reinterpret_cast<const char*>(&p);\n"
        for index, (path, _) in enumerate(fields)
    )
    probe = (
        _launch.source_text("common.cuh")
        + "\n__global__ void params_layout(unsigned long long* out) {\n"
        + "    const fastattn_gpu::Params p{};\n"
        + "    out[0] = sizeof(fastattn_gpu::Params);\n"
        + body
        + "}\n"
    )
    kernel = emulator.compile_source(probe, ("params_layout",)).get_function("params_layout")
    measured = np.zeros(len(fields) + 1, np.uint64)
    kernel((1,), (1,), (measured,))
    assert int(measured[0]) == params.PARAMS.itemsize, "sizeof(Params)"
    for (path, offset), compiled in zip(fields, measured[1:]):
        assert int(compiled) == offset, f"Params::{path}: the kernels' offset {int(compiled)}, numpy's {offset}"


def test_a_call_fills_its_record_from_the_problem() -> None:
    """Sizes, rules, the mask's broadcast strides and the dropout words, as the kernels read them."""
    rng = np.random.default_rng()
    q = rng.standard_normal((2, 4, 5, 32)).astype(np.float16)
    k = rng.standard_normal((2, 2, 9, 32)).astype(np.float16)
    mask = rng.standard_normal((1, 4, 5, 9)).astype(np.float32)
    lengths = np.array([9, 4])
    options = AttentionOptions(
        causal="bottom_right", window=(3, 1), mask=mask, key_lengths=lengths, softcap=2.5,
        dropout_p=0.25, dropout_seed=2**40 + 7, dropout_offset=11,
    )  # fmt: skip
    call = _validation.prepare("forward", {"q": q, "k": k, "v": k}, options)
    record = params.from_problem(call.problem, call.extras)
    (argument,) = params.argument(record)
    assert isinstance(argument, np.void) and len(argument.tobytes()) == params.PARAMS.itemsize
    assert (argument["batch"], argument["heads_q"], argument["heads_kv"], argument["group"]) == (2, 4, 2, 2)
    assert (argument["seq_q"], argument["seq_k"], argument["rows"]) == (5, 9, 40)
    assert np.isclose(argument["scale"], 32**-0.5) and argument["softcap"] == np.float32(2.5)
    rules = argument["rules"]
    assert (rules["causal"], rules["offset"], rules["window_left"], rules["window_right"]) == (1, 4, 3, 1)
    assert rules["mask_kind"] == params.MASK_KINDS["float32"] and rules["m_sb"] == 0
    assert (rules["m_sh"], rules["m_sq"], rules["m_sk"]) == (45, 9, 1)
    assert rules["mask"] == call.extras.mask.ctypes.data != 0
    assert rules["key_lengths"] == call.extras.key_lengths.ctypes.data != 0
    dropout = argument["dropout"]
    assert tuple(dropout["key"]) == (7, 2**8) and dropout["offset"] == 11
    assert dropout["threshold"] == 2**30 and dropout["keep_scale"] == np.float32(1 / 0.75)
