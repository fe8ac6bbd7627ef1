"""``NosaBatchingManager``: transformers' ``ContinuousBatchingManager`` for a NOSA model, and ``enable(model)``.

The manager is transformers' own (request queue, background loop, ``add_request``, ``cancel_request``, ``get_result``,
streaming, ``generate_batch`` on top); it differs in three places:

- ``_create_batch_processor`` builds a ``NosaPagedCache`` (K/V in one NosaCache per request, a token ledger on the
  device) and a scheduler on NOSA's prefill chunk grid (``serving.scheduler``), in place of the stock cache and
  scheduler. Everything else (``ContinuousBatchProcessor``, its inputs and outputs, ``ModelRunner``) is stock;
- ``add_request`` refuses a request that could not fit the host (or device) budget even alone: it fails at once
  with a MemoryError naming its size, and the others run;
- the continuous-batching config is set for NOSA's per-request attention: no compile, no asynchronous batching,
  no decode fast path, no block sharing (each logged when the caller asked), and transformers' CUDA graphs off: on
  CUDA a decode step replays NOSA's own graph instead (``serving.step_graph``, on the runner's ``compute_batch``;
  ``use_cuda_graph=False`` turns it off);
- ``switch_to_cb_friendly_attn`` sets the model's attention implementation to ``"nosa_paged"`` for the session
  (restored by ``stop``, as transformers restores its own switch): NOSA layers never dispatch to an attention
  implementation, and with a name that is not eager / sdpa transformers' inputs build no
  ``[max_batch_tokens, ledger + max_batch_tokens]`` mask (allocated once and refilled every step). The name is
  registered in transformers' ``AttentionInterface`` (its public hook for custom attention) with a function that
  refuses to run: only a layer that is not NOSA's could reach it.

``enable(model)`` binds ``init_continuous_batching`` on the model instance to build this manager, so transformers'
own ``model.generate_batch``, ``model.init_continuous_batching`` and ``continuous_batching_context_manager`` (and
``transformers serve``, which calls them) run NOSA. Nothing of transformers is patched.
"""

from __future__ import annotations

import copy
import logging
import types

from transformers import AttentionInterface
from transformers.generation.configuration_utils import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching import continuous_api
from transformers.generation.continuous_batching.continuous_api import (
    ContinuousBatchingManager,
    ContinuousBatchProcessor,
)
from transformers.generation.continuous_batching.initialization import update_cb_config_after_cache_creation
from transformers.generation.continuous_batching.requests import RequestState

from ..attention.eviction_head import check_eviction_heads
from ..config import NosaConfig
from .paged_cache import NosaPagedCache
from .requests import RequestCaches, ServingBudget
from .scheduler import NOSA_SCHEDULERS
from .step_graph import StepGraphs, step_graphs_wanted

logger = logging.getLogger(__name__)

# Tokens the device ledger holds (all requests together) when the caller sets no num_blocks: what the host budget
# admits, at most MAX_LEDGER_TOKENS (transformers keeps an int64 index buffer of that length on the device), or
# DEFAULT_LEDGER_TOKENS when the host budget is unknown (docs/serving.md).
DEFAULT_LEDGER_TOKENS = 1 << 20
MAX_LEDGER_TOKENS = 1 << 23
DEFAULT_MAX_BATCH_TOKENS = 8192  # transformers' PagedAttentionMemoryHandler._default_max_batch_tokens (5.18-5.25)

_FORCED = dict(use_cuda_graph=False, use_async_batching=False, varlen_compile_config=None,
               decode_compile_config=None, default_compile_level=0, max_blocks_per_request=0,
               allow_block_sharing=False)
_DEFAULTS_OF_FORCED = dict(use_cuda_graph=None, use_async_batching=None, varlen_compile_config=None,
                           decode_compile_config=None, default_compile_level=0, max_blocks_per_request=None,
                           allow_block_sharing=True)


NOSA_PAGED = "nosa_paged"  # the attention implementation a NOSA model runs under continuous batching


