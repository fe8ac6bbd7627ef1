"""Biased attention in one flash-style pass: ``softmax(q . k * scale + b) . v`` with the per-key bias ``b`` added
inside the kernel, causal (query ``i`` sees keys ``j <= q_offset + i``) or not, with GQA. Forward only.

Why a kernel of our own: the sdpa route (``attention.dense.bias_columns``) carries the bias in extra head
dimensions, which moves D = 64 onto FlashAttention's 96-wide tiles (1.5x the work) and measured 141 TFLOP/s on a
QUOKA chunk and 322 on a causal 32K prompt, against 245 and 486 for the same calls without a bias (H200,
``docs/results/2026-12-02_dense_attention.json``). Here the bias is one fp32 load per key tile and the head dimension
stays D.

Layout as FlashAttention-2 (and Triton's fused-attention tutorial): one program per (tile of ``BLOCK_M`` queries,
sequence x query head), a running max and sum in the exp2 domain (``log2(e)`` folded into the scale and the bias),
fp32 accumulation, keys in tiles of ``BLOCK_N``. A causal tile runs its key tiles in two loops: those every query
of the tile sees (no mask, so the compiler can pipeline the loads) and those on the diagonal (masked); key tiles
past the diagonal are never read. Masked logits are a finite floor, as ``attend``'s masks are, so a row that sees
no key (possible only when ``q_offset < 0``) gives an arbitrary average instead of NaN.

A prefix of keys every query sees can be read from a second place (``prefix=``): a QUOKA chunk attends to its
blocks where they lie in the slot pool, then to itself, with no copy joining the two (``attention.pool``).

The torch reference is ``attend.attend``; ``tests/kernels/test_flash_biased.py`` holds this kernel to it.
"""

from __future__ import annotations

import torch

from ...rules.attend import AttentionInputs, attend
from ...rules.selection import MASK_VALUE
from ..backend import (HAS_TRITON, interpreting, kernel_path, launcher, log_fallback, next_power_of_2,
                       on_device, tl, triton, tuned_run)

LOG2E = 1.4426950408889634
# Fixed tiles under the interpreter (autotuning there would run every configuration); on a GPU the launcher picks
# among CONFIGS per (head dim, causal, dtype) on the first call.
# A configuration is (BLOCK_M, BLOCK_N, num_warps, num_stages, packed): packed rows hold a tile's queries for every
# head of a GQA group (when the group is a power of two up to BLOCK_M), so each key tile is read once per group.
CONFIGS = [(128, 64, 8, 3, False), (128, 64, 4, 3, False), (128, 128, 8, 3, False), (64, 64, 4, 4, False),
           (128, 32, 4, 4, False), (128, 64, 8, 3, True), (128, 64, 4, 3, True), (128, 128, 8, 3, True)]

