"""Export and Hub publishing: exported checkpoints load in a fresh process through remote code and decode exactly
like the in-process model; adapters export bit-exactly; push goes through the real Hub client to a loopback
server; bad inputs fail clearly and write nothing."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file

import hf_nosa
from hf_nosa.hub import export, load_metrics, register_auto_classes, verify_folder
from hf_nosa.modeling import eviction_heads, randomize_eviction_heads

from .conftest import tiny_model
from .loopback_hub import LoopbackHub

NOSA = dict(block_size=16, budget_tokens=64, query_tokens=16, sink_tokens=16, local_tokens=16,
            compress_kernel=8, compress_stride=4)
PROMPT, NEW = 150, 8  # prompt > budget: selection and the eviction heads decide what is attended
EXPECTED_FILES = {
    "README.md", "config.json", "generation_config.json", "model.safetensors",
    "custom_generate/generate.py", "custom_generate/requirements.txt", "nosa_export.json",
}
REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (tests/conftest.py)


def nosa_model(family, seed=0):
    model = hf_nosa.to_nosa(tiny_model(family, seed=seed), hf_nosa.NosaConfig(**NOSA))
    return randomize_eviction_heads(model, scale=2.0)


def greedy(model, ids, **kwargs):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, **kwargs)


def tensors(folder):
    out = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def fresh_env(tmp):
    """Environment of a fresh Python: its own HF home (remote-code module cache), no token, no endpoint.

    custom_generate/requirements.txt names hf-nosa, which transformers checks through the installed metadata; a
    source checkout run with PYTHONPATH=. has none, so it gets a minimal dist-info here.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    paths = [str(REPO_ROOT)]
    try:
        importlib.metadata.version("hf-nosa")
    except importlib.metadata.PackageNotFoundError:
        info = tmp / "site" / f"hf_nosa-{hf_nosa.__version__}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: hf-nosa\nVersion: {hf_nosa.__version__}\n")
        paths.append(str(tmp / "site"))
    env.update(HF_HOME=str(tmp / "hf_home"), PYTHONPATH=os.pathsep.join(paths), TOKENIZERS_PARALLELISM="false")
    return env


def run_python(code, args, env, timeout=240):
    result = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_nothing_written(out_dir):
    assert not out_dir.exists()
    assert not [p.name for p in out_dir.parent.iterdir() if p.name.startswith(f".{out_dir.name}.")]


# --------------------------------------------------------------------------- in-process export


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """One exported checkpoint per family, with the in-process greedy NOSA decode of a random prompt."""
    root = tmp_path_factory.mktemp("exports")
    ids = torch.randint(3, 97, (1, PROMPT))
    out = {"root": root, "ids": ids}
    for family in ("llama", "qwen2", "qwen3"):
        model = nosa_model(family)
        export(model, root / family)
        out[family] = {"nosa": greedy(model, ids, cache_implementation="nosa"), "logits": model(ids).logits}
    stock = tiny_model("llama", seed=3)
    stock.save_pretrained(root / "stock")
    out["stock_plain"] = greedy(stock, ids)
    hf_nosa.to_nosa(stock)
    out["stock_nosa"] = greedy(stock, ids, cache_implementation="nosa", cache_config=NOSA)
    export(nosa_model("llama"), root / "too_new", hf_nosa_requirement=">=99.0")
    torch.save({k: v for k, v in out.items() if k != "root"}, root / "reference.pt")
    return out


