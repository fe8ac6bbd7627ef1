"""Pass-key accuracy of SmolLM2 + the shipped adapter under the default prefill ("auto": QUOKA beyond the prefill
budget) as ``NosaConfig.prefill_batch_tokens`` lengthens the prefill chunks of a small batch.

Each ``--batch-tokens`` value is one row: the passkey task at ``--length`` tokens, ``--samples`` prompts (``--seed``),
decoded ``--batch`` at a time through a NosaCache with the adapter's layout. Rows are appended to ``--results`` as
they end (the file is re-read before each write, so two processes may share it), with the chunk each row's batch
took, its locality, bytes moved per token and seconds.

Example (CPU, one thread):
    OMP_NUM_THREADS=1 python experiments/smollm2/prefill_chunks.py --batch-tokens 0 2048 --length 8192 \
        --samples 8 --seed 1 --results docs/results/smollm2-prefill-batch-tokens-cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch
import transformers

from hf_nosa import NosaConfig
from hf_nosa.eval.runner import evaluate_tasks
from hf_nosa.modeling.loading import load_causal_lm
from hf_nosa.training.retrofit import merge_adapter

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.environment
from benchmarks.environment import source_commit  # noqa: E402

ADAPTER = Path(__file__).resolve().parents[2] / "hf_nosa" / "assets" / "smollm2_adapter"



def _append(path: Path, row: dict, header: dict) -> None:
    data = json.loads(path.read_text()) if path.is_file() else {**header, "rows": []}
    data["rows"].append(row)
    path.write_text(json.dumps(data, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-tokens", type=int, nargs="+", required=True, help="prefill_batch_tokens values")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    parser.add_argument("--results", type=Path, required=True)
    args = parser.parse_args()

    base, tokenizer = load_causal_lm("smollm2")
    model = merge_adapter(ADAPTER, base_model=base)
    layout = json.loads((ADAPTER / "nosa_retrofit.json").read_text())["nosa_config"]
    header = {"what": f"SmolLM2-135M-Instruct with the shipped adapter, passkey at {args.length} tokens, "
                      f"{args.samples} prompts (seed {args.seed}), batch {args.batch}, NOSA with prefill='auto' (QUOKA) "
                      "and the adapter's layout, by prefill_batch_tokens",
              "command": "python experiments/smollm2/prefill_chunks.py " + " ".join(
                  f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                  for k, v in vars(args).items()),
              "device": f"cpu, fp32, {torch.get_num_threads()} thread(s)", "commit": source_commit(),
              "date": date.today().isoformat(), "torch": torch.__version__, "transformers": transformers.__version__,
              "python": platform.python_version()}
    for batch_tokens in args.batch_tokens:
        cfg = NosaConfig.from_dict({**layout, "prefill": "auto", "prefill_batch_tokens": batch_tokens})
        began = time.perf_counter()
        row = evaluate_tasks(model, tokenizer, tasks=["passkey"], length=args.length, method="nosa", nosa_config=cfg,
                             samples=args.samples, seed=args.seed, batch_size=args.batch)
        row.pop("examples", None)
        row.update(seconds=time.perf_counter() - began, prefill_batch_tokens=batch_tokens, batch=args.batch,
                   length=args.length, seed=args.seed, prefill_chunk=cfg.prefill_chunk(args.batch),
                   commit=header["commit"])
        _append(args.results, row, header)
        print(f"prefill_batch_tokens={batch_tokens} chunk={cfg.prefill_chunk(args.batch)}: "
              f"{row['tasks']['passkey']:.3f} locality={row.get('locality', float('nan')):.3f} "
              f"in {row['seconds']:.0f}s", flush=True)


if __name__ == "__main__":
    main()
