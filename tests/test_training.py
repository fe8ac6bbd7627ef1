"""Training-time NOSA attention: it equals decoding, its two backends agree, and the eviction head learns."""

import pytest
import torch

from hf_nosa import NosaCache, NosaConfig, to_nosa
from hf_nosa.modeling import eviction_heads, randomize_eviction_heads
from hf_nosa.rules.selection import nosa_token_mask
from hf_nosa.attention.training import BACKENDS, flex_block_mask, nosa_training_attention, selected_blocks

from .conftest import SPARSE, small_nosa_config, tiny_model
from .utils import assert_close

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _sparse_model(family, seed=0, **windows):
    model = to_nosa(tiny_model(family, seed=seed), small_nosa_config(**SPARSE, **windows))
    return randomize_eviction_heads(model, generator=torch.Generator().manual_seed(seed + 7))


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("family,windows", [("llama", {}), ("qwen3", {}),
                                             ("llama", {"compress_kernel": 2, "compress_stride": 1})])
def test_training_forward_equals_incremental_nosa_decoding(family, windows):
    model = _sparse_model(family, **windows)
    ids = torch.randint(3, 97, (2, 150), generator=torch.Generator().manual_seed(1))
    model.train()
    with torch.no_grad():
        train_logits = model(ids, use_cache=False).logits
    model.eval()
    cache = NosaCache(model.config, small_nosa_config(**SPARSE, **windows, prefill="nosa"))
    prompt = 37  # a partly written block: prefill by the rule, then one token per step
    with torch.no_grad():
        steps = [model(ids[:, :prompt], past_key_values=cache).logits]
        for t in range(prompt, ids.shape[1]):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache).logits)
    decode_logits = torch.cat(steps, dim=1)
    assert_close(train_logits, decode_logits, atol=1e-4, rtol=0, msg=family)
    # the budget really bites: full attention differs
    with torch.no_grad():
        dense = model(ids, use_cache=False).logits
    assert not torch.allclose(dense[:, -50:], decode_logits[:, -50:], atol=1e-3)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_left_padded_batch_matches_the_cache_prefill():
    model = _sparse_model("qwen3", seed=2)
    ids = torch.randint(3, 97, (2, 120), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    with torch.no_grad():
        model.train()
        train_logits = model(ids, attention_mask=mask, use_cache=False).logits
        model.eval()
        cache = NosaCache(model.config, small_nosa_config(**SPARSE, prefill="nosa"))
        cache_logits = model(ids, attention_mask=mask, past_key_values=cache).logits
    real = mask.bool()
    assert_close(train_logits[real], cache_logits[real], atol=1e-4, rtol=0)


def _inputs(seed, B=2, H=4, Hk=2, T=150, D=16):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (H, Hk, Hk))
    bias = torch.randn(B, Hk, T, generator=g)
    return q, k, v, bias


