"""The numpy views ``fastattn._dlpack`` makes of torch CPU tensors: same memory, shape, strides and
values as ``Tensor.numpy()``, read-only, alive as long as the view, and None wherever a view would
be wrong (a negative bit, no storage, another type)."""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest
import torch
from torch.utils.dlpack import to_dlpack

from fastattn import _dlpack


def _view(tensor: torch.Tensor) -> np.ndarray | None:
    return _dlpack.tensor_view(tensor, torch.Tensor, to_dlpack)


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool, torch.int32, torch.int64]
)
def test_views_match_the_tensor(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(int(np.random.default_rng().integers(2**31)))
    base = torch.randn(3, 5, 7, 9, generator=generator) * 4
    for tensor in (base, base[1:, ::2, 3:, 1::3], base.transpose(1, 2), base[0, 0, 0, 0]):
        tensor = tensor.to(dtype) if dtype != torch.bool else tensor > 0
        view = _view(tensor)
        assert view is not None
        assert view.shape == tuple(tensor.shape)
        assert view.ctypes.data == tensor.data_ptr()
        assert view.strides == tuple(s * tensor.element_size() for s in tensor.stride())
        assert not view.flags.writeable
        if dtype == torch.bfloat16:
            assert view.dtype == np.dtype(ml_dtypes.bfloat16)
            np.testing.assert_array_equal(view.view(np.int16), tensor.view(torch.int16).numpy())
        else:
            np.testing.assert_array_equal(view, tensor.numpy())


def test_a_view_keeps_its_tensor_alive() -> None:
    tensor = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    view = _view(tensor[3:])
    del tensor
    gc.collect()
    torch.zeros(64, 64)  # would reuse freed memory
    np.testing.assert_array_equal(view[0], np.arange(192, 256, dtype=np.float32))


def test_no_view_where_one_would_be_wrong() -> None:
    values = torch.randn(4, 4)
    assert _view(torch._neg_view(values)) is None  # DLPack exports the memory without the sign
    imaginary = torch.randn(4, dtype=torch.complex64).conj().imag  # public ops make negative-bit views
    assert imaginary.is_neg() and _view(imaginary) is None
    assert _view(torch.empty(4, 4, device="meta")) is None
    assert _view(values.to_sparse()) is None
    assert _view(torch.nn.Parameter(values)) is None  # another type: the general path
    assert _view(values.to(torch.complex64)) is None
    assert _dlpack.tensor_views({"q": values, "k": torch._neg_view(values)}, torch.Tensor, to_dlpack) is None
