"""The cuda backend's kernel table: every kernel family it can run a call on, declared once.

Each :class:`KernelOp` says what it takes (direction, dtypes) and why it declines a problem, which
template instances a call runs, and every instance it can ever run.  The table drives the cuda
backend's dispatch (:func:`select`: the first op of a direction that accepts the problem), its
reasons to decline (:func:`reasons`), ``explain``'s kernel names (:func:`kernel_names`), and CI's
nvcc compile check (``python -m fastattn._gpu.instantiate SOURCE`` prints a translation unit that
instantiates every instance of one source).

Fast paths (the split-KV decode) are tried first and stand aside silently: the general op of the
same direction and dtype then runs the call, so a fast path's reasons are never a reason to decline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._problem import AttentionProblem
from . import _launch, backward, decode, forward, fp32

#: Why the cuda backend declines float64 (and any dtype no op takes).
NO_KERNEL_FOR_DTYPE = "{dtype} runs on the reference backend through CuPy"


@dataclass(frozen=True)
class KernelOp:
    """One kernel family of the cuda backend.

    Attributes
    ----------
    name : str
        The family's name (its main kernel's), as ``explain`` shows it.
    source : str
        Its file under ``fastattn/_gpu/kernels``.
    direction : str
        ``"forward"`` or ``"backward"``.
    dtypes : tuple of str
        The input dtypes it takes.
    head_dims : str
        The head dimensions it takes, in words (``declines`` holds the rule).
    declines : callable
        ``declines(problem) -> list[str]``: why it cannot run a problem of its direction and dtypes
        (head dims, row strides, mask kinds, dropout, the device's shared memory).
    instances : callable
        ``instances(problem) -> tuple[str, ...]``: the template instances a call runs, in launch order.
    all_instances : callable
        ``all_instances() -> tuple[str, ...]``: every instance ``instances`` can name.
    shared_bytes : callable
        ``shared_bytes(problem) -> int``: the most dynamic shared memory one block of the call asks for.
    launch : callable
        Runs a call: ``launch(problem, q, k, v, out, lse, extras)`` writes ``out`` and ``lse``
        (forward); ``launch(problem, dout, q, k, v, out, lse, extras)`` returns ``(dq, dk, dv)``
        (backward).
    fast_path : bool
        Tried before the general ops and never a reason to decline.
    takes_arrays : callable or None
        ``takes_arrays(q, k, v) -> bool`` where the op needs what only the arrays show (16-byte
        aligned addresses for cp.async): when it is False the next op runs the call.  None: the op
        takes any arrays of an accepted problem (it copies misaligned ones itself).
    """

    name: str
    source: str
    direction: str
    dtypes: tuple[str, ...]
    head_dims: str
    declines: Callable[[AttentionProblem], list[str]]
    instances: Callable[[AttentionProblem], tuple[str, ...]]
    all_instances: Callable[[], tuple[str, ...]]
    shared_bytes: Callable[[AttentionProblem], int]
    launch: Callable[..., Any]
    fast_path: bool = False
    takes_arrays: Callable[[Any, Any, Any], bool] | None = None

    def takes(self, problem: AttentionProblem) -> bool:
        """Whether ``problem`` is of this op's direction and one of its dtypes."""
        return problem.direction == self.direction and problem.dtype in self.dtypes


#: In the order :func:`select` tries them.
OPS = (
    KernelOp(
        "flash_decode", decode.SOURCE, "forward", decode.DTYPES, f"D == Dv in {decode.HEAD_DIMS}",
        decode.declines, decode.instances, decode.all_instances, decode.problem_shared_bytes, decode.forward,
        fast_path=True, takes_arrays=lambda q, k, v: decode.aligned(k, v),
    ),
    KernelOp(
        "fp32_forward", fp32.SOURCE, "forward", fp32.DTYPES, f"D, Dv <= {fp32.MAX_HEAD_DIM}",
        fp32.declines, fp32.forward_instances, fp32.all_forward_instances, fp32.forward_problem_shared_bytes,
        fp32.forward,
    ),
    KernelOp(
        "flash_forward", forward.SOURCE, "forward", forward.DTYPES, f"D == Dv in {forward.HEAD_DIMS}",
        forward.declines, forward.instances, forward.all_instances, forward.problem_shared_bytes, forward.forward,
    ),
    KernelOp(
        "fp32_backward", fp32.SOURCE, "backward", fp32.DTYPES, f"D, Dv <= {fp32.MAX_HEAD_DIM}",
        fp32.declines, fp32.backward_instances, fp32.all_backward_instances, fp32.backward_problem_shared_bytes,
        fp32.backward,
    ),
    KernelOp(
        "flash_backward", backward.SOURCE, "backward", forward.DTYPES, f"D == Dv in {backward.HEAD_DIMS}",
        backward.declines, backward.instances, backward.all_instances, backward.problem_shared_bytes, backward.run,
    ),
)  # fmt: skip


def for_arrays(problem: AttentionProblem, q: Any, k: Any, v: Any) -> KernelOp:
    """The op that runs a call with these arrays: :func:`select`'s, unless it cannot take them.

    Raises
    ------
    RuntimeError
        No op runs ``problem`` (the backend declined it: a caller's mistake).
    """
    op = select(problem)
    if op is not None and op.takes_arrays is not None and not op.takes_arrays(q, k, v):
        op = select(problem, fast_paths=False)
    if op is None:
        raise RuntimeError(f"cuda: no kernel runs {problem.describe()}: {reasons(problem)}")
    return op


def select(problem: AttentionProblem, *, fast_paths: bool = True) -> KernelOp | None:
    """The op that runs ``problem``: the first that takes and accepts it (None when none does).

    ``fast_paths=False`` skips the fast paths (a call whose arrays a fast path cannot take at run
    time, e.g. misaligned addresses, goes to the general op).  Kept per problem (problems are
    interned; the identity is checked) and device kind, so a call does not re-run the declines the
    registry's selection already ran.
    """
    key = (id(problem), fast_paths, _launch.is_emulated())
    kept = _selected.get(key)
    if kept is not None and kept[0] is problem:
        return kept[1]
    chosen = next(
        (op for op in OPS if op.takes(problem) and (fast_paths or not op.fast_path) and not op.declines(problem)),
        None,
    )
    if len(_selected) >= _SELECTIONS_KEPT:
        _selected.clear()
    _selected[key] = (problem, chosen)
    return chosen


#: (id(problem), fast_paths, emulated) -> (problem, op): selections already made.
_selected: dict[tuple[int, bool, bool], tuple[AttentionProblem, KernelOp | None]] = {}
_SELECTIONS_KEPT = 1024


def reasons(problem: AttentionProblem) -> list[str]:
    """Why no op runs ``problem`` (empty when one does): the general ops' reasons, named."""
    if select(problem) is not None:
        return []
    general = [op for op in OPS if op.takes(problem) and not op.fast_path]
    if not general:
        return [NO_KERNEL_FOR_DTYPE.format(dtype=problem.dtype)]
    return [f"{op.name}: {reason}" for op in general for reason in op.declines(problem)]


def kernel_names(problem: AttentionProblem) -> tuple[str, ...]:
    """The template instances that run ``problem`` (empty when no op does)."""
    op = select(problem)
    return () if op is None else op.instances(problem)


def instantiation_unit(source: str) -> str:
    """A translation unit for nvcc: ``source`` and an explicit instantiation of every template
    instance the table's ops of that source can run (CI compiles it for sm_80 and sm_90)."""
    names = dict.fromkeys(name for op in OPS if op.source == source for name in op.all_instances())
    if not names:
        raise ValueError(f"source: expected one of {sorted({op.source for op in OPS})}, received {source!r}")
    lines = [f'#include "{source}"']
    lines += [
        f"template __global__ void {name}(const __grid_constant__ fastattn_gpu::Params);"
        for name in names
        if "<" in name  # plain kernels are compiled with the source
    ]
    return "\n".join(lines) + "\n"
