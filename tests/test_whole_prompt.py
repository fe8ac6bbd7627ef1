"""A QUOKA prompt through each layer whole (``whole_prompt``): the same chunks, blocks and dense tail as chunk by
chunk, so the same tokens and logits, with the blocks gathered on the device and nothing read back from the host."""

import pytest
import torch

from hf_nosa import NosaCache, NosaConfig, to_nosa
from hf_nosa.modeling import fused, randomize_eviction_heads
from hf_nosa.prefill.whole_prompt import gather_blocks

from .conftest import padded_batch, small_nosa_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
WHOLE = 1 << 20  # prefill_whole_prompt_tokens above every prompt here (small_nosa_config's 0: chunk by chunk)


def _layer_lengths(model):
    """The sequence length each forward of the first decoder layer saw, in order."""
    seen = []
    model.model.layers[0].register_forward_pre_hook(lambda module, args, kwargs: seen.append(
        (args[0] if args else kwargs["hidden_states"]).shape[1]), with_kwargs=True)
    return seen


def _generate(model, ids, mask, new_tokens=6, hidden_states=False, **cache_config):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, cache_implementation="nosa",
                          cache_config=cache_config, output_hidden_states=hidden_states)


def _converted(family="llama", seed=3, layers=2, **overrides):
    config = small_nosa_config(prefill="quoka", prefill_budget_tokens=64, prefill_chunk_size=64,
                               prefill_whole_prompt_tokens=WHOLE, **overrides)
    model = to_nosa(tiny_model(family, seed=seed, num_hidden_layers=layers), config)
    randomize_eviction_heads(model, generator=torch.Generator().manual_seed(seed + 1))
    return model


@pytest.mark.parametrize("pads", [(0,), (0, 9, 23)])
def test_whole_prompt_gives_the_chunked_tokens_and_logits(family, pads):
    """Sparse budget (64 of up to 400 tokens), 64-token chunks, a dense tail of 64 tokens starting mid-chunk in the
    padded rows: through each layer whole, the same tokens and logits as chunk by chunk."""
    model = _converted(family)
    ids, mask = padded_batch(400, pads, seed=4)
    lengths = _layer_lengths(model)
    chunked = _generate(model, ids, mask, prefill_whole_prompt_tokens=0)
    assert lengths[0] == 64 and max(lengths) == 64
    lengths.clear()
    whole = _generate(model, ids, mask)  # the model's config: whole
    assert lengths[0] == 400 and lengths[1:] == [1] * 5
    assert torch.equal(whole.sequences, chunked.sequences)
    for a, b in zip(whole.logits, chunked.logits):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_whole_prompt_without_dense_tail_or_quoka_budget_changes_the_output():
    """The chunks really attend sparsely when the prompt comes whole: a budget covering everything gives other
    logits, and a prompt within the threshold but no dense tail still matches chunk by chunk."""
    model = _converted(prefill_dense_tail_tokens=0)
    ids, mask = padded_batch(300, (0, 5), seed=8)
    whole = _generate(model, ids, mask, new_tokens=2, prefill_dense_tail_tokens=0)
    chunked = _generate(model, ids, mask, new_tokens=2, prefill_dense_tail_tokens=0, prefill_whole_prompt_tokens=0)
    torch.testing.assert_close(whole.logits[0], chunked.logits[0], atol=2e-5, rtol=1e-4)
    full = _generate(model, ids, mask, new_tokens=2, prefill_dense_tail_tokens=0, prefill_budget_tokens=320)
    assert (whole.logits[0] - full.logits[0]).abs().max() > 1e-3


def test_a_prompt_over_the_threshold_goes_chunk_by_chunk():
    model = _converted()
    ids, mask = padded_batch(256, (0, 0), seed=2)
    lengths = _layer_lengths(model)
    _generate(model, ids, mask, new_tokens=1, prefill_whole_prompt_tokens=2 * 256 - 1)
    assert lengths == [64] * 4
    lengths.clear()
    _generate(model, ids, mask, new_tokens=1, prefill_whole_prompt_tokens=2 * 256)
    assert lengths == [256]
    lengths.clear()
    _generate(model, ids, mask, new_tokens=1, prefill="dense")  # whole only under QUOKA
    assert lengths == [64] * 4


