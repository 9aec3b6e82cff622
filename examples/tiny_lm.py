"""A tiny decoder-only language model in numpy, built on ``fastattn.nn`` layers.

The characters of ``examples/data/tiny_text.txt`` are embedded and passed through pre-norm
transformer blocks (RMSNorm, causal grouped-query attention with RoPE and a sliding window, a ReLU
feed-forward), then
projected to next-character logits.  Every piece has a hand-written backward; the attention's runs
through :func:`fastattn.attention_backward`.  Adam trains the model for a few hundred steps on
random windows of the text, and then it writes text one character at a time, with one
:class:`~fastattn.nn.KVCache` per layer so that each new character costs one decode step.

    python examples/tiny_lm.py                    # 300 steps, then a 300-character sample
    python examples/tiny_lm.py --steps 60 --sample-length 120 --prompt "The sea"
"""

from __future__ import annotations

import argparse
import pathlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fastattn.nn import KVCache, MultiheadAttention

TEXT_PATH = pathlib.Path(__file__).resolve().parent / "data" / "tiny_text.txt"


class Vocabulary:
    """Character-level tokens: each distinct character of a text is one id."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self._ids = {char: index for index, char in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        """int64 ids, (len(text),); raises ValueError for a character the text never used."""
        unknown = sorted(set(text) - set(self._ids))
        if unknown:
            raise ValueError(f"text: expected characters of the training text, received {unknown}")
        return np.array([self._ids[char] for char in text], dtype=np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        """The characters of ``ids``."""
        return "".join(self.chars[int(index)] for index in ids)


class Embedding:
    """Token embedding: ids (B, S) -> vectors (B, S, E)."""

    def __init__(self, vocab_size: int, dim: int, rng: np.random.Generator, dtype: np.dtype) -> None:
        self.weight = rng.normal(0.0, 1.0, (vocab_size, dim)).astype(dtype)
        self.grads: dict[str, np.ndarray] = {}

    def named_parameters(self) -> list[tuple[str, np.ndarray]]:
        """``[("weight", (vocab, E))]``."""
        return [("weight", self.weight)]

    def forward(self, ids: np.ndarray) -> np.ndarray:
        """int ids (B, S) -> (B, S, E)."""
        self._ids = ids
        return self.weight[ids]

    def backward(self, grad: np.ndarray) -> None:
        """Gradient (B, S, E) of the output -> ``grads["weight"]``."""
        weight_grad = np.zeros_like(self.weight)
        np.add.at(weight_grad, self._ids.ravel(), grad.reshape(-1, self.weight.shape[1]))
        self.grads = {"weight": weight_grad}


class RMSNorm:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last axis (Llama's normalisation)."""

    def __init__(self, dim: int, dtype: np.dtype, eps: float = 1e-6) -> None:
        self.weight = np.ones(dim, dtype=dtype)
        self.eps = eps
        self.grads: dict[str, np.ndarray] = {}

    def named_parameters(self) -> list[tuple[str, np.ndarray]]:
        """``[("weight", (E,))]``."""
        return [("weight", self.weight)]

    def forward(self, x: np.ndarray) -> np.ndarray:
        """(..., E) -> (..., E)."""
        self._inv_rms = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps)
        self._normed = x * self._inv_rms
        return self._normed * self.weight

    def backward(self, grad: np.ndarray) -> np.ndarray:
        """Gradient of the output -> gradient of the input (same shape); fills ``grads``."""
        self.grads = {"weight": (grad * self._normed).reshape(-1, self.weight.size).sum(axis=0)}
        d_normed = grad * self.weight
        return self._inv_rms * (d_normed - self._normed * np.mean(d_normed * self._normed, axis=-1, keepdims=True))