def test_export_layout_config_and_card(exports):
    folder = exports["root"] / "qwen3"
    files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert files == EXPECTED_FILES | {"configuration_nosa_qwen3.py", "modeling_nosa_qwen3.py"}
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "nosa_qwen3"
    assert config["architectures"] == ["NosaQwen3ForCausalLM"]
    assert config["auto_map"] == {
        "AutoConfig": "configuration_nosa_qwen3.NosaQwen3Config",
        "AutoModelForCausalLM": "modeling_nosa_qwen3.NosaQwen3ForCausalLM",
    }
    assert hf_nosa.NosaConfig.from_dict(config["nosa"]) == hf_nosa.NosaConfig(**NOSA)
    assert "cache_implementation" not in json.loads((folder / "generation_config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    assert {f"model.layers.{i}.self_attn.eviction_head.{p}" for i in range(2) for p in ("A", "delta.weight")} <= set(
        weights
    )
    code = (folder / "modeling_nosa_qwen3.py").read_text()
    assert "import hf_nosa" in code and "HF_NOSA_REQUIREMENT" in code
    assert (folder / "custom_generate/requirements.txt").read_text().strip() == f"hf-nosa>={hf_nosa.__version__}"
    card = ModelCard.load(folder / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert {"nosa", "sparse-attention", "kv-cache-offload"} <= set(card.data.tags)
    assert "| `budget_tokens` | `64` |" in card.text and 'cache_implementation="nosa"' in card.text
    assert verify_folder(folder)["family"] == "qwen3"


def test_register_auto_classes_loads_without_remote_code(exports):
    from transformers import AutoModelForCausalLM

    register_auto_classes()
    register_auto_classes()  # idempotent
    model = AutoModelForCausalLM.from_pretrained(str(exports["root"] / "llama"))
    assert type(model).__name__ == "NosaLlamaForCausalLM" and len(eviction_heads(model)) == 2
    assert torch.equal(greedy(model, exports["ids"], cache_implementation="nosa"), exports["llama"]["nosa"])


def test_stock_checkpoint_in_nosa_class_gets_untrained_heads(exports):
    from hf_nosa.modeling.remote import NosaLlamaForCausalLM

    model = NosaLlamaForCausalLM.from_pretrained(str(exports["root"] / "stock"))
    assert all(bool((head.A == 0).all()) for head in eviction_heads(model).values())
    assert torch.equal(greedy(model, exports["ids"]), exports["stock_plain"])


def _tiny_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(97)}, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w3", pad_token="w0").save_pretrained(str(folder))


def test_export_from_saved_folder_finds_tokenizer_license_and_metrics(tmp_path):
    from transformers import AutoTokenizer

    source = tmp_path / "converted"
    nosa_model("qwen2").save_pretrained(source)
    _tiny_tokenizer(source)
    (source / "README.md").write_text("---\nlicense: mit\n---\n# base\n")
    metrics = [{"task": "passkey-8k", "full_attention": 1.0, "nosa": 0.96875}, {"task": "ppl", "nosa": 3.21}]
    (tmp_path / "metrics.json").write_text(json.dumps({"results": metrics}))
    out = export(source, tmp_path / "out", metrics=tmp_path / "metrics.json", repo_id="me/nosa-tiny",
                 base_model_id="org/tiny-qwen2")
    assert AutoTokenizer.from_pretrained(str(out))("w5 w7")["input_ids"] == [5, 7]
    card = ModelCard.load(out / "README.md")
    assert card.data.license == "mit"
    assert card.data.base_model == "org/tiny-qwen2" and card.data.base_model_relation == "finetune"
    assert "| passkey-8k | 1 | 0.9688 |" in card.text and "| ppl |  | 3.21 |" in card.text
    assert 'repo = "me/nosa-tiny"' in card.text
    assert tensors(out).keys() == tensors(source).keys()
    assert all(torch.equal(tensors(out)[k], v) for k, v in tensors(source).items())


def test_model_from_a_hub_id_takes_base_license_and_tokenizer_from_the_local_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--org--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    _tiny_tokenizer(repo / "snapshots" / commit)
    (repo / "snapshots" / commit / "README.md").write_text("---\nlicense: llama3.2\n---\n# tiny\n")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    model = nosa_model("llama")
    model.config._name_or_path = "org/tiny-llama"  # as from_pretrained("org/tiny-llama") leaves it
    out = export(model, tmp_path / "out")
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "org/tiny-llama" and card.data.license == "llama3.2"
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()


def test_sharded_export_and_generation_config_without_nosa(tmp_path):
    from transformers import GenerationConfig

    model = nosa_model("qwen3")
    model.generation_config.cache_implementation = "nosa"  # accepted in-process, refused by stock transformers
    out = export(model, tmp_path / "out", max_shard_size="100KB")
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    assert verify_folder(out)["tensors"] == len(model.state_dict())
    assert all(torch.equal(tensors(out)[k], v) for k, v in model.state_dict().items())
    assert "cache_implementation" not in json.loads((out / "generation_config.json").read_text())
    assert GenerationConfig.from_pretrained(str(out)).cache_implementation is None


def test_load_metrics_shapes():
    assert load_metrics({"a": 1, "b": {"x": 2}}) == [{"task": "a", "value": 1}, {"task": "b", "x": 2}]
    with pytest.raises(ValueError, match="metrics"):
        load_metrics({"a": [1, 2]})


# --------------------------------------------------------------------------- adapters


def _adapter(tmp_path, family="llama"):
    """A retrofit adapter folder (PEFT LoRA + eviction heads + nosa_retrofit.json) and its in-process merge."""
    from peft import LoraConfig, get_peft_model

    base_dir = tmp_path / f"base_{family}"
    tiny_model(family, seed=1).save_pretrained(base_dir)
    model = hf_nosa.to_nosa(tiny_model(family, seed=1), hf_nosa.NosaConfig(**NOSA))
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      modules_to_save=["eviction_head"], init_lora_weights=False)
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "modules_to_save" in name:
                param.copy_(torch.randn_like(param))
    adapter_dir = tmp_path / "adapter"
    peft_model.save_pretrained(adapter_dir)
    recipe = {"model": str(base_dir), "description": "tiny test recipe", "nosa": NOSA, "lora": {"r": 4, "alpha": 8},
              "seq_len": 256, "steps": 30}
    record = {"base_model": str(base_dir), "family": family, "nosa_config": NOSA, "recipe": recipe, "steps": 30,
              "final_loss": 2.5, "tokens_per_second": 1234.5, "hf_nosa_version": hf_nosa.__version__}
    (adapter_dir / "nosa_retrofit.json").write_text(json.dumps(record))
    return adapter_dir, peft_model.merge_and_unload()