def test_whole_prompt_reads_nothing_back_and_holds_the_prompt():
    """Prefill alone: no host read (blocks and tail come from the layer's keys), and the device held the prompt's
    tokens of one layer at the peak (``device_tokens``), where chunk by chunk it holds a budget plus a chunk."""
    model = _converted()
    ids = padded_batch(320, (0,), seed=1)[0]
    for whole, read, held in ((320, False, 320), (0, True, 64 + 64)):
        cfg = small_nosa_config(prefill="quoka", prefill_budget_tokens=64, prefill_chunk_size=64,
                                prefill_whole_prompt_tokens=whole)
        cache = NosaCache(model.config, cfg)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        stats = cache.stats()
        assert stats["seen_tokens"] == stats["host_tokens"] == 320
        assert (stats["bytes_to_device"] > 0) == read
        assert stats["device_tokens"] == held


def test_whole_prompt_on_the_kernels(interpret, prompt_rotary_on_torch, monkeypatch):
    """The Triton path (interpreted): selection kernels, flash_biased over the gathered blocks and the tail's
    prefix on the device, against chunk by chunk on the torch path.

    The prompt's rotary embedding runs its torch reference (the interpreter runs that kernel once per token and
    layer, most of this test's time, and it is bitwise its reference: tests/conftest.py ``prompt_rotary_on_torch``).
    One layer: every layer runs the same kernels (two layers through a whole prompt, against chunk by chunk, are the
    torch-path tests above). 100 tokens in 32-token chunks, a budget of 3 blocks and a 16-token dense tail: a chunk
    with nothing before it, one whose 2 earlier blocks all fit the budget, one choosing 3 of 4 blocks while the
    rows' tails start inside it (at its 21st query, and at its 8th in the row padded by 13), and a last one of tail
    queries alone. With one layer the last position's logits come from the dense tail alone, so the layer's output
    at every real position of the prompt is compared too: there each chunk's own blocks and tail show."""
    model = _converted(seed=11, layers=1)
    ids, mask = padded_batch(100, (0, 13), seed=12)
    config = dict(prefill_chunk_size=32, prefill_budget_tokens=48, prefill_dense_tail_tokens=16, local_tokens=16)
    lengths = _layer_lengths(model)
    whole = _generate(model, ids, mask, new_tokens=1, hidden_states=True, **config)
    assert lengths == [100] and prompt_rotary_on_torch == [100]  # the whole prompt through the layer at once
    monkeypatch.setenv("HF_NOSA_KERNELS", "torch")
    chunked = _generate(model, ids, mask, new_tokens=1, hidden_states=True, prefill_whole_prompt_tokens=0, **config)
    torch.testing.assert_close(whole.logits[0], chunked.logits[0], atol=1e-4, rtol=1e-4)
    real = mask.bool()
    for a, b in zip(whole.hidden_states[0], chunked.hidden_states[0]):  # the embeddings, then the layer (normed)
        torch.testing.assert_close(a[real], b[real], atol=1e-4, rtol=1e-4)


