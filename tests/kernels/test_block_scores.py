"""block_select / append_token (Triton) against selection.py.

The kernel's pooled scores must match ``query_block_scores`` / ``eviction_block_scores``; its selection must be
exactly what ``select_blocks`` picks from those scores (so rounding never hides a wrong pick), and on these
inputs also what the reference picks from its own scores. Selections are compared as ascending block lists.
"""

from __future__ import annotations

import pytest
import torch

import hf_nosa.kernels.decode.block_scores as mod
from hf_nosa import NosaConfig
from hf_nosa.kernels.decode.block_scores import NewToken, append_token, append_token_ref, block_select, block_select_ref
from hf_nosa.rules.selection import MASK_VALUE, compress_keys, favour_resident, num_windows, select_blocks
from tests.conftest import small_nosa_config
from tests.utils import assert_close

PAPER = NosaConfig()  # block 64, windows 32 / 16, budget 4096
SMALL = small_nosa_config()  # block 16, windows 8 / 4, budget 8 blocks
NARROW = small_nosa_config(compress_kernel=2, compress_stride=1)  # a window per token (byte-level models)


@pytest.fixture
def poison(monkeypatch):
    def empty(*shape, dtype, device):
        fill = float("nan") if dtype.is_floating_point else 987654321
        return torch.full(shape, fill, dtype=dtype, device=device)

    monkeypatch.setattr(mod, "_empty", empty)


def ascending(selected: torch.Tensor) -> torch.Tensor:
    big = torch.iinfo(torch.long).max
    out = torch.where(selected < 0, big, selected).sort(-1).values
    return out.masked_fill(out == big, -1)