if HAS_TRITON:

    @triton.jit
    def _tile(b_q, p_k, p_v, p_b, o_n, n0, limit, m_i, l_i, acc, qk_scale, stride_kt, stride_vt, S,
              MASKED_TILE: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr, FLOOR: tl.constexpr):
        """One key tile ``n0 ..`` for the queries ``b_q``: the running (max, sum, accumulator), updated."""
        o_s = n0 + o_n
        if MASKED_TILE:
            m_s = o_s < S
            b_k = tl.load(p_k + o_s[:, None] * stride_kt, mask=m_s[:, None], other=0.0)
            b_bias = tl.load(p_b + o_s, mask=m_s, other=0.0)
        else:
            b_k = tl.load(p_k + o_s[:, None] * stride_kt)
            b_bias = tl.load(p_b + o_s)
        if IEEE:
            b_s = tl.dot(b_q, tl.trans(b_k.to(tl.float32)), input_precision="ieee")
        else:
            b_s = tl.dot(b_q, tl.trans(b_k))
        b_s = b_s * qk_scale + b_bias[None, :] * 1.4426950408889634
        if MASKED_TILE:
            visible = m_s[None, :]
            if CAUSAL:
                visible = visible & (o_s[None, :] <= limit[:, None])
            b_s = tl.where(visible, b_s, FLOOR)
        m_new = tl.maximum(m_i, tl.max(b_s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        b_p = tl.math.exp2(b_s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(b_p, 1)
        if MASKED_TILE:
            b_v = tl.load(p_v + o_s[:, None] * stride_vt, mask=m_s[:, None], other=0.0)
        else:
            b_v = tl.load(p_v + o_s[:, None] * stride_vt)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(b_p, b_v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
        return m_new, l_i, acc

    # The bias rows are views that start at a chunk's first key, so their addresses are 16-byte aligned or not
    # with the prompt's length: not specialized on either, or a prompt of a new length compiles a new variant.
    @triton.jit(do_not_specialize=[
        "Tq", "S", "S0", "q_offset", "stride_bb", "stride_bh", "stride_pbb", "stride_pbh", "stride_lb", "stride_lh",
    ], do_not_specialize_on_alignment=["bias_ptr", "pb_ptr"])
    def _flash_biased_kernel(
        q_ptr, k_ptr, v_ptr, bias_ptr, out_ptr, pk_ptr, pv_ptr, pb_ptr, lse_ptr,
        stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
        stride_bb, stride_bh, stride_ob, stride_oh, stride_ot,
        stride_pkb, stride_pkh, stride_pkt, stride_pvb, stride_pvh, stride_pvt, stride_pbb, stride_pbh,
        stride_lb, stride_lh,
        H, G, Tq, S, S0, q_offset, qk_scale,
        D: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr, FLOOR: tl.constexpr, PREFIX: tl.constexpr,
        LSE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACK: tl.constexpr,
    ):
        # A program's BLOCK_M rows are BLOCK_M // PACK queries x PACK query heads of one KV head (PACK = 1: one head;
        # PACK = G: the whole GQA group, which then reads each key tile once instead of G times).
        QUERIES: tl.constexpr = BLOCK_M // PACK
        i_m, i_bh = tl.program_id(0), tl.program_id(1)
        if CAUSAL:  # the last query tiles see the most keys: start them first, so the last wave is the light tiles
            i_m = tl.num_programs(0) - 1 - i_m
        i_b, i_hp = i_bh // (H // PACK), i_bh % (H // PACK)
        i_hk = i_hp * PACK // G
        o_r = tl.arange(0, BLOCK_M)
        o_h = (i_hp * PACK + o_r % PACK).to(tl.int64)  # each row's query head
        o_m = i_m * QUERIES + o_r // PACK  # each row's query
        o_n = tl.arange(0, BLOCK_N)
        o_d = tl.arange(0, D)
        m_m = o_m < Tq
        p_q = q_ptr + i_b.to(tl.int64) * stride_qb + o_h[:, None] * stride_qh + o_m[:, None].to(tl.int64) * stride_qt
        b_q = tl.load(p_q + o_d[None, :], mask=m_m[:, None], other=0.0)
        if IEEE:
            b_q = b_q.to(tl.float32)
        p_k = k_ptr + i_b.to(tl.int64) * stride_kb + i_hk.to(tl.int64) * stride_kh + o_d[None, :]
        p_v = v_ptr + i_b.to(tl.int64) * stride_vb + i_hk.to(tl.int64) * stride_vh + o_d[None, :]
        p_b = bias_ptr + i_b.to(tl.int64) * stride_bb + i_hk.to(tl.int64) * stride_bh

        m_i = tl.full([BLOCK_M], FLOOR, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        limit = o_m + q_offset  # the last key each query sees (causal)
        if PREFIX:
            # Keys every query sees, read where they lie (a QUOKA chunk's blocks in the slot pool): no join copy.
            p_pk = pk_ptr + i_b.to(tl.int64) * stride_pkb + i_hk.to(tl.int64) * stride_pkh + o_d[None, :]
            p_pv = pv_ptr + i_b.to(tl.int64) * stride_pvb + i_hk.to(tl.int64) * stride_pvh + o_d[None, :]
            p_pb = pb_ptr + i_b.to(tl.int64) * stride_pbb + i_hk.to(tl.int64) * stride_pbh
            for n0 in range(0, S0 // BLOCK_N * BLOCK_N, BLOCK_N):
                m_i, l_i, acc = _tile(b_q, p_pk, p_pv, p_pb, o_n, n0, limit, m_i, l_i, acc, qk_scale, stride_pkt,
                                      stride_pvt, S0, False, False, IEEE, FLOOR)
            for n0 in range(S0 // BLOCK_N * BLOCK_N, S0, BLOCK_N):
                m_i, l_i, acc = _tile(b_q, p_pk, p_pv, p_pb, o_n, n0, limit, m_i, l_i, acc, qk_scale, stride_pkt,
                                      stride_pvt, S0, True, False, IEEE, FLOOR)
        if CAUSAL:
            # keys every query of the tile sees: j <= q_offset + first query of the tile
            full = tl.minimum(tl.maximum(i_m * QUERIES + q_offset + 1, 0), S) // BLOCK_N * BLOCK_N
            end = tl.minimum(tl.maximum(i_m * QUERIES + QUERIES + q_offset, 0), S)
        else:
            full = S // BLOCK_N * BLOCK_N
            end = S
        for n0 in range(0, full, BLOCK_N):
            m_i, l_i, acc = _tile(b_q, p_k, p_v, p_b, o_n, n0, limit, m_i, l_i, acc, qk_scale, stride_kt, stride_vt,
                                  S, False, CAUSAL, IEEE, FLOOR)
        for n0 in range(full, end, BLOCK_N):
            m_i, l_i, acc = _tile(b_q, p_k, p_v, p_b, o_n, n0, limit, m_i, l_i, acc, qk_scale, stride_kt, stride_vt,
                                  S, True, CAUSAL, IEEE, FLOOR)

        b_o = acc / tl.maximum(l_i, 1e-30)[:, None]
        p_o = (out_ptr + i_b.to(tl.int64) * stride_ob + o_h[:, None] * stride_oh
               + o_m[:, None].to(tl.int64) * stride_ot + o_d[None, :])
        tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=m_m[:, None])
        if LSE:  # natural log: the running max and sum are in the exp2 domain
            p_l = lse_ptr + i_b.to(tl.int64) * stride_lb + o_h * stride_lh + o_m
            tl.store(p_l, (m_i + tl.math.log2(tl.maximum(l_i, 1e-30))) * 0.6931471805599453, mask=m_m)


_BEST: dict[tuple, tuple] = {}  # (D, causal, dtype, device) -> the fastest of CONFIGS, timed once


def _launch(query, keys, values, bias, scale, q_offset, causal, out, config=None, prefix=None, lse=None):
    B, H, Tq, D = query.shape
    Hk, S = keys.shape[1], keys.shape[2]
    ieee = query.dtype == torch.float32 or interpreting()  # the interpreter's bf16 tl.dot is wrong: it casts
    common = dict(D=D, CAUSAL=causal, IEEE=ieee, FLOOR=MASK_VALUE * LOG2E, PREFIX=prefix is not None,
                  LSE=lse is not None)
    lse_arg = lse if lse is not None else bias  # (unwritten without lse)
    pk, pv, pb = prefix if prefix is not None else (keys, values, bias)  # (unread without a prefix)
    S0 = pk.shape[2] if prefix is not None else 0

    G = H // Hk

    def run(block_m, block_n, warps, stages, packed):
        pack = G if packed and G == next_power_of_2(G) and G <= block_m else 1
        grid = (triton.cdiv(Tq, block_m // pack), B * H // pack)
        with on_device(query):
            launcher(_flash_biased_kernel)[grid](
                query, keys, values, bias, out, pk, pv, pb, lse_arg,
                query.stride(0), query.stride(1), query.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
                values.stride(0), values.stride(1), values.stride(2), bias.stride(0), bias.stride(1),
                out.stride(0), out.stride(1), out.stride(2),
                pk.stride(0), pk.stride(1), pk.stride(2), pv.stride(0), pv.stride(1), pv.stride(2),
                pb.stride(0), pb.stride(1), lse_arg.stride(0), lse_arg.stride(1),
                H, G, Tq, S, S0, q_offset, scale * LOG2E,
                BLOCK_M=block_m, BLOCK_N=block_n, PACK=pack, num_warps=warps, num_stages=stages, **common,
            )

    # One choice per (head dim, causal, dtype): the prefix and lse variants take the tiles their base variant chose
    # (timing each would compile every configuration again on a user's first generate call).
    tuned_run(run, CONFIGS, _BEST, (D, causal, query.dtype, query.device), query.device, "flash_biased",
              config=config, interpreter_config=(32, 32, 4, 1, False))


def _joined(keys, values, bias, q_offset, prefix):
    """The references' view of a prefix: joined in front of the keys, its length added to ``q_offset``."""
    if prefix is None:
        return keys, values, bias, q_offset
    pk, pv, pb = prefix
    return torch.cat([pk, keys], 2), torch.cat([pv, values], 2), torch.cat([pb, bias], 2), q_offset + pk.shape[2]


def flash_biased_ref(query, keys, values, bias, scale, *, q_offset=0, causal=True, prefix=None):
    """The torch reference: ``attend.attend`` (a prefix joined in front of the keys)."""
    keys, values, bias, q_offset = _joined(keys, values, bias, q_offset, prefix)
    return attend(query, AttentionInputs(keys, values, bias, None, q_offset, causal=causal), scale)


def runs_on_kernel(query: torch.Tensor, what: str) -> bool:
    """Whether attention over ``query [B, H, Tq, D]`` takes this kernel: where the Triton kernels run, for the head
    dims it takes; another head dim there takes the caller's sdpa route (``what``), said once in the log."""
    if kernel_path("flash_biased", query) != "triton":
        return False
    D = query.shape[-1]
    if D == next_power_of_2(D) and 16 <= D <= 256:
        return True
    log_fallback("flash_biased", query.device.type, f"head dim {D} is not a power of two in 16 .. 256 ({what} "
                 "takes the sdpa route with the bias in extra head dimensions)")
    return False


def flash_biased_lse_ref(query, keys, values, bias, scale, *, q_offset=0, causal=True, prefix=None):
    """The log-sum-exp of each query's biased logits over the keys it sees, ``[B, H, Tq]`` fp32 (einsum)."""
    keys, _, bias, q_offset = _joined(keys, values, bias, q_offset, prefix)
    B, H, Tq, D = query.shape
    Hk, S = keys.shape[1], keys.shape[2]
    logits = torch.einsum("bkgtd,bksd->bkgts", query.float().view(B, Hk, H // Hk, Tq, D), keys.float()) * scale
    logits = logits + bias[:, :, None, None, :]
    if causal:
        hidden = torch.arange(S, device=query.device)[None, :] > torch.arange(Tq, device=query.device)[:, None] + q_offset
        logits = logits.masked_fill(hidden, MASK_VALUE)
    return torch.logsumexp(logits, -1).reshape(B, H, Tq)


def flash_biased(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float,
                 *, q_offset: int = 0, causal: bool = True, prefix: tuple | None = None,
                 out: torch.Tensor | None = None, lse: torch.Tensor | None = None, config: tuple | None = None
                 ) -> torch.Tensor:
    """``softmax(q . k * scale + bias) . v``: Triton on CUDA, ``attend`` elsewhere (``HF_NOSA_KERNELS`` forces one).

    Args:
        query: ``[B, H, Tq, D]``; keys, values: ``[B, Hk, S, D]`` in the query's dtype, H a multiple of Hk; D a
            power of two from 16 to 256.
        bias: ``[B, Hk, S]`` float32 (``MASK_VALUE`` hides a key).
        q_offset: with ``causal``, query ``i`` sees keys ``0 .. q_offset + i`` (``S - Tq``: the queries are the
            last keys, as in a prefill chunk).
        prefix: ``(keys, values, bias)`` of ``S0`` keys before ``keys`` that every query sees (``[B, Hk, S0, D]``
            twice, ``[B, Hk, S0]`` fp32), read where they lie: a QUOKA chunk's blocks in the slot pool, then the
            chunk itself (``attention.pool``). ``q_offset`` still counts within ``keys``.
        out: where to write the result (query's shape and dtype, last dim contiguous); None: a new tensor.
        lse: a ``[B, H, Tq]`` fp32 tensor to receive each query's log-sum-exp of its logits (natural log), for
            merging with attention over other keys (``attention.prefix``); None: not computed.
        config: ``(BLOCK_M, BLOCK_N, num_warps, num_stages, packed)``; None: the fastest of ``CONFIGS``, timed
            once per (head dim, causal, dtype, device).

    Returns:
        ``[B, H, Tq, D]`` in the query's dtype (no gradient: inference paths only).

    Example:
        >>> q, k, v = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
        >>> b = torch.randn(1, 2, 6)
        >>> torch.allclose(flash_biased(q, k, v, b, 0.25), flash_biased_ref(q, k, v, b, 0.25), atol=1e-6)
        True
    """
    if query.dim() != 4 or keys.dim() != 4 or values.shape != keys.shape:
        raise ValueError(f"flash_biased: query must be [B, H, Tq, D] and keys/values [B, Hk, S, D]; got "
                         f"{tuple(query.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}")
    B, H, Tq, D = query.shape
    Hk, S = keys.shape[1], keys.shape[2]
    if keys.shape[0] != B or keys.shape[3] != D or H % Hk:
        raise ValueError(f"flash_biased: keys {tuple(keys.shape)} do not fit query {tuple(query.shape)} "
                         "(need [B, Hk, S, D] with H % Hk == 0)")
    if tuple(bias.shape) != (B, Hk, S) or bias.dtype != torch.float32:
        raise ValueError(f"flash_biased: bias must be float32 [B, Hk, S] = {(B, Hk, S)}; got {bias.dtype} "
                         f"{tuple(bias.shape)}")
    if keys.dtype != query.dtype or values.dtype != query.dtype:
        raise ValueError(f"flash_biased: query, keys and values must share a dtype; got {query.dtype}, "
                         f"{keys.dtype}, {values.dtype}")
    if prefix is not None:
        pk, pv, pb = prefix
        if pk.dim() != 4 or pv.shape != pk.shape or tuple(pk.shape[:2]) != (B, Hk) or pk.shape[3] != D \
                or tuple(pb.shape) != tuple(pk.shape[:3]) or pb.dtype != torch.float32 \
                or pk.dtype != query.dtype or pv.dtype != query.dtype:
            raise ValueError(f"flash_biased: prefix must be keys/values [B, Hk, S0, D] = [{B}, {Hk}, S0, {D}] in "
                             f"{query.dtype} and a float32 bias [B, Hk, S0]; got {tuple(pk.shape)} {pk.dtype}, "
                             f"{tuple(pv.shape)} {pv.dtype}, {tuple(pb.shape)} {pb.dtype}")
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1):
        raise ValueError(f"flash_biased: out must be {tuple(query.shape)} {query.dtype} with a contiguous last dim; "
                         f"got {tuple(out.shape)} {out.dtype}")
    if lse is not None and (tuple(lse.shape) != (B, H, Tq) or lse.dtype != torch.float32 or lse.stride(-1) != 1):
        raise ValueError(f"flash_biased: lse must be float32 [B, H, Tq] = {(B, H, Tq)} with a contiguous last dim; "
                         f"got {lse.dtype} {tuple(lse.shape)}")
    if kernel_path("flash_biased", query) == "torch":
        if lse is not None:
            lse.copy_(flash_biased_lse_ref(query, keys, values, bias, scale, q_offset=q_offset, causal=causal,
                                           prefix=prefix))
        result = flash_biased_ref(query, keys, values, bias, scale, q_offset=q_offset, causal=causal, prefix=prefix)
        return result if out is None else out.copy_(result)
    if D != next_power_of_2(D) or not 16 <= D <= 256:
        raise ValueError(f"flash_biased: the Triton kernel takes a head dim that is a power of two in 16 .. 256; got "
                         f"{D} (use dense_attention.biased_attention)")
    query, keys, values, bias = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, keys, values, bias))
    if prefix is not None:
        prefix = tuple(t if t.stride(-1) == 1 else t.contiguous() for t in prefix)
    out = torch.empty_like(query) if out is None else out
    with torch.no_grad():
        _launch(query, keys, values, bias, float(scale), int(q_offset), bool(causal), out, config, prefix, lse)
    return out
