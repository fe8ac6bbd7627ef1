"""The LoRA retrofit: tiny.yaml trains, saves, reloads, merges and resumes; bad input fails before training."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_nosa import NosaConfig, to_nosa
from hf_nosa.training.allocator import EXPANDABLE_SEGMENTS, allocator_setting, user_setting
from hf_nosa.modeling import eviction_heads
from hf_nosa.training.retrofit import (
    data_files,
    load_adapter,
    load_base,
    load_recipe,
    merge_adapter,
    pack_data,
    read_run,
    retrofit,
)

from .conftest import tiny_model

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
SHIPPED = ["llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen3-0.6b", "qwen3-4b",
           "qwen3-8b", "smollm2-135m", "tiny"]
RUN_KEYS = {"base_model", "family", "nosa_config", "recipe", "steps", "final_loss", "tokens_per_second",
            "hf_nosa_version", "allocator"}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _write_text_data(path: Path, seed: int = 0, n: int = 120) -> Path:
    rng = random.Random(seed)
    words = "the cat sat on the mat and a dog ran to the park while birds sang in the old tree".split()
    with path.open("w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(8, 30)))}) + "\n")
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return _write_text_data(tmp_path_factory.mktemp("data") / "train.jsonl")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, data):
    out = tmp_path_factory.mktemp("tiny") / "adapter"
    return retrofit("tiny", data, out)


def _logits(model, seed=0, length=100):
    ids = torch.randint(3, 259, (2, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.slow
def test_tiny_recipe_trains_and_writes_the_adapter(tiny_run):
    losses = tiny_run.losses
    assert tiny_run.steps == len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses
    out = tiny_run.output_dir
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    run = read_run(out)
    assert set(run) == RUN_KEYS
    assert run["family"] == "llama" and run["steps"] == 30 and run["base_model"] == "recipe:model"
    assert run["final_loss"] == pytest.approx(losses[-1]) and run["tokens_per_second"] > 0
    assert run["allocator"] is None  # the CUDA allocator's setting; this run trained on the CPU
    assert NosaConfig.from_dict(run["nosa_config"]) == NosaConfig.from_dict(load_recipe("tiny")["nosa"])
    assert json.loads((out / "adapter_config.json").read_text())["modules_to_save"] == ["eviction_head"]
    # the eviction heads trained (A starts at zero)
    heads = eviction_heads(tiny_run.model.base_model.model)
    assert all(float(h.modules_to_save["default"].A.detach().abs().sum()) > 0 for h in heads.values())


@pytest.mark.slow
def test_reloaded_adapter_gives_identical_outputs(tiny_run):
    recipe = load_recipe("tiny")
    base = to_nosa(load_base(recipe["model"]), NosaConfig.from_dict(recipe["nosa"]))
    reloaded = load_adapter(base, tiny_run.output_dir)
    assert torch.equal(_logits(reloaded), _logits(tiny_run.model))


@pytest.mark.slow
def test_merged_model_equals_the_adapter_model(tiny_run):
    merged = merge_adapter(tiny_run.output_dir)
    assert not hasattr(merged, "peft_config") and len(eviction_heads(merged)) == 2
    torch.testing.assert_close(_logits(merged, seed=1), _logits(tiny_run.model, seed=1), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_loading_onto_a_model_without_heads_or_with_another_config_fails(tiny_run):
    recipe = load_recipe("tiny")
    with pytest.raises(ValueError, match="eviction heads"):
        load_adapter(load_base(recipe["model"]), tiny_run.output_dir)
    other = NosaConfig.from_dict(recipe["nosa"]).replace(budget_tokens=96)
    with pytest.raises(ValueError, match="budget_tokens"):
        load_adapter(to_nosa(load_base(recipe["model"]), other), tiny_run.output_dir)
    with pytest.raises(ValueError, match="qwen3"):
        load_adapter(to_nosa(tiny_model("qwen3"), NosaConfig.from_dict(recipe["nosa"])), tiny_run.output_dir)


@pytest.mark.slow
def test_resume_continues_the_step_count_and_the_loss_curve(tiny_run, data, tmp_path):
    out = tmp_path / "resumed"
    first = retrofit("tiny", data, out, max_steps=12)
    assert first.steps == 12
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000010", "step-0000012"]
    with pytest.raises(ValueError, match="resume=True"):
        retrofit("tiny", data, out)
    changed = {**load_recipe("tiny"), "lr_lora": 0.5}
    with pytest.raises(ValueError, match="lr_lora"):
        retrofit(changed, data, out, resume=True)
    second = retrofit("tiny", data, out, resume=True)
    assert second.steps == 30 and len(second.losses) == 30
    torch.testing.assert_close(torch.tensor(second.losses), torch.tensor(tiny_run.losses), atol=1e-6, rtol=0)
    assert read_run(out)["steps"] == 30
    assert torch.equal(_logits(second.model), _logits(tiny_run.model))
    state = json.loads((out / "trainer_state.json").read_text())  # beside the adapter: the whole run's curve
    assert state["step"] == 30 and state["losses"] == second.losses


@pytest.mark.slow
@pytest.mark.parametrize("slow_from_step", [None, 7])
def test_time_limit_plans_the_run_and_its_schedule_and_stops_early_when_steps_slow(data, tmp_path, monkeypatch,
                                                                                   slow_from_step):
    """A fake clock: each tiny step takes 1 s (2 s after ``slow_from_step``); nothing else takes time."""
    import types

    import hf_nosa.training.retrofit as module

    clock = {"now": 1000.0, "micro": 0}
    original = module._batch

    def timed_batch(*args, **kwargs):
        clock["micro"] += 1  # two micro-batches a step (tiny: grad_accum 2)
        slow = slow_from_step is not None and clock["micro"] > 2 * (slow_from_step - 1)
        clock["now"] += 2.0 if slow else 0.5
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "_batch", timed_batch)
    monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    with pytest.raises(ValueError, match="time_limit"):
        retrofit("tiny", data, tmp_path / "bad", time_limit=module.TIME_LIMIT_RESERVE_S)
    out = tmp_path / "out"
    # planned after step 1 + TIME_PLAN_STEPS: 1 s a step, 12.5 - 4 s left before the reserve: 8 more steps
    result = retrofit("tiny", data, out, time_limit=module.TIME_LIMIT_RESERVE_S + 12.5)
    run = read_run(out)
    assert run["schedule_steps"] == 12 and run["time_limit_s"] == module.TIME_LIMIT_RESERVE_S + 12.5
    # steady: all 12 planned steps; slowing at step 7: stopped once a step no longer fit (step 8)
    expected = 12 if slow_from_step is None else 8
    assert result.steps == run["steps"] == len(result.losses) == expected
    assert (out / "adapter_model.safetensors").is_file()
    last = out / "checkpoints" / f"step-{expected:07d}"
    assert json.loads((last / "trainer_state.json").read_text())["schedule_steps"] == 12
    scheduler = torch.load(last / "scheduler.bin", weights_only=False)
    factor = module._schedule(load_recipe("tiny"), {"steps": 12})(expected)
    assert scheduler["_last_lr"][1] == pytest.approx(load_recipe("tiny")["lr_lora"] * factor)
    if slow_from_step is None:  # the cosine ended at the planned step, not at the recipe's 30
        assert factor == pytest.approx(0.1)


@pytest.mark.slow
def test_local_folder_base_with_token_ids_and_two_learning_rates(tmp_path):
    from hf_nosa.training.retrofit import _build_model, _optimizer

    recipe = {**load_recipe("tiny"), "steps": 3, "save_every": 0, "tokenizer": None, "lr_lora": 5e-3}
    folder = tmp_path / "base"
    load_base(recipe["model"]).save_pretrained(folder)  # a local checkpoint without a tokenizer
    data = tmp_path / "ids.jsonl"
    rng = random.Random(1)
    data.write_text("".join(json.dumps({"input_ids": [rng.randrange(3, 259) for _ in range(200)]}) + "\n"
                            for _ in range(8)))
    result = retrofit(recipe, data, tmp_path / "out", base_model=str(folder))
    run = read_run(tmp_path / "out")
    assert run["base_model"] == str(folder) and run["steps"] == 3 and run["recipe"]["model"] == str(folder)
    merged = merge_adapter(tmp_path / "out")  # the base comes back from the folder the run recorded
    torch.testing.assert_close(_logits(merged), _logits(result.model), atol=1e-5, rtol=1e-5)
    model, _, _ = _build_model(recipe, str(folder), torch.float32)
    lrs = sorted((g["lr"], len(g["params"])) for g in _optimizer(model, recipe).param_groups)
    layers, targets = 2, len(recipe["lora"]["target_modules"])
    assert lrs == sorted([(recipe["lr_eviction"], 3 * layers), (recipe["lr_lora"], 2 * targets * layers)])


@pytest.mark.slow
def test_alignment_loss_weights_reach_the_training_step(data, tmp_path):
    recipe = {**load_recipe("tiny"), "steps": 3, "gradient_checkpointing": False}
    plain = retrofit(recipe, data, tmp_path / "plain")
    aligned = retrofit({**recipe, "eviction_loss": 1.0}, data, tmp_path / "aligned")
    assert read_run(tmp_path / "aligned")["recipe"]["eviction_loss"] == 1.0
    # same seed, data and steps: only the eviction loss differs, and it moves the eviction heads differently
    def scales(result):
        return torch.cat([m.eviction_head.A.detach().flatten() for m in result.model.modules() if hasattr(m, "eviction_head")])

    assert not torch.allclose(scales(plain), scales(aligned))
    again = retrofit(recipe, data, tmp_path / "again")  # the difference is not run-to-run noise
    torch.testing.assert_close(scales(plain), scales(again))
    with pytest.raises(ValueError, match="eviction_loss=-1.0 is invalid"):
        load_recipe({**recipe, "eviction_loss": -1.0})
    with pytest.raises(ValueError, match="need gradient_checkpointing: false"):
        load_recipe({**recipe, "selection_loss": 0.5, "gradient_checkpointing": True})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(args, cwd: Path, extra_env) -> subprocess.Popen:
    """``accelerate launch`` in its own process group, its output in ``cwd``/stdout.txt and stderr.txt."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(OMP_NUM_THREADS="1", **extra_env)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *args]
    with open(cwd / "stdout.txt", "w") as stdout, open(cwd / "stderr.txt", "w") as stderr:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=stderr, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:  # the launcher and the workers it started
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# The launched runs: the tiny recipe cut to LAUNCH_STEPS steps, a checkpoint every LAUNCH_SAVE_EVERY, so that the
# run ends where its schedule does. What a launch adds to the in-process runs above (the launcher, the process group,
# gradients synchronised at the last micro-step of each step, checkpoints saved by every process, the adapter written
# by the main one) is all there after two checkpointed steps; the recipe's 30 steps repeat them (and 26 more steps
# cost seconds in every launched process). The training itself is checked in process (tiny_run).
LAUNCH_STEPS, LAUNCH_SAVE_EVERY = 4, 2


