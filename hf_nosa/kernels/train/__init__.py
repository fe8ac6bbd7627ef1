"""Kernels of the training attention: the selection of every query token (``train_select``, ``selection_bitmap``)
and the block-sparse attention forward and backward (``sparse_train_attention`` with its plan, split and helpers)."""
