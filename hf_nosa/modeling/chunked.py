"""The causal LM forward of a NOSA model with a NosaCache: model-level chunked prefill and graph-replayed decode.

Prefill: a prompt longer than a chunk (``prefill_chunk_size`` tokens, the same at every batch, so a row's answer
never depends on its batch) goes through the whole model one chunk at a time (every layer finishes chunk i before
any layer sees chunk i + 1), so device memory holds the weights, the cache's working set and one chunk's
activations whatever the prompt length; logits are computed only where ``logits_to_keep`` asks. A new QUOKA prompt
of at most ``prefill_whole_prompt_tokens`` (rows x length) whose activations fit the device's free memory goes
through each layer whole instead, and the layers cut the same chunks (``whole_prompt``). A prompt that continues a
held sequence by more than ``decode_rule_tokens`` (a new turn of a conversation) is prefilled the same way from the
cache's length; its first chunk ends on a block boundary, so the later ones start on blocks as a new prompt's do.

Every call on a NosaCache is one turn (``NosaCache.turn``): one that raises part-way leaves the cache as it was.
Eviction heads are checked for NaN and inf before every prompt and new turn, whatever the cache.

Decode: a one-token step on CUDA replays a CUDA graph of the model's decode forward (``modeling.cuda_graph``),
captured once per shapes and buffers; caches built by ``generate(cache_implementation="nosa")`` draw their buffers
from the model's workspace, so the graph also survives from one generate call to the next. A cache with another
selector (``cache/selectors.py``) decodes eagerly: its selection state grows and is indexed from the host every block,
so its step is not one fixed graph. After a capture fails, the model decodes eagerly for good, whatever the cache (the
failure comes from the model's forward, so the next cache would fail the same way); each reason is logged once.

Left padding: a prompt whose rows start with padding (a 2D ``attention_mask`` with leading zeros) is sent through
with each row's real tokens moved to the front and its padding to the end (``padding.roll_rows``; ids, positions
and mask alike), and the cache is told each row's padding (``NosaCache.begin_prefill``). Every chunk boundary,
block, compressed window and sink block then falls where it would for the row alone, QUOKA's chunked selection
included, and the cache counts the row's later tokens from its first real one (``hf_nosa.rules.padding``). The outputs
are moved back: logits and hidden states come out at the positions the caller asked for, as the stock forward
would give them. Such a prompt goes through this path even when it fits one chunk. A 2D mask never reaches the
layers: the cache takes the prompt's padding from it, and each chunk runs with causal masking only (transformers
would expand the mask to ``[B, 1, chunk, context]`` bool in every chunk, 1.2 GB at 64K x 38).

Any other call (no NosaCache, or labels) runs the stock forward; output_attentions is refused by name.
"""

from __future__ import annotations

import inspect
import logging
import os

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..cache.graph_capture import GRAPH_ENV_VAR
from ..cache.nosa_cache import NosaCache
from ..kernels.backend import kernel_path
from ..rules.devices import available_device_memory, whole_prompt_bytes
from ..rules.padding import leading_padding, roll_rows
from .cuda_graph import DecodeGraph, cache_keyword, in_stock_forward

