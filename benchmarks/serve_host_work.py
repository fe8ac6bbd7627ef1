"""The host work of a batched continuous-batching decode step, per layer, with the device work taken out.

A NOSA decode step under ``generate_batch`` runs, per layer, Python around one batched update of every decoding
request (``hf_nosa.serving.decode_batch``): each request's ``prepare_fused_step`` and ``_widen``, the run's views of
the shared buffers, then ``finish_fused_step``. On the GPU that host work adds to the step wherever it exceeds the
device's, and it grows with the number of requests. This measures it on the CPU: a tiny Llama under the Triton
interpreter (so the batched path runs), with the batched update's kernels and attention replaced by stubs that
return zeros, and each host-side function timed; the tokens are not meaningful.

    python -m benchmarks serve host --rows 16 --out FILE.json

``--batches N`` sends the requests N times through one persistent manager: from the second batch on, every request
draws its host buffers from what the earlier ones gave back (``HostPool.take``, timed beside the rest).

``--graphs`` runs the manager's decode-step graphs (``hf_nosa.serving.step_graph``) with a stand-in graph whose
replay does nothing: what is timed is the host work of a replayed step (the step planned for every layer, each
request's prepare and finish in every layer): ``replayed_step_us`` the mean over the steps planned whole,
``replayed_step_median_us`` a steady one (the median: a batch's first steps build the runs' views).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TIMED = ("_layer_rows", "_widen", "_views", "plan_step", "_run")


def tiny_model(layers: int = 2):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_nosa import NosaConfig, to_nosa
    from hf_nosa.modeling import randomize_eviction_heads

    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    nosa = NosaConfig(block_size=16, budget_tokens=64, query_tokens=16, sink_tokens=16, local_tokens=16,
                      compress_kernel=8, compress_stride=4, prefill_chunk_size=64, prefill_whole_prompt_tokens=0)
    return randomize_eviction_heads(to_nosa(model, nosa), generator=torch.Generator().manual_seed(1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16, help="requests decoding together (default: 16)")
    parser.add_argument("--prompt", type=int, default=40, help="tokens per prompt (default: 40)")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens per request (default: 8)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the tiny Llama (default: 2)")
    parser.add_argument("--batches", type=int, default=1,
                        help="times the requests go through one persistent manager (default: 1)")
    parser.add_argument("--graphs", action="store_true",
                        help="decode steps through the step graphs, their replays doing nothing (module docstring)")
    parser.add_argument("--out", default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    # set before triton and the kernels are imported (they read it then): the batched path runs on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("HF_NOSA_KERNELS", "triton")
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from benchmarks.harness import write_json
    from hf_nosa.cache import decode_step
    from hf_nosa.serving import ServingBudget, decode_batch, enable, host_pool

    torch.set_num_threads(1)
    model = tiny_model(args.layers)
    seconds, calls = collections.defaultdict(float), collections.Counter()
    each = collections.defaultdict(list)  # per call, for the replayed step's median

    def timed(owner, name):
        original = getattr(owner, name)

        def run(*a, **k):
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                spent = time.perf_counter() - start
                seconds[name] += spent
                calls[name] += 1
                if name in ("plan_whole_step", "finish_whole_step"):
                    each[name].append(spent)

        setattr(owner, name, run)
        return original

    saved = {name: timed(decode_batch, name) for name in TIMED}
    saved_prepare = timed(decode_step.DecodePaths, "prepare_fused_step")
    saved_finish = timed(decode_step.DecodePaths, "finish_fused_step")
    saved_pool = {name: timed(host_pool.HostPool, name) for name in ("take", "give_back")}
    stubs = decode_batch.DecodePaths.decode_rows, decode_batch.attend_cache_inputs
    decode_batch.DecodePaths.decode_rows = staticmethod(lambda batch, k, v, q, b, scale, r0, r1: None)
    decode_batch.attend_cache_inputs = lambda q, inputs, scale: torch.zeros_like(q)
    graphs = []
    if args.graphs:
        from types import SimpleNamespace

        from hf_nosa.serving import manager as serving_manager
        from hf_nosa.serving import step_graph

        class NoReplay:  # the device work of a replay is not what is measured here
            def capture(self, fn, device):
                return SimpleNamespace(replay=lambda: None)

        saved_graphs = (serving_manager.step_graphs_wanted, step_graph.CudaGraphs)
        serving_manager.step_graphs_wanted = lambda device, use_cuda_graph: True
        step_graph.CudaGraphs = NoReplay
        for name in ("plan_whole_step", "finish_whole_step"):
            graphs.append((name, timed(step_graph, name)))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 97, (args.prompt,), generator=g).tolist() for _ in range(args.rows)]
    enable(model, budget=ServingBudget(decode_rows=args.rows))  # every request on a row: one run
    try:
        for _ in range(args.batches):
            model.generate_batch(prompts, generation_config=GenerationConfig(
                max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0),
                continuous_batching_config=ContinuousBatchingConfig(
                    max_batch_tokens=max(1024, args.rows * args.prompt)), persistent_manager=True)
        free_buffers = len(model._cached_continuous_batching_manager.nosa_requests.host_pool.free)
        step_graphs = model._cached_continuous_batching_manager.nosa_step_graphs
        step_graphs = step_graphs.stats() if step_graphs is not None else None
        runs = dict(model._cached_continuous_batching_manager.nosa_requests.decode_runs)
    finally:
        model.destroy_cached_continuous_batching_manager()
        for name, original in saved.items():
            setattr(decode_batch, name, original)
        decode_step.DecodePaths.prepare_fused_step = saved_prepare
        decode_step.DecodePaths.finish_fused_step = saved_finish
        for name, original in saved_pool.items():
            setattr(host_pool.HostPool, name, original)
        decode_batch.DecodePaths.decode_rows, decode_batch.attend_cache_inputs = stubs
        if args.graphs:
            serving_manager.step_graphs_wanted, step_graph.CudaGraphs = saved_graphs
            for name, original in graphs:
                setattr(step_graph, name, original)
    layer_runs = calls["_run"]
    per_layer_us = (seconds["_layer_rows"] + seconds["_run"]) / max(layer_runs, 1) * 1e6
    replayed_us = None
    if step_graphs is not None and step_graphs["replays"]:
        # a replayed step's host work: one plan (the mean over every step planned, the first steps of a batch, which
        # build the runs' views, included) and one finish
        replayed_us = sum(seconds[name] / max(calls[name], 1) for name in ("plan_whole_step", "finish_whole_step"))
        replayed_us *= 1e6
    # a steady replayed step (the median: the first steps of a batch build the runs' views and widen the rows)
    median = {name: sorted(times)[len(times) // 2] * 1e6 for name, times in each.items() if times}
    steady_us = sum(median.values()) if len(median) == 2 else None
    result = dict(rows=args.rows, layers=args.layers, batches=args.batches, free_buffers=free_buffers,
                  batched_runs=runs, host_us_per_layer=per_layer_us, step_graphs=step_graphs,
                  replayed_step_us=replayed_us, replayed_step_median_us=steady_us,
                  functions={name: dict(calls=calls[name], total_ms=seconds[name] * 1e3,
                                        per_call_us=seconds[name] / max(calls[name], 1) * 1e6) for name in seconds})
    print(json.dumps(dict(rows=args.rows, batched_runs=runs, host_us_per_layer=round(per_layer_us, 1),
                          step_graphs=step_graphs, replayed_step_us=replayed_us and round(replayed_us, 1),
                          replayed_step_median_us=steady_us and round(steady_us, 1))))
    for name, row in result["functions"].items():
        print(f"  {name:20s} {row['calls']:5d} calls  {row['per_call_us']:8.1f} us each")
    return write_json(args.out, result) if args.out else result


if __name__ == "__main__":
    main()
