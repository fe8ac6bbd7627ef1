"""QUOKA block scoring (design Sec. 4): per kept query a softmax over windows, summed over the group, averaged over
the kept queries, pooled to blocks.

Two kernels. The first computes each row's softmax normaliser (running max and sum, as flash attention does)
over one split of the complete windows, one program per (sequence, KV head, chunk, split of ``SPLIT_W`` windows);
its rows are the kept queries of every head of the KV head's group (row g * NQ + i: rank i of head g). The second,
one program per (sequence, KV head, chunk, tile of blocks), merges the splits' normalisers and, for each window
offset that overlaps a block (``selection.window_offsets``), turns the rows' logits into probabilities, sums them
over the real rows, divides by the number of real kept queries and keeps the running max over the offsets. (One
kernel that recomputed the normaliser in every tile of blocks did blocks/32 times the work of the first pass:
quadratic in the prompt per chunk.) A padding
window (``selection.PADDING_WINDOW_BIAS``: a window holding a padding token of a left-padded batch, told by its
compressed eviction score) takes no part in the softmax and scores ``selection.QUOKA_PADDING_SCORE``, below every
real score: pad keys mean nothing (with one pad id they are all alike), so scored they would only make near-ties
between blocks of padding. Nothing of size queries x windows is ever written out; the torch reference
(``selection.quoka_scores``) materialises it.
"""

from __future__ import annotations

import torch

from ...config import NosaConfig
from ...rules.selection import PADDING_WINDOW_BIAS, QUOKA_PADDING_SCORE, quoka_scores, window_offsets
from ..backend import HAS_TRITON, kernel_path, launcher, next_power_of_2, on_device, tl, triton

SPLIT_W = 512  # windows per normaliser program: a 64K prompt's 4096 windows in 8 programs per row group

