"""The one table of the integer codes that Python hands to the compiled kernels.

The CPU kernels (``fastattn/_cpu/params.h``: ``DtypeCode``, ``MaskKind``) and the CUDA kernels
(``fastattn/_gpu/kernels/common.cuh``: ``MaskKind``) declare the same numbers as C enums;
``tests/test_codes.py`` parses both headers and checks them against this table, so the three cannot
disagree.  A backend that does not read some kind (the GPU kernels take no float64 mask) declines it
by name; the number stays reserved.
"""

from __future__ import annotations

#: Element type of q, k, v, out and the gradients (``DtypeCode`` in the CPU headers).
DTYPE_CODES: dict[str, int] = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 3}

#: How the mask is read (``MaskKind`` in the CPU and CUDA headers): none, bool (True = may attend),
#: or a float dtype added to the scores.
MASK_CODES: dict[str | None, int] = {
    None: 0,
    "bool": 1,
    "float32": 2,
    "float64": 3,
    "float16": 4,
    "bfloat16": 5,
}
