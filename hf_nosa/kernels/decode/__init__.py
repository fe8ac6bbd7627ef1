"""Kernels of a decode step: block scores and choice (``block_scores``), the fetch into the slot pool (``fetch``,
``fetch_copy``), the attention of one token over the pool (``decode_attention``); each beside its torch reference."""