@pytest.fixture(scope="module", autouse=True)
def started_launches(request, data, tmp_path_factory):
    """Both launches start with the module when one of its launch tests is selected, and run beside the in-process
    tests before those: their processes spend most of their time importing, a core each, while this process trains
    on one thread (``one_thread``). ``{mode: (process, folder, output folder, world size)}``."""
    import yaml

    wanted = any(getattr(item, "module", None) is request.module and "launches" in item.fixturenames
                 for item in request.session.items)
    started = {}
    if wanted:
        root = tmp_path_factory.mktemp("launch")
        recipe = root / "tiny.yaml"
        recipe.write_text(yaml.safe_dump({**yaml.safe_load((RECIPES / "tiny.yaml").read_text()),
                                          "steps": LAUNCH_STEPS, "save_every": LAUNCH_SAVE_EVERY}))
        for mode in ("cpu", "ddp"):
            folder = root / mode
            folder.mkdir()
            out = folder / "launched"
            tool = ["-m", "hf_nosa.cli.commands", "retrofit", "--recipe", str(recipe), "--data", str(data), "--output", str(out)]
            if mode == "cpu":  # the documented command: accelerate's simple launcher, one CPU process
                proc = _launch(["--cpu", "--num_processes", "2", *tool], folder, {})
                world = 1
            else:  # two processes over gloo: torchrun through accelerate, told to stay on the CPU
                port = str(_free_port())
                proc = _launch(["--multi_gpu", "--num_processes", "2", "--main_process_port", port, *tool], folder,
                               {"ACCELERATE_USE_CPU": "1"})
                world = 2
            started[mode] = (proc, folder, out, world)
    yield started
    for proc, *_ in started.values():
        _stop(proc)


