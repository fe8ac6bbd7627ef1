"""Where a QUOKA prefill's wall time goes on the host: cProfile and torch.profiler (CPU self time, kernel launches)
of the 1b-shaped model's forward of a 64K prompt into a NosaCache (chunk 2048, budget 4096), batch 1, on CUDA.

    PYTHONPATH=. python benchmarks/prefill_host_profile.py > profile.txt
"""
import cProfile, pstats, time, torch, warnings, os, io
warnings.filterwarnings("ignore")
from transformers import LlamaConfig, LlamaForCausalLM
from hf_nosa import NosaCache, NosaConfig, to_nosa
from hf_nosa.modeling import randomize_eviction_heads
from benchmarks.prefill import SHAPE_1B
out = os.environ.get("OUT", ".")
cfg = LlamaConfig(**SHAPE_1B, max_position_embeddings=140000); cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
with torch.device("cuda"):
    m = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
nc = NosaConfig(block_size=64, budget_tokens=4096, query_tokens=1024, sink_tokens=64, local_tokens=1024, compress_kernel=32, compress_stride=16, prefill="quoka", prefill_chunk_size=2048, quoka_queries=16)
to_nosa(m, nc)
T = 65536
ids = torch.randint(3, 1000, (1, T), device="cuda")
def run():
    with torch.no_grad():
        m(input_ids=ids, past_key_values=NosaCache(m.config, nc), logits_to_keep=1)
    torch.cuda.synchronize()
run(); run()
t = time.perf_counter(); run(); print("wall", time.perf_counter() - t, flush=True)
pr = cProfile.Profile(); pr.enable(); run(); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40); print(s.getvalue()[:9000])
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(60); print(s.getvalue()[:12000])
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
    run()
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=45))
