"""Left padding changes nothing: a padded row decodes as the same row alone, with a budget far below the context.

The pads (0, 13 and 40 tokens with block 16) are not whole blocks, the config has sink blocks, a local window and
query blocks, and the padding keeps random token ids (garbage keys): rows counted from cache index 0 would put
padding in the sink block and cut the row into other blocks and windows than alone (``hf_nosa.rules.padding``), and these
tests fail within a few steps. Every row of the batch must give the tokens of the row alone, logits within 1e-4.
"""

import pytest
import torch

from hf_nosa import NosaCache, to_nosa
from hf_nosa.modeling import randomize_eviction_heads

from .conftest import small_nosa_config, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

LENGTH = 150  # the batch's padded length; rows alone have 150, 137 and 110 tokens
NEW_TOKENS = 40
PADS = (0, 13, 40)
# 6 blocks of 16 (sink 1, local 2, query 2, eviction head 1) against 7-12 blocks of context.
BASE = dict(budget_tokens=96, query_tokens=32, sink_tokens=16, local_tokens=32)
MODES = {
    "dense": dict(prefill="dense"),
    # 4-block QUOKA budget, 2-block chunks: the chunks of a padded row must fall where they do alone.
    "quoka": dict(prefill="quoka", prefill_budget_tokens=64, prefill_chunk_size=32, quoka_queries=3),
    "nosa": dict(prefill="nosa", prefill_chunk_size=48),
    # the batch (150 tokens) prefills by QUOKA, the 110-token row alone densely: the same blocks while they fit
    "auto": dict(prefill="auto", prefill_budget_tokens=128, prefill_chunk_size=32),
}


def _model(family, cfg, device="cpu", **overrides):
    model = to_nosa(tiny_model(family, seed=1, **overrides), cfg)
    model.generation_config.eos_token_id = None  # always the same number of steps
    randomize_eviction_heads(model, scale=0.5, generator=torch.Generator().manual_seed(2))
    return model.to(device)


def _batch(length=LENGTH, pads=PADS, device="cpu"):
    ids = torch.randint(3, 97, (len(pads), length), generator=torch.Generator().manual_seed(3)).to(device)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):  # the padding keeps its random ids
        mask[row, :pad] = 0
    return ids, mask


def _generate(model, cfg, ids, mask, new_tokens, **kwargs):
    out = model.generate(
        input_ids=ids, attention_mask=mask, past_key_values=NosaCache(model.config, cfg), max_new_tokens=new_tokens,
        do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs,
    )
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)  # [B, new], [B, new, V]


def _check_rows(model, cfg, ids, mask, pads, new_tokens, alone_on=None, **kwargs):
    """The padded batch against each row alone; ``alone_on``: a monkeypatch that runs the rows alone on the torch
    path (the reference the kernel path is held to, tokens equal and logits within 1e-4, in test_decode_path)."""
    tokens, logits = _generate(model, cfg, ids, mask, new_tokens, **kwargs)
    if alone_on is not None:
        alone_on.setenv("HF_NOSA_KERNELS", "torch")
    for row, pad in enumerate(pads):
        alone = ids[row : row + 1, pad:]
        alone_tokens, alone_logits = _generate(model, cfg, alone, torch.ones_like(alone), new_tokens, **kwargs)
        assert torch.equal(tokens[row], alone_tokens[0]), f"row {row} (pad {pad})"
        torch.testing.assert_close(logits[row], alone_logits[0], atol=1e-4, rtol=1e-4, msg=f"row {row} (pad {pad})")


@pytest.mark.parametrize("mode", ["dense", "quoka"])
def test_padded_rows_decode_like_the_rows_alone_with_a_small_budget(family, mode):
    cfg = small_nosa_config(**BASE, **MODES[mode])
    ids, mask = _batch()
    _check_rows(_model(family, cfg), cfg, ids, mask, PADS, NEW_TOKENS)


@pytest.mark.parametrize("mode", ["nosa", "auto"])
def test_the_other_prefill_modes(mode):
    cfg = small_nosa_config(**BASE, **MODES[mode])
    ids, mask = _batch()
    _check_rows(_model("qwen3", cfg), cfg, ids, mask, PADS, NEW_TOKENS)


def test_beam_search_rows_equal_the_rows_alone():
    """Beams reorder the cache's rows every step: each row's padding must follow its beam."""
    cfg = small_nosa_config(**BASE, **MODES["dense"])
    ids, mask = _batch()
    model = _model("llama", cfg)
    model.config.nosa = cfg.to_dict()  # cache_implementation="nosa": the model's config, the workspace's buffers
    out = model.generate(input_ids=ids, attention_mask=mask, cache_implementation="nosa", max_new_tokens=20,
                         num_beams=3, do_sample=False)
    for row, pad in enumerate(PADS):
        alone = ids[row : row + 1, pad:]
        expected = model.generate(input_ids=alone, attention_mask=torch.ones_like(alone), max_new_tokens=20,
                                  cache_implementation="nosa", num_beams=3, do_sample=False)
        assert torch.equal(out[row, LENGTH:], expected[0, alone.shape[1]:]), f"row {row} (pad {pad})"


