"""Work queued one step ahead on a side stream: host-to-device reads that hide behind the attention that uses them.

A dense-tail chunk reads the prompt from the host store a piece at a time (``attention.prefix``) and a QUOKA chunk
fetches its blocks over PCIe (``attention.pool``); the attention over piece i can run while piece i + 1 crosses
PCIe. ``read_ahead`` runs each read on a side stream one step ahead of its use: the current stream waits for a
read's event before its result is handed out, and the result's tensors are recorded on the current stream (they were
allocated on the side stream and are used and freed on the current one). On the CPU the reads run in order, inline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def read_ahead(reads: Sequence[Callable[[], tuple[torch.Tensor, ...]]], device: torch.device
               ) -> Iterator[tuple[torch.Tensor, ...]]:
    """The results of ``reads`` in order, each read issued while the caller works on the previous result.

    Everything the reads need must be queued on the current stream before the first result is asked for.
    """
    device = torch.device(device)
    if device.type != "cuda" or len(reads) < 2:
        for read in reads:
            yield read()
        return
    main = torch.cuda.current_stream(device)
    side = _STREAMS.get(device)
    if side is None:
        side = _STREAMS[device] = torch.cuda.Stream(device)
    side.wait_stream(main)

    def start(read):
        with torch.cuda.stream(side):
            result = read()
        return result, side.record_event()

    ahead = start(reads[0])
    for i in range(len(reads)):
        result, ready = ahead
        main.wait_event(ready)
        for t in result:
            t.record_stream(main)
        if i + 1 < len(reads):
            ahead = start(reads[i + 1])
        yield result
