"""Attention over what a NosaCache hands back, on the kernel that fits its shape, and the training attention.

``dispatch`` picks the path (``attend_cache_inputs``): ``dense`` (biased attention through sdpa or
``kernels.prefill.flash_biased``), ``pool`` (a QUOKA chunk over its slot-pool blocks), ``prefix`` (a dense tail over
a prompt read in pieces), ``read_ahead`` (host reads queued one step ahead). ``training`` is the attention a model
trains with (the decode rule for every query token), ``held_forward`` what it keeps for the recompute, and
``selection_loss`` the auxiliary loss that teaches the selection scores. ``eviction_head`` is the learned head
that scores every token once (and finds and checks a converted model's heads). Below: ``rules`` and ``kernels``.
"""