def test_export_from_adapter_equals_export_from_merged_model(tmp_path):
    adapter_dir, merged = _adapter(tmp_path)
    assert any(bool((h.A != 0).any()) for h in eviction_heads(merged).values())
    from_adapter = export(adapter_dir, tmp_path / "from_adapter")
    from_model = export(merged, tmp_path / "from_model")
    a, b = tensors(from_adapter), tensors(from_model)
    assert a.keys() == b.keys() and any(".eviction_head." in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    card = ModelCard.load(from_adapter / "README.md").text
    assert "| `steps` | 30 |" in card and "| `recipe` | tiny test recipe |" in card and '"seq_len": 256' in card
    config = json.loads((from_adapter / "config.json").read_text())
    assert hf_nosa.NosaConfig.from_dict(config["nosa"]) == hf_nosa.NosaConfig(**NOSA)


@pytest.mark.slow
def test_export_of_a_real_tiny_retrofit(tmp_path):
    from hf_nosa.training.retrofit import merge_adapter, retrofit

    words = "the cat sat on the mat and a dog ran to the park".split()
    lines = [json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(40))}) for i in range(24)]
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    result = retrofit("tiny", tmp_path / "data.jsonl", tmp_path / "adapter", max_steps=2)
    out = export(result.output_dir, tmp_path / "out")
    merged = tensors(export(merge_adapter(result.output_dir), tmp_path / "merged"))
    assert all(torch.equal(tensor, merged[name]) for name, tensor in tensors(out).items())
    record = json.loads((result.output_dir / "nosa_retrofit.json").read_text())
    assert json.loads((out / "config.json").read_text())["nosa"] == record["nosa_config"]
    assert "| `steps` | 2 |" in ModelCard.load(out / "README.md").text


@pytest.mark.parametrize(
    "base, match",
    [
        (dict(family="qwen2"), "trained on a llama model"),
        (dict(family="llama", hidden_size=32), "does not fit"),
        (dict(family="llama", num_hidden_layers=3), "does not fit"),
        (dict(family="llama", num_hidden_layers=1), "does not fit"),
    ],
)
def test_adapter_for_another_base_is_refused(tmp_path, base, match):
    adapter_dir, _ = _adapter(tmp_path)
    other = tmp_path / "other_base"
    tiny_model(**base).save_pretrained(other)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=match):
        export(adapter_dir, out, base_model=str(other))
    assert_nothing_written(out)


# --------------------------------------------------------------------------- bad inputs write nothing


def _corrupt_missing_weights(folder):
    (folder / "model.safetensors").unlink()


def _corrupt_missing_shard(folder):
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()


def _corrupt_nosa_section(folder):
    config = json.loads((folder / "config.json").read_text())
    config["nosa"]["block_size"] = 24
    (folder / "config.json").write_text(json.dumps(config))


def _corrupt_drop_heads(folder):
    from safetensors.torch import save_file

    weights = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if ".eviction_head." not in k}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})


