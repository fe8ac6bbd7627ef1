"""The compressed keys' extension by a prefill chunk (``CompressedKeys.extend``) in one launch per chunk and layer.

A chunk of tokens finishes the windows it completes (window means of keys and eviction scores, the first of them
partly made of tokens before the chunk, which the ring of the last ``compress_kernel`` tokens holds) and then
becomes the ring's content. In torch that is two concatenations, the means, their dtype conversions and the writes:
ten launches. Here one program per (sequence, KV head, tile of ``WINDOWS`` windows: 4 at the defaults, so that a
512-token chunk of 16 rows spreads over 1,024 programs; with 32 a tile, one program per row and head walked all 32
windows in turn and the kernel took 0.33 ms a launch, 7% of a 64K prefill at batch 16) averages its windows in
float32 (as ``selection.compress_keys``), and the first tile, the only one that reads the ring (a window that starts
before the chunk is among the first ``compress_kernel / compress_stride``), then refills the ring: no other program
touches it, so the ring is read before it is overwritten without synchronisation between programs.
"""

from __future__ import annotations

from ...config import NosaConfig
from ..backend import HAS_TRITON, launcher, next_power_of_2, on_device, tl, triton

if HAS_TRITON:

    @triton.jit(do_not_specialize=["start", "T", "n_old", "n_new", "stride_bb", "stride_bh"])
    def _extend_kernel(
        k_ptr, b_ptr, rk_ptr, rb_ptr, ok_ptr, ob_ptr,
        stride_kb, stride_kh, stride_kt, stride_kd,
        stride_bb, stride_bh, stride_bt,
        stride_rkb, stride_rkh, stride_rkt, stride_rkd,
        stride_rbb, stride_rbh, stride_rbt,
        stride_okb, stride_okh, stride_okw, stride_okd,
        stride_obb, stride_obh, stride_obw,
        Hk, D, start, T, n_old, n_new,
        KERNEL: tl.constexpr, STRIDE: tl.constexpr, WINDOWS: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """Program (sequence x KV head, tile): windows ``n_old + tile * WINDOWS ..`` (below n_new); tile 0 then
        writes tokens ``max(start, start + T - KERNEL) .. start + T - 1`` into the ring."""
        i_bh, i_t = tl.program_id(0), tl.program_id(1)
        i_b, i_h = (i_bh // Hk).to(tl.int64), (i_bh % Hk).to(tl.int64)
        o_t = tl.arange(0, BLOCK_T)
        o_d = tl.arange(0, BLOCK_D)
        m_t = o_t < KERNEL
        m_d = o_d < D
        k_row = k_ptr + i_b * stride_kb + i_h * stride_kh
        b_row = b_ptr + i_b * stride_bb + i_h * stride_bh
        rk_row = rk_ptr + i_b * stride_rkb + i_h * stride_rkh
        rb_row = rb_ptr + i_b * stride_rbb + i_h * stride_rbh
        w_end = tl.minimum(n_new, n_old + (i_t + 1) * WINDOWS)
        for w in range(n_old + i_t * WINDOWS, w_end):
            t = w * STRIDE + o_t  # the window's tokens
            ring = m_t & (t < start)
            new = m_t & (t >= start)
            slot = t % KERNEL
            x = tl.load(rk_row + slot[:, None] * stride_rkt + o_d[None, :] * stride_rkd,
                        mask=ring[:, None] & m_d[None, :], other=0.0).to(tl.float32)
            x += tl.load(k_row + (t - start)[:, None] * stride_kt + o_d[None, :] * stride_kd,
                         mask=new[:, None] & m_d[None, :], other=0.0).to(tl.float32)
            y = tl.load(rb_row + slot * stride_rbt, mask=ring, other=0.0).to(tl.float32)
            y += tl.load(b_row + (t - start) * stride_bt, mask=new, other=0.0).to(tl.float32)
            p_ok = ok_ptr + i_b * stride_okb + i_h * stride_okh + w * stride_okw + o_d * stride_okd
            tl.store(p_ok, (tl.sum(x, axis=0) / KERNEL).to(ok_ptr.dtype.element_ty), mask=m_d)
            tl.store(ob_ptr + i_b * stride_obb + i_h * stride_obh + w * stride_obw, tl.sum(y, axis=0) / KERNEL)
        if i_t == 0:
            tl.debug_barrier()  # every thread has read the ring above before any of it is overwritten
            t = start + T - KERNEL + o_t  # the last KERNEL tokens; those before the chunk stay as they are
            m = m_t & (t >= start)
            slot = t % KERNEL
            x = tl.load(k_row + (t - start)[:, None] * stride_kt + o_d[None, :] * stride_kd,
                        mask=m[:, None] & m_d[None, :])
            tl.store(rk_row + slot[:, None] * stride_rkt + o_d[None, :] * stride_rkd, x,
                     mask=m[:, None] & m_d[None, :])
            y = tl.load(b_row + (t - start) * stride_bt, mask=m)
            tl.store(rb_row + slot * stride_rbt, y, mask=m)


def extend_windows(out_k, out_b, ring_k, ring_b, keys, bias, start: int, n_old: int, n_new: int,
                   cfg: NosaConfig) -> None:
    """Windows ``n_old .. n_new - 1`` of ``out_k [B, Hk, W, D]`` / ``out_b [B, Hk, W]`` (fp32) from the ring
    (``ring_k [B, Hk, kernel, D]``, ``ring_b [B, Hk, kernel]``, token t at slot ``t % kernel``) and the tokens
    ``start ..`` (``keys [B, Hk, T, D]``, ``bias [B, Hk, T]``); then the ring gets the last of those tokens. In
    place; the Triton launch of ``CompressedKeys._extend_rows`` (its torch form is the reference)."""
    B, Hk, T, D = keys.shape
    kernel, stride = cfg.compress_kernel, cfg.compress_stride
    if n_old * stride + kernel - 1 < start or n_new > out_k.shape[2] or start < 0:
        raise ValueError(
            f"extend_windows: window n_old={n_old} must end at or after start={start} (the ring holds only the "
            f"last {kernel} tokens) and n_new={n_new} fit the {out_k.shape[2]} windows of out_k"
        )
    # Windows per program: few, so that a chunk's windows spread over many programs (a program walks its windows one
    # after another), and at least the windows that can start before the chunk, which tile 0 alone reads the ring for.
    windows = max(4, -(-kernel // stride))
    tiles = max(1, -(-(n_new - n_old) // windows))
    with on_device(keys):
        launcher(_extend_kernel)[(B * Hk, tiles)](
            keys, bias, ring_k, ring_b, out_k, out_b,
            *keys.stride(), *bias.stride(), *ring_k.stride(), *ring_b.stride(), *out_k.stride(), *out_b.stride(),
            Hk, D, start, T, n_old, n_new,
            KERNEL=kernel, STRIDE=stride, WINDOWS=windows,
            BLOCK_T=max(16, next_power_of_2(kernel)), BLOCK_D=max(16, next_power_of_2(D)),
        )
