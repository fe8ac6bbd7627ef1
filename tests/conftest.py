"""Tiny Llama / Qwen2 / Qwen3 models built from configs: the suite downloads nothing."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from hf_nosa import NosaConfig

COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16, "use_sliding_window": False}),
}


def tiny_model(family: str = "llama", seed: int = 0, attn: str = "sdpa", **overrides):
    """A random tiny causal LM of one family, fp32, eval mode."""
    config_cls, model_cls, extra = FAMILIES[family]
    config = config_cls(**{**COMMON, **extra, **overrides})
    config._attn_implementation = attn
    torch.manual_seed(seed)
    return model_cls(config).eval()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matrices: one thread is fastest, and keeps a module steady on a busy 2-core machine (``pytestmark =
    pytest.mark.usefixtures("one_thread")``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Windows that make small_nosa_config's budget bite: sink 1 + local 1 + query 1 + eviction 1 blocks of 16 tokens,
# far below the sequences the tests run.
SPARSE = dict(budget_tokens=64, query_tokens=16, sink_tokens=16, local_tokens=16)


def small_nosa_config(**overrides) -> NosaConfig:
    """Block 16, windows 8/4: every rule of the paper, at sizes a CPU test can afford."""
    base = dict(
        block_size=16,
        budget_tokens=128,
        query_tokens=32,
        sink_tokens=16,
        local_tokens=32,
        compress_kernel=8,
        compress_stride=4,
        prefill_chunk_size=512,
        prefill_whole_prompt_tokens=0,  # chunk by chunk through the model (tests/test_whole_prompt.py: each layer)
    )
    base.update(overrides)
    return NosaConfig(**base)


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def padded_batch(length: int = 40, pads=(0, 7, 20), seed: int = 0):
    """Random prompts ``[len(pads), length]``, row i left-padded by ``pads[i]`` tokens (id 0), and their mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (len(pads), length), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask



@pytest.fixture
def interpret(monkeypatch):
    """Device kernels on CPU tensors: the Triton interpreter, and the kernel path chosen over the torch one."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("HF_NOSA_KERNELS", "triton")


@pytest.fixture
def prompt_rotary_on_torch(monkeypatch):
    """With ``interpret``: the rotary embedding of a prompt or chunk (more than one token a row) on its torch
    reference, a decode step's still on the kernel. The kernel runs one program per token, about 30 ms each in the
    interpreter (most of an interpreted prompt's time), and is bitwise its reference for any per-row positions
    (tests/kernels/test_rotary.py); a prompt's rotary kernel inside a model stays covered by
    tests/kernels/test_decode_path.py::test_kernel_path_equals_torch_path_interpreted. Yields the token counts of the
    calls it took from the kernel to the reference (a test can assert the fixture was not idle)."""
    import hf_nosa.kernels.rotary as rotary

    chosen = rotary.inference_kernel_path
    prompts = []

    def path(name, q, *tensors):
        kernel = chosen(name, q, *tensors)
        if kernel == "triton" and q.dim() == 4 and q.shape[2] > 1:
            prompts.append(q.shape[2])
            return "torch"
        return kernel

    monkeypatch.setattr(rotary, "inference_kernel_path", path)
    yield prompts


@pytest.fixture(scope="session", autouse=True)
def started_early(request, tmp_path_factory):
    """Runs in fresh processes that start with the session instead of with their module: a test module may define
    ``start_early(tmp_path_factory)``, returning a ``subprocess.Popen``; it is called here when one of the module's
    tests is selected, and the module's fixtures wait for the process (``started_early[module.__name__]``). Such a
    run takes one core for itself, and most of the suite (the interpreted kernels, the modules on ``one_thread``)
    leaves the second core of the 2-core CI machine idle. A process still running at the session's end is killed."""
    started = {}
    for module in dict.fromkeys(getattr(item, "module", None) for item in request.session.items):
        start = getattr(module, "start_early", None)
        if callable(start):
            started[module.__name__] = start(tmp_path_factory)
    yield started
    for proc in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