def _refuse_stock_attention(module, *args, **kwargs):
    raise TypeError(
        f"attention implementation {NOSA_PAGED!r} is set while a NOSA model runs under continuous batching, but a "
        f"layer that is not NOSA's ({type(module).__name__}) dispatched to it: convert the model with hf_nosa.to_nosa."
    )


def register_attention() -> None:
    """Register ``NOSA_PAGED`` in transformers' ``AttentionInterface`` (idempotent)."""
    AttentionInterface.register(NOSA_PAGED, _refuse_stock_attention)


def ledger_tokens(requests: RequestCaches) -> int:
    """Tokens the ledger holds when the caller sets no ``num_blocks``: what the host budget admits (capped)."""
    if requests.budget.host_bytes is None:
        return DEFAULT_LEDGER_TOKENS
    P = requests.nosa_config.block_size
    per_token = max(1, requests.host_bytes(P) // P)
    return max(P, min(requests.budget.host_bytes // per_token, MAX_LEDGER_TOKENS))


def nosa_batching_config(config: ContinuousBatchingConfig | None, chunk: int,
                         decode_rows: int = 0) -> ContinuousBatchingConfig:
    """A copy of ``config`` set for NOSA serving (see the module docstring), for QUOKA chunks of ``chunk`` tokens;
    the caller's is left as it was. Without ``num_blocks``, transformers sizes a one-block ledger and
    ``NosaPagedCache`` re-sizes it (``ledger_tokens``). Without ``max_batch_tokens``: transformers' default in whole
    chunks, plus a token for each of ``decode_rows`` requests decoding beside them. The scheduler cuts a prompt piece
    down to a chunk edge (``serving.scheduler``), so 8,192 tokens a step beside 21 decode tokens carried 6,144 prompt
    tokens: a quarter of the step's budget went unused in every step that had a prompt piece."""
    config = copy.deepcopy(config) if config is not None else ContinuousBatchingConfig()
    for name, value in _FORCED.items():
        given = getattr(config, name)
        if given != value and given != _DEFAULTS_OF_FORCED[name] and name != "use_cuda_graph":  # NOSA's own graphs
            logger.warning("NOSA serving: ContinuousBatchingConfig.%s=%r is not supported yet; using %r "
                           "(docs/serving.md).", name, given, value)
        setattr(config, name, value)
    if config.max_batch_tokens is None:  # transformers' default in whole chunks, and the decode tokens beside them
        config.max_batch_tokens = -(-DEFAULT_MAX_BATCH_TOKENS // chunk) * chunk + decode_rows
    if config.max_batch_tokens < chunk:
        raise ValueError(
            f"ContinuousBatchingConfig.max_batch_tokens={config.max_batch_tokens} is smaller than NosaConfig."
            f"prefill_chunk_size={chunk}: a prompt is scheduled a whole chunk at a time. Raise max_batch_tokens or "
            "lower prefill_chunk_size."
        )
    return config


class NosaBatchingManager(ContinuousBatchingManager):
    """transformers' continuous-batching manager for a NOSA model (see the module docstring).

    Args: those of ``ContinuousBatchingManager``, and keyword-only ``budget`` (``ServingBudget``: host and device
    bytes the requests may hold at once) and ``nosa_config`` (overrides the model's NosaConfig for every request).
    """

    def __init__(self, model, generation_config: GenerationConfig, continuous_batching_config=None,
                 workload_hints=None, *, budget: ServingBudget | None = None, nosa_config: NosaConfig | None = None):
        if not hasattr(model.model.layers[0].self_attn, "eviction_head"):
            raise ValueError("NosaBatchingManager needs a NOSA model: convert it first with hf_nosa.to_nosa(model).")
        returns = getattr(generation_config, "num_return_sequences", None) or 1
        if returns != 1:
            raise ValueError(
                f"NOSA serving: num_return_sequences={returns} is not supported yet (a request's NosaCache is not "
                "forked); send the prompt several times instead."
            )
        shard = getattr(model.model.layers[0].self_attn.eviction_head, "tensor_parallel", None)
        longest = (getattr(workload_hints, "max_prompt_length", 0) or 0) + (
            getattr(workload_hints, "max_generated_length", 0) or 0)
        chunk = NosaConfig.from_model_config(model.config, nosa_config).prefill_chunk()
        config = nosa_batching_config(continuous_batching_config, chunk, (budget or ServingBudget()).decode_rows)
        # the step's activations are kept free beside the requests' working sets (ServingBudget.resolved)
        step_requests = config.max_requests_per_batch or getattr(workload_hints, "num_requests", None)
        self.nosa_requests = RequestCaches(model.config, nosa_config, budget or ServingBudget(), model.dtype,
                                           model.device, rank_kv_heads=shard.hi - shard.lo if shard else None,
                                           expected_tokens=longest or None, step_tokens=config.max_batch_tokens,
                                           step_requests=step_requests)
        # on CUDA a decode step replays NOSA's graph (serving.step_graph) unless the caller turns graphs off
        use_cuda_graph = getattr(continuous_batching_config, "use_cuda_graph", None)
        self.nosa_step_graphs = (StepGraphs(self.nosa_requests)
                                 if step_graphs_wanted(model.device, use_cuda_graph) else None)
        self.nosa_ledger_tokens = None
        if config.num_blocks is None:
            self.nosa_ledger_tokens = ledger_tokens(self.nosa_requests)
            config.num_blocks = 1  # transformers' sizing sees one block; NosaPagedCache re-sizes the ledger
        super().__init__(model, generation_config, config, workload_hints)

    def switch_to_cb_friendly_attn(self, model, auto_switch_to_flash: bool = True) -> None:
        """Set the model's attention implementation to ``NOSA_PAGED`` for the session (module docstring)."""
        register_attention()
        if model.config._attn_implementation != NOSA_PAGED:
            original = model.config._attn_implementation
            model.set_attn_implementation(NOSA_PAGED)
            if self._original_attn_impl is None:
                self._original_attn_impl = original

    def add_request(self, input_ids: list[int], request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, record_timestamps: bool = False, eos_token_id=None,
                    **logit_processor_kwargs) -> str | None:
        """transformers' ``add_request``; a request that cannot fit the serving budget even alone fails at once
        (its output carries the MemoryError's message) instead of waiting forever."""
        if not self.is_tp_driver:
            return None
        if request_id is None:
            with self._request_lock:
                request_id = f"req_{self._request_counter}"
                self._request_counter += 1
        limit = self.generation_config.max_new_tokens if max_new_tokens is None else max_new_tokens
        try:
            self.nosa_requests.check_fits(request_id, len(input_ids), limit)
        except MemoryError as error:
            logger.error("%s", error)
            state = RequestState(request_id=request_id, initial_tokens=list(input_ids), max_new_tokens=limit,
                                 eos_token_id=eos_token_id if eos_token_id is not None else -1,
                                 streaming=streaming, record_timestamps=record_timestamps)
            self.output_router.fail_and_deliver(state, error)
            return request_id
        return super().add_request(input_ids, request_id=request_id, max_new_tokens=max_new_tokens,
                                   streaming=streaming, record_timestamps=record_timestamps,
                                   eos_token_id=eos_token_id, **logit_processor_kwargs)

    def _create_batch_processor(self) -> ContinuousBatchProcessor:
        """transformers' ``_create_batch_processor`` with NOSA's cache and scheduler."""
        batch_processor = getattr(self, "batch_processor", None)
        if isinstance(batch_processor, ContinuousBatchProcessor):
            batch_processor.reset()
            self._install_step_graphs(batch_processor)
            return batch_processor
        supports_logits_to_keep = getattr(self.model, "_supports_logits_to_keep", None)
        cache = NosaPagedCache(
            config=self.model.config.get_text_config(),
            continuous_batching_config=self.continuous_batching_config,
            device=self.model.device,
            distributed_helper=self.distributed_helper,
            dtype=self.model.dtype,
            model_supports_logits_to_keep=callable(supports_logits_to_keep) and supports_logits_to_keep(),
            requests=self.nosa_requests,
            ledger_tokens=self.nosa_ledger_tokens,
        )
        self._use_prefix_sharing = False
        update_cb_config_after_cache_creation(cb_config=self.continuous_batching_config, num_blocks=cache.num_blocks,
                                              max_batch_tokens=cache.max_batch_tokens)
        scheduler_type = self.continuous_batching_config.scheduler_type
        scheduler_cls = NOSA_SCHEDULERS.get(scheduler_type)
        if scheduler_cls is None:
            raise ValueError(f"NOSA serving: scheduler_type={scheduler_type!r} is not supported; allowed values are "
                             f"{sorted(NOSA_SCHEDULERS)}.")
        scheduler = scheduler_cls(cache=cache, safety_margin=self.continuous_batching_config.safety_margin,
                                  max_requests_per_batch=self.continuous_batching_config.max_requests_per_batch)
        scheduler.chunk_size = self.nosa_requests.nosa_config.prefill_chunk()
        processor = ContinuousBatchProcessor(
            cache=cache,
            config=self.model.config.get_text_config(),
            generation_config=self.generation_config,
            continuous_batching_config=self.continuous_batching_config,
            logit_processor=self.logit_processor,
            input_queue=self.input_queue if self.is_tp_driver else None,
            cancel_queue=self.cancel_queue if self.is_tp_driver else None,
            output_router=self.output_router,
            background_thread_status=self.background_thread_status,
            model_device=self.model.device,
            model_dtype=self.model.dtype,
            scheduler=scheduler,
            distributed_helper=self.distributed_helper,
        )
        self._install_step_graphs(processor)
        return processor

    def _install_step_graphs(self, processor: ContinuousBatchProcessor) -> None:
        graphs = getattr(self, "nosa_step_graphs", None)
        if graphs is not None:
            graphs.install(processor.model_runner)


def init_continuous_batching(model, generation_config: GenerationConfig | None = None,
                             continuous_batching_config: ContinuousBatchingConfig | None = None,
                             workload_hints=None, *, budget: ServingBudget | None = None,
                             nosa_config: NosaConfig | None = None) -> NosaBatchingManager:
    """transformers' ``init_continuous_batching`` for a NOSA model: a ``NosaBatchingManager`` (a manager kept by
    ``persistent_manager=True`` is reused, as in transformers)."""
    check_eviction_heads(model)  # once per manager: its steps skip the check the forward makes before every prompt
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if isinstance(cached, NosaBatchingManager):
        cached.switch_to_cb_friendly_attn(model)  # stop() switched the attention implementation back
        return cached
    generation_config = generation_config if generation_config is not None else model.generation_config
    if generation_config is None:
        raise ValueError("A GenerationConfig must be provided or set in the model.")
    if generation_config.eos_token_id is None:
        continuous_api.logger.warning("`eos_token_id` not set in GenerationConfig. Setting to -1 (disabled).")
        generation_config.eos_token_id = -1
    return NosaBatchingManager(model, generation_config, continuous_batching_config, workload_hints, budget=budget,
                               nosa_config=nosa_config)


def enable(model, *, budget: ServingBudget | None = None, nosa_config: NosaConfig | None = None):
    """Make transformers' continuous batching of ``model`` (a NOSA model) run NOSA: ``model.generate_batch``,
    ``model.init_continuous_batching`` and ``model.continuous_batching_context_manager`` then build a
    ``NosaBatchingManager`` with ``budget`` and ``nosa_config``. Binds one method on this instance; idempotent
    (a later call replaces the budget and config). Returns the model."""
    if not hasattr(model.model.layers[0].self_attn, "eviction_head"):
        raise ValueError("hf_nosa.serving.enable needs a NOSA model: convert it first with hf_nosa.to_nosa(model).")

    def _init(self, generation_config=None, continuous_batching_config=None, workload_hints=None):
        return init_continuous_batching(self, generation_config, continuous_batching_config, workload_hints,
                                        budget=budget, nosa_config=nosa_config)

    model.init_continuous_batching = types.MethodType(_init, model)
    return model
