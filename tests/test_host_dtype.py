"""host_dtype: a quantized host store (fp8 e4m3fn, int8) through the config, the store's API and generate.

The store quantizes complete blocks once (one scale per block and KV head) and keeps each row's incomplete block
in the model's dtype, so reads equal the full-precision store within ``quantization_error_bound`` on complete
blocks and exactly on the rest; generate with it stays within a stated tolerance of the full-precision store.
"""

import json

import pytest
import torch

from hf_nosa import NosaCache, NosaConfig, to_nosa
from hf_nosa.config import HOST_DTYPES
from hf_nosa.cache.host_quant import HOST_FORMATS, quantization_error_bound
from hf_nosa.cache.host_store import HostStore
from hf_nosa.modeling import randomize_eviction_heads

from .conftest import small_nosa_config, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

FORMATS = sorted(HOST_FORMATS)
# Largest |logit difference| to the full-precision store while both decode the same tokens (fp32 tiny models
# whose logits span about +-0.7; measured on these tests: fp8 at most 0.0044, int8 0.0013, tokens all the same).
LOGIT_TOLERANCE = {"float8_e4m3fn": 0.015, "int8": 0.005}


# ----- config -----


def test_bad_host_dtype_lists_the_allowed_ones():
    for bad in ("fp8", "bfloat16", "float8_e5m2", 8):
        with pytest.raises(ValueError) as info:
            NosaConfig(host_dtype=bad)
        message = str(info.value)
        assert f"NosaConfig.host_dtype={bad!r}" in message
        assert all(repr(name) in message for name in HOST_DTYPES)
    assert set(HOST_DTYPES) == {"auto", *HOST_FORMATS}  # every quantized name is a format the store knows


def test_saved_under_nosa_and_overridden_by_cache_config(tmp_path):
    model = to_nosa(tiny_model("llama"), small_nosa_config(host_dtype="int8"))
    model.config.save_pretrained(tmp_path)
    section = json.loads((tmp_path / "config.json").read_text())["nosa"]
    assert section["host_dtype"] == "int8"
    assert NosaConfig.from_model_config(type(model.config).from_pretrained(tmp_path)).host_dtype == "int8"
    older = {key: value for key, value in section.items() if key != "host_dtype"}  # saved before the field existed
    assert NosaConfig.from_dict(older).host_dtype == "auto"

    ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(0))

    def store_dtype(**kwargs):
        out = model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, cache_implementation="nosa",
                             return_dict_in_generate=True, **kwargs)
        return out.past_key_values.layers[0].host.k_chunks[0].dtype

    assert store_dtype() == torch.int8
    assert store_dtype(cache_config={"host_dtype": "float8_e4m3fn"}) == torch.float8_e4m3fn
    assert store_dtype(cache_config={"host_dtype": "auto"}) == torch.float32
    with pytest.raises(ValueError, match="host_dtype"):
        store_dtype(cache_config={"host_dtype": "fp4"})


# ----- the store -----

B, HK, D, P = 3, 2, 32, 16
OFFSETS = torch.tensor([0, 13, 40])  # rows of 130, 117 and 90 tokens: each ends in another block, at another place


def _written(host_dtype, dtype=torch.bfloat16, length=130, seed=0):
    """A store holding a left-padded batch written in uneven pieces, each row from its first real token."""
    gen = torch.Generator().manual_seed(seed)
    host = HostStore(B, HK, D, dtype, P, pin=False, host_dtype=host_dtype)
    host.chunk_tokens = 3 * P  # several chunks
    host.set_offsets(OFFSETS)
    start = 0
    for n in (37, 1, 50, 20, 1, 21):
        k = torch.randn(B, HK, n, D, generator=gen) * torch.exp(torch.randn(B, HK, n, 1, generator=gen))
        k[..., 3] *= 30  # an outlier channel
        v = torch.randn(B, HK, n, D, generator=gen)
        host.write_rows(start - OFFSETS, k.to(dtype), v.to(dtype), torch.randn(B, HK, n, generator=gen))
        start += n
    assert start == length
    return host


