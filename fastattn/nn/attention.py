"""MultiheadAttention: multi-head, grouped-query and multi-query attention on fastattn's kernels.

The layer projects its inputs with plain matrix products (numpy on the host, CuPy on a GPU), hands
``(B, S, H, D)`` views of the projections to :func:`fastattn.attention` with ``layout="bshd"`` (no
transpose copies), and projects the result back.  Its backward runs the projections' gradients as
matrix products and the attention's through :func:`fastattn.attention_backward`.

The q, k and v projection weights are stored stacked in one ``(Hq*D + 2*Hkv*D, E)`` array (the
parameters are views of it), so a self-attention call projects its input with one matrix product.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _arrays, _validation, backends, distributed, functional
from .._options import AttentionOptions
from .._validation import PreparedCall
from ..backends.registry import UnsupportedError
from ..distributed._setup import check_communicator
from ..distributed._sharding import check_sharding
from . import _checks
from ._device import array_module, native_input, to_device
from ._heads import HeadLayout
from ._masks import cache_options, right_padding_lengths, torch_masks
from ._state_dict import check_dialect, detect_dialect, from_layer_names, to_layer_names
from .kv_cache import KVCache
from .rope import RotaryEmbedding

_INPUT_NAMES = ("query", "key", "value")
_PROJECTIONS = ("q", "k", "v")


@dataclass(frozen=True)
class _Format:
    """How the caller laid out its inputs: unbatched ``(S, E)``, ``(B, S, E)`` or ``(S, B, E)``."""

    unbatched: bool
    batch_first: bool

    def to_batch_first(self, array: Any) -> Any:
        """A ``(B, S, ...)`` view of an array in the caller's axis order."""
        if self.unbatched:
            return array[None]
        return array if self.batch_first else array.swapaxes(0, 1)

    def from_batch_first(self, array: Any) -> Any:
        """A ``(B, S, ...)`` array in the caller's axis order (a view)."""
        if self.unbatched:
            return array[0]
        return array if self.batch_first else array.swapaxes(0, 1)


@dataclass(frozen=True)
class _Source:
    """One distinct input array and the projections (of q, k, v) it feeds."""

    native: Any
    origin: _arrays.ArrayOrigin
    projections: tuple[str, ...]


@dataclass(frozen=True)
class _Saved:
    """What the backward needs from the last training forward.

    ``call`` is the attention's validated call, ``out`` and ``lse`` its native results (out in
    ``(B, H, L, D)`` order): the backward's attention call checks only its new gradient.  Under
    sequence parallelism ``call`` is None and ``sharded`` holds the ring call's q, k, v (``bshd``),
    its options and the shards' global positions.
    """

    form: _Format
    output_shape: tuple[int, ...]
    sources: tuple[_Source, ...]
    call: PreparedCall | None
    out: Any
    lse: Any
    sharded: _ShardedCall | None = None


@dataclass(frozen=True)
class _ShardedCall:
    """The ring attention call of a sequence-parallel forward, as its backward repeats it."""

    q: Any
    k: Any
    v: Any
    options: dict[str, Any]
    positions_q: np.ndarray
    positions_k: np.ndarray


