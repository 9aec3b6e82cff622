"""Per-call overhead: the Python path from the API to the kernel, against torch's in the same run.

The call is a decode step so small that the kernel itself takes well under a microsecond:
B=1, H=1, Sq=1, Sk=16, D=64, float32.  Timed, each as the median of ``--rounds`` rounds of
``--calls`` calls, the implementations interleaved within every round (the machine is shared):

* forward: fastattn on numpy (``backend="cpu"`` and automatic selection), ``fastattn.torch``'s
  ``scaled_dot_product_attention`` under ``torch.no_grad()`` and with inputs that require grad, and
  torch's own ``F.scaled_dot_product_attention`` in both modes (the grad mode is set around each
  timed loop, as a decode loop sets it once, so it costs neither side per call);
* forward+backward: fastattn on numpy (``attention(return_lse=True)`` + ``attention_backward``),
  ``fastattn.torch`` and torch SDPA through ``torch.autograd.grad``;
* one decode step of a layer with 128 cached tokens (E=512, 8 query heads): fastattn's
  ``nn.MultiheadAttention`` (2 kv heads) appending to its ``KVCache`` (then truncated back to 128,
  inside the timing), against ``torch.nn.MultiheadAttention`` (8 heads; torch has no grouped-query
  attention) fed the concatenation of the 128 past inputs and the new one.  The layer steps are
  interleaved among themselves, after the tiny calls (their matrix products wake thread pools).

``--stages`` also times the stages of the numpy forward separately (options, validation, backend
selection, kernel call, hand-back), those of ``fastattn.torch``'s no-grad forward (tensor views,
validation, run, hand-back), and the floor of any Python ``torch.autograd.Function`` (an identity
function's ``apply`` and its forward+backward): where the remaining microseconds go.

    python benchmarks/bench_overhead.py                 # writes benchmarks/results/overhead-<date>.json
    python benchmarks/bench_overhead.py --rounds 3 --calls 500 --json /tmp/o.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

import fastattn
import fastattn.torch as fastattn_torch
from fastattn import _arrays, _bench, _validation, functional
from fastattn._options import AttentionOptions
from fastattn.backends import registry
from fastattn.nn import KVCache, MultiheadAttention

RESULTS = Path(__file__).with_name("results")
GOALS = {  # DESIGN/issue #18: per-call time as a multiple of torch SDPA's (layer: of torch's layer)
    "numpy forward": ("torch sdpa forward (no_grad)", 1.0),
    "numpy forward+backward": ("torch sdpa forward+backward", 1.0),
    "fastattn.torch forward (no_grad)": ("torch sdpa forward (no_grad)", 1.5),
    "fastattn.torch forward (grad)": ("torch sdpa forward (grad)", 1.5),
    "fastattn.torch forward+backward": ("torch sdpa forward+backward", 1.5),
    "fastattn layer decode step": ("torch layer decode step", 1.0),
}


def _tiny_inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    shapes = {"q": (1, 1, 1, 64), "k": (1, 1, 16, 64), "v": (1, 1, 16, 64), "dout": (1, 1, 1, 64)}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def tiny_calls(rng: np.random.Generator) -> dict[str, Callable[[], Any]]:
    """The tiny attention calls, by name; each runs one call (or one forward+backward)."""
    a = _tiny_inputs(rng)
    q, k, v, dout = a["q"], a["k"], a["v"], a["dout"]
    t = {name: torch.from_numpy(x) for name, x in a.items()}
    tg = {name: torch.from_numpy(x.copy()).requires_grad_() for name, x in a.items() if name != "dout"}

    def numpy_forward_backward() -> Any:
        out, lse = fastattn.attention(q, k, v, return_lse=True, backend="cpu")
        return fastattn.attention_backward(dout, q, k, v, out, lse, backend="cpu")

    def forward_backward(function: Callable[..., Any]) -> Callable[[], Any]:
        inputs = (tg["q"], tg["k"], tg["v"])
        return lambda: torch.autograd.grad(function(*inputs), inputs, t["dout"])

    calls = {
        "numpy forward": lambda: fastattn.attention(q, k, v, backend="cpu"),
        "numpy forward (automatic backend)": lambda: fastattn.attention(q, k, v),
        "numpy forward+backward": numpy_forward_backward,
        "fastattn.torch forward (no_grad)": lambda: fastattn_torch.scaled_dot_product_attention(t["q"], t["k"], t["v"]),
        "fastattn.torch forward (grad)": lambda: fastattn_torch.scaled_dot_product_attention(tg["q"], tg["k"], tg["v"]),
        "fastattn.torch forward+backward": forward_backward(fastattn_torch.scaled_dot_product_attention),
        "torch sdpa forward (no_grad)": lambda: F.scaled_dot_product_attention(t["q"], t["k"], t["v"]),
        "torch sdpa forward (grad)": lambda: F.scaled_dot_product_attention(tg["q"], tg["k"], tg["v"]),
        "torch sdpa forward+backward": forward_backward(F.scaled_dot_product_attention),
    }
    return calls


def layer_steps(rng: np.random.Generator, cached: int = 128) -> dict[str, Callable[[], Any]]:
    embed, heads, kv_heads = 512, 8, 2
    layer = MultiheadAttention(embed, heads, kv_heads, causal=True, seed=0).eval()
    cache = KVCache(1, cached + 1, kv_heads, embed // heads)
    layer(rng.standard_normal((1, cached, embed)).astype(np.float32), cache=cache)
    token = rng.standard_normal((1, 1, embed)).astype(np.float32)

    def fastattn_step() -> Any:
        out = layer(token, cache=cache)
        cache.truncate([cached])
        return out

    torch_layer = torch.nn.MultiheadAttention(embed, heads, batch_first=True).eval()
    past = torch.randn(1, cached, embed)
    new = torch.from_numpy(token)

    def torch_step() -> Any:
        keys = torch.cat([past, new], dim=1)
        return torch_layer(new, keys, keys, need_weights=False)[0]

    return {"fastattn layer decode step": fastattn_step, "torch layer decode step": torch_step}


def stages(rng: np.random.Generator) -> dict[str, Callable[[], Any]]:
    """The numpy forward's stages, each alone (on the same inputs, after a warm-up call)."""
    a = _tiny_inputs(rng)
    arrays = {"q": a["q"], "k": a["k"], "v": a["v"]}
    options = AttentionOptions(backend="cpu")
    call = _validation.prepare("forward", arrays, options)
    backend = registry.select(call.problem, "cpu")
    out, lse = backend.forward(call.problem, a["q"], a["k"], a["v"], call.extras)
    return {
        "build AttentionOptions": lambda: AttentionOptions(
            False, None, None, None, None, None, "bhsd", 0.0, None, 0, False, "cpu"
        ),
        "prepare (validate, remembered problem)": lambda: _validation.prepare("forward", arrays, options),
        "registry.select (remembered)": lambda: registry.select(call.problem, "cpu"),
        "cpu backend forward (plan lookup, allocation, kernel)": lambda: backend.forward(
            call.problem, a["q"], a["k"], a["v"], call.extras
        ),
        "whole call after prepare": lambda: functional.finish_forward(call),
        "whole call": lambda: fastattn.attention(a["q"], a["k"], a["v"], backend="cpu"),
    }