@pytest.mark.parametrize(
    "corrupt, shard, error, match",
    [
        (_corrupt_missing_weights, None, FileNotFoundError, "no weights"),
        (_corrupt_missing_shard, "100KB", FileNotFoundError, "missing weight file"),
        (_corrupt_nosa_section, None, ValueError, "block_size=24"),
        (_corrupt_drop_heads, None, ValueError, "eviction heads"),
    ],
)
def test_corrupted_inputs_fail_clearly_and_write_nothing(tmp_path, corrupt, shard, error, match):
    source = tmp_path / "source"
    nosa_model("llama").save_pretrained(source, **({"max_shard_size": shard} if shard else {}))
    corrupt(source)
    out = tmp_path / "out"
    with pytest.raises(error, match=match):
        export(source, out)
    assert_nothing_written(out)


def test_failure_midway_leaves_out_dir_untouched(tmp_path, monkeypatch):
    from hf_nosa.hub import card

    out = tmp_path / "out"
    export(nosa_model("llama"), out)
    (out / "keep.txt").write_text("old")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.raises(ValueError, match="not empty"):
        export(nosa_model("llama"), out)

    def broken(**kwargs):
        raise RuntimeError("card failed")

    monkeypatch.setattr(card, "render_model_card", broken)
    with pytest.raises(RuntimeError, match="card failed"):
        export(nosa_model("llama", seed=1), out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    monkeypatch.undo()
    export(nosa_model("llama", seed=1), out, overwrite=True)
    assert (out / "keep.txt").read_text() == "old"  # not written by the export: kept
    assert (out / "model.safetensors").read_bytes() != before["model.safetensors"]


def test_bad_sources(tmp_path):
    with pytest.raises(ValueError, match="no eviction heads"):
        export(tiny_model("llama"), tmp_path / "a")
    with pytest.raises(FileNotFoundError, match="not a folder"):
        export(tmp_path / "missing", tmp_path / "b")
    with pytest.raises(ValueError, match="hf_nosa_requirement"):
        export(nosa_model("llama"), tmp_path / "c", hf_nosa_requirement="latest")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_remote_classes_check_like_to_nosa():
    from hf_nosa.modeling.remote import NosaLlamaConfig, NosaQwen2Config, NosaQwen2ForCausalLM

    with pytest.raises(ValueError, match='"nosa" section of config.json is invalid.*block_size'):
        NosaLlamaConfig(nosa={**NOSA, "block_size": 12})
    config = {k: v for k, v in tiny_model("qwen2").config.to_dict().items() if k != "layer_types"}
    sliding = NosaQwen2Config(**{**config, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0})
    with pytest.raises(ValueError, match="full-attention layers only"):
        NosaQwen2ForCausalLM(sliding)


def test_verify_rejects_nosa_in_generation_config(exports, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(exports["root"] / "llama", folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "cache_implementation": "nosa"}))
    with pytest.raises(ValueError, match="cache_implementation"):
        verify_folder(folder)


# --------------------------------------------------------------------------- a fresh Python: load, export, push
#
# One fresh interpreter runs three phases in turn (starting one costs seconds of imports), each reporting on its own:
# it loads the exports through remote code before anything imported hf_nosa, exports from a copy of the package,
# then pushes over a loopback Hub. Its hf_nosa is that copy (first on PYTHONPATH, and the working directory is not
# the repository), so the remote code and the push commands run from the copy too.

FRESH = r"""
import json, sys, traceback
args, phases, results = json.loads(sys.argv[1]), json.loads(sys.argv[2]), {}
for name, code in phases:
    scope = {"__name__": name, "args": args[name]}
    try:
        exec(compile(code, f"<{name} phase>", "exec"), scope)
        results[name] = scope["result"]
    except BaseException:
        results[name] = {"error": traceback.format_exc()}
print(json.dumps(results))
"""

