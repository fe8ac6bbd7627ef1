"""The flash-style biased attention kernel against its torch reference (``attend.attend``).

CPU cases run the kernel in the Triton interpreter (``TRITON_INTERPRET=1``, set per test) at small sizes with
16-wide tiles, so several key tiles, the diagonal loop and the ragged last tiles all run; the ``gpu`` cases run
the compiled kernel at prefill-sized shapes in bf16 and fp16.
"""

import importlib

import pytest
import torch

from hf_nosa.rules.selection import MASK_VALUE

from ..utils import assert_close

flash_module = importlib.import_module("hf_nosa.kernels.prefill.flash_biased")


def _inputs(B, H, Hk, Tq, S, D, dtype, device, seed, extreme=False, hidden=0.0):
    """Random q, k, v and a nonzero per-key bias; ``extreme``: biases up to +-80; ``hidden``: that share of the keys
    past the first get MASK_VALUE (padding), so every query still sees key 0."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, D, generator=g).to(dtype).to(device)
    k = torch.randn(B, Hk, S, D, generator=g).to(dtype).to(device)
    v = torch.randn(B, Hk, S, D, generator=g).to(dtype).to(device)
    bias = torch.randn(B, Hk, S, generator=g) * (40.0 if extreme else 1.0)
    if extreme:
        bias = bias.clamp(-80, 80)
        bias[..., 1::7] = 80.0
        bias[..., 2::5] = -80.0
    if hidden:
        drop = torch.rand(B, Hk, S, generator=g) < hidden
        drop[..., 0] = False
        bias = torch.where(drop, MASK_VALUE, bias)
    return q, k, v, bias.to(device)


CASES = [
    # B, H, Hk, Tq, S, D, q_offset, causal
    (1, 2, 2, 40, 40, 16, 0, True),  # a causal prompt, ragged last tiles
    (2, 4, 1, 20, 70, 32, 50, True),  # a chunk after 50 earlier keys (lower-right), GQA 4
    (1, 4, 2, 33, 47, 16, 0, False),  # every query sees every key
    (2, 2, 1, 16, 64, 16, 30, True),  # queries in the middle of the keys: later keys hidden by the causal rule
]


@pytest.mark.skipif(not flash_module.HAS_TRITON, reason="needs the triton package")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("extreme", [False, True], ids=["bias", "extreme-bias"])
def test_kernel_matches_attend_interpreted(interpret, case, extreme):
    B, H, Hk, Tq, S, D, q_offset, causal = case
    q, k, v, bias = _inputs(B, H, Hk, Tq, S, D, torch.float32, "cpu", seed=Tq + S, extreme=extreme, hidden=0.2)
    out = flash_module.flash_biased(q, k, v, bias, D**-0.5, q_offset=q_offset, causal=causal)
    expected = flash_module.flash_biased_ref(q, k, v, bias, D**-0.5, q_offset=q_offset, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not flash_module.HAS_TRITON, reason="needs the triton package")
@pytest.mark.parametrize("H, Hk", [(2, 1), (8, 2), (6, 2)], ids=["group2", "group4", "group3-unpacked"])
def test_each_tile_configuration_is_exact_interpreted(interpret, H, Hk):
    """Tiles of 16 and 32 keys and queries give the same result (the full-tile loop, the diagonal loop and their
    boundary move with the tile sizes), with rows of one head or packed over the GQA group (a group that is not a
    power of two stays unpacked); with a prefix and the log-sum-exp too."""
    q, k, v, bias = _inputs(2, H, Hk, 45, 77, 16, torch.float32, "cpu", seed=5, extreme=True, hidden=0.2)
    prefix = _prefix(2, Hk, 21, 16, torch.float32, "cpu", seed=6)
    expected = flash_module.flash_biased_ref(q, k, v, bias, 0.25, q_offset=32)
    expected_prefix = flash_module.flash_biased_ref(q, k[:, :, -45:], v[:, :, -45:], bias[:, :, -45:], 0.25,
                                                    prefix=prefix)
    expected_lse = flash_module.flash_biased_lse_ref(q, k, v, bias, 0.25, q_offset=32)
    configs = [(16, 16, 4, 1, False), (32, 16, 4, 1, False), (16, 32, 4, 1, True), (32, 16, 4, 1, True)]
    for config in configs if H // Hk != 3 else configs[2:3]:  # (a group of 3 asked to pack stays unpacked)
        lse = torch.empty(2, H, 45)
        out = flash_module.flash_biased(q, k, v, bias, 0.25, q_offset=32, config=config, lse=lse)
        assert_close(out, expected, atol=2e-5, rtol=2e-5, msg=str(config))
        assert_close(lse, expected_lse, atol=1e-4, rtol=1e-5, msg=str(config))
        out = flash_module.flash_biased(q, k[:, :, -45:], v[:, :, -45:], bias[:, :, -45:], 0.25, prefix=prefix,
                                        config=config)
        assert_close(out, expected_prefix, atol=2e-5, rtol=2e-5, msg=str(config))


PREFIX_CASES = [
    # B, H, Hk, Tq, S0 (keys every query sees, in front), D
    (1, 2, 2, 40, 48, 16),  # whole prefix tiles
    (2, 4, 1, 21, 37, 32),  # a ragged prefix tile (the masked loop), GQA 4
    (2, 4, 2, 16, 0, 16),  # an empty prefix: the chunk alone
]


def _prefix(B, Hk, S0, D, dtype, device, seed, hidden=0.3):
    """Keys, values and bias of pool blocks in a strided buffer (as the slot pool's rows are), some hidden (empty
    slots: MASK_VALUE)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(B + 1, Hk, S0 + 5, 2, D, generator=g).to(dtype).to(device)
    pk, pv = pool[1:, :, 5:, 0], pool[1:, :, 5:, 1]
    pb = torch.randn(B, Hk, S0, generator=g) * 10
    pb = torch.where(torch.rand(B, Hk, S0, generator=g) < hidden, MASK_VALUE, pb)
    return pk, pv, pb.to(device)


