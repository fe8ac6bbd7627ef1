"""How fast pinned host memory is allocated, with torch's default pinned allocator and with its host-register mode.

A NosaCache pins its whole host store up front (78 GiB for 38 sequences of 64K tokens in the 1b shape), and the
first ``generate`` call at a new shape pays for it: ``first_call_s`` in ``docs/results/2026-12-03_generate_64k.json``
is 94 s for a warm-up call that stops after 8 tokens, whose prefill alone takes about 45 s. torch allocates pinned memory with ``cudaHostAlloc`` by default; with
``PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:N`` it allocates pageable
memory and registers it with ``cudaHostRegister`` from N threads. Each setting runs in its own process (the
setting is read when CUDA starts; ``host_register_16_runtime`` sets it from Python after CUDA started instead, as a
library could): GB/s for ``--gib`` GiB in chunks of ``--chunk-mib`` MiB (the host store's own
chunking), the memory touched once after allocation (as the store's first write does).

    python -m benchmarks decode pinning --gib 16 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SETTINGS = {
    "default": None,
    "host_register_8": "pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
    "host_register_16": "pinned_use_cuda_host_register:True,pinned_num_register_threads:16",
    # the same, set from Python after CUDA started (what a library could do without the user's environment)
    "host_register_16_runtime": "pinned_use_cuda_host_register:True,pinned_num_register_threads:16",
}
RUNTIME = "_runtime"


def one_run(gib: float, chunk_mib: int, runtime_conf: str | None = None) -> dict:
    import torch

    torch.cuda.init()
    if runtime_conf:
        torch.cuda.memory._set_allocator_settings(runtime_conf)
    n_chunks = max(1, int(gib * 1024 / chunk_mib))
    start = time.perf_counter()
    chunks = [torch.empty(chunk_mib << 20, dtype=torch.uint8, pin_memory=True) for _ in range(n_chunks)]
    allocated = time.perf_counter() - start
    for chunk in chunks:
        chunk.fill_(1)
    touched = time.perf_counter() - start
    pinned = all(chunk.is_pinned() for chunk in chunks)
    size = n_chunks * (chunk_mib << 20)
    return dict(bytes=size, allocate_s=allocated, allocate_GBps=size / allocated / 1e9, touched_s=touched,
                pinned=pinned)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=16.0)
    parser.add_argument("--chunk-mib", type=int, default=256)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process of one setting
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.one is not None:
        runtime_conf = SETTINGS[args.one] if args.one.endswith(RUNTIME) else None
        print(json.dumps(one_run(args.gib, args.chunk_mib, runtime_conf)))
        return 0
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.environment import environment

    result = dict(environment(), gib=args.gib, chunk_mib=args.chunk_mib, rows=[])
    for name in args.settings.split(","):
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if SETTINGS[name] and not name.endswith(RUNTIME):
            env["PYTORCH_CUDA_ALLOC_CONF"] = SETTINGS[name]
        out = subprocess.run([sys.executable, __file__, "--one", name, "--gib", str(args.gib), "--chunk-mib",
                              str(args.chunk_mib)], env=env, capture_output=True, text=True, timeout=600)
        row = dict(setting=name, alloc_conf=SETTINGS[name])
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        row.update(json.loads(lines[-1]) if lines else dict(error=out.stderr[-500:]))
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "pinning.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