def test_a_padded_prompts_outputs_come_back_at_the_callers_positions():
    """The prompt goes through the model with each row's real tokens first; a forward's logits and hidden states
    still come out at the positions of the caller's (left-padded) layout, equal to the row alone's."""
    cfg = small_nosa_config(**BASE, **MODES["quoka"])
    model = _model("qwen3", cfg)
    ids, mask = _batch(length=100)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=positions, past_key_values=NosaCache(model.config, cfg),
                    output_hidden_states=True)
        for row, pad in enumerate(PADS):
            alone = model(ids[row : row + 1, pad:], past_key_values=NosaCache(model.config, cfg),
                          output_hidden_states=True)
            torch.testing.assert_close(out.logits[row, pad:], alone.logits[0], atol=1e-4, rtol=1e-4)
            for layer, (mine, theirs) in enumerate(zip(out.hidden_states, alone.hidden_states)):
                torch.testing.assert_close(mine[row, pad:], theirs[0], atol=1e-4, rtol=1e-4, msg=f"layer {layer}")


@pytest.mark.parametrize("mode", ["dense", "quoka"])
def test_the_same_on_the_device_kernels_interpreted(interpret, prompt_rotary_on_torch, monkeypatch, mode):
    """The Triton path (block_select, fetch, decode attention; QUOKA scoring and chunk attention) in the
    interpreter: its kernels read each row's padding on the device. The rows alone (no padding) run on the torch
    path: the interpreted batch is what is under test. The prompt's rotary embedding (a per-token kernel, bitwise
    its reference: tests/conftest.py ``prompt_rotary_on_torch``) runs the reference, the decode steps' the kernel."""
    # The interpreter takes about a second per decode step, so the sizes are the least that still hold every case. 4
    # blocks (sink, local 2, query 1) against rows of 97, 94 and 80 tokens (pads 3 and 17: a part of a block, and a
    # whole block and a part). Two decode steps: the first fetches every row's selection and opens block 5 of the
    # 80-token row (its prompt ends on a block boundary, so its pool holds no partial block); in the second the
    # 94-token row completes a compressed window and block 5, and the selection changes. QUOKA: a 48-token dense
    # tail, so the one chunk that fetches blocks holds the rows' first tail queries at 17, 14 and 0 (a padded row's
    # inside the chunk, as alone), and the last two chunks are tail queries over the prefix alone.
    pads = (0, 3, 17)
    tail = {"prefill_dense_tail_tokens": 48} if mode == "quoka" else {}
    cfg = small_nosa_config(**{**BASE, "budget_tokens": 64, "query_tokens": 16, **tail}, **MODES[mode])
    ids, mask = _batch(length=97, pads=pads)
    _check_rows(_model("llama", cfg, num_hidden_layers=1), cfg, ids, mask, pads, 3, alone_on=monkeypatch)
    assert prompt_rotary_on_torch  # the batch's prompt took the reference (the rows alone run the torch path anyway)


def _updates_and_crop(model, cfg, prompt, prompt_mask, extra):
    """Prompt, 20 more tokens in one update, crop 8 of them, 18 more, one decode token: the logits of the updates
    and the first layer's keys."""
    cache = NosaCache(model.config, cfg)
    T = prompt.shape[1]
    mask = torch.cat([prompt_mask, torch.ones_like(extra), torch.ones_like(extra[:, :1])], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate numbers them: from each row's first real token

    def forward(ids, lo, hi):
        return model(ids, attention_mask=mask[:, :hi], position_ids=positions[:, lo:hi], past_key_values=cache).logits

    with torch.no_grad():
        forward(prompt, 0, T)
        first = forward(extra[:, :20], T, T + 20)
        cache.crop(-8)
        second = forward(extra[:, 12:30], T + 12, T + 30)
        step = forward(extra[:, :1], T + 30, T + 31)
    return torch.cat([first, second, step], 1), cache.layers[0].keys


def test_updates_after_the_prompt_and_crop_equal_the_rows_alone():
    """Several tokens after a prompt (assisted decoding's candidates), then crop (their rejection), then more:
    each row of the padded cache gives what the row alone gives."""
    cfg = small_nosa_config(**BASE, **MODES["quoka"])
    model = _model("qwen2", cfg)
    ids, mask = _batch(length=130)
    extra = torch.randint(3, 97, (3, 30), generator=torch.Generator().manual_seed(4))
    together, keys = _updates_and_crop(model, cfg, ids, mask, extra)
    for row, pad in enumerate(PADS):
        alone = ids[row : row + 1, pad:]
        expected, alone_keys = _updates_and_crop(model, cfg, alone, torch.ones_like(alone), extra[row : row + 1])
        torch.testing.assert_close(together[row], expected[0], atol=1e-4, rtol=1e-4, msg=f"row {row} (pad {pad})")
        # the cache-layer protocol's keys: the row's own keys at their cache positions, zeros in the padding
        torch.testing.assert_close(keys[row, :, pad:], alone_keys[0], atol=1e-5, rtol=1e-5)
        assert not keys[row, :, :pad].any()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["dense", "quoka"])
def test_the_same_on_gpu(family, mode):
    """Compiled kernels and the CUDA-graph decode, fp32."""
    cfg = small_nosa_config(**BASE, **MODES[mode])
    ids, mask = _batch(device="cuda")
    _check_rows(_model(family, cfg, device="cuda"), cfg, ids, mask, PADS, NEW_TOKENS)
