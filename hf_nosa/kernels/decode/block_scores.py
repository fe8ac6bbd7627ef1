"""NOSA block selection of one decode step on the device: compressed-key scores, block pooling, the two top-k's.

Two launches per layer, no host sync (the token index is read from a device tensor):

1. ``_window_logits_kernel`` (one program per (sequence, KV head, tile of windows)): optionally appends the new
   token first (ring of the last ``compress_kernel`` tokens; the window that ends at it is averaged and stored,
   keys and eviction scores alike), then ``q . k~ * scale`` for every query head of the group.
2. ``_select_kernel`` (one program per (sequence, KV head)): softmax per query head over the complete windows
   that are not padding windows (``selection.PADDING_WINDOW_BIAS``: a window holding a padding token of a
   left-padded batch, told by its compressed eviction score; it gets probability 0), summed over the GQA group,
   max-pooled to blocks; eviction scores max-pooled over the same windows; +inf for the sink blocks and the local
   window; ``Q = top(query score, sink + local + query blocks)``; eviction score with +inf on Q; ``top(.., K)``.
   A top-k is a threshold search over order-preserving integer keys (32 counting passes, then ties to the most
   recent block), so it is exact, needs no sort, and matches ``topk_recent_first``.

Blocks are scored over a fixed capacity (``N_SORT``, from the compressed-key buffer's capacity) with masks, so the
kernels recompile only when that buffer grows (to the next power of two of windows), not every block.

The torch reference is ``rules/selection.py`` (``query_block_scores``, ``eviction_block_scores``, ``select_blocks``).
Selected blocks come back in ascending order, -1 after them (the reference orders by score; as sets they agree).

Rows of a left-padded batch are stored row-relative (``hf_nosa.rules.padding``): both kernels read ``offsets [B]``
beside the step, and row b's token is ``t - offsets[b]`` for its windows, blocks, sink and local window.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...config import NosaConfig
from ...rules.selection import (
    PADDING_WINDOW_BIAS,
    compress_keys,
    eviction_block_scores,
    favour_resident,
    num_windows,
    query_block_scores,
    select_blocks,
    window_offsets,
)
from ..backend import HAS_TRITON, interpreting, kernel_path, launcher, next_power_of_2, on_device, tl, triton

BLOCK_W = 64  # windows per program of the logits kernel
MIN_WINDOW_CAPACITY = 256


class NewToken(NamedTuple):
    """The token being decoded and the ring of the last ``compress_kernel`` tokens it goes into (updated in place)."""

    key: torch.Tensor  # [B, Hk, 1, D] post-RoPE
    bias: torch.Tensor  # [B, Hk, 1] float32 eviction score
    ring_k: torch.Tensor  # [B, Hk, compress_kernel, D]
    ring_b: torch.Tensor  # [B, Hk, compress_kernel] float32



def _empty(*shape, dtype, device) -> torch.Tensor:
    """Every buffer a launch allocates (outputs and scratch); tests swap it for one that poisons them."""
    return torch.empty(*shape, dtype=dtype, device=device)


if HAS_TRITON:

    @triton.jit
    def _window_logits_kernel(
        q_ptr, ck_ptr, cb_ptr, ring_k_ptr, ring_b_ptr, k_new_ptr, b_new_ptr, step_ptr, offset_ptr, logits_ptr,
        stride_q_b, stride_q_h, stride_ck_b, stride_ck_h, stride_ck_w, stride_cb_b, stride_cb_h,
        stride_rk_b, stride_rk_h, stride_rk_t, stride_rb_b, stride_rb_h, stride_kn_b, stride_kn_h,
        stride_bn_b, stride_bn_h,
        W_CAP, scale,
        HK: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        BW: tl.constexpr, KER: tl.constexpr, KER_PAD: tl.constexpr, STRIDE: tl.constexpr,
        APPEND: tl.constexpr, SCORE: tl.constexpr, IEEE: tl.constexpr,
    ):
        i_bh = tl.program_id(0)
        i_w = tl.program_id(1)
        i_b = i_bh // HK
        i_h = i_bh % HK
        t = tl.load(step_ptr) - tl.load(offset_ptr + i_b)  # row-relative (hf_nosa.rules.padding)
        n_win = tl.where(t + 1 >= KER, (t + 1 - KER) // STRIDE + 1, 0).to(tl.int32)
        o_w = i_w * BW + tl.arange(0, BW)
        o_d = tl.arange(0, D_PAD)
        m_d = o_d < D
        p_ck = ck_ptr + i_b.to(tl.int64) * stride_ck_b + i_h * stride_ck_h
        p_cb = cb_ptr + i_b.to(tl.int64) * stride_cb_b + i_h * stride_cb_h

        w_new = n_win - 1
        mine = False
        k_mean = tl.zeros([D_PAD], tl.float32)
        if APPEND:
            r = (t % KER).to(tl.int32)
            p_rk = ring_k_ptr + i_b * stride_rk_b + i_h * stride_rk_h
            p_rb = ring_b_ptr + i_b * stride_rb_b + i_h * stride_rb_h
            k_new = tl.load(k_new_ptr + i_b * stride_kn_b + i_h * stride_kn_h + o_d, mask=m_d, other=0.0)
            b_new = tl.load(b_new_ptr + i_b * stride_bn_b + i_h * stride_bn_h)
            if i_w == 0:
                tl.store(p_rk + r * stride_rk_t + o_d, k_new, mask=m_d)
                tl.store(p_rb + r, b_new)
            completes = (t + 1 >= KER) & ((t + 1 - KER) % STRIDE == 0)
            if SCORE:
                mine = completes & (w_new >= i_w * BW) & (w_new < i_w * BW + BW)
            else:
                mine = completes
            if mine:
                # The window of the last KER tokens: the ring, with this token in place of the one it replaces
                # (read from registers: the program of tile 0 may be writing it concurrently).
                o_r = tl.arange(0, KER_PAD)
                m_r = o_r < KER
                ring = tl.load(p_rk + o_r[:, None] * stride_rk_t + o_d[None, :], mask=m_r[:, None] & m_d[None, :], other=0.0)
                ring = tl.where(o_r[:, None] == r, k_new[None, :], ring).to(tl.float32)
                k_mean = (tl.sum(ring, 0) / KER).to(ck_ptr.dtype.element_ty).to(tl.float32)
                tl.store(p_ck + w_new * stride_ck_w + o_d, k_mean.to(ck_ptr.dtype.element_ty), mask=m_d)
                ring_b = tl.load(p_rb + o_r, mask=m_r, other=0.0)
                ring_b = tl.where(o_r == r, b_new, ring_b)
                tl.store(p_cb + w_new, tl.sum(ring_b, 0) / KER)

        if SCORE:
            o_g = tl.arange(0, G_PAD)
            m_g = o_g < G
            p_q = q_ptr + i_b * stride_q_b + (i_h * G + o_g)[:, None] * stride_q_h + o_d[None, :]
            b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0)
            m_w = o_w < n_win
            b_k = tl.load(p_ck + o_w[:, None] * stride_ck_w + o_d[None, :], mask=m_w[:, None] & m_d[None, :], other=0.0)
            if APPEND:
                b_k = tl.where((o_w[:, None] == w_new) & mine, k_mean[None, :].to(b_k.dtype), b_k)
            if IEEE:
                b_s = tl.dot(b_q.to(tl.float32), tl.trans(b_k.to(tl.float32)), input_precision="ieee")
            else:
                b_s = tl.dot(b_q, tl.trans(b_k))
            b_s = tl.where(m_w[None, :], b_s * scale, float("-inf"))
            p_out = logits_ptr + (i_bh * G + o_g).to(tl.int64)[:, None] * W_CAP + o_w[None, :]
            tl.store(p_out, b_s, mask=m_g[:, None] & (o_w < W_CAP)[None, :])

    @triton.jit
    def _top_mask(x, k, N: tl.constexpr):
        """Mask of the k largest of ``x [N]``, ties to the highest index; -inf entries are never chosen."""
        x = tl.where(x == 0.0, 0.0, x)  # -0.0 and +0.0 are one value, as in torch.sort
        bits = x.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)  # integer order == float order
        lo = tl.full([], -2147483648, tl.int64)
        hi = tl.full([], 2147483647, tl.int64)
        for _ in tl.static_range(32):  # largest v with at least k keys >= v: the k-th largest key
            mid = lo + (hi - lo + 1) // 2
            enough = tl.sum((key >= mid).to(tl.int32), 0) >= k
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid - 1)
        above = key > lo
        tied = (key == lo).to(tl.int32)
        need = k - tl.sum(above.to(tl.int32), 0)
        later_ties = tl.sum(tied, 0) - tl.cumsum(tied, 0)  # tied entries with a higher index
        chosen = above | ((tied > 0) & (later_ties < need))
        return chosen & (x != float("-inf"))

    @triton.jit
    def _select_kernel(
        logits_ptr, cb_ptr, step_ptr, offset_ptr, out_ptr, qs_ptr, es_ptr, resident_ptr,
        stride_cb_b, stride_cb_h, stride_o_b, stride_o_h, stride_r_b, stride_r_h,
        W_CAP, S, factor,
        HK: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, BW: tl.constexpr, N_SORT: tl.constexpr,
        K: tl.constexpr, K_PAD: tl.constexpr, N_Q: tl.constexpr, P: tl.constexpr, KER: tl.constexpr,
        STRIDE: tl.constexpr, R: tl.constexpr, OFF0: tl.constexpr, M: tl.constexpr,
        SINK: tl.constexpr, LOCAL: tl.constexpr, STORE_SCORES: tl.constexpr, PAD_BIAS: tl.constexpr,
        STICKY: tl.constexpr,
    ):
        i_bh = tl.program_id(0)
        i_b = i_bh // HK
        i_h = i_bh % HK
        t = tl.load(step_ptr) - tl.load(offset_ptr + i_b)  # row-relative (hf_nosa.rules.padding)
        c = (t // P).to(tl.int32)
        n_win = tl.where(t + 1 >= KER, (t + 1 - KER) // STRIDE + 1, 0).to(tl.int32)
        p_logits = logits_ptr + (i_bh * G).to(tl.int64) * W_CAP
        p_cb = cb_ptr + i_b.to(tl.int64) * stride_cb_b + i_h * stride_cb_h

        # softmax statistics per query head over the complete windows, padding windows left out
        o_g = tl.arange(0, G_PAD)
        m_g = o_g < G
        b_m = tl.full([G_PAD], float("-inf"), tl.float32)
        b_l = tl.zeros([G_PAD], tl.float32)
        for w0 in range(0, n_win, BW):
            o_w = w0 + tl.arange(0, BW)
            m_w = (o_w < n_win) & (tl.load(p_cb + o_w, mask=o_w < n_win, other=0.0) >= PAD_BIAS)
            x = tl.load(p_logits + o_g[:, None] * W_CAP + o_w[None, :], mask=m_g[:, None] & m_w[None, :],
                        other=float("-inf"))
            m_new = tl.maximum(b_m, tl.max(x, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            b_l = b_l * tl.exp(b_m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), 1)
            b_m = m_new
        b_m = tl.where(b_m == float("-inf"), 0.0, b_m)
        b_inv = tl.where(b_l > 0, 1.0 / tl.where(b_l > 0, b_l, 1.0), 0.0)

        # pool windows to blocks: block n sees windows n * R + OFF0 .. n * R + OFF0 + M - 1
        o_n = tl.arange(0, N_SORT)
        qs = tl.zeros([N_SORT], tl.float32)
        es = tl.full([N_SORT], float("-inf"), tl.float32)
        # A loop, not unrolled: narrow windows (kernel 2, stride 1) make M ~ block_size, and unrolling that many
        # gathers took over a minute to compile.
        for j in range(M):
            w = o_n * R + (OFF0 + j)
            ok = (w >= 0) & (w < n_win)
            e = tl.load(p_cb + w, mask=ok, other=float("-inf"))
            real = ok & (e >= PAD_BIAS)  # a padding window has probability 0
            prob = tl.zeros([N_SORT], tl.float32)
            for g in tl.static_range(G):
                m_head = tl.sum(tl.where(o_g == g, b_m, 0.0), 0)
                inv_head = tl.sum(tl.where(o_g == g, b_inv, 0.0), 0)
                x = tl.load(p_logits + g * W_CAP + w, mask=real, other=float("-inf"))
                prob += tl.exp(x - m_head) * inv_head
            qs = tl.maximum(qs, tl.where(real, prob, 0.0))
            es = tl.maximum(es, e)
        if STORE_SCORES:
            tl.store(qs_ptr + i_bh * N_SORT + o_n, qs)
            tl.store(es_ptr + i_bh * N_SORT + o_n, es)

        if STICKY:  # favour_resident: the blocks the slot pool holds (last step's selection) score x factor
            p_r = resident_ptr + i_b.to(tl.int64) * stride_r_b + i_h * stride_r_h
            held = tl.zeros([N_SORT], tl.int32)
            for i_s in range(S):
                held = tl.maximum(held, (o_n == tl.load(p_r + i_s)).to(tl.int32))
            qs = tl.where(held > 0, qs * factor, qs)

        # select_blocks: +inf for sink and local window, Q from the query score, the rest from the eviction score
        valid = o_n < c
        forced = valid & ((o_n < SINK) | (o_n >= c - LOCAL))
        qs = tl.where(valid, tl.where(forced, float("inf"), qs), float("-inf"))
        in_q = _top_mask(qs, N_Q, N_SORT)
        es = tl.where(valid, tl.where(in_q, float("inf"), es), float("-inf"))
        chosen = _top_mask(es, K, N_SORT)

        p_out = out_ptr + i_b * stride_o_b + i_h * stride_o_h
        rank = tl.cumsum(chosen.to(tl.int32), 0) - 1
        tl.store(p_out + rank, o_n.to(tl.int64), mask=chosen)
        o_k = tl.arange(0, K_PAD)
        n_chosen = tl.sum(chosen.to(tl.int32), 0)
        tl.store(p_out + o_k, tl.full([K_PAD], -1, tl.int64), mask=(o_k >= n_chosen) & (o_k < K))


def _geometry(cfg: NosaConfig) -> tuple[int, int, int]:
    """(R, first window offset, number of windows per block) of ``pool_windows_to_blocks``."""
    per_block, offsets = window_offsets(cfg)
    return per_block, int(offsets[0]), int(offsets.numel())


def blocks_capacity(window_capacity: int, cfg: NosaConfig) -> int:
    """How many blocks can be candidates while the compressed keys hold at most ``window_capacity`` windows."""
    return (window_capacity * cfg.compress_stride + cfg.compress_kernel - 2) // cfg.block_size


def window_capacity_for(n_windows: int) -> int:
    """The compressed-key capacity of a cache sized for ``n_windows`` windows: the next multiple of
    ``MIN_WINDOW_CAPACITY``. The kernels take the capacity at run time (their loads are masked at it), and Triton
    specialises an integer argument only on its divisibility by 16, so every such capacity shares the compiled
    kernels; the one compile-time size it moves is the selection's sort width (``N_SORT``, a power of two of the
    blocks the capacity covers). A power of two instead would hold up to twice the windows: at 64K tokens, half of a
    serving row's 280 MB in the 1b shape. A cache that outgrows its capacity takes ``window_capacity_grown``."""
    return max(MIN_WINDOW_CAPACITY, -(-n_windows // MIN_WINDOW_CAPACITY) * MIN_WINDOW_CAPACITY)


def window_capacity_grown(n_windows: int) -> int:
    """The capacity a cache of unknown length grows to when it needs ``n_windows`` windows: a power of two, so it
    doubles (each growth is a new buffer, and a captured decode step is captured again)."""
    return max(MIN_WINDOW_CAPACITY, next_power_of_2(n_windows))


def _launch_logits(query, ck, cb, token: NewToken | None, step, offsets, cfg: NosaConfig, scale: float, score: bool):
    B, Hk, W_CAP, D = ck.shape
    H = query.shape[1] if query is not None else Hk
    G = H // Hk
    logits = _empty(B * Hk * G, W_CAP, dtype=torch.float32, device=ck.device) if score else ck
    append = token is not None
    k_new, b_new, ring_k, ring_b = token if append else (ck, cb, ck, cb)
    q = query if score else ck
    ieee = ck.dtype == torch.float32 or interpreting()
    grid = (B * Hk, triton.cdiv(W_CAP, BLOCK_W) if score else 1)
    launcher(_window_logits_kernel)[grid](
        q, ck, cb, ring_k, ring_b, k_new, b_new, step, offsets, logits,
        q.stride(0), q.stride(1), ck.stride(0), ck.stride(1), ck.stride(2), cb.stride(0), cb.stride(1),
        ring_k.stride(0), ring_k.stride(1), ring_k.stride(2), ring_b.stride(0), ring_b.stride(1),
        k_new.stride(0), k_new.stride(1), b_new.stride(0), b_new.stride(1),
        W_CAP, float(scale),
        HK=Hk, G=G, G_PAD=max(16, next_power_of_2(G)), D=D, D_PAD=next_power_of_2(max(D, 16)),
        BW=BLOCK_W, KER=cfg.compress_kernel, KER_PAD=next_power_of_2(cfg.compress_kernel),
        STRIDE=cfg.compress_stride, APPEND=append, SCORE=score, IEEE=ieee,
        num_warps=4,
    )
    return logits


def _block_select_triton(query, ck, cb, step, offsets, cfg, scale, token, K, return_scores, resident):
    B, Hk, W_CAP, _ = ck.shape
    G = query.shape[1] // Hk
    R, off0, M = _geometry(cfg)
    n_q = min(cfg.sink_blocks + cfg.local_blocks + cfg.query_blocks, K)
    N_SORT = next_power_of_2(max(K, n_q, blocks_capacity(W_CAP, cfg), 16))
    out = _empty(B, Hk, K, dtype=torch.long, device=ck.device)
    scores = _empty(2, B * Hk, N_SORT, dtype=torch.float32, device=ck.device) if return_scores else out
    with on_device(ck):
        logits = _launch_logits(query, ck, cb, token, step, offsets, cfg, scale, score=True)
        sticky = resident is not None and cfg.resident_margin > 0
        held = resident if sticky else out
        launcher(_select_kernel)[(B * Hk,)](
            logits, cb, step, offsets, out, scores[0] if return_scores else out, scores[1] if return_scores else out,
            held, cb.stride(0), cb.stride(1), out.stride(0), out.stride(1), held.stride(0), held.stride(1),
            W_CAP, held.shape[-1] if sticky else 0, 1.0 + cfg.resident_margin,
            HK=Hk, G=G, G_PAD=next_power_of_2(G), BW=BLOCK_W, N_SORT=N_SORT, K=K, K_PAD=next_power_of_2(K),
            N_Q=n_q, P=cfg.block_size, KER=cfg.compress_kernel, STRIDE=cfg.compress_stride, R=R, OFF0=off0, M=M,
            SINK=cfg.sink_blocks, LOCAL=cfg.local_blocks, STORE_SCORES=return_scores, PAD_BIAS=PADDING_WINDOW_BIAS,
            STICKY=sticky, num_warps=4,
        )
    if return_scores:
        return out, scores[0].view(B, Hk, N_SORT), scores[1].view(B, Hk, N_SORT)
    return out


# ----- torch references -----


def _row_steps(step, offsets, B: int, device) -> torch.Tensor:
    """``[B]`` row-relative index of the decode token: the step minus each row's left padding (reads the step)."""
    t = torch.full((B,), int(step.reshape(-1)[0]), dtype=torch.long, device=device)
    return t if offsets is None else t - offsets.to(device)


def append_token_ref(ck, cb, token: NewToken, step, cfg: NosaConfig, offsets=None) -> None:
    """Put the token into the ring; when a window ends at it, store the window's mean key and score (per row)."""
    B = ck.shape[0]
    t = _row_steps(step, offsets, B, ck.device)
    kernel = cfg.compress_kernel
    rows = torch.arange(B, device=ck.device)
    token.ring_k[rows, :, t % kernel] = token.key[:, :, 0]
    token.ring_b[rows, :, t % kernel] = token.bias[:, :, 0]
    for b in range(B):
        tb = int(t[b])
        n = num_windows(tb + 1, cfg)
        if n == num_windows(tb, cfg):
            continue
        order = torch.arange(tb + 1 - kernel, tb + 1, device=ck.device) % kernel
        ck[b, :, n - 1] = compress_keys(token.ring_k[b : b + 1, :, order], cfg)[0, :, 0]
        cb[b, :, n - 1] = compress_keys(token.ring_b[b : b + 1, :, order], cfg)[0, :, 0]


def block_select_ref(query, ck, cb, step, cfg: NosaConfig, scale: float, token=None, budget_blocks=None,
                     return_scores=False, offsets=None, resident=None):
    """``rules/selection.py`` applied to the decode token at ``step`` (reads it with a host sync), row-relative; the
    returned scores are those before ``favour_resident``."""
    if token is not None:
        append_token_ref(ck, cb, token, step, cfg, offsets)
    K = cfg.budget_blocks if budget_blocks is None else budget_blocks
    B, Hk = ck.shape[:2]
    t = _row_steps(step, offsets, B, ck.device)
    positions = t[:, None]  # [B, 1]
    c = int(t.max()) // cfg.block_size
    n = num_windows(int(t.max()) + 1, cfg)
    qs = query_block_scores(query, ck[:, :, :n], positions, c, cfg, scale, compressed_bias=cb[:, :, :n])[:, :, 0]
    es = eviction_block_scores(cb[:, :, :n], positions, c, cfg)[:, :, 0]
    favoured = qs[:, :, None]
    if resident is not None and cfg.resident_margin > 0:
        favoured = favour_resident(favoured, resident, cfg.resident_margin)
    selected = select_blocks(favoured, es[:, :, None], positions // cfg.block_size, cfg, K)[:, :, 0]
    # ascending, -1 last: the kernel's order
    selected = torch.where(selected < 0, torch.iinfo(torch.long).max, selected).sort(-1).values
    selected = selected.masked_fill(selected == torch.iinfo(torch.long).max, -1)
    return (selected, qs, es) if return_scores else selected


# ----- public -----


def append_token(compressed_keys, compressed_bias, token: NewToken, step: torch.Tensor, cfg: NosaConfig, *,
                 offsets: torch.Tensor | None = None) -> None:
    """Append the decode token to the ring and, when a window ends at it, to the compressed keys (in place).

    Args:
        compressed_keys: ``[B, Hk, W, D]`` window means of the keys, ``W`` a capacity >= the windows complete at
            the token; compressed_bias: ``[B, Hk, W]`` float32 window means of the eviction scores.
        token: the token and the ring of the last ``compress_kernel`` tokens.
        step: ``[1]`` long on the device, the cache index t of the token (not advanced).
        offsets: ``[B]`` long on the device, each row's left padding (row b's token is ``t - offsets[b]``), or None.
    """
    offsets = _check(None, compressed_keys, compressed_bias, step, token, offsets)
    if kernel_path("block_select", compressed_keys) == "torch":
        return append_token_ref(compressed_keys, compressed_bias, token, step, cfg, offsets)
    with on_device(compressed_keys):
        _launch_logits(None, compressed_keys, compressed_bias, token, step, offsets, cfg, 1.0, score=False)


def block_select(
    query: torch.Tensor,
    compressed_keys: torch.Tensor,
    compressed_bias: torch.Tensor,
    step: torch.Tensor,
    cfg: NosaConfig,
    scale: float,
    *,
    token: NewToken | None = None,
    budget_blocks: int | None = None,
    return_scores: bool = False,
    offsets: torch.Tensor | None = None,
    resident: torch.Tensor | None = None,
):
    """The blocks the decode token at cache index t attends to (NOSA rule of ``rules/selection.py``), on the device.

    Args:
        query: ``[B, H, 1, D]`` post-RoPE query of the token.
        compressed_keys: ``[B, Hk, W, D]`` (``W`` >= the windows complete at t; the rest is ignored);
            compressed_bias: ``[B, Hk, W]`` float32 window means of the eviction scores, padding folded in: they
            give the eviction score and mark the padding windows, which the query-aware score leaves out.
        step: ``[1]`` long on the device holding t (read on the device: no host sync).
        token: when given, the token is first appended (``append_token``).
        budget_blocks: K, default ``cfg.budget_blocks``.
        return_scores: also return the pooled query and eviction scores ``[B, Hk, N]`` (the kernel's N is its
            capacity; the reference's is t // block_size), for tests.
        offsets: ``[B]`` long on the device, each row's left padding, or None (zeros). Row b's token is then
            ``t - offsets[b]`` for every rule: blocks, windows, sink and local window counted from the row's first
            real token (``hf_nosa.rules.padding``).
        resident: ``[B, Hk, S]`` long, the blocks the slot pool holds (-1: empty slot); with
            ``cfg.resident_margin > 0`` their query-aware scores are multiplied by ``1 + resident_margin`` before
            the choice (``selection.favour_resident``). None: no block is favoured.

    Returns:
        ``[B, Hk, K]`` long block indices in ascending order, -1 after them.

    Example:
        >>> cfg = NosaConfig(block_size=16, budget_tokens=64, query_tokens=16, sink_tokens=16, local_tokens=16,
        ...                  compress_kernel=8, compress_stride=4)
        >>> ck, cb = torch.randn(1, 2, 256, 8), torch.randn(1, 2, 256)
        >>> block_select(torch.randn(1, 4, 1, 8), ck, cb, torch.tensor([200]), cfg, 0.35).shape
        torch.Size([1, 2, 4])
    """
    offsets = _check(query, compressed_keys, compressed_bias, step, token, offsets)
    if resident is not None:
        B, Hk = compressed_keys.shape[:2]
        if (resident.dim() != 3 or tuple(resident.shape[:2]) != (B, Hk) or resident.dtype != torch.long
                or resident.device != compressed_keys.device or resident.stride(-1) != 1):
            raise ValueError(f"resident must be long [B, Hk, S] with B, Hk = {B}, {Hk} on the compressed keys' device, "
                             f"contiguous in S; got {resident.dtype} {tuple(resident.shape)} on {resident.device}")
    K = cfg.budget_blocks if budget_blocks is None else budget_blocks
    if not isinstance(K, int) or K < 1:
        raise ValueError(f"budget_blocks must be a positive int; got {budget_blocks!r}")
    if kernel_path("block_select", compressed_keys) == "torch":
        return block_select_ref(query, compressed_keys, compressed_bias, step, cfg, scale, token, K, return_scores,
                                offsets, resident)
    return _block_select_triton(query, compressed_keys, compressed_bias, step, offsets, cfg, scale, token, K,
                                return_scores, resident)


def _check(query, ck, cb, step, token, offsets=None) -> torch.Tensor:
    """Validate; returns the offsets (zeros when None)."""
    if ck.dim() != 4 or ck.stride(-1) != 1:
        raise ValueError(f"compressed_keys must be [B, Hk, W, D] with a contiguous last dim; got {tuple(ck.shape)}")
    B, Hk, W, D = ck.shape
    if tuple(cb.shape) != (B, Hk, W) or cb.dtype != torch.float32 or cb.stride(-1) != 1:
        raise ValueError(f"compressed_bias must be float32 [B, Hk, W] = {(B, Hk, W)}; got {cb.dtype} {tuple(cb.shape)}")
    if query is not None:
        if query.dim() != 4 or query.shape[0] != B or query.shape[2] != 1 or query.shape[3] != D or query.shape[1] % Hk:
            raise ValueError(f"query must be [B, H, 1, D] with H a multiple of Hk={Hk}; got {tuple(query.shape)}")
        if query.stride(-1) != 1:
            raise ValueError("query must be contiguous in its last dim")
    if step.numel() != 1 or step.dtype != torch.long or step.device != ck.device:
        raise ValueError("step must be a one-element long tensor on the compressed keys' device")
    if token is not None:
        if tuple(token.key.shape) != (B, Hk, 1, D) or token.key.stride(-1) != 1:
            raise ValueError(f"token.key must be [B, Hk, 1, D] = {(B, Hk, 1, D)} with a contiguous last dim")
        if tuple(token.bias.shape) != (B, Hk, 1) or token.bias.dtype != torch.float32:
            raise ValueError(f"token.bias must be float32 [B, Hk, 1] = {(B, Hk, 1)}")
        if token.ring_k.shape[:2] != (B, Hk) or token.ring_k.shape[3] != D or token.ring_k.stride(-1) != 1:
            raise ValueError("token.ring_k must be [B, Hk, compress_kernel, D] with a contiguous last dim")
        if token.ring_b.shape != token.ring_k.shape[:3] or token.ring_b.stride(-1) != 1:
            raise ValueError("token.ring_b must be float32 [B, Hk, compress_kernel]")
    if offsets is None:
        return torch.zeros(B, dtype=torch.long, device=ck.device)
    if tuple(offsets.shape) != (B,) or offsets.dtype != torch.long or offsets.device != ck.device:
        raise ValueError(f"offsets must be long [B={B}] on the compressed keys' device; got {offsets.dtype} "
                         f"{tuple(offsets.shape)} on {offsets.device}")
    return offsets
