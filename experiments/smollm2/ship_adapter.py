"""Ship a SmolLM2 retrofit adapter in the package, where ``hf-nosa demo --model smollm2`` applies it.

    python experiments/smollm2/ship_adapter.py .smollm2/back/adapter.tar        # or the adapter folder
    python experiments/smollm2/ship_adapter.py adapter.tar --resident-margin 1  # decode with a sticky selection

Copies the three files the demo needs (``SHIPPED``: the PEFT config, the weights with LoRA and the eviction heads,
and ``nosa_retrofit.json`` with the NosaConfig) from ``adapter.tar`` of ``gpu.sh retrofit`` (or a folder
``hf-nosa retrofit`` wrote) into ``hf_nosa/assets/smollm2_adapter``, after checking that it is a SmolLM2 adapter with an
eviction head in each of the 30 layers. The PEFT config names the base by the path of the GGUF file on the machine
that trained it; the shipped copy names it ``smollm2``, what ``hf_nosa.modeling.loading`` resolves anywhere. ``--resident-margin``
sets ``NosaConfig.resident_margin`` in the shipped ``nosa_retrofit.json`` (decoding only: training ignores it, so an
adapter trained without it may ship with it); the record keeps what the run trained with under ``trained_nosa_config``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
from pathlib import Path

SHIPPED = ("adapter_config.json", "adapter_model.safetensors", "nosa_retrofit.json")
TARGET = Path(__file__).resolve().parents[2] / "hf_nosa" / "assets" / "smollm2_adapter"
LAYERS = 30  # SmolLM2-135M


def read_files(source: Path) -> dict[str, bytes]:
    """The ``SHIPPED`` files of an adapter folder or tar, as bytes."""
    if source.is_dir():
        found = {name: (source / name).read_bytes() for name in SHIPPED if (source / name).is_file()}
    else:
        with tarfile.open(source) as tar:
            members = {Path(m.name).name: m for m in tar.getmembers() if m.isfile()}
            found = {name: tar.extractfile(members[name]).read() for name in SHIPPED if name in members}
    missing = [name for name in SHIPPED if name not in found]
    if missing:
        raise ValueError(f"{source} lacks {missing}: not an adapter hf-nosa retrofit wrote")
    return found


def check(files: dict[str, bytes]) -> dict:
    """The run of a SmolLM2 retrofit adapter; errors name what does not fit."""
    from safetensors.torch import load

    run = json.loads(files["nosa_retrofit.json"])
    config = json.loads(files["adapter_config.json"])
    if run.get("family") != "llama" or run.get("recipe", {}).get("model") != "smollm2":
        raise ValueError(f"the adapter was trained on {run.get('recipe', {}).get('model')!r} ({run.get('family')}), "
                         "not on smollm2")
    if config.get("modules_to_save") != ["eviction_head"]:
        raise ValueError(f"adapter_config.json modules_to_save={config.get('modules_to_save')!r}; the eviction heads "
                         "must be saved with the adapter (['eviction_head'])")
    weights = load(files["adapter_model.safetensors"])
    layers = {key.split(".eviction_head.")[0] for key in weights if ".eviction_head." in key}
    if len(layers) != LAYERS:
        raise ValueError(f"the adapter holds eviction heads for {len(layers)} layers; SmolLM2 has {LAYERS}")
    return run


def ship(source: Path, target: Path = TARGET, resident_margin: float | None = None) -> dict:
    """Check the adapter at ``source`` and write its ``SHIPPED`` files into ``target``; returns its run (with
    ``resident_margin``, when given, in its nosa_config)."""
    from hf_nosa import NosaConfig

    files = read_files(Path(source))
    run = check(files)
    if resident_margin is not None:
        trained = NosaConfig.from_dict(run["nosa_config"])
        run["trained_nosa_config"] = trained.to_dict()
        run["nosa_config"] = trained.replace(resident_margin=resident_margin).to_dict()  # validates the value
        files["nosa_retrofit.json"] = (json.dumps(run, indent=2) + "\n").encode()
    config = json.loads(files["adapter_config.json"])
    config["base_model_name_or_path"] = "smollm2"
    files["adapter_config.json"] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    target.mkdir(parents=True, exist_ok=True)
    for name, blob in files.items():
        (target / name).write_bytes(blob)
    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="adapter.tar of gpu.sh retrofit, or an adapter folder")
    parser.add_argument("--to", type=Path, default=TARGET, help="where the package ships it")
    parser.add_argument("--resident-margin", type=float, default=None,
                        help="NosaConfig.resident_margin the shipped adapter decodes with (default: the run's)")
    args = parser.parse_args(argv)
    run = ship(args.source, args.to, args.resident_margin)
    size = sum((args.to / name).stat().st_size for name in SHIPPED)
    print(f"{args.to}: {', '.join(SHIPPED)} ({size / 2**20:.1f} MiB); {run['steps']} retrofit steps, final loss "
          f"{run['final_loss']:.3f}, NosaConfig budget {run['nosa_config']['budget_tokens']}, resident_margin "
          f"{run['nosa_config'].get('resident_margin', 0.0)}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as error:
        print(f"ship_adapter.py: error: {error}", file=sys.stderr)
        sys.exit(2)