def test_gather_blocks_against_a_loop():
    g = torch.Generator().manual_seed(0)
    B, Hk, T, D, P = 2, 3, 96, 8, 16
    k, v = torch.randn(B, Hk, T, D, generator=g), torch.randn(B, Hk, T, D, generator=g)
    b = torch.randn(B, Hk, T, generator=g)
    selected = torch.randint(-1, T // P, (B, Hk, 4), generator=g)
    selected[0, 0, 1] = -1
    gk, gv, gb = gather_blocks(k, v, b, selected, P)
    assert gk.shape == gv.shape == (B, Hk, 4 * P, D) and gb.shape == (B, Hk, 4 * P)
    for row in range(B):
        for head in range(Hk):
            for i, block in enumerate(selected[row, head].tolist()):
                span = slice(i * P, (i + 1) * P)
                if block < 0:
                    assert bool((gb[row, head, span] <= -1e29).all())
                    continue
                tokens = slice(block * P, (block + 1) * P)
                assert torch.equal(gk[row, head, span], k[row, head, tokens])
                assert torch.equal(gv[row, head, span], v[row, head, tokens])
                assert torch.equal(gb[row, head, span], b[row, head, tokens])


def test_the_threshold():
    cfg = NosaConfig(prefill="quoka", prefill_whole_prompt_tokens=16384)
    assert cfg.prefill_chunk(1) == cfg.prefill_chunk(2) == cfg.prefill_chunk_size == 2048
    assert cfg.prefill_whole(1, 16384) and cfg.prefill_whole(2, 8192)
    assert not cfg.prefill_whole(1, 16384 + 64) and not cfg.prefill_whole(2, 8192 + 64)  # over the threshold
    assert not cfg.prefill_whole(1, 2048)  # one chunk: nothing to cut
    assert not NosaConfig(prefill="dense").prefill_whole(1, 8192)
    assert not NosaConfig(prefill_whole_prompt_tokens=0).prefill_whole(1, 65536)
    assert NosaConfig().prefill_whole(4, 65536) and not NosaConfig().prefill_whole(5, 65536)  # the default: 262144
    assert not NosaConfig().prefill_whole(1, 4096)  # "auto": dense within the budget


@pytest.mark.parametrize("bad", [-1, True, 1.5, "all"])
def test_bad_threshold_is_named(bad):
    with pytest.raises(ValueError, match="NosaConfig.prefill_whole_prompt_tokens"):
        NosaConfig(prefill_whole_prompt_tokens=bad)


def test_the_mlp_in_slices_equals_the_mlp_at_once(monkeypatch):
    model = to_nosa(tiny_model("llama", seed=2), small_nosa_config())
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, fused.FusedMLPMixin)
    x = torch.randn(2, 50, model.config.hidden_size)
    with torch.no_grad():
        at_once = mlp(x)
        monkeypatch.setattr(fused, "MLP_SLICE_TOKENS", 16)
        sliced = mlp(x)
    torch.testing.assert_close(sliced, at_once, atol=1e-6, rtol=1e-5)
    x.requires_grad_(True)
    mlp(x).sum().backward()  # with a gradient: at once, as the stock module
    assert x.grad is not None


@pytest.mark.gpu
def test_whole_prompt_on_cuda_matches_chunk_by_chunk():
    model = _converted(seed=21).to("cuda", torch.bfloat16)
    ids, mask = padded_batch(1000, (0, 17), seed=22)
    ids, mask = ids.cuda(), mask.cuda()
    whole = _generate(model, ids, mask, new_tokens=1)
    chunked = _generate(model, ids, mask, new_tokens=1, prefill_whole_prompt_tokens=0)
    torch.testing.assert_close(whole.logits[0].float(), chunked.logits[0].float(), atol=3e-2, rtol=3e-2)


def test_the_whole_prompt_path_is_taken_only_when_its_activations_fit(monkeypatch):
    """On CUDA the whole-prompt path also asks the device: free bytes, the allocator's cached ones and the process's
    memory fraction (a 24 GB cap on a larger card); on the CPU the threshold alone decides."""
    from types import SimpleNamespace

    from hf_nosa.modeling import chunked

    model = tiny_model("llama")
    per_token = (6 * 64 + (4 + 2 * 2) * 16) * 4  # fp32 tiny llama: 6 hidden + q, k, v
    assert chunked.whole_prompt_bytes(model.config, 2, 100, 4) == 2 * 100 * per_token
    assert chunked._whole_prompt_fits(model, torch.zeros(1, 4), 1, 10**9)  # the CPU: the threshold decides
    cuda = SimpleNamespace(is_cuda=True, device="cuda:0")
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 4 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 6 * gib)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)
    fits = lambda tokens: chunked._whole_prompt_fits(model, cuda, 1, tokens)  # noqa: E731
    assert fits(int(0.79 * 62 * gib / per_token)) and not fits(int(0.81 * 62 * gib / per_token))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.3)  # a 24 GB cap
    assert fits(int(0.79 * 20 * gib / per_token)) and not fits(int(0.81 * 20 * gib / per_token))