def _runs(projections: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Split projections (in q, k, v order) into runs of neighbours: ('q', 'v') -> [('q',), ('v',)]."""
    runs: list[list[str]] = []
    for name in projections:
        if runs and _PROJECTIONS.index(name) == _PROJECTIONS.index(runs[-1][-1]) + 1:
            runs[-1].append(name)
        else:
            runs.append([name])
    return [tuple(run) for run in runs]


class MultiheadAttention(HeadLayout):
    """Multi-head attention with grouped-query (GQA) and multi-query (MQA) variants.

    ``num_heads`` query heads share ``num_kv_heads`` key/value heads: query head h reads kv head
    ``h // (num_heads // num_kv_heads)``.  ``num_kv_heads == num_heads`` is multi-head attention,
    ``1`` is multi-query.  Each head has ``head_dim = embed_dim // num_heads`` features.

    Parameters
    ----------
    embed_dim : int
        Model width E (input and output features).
    num_heads : int
        Query heads Hq; must divide ``embed_dim``.
    num_kv_heads : int, optional
        Key/value heads Hkv; must divide ``num_heads``.  ``None``: ``num_heads``.
    bias : bool
        Whether the four projections have biases.
    batch_first : bool
        Batched inputs are ``(batch, seq, embed)`` if True, ``(seq, batch, embed)`` if False
        (torch's default).  Unbatched ``(seq, embed)`` inputs are taken either way.
    causal : bool
        Query i sees only keys j <= i (bottom-right aligned against a KV cache); ``forward``'s
        ``is_causal`` overrides it per call.
    window : int or (int, int), optional
        Sliding window: ``(left, right)`` keys either side of each query's position (-1 for
        unbounded), or an int ``w`` for ``(w, w)``; with ``causal`` the right side is 0.  Mistral's
        4096 means a query at position i sees keys ``i - 4096 <= j <= i``.
    rope : bool or RotaryEmbedding, optional
        Rotary position embedding on q and k: True for :class:`RotaryEmbedding` with base 10000, or
        an instance (e.g. base 500000 for Llama 3) whose ``head_dim`` matches.
    dtype : numpy dtype
        Parameters and activations: float16, bfloat16, float32 or float64.  Matrix products
        accumulate in float32 for the half types.
    device : {"cpu", "cuda"}
        Parameters as numpy arrays, or CuPy arrays on the GPU; inputs must live there too.
    seed : int or numpy.random.Generator, optional
        Source of the Xavier-uniform initial weights (biases start at zero).
    backend : str, optional
        The fastattn backend to run on (``None``: automatic selection).
    dropout : float
        Attention-dropout probability in [0, 1], applied by the kernels in training mode only
        (:meth:`train`; never in :meth:`eval` and never on the KV-cache path), like
        torch.nn.MultiheadAttention's ``dropout``.  Each training forward draws a fresh mask seed
        from the layer's generator (seeded by ``seed``) and its backward regenerates that mask.
    sequence_parallel : fastattn.distributed.Communicator, optional
        Sequence parallelism: every rank of this communicator holds its layer (same weights) and
        its shard of the sequences (the positions ``fastattn.distributed.sequence_chunks`` gives
        it under ``sharding``); :meth:`forward` and :meth:`backward` are then collective and run
        ring attention (:func:`fastattn.distributed.ring_attention`), RoPE rotating each token by
        its global position.  Parameter gradients are each rank's share: sum them over the ranks
        (as data parallelism does).  Masks, ``need_weights``, dropout and a KV cache are declined
        (:class:`fastattn.UnsupportedError`).
    sharding : {"zigzag", "contiguous"}
        How the sequences are split under ``sequence_parallel``.

    Attributes
    ----------
    embed_dim, num_heads, num_kv_heads, bias, batch_first, causal, dtype, device, backend, dropout
    sequence_parallel, sharding
        As given (``dtype`` as a numpy dtype).
    window : (int, int) or None
        The window as ``(left, right)``.
    rope : RotaryEmbedding or None
    grads : dict of str to array
        Parameter gradients of the last :meth:`backward`, under the parameters' names.
    training : bool
        Whether ``forward`` records what :meth:`backward` needs (see :meth:`train`, :meth:`eval`).

    Notes
    -----
    :meth:`forward` takes torch.nn.MultiheadAttention's arguments and masks (see there for how they
    map onto fastattn's), and :meth:`load_state_dict` reads its state dict, so the layer can stand
    in for it; Llama-style state dicts load as well.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        bias: bool = True,
        batch_first: bool = True,
        causal: bool = False,
        window: int | tuple[int, int] | None = None,
        rope: bool | RotaryEmbedding | None = None,
        dtype: Any = np.float32,
        device: str = "cpu",
        seed: int | np.random.Generator | None = None,
        backend: str | None = None,
        dropout: float = 0.0,
        sequence_parallel: Any = None,
        sharding: str = "zigzag",
    ) -> None:
        self.embed_dim, self.num_heads, self.num_kv_heads = _checks.head_counts(
            embed_dim, num_heads, num_kv_heads
        )
        self.bias = _checks.flag("bias", bias)
        self.batch_first = _checks.flag("batch_first", batch_first)
        self.causal = _checks.flag("causal", causal)
        self.window = _checks.window(window)
        self.rope = self._rope(rope)
        self.dtype = _checks.float_dtype("dtype", dtype)
        self.device = _checks.device_name("device", device)
        if backend is not None and (not isinstance(backend, str) or backend not in backends.names()):
            raise ValueError(f"backend: expected None or one of {backends.names()}, received {backend!r}")
        self.backend = backend
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float, np.floating)) or not 0 <= dropout <= 1:
            raise ValueError(f"dropout: expected a float in [0, 1], received {dropout!r}")
        self.dropout = float(dropout)
        self.sequence_parallel = (
            None if sequence_parallel is None else check_communicator(sequence_parallel)
        )
        self.sharding = check_sharding(sharding)
        self.training = True
        self.grads: dict[str, Any] = {}
        self._saved: _Saved | None = None
        self._xp = array_module(self.device)
        self._compute = _arrays.accumulation_dtype(self.dtype.name)
        self._init_parameters(seed)

    # ------------------------------------------------------------------------------------------
    # construction

    @classmethod
    def mha(cls, embed_dim: int, num_heads: int, **options: Any) -> MultiheadAttention:
        """Multi-head attention: as many kv heads as query heads.  Options as the constructor's."""
        return cls(embed_dim, num_heads, num_heads, **options)

    @classmethod
    def mqa(cls, embed_dim: int, num_heads: int, **options: Any) -> MultiheadAttention:
        """Multi-query attention: one kv head shared by every query head."""
        return cls(embed_dim, num_heads, 1, **options)

    @classmethod
    def gqa(cls, embed_dim: int, num_heads: int, num_kv_heads: int, **options: Any) -> MultiheadAttention:
        """Grouped-query attention: ``num_heads // num_kv_heads`` query heads per kv head."""
        return cls(embed_dim, num_heads, num_kv_heads, **options)

    def _rope(self, rope: Any) -> RotaryEmbedding | None:
        if rope is None or rope is False:
            return None
        if rope is True:
            return RotaryEmbedding(self.head_dim)
        if not isinstance(rope, RotaryEmbedding):
            raise TypeError(f"rope: expected None, a bool or a RotaryEmbedding, received {rope!r}")
        if rope.head_dim != self.head_dim:
            raise ValueError(
                f"rope: expected a RotaryEmbedding of head_dim={self.head_dim} (embed_dim "
                f"{self.embed_dim} / num_heads {self.num_heads}), received head_dim={rope.head_dim}"
            )
        return rope

    def _init_parameters(self, seed: Any) -> None:
        if seed is not None and not isinstance(seed, (int, np.integer, np.random.Generator)):
            raise TypeError(f"seed: expected None, an int or a numpy Generator, received {seed!r}")
        rng = np.random.default_rng(seed)
        self._dropout_seeds = np.random.default_rng(rng.integers(2**63))
        width_q, width_kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self._rows = {
            "q": slice(0, width_q),
            "k": slice(width_q, width_q + width_kv),
            "v": slice(width_q + width_kv, width_q + 2 * width_kv),
        }

        def xavier(fan_out: int, fan_in: int) -> np.ndarray:
            bound = np.sqrt(6.0 / (fan_in + fan_out))
            return rng.uniform(-bound, bound, size=(fan_out, fan_in))

        xp = self._xp
        stacked = np.concatenate([xavier(width, self.embed_dim) for width in (width_q, width_kv, width_kv)])
        self._in_weight = xp.asarray(stacked.astype(self.dtype))
        self._out_weight = xp.asarray(xavier(self.embed_dim, width_q).astype(self.dtype))
        self._in_bias = xp.zeros(stacked.shape[0], dtype=self.dtype) if self.bias else None
        self._out_bias = xp.zeros(self.embed_dim, dtype=self.dtype) if self.bias else None
        self._params = self._views(self._in_weight, self._in_bias, self._out_weight, self._out_bias)

    def _views(self, in_weight: Any, in_bias: Any, out_weight: Any, out_bias: Any) -> dict[str, Any]:
        """Name the parameter (or gradient) arrays: q/k/v entries are views of the stacked ones."""
        named = {}
        for projection in _PROJECTIONS:
            rows = self._rows[projection]
            named[f"{projection}_proj.weight"] = in_weight[rows]
            if in_bias is not None:
                named[f"{projection}_proj.bias"] = in_bias[rows]
        named["o_proj.weight"] = out_weight
        if out_bias is not None:
            named["o_proj.bias"] = out_bias
        return named

    # ------------------------------------------------------------------------------------------
    # description

    def __repr__(self) -> str:
        extras = [f"bias={self.bias}", f"batch_first={self.batch_first}", f"causal={self.causal}"]
        if self.window is not None:
            extras.append(f"window={self.window}")
        if self.rope is not None:
            extras.append(f"rope={self.rope!r}")
        if self.sequence_parallel is not None:
            extras.append(f"sequence_parallel={self.sequence_parallel.size} ranks, sharding={self.sharding!r}")
        return (
            f"MultiheadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, {', '.join(extras)}, "
            f"dtype={self.dtype.name}, device={self.device!r})"
        )

    # ------------------------------------------------------------------------------------------
    # parameters

    def parameters(self) -> list[Any]:
        """The parameter arrays (numpy or CuPy, the layer's dtype); updating them in place trains."""
        return list(self._params.values())

    def named_parameters(self) -> list[tuple[str, Any]]:
        """``(name, array)`` pairs: ``q_proj.weight`` ``(Hq*D, E)``, ``q_proj.bias`` ``(Hq*D,)``,
        ``k_proj.*`` and ``v_proj.*`` ``(Hkv*D, E)``/``(Hkv*D,)``, ``o_proj.weight`` ``(E, Hq*D)``,
        ``o_proj.bias`` ``(E,)`` (biases only with ``bias=True``)."""
        return list(self._params.items())

    def parameter_count(self) -> int:
        """Number of scalar parameters."""
        return int(sum(param.size for param in self._params.values()))

    def train(self, mode: bool = True) -> MultiheadAttention:
        """Set training mode (``forward`` records what :meth:`backward` needs); returns self."""
        self.training = _checks.flag("mode", mode)
        if not self.training:
            self._saved = None
        return self

    def eval(self) -> MultiheadAttention:
        """Set inference mode (nothing recorded for :meth:`backward`); returns self."""
        return self.train(False)

    def state_dict(self, dialect: str = "llama", prefix: str = "") -> dict[str, Any]:
        """Copies of the parameters, named in one of two dialects.

        Parameters
        ----------
        dialect : {"llama", "torch"}
            ``"llama"``: ``q_proj.weight`` ... ``o_proj.bias`` (the parameters' own names).
            ``"torch"``: torch.nn.MultiheadAttention's ``in_proj_weight`` ``(3E, E)``,
            ``in_proj_bias`` ``(3E,)``, ``out_proj.weight`` ``(E, E)``, ``out_proj.bias`` ``(E,)``;
            only for multi-head layers (torch has no grouped-query attention).
        prefix : str
            Prepended to every key (e.g. ``"layers.0.self_attn."``).

        Returns
        -------
        dict of str to array
            numpy (or CuPy) arrays in the layer's dtype.
        """
        dialect = check_dialect(dialect)
        if dialect == "torch" and not self.is_mha:
            raise ValueError(
                f"dialect: 'torch' holds only multi-head layers (torch.nn.MultiheadAttention has no "
                f"grouped-query attention); this layer has num_heads={self.num_heads} and "
                f"num_kv_heads={self.num_kv_heads}, use 'llama'"
            )
        state = from_layer_names(self._xp, self._params, dialect)
        return {prefix + key: value for key, value in state.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any], prefix: str = "") -> None:
        """Copy parameters in from a state dict of either dialect (detected from its keys).

        Parameters
        ----------
        state_dict : mapping of str to array
            torch.nn.MultiheadAttention's keys or Llama-style keys (see :meth:`state_dict`); values
            numpy, CuPy or any DLPack tensor (torch), of any float dtype (cast to the layer's) on
            any device.  The keys must be exactly this layer's: biases present iff ``bias=True``.
        prefix : str
            Only keys starting with it are read, with it removed (e.g. one layer of a whole
            model's state dict: ``"model.layers.0.self_attn."``).

        Nothing is written unless every key and shape checks out.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"state_dict: expected a mapping of names to arrays, received {type(state_dict).__name__}"
            )
        if not isinstance(prefix, str):
            raise TypeError(f"prefix: expected a str, received {prefix!r}")
        selected = {key[len(prefix) :]: value for key, value in state_dict.items() if key.startswith(prefix)}
        if not selected:
            raise ValueError(
                f"prefix: expected some key to start with {prefix!r}, received keys {sorted(state_dict)}"
            )
        dialect = detect_dialect(selected)
        natives = {
            key: _arrays.to_native(value, f"state_dict[{prefix + key!r}]")[0] for key, value in selected.items()
        }
        width_q, width_kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        values = to_layer_names(natives, dialect, (width_q, width_kv, width_kv))
        missing = sorted(set(self._params) - set(values))
        unexpected = sorted(set(values) - set(self._params))
        if missing or unexpected:
            raise ValueError(
                f"state_dict: expected this layer's parameters (bias={self.bias}) in the {dialect!r} "
                f"dialect, received missing {missing} and unexpected {unexpected} (in this layer's names)"
            )
        for name, value in values.items():
            expected = tuple(self._params[name].shape)
            if tuple(value.shape) != expected:
                raise ValueError(
                    f"state_dict[{name!r}]: expected shape {expected}, received {tuple(value.shape)}"
                )
        for name, value in values.items():
            self._params[name][...] = to_device(value, name, self.device, self.dtype)

    # ------------------------------------------------------------------------------------------
    # forward

    def forward(
        self,
        query: Any,
        key: Any = None,
        value: Any = None,
        *,
        attn_mask: Any = None,
        key_padding_mask: Any = None,
        is_causal: bool | None = None,
        cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> Any:
        """Attend from ``query`` to ``key``/``value`` (self-attention when they are omitted).

        Masks follow torch.nn.MultiheadAttention, so it can be swapped in; here is how each maps
        onto fastattn's convention (bool True = MAY attend, float added):

        * ``key_padding_mask`` ``(N, S)`` (``(S,)`` unbatched): bool True = ignore that key, the
          same as torch; it is inverted.  Right padding (every row True only at its end) becomes
          ``key_lengths`` (no mask array at all); other patterns a ``(N, 1, 1, S)`` mask.  A float
          mask is added to the scores.
        * ``attn_mask`` ``(L, S)`` or ``(N * num_heads, L, S)`` (``(num_heads, L, S)``
          unbatched): bool True = NOT allowed (torch's convention, the opposite of fastattn's and
          SDPA's), inverted to ``(1, 1, L, S)`` or ``(N, num_heads, L, S)``; float added.
          With both masks, the two are combined (and'ed, or added once any is float).
        * ``is_causal``: ``None`` uses the layer's ``causal``; True/False overrides it.  Unlike
          torch (where it is only a hint that ``attn_mask`` is causal, and needs one), it applies
          the causal rule itself, on top of any ``attn_mask``.

        A query row that can see no key gives 0 (torch gives NaN).

        Parameters
        ----------
        query : array, (N, L, E), (L, N, E) with ``batch_first=False``, or (L, E)
            numpy, CuPy, or any DLPack tensor (torch) on the layer's device, in its dtype.
        key : array, (N, S, E) / (S, N, E) / (S, E), optional
            Defaults to ``query`` (self-attention).
        value : array, like key, optional
            Defaults to ``key``.
        attn_mask, key_padding_mask : array, optional
            As above.  With a ``cache``, ``attn_mask`` must be None and ``key_padding_mask``
            ``(N, L)`` marks padding at the end of the new tokens (right padding only): a row's
            cache length grows by its number of real tokens.
        is_causal : bool, optional
            As above.
        cache : KVCache, optional
            Self-attention only.  The new tokens' keys and values are appended to it and the
            queries attend to everything it holds; query i of row b sits at position
            ``lengths[b] + i`` (RoPE positions too), bottom-right aligned.  One token per row
            (``L == 1``, no masks, no weights) takes the decode fast path.  Not recorded for
            :meth:`backward`.
        need_weights : bool
            Also return the attention probabilities averaged over heads, computed on the
            ``reference`` backend (they are materialised).

        Returns
        -------
        output : array, query's shape
            In query's framework, on its device, in the layer's dtype.
        weights : array, (N, L, S) or (L, S) unbatched
            Only with ``need_weights=True``.
        """
        causal = self.causal if is_causal is None else _checks.flag("is_causal", is_causal)
        need_weights = _checks.flag("need_weights", need_weights)
        form, sources = self._sources(query, key, value)
        if form.unbatched and key_padding_mask is not None and getattr(key_padding_mask, "ndim", 0) == 1:
            key_padding_mask = key_padding_mask[None]
        self._saved = None
        if self.sequence_parallel is not None:
            return self._sharded_forward(form, sources, attn_mask, key_padding_mask, causal, need_weights, cache)
        if cache is None:
            return self._full_forward(form, sources, attn_mask, key_padding_mask, causal, need_weights)
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache: expected a KVCache or None, received {type(cache).__name__}")
        one_token = sources[0].native.shape[1] == 1
        if one_token and attn_mask is None and key_padding_mask is None and not need_weights:
            return self._decode_step(form, sources, cache, causal)
        return self._cached_forward(form, sources, cache, attn_mask, key_padding_mask, causal, need_weights)

    __call__ = forward

    def _sources(self, query: Any, key: Any, value: Any) -> tuple[_Format, list[_Source]]:
        """Group the inputs by identity and view each as ``(B, S, E)`` in the layer's dtype."""
        key = query if key is None else key
        value = key if value is None else value
        grouped: list[tuple[str, Any, list[str]]] = []
        for name, projection, array in zip(_INPUT_NAMES, _PROJECTIONS, (query, key, value)):
            for _, seen, projections in grouped:
                if seen is array:
                    projections.append(projection)
                    break
            else:
                grouped.append((name, array, [projection]))
        form: _Format | None = None
        sources = []
        for name, array, projections in grouped:
            native, origin = native_input(name, array, self.device)
            if native.ndim not in (2, 3) or native.shape[-1] != self.embed_dim:
                order = "(N, S, E)" if self.batch_first else "(S, N, E)"
                raise ValueError(
                    f"{name}: expected a 3-D {order} or 2-D (S, E) array with E = embed_dim = "
                    f"{self.embed_dim}, received shape {tuple(native.shape)}"
                )
            if form is None:
                form = _Format(unbatched=native.ndim == 2, batch_first=self.batch_first)
            elif native.ndim != (2 if form.unbatched else 3):
                raise ValueError(
                    f"{name}: expected {2 if form.unbatched else 3} axes like query, "
                    f"received shape {tuple(native.shape)}"
                )
            if native.dtype != self.dtype:
                raise TypeError(
                    f"{name}: expected dtype {self.dtype.name} (the layer's), "
                    f"received {_arrays.dtype_name(native.dtype)}"
                )
            sources.append(_Source(form.to_batch_first(native), origin, tuple(projections)))
        assert form is not None
        batch = sources[0].native.shape[0]
        for (name, _, _), source in zip(grouped[1:], sources[1:]):
            if source.native.shape[0] != batch:
                raise ValueError(
                    f"{name}: expected batch size {batch} like query, received shape "
                    f"{tuple(form.from_batch_first(source.native).shape)}"
                )
        feeding = {projection: source for source in sources for projection in source.projections}
        if feeding["v"].native.shape[1] != feeding["k"].native.shape[1]:
            raise ValueError(
                f"value: expected {feeding['k'].native.shape[1]} tokens like key, received shape "
                f"{tuple(form.from_batch_first(feeding['v'].native).shape)}"
            )
        return form, sources

    def _linear(self, x: Any, weight: Any, bias: Any) -> Any:
        """``x @ weight.T + bias`` over the last axis, one matrix product, in the compute dtype."""
        compute = self._compute
        flat = x.reshape(-1, x.shape[-1]).astype(compute, copy=False)
        result = flat @ weight.astype(compute, copy=False).T
        if bias is not None:
            result += bias.astype(compute, copy=False)
        return result.reshape(x.shape[:-1] + (weight.shape[0],))

    def _project(self, sources: list[_Source]) -> dict[str, Any]:
        """q ``(B, L, Hq, D)``, k and v ``(B, S, Hkv, D)`` in the layer's dtype: one matrix product
        per run of neighbouring projections that read the same input, split into views."""
        projected = {}
        for source in sources:
            for run in _runs(source.projections):
                rows = slice(self._rows[run[0]].start, self._rows[run[-1]].stop)
                bias = None if self._in_bias is None else self._in_bias[rows]
                result = self._linear(source.native, self._in_weight[rows], bias)
                result = result.astype(self.dtype, copy=False)
                for projection in run:
                    start = self._rows[projection].start - rows.start
                    width = self._rows[projection].stop - self._rows[projection].start
                    piece = result[..., start : start + width]
                    projected[projection] = piece.reshape(piece.shape[:-1] + (-1, self.head_dim))
        return projected

    def _rotate(self, heads: Any, positions: Any, inverse: bool = False) -> Any:
        """RoPE on ``(B, S, H, D)`` heads at ``positions`` ((S,) or (B, S)), if the layer has it."""
        return heads if self.rope is None else self.rope.apply(heads, positions, inverse=inverse)

    def _output(self, form: _Format, origin: _arrays.ArrayOrigin, out: Any) -> Any:
        """Project the attention output ``(B, L, Hq, D)`` and hand it back in the caller's axis order."""
        flat = out.reshape(out.shape[:2] + (self.num_heads * self.head_dim,))
        result = self._linear(flat, self._out_weight, self._out_bias).astype(self.dtype, copy=False)
        return _arrays.from_native(form.from_batch_first(result), origin)

    def _full_forward(
        self,
        form: _Format,
        sources: list[_Source],
        attn_mask: Any,
        key_padding_mask: Any,
        causal: bool,
        need_weights: bool,
    ) -> Any:
        """Attention without a cache (top-left causal), recorded for :meth:`backward` in training."""
        batch, seq_q = sources[0].native.shape[:2]
        seq_k = next(source.native.shape[1] for source in sources if "k" in source.projections)
        mask, key_lengths = torch_masks(
            self._xp,
            None if attn_mask is None else native_input("attn_mask", attn_mask, self.device)[0],
            None if key_padding_mask is None else native_input("key_padding_mask", key_padding_mask, self.device)[0],
            batch=batch,
            num_heads=self.num_heads,
            seq_q=seq_q,
            seq_k=seq_k,
        )
        dropping = self.training and self.dropout > 0
        options = AttentionOptions(
            causal="top_left" if causal else False,
            mask=mask,
            key_lengths=key_lengths,
            window=self.window,
            layout="bshd",
            dropout_p=self.dropout if dropping else 0.0,
            dropout_seed=int(self._dropout_seeds.integers(2**63)) if dropping else None,
            backend=self.backend,
        )
        projected = self._project(sources)
        q = self._rotate(projected["q"], np.arange(seq_q))
        k = self._rotate(projected["k"], np.arange(seq_k))
        call = _validation.prepare("forward", {"q": q, "k": k, "v": projected["v"]}, options)
        out_bhsd, lse = functional.run_forward(call)
        origin = sources[0].origin
        output = self._output(form, origin, out_bhsd.swapaxes(1, 2))
        if self.training:
            caller_shape = tuple(form.from_batch_first(sources[0].native).shape)
            self._saved = _Saved(form, caller_shape, tuple(sources), call, out_bhsd, lse)
        if need_weights:
            return output, self._weights(form, origin, q, k, options)
        return output

    def _sharded_forward(
        self,
        form: _Format,
        sources: list[_Source],
        attn_mask: Any,
        key_padding_mask: Any,
        causal: bool,
        need_weights: bool,
        cache: Any,
    ) -> Any:
        """Ring attention over this rank's shard of the sequences (``sequence_parallel``)."""
        declined = [
            f"{name}: not under sequence_parallel"
            for name, given in (
                ("attn_mask", attn_mask is not None),
                ("key_padding_mask", key_padding_mask is not None),
                ("need_weights", need_weights),
                ("cache", cache is not None),
                ("dropout", self.training and self.dropout > 0),
            )
            if given
        ]
        if declined:
            raise UnsupportedError("MultiheadAttention.forward: options the sequence-parallel layer declines", declined)
        comm = self.sequence_parallel
        assert comm is not None
        seq_q = sources[0].native.shape[1]
        seq_k = next(source.native.shape[1] for source in sources if "k" in source.projections)
        positions_q = distributed.shard_positions(comm, seq_q, self.sharding)
        positions_k = positions_q if len(sources) == 1 else distributed.shard_positions(comm, seq_k, self.sharding)
        projected = self._project(sources)
        q = self._rotate(projected["q"], positions_q)
        k = self._rotate(projected["k"], positions_k)
        options: dict[str, Any] = dict(
            comm=comm, causal="top_left" if causal else False, window=self.window, sharding=self.sharding,
            layout="bshd", backend=self.backend,
        )  # fmt: skip
        out_bshd, lse = distributed.ring_attention(q, k, projected["v"], return_lse=True, **options)
        origin = sources[0].origin
        output = self._output(form, origin, out_bshd)
        if self.training:
            caller_shape = tuple(form.from_batch_first(sources[0].native).shape)
            sharded = _ShardedCall(q, k, projected["v"], options, positions_q, positions_k)
            self._saved = _Saved(form, caller_shape, tuple(sources), None, out_bshd.swapaxes(1, 2), lse, sharded)
        return output

    def _weights(
        self, form: _Format, origin: _arrays.ArrayOrigin, q: Any, k: Any, options: AttentionOptions
    ) -> Any:
        """Head-averaged probabilities ``(B, L, S)``: attention of q, k on an identity value, on
        the reference backend, so every mask and alignment is exactly the forward's."""
        batch, seq_k = k.shape[:2]
        identity = self._xp.eye(seq_k, dtype=self.dtype)[None, :, None, :]
        probabilities = functional.attention_with(
            q,
            k,
            self._xp.broadcast_to(identity, (batch, seq_k, self.num_kv_heads, seq_k)),
            options._replace(return_lse=False, backend="reference"),
        )
        averaged = probabilities.astype(self._compute).mean(axis=2).astype(self.dtype)
        return _arrays.from_native(averaged[0] if form.unbatched else averaged, origin)

    def _check_cache(self, cache: KVCache, batch: int) -> None:
        expected = {
            "batch": batch,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "device": self.device,
        }
        for name, wanted in expected.items():
            if getattr(cache, name) != wanted:
                owner = "the input's" if name == "batch" else "the layer's"
                raise ValueError(f"cache: expected {name}={wanted} ({owner}), received {cache!r}")

    def _cache_source(self, sources: list[_Source], cache: KVCache) -> _Source:
        if len(sources) != 1:
            raise ValueError(
                "key: expected None or query itself with a cache (cached attention is self-attention), "
                "received a different array"
            )
        self._check_cache(cache, sources[0].native.shape[0])
        return sources[0]

    def _append_and_attend(
        self, sources: list[_Source], cache: KVCache, counts: Any, causal: bool
    ) -> tuple[Any, Any, AttentionOptions, Any]:
        """Project the new tokens, append their keys and values, attend to the cache's views.

        Returns the rotated queries, the keys view, the attention options and its output.
        """
        projected = self._project(sources)
        seq_q = projected["q"].shape[1]
        starts = cache.lengths
        positions = starts[:, None] + np.arange(seq_q)[None, :]
        cache.append(self._rotate(projected["k"], positions), projected["v"], counts)
        keys, values = cache.view()
        options = cache_options(
            self._xp,
            starts,
            cache.lengths,
            padded=bool(np.any(cache.lengths - starts < seq_q)),
            seq_q=seq_q,
            causal=causal,
            window=self.window,
            backend=self.backend,
        )
        q = self._rotate(projected["q"], positions)
        out = functional.attention_with(q, keys, values, options)
        return q, keys, options, out

    def _decode_step(self, form: _Format, sources: list[_Source], cache: KVCache, causal: bool) -> Any:
        """The fast path for one new token per row: no masks to translate and no weights; the
        attention call has Sq = 1 (the backends' decode kernels), reads views of the cache, and
        needs at most ``key_lengths`` (rows of different lengths) besides bottom-right alignment."""
        source = self._cache_source(sources, cache)
        out = self._append_and_attend(sources, cache, None, causal)[3]
        return self._output(form, source.origin, out)

    def _cached_forward(
        self,
        form: _Format,
        sources: list[_Source],
        cache: KVCache,
        attn_mask: Any,
        key_padding_mask: Any,
        causal: bool,
        need_weights: bool,
    ) -> Any:
        """Prefill (or a chunk of it): append the new tokens, then attend to the whole cache."""
        source = self._cache_source(sources, cache)
        if attn_mask is not None:
            raise ValueError(
                "attn_mask: expected None with a cache (the cache's positions and lengths decide "
                "what each query sees), received an array"
            )
        counts = None
        if key_padding_mask is not None:
            batch, seq_q = source.native.shape[:2]
            padding, _ = native_input("key_padding_mask", key_padding_mask, self.device)
            if padding.dtype != np.bool_ or tuple(padding.shape) != (batch, seq_q):
                raise ValueError(
                    f"key_padding_mask: expected a bool ({batch}, {seq_q}) array with a cache, "
                    f"received {_arrays.describe_value(padding)}"
                )
            counts = right_padding_lengths(self._xp, ~padding)
            if counts is None:
                raise ValueError(
                    "key_padding_mask: expected right padding with a cache (True only after a row's "
                    "real tokens), received padding before real tokens"
                )
        q, keys, options, out = self._append_and_attend(sources, cache, counts, causal)
        output = self._output(form, source.origin, out)
        if need_weights:
            return output, self._weights(form, source.origin, q, keys, options)
        return output

    # ------------------------------------------------------------------------------------------
    # backward

    def backward(self, grad_output: Any) -> tuple[Any, ...]:
        """Gradients of the last training forward, given the gradient of its output.

        Parameters
        ----------
        grad_output : array, the output's shape
            On the layer's device, in its dtype (numpy, CuPy or DLPack).

        Returns
        -------
        tuple of arrays
            One gradient per distinct input, in the order query, key, value: self-attention gives
            ``(d_query,)``; ``key is value`` gives ``(d_query, d_key)``.  Each in its input's shape,
            framework and the layer's dtype.

        Also sets :attr:`grads` to the parameters' gradients (replacing the previous ones, not
        accumulating).  Each forward supports one backward.
        """
        saved = self._saved
        if saved is None:
            raise RuntimeError(
                "backward: expected a forward in training mode without a cache before it (one "
                "backward per forward), found none"
            )
        gradient, _ = native_input("grad_output", grad_output, self.device)
        if tuple(gradient.shape) != saved.output_shape:
            raise ValueError(
                f"grad_output: expected shape {saved.output_shape} (the output's), "
                f"received {tuple(gradient.shape)}"
            )
        if gradient.dtype != self.dtype:
            raise TypeError(
                f"grad_output: expected dtype {self.dtype.name}, "
                f"received {_arrays.dtype_name(gradient.dtype)}"
            )
        xp, compute = self._xp, self._compute
        width_q = self.num_heads * self.head_dim
        d_output = saved.form.to_batch_first(gradient).reshape(-1, self.embed_dim).astype(compute, copy=False)
        attended_bshd = saved.out.swapaxes(1, 2)
        attended_shape = attended_bshd.shape
        attended = attended_bshd.reshape(-1, width_q).astype(compute, copy=False)
        d_out_weight = d_output.T @ attended
        d_out_bias = d_output.sum(axis=0) if self.bias else None
        d_attended = (d_output @ self._out_weight.astype(compute, copy=False)).astype(self.dtype)
        if saved.sharded is None:
            assert saved.call is not None
            dq, dk, dv = functional.finish_backward(
                _validation.prepare_gradient(saved.call, saved.out, saved.lse, d_attended.reshape(attended_shape))
            )
            positions_q, positions_k = np.arange(dq.shape[1]), np.arange(dk.shape[1])
        else:
            sharded = saved.sharded
            dq, dk, dv = distributed.ring_attention_backward(
                d_attended.reshape(attended_shape), sharded.q, sharded.k, sharded.v, attended_bshd, saved.lse,
                **sharded.options,
            )  # fmt: skip
            positions_q, positions_k = sharded.positions_q, sharded.positions_k
        d_projected = {
            "q": self._rotate(dq, positions_q, inverse=True),
            "k": self._rotate(dk, positions_k, inverse=True),
            "v": dv,
        }
        d_in_weight = xp.empty(self._in_weight.shape, dtype=compute)
        d_in_bias = xp.empty(self._in_weight.shape[0], dtype=compute) if self.bias else None
        input_grads = []
        in_weight = self._in_weight.astype(compute, copy=False)
        for source in saved.sources:
            batch, seq = source.native.shape[:2]
            x = source.native.reshape(batch * seq, self.embed_dim).astype(compute, copy=False)
            d_input: Any = None
            for run in _runs(source.projections):
                rows = slice(self._rows[run[0]].start, self._rows[run[-1]].stop)
                pieces = [d_projected[name].reshape(batch * seq, -1).astype(compute, copy=False) for name in run]
                d_rows = pieces[0] if len(pieces) == 1 else xp.concatenate(pieces, axis=1)
                d_in_weight[rows] = d_rows.T @ x
                if d_in_bias is not None:
                    d_in_bias[rows] = d_rows.sum(axis=0)
                contribution = d_rows @ in_weight[rows]
                d_input = contribution if d_input is None else d_input + contribution
            d_input = d_input.reshape(batch, seq, self.embed_dim).astype(self.dtype, copy=False)
            input_grads.append(_arrays.from_native(saved.form.from_batch_first(d_input), source.origin))
        grads = [d_in_weight, d_in_bias, d_out_weight, d_out_bias]
        self.grads = self._views(*(None if grad is None else grad.astype(self.dtype, copy=False) for grad in grads))
        self._saved = None
        return tuple(input_grads)
