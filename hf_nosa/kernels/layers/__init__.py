"""A model layer's small ops in one launch each: the eviction head's scale (``eviction_bias``), RMSNorm
(``rms_norm``), rotary embedding (``rotary``) and the gated MLP's activation (``silu_mul``)."""
