"""nn.MultiheadAttention(sequence_parallel=comm): each rank's shard of the layer's results."""

from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn import distributed
from fastattn.nn import MultiheadAttention


@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_sharded_layer_equals_one_process(ranks: int, sharding: str) -> None:
    rng = np.random.default_rng()
    seed = int(rng.integers(2**31))
    options = {"num_kv_heads": 2, "causal": True, "rope": True, "window": (7, 0), "dtype": np.float64, "seed": seed}
    x = rng.standard_normal((2, 29, 32))
    grad = rng.standard_normal((2, 29, 32))
    whole = MultiheadAttention(32, 4, **options)
    expected = whole(x)
    (expected_dx,) = whole.backward(grad)

    def rank(comm: distributed.SimulatedCommunicator) -> tuple[object, ...]:
        layer = MultiheadAttention(32, 4, sequence_parallel=comm, sharding=sharding, **options)
        mine = distributed.shard_sequence(x, comm.rank, comm.size, sharding=sharding, axis=1)
        out = layer(mine)
        (dx,) = layer.backward(distributed.shard_sequence(grad, comm.rank, comm.size, sharding=sharding, axis=1))
        return out, dx, layer.grads

    results = distributed.simulate(ranks, rank)
    for index, want in enumerate((expected, expected_dx)):
        got = distributed.unshard_sequence([r[index] for r in results], sharding=sharding, axis=1)
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)
    for name, want in whole.grads.items():
        if want is not None:
            np.testing.assert_allclose(sum(r[2][name] for r in results), want, rtol=1e-11, atol=1e-12)


def test_sharded_layer_declines_what_it_cannot_run() -> None:
    def rank(comm: distributed.SimulatedCommunicator) -> None:
        layer = MultiheadAttention(16, 2, sequence_parallel=comm, dtype=np.float64, dropout=0.1)
        x = np.ones((1, 4, 16))
        with pytest.raises(fastattn.UnsupportedError, match="dropout"):
            layer(x)
        with pytest.raises(fastattn.UnsupportedError, match="key_padding_mask"):
            layer.eval()(x, key_padding_mask=np.zeros((1, 4), dtype=bool))

    distributed.simulate(1, rank)
    with pytest.raises(TypeError, match="comm: expected"):
        MultiheadAttention(16, 2, sequence_parallel="world")
