"""The ``hf-nosa`` command. Each subcommand lives in its own module with ``add_arguments(parser)`` and ``run(args)``."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Modules are imported only when their command runs.
COMMANDS = {
    "demo": ("hf_nosa.demo", "decode a long passkey prompt with NOSA offload on the embedded demo model"),
    "export": ("hf_nosa.hub.exporter", "write a NOSA model or retrofit adapter as a trust_remote_code checkpoint"),
    "push": ("hf_nosa.hub.publish", "verify an exported checkpoint and publish it to the Hub in one commit"),
    "retrofit": ("hf_nosa.retrofit", "retrofit a Llama/Qwen checkpoint into NOSA: LoRA + trained eviction heads"),
    "eval": ("hf_nosa.eval.runner", "synthetic long-context suite and perplexity with full attention, NOSA and baselines"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-nosa", description="Offload-native sparse attention for transformers.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except (ValueError, FileNotFoundError) as error:
        print(f"hf-nosa {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