logger = logging.getLogger(__name__)
_OUTPUT_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class NosaForward:
    """Replaces ``model.forward`` of a converted causal LM (see the module docstring); keeps its signature."""

    def __init__(self, model: torch.nn.Module, original):
        self.model = model
        self.original = original
        self.__wrapped__ = original  # inspect.signature and generate's argument checks see the stock signature
        self._signature = inspect.signature(original)
        self.capture_failed: str | None = None  # why capturing a decode graph failed for this model (then eager)

    def __call__(self, *args, **kwargs):
        if in_stock_forward():
            return self.original(*args, **kwargs)
        if args:
            kwargs = dict(self._signature.bind_partial(*args, **kwargs).arguments)
            kwargs.update(kwargs.pop("kwargs", {}))
        if kwargs.get("output_attentions"):
            raise ValueError(
                "output_attentions=True is not supported by NOSA attention: it attends to a different set of blocks "
                "per KV head and step, and its kernels never form the attention matrix. Generate without "
                "output_attentions (or use the stock model when you need the weights)."
            )
        cache_name = "cache" if kwargs.get("cache") is not None else "past_key_values"
        cache = kwargs.get(cache_name)
        inputs = kwargs.get("input_ids")
        if inputs is None:
            inputs = kwargs.get("inputs_embeds")
        T = inputs.shape[1] if inputs is not None else 0
        if inputs is not None and T == 0:
            raise ValueError(f"{'input_ids' if kwargs.get('input_ids') is not None else 'inputs_embeds'} has no tokens "
                             f"(shape {tuple(inputs.shape)}): a NOSA model needs at least one token.")
        if not isinstance(cache, NosaCache):
            if hasattr(cache, "extend_read_and_write_indices"):  # continuous batching: checked when it starts
                return self.original(**kwargs)
            if cache is None or T != 1 or cache.get_seq_length() == 0:  # every prompt; decode steps follow one
                self._check_heads()
            return self.original(**kwargs)
        layers = getattr(self.model.config.get_text_config(decoder=True), "num_hidden_layers", None)
        if cache.state.n_layers is not None and layers is not None and cache.state.n_layers != layers:
            raise ValueError(
                f"NosaCache was built for {cache.state.n_layers} layers, but this model has {layers}: a cache belongs "
                "to one model. Build it from this model's config: NosaCache(model.config)."
            )
        cache._check_usable()
        past = cache.get_seq_length()
        if past == 0 or T != 1:
            self._check_heads()  # every prompt and every new turn: NaN heads would give NaN logits silently
        if inputs is None or kwargs.get("labels") is not None:
            return self.original(**kwargs)
        if past and T > cache.nosa_config.decode_rule_tokens:
            _check_continued(cache, kwargs.get("attention_mask"), T)
        with cache.turn():  # a call that raises part-way leaves the cache as it was before it
            if T == 1 and past > 0 and self._graph_eligible(cache, kwargs):
                return self._decode_with_graph(cache, cache_name, kwargs)
            lead = self._left_padding(cache, kwargs)
            continuing = past > 0 and T > cache.nosa_config.decode_rule_tokens
            if T <= cache.nosa_config.prefill_chunk() and lead is None and not continuing:
                return self.original(**kwargs)
            return self._chunked(cache, cache_name, kwargs, lead)

    def _check_heads(self) -> None:
        if torch.compiler.is_compiling():
            return
        from . import check_eviction_heads  # the package imports this module

        check_eviction_heads(self.model)

    @staticmethod
    def _left_padding(cache: NosaCache, kwargs: dict) -> torch.Tensor | None:
        """``[B]`` CPU long left padding of a new prompt's rows (one host read), or None when there is none to move:
        the cache holds tokens already, the mask is not a 2D padding mask, or the cache runs another selector
        (``cache/selectors.py``; those count from cache index 0)."""
        mask = kwargs.get("attention_mask")
        if cache.get_seq_length() != 0 or mask is None or mask.dim() != 2 or cache.has_selector:
            return None
        lead = leading_padding(mask).cpu()
        return lead if bool(lead.any()) else None

    # ----- prefill -----

    def _chunked(self, cache: NosaCache, cache_name: str, kwargs: dict, lead: torch.Tensor | None):
        model = self.model
        ids_name = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
        inputs = kwargs.pop(ids_name)
        B, T = inputs.shape[:2]
        past = cache.get_seq_length()
        C = cache.nosa_config.prefill_chunk()
        P = cache.nosa_config.block_size
        if (past == 0 and not cache.has_selector and cache.nosa_config.prefill_whole(B, T)
                and _whole_prompt_fits(model, inputs, B, T)):
            C = T  # through each layer whole: the layers cut QUOKA's chunks (whole_prompt)
        edges = chunk_edges(past, T, C, P, cache.nosa_config.prefill_dense_tail_tokens)
        position_ids = kwargs.pop("position_ids", None)
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=inputs.device).expand(B, T)
        attention_mask = kwargs.pop("attention_mask", None)
        keep = _kept_positions(kwargs.pop("logits_to_keep", 0), T)
        need = keep
        if lead is not None:  # real tokens first; row b's cache position j is then its position (j - lead[b]) mod T
            attention_mask = attention_mask[:, :T]
            inputs, position_ids, attention_mask = (roll_rows(x, lead, dim=1) for x in
                                                    (inputs, position_ids.expand(B, T), attention_mask))
            kept = keep.nonzero().flatten()
            moved = (kept[None, :] - lead[:, None]) % T  # [B, kept]
            need = torch.zeros(T, dtype=torch.bool)
            need[moved.flatten()] = True
        output_hidden = kwargs.get("output_hidden_states")
        return_dict = kwargs.pop("return_dict", True)
        kwargs.pop(cache_name)
        kwargs.pop("use_cache", None)
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        decoder_cache = cache_keyword(decoder)

        starting = past == 0 or T > cache.nosa_config.decode_rule_tokens  # a new prompt, or a new turn's
        if starting:
            padding = True  # a 4D mask of the caller's own goes to the layers chunk by chunk
            if attention_mask is None or attention_mask.dim() == 2:
                # The cache takes the padding from the 2D mask itself and the model runs without one: transformers
                # would expand it to [B, 1, chunk, context] in every chunk. One host read per prompt spares an
                # all-ones mask (generate's, unpadded) the padding work in every layer and chunk.
                padding = False
                if attention_mask is not None and not past and not bool(attention_mask.all()):
                    padding = attention_mask[:, :T].bool()
                attention_mask = None  # a continued prompt's has no padding (_check_continued)
            cache.begin_prefill(past + T, lead, padding=padding)
        hidden_parts, layer_states = [], []
        try:
            for a, b in zip(edges[:-1], edges[1:]):
                chunk = dict(kwargs)
                chunk[ids_name] = inputs[:, a:b]
                chunk["position_ids"] = position_ids[..., a:b]
                if attention_mask is not None:
                    chunk["attention_mask"] = (attention_mask[:, : past + b] if attention_mask.dim() == 2
                                               else attention_mask[..., a:b, : past + b])
                chunk[decoder_cache] = cache
                out = decoder(use_cache=True, **chunk)
                rows = need[a:b].nonzero().flatten()
                if rows.numel():
                    lo, hi = int(rows[0]), int(rows[-1]) + 1
                    hidden = out.last_hidden_state
                    # a run of positions (the usual case) is a view; only scattered ones need an index copy
                    hidden_parts.append(hidden[:, lo:hi] if hi - lo == rows.numel() else hidden[:, rows.to(hidden.device)])
                if output_hidden:
                    layer_states.append(out.hidden_states)
        finally:
            if starting:
                cache.end_prefill()
        hidden = torch.cat(hidden_parts, 1)
        if lead is not None:  # back to the caller's positions: row b's kept position j is need's (j - lead[b]) mod T
            slot = (torch.cumsum(need.long(), 0) - 1)[moved].to(hidden.device)  # [B, kept]
            hidden = hidden.gather(1, slot[..., None].expand(-1, -1, hidden.shape[-1]))
        logits = model.lm_head(hidden)
        hidden_states = None
        if output_hidden:
            hidden_states = tuple(torch.cat(parts, 1) for parts in zip(*layer_states))
            if lead is not None:
                hidden_states = tuple(roll_rows(h, -lead, dim=1) for h in hidden_states)
        result = CausalLMOutputWithPast(logits=logits, hidden_states=hidden_states, **{_OUTPUT_CACHE_FIELD: cache})
        return result if return_dict else result.to_tuple()

    # ----- decode -----

    def _graph_eligible(self, cache: NosaCache, kwargs: dict) -> bool:
        """Whether this one-token step replays a CUDA graph; a cache or model that cannot is logged once."""
        inputs = kwargs.get("input_ids")
        if not (
            inputs is not None
            and not self.model.training
            and not torch.is_grad_enabled()
            and not kwargs.get("output_hidden_states")
            and os.environ.get(GRAPH_ENV_VAR, "1") != "0"
            and _graph_device(inputs)
        ):
            return False
        if cache.has_selector:
            _log_eager_once(
                f"selector:{type(cache.selector).__name__}",
                "NOSA decode: a cache with the %s selector decodes eagerly, without a CUDA graph: its selection "
                "state grows and is indexed from the host as blocks fill, so its step is not one fixed graph.",
                type(cache.selector).__name__,
            )
            return False
        return self.capture_failed is None  # the failure was logged when it happened

    def _decode_with_graph(self, cache: NosaCache, cache_name: str, kwargs: dict):
        input_ids = kwargs["input_ids"]
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            position_ids = torch.full_like(input_ids, cache.get_seq_length())
        owner = cache.state.workspace if cache.state.workspace is not None else cache
        graph = getattr(owner, "decode_graph", None)
        if graph is None:
            graph = owner.decode_graph = DecodeGraph(self.model, cache)
        graph.cache = cache
        try:
            logits = graph(input_ids, position_ids.reshape(input_ids.shape)).clone()[:, None]  # [B, 1, vocab]
        except Exception as error:
            if graph.capturing_failed is not error:  # not a capture failure: a real error of the decode step
                raise
            owner.decode_graph = None  # _graph_eligible now sends every step of this model down the eager path
            self.capture_failed = f"{type(error).__name__}: {error}"
            logger.warning(
                "NOSA decode: capturing a CUDA graph failed (%s); this model decodes eagerly from now on, with "
                "every cache (set %s=0 to skip the capture).", self.capture_failed, GRAPH_ENV_VAR,
            )
            return self.original(**kwargs)
        result = CausalLMOutputWithPast(logits=logits, **{_OUTPUT_CACHE_FIELD: cache})
        return result if kwargs.get("return_dict", True) else result.to_tuple()


