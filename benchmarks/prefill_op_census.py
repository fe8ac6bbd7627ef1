"""Which source lines issue which aten ops in one QUOKA prefill chunk and layer (CPU census of launches).

At batch 1 the GPU prefill is bound by the host launching kernels, so the number of ops a QUOKA chunk issues per
layer sets its time. This builds a Llama with the 1b shape's per-layer sizes (hidden 2048, MLP 8192, 32 query / 8 KV
heads, head dim 64) but few layers and a small vocabulary, converts it with ``to_nosa`` (NosaConfig defaults, random
nonzero eviction heads as ``prefill_breakdown.py`` has them), and runs ``generate(cache_implementation="nosa",
max_new_tokens=1)`` on a random prompt longer than the prefill budget. A ``TorchDispatchMode`` sees every aten op
while a decoder layer runs; each op is attributed to the innermost ``hf_nosa``/``transformers`` ``file:line`` on the
Python stack and to a phase (the innermost of: selection, fetch_move_in, fetch, host_write, compressed_keys,
eviction_head, attention, quoka_inputs, cache_other; else model_layer). Only the layers of QUOKA chunks
(``_quoka_inputs`` ran, not the dense tail) are summarised, as ops per chunk and layer.

Kinds: ``kernel`` (a GPU launch on CUDA), ``metadata`` (views, ``empty``, ``detach``: no launch; excluded from
launches), ``sync`` (``item``/``nonzero``-like: a launch that also waits for the GPU), ``host_side`` (ops at sites
whose tensors stay on the CPU under CUDA too, ``HOST_SIDE``: no launch, no sync). By default the Triton kernels
run in the interpreter (``HF_NOSA_KERNELS=triton TRITON_INTERPRET=1``, the CUDA path's code) and each counts as one
``triton:<kernel>`` launch, the ops the interpreter itself issues not counted (``flash_biased`` is counted the same
way but computed by its torch reference: interpreted, it would take minutes per layer, and so are the decoder
layer's RMSNorm, rotary and SiLU-product kernels); ``--kernels torch`` counts the CPU
torch references instead. What CPU runs cannot show: a host-to-device ``.to(device)`` is no op on the CPU; the
lower-right causal mask is an explicit mask here (``_causal``: a few ops) where CUDA passes a ``CausalBias``.

    OMP_NUM_THREADS=1 python -m benchmarks prefill ops --context 6144 --batch 1
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import linecache
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PHASES = [  # (phase, file relative to its package, function or None for any): the innermost match on the stack
    ("selection", "hf_nosa/prefill/chunked.py", "quoka_select"),
    ("fetch_move_in", "hf_nosa/prefill/chunked.py", "_move_in_previous_chunk"),
    ("fetch", "hf_nosa/prefill/chunked.py", "fetch"),
    ("fetch", "hf_nosa/kernels/decode/fetch.py", "fetch_selection"),
    ("host_write", "hf_nosa/prefill/chunked.py", "write_to_host"),
    ("compressed_keys", "hf_nosa/cache/compressed_keys.py", None),
    ("eviction_head", "hf_nosa/modeling/attention.py", "forward"),
    ("attention", "hf_nosa/attention/dispatch.py", "attend_cache_inputs"),
    ("quoka_inputs", "hf_nosa/prefill/chunked.py", "_quoka_inputs"),
    ("cache_other", "hf_nosa/cache/nosa_cache.py", "update"),
]
METADATA = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "detach", "alias", "lift_fresh",
            "set_", "resize_", "_reshape_alias", "_unsafe_view"}
# (file, function, text of the line or None): sites whose tensors are CPU tensors on CUDA too (no launch, no sync)
HOST_SIDE = [("hf_nosa/prefill/chunked.py", "_first_tail_query", None), ("hf_nosa/cache/host_store.py", None, None),
             ("hf_nosa/rules/selection.py", "window_offsets", None),  # called without a device by quoka_score's launch
             ("hf_nosa/kernels/prefill/quoka_score.py", "_launch", "int(offsets[0])")]
SYNC = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "is_nonzero", "equal"}


def op_kind(func) -> str:
    name = func._schema.name.split("::")[-1]
    if name in SYNC:
        return "sync"
    returns = func._schema.returns
    views = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
    return "metadata" if name in METADATA or views else "kernel"


class Census(TorchDispatchMode):
    """Counts ``(chunk, layer, site, op, kind, phase)`` while ``self.where`` (set by the hooks) is not None."""

    def __init__(self, roots: dict[str, str]):
        super().__init__()
        self.roots = roots  # package name -> its directory
        self.where = None  # (chunk, layer index or None for outside the layers)
        self.paused = 0
        self.counts: dict[tuple, Counter] = defaultdict(Counter)
        self._rel: dict[str, str | None] = {}

    def rel(self, filename: str) -> str | None:
        if filename not in self._rel:
            self._rel[filename] = None
            for pkg, root in self.roots.items():
                if filename.startswith(root + os.sep):
                    self._rel[filename] = pkg + "/" + os.path.relpath(filename, root)
        return self._rel[filename]

    def note(self, op: str, kind: str):
        site, phase, frame = None, None, sys._getframe(2)
        while frame is not None and (site is None or phase is None):
            rel, fn = self.rel(frame.f_code.co_filename), frame.f_code.co_name
            if rel is not None and site is None:
                site = f"{rel}:{frame.f_lineno} ({fn})"
                if kind != "metadata" and any(rel == f and g in (None, fn) and (t is None or t in linecache.getline(
                        frame.f_code.co_filename, frame.f_lineno)) for f, g, t in HOST_SIDE):
                    kind = "host_side"
            if rel is not None and phase is None:
                phase = next((name for name, f, g in PHASES if rel == f and g in (None, fn)), None)
            frame = frame.f_back
        self.counts[self.where][(site or "?", op, kind, phase or "model_layer")] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.where is not None and not self.paused:
            self.note(func._schema.name.replace("::", "."), op_kind(func))
        return func(*args, **(kwargs or {}))


def hook(model, census: Census, quoka: dict):
    """Hooks that set ``census.where``, note QUOKA chunk-layers (but the first chunk's) and count each interpreted
    Triton launch as one op."""
    decoder = model.model
    chunk = [-1]

    def pre_decoder(*_):
        chunk[0] += 1
        census.where = (chunk[0], None)

    decoder.register_forward_pre_hook(pre_decoder)
    decoder.register_forward_hook(lambda *_: setattr(census, "where", None))
    for i, layer in enumerate(decoder.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: setattr(census, "where", (chunk[0], i)))
        layer.register_forward_hook(lambda *_: setattr(census, "where", (chunk[0], None)))

    from hf_nosa.prefill.chunked import PrefillPaths

    original = PrefillPaths._quoka_inputs

    def quoka_inputs(self, *args, **kwargs):
        if self.seen > 0:  # the first chunk has no earlier blocks: no selection, no fetch
            quoka[census.where] = self.seen
        return original(self, *args, **kwargs)

    PrefillPaths._quoka_inputs = quoka_inputs
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime.interpreter import InterpretedFunction

    interpreted_run = InterpretedFunction.run  # every interpreted launch, through launcher() or not

    def run(self, *a, **k):
        if census.where is not None and not census.paused:
            census.note("triton:" + self.fn.__name__, "kernel")
        census.paused += 1  # the interpreter's own copies of the arguments are no launches
        try:
            return interpreted_run(self, *a, **k)
        finally:
            census.paused -= 1

    InterpretedFunction.run = run

    # flash_biased interpreted over a QUOKA chunk (512 queries x 4.6K keys in 32 x 32 tiles) takes minutes per
    # layer: count its launch, compute its result with the torch reference (what the tests hold it to).
    from hf_nosa.kernels.prefill import flash_biased as flash_module

    def reference_launch(query, keys, values, bias, scale, q_offset, causal, out, config=None, prefix=None, lse=None):
        if census.where is not None and not census.paused:
            census.note("triton:_flash_biased_kernel", "kernel")
        census.paused += 1
        try:
            kw = dict(q_offset=q_offset, causal=causal, prefix=prefix)
            out.copy_(flash_module.flash_biased_ref(query, keys, values, bias, scale, **kw))
            if lse is not None:
                lse.copy_(flash_module.flash_biased_lse_ref(query, keys, values, bias, scale, **kw))
        finally:
            census.paused -= 1

    flash_module._launch = reference_launch

    # The decoder layer's elementwise kernels (RMSNorm, rotary, SiLU product) over a whole chunk are thousands of
    # interpreted programs: count each launch once and compute its result with the torch reference (bitwise or
    # within float32's last bits of it, see the kernels' tests).
    # the modules by name: hf_nosa.kernels re-exports functions named like two of them
    norm_module, rotary_module, silu_module = (importlib.import_module("hf_nosa.kernels." + name)
                                               for name in ("rms_norm", "rotary", "silu_mul"))

    def counted(name, reference):
        def launch(*a):
            if census.where is not None and not census.paused:
                census.note("triton:" + name, "kernel")
            census.paused += 1
            try:
                return reference(*a)
            finally:
                census.paused -= 1

        return launch

    norm_module._launch = counted("_rms_norm_kernel", norm_module.rms_norm_ref)
    rotary_module._launch = counted("_rotary_kernel", rotary_module.apply_rotary_ref)
    silu_module._launch = counted("_silu_mul_kernel", silu_module.silu_mul_ref)


def summarize(counts: dict, keys: list, top: int) -> dict:
    n = max(1, len(keys))
    total = Counter()
    for key in keys:
        total.update(counts[key])
    per = lambda c: round(c / n, 2)  # noqa: E731
    kinds, phases, ops, sites = Counter(), defaultdict(Counter), defaultdict(Counter), defaultdict(Counter)
    site_ops = defaultdict(Counter)
    for (site, op, kind, phase), c in total.items():
        kinds[kind] += c
        phases[phase][kind] += c
        ops[op][kind] += c
        sites[site][kind] += c
        sites[site]["phase:" + phase] += c
        site_ops[site][op] += c
    launches = lambda c: c["kernel"] + c["sync"]  # noqa: E731
    functions = Counter()
    for site, c in sites.items():
        functions[site.split(":")[0] + " (" + site.split("(")[-1]] += launches(c)
    site_rows = sorted(sites.items(), key=lambda kv: -(launches(kv[1]) * 1e6 + sum(kv[1].values())))
    return dict(
        chunk_layers=n, all_ops=per(sum(kinds.values())), launches=per(kinds["kernel"] + kinds["sync"]),
        by_kind={k: per(c) for k, c in kinds.items()},
        by_phase={p: dict(launches=per(launches(c)), metadata=per(c["metadata"]), sync=per(c["sync"]))
                  for p, c in sorted(phases.items(), key=lambda kv: -launches(kv[1]))},
        by_op={o: dict(launches=per(launches(c)), metadata=per(c["metadata"]))
               for o, c in sorted(ops.items(), key=lambda kv: -(launches(kv[1]) * 1e6 + kv[1]["metadata"]))},
        by_function={f: per(c) for f, c in functions.most_common()},  # every site, lines merged: commits compare
        sync_sites={s: per(c["sync"]) for s, c in site_rows if c["sync"]},
        host_side_sites={s: per(c["host_side"]) for s, c in site_rows if c["host_side"]},
        by_site=[dict(site=s, launches=per(launches(c)), metadata=per(c["metadata"]), sync=per(c["sync"]),
                      phase=max((k for k in c if k.startswith("phase:")), key=c.get)[6:],
                      ops={o: per(x) for o, x in site_ops[s].most_common()}) for s, c in site_rows[:top]],
    )


def run(args, batch: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_nosa import NosaConfig, to_nosa
    from hf_nosa.modeling import randomize_eviction_heads

    dtype = getattr(torch, args.dtype)
    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=args.layers,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=args.vocab,
                         max_position_embeddings=1 << 17, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype).eval()
    to_nosa(model, NosaConfig(prefill_chunk_size=512))  # 512-token chunks: comparable across commits
    randomize_eviction_heads(model, scale=0.5, generator=torch.Generator().manual_seed(0))
    import hf_nosa
    import transformers

    roots = {"hf_nosa": os.path.dirname(hf_nosa.__file__), "transformers": os.path.dirname(transformers.__file__)}
    census, quoka = Census(roots), {}
    hook(model, census, quoka)
    ids = torch.randint(3, args.vocab, (batch, args.context), generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    with census:
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                       cache_implementation="nosa")
    wall = time.perf_counter() - t0
    ncfg = model.config.nosa if isinstance(model.config.nosa, NosaConfig) else NosaConfig.from_dict(model.config.nosa)
    full, chunk_size = ncfg.prefill_budget_blocks * ncfg.block_size, ncfg.prefill_chunk_size
    keys = sorted(quoka)
    steady = [key for key in keys if key[0] * chunk_size >= full]  # chunks selecting a whole budget of blocks
    per_chunk = [dict(chunk=c, layer=i, launches=sum(n for (_, _, kind, _), n in census.counts[(c, i)].items()
                                                     if kind in ("kernel", "sync")),
                      all_ops=sum(census.counts[(c, i)].values())) for c, i in keys]
    outside = [sum(census.counts[(c, None)].values()) for c in range(max((c for c, _ in census.counts), default=-1) + 1)]
    return dict(batch=batch, wall_s=round(wall, 1), quoka_chunk_layers=[list(k) for k in keys],
                full_budget_chunks=sorted({c for c, _ in steady}),
                per_quoka_chunk_layer=summarize(census.counts, keys, args.top),
                per_full_budget_chunk_layer=summarize(census.counts, steady, args.top) if steady else None,
                per_chunk=per_chunk, ops_outside_layers_per_chunk=outside)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=6144, help="prompt tokens (> the 4096-token budget)")
    parser.add_argument("--batch", default="1", help="comma list of batch sizes")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--kernels", default="triton", choices=("triton", "torch"),
                        help="triton: the CUDA path's code, Triton kernels interpreted (one launch each)")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      "docs", "results", "prefill_op_census_cpu.json"))
    args = parser.parse_args(argv)
    os.environ["HF_NOSA_KERNELS"] = args.kernels
    if args.kernels == "triton":
        os.environ["TRITON_INTERPRET"] = "1"
    import hf_nosa
    import transformers

    repo = os.path.dirname(os.path.dirname(os.path.abspath(hf_nosa.__file__)))
    commit = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = dict(command=" ".join([os.path.basename(sys.executable)] + sys.argv), commit=commit,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  versions=dict(torch=torch.__version__, transformers=transformers.__version__,
                                python=sys.version.split()[0]),
                  settings=dict(vars(args), out=os.path.relpath(args.out, repo), omp_threads=torch.get_num_threads()),
                  notes=["launches = kernel + sync ops (metadata and host_side ops excluded); means per chunk and layer",
                         "CPU only: no host-to-device copies are seen; _causal's explicit mask stands in for "
                         "CUDA's CausalBias; fetch parts are 1 (as on CUDA below 8 rows)"],
                  runs=[])
    for batch in (int(b) for b in args.batch.split(",")):
        result["runs"].append(run(args, batch))
        summary = result["runs"][-1]["per_full_budget_chunk_layer"] or result["runs"][-1]["per_quoka_chunk_layer"]
        print(f"batch {batch}: {summary['launches']} launches, {summary['all_ops']} ops per QUOKA chunk-layer "
              f"({result['runs'][-1]['wall_s']} s)")
        for phase, c in summary["by_phase"].items():
            print(f"  {phase:16s} {c['launches']:8.1f} launches {c['metadata']:8.1f} metadata")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