class _Identity(torch.autograd.Function):
    """The cheapest autograd function: what any Python ``autograd.Function`` costs per call."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return q.view_as(q)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return dout, None, None


class _Shaped(torch.autograd.Function):
    """An autograd function shaped like fastattn.torch's (q, k, v and a Python object in; out and a
    non-differentiable lse out; five tensors saved; a once-differentiable backward returning three
    fresh gradients), doing no attention: what torch's autograd costs that shape per call."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: Any) -> tuple[torch.Tensor, ...]:
        out, lse = torch.from_numpy(np.empty(q.shape, np.float32)), torch.from_numpy(np.empty(q.shape[:3], np.float32))
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor, dlse: Any) -> tuple[Any, ...]:
        q, k, v, _, _ = ctx.saved_tensors
        return (*(torch.from_numpy(np.empty(x.shape, np.float32)) for x in (q, k, v)), None)


def torch_stages(rng: np.random.Generator) -> dict[str, Callable[[], Any]]:
    """``fastattn.torch``'s no-grad forward in stages, and the floor of a Python autograd function."""
    a = _tiny_inputs(rng)
    tensors = {name: torch.from_numpy(a[name]) for name in ("q", "k", "v")}
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    fastattn_torch.scaled_dot_product_attention(q, k, v)
    options = AttentionOptions()
    call = _validation.prepare("forward", tensors, options)
    out, _ = functional.run_forward(call)
    grads = {name: torch.from_numpy(a[name].copy()).requires_grad_() for name in ("q", "k", "v")}
    leaves = (grads["q"], grads["k"], grads["v"])
    dout = torch.from_numpy(a["dout"])
    return {
        "torch: three tensors viewed (_arrays.natives_of)": lambda: _arrays.natives_of(tensors, {}),
        "torch: prepare (views, key, remembered problem)": lambda: _validation.prepare("forward", tensors, options),
        "torch: run and hand back (functional.finish_forward)": lambda: functional.finish_forward(call),
        "torch: hand-back alone (torch.from_numpy)": lambda: torch.from_numpy(out),
        "torch: whole no-grad call": lambda: fastattn_torch.scaled_dot_product_attention(q, k, v),
        "torch: identity autograd.Function.apply (grad)": lambda: _Identity.apply(*leaves),
        "torch: identity autograd.Function forward+backward (grad)": lambda: torch.autograd.grad(
            _Identity.apply(*leaves), leaves, dout, allow_unused=True
        ),
        "torch: fastattn-shaped autograd.Function, no attention, forward (grad)": lambda: _Shaped.apply(*leaves, None),
        "torch: fastattn-shaped autograd.Function, no attention, forward+backward (grad)": lambda: torch.autograd.grad(
            _Shaped.apply(*leaves, None)[0], leaves, dout
        ),
    }


