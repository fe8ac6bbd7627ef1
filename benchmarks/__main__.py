"""``python -m benchmarks <suite> [<part>] [args]``: the benchmark suites a user runs, one name per area.

Each suite runs one script's ``main(argv)`` with the arguments after it (the script's own interface:
``python -m benchmarks generate --help``); a suite with several parts names them after the suite
(``python -m benchmarks prefill breakdown --context 65536``). Run from the repository root; results go where
``--out`` says (committed ones under docs/results/, indexed by docs/results/README.md). Most suites want CUDA;
``--smoke`` runs tiny shapes on the CPU where a script offers it.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class Suite:
    """A suite: what it measures (one line), its main script, and its other parts by name."""

    summary: str
    script: str
    parts: dict[str, tuple[str, str]] = field(default_factory=dict)  # part -> (script, one line)


TABLE = """\
generate             generate              model.generate end to end: stock caches against NOSA at their largest batches
generate memory      memory_census         what is live at the peak of NOSA generate, by allocation site
decode               decode_throughput     the graph-replayed decode engine's tok/s and GB/s beside the roofline
decode step          decode                decode tok/s, the default cache against a filled NosaCache (no prefill)
decode fetch         fetch_bandwidth       host-to-device block-fetch bandwidth (UVA gather, copies)
decode pinning       pinning               pinned host allocation rate: torch's default against cudaHostRegister
decode layers        layer_kernels         fused RMSNorm, rotary and SiLU-product kernels against the torch ops
prefill              prefill               time to the first token: QUOKA against dense sdpa by context, batch, chunk
prefill breakdown    prefill_breakdown     a NOSA prefill's GPU time by kernel kind, and its host syncs
prefill attention    dense_attention       biased attention against stock sdpa, alone and in a prefill
prefill ops          prefill_op_census     the source lines that issue a QUOKA chunk's aten ops (a CPU census)
prefill read         host_read_bandwidth   the dense tail's host-store reads: GB/s by path, blocks and warps
prefill fetch-bytes  quoka_fetch_bytes     blocks a QUOKA prefill fetches over PCIe per chunk (counts)
prefill score        quoka_score           QUOKA's block-scoring kernel at the shapes of a generate prefill
train                train_step            the retrofit step: NOSA's sparse attention against dense sdpa, by length
train breakdown      train_step_breakdown  a step's GPU time by kernel, idle gaps and launch sites
train memory         train_memory          a step's device memory event by event, with the allocator's message
train tiles          selection_tiles       the training selection per tile configuration of its kernels
train ties           selection_ties        whether the block-score kernel keeps the reference's exact ties
train retrofit       retrofit_profile      where the SmolLM2-135M retrofit's micro-step goes
serve                serve                 continuous batching (generate_batch), stock against NOSA
serve host           serve_host_work       a batched decode step's host work per layer (CPU, its kernels stubbed)
conversation         conversation          a new turn on a reused conversation cache against re-prefilling it
conversation stream  request_stream        batch-1 requests of different lengths, stock static + compile against NOSA
serve tp             tensor_parallel       1 GPU against N (tp_plan="auto", under torchrun): generate and generate_batch
"""  # suite [part], its script in benchmarks/, what it measures: columns 2+ spaces apart
SUITES: dict[str, Suite] = {}
for row in TABLE.splitlines():
    suite, script, summary = re.split(r"\s{2,}", row, maxsplit=2)
    name, _, part = suite.partition(" ")
    if part:
        SUITES[name].parts[part] = (script, summary)
    else:
        SUITES[name] = Suite(summary, script)


def usage() -> str:
    width = max(map(len, SUITES))
    lines = ["usage: python -m benchmarks <suite> [<part>] [args]   (<suite> --help: its arguments)", "", "suites:"]
    for name, suite in SUITES.items():
        lines.append(f"  {name:<{width}}  {suite.summary}")
        lines += [f"  {'':<{width}}    {part}: {summary}" for part, (_, summary) in suite.parts.items()]
    return "\n".join(lines)


def resolve(argv: list[str]) -> tuple[str, str | None, list[str]]:
    """(suite, part or None, the script's arguments) for ``argv`` = [suite, [part], args...]."""
    name, rest = argv[0], argv[1:]
    if name not in SUITES:
        raise SystemExit(f"python -m benchmarks: unknown suite {name!r}; allowed: {', '.join(SUITES)}")
    suite = SUITES[name]
    if rest and rest[0] in suite.parts:
        return name, rest[0], rest[1:]
    if rest and not rest[0].startswith("-") and suite.parts:
        raise SystemExit(f"python -m benchmarks {name}: unknown part {rest[0]!r}; allowed: {', '.join(suite.parts)} "
                         f"(or none, for {suite.script})")
    return name, None, rest


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, part, args = resolve(argv)
    suite = SUITES[name]
    prog = f"python -m benchmarks {name}" + (f" {part}" if part else "")
    if part is None and suite.parts and args[:1] in (["-h"], ["--help"]):
        print(f"{prog}: {suite.summary}\nparts: {', '.join(suite.parts)} ({prog} <part> --help)\n")
    module = importlib.import_module(f"benchmarks.{suite.parts[part][0] if part else suite.script}")
    saved = sys.argv
    sys.argv = [prog, *args]  # argparse's program name, and the command environment() records
    try:
        return module.main(args)
    finally:
        sys.argv = saved


if __name__ == "__main__":
    sys.exit(main())