def _assert_within_bound(got, want, name, lengths, slack=1.0):
    """``got`` (quantized store) against ``want`` (full precision), ``[B, Hk, T, D]``, per row up to its length:
    complete blocks within the format's bound (times ``slack``, plus bf16's rounding), the tail exactly."""
    for row, n in enumerate(lengths.tolist()):
        full = n // P * P
        blocks = want[row, :, :full].float().reshape(HK, -1, P, D)
        bound = quantization_error_bound(blocks, name).reshape(HK, full, D) * slack
        error = (got[row, :, :full].float() - want[row, :, :full].float()).abs()
        assert bool((error <= bound + want[row, :, :full].float().abs() * 2.0**-8).all()), f"row {row}"
        assert torch.equal(got[row, :, full:n], want[row, :, full:n]), f"row {row}: the tail is kept as written"


@pytest.mark.parametrize("name", FORMATS)
def test_read_and_gather_blocks_within_the_bound(name):
    ref, quant = _written("auto"), _written(name)
    lengths = quant.row_lengths()
    assert torch.equal(lengths, 130 - OFFSETS)
    (rk, rv, rb), (qk, qv, qb) = ref.read(0, 130, "cpu"), quant.read(0, 130, "cpu")
    assert qk.dtype == torch.bfloat16
    _assert_within_bound(qk, rk, name, lengths)
    _assert_within_bound(qv, rv, name, lengths)
    for row, n in enumerate(lengths.tolist()):
        assert torch.equal(qb[row, :, :n], rb[row, :, :n])  # scores in full precision
    assert not torch.equal(qk[0, :, :P], rk[0, :, :P])  # the store does quantize
    # a read that starts and ends inside blocks
    part = quant.read(21, 100, "cpu")[0]
    for row, n in enumerate(lengths.clamp(max=100).tolist()):
        assert torch.equal(part[row, :, : n - 21], qk[row, :, 21:n])
    # blocks by (sequence, KV head, block), the rows' tail blocks included: what read gives
    b_idx = torch.tensor([0, 1, 2, 2, 1, 0])
    h_idx = torch.tensor([1, 0, 1, 0, 1, 0])
    blocks = torch.tensor([8, 7, 5, 0, 3, 2])  # 8, 7 and 5 are the rows' incomplete blocks
    k, v, b = quant.gather_blocks(b_idx, h_idx, blocks)
    for i in range(6):
        lo, n = int(blocks[i]) * P, int(lengths[b_idx[i]])
        held = min(P, n - lo)
        assert torch.equal(k[i, :held], qk[b_idx[i], h_idx[i], lo : lo + held])
        assert torch.equal(v[i, :held], qv[b_idx[i], h_idx[i], lo : lo + held])
        assert torch.equal(b[i, :held], qb[b_idx[i], h_idx[i], lo : lo + held])


def _bound(x, name):
    """``quantization_error_bound`` of ``x [Hk, T, D]`` (T a multiple of P) in blocks of P tokens, plus bf16's
    rounding of the dequantized value."""
    blocks = x.float().reshape(x.shape[0], -1, P, x.shape[-1])
    return quantization_error_bound(blocks, name).reshape(x.shape) + x.float().abs() * 2.0**-8


