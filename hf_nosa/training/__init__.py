"""Retrofitting a stock checkpoint into a NOSA model: the run, its recipes, data and distillation.

``retrofit`` (``hf-nosa retrofit``: LoRA plus fully trained eviction heads), ``recipe`` (the YAML recipes),
``data`` (files or the built-in corpus, packed), ``distill`` (the KL term against the base model), ``allocator``
(the CUDA allocator's setting for a run). The attention a model trains with is ``hf_nosa.attention.training``.
"""