@pytest.fixture(scope="module")
def launches(started_launches):
    """The finished launches: ``{mode: (returncode, stdout, stderr, output folder, world size)}``."""
    results = {}
    for mode, (proc, folder, out, world) in started_launches.items():
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise
        results[mode] = (proc.returncode, (folder / "stdout.txt").read_text(), (folder / "stderr.txt").read_text(),
                         out, world)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["cpu", "ddp"])
def test_accelerate_launch_runs_the_tiny_recipe_to_the_end(launches, mode):
    returncode, stdout, stderr, out, world = launches[mode]
    assert returncode == 0, stderr[-3000:]
    assert f"retrofit: {LAUNCH_STEPS} steps" in stdout
    run = read_run(out)
    assert run["steps"] == LAUNCH_STEPS and (out / "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        f"step-{step:07d}" for step in range(LAUNCH_SAVE_EVERY, LAUNCH_STEPS + 1, LAUNCH_SAVE_EVERY)]
    state = json.loads((out / "checkpoints" / f"step-{LAUNCH_STEPS:07d}" / "trainer_state.json").read_text())
    assert state["world_size"] == world and state["tokens"] == LAUNCH_STEPS * 2 * 2 * 128 * world


def test_bad_input_fails_before_training(tmp_path, data):
    out = tmp_path / "out"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        retrofit("tiny", tmp_path / "missing.jsonl", out)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no non-empty"):
        retrofit("tiny", empty, out)
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "too short"}) + "\n")
    with pytest.raises(ValueError, match="holds 10 tokens"):
        retrofit("tiny", short, out)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['learning_rate'\]"):
        retrofit({**load_recipe("tiny"), "learning_rate": 1e-3}, data, out)
    with pytest.raises(ValueError, match="seq_len=120 .* multiple of nosa.block_size=16"):
        retrofit({**load_recipe("tiny"), "seq_len": 120}, data, out)
    with pytest.raises(ValueError, match="NosaConfig field"):
        retrofit({**load_recipe("tiny"), "nosa": {"budget": 64}}, data, out)
    with pytest.raises(ValueError, match="lora must have exactly"):
        retrofit({**load_recipe("tiny"), "lora": {"r": 8}}, data, out)
    with pytest.raises(FileNotFoundError, match="not found"):
        retrofit("no-such-recipe", data, out)
    assert not out.exists()


