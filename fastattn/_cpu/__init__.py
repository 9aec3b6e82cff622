"""Compiled CPU kernels (Cython + OpenMP). Import through ``fastattn.backends.cpu``.

OpenMP's idle threads spin for a while after each parallel region by default.  Between kernels
that is wasted, and right before numpy's own threaded BLAS (a projection, the next layer) it
fights BLAS for the cores: a loop alternating a small matmul with a small attention call ran 40x
slower here.  So, unless the caller set ``OMP_WAIT_POLICY`` themselves, the OpenMP runtime that
the extensions load is started with passive waiting.  The runtime reads the variable once, when
it is loaded, which happens on the import below; the variable is removed again afterwards so that
other libraries loaded later (torch's own OpenMP runtime, for one) see the environment unchanged.
"""

import os

_caller_policy = os.environ.get("OMP_WAIT_POLICY")
if _caller_policy is None:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
try:
    from . import _runtime  # noqa: F401  (loads the OpenMP runtime, which reads the variable now)
finally:
    if _caller_policy is None:
        del os.environ["OMP_WAIT_POLICY"]