if HAS_TRITON:

    @triton.jit
    def _kept_queries(q_ptr, i_b, i_h, i_r, stride_qb, stride_qh, stride_qr, stride_qn, stride_qd, G, NQ, D, scale,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """The group's kept queries of one chunk, scaled: ``[BLOCK_R, BLOCK_D]`` fp32, row g * NQ + i."""
        o_r = tl.arange(0, BLOCK_R)
        o_d = tl.arange(0, BLOCK_D)
        r_g, r_i = o_r // NQ, o_r % NQ
        p_q = (
            q_ptr
            + i_b * stride_qb
            + (i_h * G + r_g[:, None]) * stride_qh
            + i_r * stride_qr
            + r_i[:, None] * stride_qn
            + o_d[None, :] * stride_qd
        )
        m = (o_r < G * NQ)[:, None] & (o_d < D)[None, :]
        return tl.load(p_q, mask=m, other=0.0).to(tl.float32) * scale

    @triton.jit(do_not_specialize=["R", "n_split"])
    def _quoka_normaliser_kernel(
        q_ptr, k_ptr, cb_ptr, n_win_ptr, m_ptr, l_ptr,
        stride_qb, stride_qh, stride_qr, stride_qn, stride_qd,
        stride_kb, stride_kh, stride_kw, stride_kd,
        stride_cbb, stride_cbh, stride_cbw,
        Hk, G, NQ, D, R, n_split, scale,
        HAS_BIAS: tl.constexpr, PAD_BIAS: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr, SPLIT: tl.constexpr,
    ):
        """Program (sequence x KV head, chunk, split): each row's running max and sum of exp over the usable
        windows (complete, not padding) of windows ``split * SPLIT ..``; written to ``[B, Hk, R, n_split, BLOCK_R]``."""
        i_bh, i_r, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        i_b, i_h = i_bh // Hk, i_bh % Hk
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < D
        b_q = _kept_queries(q_ptr, i_b, i_h, i_r, stride_qb, stride_qh, stride_qr, stride_qn, stride_qd, G, NQ, D,
                            scale, BLOCK_R, BLOCK_D)
        n_win = tl.minimum(tl.load(n_win_ptr + i_r), (i_s + 1) * SPLIT)
        b_m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        b_l = tl.zeros([BLOCK_R], dtype=tl.float32)
        for w0 in range(i_s * SPLIT, n_win, BLOCK_W):
            o_w = w0 + tl.arange(0, BLOCK_W)
            m_w = o_w < n_win
            p_k = k_ptr + i_b * stride_kb + i_h * stride_kh + o_w[:, None] * stride_kw + o_d[None, :] * stride_kd
            b_k = tl.load(p_k, mask=m_w[:, None] & m_d[None, :], other=0.0).to(tl.float32)
            if HAS_BIAS:
                p_cb = cb_ptr + i_b * stride_cbb + i_h * stride_cbh + o_w * stride_cbw
                m_w = m_w & (tl.load(p_cb, mask=m_w, other=0.0) >= PAD_BIAS)
            # tf32x3 (three tf32 products on the tensor cores) keeps about fp32's precision; one tf32 product would
            # cost ~1e-3 on the logits, enough to reorder close blocks against the reference.
            b_s = tl.dot(b_q, tl.trans(b_k), input_precision="tf32x3")  # [BLOCK_R, BLOCK_W]
            b_s = tl.where(m_w[None, :], b_s, float("-inf"))
            b_mn = tl.maximum(b_m, tl.max(b_s, axis=1))
            b_safe = tl.where(b_mn == float("-inf"), 0.0, b_mn)  # no usable window yet: nothing to rescale
            b_l = b_l * tl.exp(b_m - b_safe) + tl.sum(tl.exp(b_s - b_safe[:, None]), axis=1)
            b_m = b_mn
        o_out = ((i_bh * R + i_r) * n_split + i_s) * BLOCK_R + tl.arange(0, BLOCK_R)
        tl.store(m_ptr + o_out, b_m)
        tl.store(l_ptr + o_out, b_l)

    @triton.jit(do_not_specialize=["N", "R", "n_split", "stride_vb", "stride_ob", "stride_oh", "stride_or"])
    def _quoka_score_kernel(
        q_ptr, k_ptr, cb_ptr, n_win_ptr, n_valid_ptr, m_ptr, l_ptr, out_ptr,
        stride_qb, stride_qh, stride_qr, stride_qn, stride_qd,
        stride_kb, stride_kh, stride_kw, stride_kd,
        stride_cbb, stride_cbh, stride_cbw,
        stride_vb, stride_vr,
        stride_ob, stride_oh, stride_or, stride_on,
        Hk, G, NQ, D, N, R, n_split, scale,
        PER_BLOCK: tl.constexpr, FIRST_OFFSET: tl.constexpr, N_OFFSETS: tl.constexpr,
        HAS_BIAS: tl.constexpr, PAD_BIAS: tl.constexpr, PAD_SCORE: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """Program (sequence x KV head, chunk, tile of blocks): the blocks' scores."""
        i_bh, i_r, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        i_b, i_h = i_bh // Hk, i_bh % Hk
        o_r = tl.arange(0, BLOCK_R)
        o_d = tl.arange(0, BLOCK_D)
        o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_d = o_d < D
        m_n = o_n < N
        n_win = tl.load(n_win_ptr + i_r)
        n_real = tl.load(n_valid_ptr + i_b * stride_vb + i_r * stride_vr)
        m_real = (o_r < G * NQ) & (o_r % NQ < n_real)  # kept query i of a head counts when i is a real token
        b_q = _kept_queries(q_ptr, i_b, i_h, i_r, stride_qb, stride_qh, stride_qr, stride_qn, stride_qd, G, NQ, D,
                            scale, BLOCK_R, BLOCK_D)

        # The splits' normalisers, merged as flash-decoding merges partial softmaxes.
        b_m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        b_l = tl.zeros([BLOCK_R], dtype=tl.float32)
        for i_s in range(0, n_split):
            o_in = ((i_bh * R + i_r) * n_split + i_s) * BLOCK_R + o_r
            s_m = tl.load(m_ptr + o_in)
            s_l = tl.load(l_ptr + o_in)
            b_mn = tl.maximum(b_m, s_m)
            b_safe = tl.where(b_mn == float("-inf"), 0.0, b_mn)
            b_l = b_l * tl.exp(b_m - b_safe) + s_l * tl.exp(s_m - b_safe)
            b_m = b_mn
        # a row without a usable window gives no mass (0), as the reference's nan_to_num
        b_m = tl.where(b_l > 0, b_m, 0.0)
        b_inv = tl.where(m_real & (b_l > 0), 1.0 / tl.where(b_l > 0, b_l, 1.0), 0.0)
        b_inv = b_inv / tl.maximum(n_real, 1).to(tl.float32)

        # Per window offset, the rows' mean probability; per block, the max over offsets.
        best = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
        for j in range(N_OFFSETS):  # not unrolled: see block_scores._select_kernel (narrow windows)
            o_w = o_n * PER_BLOCK + (FIRST_OFFSET + j)
            m_w = m_n & (o_w >= 0) & (o_w < n_win)
            p_k = k_ptr + i_b * stride_kb + i_h * stride_kh + o_w[:, None] * stride_kw + o_d[None, :] * stride_kd
            b_k = tl.load(p_k, mask=m_w[:, None] & m_d[None, :], other=0.0).to(tl.float32)
            b_s = tl.dot(b_q, tl.trans(b_k), input_precision="tf32x3")  # [BLOCK_R, BLOCK_N]
            b_p = tl.exp(tl.minimum(b_s - b_m[:, None], 0.0)) * b_inv[:, None]
            b_w = tl.sum(b_p, axis=0)
            b_w = tl.where(n_real > 0, b_w, float("-inf"))
            if HAS_BIAS:  # a padding window scores at most PAD_SCORE, below every real score
                p_cb = cb_ptr + i_b * stride_cbb + i_h * stride_cbh + o_w * stride_cbw
                pad = tl.load(p_cb, mask=m_w, other=0.0) < PAD_BIAS
                b_w = tl.where(pad, tl.minimum(b_w, PAD_SCORE), b_w)
            best = tl.maximum(best, tl.where(m_w, b_w, float("-inf")))

        p_o = out_ptr + i_b * stride_ob + i_h * stride_oh + i_r * stride_or + o_n * stride_on
        tl.store(p_o, best, mask=m_n)


def _launch(kept_queries, compressed_keys, n_windows, n_blocks, cfg, n_valid, compressed_bias):
    B, H, R, NQ, D = kept_queries.shape
    Hk, W = compressed_keys.shape[1], compressed_keys.shape[2]
    out = torch.empty(B, Hk, R, n_blocks, dtype=torch.float32, device=kept_queries.device)
    if out.numel() == 0:
        return out
    per_block, offsets = window_offsets(cfg)
    n_windows = n_windows.to(device=kept_queries.device, dtype=torch.int32)
    n_valid = n_valid.to(device=kept_queries.device, dtype=torch.int32)
    has_bias = compressed_bias is not None
    cb = compressed_bias if has_bias else n_valid  # any tensor: never read without HAS_BIAS
    cb_strides = compressed_bias.stride() if has_bias else (0, 0, 0)
    # Splits cover the keys' capacity, not the windows in use: that count lives on the device (no host sync);
    # a split past a chunk's windows leaves max -inf and sum 0, which the merge ignores.
    n_split = max(1, -(-W // SPLIT_W))
    block_r = max(16, next_power_of_2(H // Hk * NQ))
    block_d = max(16, next_power_of_2(D))
    m_part = torch.empty(B * Hk * R * n_split * block_r, dtype=torch.float32, device=kept_queries.device)
    l_part = torch.empty_like(m_part)
    common = dict(Hk=Hk, G=H // Hk, NQ=NQ, D=D, R=R, n_split=n_split, scale=D**-0.5, HAS_BIAS=has_bias,
                  PAD_BIAS=PADDING_WINDOW_BIAS, BLOCK_R=block_r, BLOCK_D=block_d)
    block_n = 32
    with on_device(kept_queries):
        launcher(_quoka_normaliser_kernel)[(B * Hk, R, n_split)](
            kept_queries, compressed_keys, cb, n_windows, m_part, l_part,
            *kept_queries.stride(), *compressed_keys.stride(), *cb_strides,
            BLOCK_W=32, SPLIT=SPLIT_W, **common,
        )
        launcher(_quoka_score_kernel)[(B * Hk, R, -(-n_blocks // block_n))](
            kept_queries, compressed_keys, cb, n_windows, n_valid, m_part, l_part, out,
            *kept_queries.stride(), *compressed_keys.stride(), *cb_strides, *n_valid.stride(), *out.stride(),
            N=n_blocks, PER_BLOCK=per_block, FIRST_OFFSET=int(offsets[0]), N_OFFSETS=len(offsets),
            PAD_SCORE=QUOKA_PADDING_SCORE, BLOCK_N=block_n, **common,
        )
    return out


def quoka_score_ref(kept_queries, compressed_keys, n_windows, n_blocks, cfg, n_valid=None, compressed_bias=None):
    """The torch reference: ``selection.quoka_scores``."""
    return quoka_scores(kept_queries, compressed_keys, n_windows, n_blocks, cfg, n_valid,
                        compressed_bias=compressed_bias)


def quoka_score(
    kept_queries: torch.Tensor,
    compressed_keys: torch.Tensor,
    n_windows: torch.Tensor,
    n_blocks: int,
    cfg: NosaConfig,
    *,
    n_valid: torch.Tensor | None = None,
    compressed_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """QUOKA block scores of R chunks: Triton on CUDA, torch elsewhere (``HF_NOSA_KERNELS=torch|triton`` forces one,
    see ``backend.py``).

    Args:
        kept_queries: ``[B, H, R, n, D]`` the kept queries of each chunk and query head (any float dtype).
        compressed_keys: ``[B, Hk, W, D]``.
        n_windows: ``[R]`` integer, windows complete before each chunk.
        n_blocks: N, blocks to score.
        n_valid: ``[B, R]`` integer, how many of the kept queries are real tokens (default: all ``n``).
        compressed_bias: ``[B, Hk, W]`` float32 window means of the eviction scores (padding folded in); they
            mark the padding windows, which score ``selection.QUOKA_PADDING_SCORE``. None: no padding.

    Returns:
        ``[B, Hk, R, N]`` float32: per block the max over overlapping windows of the kept queries' mean (over
        queries) of the group's summed softmax probability over windows (``QUOKA_PADDING_SCORE`` if every complete
        window is a padding window); -inf where no complete window or no real kept query exists.

    Example:
        >>> from hf_nosa import NosaConfig
        >>> cfg = NosaConfig(block_size=16, budget_tokens=64, query_tokens=16, sink_tokens=16, local_tokens=16,
        ...                  compress_kernel=8, compress_stride=4)
        >>> s = quoka_score(torch.randn(1, 4, 2, 3, 8), torch.randn(1, 2, 15, 8), torch.tensor([7, 15]), 4, cfg)
        >>> s.shape
        torch.Size([1, 2, 2, 4])
    """
    for name, value in (("kept_queries", kept_queries), ("compressed_keys", compressed_keys), ("n_windows", n_windows)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"quoka_score: {name} must be a tensor, got {type(value).__name__}")
    if not isinstance(cfg, NosaConfig):
        raise TypeError(f"quoka_score: cfg must be a NosaConfig, got {type(cfg).__name__}")
    if kept_queries.dim() != 5 or compressed_keys.dim() != 4:
        raise ValueError(
            "quoka_score: kept_queries must be [B, H, R, n, D] and compressed_keys [B, Hk, W, D]; got shapes "
            f"{tuple(kept_queries.shape)} and {tuple(compressed_keys.shape)}"
        )
    B, H, R, n, D = kept_queries.shape
    Bk, Hk, _, Dk = compressed_keys.shape
    if Bk != B or Dk != D or Hk == 0 or H % Hk:
        raise ValueError(
            f"quoka_score: kept_queries {tuple(kept_queries.shape)} and compressed_keys "
            f"{tuple(compressed_keys.shape)} must share B and D, with H a multiple of Hk"
        )
    if tuple(n_windows.shape) != (R,):
        raise ValueError(f"quoka_score: n_windows must have shape ({R},), got {tuple(n_windows.shape)}")
    if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or n_blocks < 0:
        raise ValueError(f"quoka_score: n_blocks must be a non-negative integer, got {n_blocks!r}")
    if n_valid is not None and tuple(n_valid.shape) != (B, R):
        raise ValueError(f"quoka_score: n_valid must have shape ({B}, {R}), got {tuple(n_valid.shape)}")
    if compressed_bias is not None:
        if not isinstance(compressed_bias, torch.Tensor):
            kind = type(compressed_bias).__name__
            raise TypeError(f"quoka_score: compressed_bias must be a tensor or None, got {kind}")
        if tuple(compressed_bias.shape) != tuple(compressed_keys.shape[:3]) or compressed_bias.dtype != torch.float32:
            raise ValueError(
                f"quoka_score: compressed_bias must be float32 [B, Hk, W] = {tuple(compressed_keys.shape[:3])}, like "
                f"the compressed keys; got {compressed_bias.dtype} {tuple(compressed_bias.shape)}"
            )
    if n < 1:
        raise ValueError("quoka_score: at least one kept query per chunk is needed (n >= 1)")
    if kernel_path("quoka_score", kept_queries) == "torch":
        return quoka_score_ref(kept_queries, compressed_keys, n_windows, n_blocks, cfg, n_valid, compressed_bias)
    if n_valid is None:
        n_valid = torch.full((B, R), n, dtype=torch.int32, device=kept_queries.device)
    return _launch(kept_queries, compressed_keys, n_windows, n_blocks, cfg, n_valid, compressed_bias)
