"""``python -m fastattn._gpu.instantiate flash_forward.cu``: print the unit CI's nvcc compiles.

It includes the source and instantiates every template instance the kernel table
(``fastattn/_gpu/ops.py``) can run from it; ``.ci/run`` compiles it for sm_80 and sm_90.
"""

from __future__ import annotations

import sys

from .ops import instantiation_unit

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m fastattn._gpu.instantiate SOURCE.cu")
    sys.stdout.write(instantiation_unit(sys.argv[1]))
