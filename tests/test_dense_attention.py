"""Biased dense attention on sdpa (``dense_attention.biased_attention``) against the torch reference ``attend``."""

import doctest

import pytest
import torch

from hf_nosa.attention import dense as dense_attention
from hf_nosa.rules.attend import AttentionInputs, attend
from hf_nosa.attention.dense import bias_columns, biased_attention
from hf_nosa.rules.masks import additive_mask
from hf_nosa.rules.selection import MASK_VALUE

from .utils import assert_close

TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
}
DTYPES = list(TOL)


def _inputs(B, H, Hk, Tq, S, D, dtype, seed, *, bias_scale=1.0, masked_share=0.1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, D, generator=g).to(dtype)
    k = torch.randn(B, Hk, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hk, S, D, generator=g).to(dtype)
    bias = bias_scale * torch.randn(B, Hk, S, generator=g)
    bias[torch.rand(B, Hk, S, generator=g) < masked_share] = MASK_VALUE
    return q, k, v, bias


def _live(inputs: AttentionInputs, B, H, Tq) -> torch.Tensor:
    """``[B, H, Tq]``: rows that see at least one key (rows that see none are arbitrary in every implementation)."""
    S, device = inputs.keys.shape[2], inputs.keys.device
    if inputs.attn_mask is not None:
        allowed = inputs.attn_mask > MASK_VALUE / 2
    elif inputs.causal:
        allowed = additive_mask(None, Tq, S, inputs.q_offset, device) == 0
    else:
        allowed = torch.ones(1, 1, Tq, S, dtype=torch.bool, device=device)
    allowed = allowed & (inputs.key_bias > MASK_VALUE / 2)[:, :, None, :]
    Hk = inputs.keys.shape[1]
    return allowed.any(-1).expand(B, Hk, Tq).repeat_interleave(H // Hk, 1)


def _check(q, inputs, scale, dtype):
    B, H, Tq, D = q.shape
    expected = attend(q.float(), inputs._replace(keys=inputs.keys.float(), values=inputs.values.float()), scale)
    actual = biased_attention(q, inputs, scale)
    assert actual.shape == q.shape and actual.dtype == dtype
    live = _live(inputs, B, H, Tq)
    assert bool(live.any())
    assert torch.isfinite(actual[live].float()).all()
    assert_close(actual[live], expected[live], **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("G", [1, 4])
@pytest.mark.parametrize(
    "Tq,S,q_offset,causal",
    [
        (1, 77, 76, True),  # decode over every key so far
        (1, 130, 0, False),  # decode over slots (bias hides the empty ones)
        (70, 70, 0, True),  # a whole prompt
        (33, 100, 67, True),  # a chunk after earlier chunks (lower-right causal)
        (20, 90, 30, True),  # a causal window that is neither (explicit mask)
        (40, 65, 0, False),  # non-causal
    ],
)
def test_matches_attend(dtype, G, Tq, S, q_offset, causal):
    Hk = 2
    q, k, v, bias = _inputs(2, Hk * G, Hk, Tq, S, 64, dtype, seed=Tq * 1000 + S + G, bias_scale=3.0)
    _check(q, AttentionInputs(k, v, bias, None, q_offset, causal), 64**-0.5, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("G", [1, 4])
def test_extreme_biases(dtype, G):
    """|b| up to 80 and the e^(b - m) form's worst case: causal rows that see only keys 160 below the row max."""
    Hk, S = 2, 96
    q, k, v, _ = _inputs(1, Hk * G, Hk, S, S, 64, dtype, seed=7)
    ramp = torch.linspace(-80.0, 80.0, S)
    bias = torch.stack([ramp, -ramp])[None].clone()
    bias[0, 0, 5] = MASK_VALUE
    _check(q, AttentionInputs(k, v, bias, None, 0, True), 64**-0.5, dtype)
    g = torch.Generator().manual_seed(8)
    uniform = (torch.rand(1, Hk, S, generator=g) * 160 - 80)
    _check(q, AttentionInputs(k, v, uniform, None, 0, True), 64**-0.5, dtype)
    _check(q[:, :, -1:], AttentionInputs(k, v, uniform, None, S - 1, True), 64**-0.5, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("G", [1, 4])
def test_padding_masks(dtype, G):
    """Left padding as the model's mask gives it ([B, 1, Tq, S], causal inside) and a per-KV-head rule mask."""
    B, Hk, Tq, S = 3, 2, 24, 56
    q, k, v, bias = _inputs(B, Hk * G, Hk, Tq, S, 64, dtype, seed=11, bias_scale=5.0, masked_share=0.0)
    pads = torch.tensor([0, 5, 40])
    real = torch.arange(S)[None, :] >= pads[:, None]  # [B, S]
    causal = torch.arange(S)[None, :] <= torch.arange(S - Tq, S)[:, None]  # [Tq, S]
    model_mask = causal[None, None] & real[:, None, None, :]
    mask = additive_mask(model_mask, Tq, S, S - Tq, "cpu")
    bias = bias + torch.where(real, 0.0, MASK_VALUE)[:, None, :]
    _check(q, AttentionInputs(k, v, bias, mask, S - Tq, False), 0.125, dtype)
    g = torch.Generator().manual_seed(12)
    rule = torch.where(torch.rand(B, Hk, Tq, S, generator=g) < 0.5, 0.0, MASK_VALUE)
    _check(q, AttentionInputs(k, v, bias, mask + rule, S - Tq, False), 0.125, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_bias_is_plain_sdpa(dtype, monkeypatch):
    """A == 0 and no mask: sdpa on the original head dimension, no bias columns."""
    q, k, v, _ = _inputs(1, 8, 2, 30, 30, 64, dtype, seed=3)
    zero = torch.zeros(1, 2, 30)

    def no_columns(*args, **kwargs):
        raise AssertionError("bias columns built for an all-zero bias")

    monkeypatch.setattr(dense_attention, "bias_columns", no_columns)
    _check(q, AttentionInputs(k, v, zero, None, 0, True), 0.125, dtype)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
    assert torch.equal(biased_attention(q, AttentionInputs(k, v, zero, None, 0, True), 0.125), expected)


def test_gradients_match_attend():
    """Training reads the bias through the columns: gradients of q, k, v and the bias match the reference."""
    B, Hk, G, T, D = 2, 2, 2, 40, 16
    q, k, v, bias = _inputs(B, Hk * G, Hk, T, T, D, torch.float32, seed=5, bias_scale=2.0, masked_share=0.0)
    grad = torch.randn(B, Hk * G, T, D, generator=torch.Generator().manual_seed(6))
    results = []
    for fn in (attend, biased_attention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        out = fn(leaves[0], AttentionInputs(leaves[1], leaves[2], leaves[3], None, 0, True), D**-0.5)
        out.backward(grad)
        results.append([out] + [t.grad for t in leaves])
    for actual, expected in zip(results[1], results[0]):
        assert_close(actual, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_columns_keep_the_bias(dtype):
    """The split columns carry b to about fp32 precision through a fp32 dot product, MASK_VALUE included."""
    q, k, v, bias = _inputs(1, 2, 1, 3, 50, 16, dtype, seed=9, bias_scale=40.0)
    q2, k2, v2 = bias_columns(q, k, v, bias, 0.25)
    assert q2.shape[-1] % 8 == 0 and torch.equal(v2[..., 16:], torch.zeros_like(v2[..., 16:]))
    logits = (q2[..., 16:].float() @ k2[..., 16:].float().transpose(-1, -2)) * 0.25  # the bias part alone
    real = bias > MASK_VALUE / 2
    assert_close(logits[:, :, :, real[0, 0]], bias[:, :, None, real[0, 0]].expand(1, 2, 3, -1), atol=1e-4, rtol=1e-6)
    assert bool((logits[:, :, :, ~real[0, 0]] < -8000).all())


def test_bad_shapes_raise():
    q, k, v, bias = _inputs(1, 4, 2, 5, 9, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="key_bias"):
        biased_attention(q, AttentionInputs(k, v, bias[:, :1], None, 0, True), 0.25)
    with pytest.raises(ValueError, match="attn_mask"):
        biased_attention(q, AttentionInputs(k, v, bias, torch.zeros(1, 1, 5, 8), 0, False), 0.25)
    with pytest.raises(ValueError, match="H % Hk"):
        biased_attention(q[:, :3], AttentionInputs(k, v, bias, None, 0, True), 0.25)


def test_docstring_examples():
    assert doctest.testmod(dense_attention).failed == 0


@pytest.mark.parametrize("q_offset,per_head_mask,calls", [(0, False, 1), (40, False, 1), (40, True, 4)])
def test_gqa_group_runs_in_one_call_unless_the_mask_is_per_kv_head(q_offset, per_head_mask, calls):
    """Causal (square or lower-right) GQA is one sdpa call; a per-KV-head mask is one call per group member."""
    q, k, v, bias = _inputs(1, 8, 2, 60 - q_offset, 60, 16, torch.float32, seed=13)
    mask = None
    if per_head_mask:
        g = torch.Generator().manual_seed(14)
        mask = torch.where(torch.rand(1, 2, 60 - q_offset, 60, generator=g) < 0.7, 0.0, MASK_VALUE)
    inputs = AttentionInputs(k, v, bias, mask, q_offset, mask is None)
    from torch.profiler import profile

    with profile() as prof:
        _check(q, inputs, 0.25, torch.float32)
    kernels = [e for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product_flash_attention")]
    assert sum(e.count for e in kernels) == calls


def test_zero_bias_that_trains_gets_its_gradient():
    """A == 0 at the start of a retrofit: the bias is zero but learns, so it must stay in the graph."""
    q, k, v, _ = _inputs(1, 4, 2, 20, 20, 16, torch.float32, seed=15)
    grad = torch.randn(1, 4, 20, 16, generator=torch.Generator().manual_seed(16))
    grads = []
    for fn in (attend, biased_attention):
        bias = torch.zeros(1, 2, 20, requires_grad=True)
        fn(q, AttentionInputs(k, v, bias, None, 0, True), 0.25).backward(grad)
        grads.append(bias.grad)
    assert grads[0].abs().sum() > 0
    assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gqa_with_mask", [True, False])
def test_lower_right_variant_and_the_repeated_kv_branch(gqa_with_mask, dtype):
    """sdpa's lower-right causal variant (what CUDA runs; in half precision with the KV heads unrepeated) and the
    repeated-KV branch (CUDA's masked GQA) give the explicit mask's result; both run here on the CPU."""
    from torch.nn.attention.bias import causal_lower_right

    q, k, v, _ = _inputs(1, 8, 2, 24, 70, 16, dtype, seed=17)
    expected = dense_attention._sdpa(q, k, v, dense_attention._causal(24, 70, 46, "cpu", dtype), False, 0.25,
                                     gqa_with_mask=True)
    same = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else TOL[dtype]
    for mask in (causal_lower_right(24, 70), dense_attention._causal(24, 70, 46, "cpu", dtype)):
        actual = dense_attention._sdpa(q, k, v, mask, False, 0.25, gqa_with_mask=gqa_with_mask)
        assert_close(actual, expected, **same)
    reference = attend(q.float(), AttentionInputs(k.float(), v.float(), torch.zeros(1, 2, 70), None, 46, True), 0.25)
    assert_close(expected.float(), reference, **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize(
    "Tq,S,q_offset,causal,masked",
    [(1, 1100, 0, False, False), (600, 600, 0, True, False), (256, 1000, 744, True, False),
     (100, 1000, 500, True, False), (256, 1000, 744, False, True)],
)
def test_on_gpu_matches_attend_on_fused_kernels(dtype, D, Tq, S, q_offset, causal, masked):
    """CUDA: every branch (causal, lower-right variant, explicit causal mask, padding mask with repeated KV heads)
    against the reference, and none of them on sdpa's math kernel."""
    _fused_case("cuda", dtype, D, Tq, S, q_offset, causal, masked)


def _fused_case(device, dtype, D, Tq, S, q_offset, causal, masked):
    from torch.profiler import ProfilerActivity, profile

    B, Hk, G = 2, 2, 4
    q, k, v, bias = (t.to(device) for t in _inputs(B, Hk * G, Hk, Tq, S, D, dtype, seed=S + Tq, bias_scale=20.0))
    mask = None
    if masked:
        keep = torch.ones(B, S, dtype=torch.bool, device=device)
        keep[1, :300] = False
        allowed = torch.arange(S, device=device)[None, :] <= torch.arange(S - Tq, S, device=device)[:, None]
        mask = torch.where(allowed[None, None] & keep[:, None, None, :], 0.0, MASK_VALUE)
    inputs = AttentionInputs(k, v, bias, mask, q_offset, causal)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        actual = biased_attention(q, inputs, D**-0.5)
    assert not any("attention_math" in e.key for e in prof.key_averages())
    expected = attend(q.float(), inputs._replace(keys=k.float(), values=v.float()), D**-0.5)
    live = _live(inputs, B, Hk * G, Tq)
    assert_close(actual[live], expected[live], atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_bias", [False, True])
def test_fold_without_looking_equals_the_reference(dtype, zero_bias):
    """``fold=True`` (what a cache on CUDA asks for) folds the bias in unread, a zero bias too: same function."""
    q, k, v, bias = _inputs(2, 4, 2, 24, 40, 16, dtype, seed=11)
    if zero_bias:
        bias.zero_()
    inputs = AttentionInputs(k, v, bias, None, 16, causal=True)
    expected = attend(q.float(), inputs._replace(keys=k.float(), values=v.float()), 0.3)
    folded = biased_attention(q, inputs, 0.3, fold=True)
    live = _live(inputs, 2, 4, 24)
    assert_close(folded[live], expected[live], **TOL[dtype])
    assert_close(folded, biased_attention(q, inputs, 0.3), **TOL[dtype])


def _joined_case(device, dtype, Tq, splits):
    """Keys in parts (a pool's blocks, then the chunk) against the reference over the joined keys."""
    S = sum(splits)
    # biases of |b| up to ~160 and a tenth of the keys hidden (MASK_VALUE)
    q, k, v, bias = (t.to(device) for t in _inputs(2, 8, 2, Tq, S, 64, dtype, seed=S + Tq, bias_scale=40.0))
    edges = [0]
    for n in splits:
        edges.append(edges[-1] + n)
    parts = [(k[:, :, a:b], v[:, :, a:b], bias[:, :, a:b]) for a, b in zip(edges, edges[1:])]
    actual = dense_attention.biased_attention_joined(q, [p[0] for p in parts], [p[1] for p in parts],
                                                     [p[2] for p in parts], 0.125)
    inputs = AttentionInputs(k, v, bias, None, S - Tq, causal=True)
    expected = attend(q.float(), inputs._replace(keys=k.float(), values=v.float()), 0.125)
    live = _live(inputs, 2, 8, Tq)
    assert_close(actual[live].float(), expected[live], **TOL[dtype])
    assert actual.shape == q.shape and actual.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Tq, splits", [(24, [96, 24]), (24, [24]), (16, [40, 7, 16])])
def test_joined_parts_equal_the_reference(dtype, Tq, splits):
    _joined_case("cpu", dtype, Tq, splits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_joined_parts_on_gpu(dtype):
    _joined_case("cuda", dtype, 512, [4160, 512])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Tq,S,q_offset,causal", [(600, 600, 0, True), (100, 1000, 900, True), (37, 500, 0, False)])
def test_on_gpu_inference_with_a_bias_runs_flash_biased_and_training_the_columns(dtype, Tq, S, q_offset, causal):
    """CUDA: a nonzero bias, no mask, no gradient takes the flash_biased kernel (|b| up to 80); with a gradient
    wanted the same call takes the sdpa columns and the gradient reaches the bias. Both equal the reference."""
    from torch.profiler import ProfilerActivity, profile

    B, Hk, G, D = 2, 2, 4, 64
    q, k, v, bias = (t.cuda() for t in _inputs(B, Hk * G, Hk, Tq, S, D, dtype, seed=Tq + S, bias_scale=40.0))
    inputs = AttentionInputs(k, v, bias, None, q_offset, causal)
    expected = attend(q.float(), inputs._replace(keys=k.float(), values=v.float()), D**-0.5)
    live = _live(inputs, B, Hk * G, Tq)

    def kernels(run):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = run()
        torch.cuda.synchronize()
        return out, {e.key for e in prof.key_averages()}

    with torch.no_grad():
        actual, names = kernels(lambda: biased_attention(q, inputs, D**-0.5))
    assert any("_flash_biased_kernel" in n for n in names)
    assert_close(actual[live], expected[live], atol=3e-2, rtol=3e-2)

    trained = bias.clone().requires_grad_(True)
    actual, names = kernels(lambda: biased_attention(q, inputs._replace(key_bias=trained), D**-0.5))
    assert not any("_flash_biased_kernel" in n for n in names)
    assert_close(actual[live].detach(), expected[live], atol=3e-2, rtol=3e-2)
    actual[live].float().sum().backward()
    assert trained.grad is not None and torch.isfinite(trained.grad).all() and trained.grad.abs().sum() > 0
