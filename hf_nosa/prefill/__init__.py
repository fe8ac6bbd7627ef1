"""QUOKA prefill: which earlier blocks a prompt chunk attends to, and how it gets there.

``quoka`` chooses the blocks of one chunk (``quoka_select``); ``chunked`` is the prefill half of a NosaLayer
(``PrefillPaths``: a chunk's write to the host store, its selection, fetch and attention); ``whole_prompt`` runs a
prompt that goes through each layer whole as QUOKA chunks inside the layer (``quoka_chunks``). Below: ``attention``.
"""
