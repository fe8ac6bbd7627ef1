"""The ``hf-nosa`` command.

Each command's arguments are defined in ``hf_nosa.cli.args`` (argparse only) and its work in a module with
``run(args)``, imported only when the command runs: ``hf-nosa --help`` and ``hf-nosa COMMAND --help`` load neither
torch nor transformers. Before a command runs, the optional packages its arguments call for (``needed_packages``)
are looked up, so that a missing one is a single line naming the extra to install, before any download.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

from . import args as cli_args

# name -> (module with run(args), arguments in cli_args, one-line help)
COMMANDS = {
    "demo": ("hf_nosa.cli.demo", cli_args.demo,
             "decode a long passkey prompt with NOSA offload on the embedded demo model"),
    "export": ("hf_nosa.hub.exporter", cli_args.export,
               "write a NOSA model or retrofit adapter as a trust_remote_code checkpoint"),
    "verify": ("hf_nosa.hub.verify", cli_args.verify,
               "check an exported checkpoint without running its code, and list what push would upload"),
    "push": ("hf_nosa.hub.publish", cli_args.push,
             "verify an exported checkpoint and publish the files export wrote to the Hub in one commit"),
    "retrofit": ("hf_nosa.training.retrofit", cli_args.retrofit,
                 "retrofit a Llama/Qwen checkpoint into NOSA: LoRA + trained eviction heads"),
    "eval": ("hf_nosa.eval.runner", cli_args.eval,
             "synthetic long-context suite and perplexity with full attention, NOSA and baselines"),
}


# optional package -> the extra of pyproject.toml that brings it
EXTRAS = {"gguf": "gguf", "datasets": "train"}


def _models(args: argparse.Namespace) -> list[str]:
    """The model names a command will load: ``--model``/``--base-model``, a retrofit recipe's model and a retrofit
    adapter's recorded base (export)."""
    names = [getattr(args, "model", None), getattr(args, "base_model", None)]
    if args.command == "retrofit":
        from ..training.recipe import load_recipe

        names.append(load_recipe(args.recipe)["model"])
    if args.command == "export" and (Path(args.source) / "nosa_retrofit.json").is_file():
        from ..hub.adapter import read_retrofit_record

        names.append(read_retrofit_record(Path(args.source))["base_model"])
    return [name for name in names if isinstance(name, str)]


def needed_packages(args: argparse.Namespace) -> dict[str, str]:
    """Optional package -> what needs it, for the command ``args`` describe: ``gguf`` for a GGUF model (``smollm2``
    or a ``.gguf`` file), ``datasets`` for retrofit data read from files. Read from the arguments alone (and a recipe
    or adapter record), before any model loads or file downloads."""
    from ..modeling.loading import is_gguf

    needed = {}
    gguf = [name for name in _models(args) if is_gguf(name)]
    if gguf:
        needed["gguf"] = f"the GGUF model {gguf[0]!r}"
    if args.command == "retrofit":
        from ..training.recipe import load_recipe
        from ..training.data import BUILTIN_DATA

        data = args.data or load_recipe(args.recipe)["data"]
        if data is not None and str(data) not in BUILTIN_DATA:
            needed["datasets"] = f"retrofit data from files ({data})"
    return needed


def missing_extra(args: argparse.Namespace) -> str | None:
    """The one-line error for the first optional package the command needs and the environment lacks, or None."""
    for package, why in needed_packages(args).items():
        if importlib.util.find_spec(package) is None:
            return (f"{why} needs the {package} package, which is not installed: pip install "
                    f'"hf-nosa[{EXTRAS[package]}]"')
    return None


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
    try:
        missing = missing_extra(args)
        if missing:
            raise ValueError(missing)
        module = importlib.import_module(args._module)
        return int(module.run(args) or 0)
    except ModuleNotFoundError as error:
        if error.name not in EXTRAS:
            raise
        print(f"hf-nosa {args.command}: error: this command needs the {error.name} package, which is not "
              f'installed: pip install "hf-nosa[{EXTRAS[error.name]}]"', file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as error:
        print(f"hf-nosa {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
