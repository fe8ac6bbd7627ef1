"""The move-in kernel (the previous prefill chunk's blocks into the slot pool) against its torch reference.

CPU cases run the kernel in the Triton interpreter (``TRITON_INTERPRET=1``, set per test); the ``gpu`` case runs the
compiled kernel at the 1b shape's sizes.
"""

import importlib

import pytest
import torch

move_module = importlib.import_module("hf_nosa.kernels.prefill.move_in")


def _case(B, Hk, S, K, P, D, T, n_held, n_kept, seed, device="cpu", dtype=torch.float32):
    """A pool whose slots hold ``n_held`` distinct random blocks (the rest -1), of which ``n_kept`` per row are
    selected, plus unheld blocks and -1 padding in the selection; the previous chunk's tokens at random."""
    g = torch.Generator().manual_seed(seed)
    held = torch.full((B, Hk, S), -1, dtype=torch.long)
    selected = torch.full((B, Hk, K), -1, dtype=torch.long)
    for b in range(B):
        for h in range(Hk):
            blocks = torch.randperm(200, generator=g)[: n_held + K]
            slots = torch.randperm(S, generator=g)[:n_held]
            held[b, h, slots] = blocks[:n_held]
            chosen = torch.cat([blocks[:n_kept], blocks[n_held : n_held + K - n_kept - 1]])
            selected[b, h, torch.randperm(K, generator=g)[: chosen.numel()]] = chosen
    slot_k = torch.randn(B, Hk, S + 1, P, D, generator=g).to(dtype)
    slot_v = torch.randn(B, Hk, S + 1, P, D, generator=g).to(dtype)
    slot_b = torch.randn(B, Hk, S + 1, P, generator=g)
    k = torch.randn(B, Hk, T, D, generator=g).to(dtype)
    v = torch.randn(B, Hk, T, D, generator=g).to(dtype)
    bias = torch.randn(B, Hk, T, generator=g)
    to = lambda *xs: [x.to(device) for x in xs]  # noqa: E731
    return to(slot_k, slot_v, slot_b, held, selected, k, v, bias)


def _run(fn, args, first, n, a):
    pool = [x.clone() for x in args[:4]]
    fn(*pool, *args[4:], first, n, a)
    return pool


@pytest.mark.parametrize(
    "B,Hk,S,K,P,D,T,n_held,n_kept,n,a",
    [
        (1, 1, 9, 8, 4, 8, 40, 5, 3, 4, 8),  # free slots to spare
        (2, 3, 9, 8, 4, 8, 40, 8, 6, 3, 0),  # exactly enough free slots (held but unselected slots are free)
        (2, 2, 7, 6, 4, 8, 40, 7, 6, 3, 12),  # one free slot for three blocks: two go to the scratch slot
        (1, 2, 33, 32, 16, 24, 200, 30, 20, 8, 64),  # a wider pool, BLOCK_K loop of one tile, D not a power of 2
        (1, 1, 80, 70, 4, 8, 40, 60, 50, 5, 4),  # K above one BLOCK_K tile
    ],
)
def test_kernel_matches_reference(interpret, B, Hk, S, K, P, D, T, n_held, n_kept, n, a):
    args = _case(B, Hk, S, K, P, D, T, n_held, n_kept, seed=S + K + n)
    first = 100 + n_held
    expected = _run(move_module.move_in_ref, args, first, n, a)
    actual = _run(move_module.move_in, args, first, n, a)
    assert torch.equal(actual[3], expected[3])  # slot_block
    for got, want in zip(actual[:3], expected[:3]):
        # the scratch slot S takes whatever has no place: the reference's scatter picks any of the duplicates
        assert torch.equal(got[:, :, :S], want[:, :, :S])
    assert not torch.equal(expected[3], args[3])  # something was placed


def test_reference_places_blocks_in_free_slots_first():
    """The reference's contract, checked by hand: free slots in slot order, selected slots untouched."""
    P, D = 2, 3
    held = torch.tensor([[[5, -1, 7, 9, -1]]])
    selected = torch.tensor([[[9, 5, -1]]])
    slot_k = torch.zeros(1, 1, 6, P, D)
    slot_v = torch.zeros(1, 1, 6, P, D)
    slot_b = torch.zeros(1, 1, 6, P)
    k = torch.arange(10 * D, dtype=torch.float32).view(1, 1, 10, D)
    v = -k
    b = torch.arange(10, dtype=torch.float32).view(1, 1, 10)
    move_module.move_in_ref(slot_k, slot_v, slot_b, held, selected, k, v, b, first=20, n=3, a=2)
    assert held.tolist() == [[[5, 20, 21, 9, 22]]]
    for j, slot in enumerate((1, 2, 4)):
        assert torch.equal(slot_k[0, 0, slot], k[0, 0, 2 + j * P : 4 + j * P])
        assert torch.equal(slot_v[0, 0, slot], v[0, 0, 2 + j * P : 4 + j * P])
        assert torch.equal(slot_b[0, 0, slot], b[0, 0, 2 + j * P : 4 + j * P])
    assert slot_k[0, 0, [0, 3]].abs().sum() == 0


def test_bad_span_is_a_value_error():
    args = _case(1, 1, 5, 4, 4, 8, 16, 2, 1, seed=0)
    with pytest.raises(ValueError, match="n must be at most S"):
        move_module.move_in(*args, 10, 6, 0)
    with pytest.raises(ValueError, match="within the 16 given"):
        move_module.move_in(*args, 10, 2, 12)


@pytest.mark.gpu
def test_kernel_matches_reference_gpu():
    args = _case(4, 8, 65, 64, 64, 64, 512, 60, 40, seed=3, device="cuda", dtype=torch.bfloat16)
    expected = _run(move_module.move_in_ref, args, 120, 8, 0)
    actual = _run(move_module.move_in, args, 120, 8, 0)
    assert torch.equal(actual[3], expected[3])
    for got, want in zip(actual[:3], expected[:3]):
        assert torch.equal(got[:, :, :65], want[:, :, :65])
