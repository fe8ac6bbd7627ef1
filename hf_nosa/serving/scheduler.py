"""transformers' schedulers with a prompt's pieces cut on NOSA's prefill chunk grid.

transformers splits a prompt that does not fit the step's token budget at whatever the budget left
(``Scheduler._schedule_request``: ``request_tokens[:token_budget]``), so where a piece ends depends on the other
requests of the step. QUOKA selects per chunk of ``NosaConfig.prefill_chunk_size`` tokens, with chunk edges at
multiples of it from the request's first token (what ``generate`` does on the request alone): a piece that ended
inside a chunk would change the chunk's queries, hence its blocks and the request's answer. ``ChunkGridMixin``
rounds a split down to the last chunk edge the budget reaches; a prompt piece that reaches its prompt's end is kept
whole. When the budget left reaches no edge, the request is scheduled with no tokens this step and continues at the
next one (its place in the queue and its admission stay).

Each step also starts by clearing the cache's plan (``NosaPagedCache.begin_step``), so a plan is always the one of
the batch being built.
"""

from __future__ import annotations

from transformers.generation.continuous_batching.requests import RequestStatus
from transformers.generation.continuous_batching.scheduler import FIFOScheduler, PrefillFirstScheduler


class ChunkGridMixin:
    """Mixed into a transformers ``Scheduler``; ``chunk_size`` is set by the manager (``prefill_chunk_size``)."""

    chunk_size: int = 2048

    def aligned_budget(self, state, request_tokens: list[int], token_budget: int) -> int:
        """The token budget for this request, cut down to a chunk edge when its prompt would be split."""
        if state.status == RequestStatus.DECODING or len(request_tokens) <= token_budget:
            return token_budget
        done = state.position_offset
        edge = (done + token_budget) // self.chunk_size * self.chunk_size
        return max(0, edge - done)

    def _schedule_request(self, state, request_tokens, token_budget, request_ids_to_remove_from_waiting) -> None:
        token_budget = self.aligned_budget(state, request_tokens, token_budget)
        super()._schedule_request(state, request_tokens, token_budget, request_ids_to_remove_from_waiting)

    def _process_candidates(self, candidates, token_budget, cache_budget, request_ids_to_remove_from_waiting):
        self.cache.begin_step()
        return super()._process_candidates(candidates, token_budget, cache_budget, request_ids_to_remove_from_waiting)


class NosaFIFOScheduler(ChunkGridMixin, FIFOScheduler):
    """transformers' FIFO scheduler (decoding requests first) on NOSA's chunk grid."""


class NosaPrefillFirstScheduler(ChunkGridMixin, PrefillFirstScheduler):
    """transformers' prefill-first scheduler (split prompts first) on NOSA's chunk grid."""


NOSA_SCHEDULERS = {"fifo": NosaFIFOScheduler, "prefill_first": NosaPrefillFirstScheduler}
