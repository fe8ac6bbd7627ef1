"""NosaConfig: every knob of NOSA decoding and QUOKA prefill, validated and serialised into config.json."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, fields
from typing import Any

PREFILL_MODES = ("auto", "dense", "nosa", "quoka")
# "auto": the host store keeps K/V in the model's dtype; the others are hf_nosa.cache.host_quant's formats.
HOST_DTYPES = ("auto", "float8_e4m3fn", "int8")
_WARNED: set[str] = set()  # retired fields already warned about in this process


def _is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclass
class NosaConfig:
    """How NOSA selects and offloads KV blocks.

    Token counts are converted to blocks of ``block_size`` tokens. At each decode step a sequence attends to
    ``budget_tokens`` worth of blocks plus the block being written: the sink blocks, the local window, the
    ``query_tokens`` chosen by the current query (query-aware) and the rest chosen by the eviction head.

    ``prefill`` says how a NosaCache handles an update of several tokens (a prompt): "dense" attends to
    everything (the whole KV on the device), "nosa" applies the decode rule to every token, "quoka" runs the
    chunked QUOKA prefill (chunks of ``prefill_chunk_size`` tokens, each attending to ``prefill_budget_tokens``
    of blocks chosen by ``quoka_queries`` queries per head, plus itself), and "auto" (the default) is "dense"
    while the sequence fits in ``prefill_budget_tokens`` and "quoka" beyond. Under "quoka", the prompt's last
    ``prefill_dense_tail_tokens`` tokens attend to every earlier token instead (read from the host store a prefill
    budget at a time, so the device KV stays bounded; the prompt crosses PCIe once more): those queries give the
    first answer token and the keys decoding reads first. The other queries of their chunk keep QUOKA's blocks. 0:
    every chunk attends to its QUOKA blocks only.

    ``prefill_chunk_size`` (default 2048) fixes QUOKA's chunks per row: a prompt's chunks start at its first token
    (a continued one's at the cache's length, its first chunk ending on a block boundary), whatever the batch, so a
    row's tokens and logits never depend on the other rows of its batch. Longer chunks reach the first token sooner
    (every chunk costs the same fixed launches and fetches most of its budget again; on an H200 one 64K prompt took
    1.08 s in 2048-token chunks and 0.63 s in 4096-token ones, ``benchmarks/prefill.py``) and hold more activations
    per forward (rows x chunk tokens).

    ``prefill_batch_tokens`` and ``prefill_max_chunk_size`` are kept so that configs saved with them still load; they
    no longer change anything (they used to lengthen the chunks of small batches, which made a row's answer depend on
    its batch), and a value other than their old default is warned about.

    ``decode_rule_tokens`` (default 64): an update of at most this many tokens to a cache that holds a sequence (the
    candidates assisted decoding and prompt lookup verify) attends by the per-token decode rule, exactly as decoding
    the tokens one at a time would, reading the sequence's K/V back; a longer one (a new turn of a conversation) goes
    through the same chunked prefill as a new prompt, starting at the cache's length, with the device memory of a
    first prompt.

    ``prefill_whole_prompt_tokens`` (default 262144; 0: never) sends a new QUOKA prompt of at most that many tokens
    over the batch (rows x length) through each layer whole instead of through the whole model one chunk at a time:
    the layer cuts it into the same chunks, and each chunk attends to the same QUOKA blocks and dense tail, gathered
    from the layer's keys on the device instead of read back from the host store (``whole_prompt``). The device then
    holds one layer's K/V of the prompt and the prompt's activations (about 26 KB a token in the 1b shape, 7 GB at
    the default) for no PCIe reads, big GEMMs and a few launches per layer; longer prompts and bigger batches keep
    the chunk-by-chunk path and its bounded memory.

    ``host_dtype`` is how the host store keeps K and V: "auto" (the model's dtype), or "float8_e4m3fn" / "int8"
    with one fp32 scale per (block, KV head) (``hf_nosa.cache.host_quant``), which halves the host memory and the bytes
    a block fetch moves against bf16. Eviction scores and compressed keys stay in full precision.

    ``resident_margin`` (default 0: the paper's rule) makes decoding's query-aware choice sticky: a block selected at
    the previous step (one the device holds) competes with its query-aware score times ``1 + resident_margin``, so a
    new block must beat it by that factor to take its place. Consecutive steps then share more blocks (locality) and
    fetch fewer. It applies to decode steps only; training and prefill keep the stateless rule. On SmolLM2 at 8K with
    the shipped adapter, a margin of 1 lifted locality from 0.90 to 0.96 at the same perplexity (docs/results.md).

    Example:
        >>> cfg = NosaConfig(budget_tokens=2048, local_tokens=512)
        >>> cfg.budget_blocks
        32
    """

    block_size: int = 64
    budget_tokens: int = 4096
    query_tokens: int = 1024
    sink_tokens: int = 64
    local_tokens: int = 1024
    compress_kernel: int = 32
    compress_stride: int = 16
    prefill: str = "auto"
    offload: bool = True
    prefill_chunk_size: int = 2048
    quoka_queries: int = 16
    prefill_budget_tokens: int | None = None
    host_dtype: str = "auto"
    prefill_dense_tail_tokens: int = 64
    prefill_batch_tokens: int = 32768
    prefill_max_chunk_size: int = 4096
    prefill_whole_prompt_tokens: int = 262144
    resident_margin: float = 0.0
    decode_rule_tokens: int = 64

    def __post_init__(self):
        def fail(name: str, rule: str, fix: str = ""):
            value = getattr(self, name)
            message = f"NosaConfig.{name}={value!r} is invalid: {rule}."
            raise ValueError(message + (f" {fix}" if fix else ""))

        int_fields = (
            "block_size",
            "budget_tokens",
            "query_tokens",
            "sink_tokens",
            "local_tokens",
            "compress_kernel",
            "compress_stride",
            "prefill_chunk_size",
            "quoka_queries",
            "prefill_dense_tail_tokens",
            "prefill_batch_tokens",
            "prefill_max_chunk_size",
            "prefill_whole_prompt_tokens",
            "decode_rule_tokens",
        )
        for name in int_fields:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                fail(name, "it must be an integer")
        if not isinstance(self.offload, bool):
            fail("offload", "it must be True or False")
        if not _is_power_of_two(self.block_size):
            fail("block_size", "it must be a power of two (the paper uses 64)")
        for name in ("budget_tokens", "query_tokens", "sink_tokens", "local_tokens", "prefill_chunk_size",
                     "prefill_batch_tokens"):
            value = getattr(self, name)
            if value < 0 or value % self.block_size:
                fail(name, f"it must be a non-negative multiple of block_size={self.block_size}")
        if self.budget_tokens == 0:
            fail("budget_tokens", "it must be at least one block")
        if self.prefill_chunk_size == 0:
            fail("prefill_chunk_size", "it must be at least one block")
        if self.prefill_whole_prompt_tokens < 0:
            fail("prefill_whole_prompt_tokens", "it must be 0 (every prompt chunk by chunk) or a positive token count")
        if self.prefill_max_chunk_size <= 0 or self.prefill_max_chunk_size % self.block_size:
            fail("prefill_max_chunk_size", f"it must be a positive multiple of block_size={self.block_size}")
        needed = self.sink_tokens + self.local_tokens + self.query_tokens
        if self.budget_tokens < needed:
            fail(
                "budget_tokens",
                f"it must cover sink_tokens + local_tokens + query_tokens = {self.sink_tokens} + "
                f"{self.local_tokens} + {self.query_tokens} = {needed}",
                "Raise budget_tokens or lower one of the three.",
            )
        if not _is_power_of_two(self.compress_stride):
            fail("compress_stride", "it must be a power of two")
        if self.compress_kernel < self.compress_stride or self.compress_kernel % self.compress_stride:
            fail("compress_kernel", f"it must be a multiple of compress_stride={self.compress_stride}")
        if self.compress_kernel > self.block_size:
            fail("compress_kernel", f"it must not exceed block_size={self.block_size}")
        if not isinstance(self.prefill, str) or self.prefill not in PREFILL_MODES:
            fail("prefill", f"allowed values are {PREFILL_MODES}")
        if not isinstance(self.host_dtype, str) or self.host_dtype not in HOST_DTYPES:
            fail("host_dtype", f"allowed values are {HOST_DTYPES}")
        margin = self.resident_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin) or margin < 0:
            fail("resident_margin", "it must be a finite number >= 0 (0: the stateless NOSA rule)")
        if self.decode_rule_tokens < 0:
            fail("decode_rule_tokens", "it must be 0 (every update of several tokens is prefilled) or a positive "
                                       "number of tokens")
        for name, old_default in (("prefill_batch_tokens", 32768), ("prefill_max_chunk_size", 4096)):
            if getattr(self, name) != old_default and name not in _WARNED:
                _WARNED.add(name)  # once per process: every copy of a config (sized_for, replace) repeats the field
                warnings.warn(
                    f"NosaConfig.{name} no longer changes anything: QUOKA's chunks are fixed per row by "
                    "prefill_chunk_size, so that a row's answer does not depend on its batch. Set prefill_chunk_size "
                    "instead.", FutureWarning, stacklevel=3)
        if self.quoka_queries < 1:
            fail("quoka_queries", "it must be at least 1")
        if self.prefill_dense_tail_tokens < 0:
            fail("prefill_dense_tail_tokens", "it must be 0 (no dense tail) or a positive number of tokens")
        if self.prefill_budget_tokens is not None:
            if isinstance(self.prefill_budget_tokens, bool) or not isinstance(self.prefill_budget_tokens, int):
                fail("prefill_budget_tokens", "it must be an integer or None")
            if self.prefill_budget_tokens <= 0 or self.prefill_budget_tokens % self.block_size:
                fail("prefill_budget_tokens", f"it must be a positive multiple of block_size={self.block_size}")
            if self.prefill_budget_tokens < self.sink_tokens + self.local_tokens:
                fail(
                    "prefill_budget_tokens",
                    f"it must cover sink_tokens + local_tokens = {self.sink_tokens} + {self.local_tokens}",
                    "Raise it, or leave it None to use budget_tokens.",
                )

    def prefill_chunk(self, batch: int = 1) -> int:
        """Prompt tokens per QUOKA chunk: ``prefill_chunk_size`` at every batch (``batch`` is accepted for callers of
        the older rule and ignored: a row's chunks never depend on its batch)."""
        return self.prefill_chunk_size

    def prefill_whole(self, batch: int, length: int) -> bool:
        """Whether a new prompt of ``length`` tokens in ``batch`` rows goes through each layer whole (its QUOKA
        chunks cut inside the layer, ``whole_prompt``) rather than through the whole model one chunk at a time."""
        return (self.prefill_mode(length) == "quoka" and length > self.prefill_chunk(batch)
                and batch * length <= self.prefill_whole_prompt_tokens)

    # Blocks, the unit every rule works in.
    @property
    def budget_blocks(self) -> int:
        return self.budget_tokens // self.block_size

    @property
    def query_blocks(self) -> int:
        return self.query_tokens // self.block_size

    @property
    def sink_blocks(self) -> int:
        return self.sink_tokens // self.block_size

    @property
    def local_blocks(self) -> int:
        return self.local_tokens // self.block_size

    @property
    def prefill_budget_blocks(self) -> int:
        tokens = self.prefill_budget_tokens if self.prefill_budget_tokens is not None else self.budget_tokens
        return tokens // self.block_size

    def prefill_mode(self, n_tokens: int) -> str:
        """The prefill a NosaCache runs when an update brings the sequence to ``n_tokens``: "auto" resolved."""
        if self.prefill != "auto":
            return self.prefill
        return "dense" if n_tokens <= self.prefill_budget_blocks * self.block_size else "quoka"

    def sized_for(self, max_tokens: int) -> "NosaConfig":
        """This rule with the budgets cut to what a sequence of at most ``max_tokens`` tokens can use.

        While the budget covers every complete block, selection takes them all whatever the split, so the cut
        config selects exactly what this one does; it only keeps the device slot pool from outgrowing the
        sequence (``budget_tokens=1<<30`` on a 40-token prompt holds one block, not a billion tokens).
        """
        P = self.block_size
        cap = max(P, -(-int(max_tokens) // P) * P)
        if cap >= max(self.budget_tokens, self.prefill_budget_blocks * P):
            return self
        budget = min(self.budget_tokens, cap)
        sink = min(self.sink_tokens, budget)
        local = min(self.local_tokens, budget - sink)
        query = min(self.query_tokens, budget - sink - local)
        prefill_budget = self.prefill_budget_tokens
        if prefill_budget is not None:
            prefill_budget = max(min(prefill_budget, cap), sink + local)
        return self.replace(budget_tokens=budget, sink_tokens=sink, local_tokens=local, query_tokens=query,
                            prefill_budget_tokens=prefill_budget)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, **overrides: Any) -> "NosaConfig":
        """Build from a config.json "nosa" section; unknown keys are an error, never ignored."""
        merged = dict(data or {})
        merged.update(overrides)
        unknown = sorted(set(merged) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"Unknown NosaConfig field(s) {unknown}; allowed fields are {list(cls.field_names())}.")
        return cls(**merged)

    def replace(self, **overrides: Any) -> "NosaConfig":
        """A copy with some fields changed (validated like the original)."""
        return NosaConfig.from_dict(self.to_dict(), **overrides)

    @classmethod
    def from_model_config(cls, config: Any, nosa_config: "NosaConfig | None" = None) -> "NosaConfig":
        """The NosaConfig of a model: the explicit one, else its config.json "nosa" section, else the defaults."""
        if nosa_config is not None:
            if not isinstance(nosa_config, NosaConfig):
                raise TypeError(f"nosa_config must be a NosaConfig, got {type(nosa_config).__name__}")
            return nosa_config
        section = getattr(config, "nosa", None)
        if isinstance(section, NosaConfig):
            return section
        return cls.from_dict(section)

