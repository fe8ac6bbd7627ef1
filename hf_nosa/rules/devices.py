"""Small host tensors (lengths, row masks, block lists) moved to the device without a host sync, the device memory
a process may still take, and what a forward's activations take of it (a whole prompt's, a serving step's).

Below the kernels and the attention paths, which all need them: a copy from pageable memory waits for the stream,
and in the middle of a layer that drains the queue of launches.
"""

from __future__ import annotations

import torch


def host_to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A small CPU tensor on ``device`` without a host sync: on CUDA through pinned memory, non-blocking (a copy from
    pageable memory waits for the stream, and in the middle of a layer that drains the queue of launches)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":  # only a CPU tensor can be pinned
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def available_device_memory(device) -> int:
    """Bytes this process may still allocate on a CUDA ``device``: the device's free bytes plus the allocator's
    cached ones, within the process' memory fraction (``torch.cuda.set_per_process_memory_fraction``, which
    ``torch.cuda.mem_get_info`` does not see: a server capped at 24 GB on an 80 GB card has 24 GB, not 76)."""
    device = torch.device(device)
    if device.index is None:  # "cuda" means the current device; the memory-fraction query wants an index
        device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    available = free + reserved - allocated
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    if fraction < 1.0:
        available = min(available, int(fraction * total) - allocated)
    return max(0, available)


# Tokens the MLP takes at a time where no gradient is wanted (``modeling.fused``): a prompt that goes through each
# layer whole would otherwise hold three [tokens, intermediate] activations, 12 GB at 4 x 64K in the 1b shape.
MLP_SLICE_TOKENS = 16384


def _text(config):
    """A model config's decoder text config (itself for a text model)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _dims(config) -> tuple[int, int, int, int]:
    """A model config's hidden size, query heads, KV heads and head dim."""
    text = _text(config)
    h, H, Hk = text.hidden_size, text.num_attention_heads, text.num_key_value_heads
    return h, H, Hk, getattr(text, "head_dim", None) or h // H


def whole_prompt_bytes(config, batch: int, length: int, element_size: int) -> int:
    """Device bytes a prompt that goes through each layer whole holds at once besides the weights and the cache: about
    six hidden-size tensors and the layer's queries, keys and values per token (the MLP runs in slices of
    ``MLP_SLICE_TOKENS`` tokens; about 26 KB a token in the 1b shape was measured, this gives 30)."""
    h, H, Hk, D = _dims(config)
    return batch * length * (6 * h + (H + 2 * Hk) * D) * element_size


def step_activation_bytes(config, tokens: int, element_size: int, logit_rows: int) -> int:
    """Device bytes the activations of one forward over ``tokens`` packed tokens take at their peak, besides the
    weights and the caches: per token about six hidden-size tensors (residual, normed input, attention output and
    its projection, the sums), the queries, keys and values and their rotated copies; the MLP's three intermediate-
    size tensors over at most ``MLP_SLICE_TOKENS`` tokens (it runs in slices beyond); and ``logit_rows`` rows of fp32
    logits (one per request of the step where the model keeps only the last token's). In the 1b shape at 8,192
    tokens: 1.23 GB (0.30 of them hidden-size and attention tensors, 0.40 the MLP, 0.53 the logits of 1,024 rows).
    A whole prompt's measured 26 KB a token in that shape (docs/results.md, ``whole_prompt_bytes``) is within the
    first term's 37 KB."""
    text = _text(config)
    h, H, Hk, D = _dims(text)
    per_token = 6 * h + 2 * (H + 2 * Hk) * D  # whole_prompt_bytes' tensors, and the rotated queries and keys
    mlp = 3 * text.intermediate_size * min(tokens, MLP_SLICE_TOKENS)
    logits = logit_rows * (h * element_size + text.vocab_size * 4)
    return (tokens * per_token + mlp) * element_size + logits
