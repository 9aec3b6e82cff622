"""The layer on device="cuda" (CuPy arrays) gives the host's results; skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from fastattn.nn import KVCache, MultiheadAttention

from ._helpers import random_layer

cupy = pytest.importorskip("cupy")
try:
    _HAS_DEVICE = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:  # no driver
    _HAS_DEVICE = False
pytestmark = pytest.mark.skipif(not _HAS_DEVICE, reason="no CUDA device")


def test_forward_backward_and_cache_on_the_gpu(rng):
    host = random_layer(rng, 32, 4, 2, causal=True, rope=True, window=5)
    device = MultiheadAttention(32, 4, 2, causal=True, rope=True, window=5, dtype=np.float64, device="cuda")
    device.load_state_dict(host.state_dict())
    assert all(isinstance(param, cupy.ndarray) for param in device.parameters())
    x = rng.standard_normal((2, 9, 32))
    padding = np.zeros((2, 9), dtype=bool)
    padding[1, 6:] = True
    expected = host(x, key_padding_mask=padding)
    out = device(cupy.asarray(x), key_padding_mask=cupy.asarray(padding))
    assert isinstance(out, cupy.ndarray)
    assert np.abs(out.get() - expected).max() < 1e-10
    grad = rng.standard_normal(x.shape)
    (dx_host,) = host.backward(grad)
    (dx_device,) = device.backward(cupy.asarray(grad))
    assert np.abs(dx_device.get() - dx_host).max() < 1e-10
    for name, value in host.grads.items():
        assert np.abs(device.grads[name].get() - value).max() < 1e-10
    cache = KVCache(2, 12, 2, 8, dtype=np.float64, device="cuda")
    device.eval()(cupy.asarray(x[:, :6]), cache=cache)
    step = device(cupy.asarray(x[:, 6:7]), cache=cache)
    assert np.abs(step.get()[:, 0] - host(x[:, :7])[:, -1]).max() < 1e-10
    assert isinstance(device.state_dict()["q_proj.weight"], cupy.ndarray)


def test_torch_cuda_tensors(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    layer = MultiheadAttention(16, 4, dtype=np.float32, device="cuda", seed=0)
    x = torch.randn(2, 5, 16, device="cuda")
    out = layer(x)
    assert isinstance(out, torch.Tensor) and out.device.type == "cuda"
    with pytest.raises(ValueError, match="query: expected an array on the layer's device"):
        MultiheadAttention(16, 4)(x)
