"""The ``hf-nosa`` command.

Each command's arguments are defined in ``hf_nosa.cli_args`` (argparse only) and its work in a module with
``run(args)``, imported only when the command runs: ``hf-nosa --help`` and ``hf-nosa COMMAND --help`` load neither
torch nor transformers.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from . import cli_args

# name -> (module with run(args), arguments in cli_args, one-line help)
COMMANDS = {
    "demo": ("hf_nosa.demo", cli_args.demo,
             "decode a long passkey prompt with NOSA offload on the embedded demo model"),
    "export": ("hf_nosa.hub.exporter", cli_args.export,
               "write a NOSA model or retrofit adapter as a trust_remote_code checkpoint"),
    "verify": ("hf_nosa.hub.verify", cli_args.verify,
               "check an exported checkpoint without running its code, and list what push would upload"),
    "push": ("hf_nosa.hub.publish", cli_args.push,
             "verify an exported checkpoint and publish the files export wrote to the Hub in one commit"),
    "retrofit": ("hf_nosa.retrofit", cli_args.retrofit,
                 "retrofit a Llama/Qwen checkpoint into NOSA: LoRA + trained eviction heads"),
    "eval": ("hf_nosa.eval.runner", cli_args.eval,
             "synthetic long-context suite and perplexity with full attention, NOSA and baselines"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-nosa", description="Offload-native sparse attention for transformers.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, arguments, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text, formatter_class=cli_args.HelpFormatter)
        command.set_defaults(_module=module_name)
        arguments(command)
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
