"""The selection bitmap kernel (``kernels/selection_bitmap.py``) against its torch reference and against the set of
indices it stands for: duplicates, entries past N and negative ones (none), K wider or narrower than N, rows that
are not a multiple of the program's rows. CPU cases run the kernel in the Triton interpreter (``interpret``)."""

from __future__ import annotations

import pytest
import torch

from hf_nosa.kernels.backend import HAS_TRITON
from hf_nosa.kernels.train.selection_bitmap import ROWS, selection_bitmap, selection_bitmap_ref

pytestmark = pytest.mark.usefixtures("one_thread")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package")


def _indices(shape, n_blocks, seed, dtype=torch.int16):
    """Random indices with every kind of entry: duplicates, ``n_blocks`` (none), beyond it, negative."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-2, n_blocks + 3, shape, generator=g)
    return idx.to(dtype)


def _expected(indices: torch.Tensor, n_blocks: int) -> torch.Tensor:
    out = torch.zeros(*indices.shape[:-1], n_blocks, dtype=torch.bool)
    flat, rows = indices.reshape(-1, indices.shape[-1]).tolist(), out.view(-1, n_blocks)
    for r, row in enumerate(flat):
        for n in row:
            if 0 <= n < n_blocks:
                rows[r, n] = True
    return out


@pytest.mark.parametrize("shape,n_blocks,dtype", [
    ((2, 3, ROWS + 5, 7), 40, torch.int16),   # rows past a program's, N not a power of two
    ((1, 2, 9, 40), 13, torch.int32),          # K wider than N: duplicates everywhere
    ((3, 1), 300, torch.int64),                # N over one column chunk of the kernel
])
@needs_triton
def test_kernel_matches_reference_and_the_index_sets(interpret, shape, n_blocks, dtype):
    indices = _indices(shape, n_blocks, seed=n_blocks)
    expected = _expected(indices, n_blocks)
    assert torch.equal(selection_bitmap_ref(indices, n_blocks), expected)
    out = selection_bitmap(indices, n_blocks)
    assert out.dtype == torch.bool and out.is_contiguous() and out.shape == (*shape[:-1], n_blocks)
    assert torch.equal(out, expected)


@needs_triton
def test_zero_blocks_and_no_indices(interpret):
    assert selection_bitmap(torch.zeros(3, 0, dtype=torch.int16), 5).tolist() == [[False] * 5] * 3
    assert selection_bitmap(torch.zeros(3, 2, dtype=torch.int16), 0).shape == (3, 0)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="n_blocks"):
        selection_bitmap(torch.zeros(2, 3, dtype=torch.int16), -1)
    with pytest.raises(ValueError, match="indices must be an integer tensor"):
        selection_bitmap(torch.zeros(2, 3), 4)


@pytest.mark.gpu
def test_kernel_on_cuda_at_the_training_shape():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    indices = _indices((1, 8, 4096, 64), 1025, seed=7).cuda()
    assert torch.equal(selection_bitmap(indices, 1024).cpu(), selection_bitmap_ref(indices.cpu(), 1024))