def test_cli_reports_bad_input_as_an_error(tmp_path, data, capsys):
    from hf_nosa.cli import commands as cli

    bad = tmp_path / "bad.yaml"
    bad.write_text((RECIPES / "tiny.yaml").read_text() + "\nlearning_rate: 0.1\n")
    code = cli.main(["retrofit", "--recipe", str(bad), "--data", str(data), "--output", str(tmp_path / "o")])
    assert code == 2 and "learning_rate" in capsys.readouterr().err


def test_data_formats_pack_the_same_documents(tmp_path):
    pd = pytest.importorskip("pandas")
    recipe = load_recipe("tiny")
    recipe["seq_len"] = 16
    docs = [[5, 6, 7] * 4, [8] * 9, [9, 10] * 5]
    pd.DataFrame({"input_ids": docs}).to_parquet(tmp_path / "ids.parquet")
    packed = pack_data(tmp_path / "ids.parquet", recipe, recipe["model"], eos_id=2)
    flat = [t for doc in docs for t in doc + [2]]
    assert packed.tolist() == [flat[:16], flat[16:32]]
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("ab\ncd")  # one document per file, newlines kept
    (tmp_path / "texts" / "b.txt").write_text("efghijklmn")
    packed = pack_data(tmp_path / "texts", recipe, recipe["model"], eos_id=2)
    expected = [3 + b for b in b"ab\ncd"] + [2] + [3 + b for b in b"efghijklmn"] + [2]
    assert packed.tolist() == [expected[:16]]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipes_are_valid(name):
    recipe = load_recipe(name)
    cfg = NosaConfig.from_dict(recipe["nosa"])
    assert recipe["seq_len"] % cfg.block_size == 0 and recipe["device_memory_gb"] > 0
    assert recipe["seq_len"] >= cfg.budget_tokens
    assert (RECIPES / f"{name}.yaml").read_text().count("lr_eviction") == 1