@pytest.mark.skipif(not flash_module.HAS_TRITON, reason="needs the triton package")
@pytest.mark.parametrize("case", PREFIX_CASES, ids=lambda c: "x".join(map(str, c)))
def test_prefix_matches_joined_keys_interpreted(interpret, case):
    """Keys read from a prefix (a QUOKA chunk's pool blocks, not copied) and then the chunk's own keys (causal)
    equal the reference over the joined keys, and differ from it when the prefix is left out."""
    B, H, Hk, Tq, S0, D = case
    q, k, v, bias = _inputs(B, H, Hk, Tq, Tq, D, torch.float32, "cpu", seed=Tq + S0, hidden=0.2)
    prefix = _prefix(B, Hk, S0, D, torch.float32, "cpu", seed=S0)
    out = flash_module.flash_biased(q, k, v, bias, D**-0.5, prefix=prefix)
    joined = [torch.cat([p, t], 2) for p, t in zip(prefix, (k, v, bias))]
    expected = flash_module.flash_biased_ref(q, *joined, D**-0.5, q_offset=S0)
    assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert_close(flash_module.flash_biased_ref(q, k, v, bias, D**-0.5, prefix=prefix), expected, atol=1e-6, rtol=1e-6)
    if S0:
        assert (out - flash_module.flash_biased_ref(q, k, v, bias, D**-0.5)).abs().max() > 1e-2


@pytest.mark.skipif(not flash_module.HAS_TRITON, reason="needs the triton package")
@pytest.mark.parametrize("causal, S0", [(True, 0), (False, 0), (True, 37)])
def test_lse_matches_the_logits_interpreted(interpret, causal, S0):
    """The log-sum-exp the kernel writes equals the einsum's over every key a query sees (extreme biases, hidden
    keys, a ragged prefix), and the output is unchanged by asking for it."""
    B, H, Hk, Tq, D = 2, 4, 2, 21, 16
    q, k, v, bias = _inputs(B, H, Hk, Tq, Tq, D, torch.float32, "cpu", seed=S0 + 3, extreme=True, hidden=0.2)
    prefix = _prefix(B, Hk, S0, D, torch.float32, "cpu", seed=S0) if S0 else None
    lse = torch.empty(B, H, Tq)
    out = flash_module.flash_biased(q, k, v, bias, 0.25, causal=causal, prefix=prefix, lse=lse)
    expected = flash_module.flash_biased_lse_ref(q, k, v, bias, 0.25, causal=causal, prefix=prefix)
    assert_close(lse, expected, atol=1e-4, rtol=1e-5)
    assert torch.equal(out, flash_module.flash_biased(q, k, v, bias, 0.25, causal=causal, prefix=prefix))
    full = torch.cat([prefix[0], k], 2) if S0 else k
    logits = torch.einsum("bkgtd,bksd->bkgts", q.view(B, Hk, 2, Tq, D), full) * 0.25
    assert (expected - logits.logsumexp(-1).view(B, H, Tq)).abs().max() > 1.0  # the bias counts