@pytest.mark.parametrize("q_offset", [0, 37])
def test_chunked_selection_equals_the_reference_rule(q_offset):
    cfg = small_nosa_config(**SPARSE)
    q, k, _, bias = _inputs(2)
    q = q[:, :, q_offset:]
    P, T = cfg.block_size, k.shape[2]
    reference = nosa_token_mask(q, k, bias, q_offset, cfg, 0.25)
    for chunk in (None, 7):
        bitmap = selected_blocks(q, k, bias, cfg, 0.25, q_offset=q_offset, chunk_size=chunk)
        tokens = bitmap.repeat_interleave(P, -1)[..., :T]
        pos = torch.arange(q_offset, T)[:, None]
        own = (torch.arange(T) // P == pos // P) & (torch.arange(T) <= pos)
        assert torch.equal(tokens | own, reference)
        assert int(bitmap.sum(-1).max()) <= cfg.budget_blocks


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("tile", [16, 32])
def test_flex_backend_equals_explicit_forward_and_bias_gradient(tile, monkeypatch):
    import hf_nosa.attention.training as training

    monkeypatch.setattr(training, "FLEX_TILE", tile)
    cfg = small_nosa_config(**SPARSE)
    grads, outs = {}, {}
    for backend in ("explicit", "flex"):
        q, k, v, bias = _inputs(3)
        bias.requires_grad_()  # FlexAttention has no CPU backward for q, k, v; the bias gradient it does have
        out = nosa_training_attention(q, k, v, bias, cfg, 0.25, backend=backend)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        outs[backend], grads[backend] = out.detach(), bias.grad
    assert_close(outs["flex"], outs["explicit"], atol=1e-5)
    assert_close(grads["flex"], grads["explicit"], atol=1e-5)
    assert grads["explicit"].abs().sum() > 0


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_and_explicit_agree_on_real_rows_under_padding():
    # Padded query rows are garbage in both (they see only padding); real rows must agree exactly.
    cfg = small_nosa_config(**SPARSE)
    q, k, v, bias = _inputs(5)
    keep = torch.ones(2, 150, dtype=torch.bool)
    keep[1, :37] = False
    causal = torch.ones(150, 150, dtype=torch.bool).tril()
    mask = (causal[None] & keep[:, None, :])[:, None]  # [B, 1, T, T] as transformers builds for sdpa
    outs = [nosa_training_attention(q, k, v, bias, cfg, 0.25, attention_mask=mask, backend=b) for b in BACKENDS]
    real = keep[:, None, :, None].expand_as(outs[0])
    assert_close(outs[0][real], outs[1][real], atol=1e-5)


PADS = (0, 13, 40)  # left padding of the rows; 13 and 40 are not whole blocks of 16


def _left_padded(seed, q_offset=0, T=150):
    """Inputs of a left-padded batch: the padding keeps random (garbage) keys, and the model's 4D mask."""
    q, k, v, bias = _inputs(seed, B=len(PADS), T=T)
    keep = torch.ones(len(PADS), T, dtype=torch.bool)
    for row, pad in enumerate(PADS):
        keep[row, :pad] = False
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = (causal[None] & keep[:, None, :])[:, None, q_offset:]  # [B, 1, Tq, T] as transformers builds it
    return q[:, :, q_offset:], k, v, bias, mask, keep


@pytest.mark.parametrize("q_offset", [0, 45])
def test_left_padded_rows_select_as_the_rows_alone(q_offset):
    """The decode rule on a left-padded batch (``offsets``): every real query of a row sees exactly the tokens the
    same row alone sees, whatever the padding length, and never a padding token."""
    cfg = small_nosa_config(**SPARSE)
    q, k, _, bias, _, _ = _left_padded(8, q_offset)
    for row, pad in enumerate(PADS):
        bias[row, :, :pad] = -1e30  # padding folded into the scores, as the cache and the training path do
    together = nosa_token_mask(q, k, bias, q_offset, cfg, 0.25, offsets=torch.tensor(PADS))
    for row, pad in enumerate(PADS):
        first = max(0, pad - q_offset)  # the row's first real query
        alone = nosa_token_mask(q[row : row + 1, :, first:], k[row : row + 1, :, pad:], bias[row : row + 1, :, pad:],
                                q_offset + first - pad, cfg, 0.25)
        assert torch.equal(together[row, :, first:, pad:], alone[0]), row
        assert not together[row, :, first:, :pad].any()
        assert int(alone.sum(-1).max()) < alone.shape[-1]  # the budget bites


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("selection_kernel", [False, True])
def test_left_padded_training_attention_equals_the_rows_alone(selection_kernel, monkeypatch):
    """Training attention (every backend) on a left-padded batch: each real query's output is the row's alone."""
    import hf_nosa.attention.training as training

    monkeypatch.setattr(training, "SELECTION_KERNEL", selection_kernel)
    monkeypatch.setattr(training, "FLEX_TILE", 32)
    cfg = small_nosa_config(**SPARSE)
    q, k, v, bias, mask, keep = _left_padded(9)
    for backend in BACKENDS:
        out = nosa_training_attention(q, k, v, bias, cfg, 0.25, attention_mask=mask, backend=backend)
        for row, pad in enumerate(PADS):
            alone = nosa_training_attention(q[row : row + 1, :, pad:], k[row : row + 1, :, pad:],
                                            v[row : row + 1, :, pad:], bias[row : row + 1, :, pad:], cfg, 0.25,
                                            backend=backend)
            assert_close(out[row, :, pad:], alone[0], atol=1e-5, msg=f"{backend} row {row}")


@pytest.mark.parametrize("q_offset", [0, 40])
def test_flex_block_table_covers_exactly_the_tiles_the_rule_touches(q_offset):
    cfg = small_nosa_config(**SPARSE)
    q, k, _, bias = _inputs(4, T=200)
    q = q[:, :, q_offset:]
    bitmap = selected_blocks(q, k, bias, cfg, 0.25, q_offset=q_offset)
    tokens = nosa_token_mask(q, k, bias, q_offset, cfg, 0.25)  # [B, Hk, Tq, T]
    tile = 32
    mask = flex_block_mask(bitmap, cfg, heads=4, q_offset=q_offset, tile=tile)
    Tq, T = tokens.shape[2:]
    padded = torch.nn.functional.pad(tokens, (0, -T % tile, 0, -Tq % tile))
    B, Hk = tokens.shape[:2]
    tiles = padded.view(B, Hk, padded.shape[2] // tile, tile, padded.shape[3] // tile, tile)
    touched = tiles.any(5).any(3).repeat_interleave(2, dim=1)
    assert torch.equal(mask.to_dense().bool(), touched)
    # full tiles need no mask_mod: every token of them is allowed
    full = torch.zeros_like(touched)
    for b in range(B):
        for h in range(4):
            for i in range(touched.shape[2]):
                n = int(mask.full_kv_num_blocks[b, h, i])
                full[b, h, i, mask.full_kv_indices[b, h, i, :n].long()] = True
    rows_ok = torch.arange(tiles.shape[2] * tile).view(-1, tile) < Tq
    everything = (tiles | ~rows_ok[None, None, :, :, None, None]).all(5).all(3).repeat_interleave(2, dim=1)
    assert full.any() and bool((everything | ~full).all())


@pytest.mark.parametrize("q_offset,kv_tile", [(0, None), (45, 16)])
def test_flex_block_table_with_row_offsets_covers_every_allowed_key(q_offset, kv_tile):
    """With left padding a row-relative block straddles key tiles: every tile holding a key the rule allows is
    visited, none is skipped as full, and ``mask_mod`` is the exact rule (equal to the token mask)."""
    cfg = small_nosa_config(**SPARSE)
    q, k, _, bias, _, _ = _left_padded(4, q_offset, T=200)
    offsets = torch.tensor(PADS)
    for row, pad in enumerate(PADS):
        bias[row, :, :pad] = -1e30
    bitmap = selected_blocks(q, k, bias, cfg, 0.25, q_offset=q_offset, offsets=offsets)
    tokens = nosa_token_mask(q, k, bias, q_offset, cfg, 0.25, offsets=offsets)  # [B, Hk, Tq, T]
    tile = 32
    mask = flex_block_mask(bitmap, cfg, heads=4, q_offset=q_offset, tile=tile, kv_tile=kv_tile, offsets=offsets)
    kv = mask.BLOCK_SIZE[1]
    Tq, T = tokens.shape[2:]
    padded = torch.nn.functional.pad(tokens, (0, -T % kv, 0, -Tq % tile))
    B, Hk = tokens.shape[:2]
    tiles = padded.view(B, Hk, padded.shape[2] // tile, tile, padded.shape[3] // kv, kv)
    touched = tiles.any(5).any(3).repeat_interleave(2, dim=1)
    visited = mask.to_dense().bool()
    assert bool((visited | ~touched).all())
    assert int(mask.full_kv_num_blocks.sum()) == 0
    b, h, qi, ki = (torch.arange(n).view(*([1] * i), n, *([1] * (3 - i))) for i, n in enumerate((B, 4, Tq, T)))
    assert torch.equal(mask.mask_mod(b, h, qi, ki), tokens.repeat_interleave(2, dim=1))


def test_eviction_head_learns_through_the_bias_only():
    model = _sparse_model("llama")
    model.train()
    ids = torch.randint(3, 97, (2, 96), generator=torch.Generator().manual_seed(5))
    model(ids, labels=ids, use_cache=False).loss.backward()
    for head in eviction_heads(model).values():
        assert head.A.grad is not None and head.A.grad.abs().sum() > 0
        assert head.delta.weight.grad.abs().sum() > 0


def test_bad_backend_and_lengths():
    cfg = small_nosa_config(**SPARSE)
    q, k, v, bias = _inputs(6, T=40)
    with pytest.raises(ValueError, match="backend"):
        nosa_training_attention(q, k, v, bias, cfg, 0.25, backend="triton")
    with pytest.raises(ValueError, match="q_offset"):
        nosa_training_attention(q, k, v, bias, cfg, 0.25, q_offset=3)


@pytest.mark.parametrize("padded", [False, True])
def test_sparse_backend_equals_explicit_with_gradients_interpreted(interpret, padded):
    """The Triton block-sparse kernels (interpreted) on a real selection: the explicit backend's output and
    gradients of query, key, value and bias (real query rows; padding rows are arbitrary in every backend)."""
    cfg = NosaConfig(block_size=16, budget_tokens=64, query_tokens=16, sink_tokens=16, local_tokens=16,
                     compress_kernel=8, compress_stride=4)
    q, k, v, bias = _inputs(14, T=96)
    mask, real = None, torch.ones(2, 4, 96, 16, dtype=torch.bool)
    if padded:
        keep = torch.ones(2, 96, dtype=torch.bool)
        keep[1, :21] = False
        mask = (torch.ones(96, 96, dtype=torch.bool).tril()[None] & keep[:, None, :])[:, None]
        real[1, :, :21] = False
    upstream = torch.randn(2, 4, 96, 16, generator=torch.Generator().manual_seed(15)) * real
    results = {}
    for backend in ("explicit", "sparse"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        out = nosa_training_attention(*leaves, cfg, 0.25, attention_mask=mask, backend=backend)
        (out * upstream).sum().backward()
        results[backend] = [out.detach()[real]] + [t.grad for t in leaves]
    for name, actual, expected in zip(("out", "dq", "dk", "dv", "dbias"), results["sparse"], results["explicit"]):
        assert expected.abs().sum() > 0, name
        assert_close(actual, expected, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("fold", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_on_gpu_equals_explicit(dtype, fold):
    cfg = small_nosa_config(block_size=64, budget_tokens=512, query_tokens=128, sink_tokens=64, local_tokens=128,
                            compress_kernel=32, compress_stride=16)
    grads = {}
    outs = {}
    for backend in ("explicit", "flex"):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, h, 1000, 64, generator=g).to("cuda", dtype).requires_grad_() for h in (8, 2, 2))
        bias = torch.randn(2, 2, 1000, generator=g).cuda().requires_grad_()
        out = nosa_training_attention(q, k, v, bias, cfg, 0.125, backend=backend, fold=fold)
        out.float().pow(2).sum().backward()
        outs[backend] = out.detach()
        grads[backend] = [x.grad for x in (q, k, v, bias)]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert_close(outs["flex"], outs["explicit"], atol=tol, rtol=tol)
    for a, b in zip(grads["flex"], grads["explicit"]):
        assert_close(a, b, atol=tol * 10, rtol=tol * 10)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_training_forward_on_gpu_equals_nosa_decoding_and_trains_the_heads():
    """The CUDA default backend (sparse, with the selection kernels) against decoding token by token, in fp32: a
    block the selection kernels pick otherwise than decoding shows in the logits (shared-window ties, 4e446fe).
    No "flex" in the name: the training phases of gpu_session.sh deselect the flex tests."""
    model = _sparse_model("llama").cuda()
    ids = torch.randint(3, 97, (2, 150), generator=torch.Generator().manual_seed(1)).cuda()
    model.train()
    train_logits = model(ids, use_cache=False).logits
    model.eval()
    cache = NosaCache(model.config, small_nosa_config(**SPARSE, prefill="nosa"))
    with torch.no_grad():
        steps = [model(ids[:, :37], past_key_values=cache).logits]
        for t in range(37, ids.shape[1]):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache).logits)
    assert_close(train_logits.detach(), torch.cat(steps, dim=1), atol=1e-3, rtol=0)
    model.train()
    model(ids, labels=ids, use_cache=False).loss.backward()
    for head in eviction_heads(model).values():
        assert head.A.grad.abs().sum() > 0 and head.delta.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("G,padded", [(1, False), (4, False), (4, True)])
def test_explicit_backend_equals_the_reference_with_gradients(G, padded):
    """The mask path on sdpa (bias folded into head dimensions) against the per-token einsum reference."""
    cfg = small_nosa_config(**SPARSE)
    q, k, v, bias = _inputs(7, H=2 * G, T=150)
    mask = None
    if padded:
        keep = torch.ones(2, 150, dtype=torch.bool)
        keep[1, :37] = False
        mask = (torch.ones(150, 150, dtype=torch.bool).tril()[None] & keep[:, None, :])[:, None]
    grad = torch.randn(2, 2 * G, 150, 16, generator=torch.Generator().manual_seed(8))
    results = {}
    for backend in ("reference", "explicit"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        out = nosa_training_attention(*leaves, cfg, 0.25, attention_mask=mask, backend=backend)
        real = torch.ones_like(out, dtype=torch.bool)
        if padded:
            real[1, :, :37] = False  # padding query rows are arbitrary in every backend
        (out * grad * real).sum().backward()
        results[backend] = [out[real]] + [t.grad for t in leaves]
    for actual, expected in zip(results["explicit"], results["reference"]):
        assert_close(actual, expected, atol=2e-5, rtol=1e-4)
    assert results["explicit"][4].abs().sum() > 0


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("G,fold", [(4, 1), (4, 2), (4, 4), (2, 2)])
def test_folded_flex_layout_equals_explicit(G, fold, monkeypatch):
    """GQA members folded into the query rows: same outputs and bias gradient as the per-token mask path."""
    import hf_nosa.attention.training as training

    monkeypatch.setattr(training, "FLEX_TILE", 16)
    cfg = small_nosa_config(**SPARSE)
    outs, grads = {}, {}
    for backend in ("explicit", "flex"):
        q, k, v, bias = _inputs(9, H=2 * G, T=130)
        bias.requires_grad_()
        out = nosa_training_attention(q, k, v, bias, cfg, 0.25, backend=backend, fold=fold)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        outs[backend], grads[backend] = out.detach(), bias.grad
    assert_close(outs["flex"], outs["explicit"], atol=1e-5)
    assert_close(grads["flex"], grads["explicit"], atol=1e-5)


@pytest.mark.parametrize("q_offset", [0, 40])
def test_folded_block_table_covers_exactly_the_tiles_the_rule_touches(q_offset):
    cfg = small_nosa_config(**SPARSE)
    G, fold, tile = 4, 4, 32
    q, k, _, bias = _inputs(10, H=2 * G, T=200)
    q = q[:, :, q_offset:]
    bitmap = selected_blocks(q, k, bias, cfg, 0.25, q_offset=q_offset)
    tokens = nosa_token_mask(q, k, bias, q_offset, cfg, 0.25)  # [B, Hk, Tq, T]
    rows = tokens.repeat_interleave(fold, dim=2)  # row t * fold + f is token t
    mask = flex_block_mask(bitmap, cfg, heads=2 * G, q_offset=q_offset, tile=tile, fold=fold)
    R, T = rows.shape[2:]
    padded = torch.nn.functional.pad(rows, (0, -T % tile, 0, -R % tile))
    B, Hk = rows.shape[:2]
    tiles = padded.view(B, Hk, padded.shape[2] // tile, tile, padded.shape[3] // tile, tile)
    touched = tiles.any(5).any(3).repeat_interleave(G // fold, dim=1)
    assert mask.shape[-2:] == (R, T)
    assert torch.equal(mask.to_dense().bool(), touched)
    # tiles are tile x tile in both layouts: the folded one visits fewer for the same rule
    unfolded = flex_block_mask(bitmap, cfg, heads=2 * G, q_offset=q_offset, tile=tile)
    assert int(mask.to_dense().sum()) < int(unfolded.to_dense().sum())


def test_flex_fold_choice_and_bad_fold():
    import hf_nosa.attention.training as training
    from hf_nosa.attention.training import flex_fold

    assert [flex_fold(h, 8, limit=8) for h in (8, 16, 24, 32, 64, 128)] == [1, 2, 1, 4, 8, 8]
    assert flex_fold(32, 8, tile=2, limit=8) == 2
    assert flex_fold(32, 8) == flex_fold(32, 8, limit=training.FLEX_FOLD)
    cfg = small_nosa_config(**SPARSE)
    q, k, v, bias = _inputs(6, T=40)
    with pytest.raises(ValueError, match="fold"):
        nosa_training_attention(q, k, v, bias, cfg, 0.25, backend="flex", fold=3)
    with pytest.raises(ValueError, match="fold"):
        flex_block_mask(selected_blocks(q, k, bias, cfg, 0.25), cfg, heads=4, tile=32, fold=4)


def _counting_selection(monkeypatch):
    import hf_nosa.attention.training as training

    calls = []
    original = training.selected_block_indices

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(training, "selected_block_indices", counting)
    return calls


def test_checkpointed_backward_reuses_the_forward_selection(monkeypatch):
    """Under gradient checkpointing the recomputed forward finds its selection: one selection per layer and step,
    and the same gradients as without checkpointing. Without checkpointing nothing is held."""
    import gc

    from torch.utils.checkpoint import checkpoint

    from hf_nosa.attention import held_forward

    cfg = small_nosa_config(**SPARSE)
    calls = _counting_selection(monkeypatch)
    layers = [_inputs(20 + i, T=130) for i in range(2)]  # two "layers": different inputs, different selections
    grads = {}
    for checkpointed in (False, True):
        calls.clear()
        leaves = [[t.clone().requires_grad_() for t in layer] for layer in layers]

        def layer_forward(q, k, v, bias):
            return nosa_training_attention(q.clone(), k, v, bias, cfg, 0.25, backend="explicit")

        outs = [checkpoint(layer_forward, *x, use_reentrant=False) if checkpointed else layer_forward(*x)
                for x in leaves]
        assert len(calls) == 2
        assert len(held_forward.live()) == (2 if checkpointed else 0)
        sum((o * torch.linspace(-1, 1, 16)).sum() for o in outs).backward()
        assert len(calls) == 2, "the recomputed forward selected again"
        grads[checkpointed] = [t.grad for x in leaves for t in x]
        del outs
    for a, b in zip(grads[True], grads[False]):
        assert_close(a, b, atol=1e-6, rtol=1e-6)
    gc.collect()
    assert held_forward.live() == []  # nothing outlives the step


def test_reentrant_checkpointing_selects_in_its_rerun(monkeypatch):
    """Reentrant checkpointing runs its first forward without gradients: nothing is held, and the rerun (inside the
    backward) finds nothing and selects anew, with the same gradients."""
    from torch.utils.checkpoint import checkpoint

    from hf_nosa.attention import held_forward

    cfg = small_nosa_config(**SPARSE)
    calls = _counting_selection(monkeypatch)
    q, k, v, bias = _inputs(21, T=130)
    grads = {}
    for checkpointed in (False, True):
        calls.clear()
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]

        def layer_forward(q, k, v, bias):
            return nosa_training_attention(q, k, v, bias, cfg, 0.25, backend="explicit")

        out = checkpoint(layer_forward, *leaves, use_reentrant=True) if checkpointed else layer_forward(*leaves)
        assert held_forward.live() == []
        (out * torch.linspace(-1, 1, 16)).sum().backward()
        assert len(calls) == (2 if checkpointed else 1)
        grads[checkpointed] = [t.grad for t in leaves]
    for a, b in zip(grads[True], grads[False]):
        assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_checkpointed_sparse_attention_reuses_the_forward_output_interpreted(interpret, monkeypatch):
    """The sparse kernels under gradient checkpointing: the rerun takes the first forward's output and log-sum-exp
    instead of running the forward kernels again (counted), and the gradients equal those without checkpointing
    (left padding included)."""
    import gc

    from torch.utils.checkpoint import checkpoint

    from hf_nosa.attention import held_forward
    from hf_nosa.kernels.train import sparse_train_split

    cfg = small_nosa_config(**SPARSE)
    forwards = []
    original = sparse_train_split._forward
    monkeypatch.setattr(sparse_train_split, "_forward", lambda *a: forwards.append(1) or original(*a))
    # One KV head of two query heads (a group, as in the GQA models): the interpreter runs a program per (tile, row,
    # KV head), and what is checked here (the rerun reusing the held forward, bitwise the same gradients) does not
    # depend on the head count; test_sparse_backend_equals_explicit_with_gradients_interpreted and
    # kernels/test_sparse_train_split.py check the kernels over several KV heads. Half the programs of 4/2 heads.
    layers = [_inputs(50 + i, H=2, Hk=1, T=100) for i in range(2)]
    mask = torch.ones(2, 100, dtype=torch.long)
    mask[1, :7] = 0
    attention_mask = mask[:, None, None, :].bool() & torch.ones(100, 100, dtype=torch.bool).tril()
    for q, k, _, bias in layers:  # the budget bites (the last queries: 4 of 6 earlier blocks): a real sparse selection
        chosen = selected_blocks(q, k, bias, cfg, 0.25).sum(-1)
        assert int(chosen.max()) <= cfg.budget_blocks and int(chosen[..., -1].min()) < 100 // cfg.block_size
    grads = {}
    # "hooks": saved-tensor hooks that keep what the forward saved (no checkpoint, so no rerun): the forward holds its
    # result expecting a rerun that never comes, and the backward runs on what it saved
    for mode in ("plain", "checkpoint", "hooks"):
        forwards.clear()
        leaves = [[t.clone().requires_grad_() for t in layer] for layer in layers]

        def layer_forward(q, k, v, bias):
            return nosa_training_attention(q * 1.0, k, v, bias, cfg, 0.25, backend="sparse",
                                           attention_mask=attention_mask)

        if mode == "hooks":
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                outs = [layer_forward(*x) for x in leaves]
        else:
            outs = [checkpoint(layer_forward, *x, use_reentrant=False) if mode == "checkpoint" else layer_forward(*x)
                    for x in leaves]
        assert len(forwards) == 2
        sum((o[1:] * torch.linspace(-1, 1, 16)).sum() + (o[0] ** 2).sum() for o in outs).backward()
        assert len(forwards) == 2, "the rerun ran the forward kernels again"
        grads[mode] = [t.grad for x in leaves for t in x]
        del outs
    for mode in ("checkpoint", "hooks"):
        for a, b in zip(grads[mode], grads["plain"]):
            assert torch.equal(a, b)  # the same kernels on the same inputs: bitwise
    gc.collect()
    assert held_forward.live() == []


def test_a_fingerprint_tells_layers_and_steps_apart():
    """Different inputs (another layer, a step later) give another fingerprint; the same inputs in the same layout
    (a rerun's) the same one, also through a transposed view (the query as attention gets it)."""
    from hf_nosa.attention import held_forward

    q, k, _, bias = _inputs(60, T=90)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    meta, numbers = held_forward.fingerprint(q, k, bias, (0, 0.25))
    again = held_forward.fingerprint(q.transpose(1, 2).clone().transpose(1, 2), k.clone(), bias.clone(), (0, 0.25))
    assert again[0] == meta and torch.equal(again[1], numbers)
    step = q.clone()
    step[1, 3, 77, 5] += 1e-3  # one value changed: the sums see it
    assert not torch.equal(held_forward.fingerprint(step, k, bias, (0, 0.25))[1], numbers)
    assert held_forward.fingerprint(q, k, bias, (1, 0.25))[0] != meta
    # the samples: values spread over the elements in row-major order, read in place from the transposed view
    flat = q.reshape(-1)
    where = torch.arange(held_forward.FINGERPRINT_SAMPLES) * (flat.numel() // held_forward.FINGERPRINT_SAMPLES)
    assert torch.equal(held_forward._samples(q), flat[where])


@pytest.mark.gpu
def test_checkpointed_forward_waits_on_the_host_on_gpu(monkeypatch):
    """On CUDA a held forward (selection, output, log-sum-exp) waits in pinned host memory between the forward and
    its rerun (it would hold device memory at the step's peak otherwise); the rerun gets them back, the earlier
    layer's prefetched, with the same gradients as without checkpointing."""
    import gc

    from torch.utils.checkpoint import checkpoint

    from hf_nosa.attention import held_forward
    from hf_nosa.kernels.train import sparse_train_split

    cfg = small_nosa_config(**SPARSE)
    calls = _counting_selection(monkeypatch)
    forwards = []
    original = sparse_train_split._forward
    monkeypatch.setattr(sparse_train_split, "_forward", lambda *a: forwards.append(1) or original(*a))
    uploads = []  # per copy back: on the upload stream (prefetched) or the current one
    to_device = held_forward._to_device
    monkeypatch.setattr(held_forward, "_to_device",
                        lambda *a, **kw: uploads.append(len(a) > 3 or "stream" in kw) or to_device(*a, **kw))
    layers = [[t.cuda() for t in _inputs(40 + i, T=300)] for i in range(3)]
    grads = {}
    for checkpointed in (False, True):
        calls.clear()
        forwards.clear()
        uploads.clear()
        leaves = [[t.clone().requires_grad_() for t in layer] for layer in layers]

        def layer_forward(q, k, v, bias):
            return nosa_training_attention(q * 1.0, k, v, bias, cfg, 0.25, backend="sparse")

        x = leaves[0][0]
        for layer in leaves:  # a chain of layers, as in a model: the backward reruns them last to first
            x = checkpoint(layer_forward, x, *layer[1:], use_reentrant=False) if checkpointed else \
                layer_forward(x, *layer[1:])
        held = held_forward.live()
        if checkpointed:
            assert len(held) == 3 and all(h._indices is None and len(h._host) == 3 for h in held)
            assert all(t.is_pinned() for h in held for t in h._host)
        else:
            assert held == []
        (x * torch.linspace(-1, 1, 16, device="cuda")).sum().backward()
        assert len(calls) == 3 and len(forwards) == 3, "the rerun selected or attended again"
        if checkpointed:  # layer 2 copied back on the current stream; 1 and 0 on the upload stream, prefetched
            assert uploads == [False, True, True], uploads
        grads[checkpointed] = [t.grad for x in leaves for t in x if t.grad is not None]
        del x, held
    for a, b in zip(grads[True], grads[False]):
        assert torch.equal(a, b)
    gc.collect()
    assert held_forward.live() == []


def test_selection_is_not_kept_without_gradients(monkeypatch):
    from hf_nosa.attention import held_forward

    cfg = small_nosa_config(**SPARSE)
    calls = _counting_selection(monkeypatch)
    q, k, v, bias = _inputs(30, T=100)
    with torch.no_grad():
        first = nosa_training_attention(q, k, v, bias, cfg, 0.25)
        second = nosa_training_attention(q, k, v, bias, cfg, 0.25)
    assert len(calls) == 2 and held_forward.live() == []
    assert torch.equal(first, second)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_model_step_with_gradient_checkpointing_selects_once_per_layer(monkeypatch):
    model = _sparse_model("llama", seed=3)
    ids = torch.randint(3, 97, (1, 140), generator=torch.Generator().manual_seed(6))
    grads = {}
    for checkpointed in (False, True):
        calls = _counting_selection(monkeypatch)
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids, use_cache=False).loss.backward()
        assert len(calls) == model.config.num_hidden_layers
        grads[checkpointed] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys() and grads[True]
    for name in grads[True]:
        assert_close(grads[True][name], grads[False][name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_key_tiles_of_one_block_equal_explicit(monkeypatch):
    """Key tiles as small as a NOSA block (FLEX_KV_TILE): same result, and no more tiles than the default."""
    import hf_nosa.attention.training as training

    monkeypatch.setattr(training, "FLEX_TILE", 32)
    cfg = small_nosa_config(**SPARSE)
    q, k, v, bias = _inputs(11, H=8, T=200)
    expected = nosa_training_attention(q, k, v, bias, cfg, 0.25, backend="explicit")
    monkeypatch.setattr(training, "FLEX_KV_TILE", cfg.block_size)
    assert_close(nosa_training_attention(q, k, v, bias, cfg, 0.25, backend="flex"), expected, atol=1e-5)
    bitmap = selected_blocks(q, k, bias, cfg, 0.25)
    small = flex_block_mask(bitmap, cfg, heads=8, tile=32, fold=4, kv_tile=cfg.block_size)
    large = flex_block_mask(bitmap, cfg, heads=8, tile=32, fold=4)
    assert int(small.to_dense().sum()) * cfg.block_size < int(large.to_dense().sum()) * 32
    with pytest.raises(ValueError, match="multiple of block_size"):
        flex_block_mask(bitmap, cfg, heads=8, tile=32, kv_tile=24)


@pytest.mark.parametrize("padded", [False, True])
def test_selection_through_the_kernels_equals_the_reference(padded, monkeypatch):
    """SELECTION_KERNEL: the selection through kernels/train_select (interpreted here) picks the same blocks."""
    import hf_nosa.attention.training as training

    cfg = small_nosa_config(**SPARSE)
    q, k, _, bias = _inputs(12, H=8, T=150)
    if padded:
        bias[1, :, :37] = -1e30
    expected = selected_blocks(q, k, bias, cfg, 0.25, q_offset=0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HF_NOSA_KERNELS", "triton")
    monkeypatch.setattr(training, "SELECTION_KERNEL", True)
    actual = selected_blocks(q, k, bias, cfg, 0.25, q_offset=0, chunk_size=64)
    assert torch.equal(actual, expected)


@pytest.mark.gpu
def test_selection_kernel_on_gpu_picks_the_reference_blocks(monkeypatch):
    """SELECTION_KERNEL on CUDA at a training shape: the compiled block-score kernel changes the summation order
    only, so at most a near-tie in a handful of tokens may resolve differently."""
    import hf_nosa.attention.training as training

    cfg = small_nosa_config(block_size=64, budget_tokens=512, query_tokens=128, sink_tokens=64, local_tokens=128,
                            compress_kernel=32, compress_stride=16)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, h, 4096, 64, generator=g).to("cuda", torch.bfloat16) for h in (32, 8))
    bias = torch.randn(1, 8, 4096, generator=g).cuda()
    expected = selected_blocks(q, k, bias, cfg, 0.125)
    monkeypatch.setattr(training, "SELECTION_KERNEL", True)
    actual = selected_blocks(q, k, bias, cfg, 0.125)
    differing = (actual != expected).any(-1).float().mean().item()
    assert differing <= 1e-3, differing