class Linear:
    """``x @ weight (+ bias)`` over the last axis; weight (in, out)."""

    def __init__(self, fan_in: int, fan_out: int, rng: np.random.Generator, dtype: np.dtype, bias: bool = True) -> None:
        self.weight = rng.normal(0.0, 1.0 / np.sqrt(fan_in), (fan_in, fan_out)).astype(dtype)
        self.bias = np.zeros(fan_out, dtype=dtype) if bias else None
        self.grads: dict[str, np.ndarray] = {}

    def named_parameters(self) -> list[tuple[str, np.ndarray]]:
        """``weight`` (in, out) and, if any, ``bias`` (out,)."""
        named = [("weight", self.weight)]
        return named + ([("bias", self.bias)] if self.bias is not None else [])

    def forward(self, x: np.ndarray) -> np.ndarray:
        """(..., in) -> (..., out)."""
        self._x = x
        y = x @ self.weight
        return y if self.bias is None else y + self.bias

    def backward(self, grad: np.ndarray) -> np.ndarray:
        """Gradient (..., out) of the output -> gradient (..., in) of the input; fills ``grads``."""
        flat_x = self._x.reshape(-1, self.weight.shape[0])
        flat_grad = grad.reshape(-1, self.weight.shape[1])
        self.grads = {"weight": flat_x.T @ flat_grad}
        if self.bias is not None:
            self.grads["bias"] = flat_grad.sum(axis=0)
        return grad @ self.weight.T


class FeedForward:
    """``relu(x @ W1 + b1) @ W2 + b2``."""

    def __init__(self, dim: int, hidden: int, rng: np.random.Generator, dtype: np.dtype) -> None:
        self.up = Linear(dim, hidden, rng, dtype)
        self.down = Linear(hidden, dim, rng, dtype)

    def children(self) -> dict[str, object]:
        """The sub-modules, by name."""
        return {"up": self.up, "down": self.down}

    def forward(self, x: np.ndarray) -> np.ndarray:
        """(..., E) -> (..., E)."""
        hidden = self.up.forward(x)
        self._active = hidden > 0
        return self.down.forward(hidden * self._active)

    def backward(self, grad: np.ndarray) -> np.ndarray:
        """Gradient of the output -> gradient of the input."""
        return self.up.backward(self.down.backward(grad) * self._active)