def chunk_edges(past: int, T: int, C: int, P: int, tail: int) -> list[int]:
    """Where a prompt of ``T`` tokens after ``past`` held ones is cut into QUOKA chunks: offsets ``0 .. T``.

    A new prompt's edges are at multiples of ``C``. A continued one's first chunk ends on a block boundary (the block
    it starts in, plus ``C - P`` tokens), so that its later chunks start on blocks as a new prompt's do; and a last
    chunk shorter than the dense tail (``tail`` tokens) and than a block joins the one before it, so that the tail's
    queries, which read every earlier token back from the host store, do it in one chunk rather than two (at the
    defaults, tail = block: always). A chunk then holds at most ``C + P - 1`` tokens with the block it starts in.
    """
    if not past:
        return [0, *range(C, T, C), T] if C < T else [0, T]
    first = min(T, C - past % P)
    edges = [0, *range(first, T, C), T] if first < T else [0, T]
    if len(edges) > 2 and T - edges[-2] < min(tail, P):
        del edges[-2]
    return edges


def _whole_prompt_fits(model, inputs: torch.Tensor, batch: int, length: int) -> bool:
    """Whether a whole prompt's activations fit the device's free memory now (its allocator's cache, the process's
    memory fraction and the device's free bytes counted), so the whole-prompt path never runs a prompt out of
    memory that chunks would fit. Always on the CPU (host memory is checked by the host store)."""
    if not inputs.is_cuda:
        return True
    available = available_device_memory(inputs.device)
    element_size = next(model.parameters()).element_size()
    return whole_prompt_bytes(model.config, batch, length, element_size) <= 0.8 * available