@pytest.mark.gpu
def test_tiny_recipe_on_gpu_bf16_with_flex_attention(data, tmp_path):
    pytest.importorskip("datasets")
    result = retrofit("tiny", data, tmp_path / "gpu")
    assert next(result.model.parameters()).is_cuda
    assert sum(result.losses[-5:]) / 5 < sum(result.losses[:5]) / 5 - 0.3, result.losses
    recipe = load_recipe("tiny")
    base = to_nosa(load_base(recipe["model"], dtype=torch.bfloat16).cuda(), NosaConfig.from_dict(recipe["nosa"]))
    reloaded = load_adapter(base, tmp_path / "gpu")
    ids = torch.randint(3, 259, (2, 128), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        a, b = reloaded(input_ids=ids).logits.float(), result.model(input_ids=ids).logits.float()
    torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
def test_tiny_recipe_on_gpu_bf16_with_the_eviction_loss(data, tmp_path):
    pytest.importorskip("datasets")
    recipe = {**load_recipe("tiny"), "gradient_checkpointing": False, "eviction_loss": 0.5}
    result = retrofit(recipe, data, tmp_path / "gpu")
    assert next(result.model.parameters()).is_cuda
    expected = allocator_setting() if user_setting() else EXPANDABLE_SEGMENTS  # the user's setting is kept
    assert read_run(tmp_path / "gpu")["allocator"] == expected
    assert all(loss == loss for loss in result.losses)  # bf16 autocast, flex attention and the loss: no NaN
    assert sum(result.losses[-5:]) / 5 < sum(result.losses[:5]) / 5 - 0.3, result.losses
    scales = torch.cat([m.eviction_head.A.detach().flatten() for m in result.model.modules() if hasattr(m, "eviction_head")])
    assert scales.abs().max() > 0.05  # the heads left A = 0


def test_recipe_may_name_a_gguf_file_beside_it_and_builtin_data(tmp_path, monkeypatch):
    import yaml

    recipe = yaml.safe_load((RECIPES / "tiny.yaml").read_text())
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "base.gguf").write_bytes(b"GGUF")
    (tmp_path / "recipes" / "g.yaml").write_text(yaml.safe_dump({**recipe, "model": "base.gguf",
                                                                 "data": "python-prose-and-code"}))
    monkeypatch.chdir(tmp_path)
    loaded = load_recipe(tmp_path / "recipes" / "g.yaml")
    assert loaded["model"] == str((tmp_path / "recipes" / "base.gguf").resolve())
    assert loaded["data"] == "python-prose-and-code" and data_files("python-prose-and-code") == {}
    (tmp_path / "recipes" / "h.yaml").write_text(yaml.safe_dump({**recipe, "data": 3}))
    with pytest.raises(ValueError, match="recipe data=3 is invalid"):
        load_recipe(tmp_path / "recipes" / "h.yaml")
    with pytest.raises(FileNotFoundError, match="nor is it a built-in corpus"):
        data_files("no-such-corpus")


def test_builtin_corpus_is_prose_and_code_apart_from_the_evaluation():
    from hf_nosa.eval.corpus import prose_documents, stdlib_files
    from hf_nosa.eval.tasks import NOISE
    from hf_nosa.training.data import builtin_documents

    docs = builtin_documents("python-prose-and-code")
    assert docs == builtin_documents("python-prose-and-code")
    assert len(docs) == len(prose_documents("train")) + len(stdlib_files("train"))
    eval_prose = {text for _, text in prose_documents("eval")}
    assert not eval_prose & set(docs)  # the haystack half never trains
    assert not any(NOISE.strip() in doc for doc in docs)
    recipe = load_recipe("tiny")
    packed = pack_data("python-prose-and-code", recipe, recipe["model"], eos_id=2, sequences=3)
    assert packed.shape == (3, recipe["seq_len"])  # tokenized only as far as the run reads
