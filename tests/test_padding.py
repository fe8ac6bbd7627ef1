"""Left padding changes nothing: a padded row decodes as the same row alone, with a budget far below the context.

Padding tokens carry eviction score MASK_VALUE, so every window holding one is a padding window
(``selection.PADDING_WINDOW_BIAS``) and takes no part in query-aware scoring; with that, every rule of a decode step
is relative to the real tokens, except the sink blocks (blocks 0.., which in a padded row are padding). The test
config has no sink blocks.

Blocks and compression windows are aligned to cache indices, not to the first real token: padding whose length is
not a multiple of ``block_size`` shifts every block boundary of the row, so the row is cut into different blocks
(and windows) than when alone, and a budget below the context then selects different tokens. The pad lengths here
are multiples of ``block_size`` (which ``compress_stride`` divides); for QUOKA also of ``prefill_chunk_size``, since
chunks too start at cache index 0.

The padding keeps random token ids, so pad keys differ as garbage may; without the padding-window rule these rows
come out different from the rows alone.
"""

import pytest
import torch

from hf_nosa import NosaCache, to_nosa
from hf_nosa.modeling import randomize_eviction_heads

from .conftest import small_nosa_config, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

LENGTH = 310  # the unpadded row; 12 new tokens cross the block boundary at 320
NEW_TOKENS = 12
# Budget 4 blocks of 16 (query 1, local 2, eviction head 1, no sink) against 20 blocks of context.
BASE = dict(budget_tokens=64, query_tokens=16, sink_tokens=0, local_tokens=32)
CASES = {
    "dense": (dict(prefill="dense"), (0, 16, 48)),
    # QUOKA prefill with a 4-block budget and 2-block chunks: pads are whole chunks.
    "quoka": (dict(prefill="quoka", prefill_budget_tokens=64, prefill_chunk_size=32, quoka_queries=3), (0, 32, 64)),
}


def _generate(model, cfg, ids, mask, new_tokens):
    out = model.generate(
        input_ids=ids, attention_mask=mask, past_key_values=NosaCache(model.config, cfg), max_new_tokens=new_tokens,
        do_sample=False, output_logits=True, return_dict_in_generate=True,
    )
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)  # [B, new], [B, new, V]


def _check_rows(family, mode, new_tokens=NEW_TOKENS, device="cpu", **model_overrides):
    overrides, pads = CASES[mode]
    cfg = small_nosa_config(**BASE, **overrides)
    aligned = cfg.block_size if mode == "dense" else cfg.prefill_chunk_size
    assert all(pad % aligned == 0 for pad in pads)
    model = to_nosa(tiny_model(family, seed=1, **model_overrides), cfg)
    model.generation_config.eos_token_id = None  # always new_tokens steps
    randomize_eviction_heads(model, scale=0.5, generator=torch.Generator().manual_seed(2))
    model.to(device)
    ids = torch.randint(3, 97, (len(pads), LENGTH), generator=torch.Generator().manual_seed(3)).to(device)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):  # padding keeps its random ids
        mask[row, :pad] = 0

    tokens, logits = _generate(model, cfg, ids, mask, new_tokens)
    for row, pad in enumerate(pads):
        alone = ids[row : row + 1, pad:]
        alone_tokens, alone_logits = _generate(model, cfg, alone, torch.ones_like(alone), new_tokens)
        assert torch.equal(tokens[row], alone_tokens[0]), f"row {row} (pad {pad})"
        torch.testing.assert_close(logits[row], alone_logits[0], atol=1e-4, rtol=1e-4, msg=f"row {row} (pad {pad})")


@pytest.mark.parametrize("mode", sorted(CASES))
def test_padded_rows_decode_like_the_rows_alone_with_a_small_budget(family, mode):
    _check_rows(family, mode)


@pytest.mark.parametrize("mode", sorted(CASES))
def test_the_same_on_the_device_kernels_interpreted(monkeypatch, mode):
    """The Triton path (block_select, fetch, decode attention; QUOKA scoring and chunk attention) in the
    interpreter: the padding rule of its kernels is the torch rule."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HF_NOSA_KERNELS", "triton")
    _check_rows("llama", mode, new_tokens=4, num_hidden_layers=1)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", sorted(CASES))
def test_the_same_on_gpu(family, mode):
    """Compiled kernels, fp32: block_select, fetch, decode attention, QUOKA scoring and chunk attention."""
    _check_rows(family, mode, device="cuda")