def _check_continued(cache: NosaCache, attention_mask: torch.Tensor | None, T: int) -> None:
    """A continued prompt (a new turn: more than ``decode_rule_tokens`` tokens on a cache holding a sequence) is
    prefilled from the cache's length in every row at once: rows must hold no left padding, and the new tokens none."""
    past = cache.get_seq_length()
    allowed = (f"continued prompts longer than NosaConfig.decode_rule_tokens={cache.nosa_config.decode_rule_tokens} "
               "are supported on caches without left padding. Keep one conversation per cache, or batch "
               "conversations of equal length.")
    if any(layer.is_initialized and layer.padded for layer in cache.layers):
        raise ValueError(f"{T} new tokens continue a left-padded batch on this NosaCache (rows of different "
                         f"lengths): {allowed}")
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask[:, -T:].all()):
        raise ValueError(f"A continued prompt ({T} new tokens on a NosaCache holding {past}) has padding in its "
                         f"attention_mask: {allowed}")


def _graph_device(inputs: torch.Tensor) -> bool:
    """Whether a decode step on ``inputs``' device can be captured: CUDA tensors on the device-kernel path."""
    return inputs.is_cuda and kernel_path("decode_step", inputs) == "triton"


_logged: set[str] = set()


def _log_eager_once(key: str, message: str, *args) -> None:
    """Log once per process why a decode step runs eagerly (as ``kernels.backend.log_fallback`` does for kernels)."""
    if key not in _logged:
        _logged.add(key)
        logger.warning(message, *args)


def _kept_positions(logits_to_keep, T: int) -> torch.Tensor:
    """``[T]`` bool on the CPU: the positions whose logits the caller asked for (transformers' convention)."""
    keep = torch.zeros(T, dtype=torch.bool)
    if isinstance(logits_to_keep, torch.Tensor):
        keep[logits_to_keep.cpu().long()] = True
    elif logits_to_keep == 0:
        keep[:] = True
    else:
        keep[-int(logits_to_keep):] = True
    return keep


def install_forward(model: torch.nn.Module) -> None:
    """Route ``model.forward`` through ``NosaForward`` (idempotent)."""
    if isinstance(model.__dict__.get("forward"), NosaForward):
        return
    model.forward = NosaForward(model, model.forward)