LOAD = r"""
import importlib.abc, json, sys, torch
from pathlib import Path
root = Path(args["root"]); ref = torch.load(root / "reference.pt"); ids = ref["ids"]
result = {"hf_nosa_preloaded": "hf_nosa" in sys.modules}

class Block(importlib.abc.MetaPathFinder):  # a user without hf_nosa installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "hf_nosa":
            raise ModuleNotFoundError(f"No module named {name!r}")

from transformers import AutoModelForCausalLM
sys.meta_path.insert(0, Block())
try:
    AutoModelForCausalLM.from_pretrained(str(root / "llama"), trust_remote_code=True)
except ImportError as error:
    result["without_hf_nosa"] = str(error)
sys.meta_path.pop(0)
try:
    AutoModelForCausalLM.from_pretrained(str(root / "too_new"), trust_remote_code=True)
except ImportError as error:
    result["too_old_hf_nosa"] = str(error)

def greedy(model, **kw):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=%d, do_sample=False, **kw)

for family in ("llama", "qwen2", "qwen3"):
    model = AutoModelForCausalLM.from_pretrained(str(root / family), trust_remote_code=True)
    result[family] = {
        "class": type(model).__name__, "module": type(model).__module__,
        "same_tokens": torch.equal(greedy(model, cache_implementation="nosa"), ref[family]["nosa"]),
        "logits_diff": (model(ids).logits - ref[family]["logits"]).abs().max().item(),
    }
stock = AutoModelForCausalLM.from_pretrained(str(root / "stock"))
custom = str(root / "llama")
result["stock_plain"] = torch.equal(greedy(stock, custom_generate=custom, trust_remote_code=True), ref["stock_plain"])
nosa = greedy(stock, custom_generate=custom, trust_remote_code=True, cache_implementation="nosa", cache_config=%s)
result["stock_nosa"] = torch.equal(nosa, ref["stock_nosa"])
""" % (NEW, repr(NOSA))

COPY = r"""
import hf_nosa; from hf_nosa.hub import export
from tests.conftest import small_nosa_config, tiny_model
result = {"hf_nosa": hf_nosa.__file__}
export(hf_nosa.to_nosa(tiny_model('llama'), small_nosa_config()), args["out"])
"""

PUSH = r"""
import contextlib, io, json, os, sys
from huggingface_hub import constants
import hf_nosa.cli.commands as cli

cli.COMMANDS = {k: v for k, v in cli.COMMANDS.items() if k in ("export", "push")}
result = []
for scenario in args["scenarios"]:
    for key, value in scenario["env"].items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    constants.HF_HUB_OFFLINE = constants._is_true(os.environ.get("HF_HUB_OFFLINE"))  # as at import
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = cli.main(scenario["argv"])
    result.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
"""


def _push_folders(folder, tmp):
    """Folders to push beside the export: one with extra files, one with a symbolic link out, one with edited remote
    code, one without weights."""
    # a crafted folder: a tokenizer file export may write, plus files it never writes (a secret, notes, bytecode)
    with_extra = tmp / "with_extra"
    shutil.copytree(folder, with_extra)
    (with_extra / "tokenizer.json").write_text("{}")
    (with_extra / ".env").write_text("HF_TOKEN=hf_secret\n")
    (with_extra / "notes.txt").write_text("stale")
    (with_extra / "__pycache__").mkdir()
    (with_extra / "__pycache__" / "modeling.cpython-311.pyc").write_bytes(b"\0")
    linked = tmp / "linked"
    shutil.copytree(folder, linked)
    (tmp / "outside.txt").write_text("linked-secret-7f3a")
    (linked / "notes.txt").symlink_to(tmp / "outside.txt")
    tampered = tmp / "tampered"
    shutil.copytree(folder, tampered)
    marker = tmp / "code_ran"
    with open(tampered / "modeling_nosa_llama.py", "a") as handle:
        handle.write(f"\nopen({str(marker)!r}, 'w').close()\n")
    broken = tmp / "broken"
    shutil.copytree(folder, broken)
    (broken / "model.safetensors").unlink()
    return with_extra, linked, tampered, marker, broken


