"""Every module of hf_nosa imports as the first hf_nosa module of a fresh interpreter (a user's
``from hf_nosa.cache.host_store import HostStore``, a script's ``import hf_nosa.kernels.decode.fetch``): no import cycle that only
the package's usual import order hides.

Importing each of the ~90 modules in its own interpreter would take a minute, so the module-level imports are read
from the sources first (``import_graph``); only the modules on a cycle of that graph can meet a half-initialised
module, and those are imported first, each in a fresh child of one interpreter.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# A first child imports every module and reports the third-party modules they loaded; the parent imports those once,
# then forks a child per module: each child starts with no hf_nosa module loaded and runs only hf_nosa's imports.
FIRST_IMPORT = r"""
import importlib, json, os, sys, traceback


def in_child(job):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            message = job()
        except BaseException:
            message = "!" + traceback.format_exc(limit=-4)
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode()


names = json.loads(sys.argv[1])
before = set(sys.modules)


def third_party():
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException:
            pass
    return json.dumps(sorted(m for m in set(sys.modules) - before if m.split(".")[0] != "hf_nosa"))


for module in json.loads(in_child(third_party)):
    try:
        importlib.import_module(module)
    except BaseException:
        pass
failures = {}
for name in names:
    message = in_child(lambda: importlib.import_module(name) and "")
    if message:
        failures[name] = message
print(json.dumps(failures))
"""


def _modules() -> dict[str, Path]:
    """Module name -> source file, for the package's modules."""
    modules = {}
    for path in sorted((REPO_ROOT / "hf_nosa").rglob("*.py")):
        parts = path.relative_to(REPO_ROOT).with_suffix("").parts
        if "templates" in parts:  # remote-code files copied into exports, not modules of the package
            continue
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _module_level_imports(body: list) -> list:
    """The import statements a module runs when it is imported: its body's, inside ``if`` and ``try`` too, but not
    under ``if TYPE_CHECKING`` nor in functions and classes."""
    found = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            test = node.test
            checking = getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING"
            found += _module_level_imports(node.orelse) + ([] if checking else _module_level_imports(node.body))
        elif isinstance(node, ast.Try):
            found += _module_level_imports(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                found += _module_level_imports(handler.body)
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules its import runs first. Importing ``a.b.c`` runs ``a``, ``a.b``, ``a.b.c``;
    ``from .x import y`` runs ``x`` and, where ``y`` is a module, ``x.y``. A module's own parent packages are left
    out: they are always in sys.modules (initialised or not) by the time it runs, and a cycle through them alone is
    the package's usual lazy pattern."""
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        deps = set()
        for node in _module_level_imports(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                parts = target.split(".")
                deps |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        graph[name] = {d for d in deps if d in modules and d != name and d not in ancestors}
    return graph


def on_cycles(graph: dict[str, set[str]]) -> set[str]:
    """The modules on some cycle of ``graph`` (strongly connected components of more than one module)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), set()

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.update(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_sees_a_known_cycle():
    """The graph's reading, on a cycle it must find: ``b`` imports ``a`` back while ``a`` imports ``b``."""
    graph = {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": {"p.a"}}
    assert on_cycles(graph) == {"p.a", "p.b"}
    modules = _modules()
    real = import_graph(modules)
    assert {"hf_nosa.rules", "hf_nosa.rules.devices"} <= real["hf_nosa.cache.host_store"]
    assert "hf_nosa.kernels" not in real["hf_nosa.kernels.decode.fetch"]  # its own package: left out
    assert "hf_nosa.cache.host_store" not in real["hf_nosa.kernels.decode.fetch"]  # named in annotations only


def test_every_module_on_an_import_cycle_imports_first():
    modules = _modules()
    names = sorted(on_cycles(import_graph(modules)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", FIRST_IMPORT, json.dumps(names)], env=env, capture_output=True,
                            text=True, timeout=300, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    failures = json.loads(result.stdout.strip().splitlines()[-1])
    assert failures == {}, "\n".join(f"{name}:\n{error}" for name, error in failures.items())


def test_hf_nosa_imported_before_or_after_transformers_models():
    """``import hf_nosa`` first, then a transformers model (its file imports GenerationMixin, which makes hf_nosa
    register "nosa" half-way through that model file's import): both orders load, and generate knows "nosa"."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    check = ("from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS as names; "
             "assert 'nosa' in names, names")
    for order in ("import hf_nosa; from transformers import LlamaForCausalLM, Qwen3ForCausalLM",
                  "from transformers import LlamaForCausalLM; import hf_nosa; hf_nosa.NosaCache",
                  "import hf_nosa; from transformers import GenerationConfig; from transformers import Qwen2ForCausalLM"):
        result = subprocess.run([sys.executable, "-c", f"{order}; {check}"], env=env, capture_output=True, text=True,
                                timeout=120, cwd=REPO_ROOT)
        assert result.returncode == 0, f"{order}:\n{result.stderr[-2000:]}"


# The layers of hf_nosa, lowest first (docs/architecture.md): a module imports only from its own layer or below.
# training, eval and hub share a layer; hub publishes what training wrote, so it may import training's modules.
LAYERS = [("config",), ("rules",), ("kernels",), ("attention",), ("prefill",), ("cache",), ("serving",),
          ("generation",), ("modeling",), ("training", "eval"), ("hub",), ("cli", "assets")]


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the package's face (hf_nosa/__init__.py) hands names on from every layer
    return next((i for i, names in enumerate(LAYERS) if parts[1] in names), None)


def _every_import(name: str, path: Path) -> list[str]:
    """Every hf_nosa module ``path`` imports, at module level or inside a function (a lazy import runs too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return [target for target in found if target.startswith("hf_nosa.")]


def test_imports_only_go_down_the_layers():
    """No module imports one of a higher layer, not even lazily inside a function (such an import is how circles
    come back): the house issue's rule, held by the suite rather than by a picture."""
    modules = _modules()
    up = []
    for name, path in modules.items():
        own = _layer(name)
        assert own is not None or name == "hf_nosa", f"{name}: in no layer of LAYERS; add its subpackage there"
        if own is None:
            continue
        for target in _every_import(name, path):
            theirs = _layer(target)
            if theirs is not None and theirs > own:
                up.append(f"{name} -> {target} ({LAYERS[own]} below {LAYERS[theirs]})")
    assert not up, "imports running up the layers:\n" + "\n".join(sorted(set(up)))


def test_every_module_is_at_most_600_lines_and_says_what_it_owns():
    """docs/architecture.md's house rule: no module of hf_nosa over 600 lines, each opening with a docstring."""
    package = REPO_ROOT / "hf_nosa"
    too_long, silent = [], []
    for path in sorted(package.rglob("*.py")):
        source = path.read_text()
        if len(source.splitlines()) > 600:
            too_long.append(f"{path.relative_to(package)} ({len(source.splitlines())} lines)")
        if not (ast.get_docstring(ast.parse(source)) or "").strip():
            silent.append(str(path.relative_to(package)))
    assert not too_long, f"modules over 600 lines: {too_long}"
    assert not silent, f"modules without a docstring: {silent}"
