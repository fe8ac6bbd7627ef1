"""Kernels of the QUOKA prefill: the choice of a chunk's blocks (``quoka_choice``, ``quoka_score``, ``quoka_top``),
its attention (``chunk_attention``, ``flash_biased``), the compressed keys' extension (``compress_extend``), the
previous chunk's move into the pool (``move_in``), host-store writes and reads (``host_write``, ``host_read``)."""
