"""The NOSA rules in plain torch, and the data they pass: the specification every kernel and path is held against.

``selection`` (eviction scores, compressed keys, block scores, the choice of blocks, QUOKA's scores), ``attend``
(the reference attention over what a cache hands back), ``inputs`` (``AttentionInputs`` and the key sources it
names), ``masks`` (transformers' masks as additive fp32), ``padding`` (left padding counted out, row by row) and
``devices`` (small host tensors moved to the device without a sync). Imports only ``config``.
"""