def test_bad_inputs_are_refused_by_name():
    q, k, v, bias = _inputs(1, 4, 2, 8, 8, 16, torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match="bias must be float32"):
        flash_module.flash_biased(q, k, v, bias.double(), 0.25)
    with pytest.raises(ValueError, match="H % Hk"):
        flash_module.flash_biased(q[:, :3], k, v, bias, 0.25)
    with pytest.raises(ValueError, match="share a dtype"):
        flash_module.flash_biased(q, k.double(), v, bias, 0.25)
    with pytest.raises(ValueError, match="prefix must be"):
        flash_module.flash_biased(q, k, v, bias, 0.25, prefix=(k[:, :1], v[:, :1], bias[:, :1]))
    with pytest.raises(ValueError, match="prefix must be"):
        flash_module.flash_biased(q, k, v, bias, 0.25, prefix=(k, v, bias.double()))
    with pytest.raises(ValueError, match="lse must be"):
        flash_module.flash_biased(q, k, v, bias, 0.25, lse=torch.empty(1, 4, 7))


def test_cpu_tensors_take_the_reference(monkeypatch):
    monkeypatch.delenv("HF_NOSA_KERNELS", raising=False)
    q, k, v, bias = _inputs(1, 4, 2, 10, 30, 16, torch.float32, "cpu", seed=1)
    out = flash_module.flash_biased(q, k, v, bias, 0.25, q_offset=20)
    assert torch.equal(out, flash_module.flash_biased_ref(q, k, v, bias, 0.25, q_offset=20))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
def test_kernel_matches_attend_on_gpu(dtype, D):
    tol = dict(atol=2e-2, rtol=2e-2)
    for Tq, S, q_offset, causal, extreme in ((1000, 1000, 0, True, False), (512, 4608, 4096, True, True),
                                             (300, 1111, 0, False, True)):
        q, k, v, bias = _inputs(2, 32, 8, Tq, S, D, dtype, "cuda", seed=Tq, extreme=extreme, hidden=0.1)
        out = flash_module.flash_biased(q, k, v, bias, D**-0.5, q_offset=q_offset, causal=causal)
        expected = flash_module.flash_biased_ref(q.float(), k.float(), v.float(), bias, D**-0.5, q_offset=q_offset,
                                                 causal=causal)
        assert_close(out, expected, **tol, msg=f"Tq={Tq} S={S} {dtype}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefix_matches_attend_on_gpu(dtype):
    """A QUOKA chunk's shape: 512 queries over 4096 pool keys (some empty) then themselves, and a ragged prefix."""
    for Tq, S0, D in ((512, 4096, 64), (300, 1000, 128)):
        q, k, v, bias = _inputs(2, 32, 8, Tq, Tq, D, dtype, "cuda", seed=Tq, extreme=True, hidden=0.1)
        prefix = _prefix(2, 8, S0, D, dtype, "cuda", seed=S0)
        out = flash_module.flash_biased(q, k, v, bias, D**-0.5, prefix=prefix)
        expected = flash_module.flash_biased_ref(q.float(), k.float(), v.float(), bias, D**-0.5,
                                                 prefix=(prefix[0].float(), prefix[1].float(), prefix[2]))
        assert_close(out, expected, atol=2e-2, rtol=2e-2, msg=f"Tq={Tq} S0={S0} {dtype}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_configuration_on_gpu():
    """Each of CONFIGS (the autotuner may pick any): a QUOKA chunk over pool blocks and a causal chunk, GQA 4."""
    q, k, v, bias = _inputs(2, 32, 8, 700, 700, 64, torch.bfloat16, "cuda", seed=8, extreme=True, hidden=0.1)
    prefix = _prefix(2, 8, 1000, 64, torch.bfloat16, "cuda", seed=9)
    as_float = (prefix[0].float(), prefix[1].float(), prefix[2])
    expected = flash_module.flash_biased_ref(q.float(), k.float(), v.float(), bias, 0.125, prefix=as_float)
    for config in flash_module.CONFIGS:
        out = flash_module.flash_biased(q, k, v, bias, 0.125, prefix=prefix, config=config)
        assert_close(out, expected, atol=2e-2, rtol=2e-2, msg=str(config))


def test_docstring_example():
    import doctest

    assert doctest.testmod(flash_module, raise_on_error=True).attempted > 0