@pytest.mark.parametrize("name", FORMATS)
def test_index_batch_and_crop(name):
    ref, quant = _written("auto"), _written(name)
    before = quant.read(0, 130, "cpu")[0]
    index = torch.tensor([2, 0, 0])
    for store in (ref, quant):
        store.index_batch(index)
    assert torch.equal(quant.offsets, OFFSETS[index])
    after = quant.read(0, 130, "cpu")[0]
    for row, old in enumerate(index.tolist()):
        n = int(130 - OFFSETS[old])
        assert torch.equal(after[row, :, :n], before[old, :, :n])
    # crop to 100: rows of 90, 130, 130 tokens now end at 60, 100, 100, inside blocks they had completed, whose
    # tokens come back from the store: within the bound of the block as it was quantized
    written = ref.read(0, 130, "cpu")[0]
    for store in (ref, quant):
        store.length = 100
    lengths = quant.row_lengths()
    assert lengths.tolist() == [60, 100, 100]
    cropped = quant.read(0, 100, "cpu")[0]
    for row, n in enumerate(lengths.tolist()):
        error = (cropped[row, :, :n].float() - written[row, :, :n].float()).abs()
        assert bool((error <= _bound(written[row, :, : -(-n // P) * P], name)[:, :n]).all()), f"row {row}"
    # rows grow again: the cut block is completed and quantized anew, its earlier tokens rounded twice
    k = torch.randn(B, HK, 30, D, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    for store in (ref, quant):
        store.write_rows(100 - store.offsets, k, k, torch.zeros(B, HK, 30))
    regrown = ref.read(0, 130, "cpu")[0]
    got = quant.read(0, 130, "cpu")[0]
    for row, n in enumerate(quant.row_lengths().tolist()):
        full = n // P * P
        cut = int(lengths[row]) // P * P  # the cut block starts here
        bound = _bound(regrown[row, :, :full], name)
        bound[:, cut : cut + P] += _bound(written[row, :, cut : cut + P], name)
        error = (got[row, :, :full].float() - regrown[row, :, :full].float()).abs()
        assert bool((error <= bound).all()), f"row {row}"
        assert torch.equal(got[row, :, full:n], regrown[row, :, full:n])


@pytest.mark.parametrize("dtype, ratio", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_host_bytes(dtype, ratio):
    """K and V take one byte per value: a half of bf16's bytes, a quarter of fp32's, plus a scale per block and
    head for each, and the tails; a block fetch moves the block's bytes and its two scales."""
    ref, quant = _written("auto", dtype), _written("float8_e4m3fn", dtype)
    tokens = ref.capacity
    assert quant.capacity == tokens
    kv, scores = 2 * B * HK * tokens * D * dtype.itemsize, B * HK * tokens * 4
    assert ref.nbytes() == kv + scores
    tails = 2 * B * HK * P * D * dtype.itemsize
    assert quant.nbytes() == kv // ratio + scores + 2 * B * HK * (tokens // P) * 4 + tails
    assert quant.block_bytes() == P * (2 * D + 4) + 8
    assert ref.block_bytes() == P * (2 * D * dtype.itemsize + 4)


# ----- generate -----

# A budget covering the context: every block is fetched once from the store (dequantized) and selection cannot
# change with the values, so the logits differ by the quantization alone.
FULL = dict(budget_tokens=256, query_tokens=16, sink_tokens=16, local_tokens=32)
SMALL = dict(budget_tokens=64, query_tokens=16, sink_tokens=16, local_tokens=32)  # 4 blocks of ~8 in the context


def _model(family, cfg, **overrides):
    model = to_nosa(tiny_model(family, seed=1, **overrides), cfg)
    model.generation_config.eos_token_id = None
    randomize_eviction_heads(model, scale=0.5, generator=torch.Generator().manual_seed(2))
    return model


def _generate(model, cfg, ids, mask, new_tokens=12):
    cache = NosaCache(model.config, cfg)
    out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1), cache


def _check_close_to_full_precision(family, name, prefill="dense", budget=FULL):
    cfg = small_nosa_config(**budget, prefill=prefill)
    model = _model(family, cfg)
    ids = torch.randint(3, 97, (2, 120), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # a padded row: its blocks and tail sit elsewhere than row 0's
    tokens, logits, cache = _generate(model, cfg, ids, mask)
    q_tokens, q_logits, q_cache = _generate(model, cfg.replace(host_dtype=name), ids, mask)
    tol = LOGIT_TOLERANCE[name]
    for row in range(2):
        same = (tokens[row] == q_tokens[row]).long().cumprod(0)
        upto = int(same.sum())  # steps decoded from the same tokens; the next one's logits still share the prefix
        shared = min(upto + 1, tokens.shape[1])
        torch.testing.assert_close(q_logits[row, :shared], logits[row, :shared], atol=tol, rtol=0)
        if upto < tokens.shape[1]:  # a token changed: only where the full-precision choice was within the tolerance
            top2 = logits[row, upto].topk(2).values
            assert float(top2[0] - top2[1]) <= 2 * tol, f"row {row} step {upto}"
    stats, q_stats = cache.stats(), q_cache.stats()
    layer = q_cache.layers[0]
    assert q_stats["blocks_loaded"] > 0
    if torch.equal(tokens, q_tokens):  # same tokens, same selections: the same blocks, each moving fewer bytes
        assert q_stats["blocks_loaded"] == stats["blocks_loaded"]
    if prefill == "dense":  # nothing is read back from the store but the decode fetches
        assert q_stats["bytes_to_device"] == q_stats["blocks_loaded"] * layer.host.block_bytes()
    assert q_stats["host_bytes"] == sum(lay.host.nbytes() for lay in q_cache.layers)
    assert q_stats["host_bytes"] < 0.45 * stats["host_bytes"]  # fp32 model: K, V at a quarter (scores stay fp32)
    assert q_stats["full_kv_bytes"] == stats["full_kv_bytes"]


def test_generate_with_fp8_store_close_to_full_precision(family):
    _check_close_to_full_precision(family, "float8_e4m3fn")


def test_generate_with_int8_store_and_quoka_prefill():
    """QUOKA's chunks fetch the prompt's blocks from the store, dequantized, while the prompt is written."""
    _check_close_to_full_precision("qwen2", "int8", prefill="quoka", budget=dict(SMALL, prefill_budget_tokens=64,
                                                                                 prefill_chunk_size=32))


def test_padded_rows_equal_the_rows_alone_with_fp8_store():
    """A padded prompt is stored with its padding moved to the end, then each row from its first real token: the
    blocks a row completes and its tail are those of the row alone (the tail keeps the exact values), so the padded
    batch decodes like each row alone, as with the full-precision store."""
    cfg = small_nosa_config(**SMALL, prefill="quoka", prefill_budget_tokens=64, prefill_chunk_size=32,
                            quoka_queries=3, host_dtype="float8_e4m3fn")
    model = _model("llama", cfg)
    pads = (0, 13, 21)
    ids = torch.randint(3, 97, (3, 110), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    tokens, logits, _ = _generate(model, cfg, ids, mask)
    for row, pad in enumerate(pads):
        alone = ids[row : row + 1, pad:]
        alone_tokens, alone_logits, _ = _generate(model, cfg, alone, torch.ones_like(alone))
        assert torch.equal(tokens[row], alone_tokens[0]), f"row {row} (pad {pad})"
        torch.testing.assert_close(logits[row], alone_logits[0], atol=1e-4, rtol=1e-4)


def test_device_kernels_equal_the_torch_path_interpreted(monkeypatch, prompt_rotary_on_torch):
    """The Triton path (host write, fused fetch step dequantizing blocks and quantizing the blocks decoding
    completes) gives what the torch references give, on a padded batch whose rows complete blocks at different
    steps. The prompt's rotary embedding, a kernel of a program per token that is bitwise its reference, runs the
    reference (tests/conftest.py ``prompt_rotary_on_torch``); the decode steps' the kernel."""
    cfg = small_nosa_config(**SMALL, prefill="dense", host_dtype="float8_e4m3fn")
    model = _model("llama", cfg, num_hidden_layers=1)  # one layer keeps the interpreter fast
    ids = torch.randint(3, 97, (2, 79), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    # Rows of 79 and 77 tokens and 3 decode steps (about a second each in the interpreter): row 0 completes block 4
    # in the first step and opens block 5 in the second; in the third row 1 completes its block 4 and a new
    # selection fetches a block. (The 75- and 72-token rows and 7 steps this replaced completed row 0's block only.)
    mask[1, :2] = 0
    tokens, logits, ref_cache = _generate(model, cfg, ids, mask, new_tokens=4)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HF_NOSA_KERNELS", "triton")
    k_tokens, k_logits, cache = _generate(model, cfg, ids, mask, new_tokens=4)
    assert prompt_rotary_on_torch == [79]  # the prompt alone
    assert torch.equal(k_tokens, tokens)
    torch.testing.assert_close(k_logits, logits, atol=1e-4, rtol=1e-4)
    host = cache.layers[0].host
    assert host.k_chunks[0].dtype == torch.float8_e4m3fn
    # The blocks the decode steps completed stay in the local window, so no logit reads them back: compare the
    # stores (read on the torch path), each row up to its length.
    assert host.row_lengths().tolist() == [82, 80]  # each row completed a block while decoding
    monkeypatch.setenv("HF_NOSA_KERNELS", "torch")
    stored, expected = host.read(0, 82, "cpu"), ref_cache.layers[0].host.read(0, 82, "cpu")
    for row, n in enumerate(host.row_lengths().tolist()):
        for got, want in zip(stored, expected):
            torch.testing.assert_close(got[row, :, :n], want[row, :, :n], atol=1e-5, rtol=1e-5)  # GEMM rounding
