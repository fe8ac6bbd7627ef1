"""A GGUF file's tokenizer is rebuilt once (about 10 s on a CPU) and read back from hf-nosa's cache afterwards: the
same class, tokens, special tokens and chat template."""

from __future__ import annotations

import copy

import pytest
from transformers import AutoTokenizer

from hf_nosa.modeling import loading
from hf_nosa.modeling.loading import DownloadError, load_tokenizer, packaged_gguf

pytest.importorskip("gguf", reason="the gguf package (pip install 'hf-nosa[gguf]') reads the GGUF file")

TEXTS = ["The pass key is 71432. Remember it.", "def f(x):\n    return x ** 2  # ünïcödé, 数字 123", ""]


def test_the_cached_tokenizer_equals_the_one_rebuilt_from_the_file(tmp_path, monkeypatch):
    try:
        path = packaged_gguf("smollm2")
    except DownloadError as error:  # no network and no cached copy
        pytest.skip(f"SmolLM2 GGUF unavailable: {error}")
    monkeypatch.setattr(loading, "gguf_tokenizer_dir", lambda: tmp_path / "tokenizers")
    # The reference is what transformers gives for the file: the rebuild load_tokenizer runs itself, recorded (a
    # copy, taken before load_tokenizer saves or touches it) instead of a second ~10 s rebuild of the same call.
    original, rebuilds = AutoTokenizer.from_pretrained, []

    def recording(*args, **kwargs):
        tok = original(*args, **kwargs)
        if "gguf_file" in kwargs:
            rebuilds.append((args, kwargs, copy.deepcopy(tok)))
        return tok

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", recording)
    first = load_tokenizer(path)  # rebuilt from the file, and saved
    assert len(rebuilds) == 1
    args, kwargs, rebuilt = rebuilds[0]
    assert args == (str(path.parent),) and kwargs == {"gguf_file": path.name}  # transformers' rebuild, as it is
    saved = list((tmp_path / "tokenizers").iterdir())
    assert len(saved) == 1 and (saved[0] / "tokenizer_config.json").is_file()
    cached = load_tokenizer(path)  # read back from the cache
    assert len(rebuilds) == 1  # not rebuilt again
    chat = [{"role": "user", "content": "What is the pass key?"}]
    for tok in (first, cached):
        assert type(tok) is type(rebuilt)
        assert tok(TEXTS)["input_ids"] == rebuilt(TEXTS)["input_ids"]
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
            rebuilt.bos_token_id, rebuilt.eos_token_id, rebuilt.pad_token_id)
        assert tok.chat_template == rebuilt.chat_template
        assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            rebuilt.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert len(list((tmp_path / "tokenizers").iterdir())) == 1
