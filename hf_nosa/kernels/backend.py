"""Which implementation of a kernel runs: Triton on CUDA tensors, the torch reference on CPU tensors.

``HF_NOSA_KERNELS=torch`` or ``HF_NOSA_KERNELS=triton`` forces one path (Triton on CPU tensors needs
``TRITON_INTERPRET=1``, which is how the tests run the kernels without a GPU). The path each kernel takes is logged
once per (kernel, path, device type); nothing switches path silently.

``TRITON_INTERPRET`` is read when a kernel is launched, not when this package is imported: ``launcher(kernel)``
returns the compiled kernel, or under the interpreter an interpreted twin of it that also runs every
``@triton.jit`` function it calls (ours and triton.language's) interpreted, so tests can turn the interpreter on
after ``import hf_nosa``.
"""

from __future__ import annotations

import logging
import math
import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    HAS_TRITON = True
except ImportError:  # triton ships for Linux only; the torch references cover the rest
    triton = tl = InterpretedFunction = JITFunction = None
    HAS_TRITON = False
try:  # private, used only to speed up the interpreter (tests on CPU); without it every helper call re-patches
    from triton.runtime.interpreter import _patch_lang
except ImportError:
    _patch_lang = None

logger = logging.getLogger("hf_nosa.kernels")

ENV_VAR = "HF_NOSA_KERNELS"
PATHS = ("torch", "triton")
_logged: set[tuple[str, str, str]] = set()
_interpreted: dict[int, object] = {}


def interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (``TRITON_INTERPRET=1``), read now."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def forced_path() -> str | None:
    """The path ``HF_NOSA_KERNELS`` forces, or None; any other value is a ValueError."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if not value:
        return None
    if value not in PATHS:
        raise ValueError(f"{ENV_VAR}={value!r} is invalid; allowed values are {PATHS} (or unset for automatic).")
    return value


def kernel_path(name: str, tensor: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"`` for kernel ``name`` on ``tensor``'s device; logs the choice once."""
    path = forced_path() or ("triton" if tensor.is_cuda else "torch")
    if path == "triton":
        if not HAS_TRITON:
            raise RuntimeError(f"{ENV_VAR}=triton (or a CUDA tensor) needs the triton package, which is not installed.")
        if not tensor.is_cuda and not interpreting():
            raise ValueError(
                f"{ENV_VAR}=triton with {tensor.device.type} tensors needs TRITON_INTERPRET=1 (the Triton interpreter); "
                f"set {ENV_VAR}=torch or unset it to use the torch reference there."
            )
    _log_once(name, path, tensor.device.type)
    return path


def inference_kernel_path(name: str, *tensors: torch.Tensor) -> str:
    """``kernel_path`` for a kernel with no backward: ``"torch"`` also where a gradient is wanted through any of
    ``tensors`` or while torch compiles (the reference is then the computation autograd and Dynamo trace)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "torch"
    if torch.compiler.is_compiling():
        return "torch"
    return kernel_path(name, tensors[0])


def _log_once(name: str, path: str, device_type: str) -> None:
    key = (name, path, device_type)
    if key not in _logged:
        _logged.add(key)
        logger.info("hf_nosa kernel %s: %s path on %s tensors", name, path, device_type)


def log_fallback(name: str, device_type: str, why: str) -> None:
    """Log once that ``name`` runs the torch reference on a device where Triton would be the default."""
    key = (name, "torch-fallback", device_type)
    if key not in _logged:
        _logged.add(key)
        logger.warning("hf_nosa kernel %s: torch reference on %s tensors because %s", name, device_type, why)


def launcher(kernel):
    """The kernel to launch now: compiled, or its interpreted twin when ``TRITON_INTERPRET=1``."""
    if not interpreting() or isinstance(kernel, InterpretedFunction):
        return kernel
    return _InterpretedLaunch(_twin(kernel))


def _twin(jit_fn):
    twin = _interpreted.get(id(jit_fn))
    if twin is None:
        twin = _interpreted[id(jit_fn)] = InterpretedFunction(jit_fn.fn)
    return twin


class _InterpretedLaunch:
    """``kernel[grid](...)`` in the interpreter, with every ``@triton.jit`` function it calls (our helpers and
    triton.language's own, compiled at import because the interpreter was off then) run interpreted too."""

    def __init__(self, twin):
        self.twin = twin

    def __getitem__(self, grid):
        run = self.twin[grid]

        def launch(*args, **kwargs):
            patched: set[int] = set()

            def call(fn, *a, **k):
                twin = _twin(fn)
                if _patch_lang is None:
                    return twin(*a, **k)
                if id(fn) not in patched:  # patching triton.language once per function and launch is enough
                    _patch_lang(twin.fn)
                    patched.add(id(fn))
                return twin.rewrite()(*a, **k)

            original = JITFunction.__call__
            JITFunction.__call__ = call
            try:
                return run(*args, **kwargs)
            finally:
                JITFunction.__call__ = original

        return launch


def on_device(tensor: torch.Tensor):
    """Context that makes ``tensor``'s GPU current, so a launch lands there (layers may sit on several GPUs)."""
    if tensor.is_cuda and tensor.device.index is not None and tensor.device.index != torch.cuda.current_device():
        return torch.cuda.device(tensor.device)
    return _NULL


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NULL = _Null()


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


_sm_count: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a fixed 8 elsewhere, for split heuristics under the interpreter)."""
    if device.type != "cuda":
        return 8
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_count:
        _sm_count[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_count[index]


_zeros: dict[tuple, torch.Tensor] = {}


def shared_zeros(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros of ``shape`` made once per (shape, dtype, device) and reused: for arguments a kernel only reads (a
    fill is one more launch in a prefill chunk's path, which at batch 1 is bound by launches). Never write to it."""
    key = (tuple(shape), dtype, torch.device(device))
    t = _zeros.get(key)
    if t is None:
        t = _zeros[key] = torch.zeros(shape, dtype=dtype, device=device)
    return t


def fastest_config(run, configs, device: torch.device, what: str, *, timed: bool = True) -> tuple:
    """The configuration of ``configs`` for which ``run(*config)`` is fastest on ``device`` (each compiled and run once
    first, then timed over 3 runs); with ``timed=False`` the first that fits, compiling no other. ``what`` names the
    kernel in the error when none fits the GPU."""
    from triton.runtime.errors import OutOfResources

    best, best_ms = None, math.inf
    for config in configs:
        try:
            run(*config)
        except OutOfResources:  # a configuration the GPU cannot hold (shared memory): skip it; other errors raise
            continue
        if not timed:
            return config
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            run(*config)
        stop.record()
        torch.cuda.synchronize(device)
        ms = start.elapsed_time(stop)
        if ms < best_ms:
            best, best_ms = config, ms
    if best is None:
        raise RuntimeError(f"{what}: no configuration of {configs} fits this GPU")
    return best


def tuned_run(run, configs, cache: dict, key: tuple, device: torch.device, what: str, *, config=None,
              interpreter_config=None, timed: bool = True) -> None:
    """``run(*config)`` with the given ``config``; else under the interpreter ``interpreter_config``; else the
    configuration ``fastest_config`` found on ``device`` for ``key`` (once per process, kept in ``cache``)."""
    if config is None and interpreting():
        config = interpreter_config
    if config is None:
        config = cache.get(key)
        if config is None:
            config = cache[key] = fastest_config(run, configs, device, what, timed=timed)
    run(*config)