@pytest.fixture(scope="module", autouse=True)
def started_fresh_python(request, tmp_path_factory):
    """The fresh interpreter starts as soon as the exports exist when one of the tests reading it is selected, and
    runs beside the in-process tests before them: it spends most of its time importing, on a core of its own, while
    this process works on one thread. ``(process, loopback Hub, paths the tests check)``, or None."""
    if not any(getattr(item, "module", None) is request.module and "fresh_python" in item.fixturenames
               for item in request.session.items):
        yield None
        return
    exports = request.getfixturevalue("exports")
    tmp = tmp_path_factory.mktemp("fresh")
    shutil.copytree(Path(hf_nosa.__file__).parent, tmp / "pkg" / "hf_nosa", symlinks=True)
    folder = exports["root"] / "llama"
    with_extra, linked, tampered, marker, broken = _push_folders(folder, tmp)
    online, token = {"HF_HUB_OFFLINE": None}, {"HF_TOKEN": "hf_loopback"}

    def push(folder, repo, *extra, env=None):
        return {"argv": ["push", str(folder), "--repo-id", repo, *extra], "env": {**online, **token, **(env or {})}}

    scenarios = [
        push(broken, "me/tiny"),
        push(folder, "me/tiny", env={"HF_HUB_OFFLINE": "1"}),
        push(folder, "me/tiny", env={"HF_TOKEN": None}),
        push(with_extra, "me/tiny", "--dry-run"),
        push(folder, "me/tiny", env={"HF_TOKEN": "hf_refused"}),
        push(folder, "me/tiny", "--private"),
        push(folder, "me/tiny"),
        push(with_extra, "me/other"),
        push(folder, "me/other", "--overwrite"),
        push(linked, "me/linked"),
        push(linked, "me/linked", "--dry-run"),
        push(tampered, "me/tampered", "--dry-run", "--load-check"),
        push(folder, "me/tiny", "--dry-run", "--load-check"),
        {"argv": ["export", str(folder), str(tmp / "re_export"), "--nosa", "budget_tokens=96"], "env": {}},
    ]
    args = {"load": {"root": str(exports["root"])}, "copy": {"out": str(tmp / "copy_out")},
            "push": {"scenarios": scenarios}}
    phases = [("load", LOAD), ("copy", COPY), ("push", PUSH)]
    with LoopbackHub(lifetime=300) as hub:
        env = {**fresh_env(tmp), "HF_ENDPOINT": hub.url, "OMP_NUM_THREADS": "1"}  # tiny models: one thread
        env["PYTHONPATH"] = os.pathsep.join([str(tmp / "pkg"), env["PYTHONPATH"]])
        with open(tmp / "stdout.txt", "w") as stdout, open(tmp / "stderr.txt", "w") as stderr:
            proc = subprocess.Popen([sys.executable, "-c", FRESH, json.dumps(args), json.dumps(phases)], env=env,
                                    cwd=tmp, stdout=stdout, stderr=stderr, text=True)
        try:
            yield proc, hub, dict(tmp=tmp, folder=folder, marker=marker)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def fresh_python(started_fresh_python):
    """The three phases' results, with the loopback Hub (its records) and the paths the tests check."""
    proc, hub, paths = started_fresh_python
    proc.wait(timeout=240)
    assert proc.returncode == 0, (paths["tmp"] / "stderr.txt").read_text()[-4000:]
    results = json.loads((paths["tmp"] / "stdout.txt").read_text().strip().splitlines()[-1])
    return dict(results=results, hub=hub, **paths)


def _phase(fresh_python, name):
    result = fresh_python["results"][name]
    assert not (isinstance(result, dict) and "error" in result), result["error"]
    return result


@pytest.mark.slow
def test_fresh_process_loads_with_trust_remote_code(fresh_python):
    result = _phase(fresh_python, "load")
    assert not result["hf_nosa_preloaded"]
    assert "hf_nosa" in result["without_hf_nosa"] and "pip install" in result["without_hf_nosa"]
    assert "hf-nosa>=99.0" in result["too_old_hf_nosa"] and "pip install" in result["too_old_hf_nosa"]
    for family in ("llama", "qwen2", "qwen3"):
        loaded = result[family]
        assert loaded["module"].startswith("transformers_modules.") and loaded["class"].startswith("Nosa")
        assert loaded["same_tokens"], family
        assert loaded["logits_diff"] < 1e-5, family
    assert result["stock_plain"] and result["stock_nosa"]


def test_export_works_from_a_copy_of_the_package(fresh_python):
    """Templates are package data: export must not depend on files outside hf_nosa/ (a symbolic link to the
    repository broke exports run from a copied tree)."""
    result = _phase(fresh_python, "copy")
    assert result["hf_nosa"].startswith(str(fresh_python["tmp"] / "pkg"))
    assert (fresh_python["tmp"] / "copy_out" / "README.md").is_file()