class Block:
    """Pre-norm transformer block: ``h = x + attn(norm(x))``, ``y = h + ffn(norm(h))``."""

    def __init__(self, config: ModelConfig, rng: np.random.Generator) -> None:
        dtype = np.dtype(config.dtype)
        self.attn_norm = RMSNorm(config.embed_dim, dtype)
        self.attn = MultiheadAttention.gqa(
            config.embed_dim,
            config.num_heads,
            config.num_kv_heads,
            bias=False,
            causal=True,
            rope=True,
            window=config.window,
            dtype=dtype,
            seed=rng,
        )
        self.ffn_norm = RMSNorm(config.embed_dim, dtype)
        self.ffn = FeedForward(config.embed_dim, 4 * config.embed_dim, rng, dtype)

    def children(self) -> dict[str, object]:
        """The sub-modules, by name."""
        return {"attn_norm": self.attn_norm, "attn": self.attn, "ffn_norm": self.ffn_norm, "ffn": self.ffn}

    def forward(self, x: np.ndarray, cache: KVCache | None) -> np.ndarray:
        """(B, S, E) -> (B, S, E); with a cache, x continues the cached sequence."""
        h = x + self.attn(self.attn_norm.forward(x), cache=cache)
        return h + self.ffn.forward(self.ffn_norm.forward(h))

    def backward(self, grad: np.ndarray) -> np.ndarray:
        """Gradient of the output -> gradient of the input (B, S, E)."""
        d_h = grad + self.ffn_norm.backward(self.ffn.backward(grad))
        (d_normed,) = self.attn.backward(d_h)
        return d_h + self.attn_norm.backward(d_normed)


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of :class:`TinyLM`."""

    vocab_size: int
    embed_dim: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    num_layers: int = 2
    window: int | None = None
    dtype: str = "float32"


class TinyLM:
    """Embedding, ``num_layers`` blocks, a final RMSNorm and an output projection to logits."""

    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        dtype = np.dtype(config.dtype)
        self.config = config
        self.embed = Embedding(config.vocab_size, config.embed_dim, rng, dtype)
        self.blocks = [Block(config, rng) for _ in range(config.num_layers)]
        self.norm = RMSNorm(config.embed_dim, dtype)
        self.head = Linear(config.embed_dim, config.vocab_size, rng, dtype, bias=False)

    def _leaves(self) -> list[tuple[str, object]]:
        """Every module with parameters, with its dotted name."""
        leaves: list[tuple[str, object]] = []

        def visit(prefix: str, module: object) -> None:
            if hasattr(module, "children"):
                for name, child in module.children().items():
                    visit(f"{prefix}{name}.", child)
            else:
                leaves.append((prefix, module))

        visit("embed.", self.embed)
        for index, block in enumerate(self.blocks):
            visit(f"blocks.{index}.", block)
        visit("norm.", self.norm)
        visit("head.", self.head)
        return leaves

    def named_parameters(self) -> list[tuple[str, np.ndarray]]:
        """Every parameter array (updated in place by the optimiser)."""
        return [
            (prefix + name, array) for prefix, module in self._leaves() for name, array in module.named_parameters()
        ]

    def gradients(self) -> dict[str, np.ndarray]:
        """The gradients of the last backward, under the parameters' names."""
        return {prefix + name: grad for prefix, module in self._leaves() for name, grad in module.grads.items()}

    def train(self, mode: bool = True) -> TinyLM:
        """Training mode records what backward needs in the attention layers."""
        for block in self.blocks:
            block.attn.train(mode)
        return self

    def new_caches(self, batch: int, max_seq: int) -> list[KVCache]:
        """One empty KV cache per block."""
        config = self.config
        head_dim = config.embed_dim // config.num_heads
        return [KVCache(batch, max_seq, config.num_kv_heads, head_dim, dtype=config.dtype) for _ in self.blocks]

    def forward(self, ids: np.ndarray, caches: list[KVCache] | None = None) -> np.ndarray:
        """Logits (B, S, vocab) for ids (B, S); with caches, ids continue the cached text."""
        x = self.embed.forward(ids)
        for index, block in enumerate(self.blocks):
            x = block.forward(x, None if caches is None else caches[index])
        return self.head.forward(self.norm.forward(x))

    def backward(self, d_logits: np.ndarray) -> None:
        """Fill every module's gradients from the gradient of the logits."""
        grad = self.norm.backward(self.head.backward(d_logits))
        for block in reversed(self.blocks):
            grad = block.backward(grad)
        self.embed.backward(grad)


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean next-token cross-entropy and its gradient with respect to the logits."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    probabilities = np.exp(shifted)
    probabilities /= probabilities.sum(axis=-1, keepdims=True)
    flat = probabilities.reshape(-1, logits.shape[-1])
    rows = np.arange(flat.shape[0])
    loss = float(-np.mean(np.log(flat[rows, targets.ravel()])))
    flat[rows, targets.ravel()] -= 1.0
    return loss, (flat / flat.shape[0]).reshape(logits.shape).astype(logits.dtype)


class Adam:
    """Adam with global gradient-norm clipping."""

    def __init__(
        self, lr: float, betas: tuple[float, float] = (0.9, 0.99), eps: float = 1e-8, clip: float = 1.0
    ) -> None:
        self.lr, self.betas, self.eps, self.clip = lr, betas, eps, clip
        self.step_count = 0
        self.moments: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def step(self, params: list[tuple[str, np.ndarray]], grads: dict[str, np.ndarray]) -> None:
        """Update every ``(name, array)`` of ``params`` in place from ``grads[name]``."""
        self.step_count += 1
        norm = np.sqrt(sum(float(np.sum(grads[name].astype(np.float64) ** 2)) for name, _ in params))
        factor = min(1.0, self.clip / (norm + 1e-12))
        beta1, beta2 = self.betas
        for name, param in params:
            grad = grads[name] * factor
            first, second = self.moments.get(name, (np.zeros_like(param), np.zeros_like(param)))
            first = beta1 * first + (1 - beta1) * grad
            second = beta2 * second + (1 - beta2) * grad * grad
            self.moments[name] = (first, second)
            first_hat = first / (1 - beta1**self.step_count)
            second_hat = second / (1 - beta2**self.step_count)
            param -= (self.lr * first_hat / (np.sqrt(second_hat) + self.eps)).astype(param.dtype)


