"""Copy a quality run into the repository: results into docs/, its exported model into the package.

    python experiments/quality/publish.py DIR                 # a GPU run: GPU section + demo model
    python experiments/quality/publish.py DIR --demo-only     # a CPU run: only the demo model and its section
    python experiments/quality/publish.py DIR --results-only  # a GPU run: only the GPU section; the demo stays

Writes docs/results/quality-<preset>.json (+ the two plots), rewrites the marked sections of docs/results.md, and
replaces hf_nosa/assets/demo_model with DIR/demo_model.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from report import NAMES, markdown, plots  # noqa: E402

MAX_ASSET_BYTES = 16 * 2**20


def _replace_section(text: str, name: str, body: str) -> str:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"docs/results.md has no {start} ... {end} markers")
    return pattern.sub(lambda _: f"{start}\n{body.strip()}\n{end}", text)


def _stages(results: dict) -> str:
    lines = []
    for name in ("pretrain", "retrofit", "control"):
        info = results["stages"].get(name)
        if info:
            extra = f", training attention backend {info['training_backend']}" if "training_backend" in info else ""
            lines.append(f"- {name}: {info['steps']} steps, {info['tokens'] / 1e6:.1f}M tokens in {info['seconds']:.0f}s, "
                         f"final loss {info['final_loss']:.3f}{extra}")
    return "\n".join(lines)


def _scrub(results: dict) -> dict:
    """The run's folder is a path of the machine it ran on: results name it DIR."""
    env = results["environment"]
    env["command"] = re.sub(r"--out(=|\s+)\S+", "--out DIR", env["command"])
    env["command"] = re.sub(r"--base(=|\s+)\S+", "--base BASE_DIR/base", env["command"])
    return results


def _environment(results: dict) -> str:
    env = results["environment"]
    versions = ", ".join(f"{k} {env[k]}" for k in ("python", "torch", "transformers", "triton") if k in env)
    return f"{env['device']}; {versions}; {env['date']}; `{env['command']}`"


def gpu_section(results: dict, stem: str) -> str:
    settings = results["settings"]
    model = settings["model"]
    parts = [
        f"Run: {_environment(results)} (preset `{results['preset']}`, {results['minutes']} minutes, finished "
        f"{'yes' if results.get('finished') else 'no'}).",
        "",
        f"Model: Llama architecture, {model['num_hidden_layers']} layers, hidden {model['hidden_size']}, "
        f"{model['num_attention_heads']} query / {model['num_key_value_heads']} KV heads of {model['head_dim']}, "
        f"byte tokenizer; {results['stages'].get('pretrain', {}).get('parameters', 0) / 1e6:.2f}M parameters.",
        "",
        _stages(results),
        "",
        markdown(results),
        f"![accuracy](results/{stem}-accuracy.png)",
        "",
        f"![traffic](results/{stem}-traffic.png)",
        "",
        f"Raw results: `docs/results/{stem}.json`.",
    ]
    if results.get("notes"):
        parts += ["", "Notes from the run:", ""] + [f"- {note}" for note in results["notes"]]
    return "\n".join(parts)


def demo_section(results: dict, demo: dict) -> str:
    rows = [r for r in results.get("evaluation", []) if r.get("label") in ("full_attention", "nosa") and "passkey" in r["tasks"]]
    table = ["| length | method | pass-key accuracy | locality |", "|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["length"], r["label"])):
        locality = f"{r['locality']:.3f}" if r.get("locality") is not None else "-"
        table.append(f"| {r['length']} | {NAMES.get(r['label'], r['label'])} | {r['tasks']['passkey']:.2f} | {locality} |")
    accuracy = demo.get("passkey_accuracy")
    verdict = ("does not retrieve the pass key" if not accuracy else
               f"retrieves the pass key in {100 * accuracy:.0f}% of the evaluated prompts")
    given = results["stages"].get("pretrain", {}).get("given_base")
    return "\n".join([
        ("The base model was pretrained by an earlier run of the same preset (BASE_DIR); this run retrofitted it. "
         if given else "") +
        f"`hf_nosa/assets/demo_model` comes from `experiments/quality/run.py --preset {results['preset']}` "
        f"({_environment(results)}). `hf-nosa demo` uses a {demo['context_tokens']}-token prompt and a "
        f"{demo['budget_tokens']}-token budget by default. With NOSA at that budget the model {verdict}.",
        "",
        _stages(results),
        "",
        *table,
    ])


def _publish_results(results: dict) -> str:
    """Write docs/results/quality-<preset>.json and its plots; return the GPU section of docs/results.md."""
    stem = f"quality-{results['preset']}"
    out = ROOT / "docs" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    for path in plots(results, out):
        path.rename(out / f"{stem}-{path.name}")
    return gpu_section(results, stem)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--demo-only", action="store_true", help="install the demo model and its section only")
    which.add_argument("--results-only", action="store_true", help="write the GPU section only; keep the demo model")
    args = parser.parse_args(argv)
    run = Path(args.run_dir)
    results = _scrub(json.loads((run / "results.json").read_text()))
    doc_path = ROOT / "docs" / "results.md"
    doc = doc_path.read_text()
    if args.results_only:
        doc_path.write_text(_replace_section(doc, "gpu-results", _publish_results(results)))
        print(f"updated {doc_path.relative_to(ROOT)} and docs/results/quality-{results['preset']}*")
        return 0
    demo_dir = run / "demo_model"
    if not (demo_dir / "config.json").is_file():
        raise SystemExit(f"{demo_dir} holds no exported model")
    size = sum(f.stat().st_size for f in demo_dir.rglob("*") if f.is_file())
    if size > MAX_ASSET_BYTES:
        raise SystemExit(f"{demo_dir} is {size / 2**20:.1f} MiB; the package keeps its demo model under 16 MiB")
    if not args.demo_only:
        doc = _replace_section(doc, "gpu-results", _publish_results(results))
    demo = json.loads((demo_dir / "demo.json").read_text())
    doc = _replace_section(doc, "demo-model", demo_section(results, demo))
    doc_path.write_text(doc)
    asset = ROOT / "hf_nosa" / "assets" / "demo_model"
    if asset.exists():
        shutil.rmtree(asset)
    shutil.copytree(demo_dir, asset)
    print(f"installed {demo_dir} ({size / 2**20:.2f} MiB) as {asset.relative_to(ROOT)}; updated {doc_path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
