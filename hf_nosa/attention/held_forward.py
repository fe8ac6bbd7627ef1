"""What a layer's NOSA training forward keeps for gradient checkpointing's recompute of it: the selection and the
attention's output.

Under non-reentrant gradient checkpointing (what ``hf-nosa retrofit`` and the recipes use) the backward reruns each
layer's forward to rebuild what its backward reads. The rerun sees bitwise the same inputs, so it would select the
same blocks and compute the same attention output: both are kept from the first forward instead (``HeldForward``)
and found again by a fingerprint of the inputs. On CUDA they wait in pinned host memory, copied out on a side
stream: every layer's are held from its forward to its backward, which at the step's peak (the loss, after the last
layer) is all of them, so on the device they would raise the peak. The backward runs the layers from the last to
the first; when one rerun takes its layer's tensors back, the layer registered before it starts copying back on
another side stream, so the next rerun finds them on the device.

When a forward may be rerun: it runs under saved-tensor hooks (non-reentrant checkpointing installs them) and not
inside a backward. A rerun runs inside the backward (``in_backward``), and only there is a held forward looked up.
Without hooks nothing is held: autograd keeps what the backward needs and nothing reruns (reentrant checkpointing
runs its first forward without gradients, so it takes this path as plain inference and its rerun selects anew).

Entries live exactly as long as the autograd node that holds them (``Hold``): nothing outlives its step.
"""

from __future__ import annotations

import functools
import weakref

import torch

from ..rules.selection import MASK_VALUE

