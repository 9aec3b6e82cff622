"""Which instruction-set level of the CPU kernels runs: the highest this CPU supports, or ``FASTATTN_ISA``.

The extension holds the kernels compiled for several levels (setup.py; on x86-64 ``generic``,
``avx2``, ``avx512``, ``avx512bf16``, ``amx``); :func:`select` makes one of them the level new kernel
plans use.  At import the environment variable ``FASTATTN_ISA`` names a level to force (a lower one, to test it
or to compare); a name the build lacks or the CPU cannot run is warned about and the highest
runnable level used instead.
"""

from __future__ import annotations

import os
import warnings
from typing import NamedTuple

from . import _flash

#: The environment variable that forces a level at import.
ENVIRONMENT_VARIABLE = "FASTATTN_ISA"


class IsaLevel(NamedTuple):
    """One level of the build: its name, the width of its vectors in bytes, whether this CPU runs it."""

    name: str
    vector_bytes: int
    runs: bool


def levels() -> list[IsaLevel]:
    """Return the build's levels, lowest first."""
    return [IsaLevel(*level) for level in _flash.isa_levels()]


def runnable() -> list[str]:
    """Return the names of the levels this CPU runs, lowest first."""
    return [level.name for level in levels() if level.runs]


def active() -> str:
    """Return the name of the level new kernel plans use."""
    return _active


def select(name: str | None = None) -> str:
    """Make ``name`` (default: the highest runnable level) the level new kernel plans use.

    Parameters
    ----------
    name : str or None
        A level of :func:`levels` this CPU runs, or None for the highest.

    Returns
    -------
    str
        The level now active.

    Raises
    ------
    ValueError
        When the build has no level ``name`` or this CPU cannot run it.
    """
    global _active
    chosen = runnable()[-1] if name is None else name
    _flash.use_isa(chosen)
    _active = chosen
    return chosen


def _select_from_environment() -> str:
    forced = os.environ.get(ENVIRONMENT_VARIABLE, "").strip()
    if not forced:
        return select()
    try:
        return select(forced)
    except ValueError as error:
        chosen = select()
        warnings.warn(f"{ENVIRONMENT_VARIABLE}={forced}: {error}; running {chosen!r}", RuntimeWarning, stacklevel=2)
        return chosen


_active = _select_from_environment()
