#!/usr/bin/env bash
# One device call of a GPU session: `bash benchmarks/gpu_session.sh PHASE` with results under $OUT.
#
# Run it from a snapshot of a commit, not from a working tree that others are editing: here,
#   rm -rf .bench && mkdir .bench && git archive HEAD hf_nosa benchmarks tests recipes experiments pyproject.toml | tar -x -C .bench
# with /.bench/ in .git/info/exclude, then on the device (carry .bench):
#   cd .bench && HF_NOSA_COMMIT=<sha> bash benchmarks/gpu_session.sh generate-32k
# Each phase fits one call (10 minutes); the benchmarks write their JSON after every row, so a phase cut short
# keeps what it measured.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case "${1:-}" in
  conversation-tests)  # issue 43: a new turn on a reused cache and atomic turns on the kernels, with the decode-graph and whole-prompt GPU tests (about 4 minutes)
    timeout 560 python -m pytest -q -m gpu tests/test_conversations.py tests/test_gpu_generate.py tests/test_whole_prompt.py -p no:cacheprovider --tb=short > "$OUT/gpu_tests_conversations.log" 2>&1
    tail -30 "$OUT/gpu_tests_conversations.log" ;;
  conversation)   # issue 43: a 4096-token turn on a 60K conversation, batch 1 and 8, against re-prefilling it (about 5 minutes)
    timeout 560 python benchmarks/conversation.py --shape 1b --batches 1 8 --out "$OUT/conversation.json" 2>&1 | tee "$OUT/conversation.log" | grep -v Warning | tail -8 ;;
  request-stream)  # issue 43: 10 batch-1 requests of 8K-64K, 128 new tokens each, stock static + compile against NOSA, each call against its repeat (about 6 minutes)
    timeout "${STREAM_TIMEOUT:-570}" python benchmarks/request_stream.py --shape 1b --methods ${STREAM_METHODS:-static nosa} --out "$OUT/request_stream.json" 2>&1 | tee "$OUT/request_stream.log" | grep -v Warning | tail -8 ;;
  tests)          # the GPU-marked tests, 8 processes (Triton compilation dominates: about 4 minutes in one)
    timeout 560 python -m pytest -q -m gpu tests/ -n 8 -p no:cacheprovider --tb=short > "$OUT/gpu_tests_full.log" 2>&1
    tail -40 "$OUT/gpu_tests_full.log" ;;
  generate-32k)   # issue 14's 32K rows, stock and NOSA in one run (about 8 minutes)
    timeout 570 python benchmarks/generate.py --shape 1b --contexts 32768 --batch1 --out "$OUT/generate_32k.json" 2>&1 | tee "$OUT/generate_32k.log" | grep -v '^{' ;;
  generate-64k)   # issue 14's 64K rows (about 8 minutes)
    timeout 570 python benchmarks/generate.py --shape 1b --contexts 65536 --batch1 --out "$OUT/generate_64k.json" 2>&1 | tee "$OUT/generate_64k.log" | grep -v '^{' ;;
  prefill-breakdown)  # issue 14: the 64K NOSA prefill of generate, GPU time by kernel kind, and its host syncs (about 3 minutes)
    timeout 400 python benchmarks/prefill_breakdown.py --context 65536 --batch 16 --out "$OUT" 2>&1 | tail -60 ;;
  prefill-breakdown-b1)  # the same at batch 1, where the GPU waits on the host (8.8 s of wall time for 1.5 s of GPU work at 31c8e7b), with a cProfile of the host's time
    timeout 400 python benchmarks/prefill_breakdown.py --context 65536 --batch 1 --fetch-parts 1 --host-profile --out "$OUT/b1" 2>&1 | tail -80 ;;
  prefill-breakdown-8b)  # the 8b shape's prefill (11 s at batch 1 and 32K against 1.4 s stock), by kernel kind (about 3 minutes)
    timeout 400 python benchmarks/prefill_breakdown.py --shape 8b --context 32768 --batch 2 --out "$OUT/8b" 2>&1 | tail -60 ;;
  memory-peak)    # issue 14: what is live at the peak of NOSA generate at 64K x 38 (1b, 24 GB cap), by allocation site, beside generate.py's formula moments (about 5 minutes)
    timeout 570 python benchmarks/memory_census.py --device cuda --shape 1b --context 65536 --batch 38 --new-tokens 512 --cap-gb 24 --out "$OUT/memory_census_64k.json" 2>&1 | tail -20 ;;
  pinning)        # pinned host allocation rate: torch's default against its cudaHostRegister mode (about 1 minute)
    timeout 300 python benchmarks/pinning.py --gib 16 --out "$OUT" 2>&1 | tail -5 ;;
  quoka-attention)  # issue 17 item 2: a QUOKA chunk's attention by every candidate beside plain sdpa, chunks of 512 and 2048 (about 2 minutes)
    for c in 512 2048; do timeout 250 python benchmarks/dense_attention.py --quoka-only --quoka-chunk $c --out "$OUT" 2>&1 | grep '"quoka_chunk"' | python -c "import json,sys; [print(r['shape'], r['chunk'], r['run'], round(r.get('tflops', 0), 1), 'TFLOP/s', r.get('error', '')[:80]) for r in map(json.loads, sys.stdin)]"; done ;;
  layer-kernels)  # the fused RMSNorm, rotary and SiLU-product kernels against the stock torch ops, at a decode step (42 x 1) and a prefill chunk (about 1 minute)
    timeout 200 python benchmarks/layer_kernels.py --out "$OUT" 2>&1 | tail -20 ;;
  ttft-small-batch)  # issue 17: generate's time to the first token at 64K, NOSA at batches 1, 2 and 4, with prefill_batch_tokens 0 (512-token chunks), 2048, 4096 and 8192 (longer chunks at small batches); 64 new tokens (about 6 minutes)
    for bt in 0 2048 4096 8192; do timeout 150 python benchmarks/generate.py --shape 1b --contexts 65536 --methods nosa --nosa-batches 1 2 4 --new-tokens 64 --skip-engine --prefill-batch-tokens $bt --out "$OUT/ttft_batch_tokens_$bt.json" 2>&1 | grep -v '^{' | tail -4; done ;;
  generate-64k-chunk2048)  # the same with 2048-token prefill chunks, NOSA only (QUOKA re-reads its budget 4x less)
    timeout 570 python benchmarks/generate.py --shape 1b --contexts 65536 --methods nosa --prefill-chunk-size 2048 --out "$OUT/generate_64k_chunk2048.json" 2>&1 | tee "$OUT/generate_64k_chunk2048.log" | grep -v '^{' ;;
  fp8-engine-1b)  # issue 18: the engine with the fp8 host store beside bf16, 1b at 32K and 64K (same batch, then each its largest)
    timeout 570 python benchmarks/decode_throughput.py --quick --shapes 1b --methods nosa,nosa_fp8 --out "$OUT/fp8_1b" 2>&1 | grep -v '^{' | tail -30 ;;
  fp8-fetch-blocks)  # issue 18: the engine at 64K, bf16 and fp8 stores, with the decode fetch copying 2 (default) and 4 blocks per iteration (HF_NOSA_FETCH_BLOCKS): does a one-byte store need more blocks in flight?
    for nb in 2 4; do HF_NOSA_FETCH_BLOCKS=$nb timeout 280 python benchmarks/decode_throughput.py --shapes 1b --contexts 65536 --steps 8 --methods nosa,nosa_fp8 --out "$OUT/fetch_blocks_$nb" 2>&1 | grep -v '^{' | tail -8; done ;;
  fetch-contention)  # does the UVA fetch slow down beside compute on another stream? (why staggered decode parts gain nothing; about 1 minute)
    timeout 200 python benchmarks/fetch_bandwidth.py --contention --out "$OUT" 2>&1 | tail -8 ;;
  decode-parts)   # the engine at 64K with the batch decoded in 1 and 2 parts on their own streams (HF_NOSA_DECODE_PARTS), 2 parts staggered and free (HF_NOSA_DECODE_PARTS_STAGGER), 4 staggered, bf16 and fp8 stores, an 18 GB host budget (batch 8: a quick A/B), then the GPU test of the parts (about 4 minutes)
    for run in 1:1 2:1 2:0 4:1; do parts=${run%:*} stagger=${run#*:}; HF_NOSA_DECODE_PARTS=$parts HF_NOSA_DECODE_PARTS_STAGGER=$stagger timeout 200 python benchmarks/decode_throughput.py --shapes 1b --contexts 65536 --steps 8 --host-gb 18 --methods nosa,nosa_fp8 --out "$OUT/decode_parts_${parts}_stagger_$stagger" 2>&1 | grep -v '^{' | tail -4; done
    timeout 100 python -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_parts.py 2>&1 | tail -3 ;;
  fp8-engine-8b)  # the same on the 8b shape (48 GB cap)
    timeout 570 python benchmarks/decode_throughput.py --quick --shapes 8b --methods nosa,nosa_fp8 --out "$OUT/fp8_8b" 2>&1 | grep -v '^{' | tail -30 ;;
  fp8-generate-64k)  # generate with the fp8 store at the bf16 store's largest 64K batch (the generate-64k phase's 38)
    timeout 570 python benchmarks/generate.py --shape 1b --contexts 65536 --methods nosa --nosa-batches ${NOSA_BATCH:-38} --host-dtype float8_e4m3fn --out "$OUT/generate_64k_fp8.json" 2>&1 | grep -v '^{' ;;
  fp8-generate-32k)  # the same at 32K (the generate-32k phase's largest batch, 41)
    timeout 570 python benchmarks/generate.py --shape 1b --contexts 32768 --methods nosa --nosa-batches ${NOSA_BATCH:-41} --host-dtype float8_e4m3fn --out "$OUT/generate_32k_fp8.json" 2>&1 | grep -v '^{' ;;
  generate-8b)    # the 8b shape beside it, 32K only (48 GB cap)
    timeout 570 python benchmarks/generate.py --shape 8b --contexts 32768 --batch1 --out "$OUT/generate_8b_32k.json" 2>&1 | tee "$OUT/generate_8b.log" | grep -v '^{' ;;
  prefill)        # QUOKA TTFT against dense at 64K (batch 1 and 4) and 128K, and the attention rates
    timeout 200 python benchmarks/prefill.py --contexts 65536 --batches 1,4 --chunks 512,2048 --repeat 2 --profile --out "$OUT/p64" > "$OUT/p64.log" 2>&1
    timeout 150 python benchmarks/prefill.py --contexts 131072 --batches 1 --chunks 2048 --repeat 1 --out "$OUT/p128" > "$OUT/p128.log" 2>&1
    timeout 180 python benchmarks/dense_attention.py --lengths 32768,65536 --out "$OUT" > "$OUT/dense_attention.log" 2>&1
    tail -n 12 "$OUT/p64.log" "$OUT/p128.log" ;;
  prefill-8b)     # the 8b shape's QUOKA prefill against dense at 32K (generate's TTFT there: 11 s at batch 1), by kernel
    timeout 400 python benchmarks/prefill.py --shape 8b --contexts 32768 --batches 1,4 --chunks 512 --repeat 2 --profile --out "$OUT/p8b" > "$OUT/p8b.log" 2>&1
    tail -n 30 "$OUT/p8b.log" ;;
  retrofit-profile)  # where the smollm2-135m retrofit's micro-step goes: dense / nosa / nosa+aux, batch 1 and 4 (about 3 minutes)
    timeout 450 python benchmarks/retrofit_profile.py --batches 1,4 --out "$OUT" 2>&1 | grep -v USDT | tail -80 ;;
  prefill-chunks)  # the prefill's chunk policy and kernels: their GPU tests, then generate's first token at 64K, batches 1, 4, 16 at the defaults (about 4 minutes)
    timeout 120 python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_quoka_choice.py tests/kernels/test_compress_extend.py 2>&1 | tail -3
    timeout 200 python benchmarks/generate.py --shape 1b --contexts 65536 --methods nosa --nosa-batches 1 4 16 --new-tokens 16 --skip-engine --out "$OUT/ttft_chunks.json" 2>&1 | grep -v '^{' | tail -4 ;;
  train-sparse)   # issue 17: the retrofit step and one layer's attention at 32K with the sparse training backend beside dense (about 4 minutes)
    timeout 230 python benchmarks/train_step.py --lengths 32768 --backends sparse --repeats 2 --out "$OUT/train_sparse" 2>&1 | tail -30 ;;
  train-sparse-64k)  # issue 17: the retrofit step at 64K with the sparse training backend beside dense (not measured yet; flex was 8.5x)
    timeout 560 python benchmarks/train_step.py --lengths 65536 --backends sparse --repeats 2 --out "$OUT/train_sparse_64k" 2>&1 | tail -30 ;;
  train-step)     # issue 17's retrofit step at 16K, 32K, 64K
    timeout 570 python benchmarks/train_step.py --lengths 16384,32768,65536 --out "$OUT" 2>&1 | tail -30 ;;
  prefill-tail)   # issue 17: QUOKA's dense tail on its queries only and the kept-query choice in registers: their GPU tests, the 64K prefill by kernel at batches 4 (fetch in 1 and 2 parts) and 1, then TTFT against dense sdpa at 64K, batches 1 and 4, chunks 2048 and 4096 (about 8 minutes)
    timeout 220 python -m pytest -q -m gpu tests/kernels/test_quoka_choice.py tests/test_prefix_attention.py tests/test_quoka.py tests/test_pool_attention.py -n 8 -p no:cacheprovider --tb=short > "$OUT/gpu_tests_prefill_tail.log" 2>&1
    tail -3 "$OUT/gpu_tests_prefill_tail.log"
    timeout 120 python benchmarks/prefill_breakdown.py --context 65536 --batch 4 --fetch-parts 1,2 --out "$OUT/b4" 2>&1 | tail -11
    timeout 90 python benchmarks/prefill_breakdown.py --context 65536 --batch 1 --fetch-parts 1 --out "$OUT/b1" 2>&1 | tail -11
    timeout 170 python benchmarks/prefill.py --contexts 65536 --batches 1,4 --chunks 2048,4096 --methods dense,no_attention,quoka --repeat 2 --out "$OUT/prefill" 2>&1 | tail -8 ;;
  prefill-defaults)  # issue 17: the default chunks (4096 up to 8 rows), the compressed keys extended before the host write, flash_biased's GQA-packed rows: their GPU tests, TTFT against dense sdpa at 64K (batches 1, 4), generate's first token at 64K (batches 1, 4), a 4096-token QUOKA chunk's attention against cuDNN (about 5 minutes)
    timeout 120 python -m pytest -q -m gpu tests/kernels/test_flash_biased.py tests/test_quoka.py tests/kernels/test_compress_extend.py -n 8 -p no:cacheprovider --tb=short > "$OUT/gpu_tests_prefill_defaults.log" 2>&1
    tail -3 "$OUT/gpu_tests_prefill_defaults.log"
    timeout 100 python benchmarks/prefill.py --contexts 65536 --batches 1,4 --chunks 4096 --methods dense,quoka --repeat 3 --out "$OUT/p64" 2>&1 | tail -5
    timeout 100 python benchmarks/generate.py --shape 1b --contexts 65536 --methods nosa --nosa-batches 1 4 --new-tokens 16 --skip-engine --out "$OUT/ttft_defaults.json" 2>&1 | grep -v '^{' | tail -3
    timeout 70 python benchmarks/dense_attention.py --quoka-only --quoka-chunk 4096 --out "$OUT" 2>&1 | grep '"quoka_chunk"' | python -c "import json,sys; [print(r['shape'], r['chunk'], r['run'], round(r.get('tflops', 0), 1), 'TFLOP/s', r.get('error', '')[:80]) for r in map(json.loads, sys.stdin)]" ;;
  prefill-whole)  # issue 17: a QUOKA prompt through each layer whole (whole_prompt): its GPU tests, TTFT against dense sdpa at 64K (batches 1, 4) chunk by chunk and whole with GPU time by kernel at batch 1, generate's first token at 64K (batches 1, 4), 128K at batch 1 with 4096- and 8192-token chunks (about 8 minutes)
    timeout 150 python -m pytest -q -m gpu tests/test_whole_prompt.py tests/test_quoka.py tests/test_prefix_attention.py tests/test_pool_attention.py -n 8 -p no:cacheprovider --tb=short > "$OUT/gpu_tests_prefill_whole.log" 2>&1
    tail -3 "$OUT/gpu_tests_prefill_whole.log"
    timeout 170 python benchmarks/prefill.py --contexts 65536 --batches 1,4 --chunks 4096 --methods dense,no_attention,quoka,quoka_whole --repeat 3 --profile --out "$OUT/p64" 2>&1 | tail -7
    timeout 100 python benchmarks/generate.py --shape 1b --contexts 65536 --methods nosa --nosa-batches 1 4 --new-tokens 16 --skip-engine --out "$OUT/ttft_whole.json" 2>&1 | grep -v '^{' | tail -3
    timeout 150 python benchmarks/prefill.py --contexts 131072 --batches 1 --chunks 4096,8192 --methods dense,quoka_whole --repeat 2 --out "$OUT/p128" 2>&1 | tail -4 ;;
  prefill-whole-2)  # issue 17: the whole prompt without host syncs in its layers: GPU tests, TTFT against dense sdpa at 64K (batches 1, 4), generate's first token at 64K (batches 1, 4) and 128K (batch 1), median of 3, then the batch-1 prefill by kernel with a host profile (about 8 minutes)
    timeout 150 python -m pytest -q -m gpu tests/test_whole_prompt.py tests/test_quoka.py tests/test_padding.py -n 8 -p no:cacheprovider --tb=short -rA 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed" | cut -c1-160 | tail -12
    timeout 120 python benchmarks/prefill.py --contexts 65536 --batches 1,4 --chunks 4096 --methods dense,quoka,quoka_whole --repeat 3 --out "$OUT/p64" 2>&1 | tail -6
    timeout 100 python benchmarks/generate.py --shape 1b --contexts 65536 --methods nosa --nosa-batches 1 4 --new-tokens 16 --skip-engine --repeats 3 --out "$OUT/ttft_whole_64k.json" 2>&1 | grep -v '^{' | tail -3
    timeout 60 python benchmarks/generate.py --shape 1b --contexts 131072 --methods nosa --nosa-batches 1 --new-tokens 16 --skip-engine --repeats 3 --out "$OUT/ttft_whole_128k.json" 2>&1 | grep -v '^{' | tail -2
    timeout 100 python benchmarks/prefill_breakdown.py --context 65536 --batch 1 --fetch-parts 1 --host-profile --out "$OUT/b1" 2>&1 | tail -9 ;;
  prefill-whole-3)  # issue 17: the host write on at most HF_NOSA_WRITE_PROGRAMS programs (32) beside the layer's compute, and host_to_device on padding already on the device: GPU tests, dense sdpa and QUOKA whole at 64K (batches 1, 4) and 128K (batch 1), generate's first token at each (median of 3), the batch-1 prefill by kernel (about 7 minutes)
    timeout 150 python -m pytest -q -m gpu tests/test_whole_prompt.py tests/test_padding.py tests/kernels/test_host_write.py -n 8 -p no:cacheprovider --tb=short > "$OUT/gpu_tests_prefill_whole_3.log" 2>&1
    tail -3 "$OUT/gpu_tests_prefill_whole_3.log"
    timeout 100 python benchmarks/prefill.py --contexts 65536 --batches 1,4 --chunks 4096 --methods dense,quoka_whole --repeat 3 --out "$OUT/p64" 2>&1 | tail -4
    timeout 60 python benchmarks/generate.py --shape 1b --contexts 65536 --methods nosa --nosa-batches 1 --new-tokens 16 --skip-engine --repeats 3 --out "$OUT/ttft_64k_b1.json" 2>&1 | grep -v '^{' | tail -1
    timeout 60 python benchmarks/generate.py --shape 1b --contexts 65536 --methods nosa --nosa-batches 4 --new-tokens 16 --skip-engine --repeats 3 --out "$OUT/ttft_64k_b4.json" 2>&1 | grep -v '^{' | tail -1
    timeout 90 python benchmarks/prefill.py --contexts 131072 --batches 1 --chunks 4096 --methods dense,quoka_whole --repeat 2 --out "$OUT/p128" 2>&1 | tail -2
    timeout 60 python benchmarks/generate.py --shape 1b --contexts 131072 --methods nosa --nosa-batches 1 --new-tokens 16 --skip-engine --repeats 3 --out "$OUT/ttft_128k_b1.json" 2>&1 | grep -v '^{' | tail -1
    timeout 80 python benchmarks/prefill_breakdown.py --context 65536 --batch 1 --fetch-parts 1 --out "$OUT/b1" 2>&1 | tail -9 ;;
  train-split)    # issue 17: the split sparse training attention (shared blocks whole, each token's extras apart) and the fused selection: their GPU tests, then the retrofit step and one layer's attention at 32K, split and union paths beside dense (about 8 minutes)
    timeout 240 python -m pytest -q -m gpu tests/kernels/test_sparse_train_split.py tests/kernels/test_sparse_train_attention.py tests/kernels/test_train_select.py tests/test_training.py -n 8 -p no:cacheprovider --tb=short > "$OUT/gpu_tests_train_split.log" 2>&1
    tail -4 "$OUT/gpu_tests_train_split.log"
    timeout 330 python benchmarks/train_step.py --lengths 32768 --backends sparse --repeats 2 --out "$OUT/train_split" 2>&1 | grep -v '^{' | tail -30 ;;
  train-breakdown)  # issue 17: what a 32K retrofit step pays beyond dense: the training kernels' GPU tests (flex's left out, first failure shown), then GPU time by kernel and the peak's live allocations per mode, and one layer's sparse attention by kernel per tile size (about 8 minutes)
    timeout 170 python -m pytest -v -x -m gpu -k "not flex" tests/kernels/test_sparse_train_split.py tests/kernels/test_sparse_train_attention.py tests/kernels/test_train_select.py tests/test_training.py -n 8 -p no:cacheprovider --tb=short > "$OUT/gpu_tests_train.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|Error|assert|passed|failed" "$OUT/gpu_tests_train.log" | tail -40
    timeout 400 python benchmarks/train_step_breakdown.py --lengths 32768 --out "$OUT" 2>&1 | tail -12 ;;
  train-held)     # issue 17: the retrofit step with the attention output held for the checkpointed rerun (no forward kernels in the rerun, copied back from pinned memory, the layer below prefetched) and the RMSNorm backward keeping its input instead of float32 rows: the training GPU tests (flex's left out), the step at 32K and 64K against dense, then the 32K step by kernel (about 9 minutes)
    timeout 150 python -m pytest -v -m gpu -k "not flex" tests/kernels/test_sparse_train_split.py tests/kernels/test_train_select.py tests/test_training.py tests/kernels/test_rms_norm.py -n 8 -p no:cacheprovider --tb=short > "$OUT/gpu_tests_train_held.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|Error|assert|passed|failed" "$OUT/gpu_tests_train_held.log" | tail -30
    timeout 300 python benchmarks/train_step.py --lengths 32768,65536 --backends sparse --steps-only --out "$OUT/train_held" 2>&1 | grep -v '^{' | tail -24
    timeout 120 python benchmarks/train_step_breakdown.py --lengths 32768 --tiles "" --out "$OUT" 2>&1 | tail -4 ;;
  train-final)    # issue 17: train-held plus the split dK/dV programs launched block by block (every head of a block together): the split kernels' and the held forward's GPU tests, the step at 32K and 64K against dense, then the 64K step by kernel (about 8 minutes)
    timeout 100 python -m pytest -v -m gpu tests/kernels/test_sparse_train_split.py tests/test_training.py -k "split or waits_on_the_host" -n 3 -p no:cacheprovider --tb=short > "$OUT/gpu_tests_train_final.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|Error|assert|passed|failed" "$OUT/gpu_tests_train_final.log" | tail -12
    timeout 230 python benchmarks/train_step.py --lengths 32768,65536 --backends sparse --steps-only --out "$OUT/train_final" 2>&1 | grep -v '^{' | tail -20
    timeout 140 python benchmarks/train_step_breakdown.py --lengths 65536 --tiles "" --out "$OUT" 2>&1 | tail -3 ;;
  train-tiles)    # issue 17, next: the retrofit step at 32K and 64K with 64-row shared tiles (16 tokens) beside the default 128 (one layer at 32K: 36.6 against 37.1 ms, dK/dV 13.6 against 15.8); then the default's 64K step by kernel (about 8 minutes)
    for rows in 64 128; do timeout 200 python benchmarks/train_step.py --lengths 32768,65536 --backends sparse --steps-only --tile-rows $rows --out "$OUT/tiles_$rows" 2>&1 | grep -E '"step_time|"peak_memory' ; done ;;
  train-sites)    # issue 17: the 64K NOSA retrofit step by kernel and its torch ops by calling line (which lines launch the copies and elementwise kernels dense does not run), the step timed beside (about 4 minutes)
    timeout 400 python benchmarks/train_step_breakdown.py --lengths 65536 --modes nosa --tiles "" --sites 60 --out "$OUT" 2>&1 | tail -3 ;;
  train-plan)     # issue 17: the selection bitmap in one kernel pass, the split plan's fast path when no row is padded (no 0.5 GB or-and-copy per layer at 64K), delta in one pass: their GPU tests, the retrofit step at 64K against dense, then the NOSA step's torch ops by calling line (about 6 minutes)
    timeout 110 python -m pytest -q -m gpu tests/kernels/test_selection_bitmap.py tests/kernels/test_sparse_train_split.py tests/kernels/test_sparse_train_attention.py tests/test_training.py -k "not flex" -n 4 -p no:cacheprovider --tb=short > "$OUT/gpu_tests_train_plan.log" 2>&1
    tail -4 "$OUT/gpu_tests_train_plan.log"
    timeout 200 python benchmarks/train_step.py --lengths 65536 --backends sparse --steps-only --out "$OUT/train_plan" 2>&1 | grep -E '"kind": "model_step"' | cut -c1-200
    timeout 200 python benchmarks/train_step_breakdown.py --lengths 65536 --modes nosa --tiles "" --sites 60 --out "$OUT" 2>&1 | tail -1 ;;
  train-verify)   # issue 17, first call of the next session: the training kernels' GPU tests with their names as they finish (-v; the last two batches were cut short by their timeouts, one failure unnamed), then the retrofit step at 64K against dense (about 8 minutes)
    timeout 330 python -m pytest -v -m gpu -n 5 -p no:cacheprovider --tb=short tests/kernels/test_selection_bitmap.py tests/kernels/test_train_select.py tests/kernels/test_sparse_train_split.py tests/kernels/test_sparse_train_attention.py tests/test_training.py -k "not flex" > "$OUT/gpu_tests_train_verify.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests_train_verify.log" | cut -c1-160 | tail -24
    timeout 240 python benchmarks/train_step.py --lengths 65536 --backends sparse --steps-only --out "$OUT/train_verify" 2>&1 | grep -E '"kind": "model_step"' | cut -c1-200 ;;
  train-gaps)     # issue 17: where the 64K NOSA step's compute stream has no kernel (about 80 ms a step at b67a05c: 2.93 s of kernels on it in a 3.01 s step; the fingerprint's host sync ruled out): its idle time by gap length and the 30 longest gaps with the kernels around them, dense beside it (about 4 minutes)
    timeout 400 python benchmarks/train_step_breakdown.py --lengths 65536 --tiles "" --gaps 30 --out "$OUT" 2>&1 | tail -3 ;;
  train-idle)     # issue 17: the 64K NOSA step's compute-stream idle time (86 ms at beaec9d: 1,144 gaps over 10 us, no sync but the rerun's lookup) by the Python function that launched the kernel after each gap, then the one training-kernel GPU test the train-verify batch did not reach (about 5 minutes)
    timeout 300 python benchmarks/train_step_breakdown.py --lengths 65536 --modes nosa --tiles "" --gaps 40 --out "$OUT" 2>&1 | tail -2
    python -c "import json; r=json.load(open('$OUT/train_step_breakdown.json'))['results'][0]; print(r['step_times_s'], r['compute_stream']['idle_ms']); [print(x) for x in r['compute_stream']['idle_by_launch_site'][:25]]"
    timeout 240 python -m pytest -v -m gpu -p no:cacheprovider --tb=short "tests/kernels/test_sparse_train_attention.py::test_kernels_match_reference_on_gpu[dtype2-64]" 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -5 ;;
  train-idle-2)   # issue 17: after fewer launches between the 64K step's kernels (the fingerprint's samples in one gather, the selection's positions and static eviction scores once per layer, the plan's own blocks once per geometry): the retrofit step at 32K and 64K against dense, the NOSA step's idle time by launching function, then the float32 training-kernel GPU test alone (about 9 minutes)
    timeout 200 python benchmarks/train_step.py --lengths 32768,65536 --backends sparse --steps-only --out "$OUT/train_idle_2" 2>&1 | grep -E '"kind": "model_step"' | cut -c1-180
    timeout 170 python benchmarks/train_step_breakdown.py --lengths 65536 --modes nosa --tiles "" --gaps 40 --out "$OUT" 2>&1 | tail -1
    python -c "import json; r=json.load(open('$OUT/train_step_breakdown.json'))['results'][0]; c=r['compute_stream']; print(c['idle_ms'], c['idle_by_gap_ms']); [print(x) for x in c['idle_by_launch_site'][:12]]"
    timeout 200 python -m pytest -v -m gpu -p no:cacheprovider --tb=short "tests/kernels/test_sparse_train_attention.py::test_kernels_match_reference_on_gpu[dtype2-64]" 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -5 ;;
  train-margin)   # issue 17: how far machine noise moves the 64K target's ratio: the retrofit step at 64K against dense, three runs on one machine (0.695x at 98e3464; machines of the kind differ by about 1%) (about 6 minutes)
    for run in 1 2 3; do timeout 170 python benchmarks/train_step.py --lengths 65536 --backends sparse --steps-only --out "$OUT/train_margin_$run" 2>&1 | grep -E '"kind": "model_step"' | cut -c1-130; done ;;
  train-shared)   # issue 17: the plan's shared blocks in one kernel and the RMSNorm backward in one kernel: their GPU tests with the training kernels', then the step at 32K and 64K against dense (about 5 minutes; at bd5ab6f 18 passed, 0.898x and 0.667x)
    timeout 300 python -m pytest -v -m gpu -n 4 -p no:cacheprovider --tb=short tests/kernels/test_rms_norm.py tests/kernels/test_sparse_train_split.py tests/kernels/test_sparse_train_attention.py tests/test_training.py -k "not flex and not dtype2" > "$OUT/gpu_tests_train_shared.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests_train_shared.log" | cut -c1-160 | tail -30
    timeout 200 python benchmarks/train_step.py --lengths 32768,65536 --backends sparse --steps-only --out "$OUT/train_shared" 2>&1 | grep -E '"kind": "model_step"' | cut -c1-180 ;;
  train-lengths-1b)  # issue 17 item 3 on the code that meets its targets: the retrofit step at 16K, 32K and 64K (1b), the sparse backend's one-layer attention beside dense and its tile coverage per length (about 8 minutes; JSON written after every length)
    timeout 560 python benchmarks/train_step.py --shapes 1b --lengths 16384,32768,65536 --backends sparse --out "$OUT/train_lengths_1b" 2>&1 | grep -E '"kind": "model_step"' | cut -c1-150 ;;
  train-lengths-8b)  # the same steps in the 8b shape where memory allows (a length that does not fit is recorded as oom; about 8 minutes)
    timeout 560 python benchmarks/train_step.py --shapes 8b --lengths 16384,32768,65536 --backends sparse --steps-only --out "$OUT/train_lengths_8b" 2>&1 | grep -E '"kind": "model_step"' | cut -c1-150 ;;
  train-memory-8b)  # why the 8b NOSA step at 64K ran out of memory where dense fits (126.3 GB): its memory event by event with the allocator's message, then the same with expandable segments (no fragmentation), dense beside it (about 6 minutes)
    PYTORCH_ALLOC_CONF=expandable_segments:False timeout 200 python benchmarks/train_memory.py --shape 8b --length 65536 --modes nosa --steps 1 --out "$OUT" --tag default 2>&1 | grep -E '^\{' | cut -c1-1500
    timeout 340 python benchmarks/train_memory.py --shape 8b --length 65536 --modes nosa,dense --out "$OUT" --tag expandable 2>&1 | grep -E '^\{' | cut -c1-1500 ;;
  train-memory-32k)  # the same question where an H100 can ask it: the 8b step at 32K peaks at 70.8 GB (H200), close to the H100's 79 as 64K's 126.3 is to the H200's 140; dense and NOSA with the default allocator, then with expandable segments, then the 1b 32K step timed with expandable segments (about 7 minutes)
    PYTORCH_ALLOC_CONF=expandable_segments:False timeout 170 python benchmarks/train_memory.py --shape 8b --length 32768 --modes dense,nosa --out "$OUT" --tag default 2>&1 | grep -E '^\{' | cut -c1-900
    timeout 170 python benchmarks/train_memory.py --shape 8b --length 32768 --modes dense,nosa --out "$OUT" --tag expandable 2>&1 | grep -E '^\{' | cut -c1-900
    timeout 150 python benchmarks/train_step.py --shapes 1b --lengths 32768 --backends sparse --steps-only --out "$OUT/train_expandable_1b_32k" 2>&1 | grep -E '"kind": "model_step"' | cut -c1-150 ;;
  train-expandable)  # issue 17 with the allocator retrofit now runs with (expandable segments, dense and NOSA alike): the 8b step at 64K, the 1b targets at 32K and 64K, then why the 8b NOSA step at 64K failed with the default allocator (about 7 minutes)
    timeout 240 python benchmarks/train_step.py --shapes 8b --lengths 65536 --backends sparse --steps-only --out "$OUT/train_expandable_8b" 2>&1 | grep -E '"kind": "model_step"' | cut -c1-150
    timeout 200 python benchmarks/train_step.py --shapes 1b --lengths 32768,65536 --backends sparse --steps-only --out "$OUT/train_expandable_1b" 2>&1 | grep -E '"kind": "model_step"' | cut -c1-150
    PYTORCH_ALLOC_CONF=expandable_segments:False timeout 130 python benchmarks/train_memory.py --shape 8b --length 65536 --modes nosa --steps 1 --out "$OUT" --tag default 2>&1 | grep -E '^\{' | cut -c1-1200 ;;
  selection-tiles)  # issue 17: one 64K layer's training selection per tile configuration of the block-score and choice kernels (swept at 32K only; 282 ms of the 64K step), iid and smooth queries (about 4 minutes)
    timeout 400 python benchmarks/selection_tiles.py --out "$OUT" 2>&1 | grep -v '^{' | tail -3
    python -c "import json; d=json.load(open('$OUT/selection_tiles.json')); [print(r['inputs'], r['varied'], r['scores'], r['choice_warp_scores'], r.get('layer_ms'), r.get('tokens_differing_from_default'), r.get('error', '')[:60]) for r in d['results']]" ;;
  write-programs)  # issue 17: the host write on 8, 16 and 32 programs (HF_NOSA_WRITE_PROGRAMS) beside the whole prompt's layers: dense sdpa, then generate's first token at 64K, batch 1, median of 3 each, and the query choice's time by kernel at 8 (about 4 minutes)
    timeout 60 python benchmarks/prefill.py --contexts 65536 --batches 1 --chunks 4096 --methods dense --repeat 3 --out "$OUT/p64" 2>&1 | tail -1
    for n in 8 16 32; do
      HF_NOSA_WRITE_PROGRAMS=$n timeout 60 python benchmarks/generate.py --shape 1b --contexts 65536 --methods nosa --nosa-batches 1 --new-tokens 16 --skip-engine --repeats 3 --out "$OUT/ttft_64k_b1_w$n.json" 2>&1 | grep -v '^{' | tail -1
    done
    HF_NOSA_WRITE_PROGRAMS=8 timeout 80 python benchmarks/prefill_breakdown.py --context 65536 --batch 1 --fetch-parts 1 --out "$OUT/b1_w8" 2>&1 | tail -9 ;;
  *)
    echo "usage: gpu_session.sh tests|generate-32k|generate-64k|memory-peak|prefill-breakdown|prefill-breakdown-b1|prefill-breakdown-8b|pinning|quoka-attention|generate-64k-chunk2048|fp8-engine-1b|fp8-fetch-blocks|fp8-engine-8b|fp8-generate-64k|fp8-generate-32k|generate-8b|prefill|prefill-8b|retrofit-profile|prefill-chunks|train-sparse|train-sparse-64k|train-split|train-step|train-sites|train-plan|train-verify|train-gaps|train-lengths-1b|train-lengths-8b|train-memory-8b|train-memory-32k|train-expandable|selection-tiles|prefill-whole|prefill-whole-2|prefill-whole-3|write-programs" >&2; exit 2 ;;
esac