def _grad_mode(name: str) -> bool:
    """Inference calls (no_grad, the numpy ones, the layer steps) run with autograd off; the mode
    is set around each timed loop, not per call, as a model's decode loop would."""
    return "(grad)" in name or "torch forward+backward" in name or "sdpa forward+backward" in name


def interleaved(calls: dict[str, Callable[[], Any]], rounds: int, count: int) -> dict[str, list[float]]:
    """Microseconds per call of every implementation, one list entry per round."""
    for name, call in calls.items():
        with torch.set_grad_enabled(_grad_mode(name)):
            for _ in range(50):
                call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            with torch.set_grad_enabled(_grad_mode(name)):
                start = time.perf_counter()
                for _ in range(count):
                    call()
                times[name].append((time.perf_counter() - start) / count * 1e6)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--stages", action="store_true", help="also time the stages of the forwards")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    rng = np.random.default_rng()
    # Two groups, each interleaved within itself: the layers' matrix products wake torch's and
    # OpenBLAS's thread pools, whose spinning would otherwise be charged to the tiny calls after them.
    times = interleaved(tiny_calls(rng), args.rounds, args.calls)
    times.update(interleaved(layer_steps(rng), args.rounds, args.calls))
    medians = {name: statistics.median(values) for name, values in times.items()}
    goals = {}
    print(f"{'call':45s} {'median us':>10s}  ratio to its anchor (goal)")
    for name, median in medians.items():
        line = f"{name:45s} {median:10.2f}"
        if name in GOALS:
            anchor, goal = GOALS[name]
            ratio = median / medians[anchor]
            goals[name] = {"anchor": anchor, "ratio": ratio, "goal": goal, "met": ratio <= goal}
            line += f"  {ratio:.2f}x {anchor} (goal <= {goal}x: {'met' if ratio <= goal else 'missed'})"
        print(line)
    stage_medians = None
    if args.stages:
        stage_times = interleaved(stages(rng), args.rounds, args.calls)
        stage_medians = {name: statistics.median(values) for name, values in stage_times.items()}
        stage_times.update(interleaved(torch_stages(rng), args.rounds, args.calls))
        stage_medians = {name: statistics.median(values) for name, values in stage_times.items()}
        print("\nstages of the numpy and fastattn.torch forwards, and the floor of autograd (each timed alone):")
        for name, median in stage_medians.items():
            print(f"  {name:80s} {median:8.2f} us")

    result = {
        "date": datetime.date.today().isoformat(),
        "environment": _bench.environment("cpu"),
        "problem": {"B": 1, "H": 1, "Sq": 1, "Sk": 16, "D": 64, "dtype": "float32"},
        "layer": {"embed_dim": 512, "num_heads": 8, "num_kv_heads": 2, "cached_tokens": 128},
        "rounds": args.rounds,
        "calls_per_round": args.calls,
        "microseconds_per_call": times,
        "median_microseconds": medians,
        "goals": goals,
        "stage_median_microseconds": stage_medians,
    }
    path = args.json or RESULTS / f"overhead-{result['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
