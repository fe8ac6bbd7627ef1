#!/usr/bin/env bash
# One device call of a GPU session: `bash benchmarks/gpu_session.sh PHASE` with results under $OUT. Each phase
# re-measures a headline of the README or of the latest entries of docs/benchmarks.md through `python -m benchmarks`
# (the suites: `python -m benchmarks --help`); results worth keeping go to docs/results/ as YYYY-MM-DD_<name>, then
# `python benchmarks/results_index.py`. Phases of earlier sessions are in the git history of this file.
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
  tests)          # the GPU-marked tests, 8 processes (Triton compilation dominates: about 4 minutes in one)
    # -v names every test as it ends; HF_NOSA_FAILURES keeps each failure's traceback even if the call is cut short
    HF_NOSA_FAILURES="$OUT/gpu_tests_failures.log" timeout 570 python -m pytest -v -m gpu tests/ -n "${TEST_WORKERS:-12}" \
      -p no:cacheprovider --tb=short --durations=20 > "$OUT/gpu_tests_full.log" 2>&1
    grep -E "FAILED|ERROR" "$OUT/gpu_tests_full.log" | tail -20; tail -25 "$OUT/gpu_tests_full.log" ;;
  generate-32k)   # README "Generate throughput", 32K: DynamicCache, static + compile and NOSA at their largest batches and at batch 1 (about 8 minutes)
    timeout 570 python -m benchmarks generate --shape 1b --contexts 32768 --batch1 --out "$OUT/generate_32k.json" 2>&1 | tee "$OUT/generate_32k.log" | grep -v '^{' ;;
  generate-64k)   # README "Generate throughput", 64K rows (about 8 minutes)
    timeout 570 python -m benchmarks generate --shape 1b --contexts 65536 --batch1 --out "$OUT/generate_64k.json" 2>&1 | tee "$OUT/generate_64k.log" | grep -v '^{' ;;
  generate-8b)    # docs/benchmarks.md "The user's path": the 8b shape at 32K (48 GB cap)
    timeout 570 python -m benchmarks generate --shape 8b --contexts 32768 --batch1 --out "$OUT/generate_8b_32k.json" 2>&1 | tee "$OUT/generate_8b.log" | grep -v '^{' ;;
  ttft)           # README "Time to first token": dense sdpa and QUOKA (whole prompt) at 64K (batches 1, 4) and 128K (batch 1), then generate's first token at each, median of 3 (about 7 minutes)
    timeout 100 python -m benchmarks prefill --contexts 65536 --batches 1,4 --chunks 4096 --methods dense,quoka_whole --repeat 3 --out "$OUT/p64" 2>&1 | tail -4
    timeout 90 python -m benchmarks prefill --contexts 131072 --batches 1 --chunks 4096 --methods dense,quoka_whole --repeat 2 --out "$OUT/p128" 2>&1 | tail -2
    timeout 60 python -m benchmarks generate --shape 1b --contexts 65536 --methods nosa --nosa-batches 1 --new-tokens 16 --skip-engine --repeats 3 --out "$OUT/ttft_64k_b1.json" 2>&1 | grep -v '^{' | tail -1
    timeout 60 python -m benchmarks generate --shape 1b --contexts 65536 --methods nosa --nosa-batches 4 --new-tokens 16 --skip-engine --repeats 3 --out "$OUT/ttft_64k_b4.json" 2>&1 | grep -v '^{' | tail -1
    timeout 60 python -m benchmarks generate --shape 1b --contexts 131072 --methods nosa --nosa-batches 1 --new-tokens 16 --skip-engine --repeats 3 --out "$OUT/ttft_128k_b1.json" 2>&1 | grep -v '^{' | tail -1 ;;
  train)          # README "Retrofit step": NOSA's step against dense sdpa, 1b at 32K and 64K, 8b at 64K (expandable segments, as retrofit runs; the 8b step wants an H200; about 8 minutes)
    timeout 200 python -m benchmarks train --shapes 1b --lengths 32768,65536 --backends sparse --steps-only --out "$OUT/train_1b" 2>&1 | grep -E '"kind": "model_step"' | cut -c1-150
    timeout 300 python -m benchmarks train --shapes 8b --lengths 65536 --backends sparse --steps-only --out "$OUT/train_8b" 2>&1 | grep -E '"kind": "model_step"' | cut -c1-150 ;;
  train-lengths-1b)  # docs/benchmarks.md "By length": the retrofit step at 16K, 32K and 64K (1b), one layer's sparse attention beside dense and its tile coverage per length (about 8 minutes)
    timeout 560 python -m benchmarks train --shapes 1b --lengths 16384,32768,65536 --backends sparse --out "$OUT/train_lengths_1b" 2>&1 | grep -E '"kind": "model_step"' | cut -c1-150 ;;
  train-lengths-8b)  # the same steps in the 8b shape where memory allows (a length that does not fit is recorded as oom; about 8 minutes)
    timeout 560 python -m benchmarks train --shapes 8b --lengths 16384,32768,65536 --backends sparse --steps-only --out "$OUT/train_lengths_8b" 2>&1 | grep -E '"kind": "model_step"' | cut -c1-150 ;;
  train-memory-8b)  # docs/benchmarks.md "By length": the 8b step's memory at 64K event by event, NOSA with the default allocator, then NOSA and dense with expandable segments (an H200; about 6 minutes)
    PYTORCH_ALLOC_CONF=expandable_segments:False timeout 200 python -m benchmarks train memory --shape 8b --length 65536 --modes nosa --steps 1 --out "$OUT" --tag default 2>&1 | grep -E '^\{' | cut -c1-1500
    timeout 340 python -m benchmarks train memory --shape 8b --length 65536 --modes nosa,dense --out "$OUT" --tag expandable 2>&1 | grep -E '^\{' | cut -c1-1500 ;;
  serve)          # continuous batching: the GPU serving tests (and the selection kernels' GPU cases: capacities are sized to a request's length), then a saturating stream of 16 requests of 16K-64K (1024 new tokens) through the manager, stock against NOSA (docs/serving.md). SERVE_REQUESTS, SERVE_MIN / SERVE_MAX (131072 both: the 128K run), SERVE_NEW_TOKENS, SERVE_METHODS (nosa-eager: without its step graphs), SERVE_RATES (Poisson loads, default inf), SERVE_PROFILE=0 (no profile window), SERVE_EXTRA (more serve.py flags, e.g. --nosa-config max_batch_tokens=65536), SERVE_DEADLINE (a cut stream stops hard), SERVE_DECODE_ROWS, SERVE_SHAPE (8b: the 48 GB cap) change it. Serving needs transformers >= 5.18: carry the wheels (transformers, and huggingface_hub and tokenizers if the machine's are older than it needs) in build/serving_wheels and set SERVING_WHEELS=../build/serving_wheels from a .bench snapshot
    wheels="${SERVING_WHEELS:-build/serving_wheels}"
    if [ -d "$wheels" ]; then
      pip install -q --no-deps --target /tmp/serving_tf "$wheels"/*.whl 2>&1 | tail -2
      export PYTHONPATH="/tmp/serving_tf:$PYTHONPATH"
    fi
    python -c "import transformers; print('transformers', transformers.__version__)"
    [ "${SERVE_TEST_TIMEOUT:-150}" = 0 ] || timeout "${SERVE_TEST_TIMEOUT:-150}" python -m pytest -q tests/test_serving_gpu.py tests/kernels/test_block_scores.py -m gpu -p no:cacheprovider --tb=short 2>&1 | tee "$OUT/gpu_tests_serving.log" | tail -6
    timeout "${SERVE_TIMEOUT:-400}" python -m benchmarks serve --shape "${SERVE_SHAPE:-1b}" --requests "${SERVE_REQUESTS:-16}" --min "${SERVE_MIN:-16384}" --max "${SERVE_MAX:-65536}" --new-tokens "${SERVE_NEW_TOKENS:-1024}" --rates ${SERVE_RATES:-inf} --methods "${SERVE_METHODS:-nosa,stock}" ${SERVE_DEADLINE:+--deadline "$SERVE_DEADLINE"} ${SERVE_DECODE_ROWS:+--decode-rows "$SERVE_DECODE_ROWS"} ${SERVE_EXTRA:-} $([ "${SERVE_PROFILE:-1}" = 0 ] || echo --profile "$OUT/serve_profile" --profile-after "${SERVE_PROFILE_AFTER:-60}") --out "$OUT/serve_${SERVE_SHAPE:-1b}.json" 2>&1 | tee "$OUT/serve_${SERVE_SHAPE:-1b}.log" | grep -v Warning | tail -6 ;;
  turn-profile)   # docs/benchmarks.md "Conversations": where the batch-8 turn's time goes (torch.profiler tables under $OUT/turn-b8-*), one conversation (about 2 minutes)
    timeout 300 python -m benchmarks conversation --shape 1b --batches 8 --repeats 1 --profile "$OUT/turn" --out "$OUT/conversation_b8.json" 2>&1 | grep -v Warning | tail -3 ;;
  turn-read)      # docs/benchmarks.md "A turn's host growth": the dense tail's read paths swept (kernel blocks x warps, the copy engine), then the batch-8 turn read with the best, and the read paths' GPU tests (about 4 minutes)
    timeout 60 python -m pytest -q -m gpu tests/kernels/test_host_read.py tests/test_pinned.py -p no:cacheprovider 2>&1 | tail -2
    timeout 150 python -m benchmarks prefill read --out "$OUT/host_read.json" 2>&1 | grep -v Warning | tail -16
    timeout 330 python -m benchmarks conversation --shape 1b --batches 8 --read-setting "$OUT/host_read.json" --out "$OUT/conversation_b8_read.json" 2>&1 | grep -v Warning | grep '^{"batch' | cut -c1-400 ;;
  conversation-tests)  # docs/benchmarks.md "Conversations": a new turn on a reused cache and atomic turns on the kernels, with the decode-graph and whole-prompt GPU tests (about 4 minutes)
    timeout 560 python -m pytest -q -m gpu tests/test_conversations.py tests/test_gpu_generate.py tests/test_whole_prompt.py -p no:cacheprovider --tb=short > "$OUT/gpu_tests_conversations.log" 2>&1
    tail -30 "$OUT/gpu_tests_conversations.log" ;;
  conversation)   # docs/benchmarks.md "Conversations": a 4096-token turn on a 60K conversation, batch 1 and 8, against re-prefilling it (about 5 minutes)
    timeout 560 python -m benchmarks conversation --shape 1b --batches 1 8 --out "$OUT/conversation.json" 2>&1 | tee "$OUT/conversation.log" | grep -v Warning | tail -8 ;;
  request-stream)  # docs/benchmarks.md "Conversations": 10 batch-1 requests of 8K-64K, 128 new tokens each, stock static + compile against NOSA, each call against its repeat, Triton's cache empty as on a fresh machine (about 6 minutes)
    TRITON_CACHE_DIR="$(mktemp -d)" timeout "${STREAM_TIMEOUT:-570}" python -m benchmarks conversation stream --shape 1b --methods ${STREAM_METHODS:-static nosa} --out "$OUT/request_stream.json" 2>&1 | tee "$OUT/request_stream.log" | grep -v Warning | tail -8 ;;
  *)
    echo "usage: gpu_session.sh tests|generate-32k|generate-64k|generate-8b|ttft|train|train-lengths-1b|train-lengths-8b|train-memory-8b|serve|turn-profile|turn-read|conversation-tests|conversation|request-stream" >&2; exit 2 ;;
esac
