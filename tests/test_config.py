import json

import pytest

from hf_nosa import NosaConfig, to_nosa

from .conftest import small_nosa_config, tiny_model


def test_defaults_follow_the_paper():
    cfg = NosaConfig()
    assert (cfg.block_size, cfg.budget_tokens, cfg.query_tokens) == (64, 4096, 1024)
    assert (cfg.sink_tokens, cfg.local_tokens, cfg.compress_kernel, cfg.compress_stride) == (64, 1024, 32, 16)
    assert cfg.budget_blocks == 64 and cfg.query_blocks == 16 and cfg.sink_blocks == 1 and cfg.local_blocks == 16


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("block_size", 48, "power of two"),
        ("block_size", 0, "power of two"),
        ("budget_tokens", 100, "multiple of block_size"),
        ("query_tokens", 1000, "multiple of block_size"),
        ("sink_tokens", -64, "multiple of block_size"),
        ("local_tokens", 65, "multiple of block_size"),
        ("budget_tokens", 1024, "sink_tokens + local_tokens + query_tokens"),
        ("compress_stride", 12, "power of two"),
        ("compress_kernel", 24, "multiple of compress_stride"),
        ("compress_kernel", 128, "block_size"),
        ("prefill", "sparse", "allowed values"),
        ("offload", "yes", "True or False"),
        ("budget_tokens", 4096.0, "integer"),
        ("prefill_budget_tokens", 100, "multiple of block_size"),
        ("quoka_queries", 0, "at least 1"),
        ("resident_margin", -0.5, "finite number >= 0"),
        ("resident_margin", float("inf"), "finite number >= 0"),
        ("resident_margin", True, "finite number >= 0"),
        ("resident_margin", "1", "finite number >= 0"),
    ],
)
def test_each_invalid_field_names_itself(field, value, words):
    with pytest.raises(ValueError) as info:
        NosaConfig(**{field: value})
    message = str(info.value)
    assert f"NosaConfig.{field}={value!r}" in message
    assert words in message


def test_round_trip_through_config_json(tmp_path):
    model = tiny_model("llama")
    cfg = small_nosa_config(prefill="nosa", offload=False, resident_margin=0.75)
    to_nosa(model, cfg)
    model.config.save_pretrained(tmp_path)
    section = json.loads((tmp_path / "config.json").read_text())["nosa"]
    assert NosaConfig.from_dict(section) == cfg
    reloaded = type(model.config).from_pretrained(tmp_path)
    assert NosaConfig.from_model_config(reloaded) == cfg


def test_unknown_key_is_an_error():
    with pytest.raises(ValueError, match="budget_token"):
        NosaConfig.from_dict({"budget_token": 128})


def test_replace_validates():
    cfg = small_nosa_config()
    assert cfg.replace(budget_tokens=256).budget_tokens == 256
    with pytest.raises(ValueError, match="budget_tokens"):
        cfg.replace(budget_tokens=17)