# Values sampled from each of the query, the keys and the bias into the fingerprint, beside their sums.
FINGERPRINT_SAMPLES = 64


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread: a forward run now is a checkpoint's rerun
    (torch.utils.checkpoint asks the same function)."""
    return torch._C._current_graph_task_id() != -1


def _hooks_active() -> bool:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return True if top is None else top(False) is not None  # unknown: hold, which is only a cost if nothing reruns


def rerun_expected() -> bool:
    """Whether the backward may rerun a forward running now: saved-tensor hooks are active (non-reentrant gradient
    checkpointing's) and this is not itself a rerun."""
    return _hooks_active() and not in_backward()


@functools.lru_cache(maxsize=16)
def _sample_indices(numel: int, device: torch.device) -> torch.Tensor:
    """Where ``_samples`` reads a tensor of ``numel`` elements (row-major): made once per size and device, since
    every layer of a step has the same sizes and a few tiny launches per fingerprint leave the device waiting."""
    flat = torch.arange(FINGERPRINT_SAMPLES) * max(1, numel // FINGERPRINT_SAMPLES)
    return flat.clamp(max=max(0, numel - 1)).to(device)


def _samples(t: torch.Tensor) -> torch.Tensor:
    """``FINGERPRINT_SAMPLES`` values of ``t`` spread over its elements (row-major order), gathered in one launch
    without copying ``t``: ``take`` reads a strided tensor in place, where a reshape would copy a transposed query
    whole."""
    return torch.take(t, _sample_indices(t.numel(), t.device))


@torch.no_grad()
def fingerprint(query, key, bias, settings: tuple) -> tuple[tuple, torch.Tensor]:
    """What the selection and the attention are a function of, summarised: the settings and shapes (on the host)
    and, on the inputs' device, their sums and sampled values (``[6 + 3 * FINGERPRINT_SAMPLES]`` float64). A rerun
    sees bitwise the same inputs and finds its forward; another layer, step or batch differs in these numbers."""
    real = bias > MASK_VALUE / 2
    stats = torch.stack([query.sum(dtype=torch.float32), torch.linalg.vector_norm(query, 1, dtype=torch.float32),
                         key.sum(dtype=torch.float32), torch.linalg.vector_norm(key, 1, dtype=torch.float32),
                         torch.where(real, bias, 0.0).sum(dtype=torch.float32), real.sum().float()])
    numbers = torch.cat([stats, _samples(query).float(), _samples(key).float(), _samples(bias).float()]).double()
    meta = (str(query.device), tuple(query.shape), tuple(key.shape), *settings)
    return meta, numbers


_offload_streams: dict[int, torch.cuda.Stream] = {}
_upload_streams: dict[int, torch.cuda.Stream] = {}


def _stream(streams: dict, device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in streams:
        streams[index] = torch.cuda.Stream(device=index)
    return streams[index]


def _to_host(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event]:
    """Pinned host copies of CUDA ``tensors``, made on the offload stream after the work queued so far, and the
    event that marks them done."""
    device = tensors[0].device
    side = _stream(_offload_streams, device)
    side.wait_stream(torch.cuda.current_stream(device))
    # the same strides: one plain copy each way, and the rerun gets the layout the first forward's consumers had
    hosts = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=True) for t in tensors]
    with torch.cuda.stream(side):
        for host, t in zip(hosts, tensors):
            host.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    for t in tensors:
        t.record_stream(side)  # the device copy may be freed only once the side stream has read it
    return hosts, done


def _to_device(hosts: list[torch.Tensor], ready: torch.cuda.Event, device: torch.device, stream=None):
    """Device copies of pinned ``hosts`` (once ``ready``), made on ``stream`` (default: the current one); with a side
    stream, also the event after which the current stream may read them."""
    current = torch.cuda.current_stream(device)
    stream = stream or current
    outs = [torch.empty_strided(h.shape, h.stride(), dtype=h.dtype, device=device) for h in hosts]  # current pool
    if stream is not current:
        stream.wait_stream(current)  # the allocations are the current stream's: it may have used the memory just now
    stream.wait_event(ready)
    with torch.cuda.stream(stream):
        for out, host in zip(outs, hosts):
            out.copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    if stream is not current:
        for out in outs:
            out.record_stream(stream)
    return outs, done


class HeldForward:
    """One layer's forward of one step, held for its rerun: the selected block indices and, once the attention has
    run (``keep_output``), its output and log-sum-exp. Registered at creation, found by ``find`` in the rerun."""

    __slots__ = ("meta", "_numbers", "_numbers_ready", "_key", "_indices", "_outputs", "_host", "_host_ready",
                 "_prefetched", "__weakref__")

    def __init__(self, indices: torch.Tensor, meta: tuple, numbers: torch.Tensor):
        self.meta, self._key, self._outputs, self._prefetched = meta, None, None, None
        self._numbers_ready = None
        if numbers.is_cuda:  # read when a rerun looks it up: no host sync in the forward
            self._numbers = torch.empty(numbers.shape, dtype=numbers.dtype, pin_memory=True)
            self._numbers.copy_(numbers, non_blocking=True)
            self._numbers_ready = torch.cuda.Event()
            self._numbers_ready.record()
        else:
            self._numbers = numbers
        self._indices, self._host, self._host_ready = indices, None, None
        if indices.is_cuda:
            self._host, self._host_ready = _to_host([indices])
        _registry.append(weakref.ref(self))

    def key(self) -> tuple:
        if self._key is None:
            if self._numbers_ready is not None:
                self._numbers_ready.synchronize()
            self._key = (*self.meta, *self._numbers.tolist())
        return self._key

    def take_indices(self, device: torch.device) -> torch.Tensor:
        """The indices on ``device``: the first call hands over the device tensor (the forward that selected);
        later ones copy them back (the rerun)."""
        if self._indices is not None:
            indices = self._indices
            if self._host is not None:
                self._indices = None  # the host holds them from now on
            return indices
        copies = self._device_copies(device)
        if len(self._host) < 3:  # no output held: this was the last use of the copies
            self._prefetched = None
        return copies[0]

    def keep_output(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Hold the attention's output and log-sum-exp for the rerun (copies: the caller's tensors stay its own)."""
        if out.is_cuda:
            hosts, ready = _to_host([out, lse])
            self._host, self._host_ready = [self._host[0], *hosts], ready
        else:
            self._outputs = (out.clone(), lse.clone())

    def output(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The held ``(out, lse)`` on ``device`` (fresh tensors), or None if the forward kept none."""
        if self._outputs is not None:
            return self._outputs[0].clone(), self._outputs[1].clone()
        if self._host is None or len(self._host) < 3:
            return None
        copies = self._device_copies(device)
        self._prefetched = None  # the rerun owns them now (the host copies stay, for a second backward)
        return copies[1], copies[2]

    def _device_copies(self, device: torch.device) -> list[torch.Tensor]:
        """Everything held, back on ``device``: prefetched by the rerun of the layer after it, or copied now. Then the
        layer registered before this one starts its copies on the upload stream."""
        if self._prefetched is None:
            self._prefetched = _to_device(self._host, self._host_ready, device)
        copies, done = self._prefetched
        torch.cuda.current_stream(device).wait_event(done)
        _prefetch_before(self, device)
        return copies

    def prefetch(self, device: torch.device) -> None:
        if self._prefetched is None and self._host is not None and self._indices is None:
            self._prefetched = _to_device(self._host, self._host_ready, device, _stream(_upload_streams, device))


# Every live HeldForward in the order of registration (the layers' order within a step).
_registry: list[weakref.ref] = []


def live() -> list[HeldForward]:
    """The held forwards still alive (their step's backward has not passed them), oldest first."""
    _registry[:] = [ref for ref in _registry if ref() is not None]
    return [held for held in (ref() for ref in _registry) if held is not None]


def find(meta: tuple, numbers: torch.Tensor) -> HeldForward | None:
    """The held forward with this fingerprint (one host sync), or None."""
    candidates = [held for held in live() if held.meta == meta]
    if not candidates:
        return None
    key = (*meta, *numbers.tolist())
    return next((held for held in reversed(candidates) if held.key() == key), None)


def _prefetch_before(held: HeldForward, device: torch.device) -> None:
    """Start copying back the forward registered just before ``held`` with the same settings (the backward's next
    rerun, one layer down)."""
    entries = live()
    index = next((i for i, h in enumerate(entries) if h is held), None)
    for earlier in reversed(entries[:index] if index is not None else []):
        if earlier.meta == held.meta:
            earlier.prefetch(device)
            return


class Hold(torch.autograd.Function):
    """Identity on the queries whose graph node keeps a ``HeldForward`` alive until the backward passes it."""

    @staticmethod
    def forward(ctx, query, held):
        ctx.held = held
        return query.view_as(query)

    @staticmethod
    def backward(ctx, grad):
        return grad, None