def test_push_end_to_end_over_loopback(fresh_python):
    hub, tmp, folder, marker = fresh_python["hub"], fresh_python["tmp"], fresh_python["folder"], fresh_python["marker"]
    exported = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    left_out = [".env", "__pycache__/modeling.cpython-311.pyc", "notes.txt"]  # the files with_extra adds
    (broken_r, offline, anonymous, dry, refused, first, again, extra, overwrite, link, link_dry, tamper,
     load_checked, re_export) = _phase(fresh_python, "push")
    requests_before_push = hub.requests[: hub.requests.index(("POST", "/api/repos/create"))]
    assert broken_r["code"] == 2 and "no weights" in broken_r["stderr"]
    assert offline["code"] == 1 and "HF_HUB_OFFLINE" in offline["stderr"]
    assert anonymous["code"] == 1 and "hf auth login" in anonymous["stderr"]
    assert dry["code"] == 0, dry["stderr"]
    would_upload, _, skipped = dry["stdout"].partition("left out")
    assert all(f"  {name}\n" in would_upload for name in [*exported, "tokenizer.json"])
    assert all(f"  {name}\n" in skipped and f"  {name}\n" not in would_upload for name in left_out)
    assert "was not run" in dry["stdout"]
    assert refused["code"] == 1 and "401" in refused["stderr"]
    assert not [r for r in requests_before_push if r[1].startswith("/api/") and "agent" not in r[1]]
    assert first["code"] == 0, first["stderr"]
    assert again["code"] == 1 and "--overwrite" in again["stderr"]
    assert extra["code"] == 0 and overwrite["code"] == 0, overwrite["stderr"]
    for result in (link, link_dry):
        assert result["code"] == 2 and "notes.txt" in result["stderr"] and "symbolic link" in result["stderr"]
    assert tamper["code"] == 2 and "modeling_nosa_llama.py" in tamper["stderr"] and "sha256" in tamper["stderr"]
    assert not marker.exists()  # verification never imported the edited file, even with --load-check
    assert load_checked["code"] == 0 and "loaded with its remote code" in load_checked["stdout"]

    private = [repo for repo, request in hub.created.items()
               if request.get("visibility") == "private" or request.get("private") is True]
    assert private == ["me/tiny"]
    assert "me/linked" not in hub.created and "me/tampered" not in hub.created
    tiny = [c for c in hub.commits if c["repo"] == "me/tiny"]
    assert len(tiny) == 1 and tiny[0]["revision"] == "main"
    assert sorted(tiny[0]["added"]) == exported and tiny[0]["deleted"] == []
    assert all(tiny[0]["added"][name] == (folder / name).read_bytes() for name in exported)
    other = [c for c in hub.commits if c["repo"] == "me/other"]
    assert len(other) == 2 and sorted(other[0]["added"]) == sorted([*exported, "tokenizer.json"])
    assert other[1]["deleted"] == ["tokenizer.json"] and sorted(other[1]["added"]) == exported
    assert sorted(hub.repos["me/other"]["main"]) == sorted([".gitattributes", *exported])
    uploaded = b"".join(data for commit in hub.commits for data in commit["added"].values())
    assert b"hf_secret" not in uploaded and b"linked-secret-7f3a" not in uploaded

    assert re_export["code"] == 0, re_export["stderr"]
    config = json.loads((tmp / "re_export" / "config.json").read_text())
    assert config["nosa"] == {**json.loads((folder / "config.json").read_text())["nosa"], "budget_tokens": 96}


# --------------------------------------------------------------------------- GPU: the same path in bf16 on CUDA

GPU_LOAD = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM
ref = torch.load(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.bfloat16,
                                             device_map="cuda")
ids = ref["ids"].cuda()
out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=%d, do_sample=False,
                     cache_implementation="nosa")
print(json.dumps({"same_tokens": torch.equal(out.cpu(), ref["out"]), "dtype": str(model.dtype),
                  "device": str(model.device)}))
""" % NEW


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gpu_bf16_export_loads_and_decodes_identically(tmp_path, family):
    model = nosa_model(family)
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    model = model.to("cuda", torch.bfloat16)
    # from_pretrained(dtype=bf16) keeps the RoPE frequencies in fp32; .to(bf16) would round them
    model.model.rotary_emb.inv_freq = inv_freq.cuda()
    out = export(model, tmp_path / "out")
    ids = torch.randint(3, 97, (2, 4 * PROMPT))
    reference = greedy(model, ids.cuda(), cache_implementation="nosa").cpu()
    torch.save({"ids": ids, "out": reference}, tmp_path / "ref.pt")
    result = run_python(GPU_LOAD, [str(out), str(tmp_path / "ref.pt")], fresh_env(tmp_path))
    assert result["dtype"] == "torch.bfloat16" and result["device"].startswith("cuda")
    assert result["same_tokens"]