@dataclass
class TrainingRun:
    """A trained model, its vocabulary and the loss of every step."""

    model: TinyLM
    vocabulary: Vocabulary
    losses: list[float]


def train(
    steps: int = 300,
    *,
    batch: int = 16,
    seq: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    config: dict[str, object] | None = None,
    text: str | None = None,
    log_every: int = 0,
) -> TrainingRun:
    """Train a :class:`TinyLM` on random windows of ``text`` (the shipped text by default).

    Parameters
    ----------
    steps, batch, seq : int
        Optimiser steps, windows per step and characters per window.
    lr : float
        Adam's learning rate.
    seed : int
        Seeds the weights and the windows.
    config : dict, optional
        Overrides of :class:`ModelConfig` (``embed_dim``, ``num_heads``, ...).  ``window`` defaults
        to ``seq - 1``: attention never reaches further back than in training, so samples longer
        than ``seq`` stay in distribution (with RoPE, scores depend only on distances).
    text : str, optional
    log_every : int
        Print the loss every this many steps (0: quiet).
    """
    text = TEXT_PATH.read_text(encoding="utf-8") if text is None else text
    vocabulary = Vocabulary(text)
    data = vocabulary.encode(text)
    sizes = {"window": seq - 1, **(config or {})}
    model = TinyLM(ModelConfig(vocab_size=len(vocabulary), **sizes), seed=seed)
    optimiser = Adam(lr)
    rng = np.random.default_rng(seed + 1)
    losses = []
    for step in range(steps):
        starts = rng.integers(0, data.size - seq - 1, size=batch)
        windows = data[starts[:, None] + np.arange(seq + 1)]
        logits = model.forward(windows[:, :-1])
        loss, d_logits = cross_entropy(logits, windows[:, 1:])
        model.backward(d_logits)
        optimiser.step(model.named_parameters(), model.gradients())
        losses.append(loss)
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {loss:.3f}")
    return TrainingRun(model, vocabulary, losses)


def sample(
    model: TinyLM, vocabulary: Vocabulary, prompt: str, length: int, *, temperature: float = 0.8, seed: int = 0
) -> str:
    """Continue ``prompt`` by ``length`` characters: one prefill, then one cached step per character.

    ``temperature=0`` picks the most likely character each time.
    """
    model.train(False)
    rng = np.random.default_rng(seed)
    ids = vocabulary.encode(prompt)[None]
    caches = model.new_caches(batch=1, max_seq=ids.shape[1] + length)
    logits = model.forward(ids, caches)
    generated = []
    for _ in range(length):
        last = logits[0, -1].astype(np.float64)
        if temperature == 0:
            token = int(np.argmax(last))
        else:
            weights = np.exp((last - last.max()) / temperature)
            token = int(rng.choice(weights.size, p=weights / weights.sum()))
        generated.append(token)
        logits = model.forward(np.array([[token]]), caches)
    return prompt + vocabulary.decode(generated)


def main(argv: Sequence[str] | None = None) -> None:
    """Train, report the loss, then sample (see the module's docstring for the options)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--prompt", default="The keeper")
    parser.add_argument("--sample-length", type=int, default=300)
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args(argv)
    began = time.perf_counter()
    run = train(args.steps, batch=args.batch, seq=args.seq, lr=args.lr, seed=args.seed, log_every=args.log_every)
    tail = run.losses[-min(20, len(run.losses)) :]
    print(
        f"loss {run.losses[0]:.3f} at the first step -> {np.mean(tail):.3f} (mean of the last {len(tail)}), "
        f"{args.steps} steps in {time.perf_counter() - began:.1f} s"
    )
    began = time.perf_counter()
    text = sample(
        run.model, run.vocabulary, args.prompt, args.sample_length, temperature=args.temperature, seed=args.seed
    )
    print(f"sample ({args.sample_length} characters, KV cache, {time.perf_counter() - began:.2f} s):\n{text}")


if __name__ == "__main__":
    main()
