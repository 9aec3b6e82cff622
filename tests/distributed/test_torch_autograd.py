"""fastattn.torch's sharded attention: loss.backward() on every rank gives each its shards' gradients."""

from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn import distributed

torch = pytest.importorskip("torch")
import fastattn.torch  # noqa: E402  (after the skip: it imports torch)


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_gradients_equal_one_process(strategy: str) -> None:
    rng = np.random.default_rng()
    shapes = [(1, 4, 23, 8), (1, 2, 23, 8), (1, 2, 23, 8), (1, 4, 23, 8)]
    q, k, v, dout = (rng.standard_normal(shape) for shape in shapes)
    options = {"causal": "bottom_right", "window": (6, 0), "softcap": 3.0}
    out, lse = fastattn.attention(q, k, v, return_lse=True, backend="cpu", **options)
    expected = (out, *fastattn.attention_backward(dout, q, k, v, out, lse, backend="cpu", **options))
    function = getattr(fastattn.torch, f"{strategy}_attention")

    def rank(comm: distributed.SimulatedCommunicator) -> list[np.ndarray]:
        shards = [
            torch.from_numpy(distributed.shard_sequence(x, comm.rank, comm.size)).requires_grad_(index < 3)
            for index, x in enumerate((q, k, v, dout))
        ]
        result = function(*shards[:3], comm=comm, **options)
        assert result.grad_fn is not None
        (result * shards[3]).sum().backward()
        return [result.detach().numpy()] + [shard.grad.numpy() for shard in shards[:3]]

    results = distributed.simulate(2, rank)
    for index, want in enumerate(expected):
        got = distributed.unshard_sequence([r[index] for r in results])
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_without_grad_no_graph() -> None:
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64)

    def rank(comm: distributed.SimulatedCommunicator) -> bool:
        out, lse = fastattn.torch.ring_attention(q, q[:, :1], q[:, :1], comm=comm, return_lse=True)
        return out.grad_fn is None and lse.dtype == torch.float64

    assert distributed.simulate(1, rank) == [True]
