"""Replaying a NOSA decode step from a CUDA graph.

transformers' ``generate`` captures CUDA graphs only through ``torch.compile`` with a compileable cache (static
shapes, no Python state), which NosaCache is not: its host store grows and its counters live in Python. Its
device-kernel decode path is, however, free of host syncs and reads the token index from the device, so the
whole model forward of one decode token can be captured by hand and replayed, with the cache's Python bookkeeping
run around each replay. ``DecodeGraph`` does that; ``greedy_decode`` is a small generation loop on top.

A graph is (re)captured when a layer's buffers move (the compressed keys grow to the next power of two of
windows, a beam reorder, a reset) or the batch changes; a step with the same key runs eagerly before a capture,
so kernels are compiled outside it (the first two steps after a prefill run eagerly). A left-padded batch
replays too: each row's padding length is a device tensor the kernels read (``hf_nosa.padding``). Limits: greedy
only in ``greedy_decode``; CUDA only.
"""

from __future__ import annotations

import inspect
from contextvars import ContextVar

import torch

_STOCK_FORWARD: ContextVar[bool] = ContextVar("hf_nosa_stock_forward", default=False)


class stock_forward:
    """Inside this context a NOSA model's forward is the stock one (``modeling.chunked`` steps aside), so a graph
    captures the plain decode forward rather than a replay of itself."""

    def __enter__(self):
        self._token = _STOCK_FORWARD.set(True)

    def __exit__(self, *exc):
        _STOCK_FORWARD.reset(self._token)


def in_stock_forward() -> bool:
    return _STOCK_FORWARD.get()


def cache_keyword(module: torch.nn.Module) -> str:
    """The name this transformers version gives the cache argument of ``module.forward``."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


class DecodeGraph:
    """One decode token of ``model`` with a NosaCache, captured once and replayed.

    Args:
        model: a NOSA causal LM (``hf_nosa.to_nosa``) on CUDA, in eval mode.
        cache: its NosaCache, after a prefill, on the device-kernel path (CUDA tensors, ``HF_NOSA_KERNELS`` not
            ``torch``).

    Call it with ``input_ids [B, 1]`` and ``position_ids [B, 1]`` (CUDA long); it returns ``[B, vocab]`` logits
    (a buffer the next call overwrites).
    """

    def __init__(self, model, cache):
        self.model, self.cache = model, cache
        self.graph: torch.cuda.CUDAGraph | None = None
        self.key = None
        self._eager_key = None
        self.captures = 0
        self.replays = 0
        self.capturing_failed: BaseException | None = None  # set when a capture raised (callers fall back)

    def _layers(self):
        return list(self.cache.layers)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if not input_ids.is_cuda or input_ids.shape[1] != 1 or position_ids.shape != input_ids.shape:
            raise ValueError("DecodeGraph takes CUDA input_ids and position_ids of shape [B, 1]")
        layers = self._layers()
        if not layers or not all(layer.is_initialized and layer.seen > 0 for layer in layers):
            raise ValueError("DecodeGraph needs a cache that went through a prefill (every layer initialised)")
        t = layers[0].seen
        for layer in layers:
            layer.prepare_fused_step(t)
        key = (tuple(input_ids.shape), tuple(layer.fused_graph_key() for layer in layers))
        if self.graph is None or key != self.key:
            if key != self._eager_key:
                # Run a step of this key eagerly first: it compiles every kernel variant the capture will launch
                # (compiling or loading a module while capturing is not allowed).
                self._eager_key = key
                return self._forward(input_ids, position_ids)
            self._capture(input_ids, position_ids, key)
        self.static_ids.copy_(input_ids)
        self.static_pos.copy_(position_ids)
        self.graph.replay()
        self.replays += 1
        for layer in layers:
            layer.finish_fused_step(t)
        return self.static_logits

    def _forward(self, input_ids, position_ids):
        with stock_forward():
            out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=True,
                             **{cache_keyword(self.model): self.cache})
        return out.logits[:, -1]

    def _capture(self, input_ids, position_ids, key) -> None:
        self.graph = None
        self.static_ids = input_ids.clone()
        self.static_pos = position_ids.clone()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        try:
            with torch.cuda.graph(graph):
                self.static_logits = self._forward(self.static_ids, self.static_pos)
        except RuntimeError as error:
            self.capturing_failed = error
            raise
        self.graph, self.key = graph, key
        self.captures += 1


@torch.no_grad()
def greedy_decode(model, cache, next_ids: torch.Tensor, steps: int, *, use_graph: bool = True) -> torch.Tensor:
    """Greedy decoding of ``steps`` tokens after a prefill, with ``DecodeGraph`` (or eagerly).

    Args:
        next_ids: ``[B, 1]`` the first token to feed (e.g. the argmax of the prefill's last logits).

    Returns:
        ``[B, steps]`` the tokens fed, ``next_ids`` first.
    """
    step = DecodeGraph(model, cache) if use_graph else None
    ids = next_ids
    fed = []
    for _ in range(steps):
        t = cache.get_seq_length()
        pos = torch.full_like(ids, t)
        fed.append(ids)
        if step is not None:
            logits = step(ids, pos)
        else:
            with stock_forward():
                out = model(input_ids=ids, position_ids=pos, use_cache=True, **{cache_keyword(model): cache})
            logits = out.logits[:, -1]
        ids = logits.argmax(-1, keepdim=True)
    return torch.cat(fed, 1)
