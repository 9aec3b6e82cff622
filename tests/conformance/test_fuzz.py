"""The big randomized run: at least 10,000 problems per backend against the float64 oracle.

Marked ``slow``: the default ``pytest`` skips it (the conformance tests already run 500 examples per
backend); ``pytest -m slow`` runs it.  ``FASTATTN_FUZZ_EXAMPLES`` changes the count.  Each problem
runs the forward and the backward with fresh data from its own seed; on a mismatch the failure
names that seed and the whole case, so it can be replayed exactly (hypothesis also prints its
``@reproduce_failure`` blob and shrinks the case first).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings

from ._cases import Case, cases
from .test_backward import check_backward
from .test_forward import check_forward

FUZZ_EXAMPLES = int(os.environ.get("FASTATTN_FUZZ_EXAMPLES", "10000"))


@pytest.mark.slow
@settings(max_examples=FUZZ_EXAMPLES, database=None, suppress_health_check=list(HealthCheck))
@given(case=cases(dtypes=("float64", "float32", "float16", "bfloat16")))
def test_fuzz_forward_and_backward(backend: str, device: str, case: Case) -> None:
    try:
        check_forward(backend, device, case)
        check_backward(backend, device, case)
    except AssertionError as error:
        raise AssertionError(f"mismatch for the case with data seed {case.seed}: {case!r}\n{error}") from error