def make_state(B, H, Hk, D, t, dtype, W, cfg, with_token, device="cpu", seed=0, pads=()):
    """Compressed keys of tokens 0..t-1 (or 0..t when the token is not appended) in a buffer of capacity W whose
    unused tail is poisoned, the ring of the last compress_kernel tokens, and the query. Row i begins with
    ``pads[i]`` tokens of left padding (eviction score MASK_VALUE, as the cache stores it)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, Hk, t + 1, D, generator=g).to(dtype)
    bias = torch.randn(B, Hk, t + 1, generator=g)
    for row, pad in enumerate(pads):
        bias[row, :, :pad] = MASK_VALUE
    done = t if with_token else t + 1
    n = num_windows(done, cfg)
    ck = torch.full((B, Hk, W, D), float("nan"), dtype=dtype)
    cb = torch.full((B, Hk, W), float("nan"))
    ck[:, :, :n] = compress_keys(keys[:, :, :done], cfg)
    cb[:, :, :n] = compress_keys(bias[:, :, :done], cfg)
    ker = cfg.compress_kernel
    ring_k = torch.zeros(B, Hk, ker, D, dtype=dtype)
    ring_b = torch.zeros(B, Hk, ker)
    recent = torch.arange(max(0, t - ker), t)
    ring_k[:, :, recent % ker] = keys[:, :, recent]
    ring_b[:, :, recent % ker] = bias[:, :, recent]
    q = torch.randn(B, 1, H, D, generator=g).to(dtype).transpose(1, 2)
    to = lambda x: x.to(device)  # noqa: E731
    token = NewToken(to(keys[:, :, t : t + 1]), to(bias[:, :, t : t + 1]), to(ring_k), to(ring_b)) if with_token else None
    return to(q), to(ck), to(cb), token, torch.tensor([t], device=device)


def clone_token(token):
    return None if token is None else NewToken(token.key, token.bias, token.ring_k.clone(), token.ring_b.clone())


def check(q, ck, cb, token, step, cfg, tol, resident=None):
    scale = q.shape[-1] ** -0.5
    t = int(step)
    ck_ref, cb_ref, tok_ref = ck.clone(), cb.clone(), clone_token(token)
    sel_ref, qs_ref, es_ref = block_select_ref(q, ck_ref, cb_ref, step.clone(), cfg, scale, tok_ref, None, True,
                                               resident=resident)
    ck_k, cb_k, tok_k = ck.clone(), cb.clone(), clone_token(token)
    sel, qs, es = block_select(q, ck_k, cb_k, step.clone(), cfg, scale, token=tok_k, return_scores=True,
                               resident=resident)
    n, c = num_windows(t + 1, cfg), t // cfg.block_size
    assert_close(ck_k[:, :, :n], ck_ref[:, :, :n], **tol, msg="compressed keys")
    assert_close(cb_k[:, :, :n], cb_ref[:, :, :n], atol=1e-6, rtol=1e-6, msg="compressed scores")
    if token is not None:
        assert torch.equal(tok_k.ring_k, tok_ref.ring_k) and torch.equal(tok_k.ring_b, tok_ref.ring_b)
    assert_close(qs[:, :, :c], qs_ref, **tol, msg="query block scores")
    assert_close(es[:, :, :c], es_ref, atol=1e-6, rtol=1e-6, msg="eviction block scores")
    assert sel.shape == sel_ref.shape and sel.dtype == torch.long
    if c:
        current = torch.tensor([c], device=q.device)
        favoured = qs[:, :, None, :c]
        if resident is not None and cfg.resident_margin:
            favoured = favour_resident(favoured, resident, cfg.resident_margin)
        on_kernel_scores = select_blocks(favoured, es[:, :, None, :c], current, cfg)[:, :, 0]
        assert torch.equal(sel, ascending(on_kernel_scores)), "the kernel's pick differs from select_blocks on its own scores"
    assert torch.equal(sel, sel_ref), "the kernel's pick differs from the reference"
    return sel


CPU_CASES = [  # B, H, Hk, D, t, dtype, W, cfg, append
    (2, 4, 2, 64, 200, torch.float32, 256, SMALL, False),
    (3, 8, 1, 64, 403, torch.float32, 256, SMALL, True),  # G = 8; a window ends at t
    (1, 8, 8, 128, 139, torch.bfloat16, 256, SMALL, True),  # G = 1
    (2, 6, 2, 64, 10, torch.float32, 256, SMALL, True),  # block 0: nothing to select
    (1, 2, 2, 64, 967, torch.float32, 512, SMALL, True),  # more blocks than the budget, capacity 512
    (1, 4, 1, 128, 1311, torch.float32, 256, PAPER, True),  # the paper's geometry
    (2, 4, 2, 64, 301, torch.float32, 512, NARROW, True),  # windows of 2 tokens, stride 1
    # capacities that are multiples of 256 windows but no power of two (a cache sized for its known length), the
    # windows near the capacity
    (2, 4, 2, 64, 2990, torch.float32, 768, SMALL, True),
    (1, 4, 1, 64, 1270, torch.bfloat16, 1280, NARROW, False),
]


@pytest.mark.parametrize("B,H,Hk,D,t,dtype,W,cfg,append", CPU_CASES)
def test_matches_reference_interpreted(interpret, poison, B, H, Hk, D, t, dtype, W, cfg, append):
    state = make_state(B, H, Hk, D, t, dtype, W, cfg, append)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    check(*state, cfg, tol)


PADDED_CASES = [  # B, H, Hk, D, t, dtype, W, cfg, append, pads
    (3, 4, 2, 64, 200, torch.float32, 256, SMALL, True, (0, 37, 64)),  # unaligned and block-aligned padding
    (2, 8, 1, 64, 299, torch.float32, 256, SMALL, False, (150, 290)),  # padding past the budget; nearly all
    (2, 8, 2, 64, 123, torch.bfloat16, 256, SMALL, True, (16, 0)),
    (1, 4, 1, 128, 1311, torch.float32, 256, PAPER, True, (700,)),
]


@pytest.mark.parametrize("B,H,Hk,D,t,dtype,W,cfg,append,pads", PADDED_CASES)
def test_padding_windows_match_reference_interpreted(interpret, poison, B, H, Hk, D, t, dtype, W, cfg, append,
                                                     pads):
    """Left-padded rows: padding windows (selection.PADDING_WINDOW_BIAS) leave the softmax in the kernel too."""
    state = make_state(B, H, Hk, D, t, dtype, W, cfg, append, pads=pads)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    check(*state, cfg, tol)
    q, ck, cb, token, step = state
    _, qs, _ = block_select(q, ck.clone(), cb.clone(), step, cfg, q.shape[-1] ** -0.5, token=clone_token(token),
                            return_scores=True)
    stride, c = cfg.compress_stride, t // cfg.block_size
    for row, pad in enumerate(pads):
        # blocks before the one where the first window without padding starts have no real window: they score 0
        first_real = (pad + stride - 1) // stride * stride  # first token of that window
        n_dead = min(first_real // cfg.block_size, c)
        assert (qs[row, :, :n_dead] == 0).all()
        assert (qs[row, :, n_dead:c] > 0).all()


ROW_CASES = [  # H, Hk, D, t, dtype, cfg, append, offsets (the rows' left padding; row b's token is t - offsets[b])
    (4, 2, 64, 200, torch.float32, SMALL, True, (0, 13, 40)),
    (8, 1, 64, 301, torch.float32, SMALL, False, (5, 0, 290)),  # a row at its third token
    (4, 2, 64, 150, torch.bfloat16, SMALL, True, (16, 3)),
    (2, 2, 64, 211, torch.float32, NARROW, True, (0, 77)),
]


@pytest.mark.parametrize("H,Hk,D,t,dtype,cfg,append,offsets", ROW_CASES)
def test_row_offsets_select_like_each_row_alone_interpreted(interpret, poison, monkeypatch, H, Hk, D, t, dtype, cfg,
                                                            append, offsets):
    """Rows stored row-relative (hf_nosa.rules.padding): with ``offsets`` the kernel gives every row what the reference
    gives that row alone at its own token t - offsets[b] (appended window, ring and selection)."""
    scale = D ** -0.5
    rows = [make_state(1, H, Hk, D, t - off, dtype, 256, cfg, append, seed=b) for b, off in enumerate(offsets)]
    q, ck, cb = (torch.cat([row[i] for row in rows]) for i in range(3))
    token = None if not append else NewToken(*(torch.cat([row[3][i] for row in rows]) for i in range(4)))
    step, offs = torch.tensor([t]), torch.tensor(offsets)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    sel = {}
    for path in ("torch", "triton"):
        monkeypatch.setenv("HF_NOSA_KERNELS", path)
        ck_p, cb_p, tok_p = ck.clone(), cb.clone(), clone_token(token)
        sel[path] = block_select(q, ck_p, cb_p, step, cfg, scale, token=tok_p, offsets=offs)
        for b, (off, row) in enumerate(zip(offsets, rows)):
            ck_b, cb_b, tok_b = row[1].clone(), row[2].clone(), clone_token(row[3])
            alone = block_select_ref(row[0], ck_b, cb_b, torch.tensor([t - off]), cfg, scale, tok_b)
            assert torch.equal(sel[path][b], alone[0]), (path, b)
            n = num_windows(t - off + 1, cfg)
            assert_close(ck_p[b, :, :n], ck_b[0, :, :n], **tol)
            assert_close(cb_p[b, :, :n], cb_b[0, :, :n], atol=1e-6, rtol=1e-6)
            if append:
                assert torch.equal(tok_p.ring_k[b], tok_b.ring_k[0]) and torch.equal(tok_p.ring_b[b], tok_b.ring_b[0])


def test_ties_go_to_the_most_recent_block(interpret):
    """Equal keys everywhere: every block scores the same, so the budget is the sink plus the newest blocks."""
    cfg = SMALL
    q, ck, cb, token, step = make_state(1, 4, 2, 64, 300, torch.float32, 256, cfg, False)
    ck[:] = 0.5
    cb[:] = 0.0
    sel = check(q, ck, cb, None, step, cfg, dict(atol=1e-6, rtol=1e-6))
    c = 300 // cfg.block_size
    expected = [0] + list(range(c - cfg.budget_blocks + 1, c))
    assert sel[0, 0].tolist() == expected


def held_blocks(B, Hk, S, t, cfg, seed, device="cpu"):
    """A slot table ``[B, Hk, S]``: distinct random blocks, some slots empty (-1), some at or past t's block (held
    but no candidate: the block being written)."""
    g = torch.Generator().manual_seed(seed)
    c = t // cfg.block_size
    n = max(c + 4, S)
    table = torch.stack([torch.randperm(n, generator=g)[:S] for _ in range(B * Hk)]).view(B, Hk, S)
    table[(torch.rand(B, Hk, S, generator=g) < 0.2) | (table >= c + 4)] = -1
    return table.to(device)


RESIDENT_CASES = [  # B, H, Hk, D, t, dtype, W, cfg (with resident_margin), append, pads
    (2, 4, 2, 64, 200, torch.float32, 256, SMALL.replace(resident_margin=1.0), True, ()),
    (3, 8, 1, 64, 967, torch.float32, 512, SMALL.replace(resident_margin=0.3), False, ()),
    (2, 8, 2, 64, 299, torch.bfloat16, 256, SMALL.replace(resident_margin=1.0), True, (150, 0)),
    (1, 4, 1, 128, 4999, torch.float32, 512, PAPER.replace(resident_margin=0.5), True, ()),  # 78 blocks > 64
    (2, 4, 2, 64, 301, torch.float32, 512, NARROW.replace(resident_margin=2.0), True, ()),
]


@pytest.mark.parametrize("B,H,Hk,D,t,dtype,W,cfg,append,pads", RESIDENT_CASES)
def test_resident_margin_matches_reference_interpreted(interpret, poison, B, H, Hk, D, t, dtype, W, cfg, append,
                                                       pads):
    state = make_state(B, H, Hk, D, t, dtype, W, cfg, append, pads=pads, seed=t)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    resident = held_blocks(B, Hk, cfg.budget_blocks + 1, t, cfg, seed=t)
    favoured = check(*state, cfg, tol, resident=resident)
    plain = check(*state, cfg.replace(resident_margin=0.0), tol, resident=resident)
    # the margin only ever trades a new block for a held one in the query-aware part
    held = lambda sel: sum(int(b) in set(r.tolist()) for s_, r in zip(sel.flatten(0, 1), resident.flatten(0, 1))  # noqa: E731
                           for b in s_ if b >= 0)
    assert held(favoured) >= held(plain)


def test_append_token_matches_reference(interpret):
    cfg = SMALL
    for t in (7, 8, 11, 12, 99):  # before, at and between window ends
        q, ck, cb, token, step = make_state(2, 4, 2, 64, t, torch.float32, 256, cfg, True, seed=t)
        ck_ref, cb_ref, tok_ref = ck.clone(), cb.clone(), clone_token(token)
        append_token_ref(ck_ref, cb_ref, tok_ref, step, cfg)
        append_token(ck, cb, token, step, cfg)
        n = num_windows(t + 1, cfg)
        assert_close(ck[:, :, :n], ck_ref[:, :, :n], atol=1e-6, rtol=1e-6)
        assert_close(cb[:, :, :n], cb_ref[:, :, :n], atol=1e-6, rtol=1e-6)
        assert torch.equal(token.ring_k, tok_ref.ring_k) and torch.equal(token.ring_b, tok_ref.ring_b)


def test_bad_input():
    q, ck, cb, token, step = make_state(1, 4, 2, 16, 50, torch.float32, 256, SMALL, True)
    with pytest.raises(ValueError, match="query"):
        block_select(q[:, :3], ck, cb, step, SMALL, 0.25)
    with pytest.raises(ValueError, match="compressed_bias"):
        block_select(q, ck, cb.double(), step, SMALL, 0.25)
    with pytest.raises(ValueError, match="step"):
        block_select(q, ck, cb, step.int(), SMALL, 0.25)
    with pytest.raises(ValueError, match="budget_blocks"):
        block_select(q, ck, cb, step, SMALL, 0.25, budget_blocks=0)
    with pytest.raises(ValueError, match="token.bias"):
        block_select(q, ck, cb, step, SMALL, 0.25, token=token._replace(bias=token.bias.double()))
    with pytest.raises(ValueError, match="resident"):
        block_select(q, ck, cb, step, SMALL, 0.25, resident=torch.zeros(1, 2, 9, dtype=torch.int32))
    with pytest.raises(ValueError, match="resident"):
        block_select(q, ck, cb, step, SMALL, 0.25, resident=torch.zeros(1, 3, 9, dtype=torch.long))


GPU_CASES = [  # B, H, Hk, D, t, dtype, W, cfg, append
    (4, 32, 8, 128, 20_031, torch.bfloat16, 2048, PAPER, True),
    (3, 32, 8, 64, 70_000, torch.bfloat16, 8192, PAPER, True),  # 1093 blocks: N = 2048
    (3, 32, 8, 64, 70_000, torch.bfloat16, 4608, PAPER, True),  # the capacity a cache sized for 70K keeps (4,374)
    (5, 28, 4, 128, 9_000, torch.float32, 1024, PAPER, True),
    (2, 16, 16, 64, 3_000, torch.bfloat16, 256, PAPER, False),
    (3, 4, 2, 64, 9_001, torch.float32, 16384, NosaConfig(block_size=64, budget_tokens=1024, query_tokens=512,
                                                          sink_tokens=64, local_tokens=256, compress_kernel=2,
                                                          compress_stride=1), True),  # the quality experiment's
]


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,Hk,D,t,dtype,W,cfg,append", GPU_CASES)
def test_matches_reference_gpu(monkeypatch, poison, B, H, Hk, D, t, dtype, W, cfg, append):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("HF_NOSA_KERNELS", raising=False)
    state = make_state(B, H, Hk, D, t, dtype, W, cfg, append, device="cuda")
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    check(*state, cfg, tol)


@pytest.mark.gpu
def test_resident_margin_matches_reference_gpu(monkeypatch, poison):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("HF_NOSA_KERNELS", raising=False)
    cfg = PAPER.replace(resident_margin=1.0)
    for B, t, dtype, W in ((4, 20_031, torch.bfloat16, 2048), (2, 70_000, torch.float32, 8192)):
        state = make_state(B, 32, 8, 128, t, dtype, W, cfg, True, device="cuda", seed=t)
        resident = held_blocks(B, 8, cfg.budget_blocks + 1, t, cfg, seed=t, device="cuda")
        tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        check(*state, cfg, tol, resident=resident)


@pytest.mark.gpu
def test_padding_windows_match_reference_gpu(monkeypatch, poison):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("HF_NOSA_KERNELS", raising=False)
    state = make_state(4, 32, 8, 128, 20_031, torch.float32, 2048, PAPER, True, device="cuda",
                       pads=(0, 5_000, 12_312, 20_000))
    check(*state, PAPER, dict(atol=1e-5, rtol=1e-4))
