"""The package's shape, checked from its source: the import graph of vitp/ (every import,
function-local ones included, relative ones resolved) has no cycles, follows the layer order
config -> data -> model -> train -> tune -> cluster -> cli (console, errors, names, net, safe_load,
paths, storage, tracking, versions are sinks), keeps torch/ray out of the torch-free modules and Ray/DeepSpeed out
of model/, keeps the Ray worker away from the driver, and no file is over 400 lines. Fast: no Ray,
one subprocess.
"""
from __future__ import annotations

import ast
import functools
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400

# The layers, lowest first: a module may import its own layer, a lower one, and the sinks.
LAYERS = ("config", "data", "model", "eval", "train", "tune", "cluster", "cli")
LAYER_OF_PREFIX = {"vitp.config": "config", "vitp.recipes": "config", "vitp.data": "data",
                   "vitp.model": "model", "vitp.eval": "eval", "vitp.train": "train", "vitp.tune": "tune",
                   "vitp.cluster": "cluster", "vitp.cli": "cli"}
# Sinks: importable from every layer; they import only each other (and config, for tracking).
SINKS = ("vitp.console", "vitp.errors", "vitp.names", "vitp.net", "vitp.paths", "vitp.safe_load",
         "vitp.storage", "vitp.tracking", "vitp.versions")
# console masks every log line through the redaction of messages (standard library only)
SINK_MAY_IMPORT = {"vitp.console": ("vitp.errors", "vitp.tracking.redact"), "vitp.errors": (),
                   "vitp.names": ("vitp.errors",), "vitp.net": ("vitp.errors",),
                   "vitp.safe_load": ("vitp.errors",), "vitp.storage": ("vitp.errors",),
                   "vitp.versions": ("vitp.errors",), "vitp.paths": ("vitp.errors", "vitp.storage"),
                   "vitp.tracking": SINKS + ("vitp.config", "vitp.recipes")}
# The upward edges allowed: validation checks a variant name against the (torch-free) table; the
# feature actor of an evaluation consolidates a training checkpoint it is given (train owns that).
ALLOWED_UPWARD = {("vitp.config.validate", "vitp.model.variants"),
                  ("vitp.eval.features", "vitp.train.export")}

TORCH_FREE = ("vitp.console", "vitp.config", "vitp.recipes", "vitp.tracking", "vitp.storage",
              "vitp.errors", "vitp.names", "vitp.net")
TORCH_RAY = {"torch", "ray", "deepspeed"}  # deepspeed imports torch
MODEL_FORBIDDEN = {"ray", "deepspeed"}


# ----------------------------------------------------------------------------- the graph


@dataclass(frozen=True)
class Import:
    target: str  # a vitp module ("vitp.model.vit") or an external top-level name ("torch")
    line: int
    local: bool  # inside a function (runs when called, not when the module is imported)
    names: tuple[str, ...] = ()  # `from X import a, b`: the names taken from X


@dataclass
class Module:
    name: str
    path: Path
    root: Path
    lines: int
    docstring: str | None = None
    imports: list[Import] = field(default_factory=list)

    @property
    def rel(self) -> str:
        return str(self.path.relative_to(self.root))


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _in(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


class _Collector(ast.NodeVisitor):
    """Every import statement of one module, with its line and whether it is function-local.
    Imports under `if TYPE_CHECKING:` never run and are skipped."""

    def __init__(self, mod: Module, known: set[str]):
        self.mod, self.known, self.depth = mod, known, 0
        is_pkg = mod.path.name == "__init__.py"
        self.package = mod.name if is_pkg else mod.name.rpartition(".")[0]

    def _resolve(self, dotted: str) -> str:
        """A vitp module path -> the longest prefix that is a module of the package."""
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            cand = ".".join(parts[:i])
            if cand in self.known:
                return cand
        return dotted

    def _add(self, target: str, node: ast.AST, names: tuple[str, ...] = ()) -> None:
        if not _in(target, "vitp"):
            target = target.split(".")[0]
        self.mod.imports.append(Import(target, node.lineno, self.depth > 0, names))

    def visit_FunctionDef(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def visit_If(self, node):
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node):
        for alias in node.names:
            name = alias.name
            self._add(self._resolve(name) if _in(name, "vitp") else name, node)

    def visit_ImportFrom(self, node):
        if node.level:
            base = self.package.split(".")
            base = base[: len(base) - (node.level - 1)]
            dotted = ".".join(base + ([node.module] if node.module else []))
        else:
            dotted = node.module or ""
        if not _in(dotted, "vitp"):
            self._add(dotted, node)
            return
        names = tuple(a.name for a in node.names)
        plain = []
        for name in names:  # `from vitp.model import vit` imports the submodule
            sub = f"{dotted}.{name}"
            if sub in self.known:
                self._add(sub, node)
            else:
                plain.append(name)
        if plain or not names:
            self._add(self._resolve(dotted), node, tuple(plain))


@dataclass
class Graph:
    modules: dict[str, Module]
    errors: list[str]  # files that do not parse

    def edges(self, local: bool = True):
        """(importer, Import) for every import of a vitp module by another one."""
        for mod in self.modules.values():
            for imp in mod.imports:
                if imp.target in self.modules and imp.target != mod.name and (local or not imp.local):
                    yield mod, imp

    def where(self, src: str, dst: str) -> str:
        """`vitp/x.py:12 (local)` for each line where src imports dst."""
        mod = self.modules[src]
        hits = [f"{mod.rel}:{i.line}{' (function-local)' if i.local else ''}"
                for i in mod.imports if i.target == dst]
        return ", ".join(hits) or f"{mod.rel} (as a parent package)"


def build_graph(root: Path) -> Graph:
    """The import graph of root/vitp/."""
    files = sorted(p for p in (root / "vitp").rglob("*.py") if "__pycache__" not in p.parts)
    known = {_module_name(p, root) for p in files}
    modules, errors = {}, []
    for path in files:
        text = path.read_text()
        mod = Module(_module_name(path, root), path, root, len(text.splitlines()))
        if mod.name in modules:
            errors.append(f"{mod.rel}: {mod.name} is also {modules[mod.name].rel} (the package shadows the module)")
        try:
            tree = ast.parse(text, filename=str(path))
        except SyntaxError as e:
            errors.append(f"{mod.rel}:{e.lineno}: {e.msg}")
            modules[mod.name] = mod
            continue
        mod.docstring = ast.get_docstring(tree)
        _Collector(mod, known).visit(tree)
        modules[mod.name] = mod
    return Graph(modules, errors)


@functools.lru_cache(maxsize=1)
def graph() -> Graph:
    return build_graph(ROOT)


def _parents(name: str, modules: dict) -> list[str]:
    """Packages whose __init__ runs before `name` does: vitp, vitp.train, ..."""
    parts = name.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in modules]


def _closure_chains(g: Graph, start: str, local: bool, with_parents: bool) -> dict[str, list[str]]:
    """Every vitp module that importing `start` runs, each with the chain of steps that
    reaches it (`start`, then "-> module [file:line]" per step).

    local=False follows module-level imports only (what `import start` executes);
    with_parents also follows the package __init__ files Python runs before a submodule."""
    chains = {start: [start]}
    todo = [start]
    while todo:
        cur = todo.pop(0)  # breadth first: the shortest chain to each module
        for imp in g.modules[cur].imports:
            if imp.target not in g.modules or imp.target == cur or (imp.local and not local):
                continue
            where = f"{g.modules[cur].rel}:{imp.line}{' function-local' if imp.local else ''}"
            steps = [(p, f"package __init__ run before {imp.target}, imported at {where}")
                     for p in (_parents(imp.target, g.modules) if with_parents else [])]
            steps.append((imp.target, where))
            for target, how in steps:
                if target not in chains:
                    chains[target] = chains[cur] + [f"-> {target} [{how}]"]
                    todo.append(target)
    return chains


def _fmt_chain(g: Graph, chain: list[str]) -> str:
    return " ".join(chain)


def _externals(mod: Module, names: set[str], local: bool) -> list[Import]:
    return [i for i in mod.imports if i.target in names and (local or not i.local)]


def _layer(name: str) -> str | None:
    for prefix, layer in LAYER_OF_PREFIX.items():
        if _in(name, prefix):
            return layer
    return None


def _sink(name: str) -> str | None:
    return next((s for s in SINKS if _in(name, s)), None)


def _none(found, header: str) -> None:
    """Fail with `header` and one line per finding (no assert rewriting noise)."""
    if found:
        pytest.fail(f"{header}:\n  " + "\n  ".join(found), pytrace=False)


def _run_ok(code: str, timeout: int = 300) -> None:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode:
        pytest.fail(proc.stderr[-3000:], pytrace=False)


# ----------------------------------------------------------------------------- the tests


def test_the_checker_sees_every_kind_of_import(tmp_path):
    """The graph builder on a small made-up package: relative and absolute, module-level and
    function-local, submodules taken by `from . import x`; TYPE_CHECKING imports skipped."""
    files = {
        "vitp/__init__.py": "",
        "vitp/a/__init__.py": "from .b import thing\n",
        "vitp/a/b.py": "import torch\nfrom .. import c\n\ndef f():\n    from ..a import d  # lazy\n",
        "vitp/a/d.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import ray\n"
                            "from vitp.a.b import thing\n"),
        "vitp/c.py": "import vitp.a.d as d\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    g = build_graph(tmp_path)
    edges = {(m.name, i.target, i.local) for m in g.modules.values() for i in m.imports
             if i.target != "typing"}
    assert edges == {("vitp.a", "vitp.a.b", False), ("vitp.a.b", "torch", False),
                     ("vitp.a.b", "vitp.c", False), ("vitp.a.b", "vitp.a.d", True),
                     ("vitp.a.d", "vitp.a.b", False), ("vitp.c", "vitp.a.d", False)}
    assert sorted(map(sorted, _cycles(g))) == [["vitp.a.b", "vitp.a.b", "vitp.a.d"]]
    chains = _closure_chains(g, "vitp.c", local=False, with_parents=True)
    assert set(chains) == {"vitp.c", "vitp", "vitp.a", "vitp.a.d", "vitp.a.b"}
    assert "package __init__" in chains["vitp.a"][-1]


def test_the_rules_fire_on_a_made_up_tree(tmp_path):
    """Each rule flags its own violation (and the allowed exception passes)."""
    files = {
        "vitp/__init__.py": "",
        "vitp/config/__init__.py": "",
        "vitp/config/validate.py": "from ..model import variants\n",  # the allowed upward edge
        "vitp/model/__init__.py": "from . import vit\n",  # runs torch for anyone importing model.*
        "vitp/model/variants.py": "",
        "vitp/model/vit.py": "import torch\n\ndef f():\n    import deepspeed  # lazy\n",
        "vitp/data/ingest.py": "def f():\n    from vitp.train import loop\n",
        "vitp/train/__init__.py": "",
        "vitp/train/loop.py": "",
        "vitp/storage.py": "from vitp.config import validate\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    g = build_graph(tmp_path)
    layers = _layer_problems(g)
    assert [p.split(":")[0] for p in layers] == ["vitp.data.ingest -> vitp.train.loop",
                                                 "vitp.storage -> vitp.config.validate"], layers
    torch_free = _reach_problems(g, TORCH_FREE, TORCH_RAY)
    assert any(p.startswith("vitp.config.validate loads torch at import: ") and "package __init__" in p
               for p in torch_free), torch_free
    assert any(p.startswith("vitp.storage loads torch") for p in torch_free), torch_free
    assert _reach_problems(g, ("vitp.model",), MODEL_FORBIDDEN) == [
        "vitp/model/vit.py:4: imports deepspeed (function-local)"]


def test_every_module_parses():
    _none(graph().errors, "modules that do not parse, or defined twice")


def _cycles(g: Graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as one concrete
    cycle through its members."""
    adj = {m: sorted({i.target for i in g.modules[m].imports if i.target in g.modules and i.target != m})
           for m in g.modules}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in adj[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(adj):
        if v not in index:
            strong(v)
    cycles = []
    for comp in out:  # shortest cycle through the component's first member (BFS inside it)
        members, first = set(comp), comp[0]
        prev, queue, found = {first: None}, [first], None
        while queue and found is None:
            cur = queue.pop(0)
            for w in adj[cur]:
                if w == first:
                    found = cur
                    break
                if w in members and w not in prev:
                    prev[w] = cur
                    queue.append(w)
        path = [first]
        node = found
        while node is not None and node != first:
            path.insert(1, node)
            node = prev[node]
        cycles.append(path + [first])
    return cycles


def test_no_import_cycles():
    """Function-local imports count: a lazy import that closes a loop is still a loop."""
    g = graph()
    cycles = _cycles(g)
    if cycles:
        pytest.fail(f"{len(cycles)} import cycle(s) in vitp/:\n  " + "\n  ".join(
            " ".join([c[0]] + [f"-> {b} [{g.where(a, b)}]" for a, b in zip(c, c[1:])]) for c in cycles),
            pytrace=False)


def _reach_problems(g: Graph, prefixes: tuple[str, ...], forbidden: set[str]) -> list[str]:
    """Modules under `prefixes` that import a `forbidden` library: directly anywhere in the file
    (function-local too), or through the vitp modules they import at module level (package
    __init__ files included)."""
    problems = []
    for name, mod in sorted(g.modules.items()):
        if not any(_in(name, p) for p in prefixes):
            continue
        for imp in _externals(mod, forbidden, local=True):
            problems.append(f"{mod.rel}:{imp.line}: imports {imp.target}"
                            f"{' (function-local)' if imp.local else ''}")
        for reached, chain in sorted(_closure_chains(g, name, local=False, with_parents=True).items()):
            if reached == name:
                continue
            for ext in sorted({i.target for i in _externals(g.modules[reached], forbidden, local=False)}):
                problems.append(f"{name} loads {ext} at import: {_fmt_chain(g, chain)} "
                                f"-> {ext} [{g.modules[reached].rel}]")
    return problems


def test_torch_free_modules_import_no_torch_or_ray():
    """config/, recipes/, tracking/, storage.py, errors.py, net.py: no torch/ray/deepspeed."""
    _none(_reach_problems(graph(), TORCH_FREE, TORCH_RAY), "torch-free modules reach torch/ray")


def test_torch_free_modules_at_runtime():
    """The same, as Python sees it: importing them leaves torch, ray and deepspeed unloaded."""
    code = ("import sys\n"
            "import vitp.config, vitp.recipes, vitp.tracking, vitp.storage\n"
            "import vitp.errors, vitp.net, vitp.config.validate\n"
            "bad = sorted(m for m in ('torch', 'ray', 'deepspeed') if m in sys.modules)\n"
            "assert not bad, f'importing the torch-free modules loaded {bad}'\n")
    _run_ok(code)


def test_train_worker_module_leaves_mlflow_to_rank_0():
    """What Train's controller and every rank load (vitp/train/worker.py, at module level) reaches no
    MLflow: rank 0 imports it when it logs; elsewhere it was 0.8 s of CPU per process and start."""
    _none(_reach_problems(graph(), ("vitp.train.worker",), {"mlflow"}), "vitp.train.worker reaches MLflow")


def test_spool_tasks_load_no_mlflow():
    """What the per-node spool tasks at every run's end import (vitp/train/spools.py; their
    functions live in vitp/tracking/spoolfile.py) loads no MLflow: a fresh Ray worker importing
    all of it there was 2.3 s of CPU on the run's last path. Only `read`, in the sender, needs it."""
    code = ("import sys\n"
            "import vitp.train.spools\n"
            "assert 'mlflow' not in sys.modules, 'vitp.train.spools loaded mlflow'\n")
    _run_ok(code)


def test_train_streams_load_no_torch():
    """What Train's controller and dataset manager unpickle to hand out data (vitp/train/streams.py,
    with the checkpoint lookup it makes) loads no torch or DeepSpeed: each worker-group start of a
    run would pay torch's import there for nothing."""
    code = ("import pickle, sys\n"
            "from vitp.recipes import resolve\n"
            "from vitp.train.streams import EvalDatasetFactory, RankStreams, train_placeholder\n"
            "from vitp.train.checkpoint import data_position\n"
            "from vitp.config import Run\n"
            "cfg = resolve('debug', ['work_dir=/nonexistent-vitp-work'], check_paths=False)\n"
            "pickle.loads(pickle.dumps((RankStreams(cfg.to_dict()), EvalDatasetFactory(cfg.to_dict()), train_placeholder)))\n"
            "assert data_position(Run.of(cfg)) is None\n"
            "bad = sorted(m for m in ('torch', 'deepspeed') if m in sys.modules)\n"
            "assert not bad, f'vitp.train.streams loaded {bad}'\n")
    _run_ok(code)


def test_model_imports_no_ray_or_deepspeed():
    """model/ is plain torch: no ray/deepspeed, in its files or through what it imports."""
    _none(_reach_problems(graph(), ("vitp.model",), MODEL_FORBIDDEN), "model/ reaches Ray or DeepSpeed")


def test_model_at_runtime_loads_no_ray_or_deepspeed():
    code = ("import importlib, pkgutil, sys\n"
            "import vitp.model\n"
            "for m in pkgutil.iter_modules(vitp.model.__path__):\n"
            "    importlib.import_module('vitp.model.' + m.name)\n"
            "bad = sorted(m for m in ('ray', 'deepspeed') if m in sys.modules)\n"
            "assert not bad, f'importing vitp.model.* loaded {bad}'\n")
    _run_ok(code)


def test_worker_does_not_import_the_driver():
    """train/worker.py (runs in Ray workers) never reaches train/trainer.py (the driver),
    directly or through other modules, function-local imports included."""
    g = graph()
    worker, driver = "vitp.train.worker", "vitp.train.trainer"
    _none([] if worker in g.modules else ["vitp/train/worker.py"], "missing (contract: the Ray worker)")
    chain = _closure_chains(g, worker, local=True, with_parents=False).get(driver)
    _none([_fmt_chain(g, chain)] if chain else [], "the worker imports the driver")


def test_every_module_sits_in_a_layer():
    """Each module belongs to a layer of the target tree or is a sink (no loose modules)."""
    g = graph()
    loose = [m.rel for n, m in sorted(g.modules.items())
             if n != "vitp" and _layer(n) is None and _sink(n) is None]
    _none(loose, "modules outside the layers (config/recipes, data, model, train, tune, cluster, cli) "
                 "and the sinks (console, errors, names, net, paths, safe_load, storage, tracking, versions)")


def _layer_problems(g: Graph) -> list[str]:
    problems = []
    for mod, imp in g.edges(local=True):
        src, dst = mod.name, imp.target
        if dst == "vitp" or src == "vitp":
            continue
        loc = f"[{mod.rel}:{imp.line}{' function-local' if imp.local else ''}]"
        sink = _sink(src)
        if sink:
            if not any(_in(dst, ok) for ok in SINK_MAY_IMPORT[sink]) and not _in(dst, sink):
                problems.append(f"{src} -> {dst}: {sink} is a sink and may import only "
                                f"{', '.join(SINK_MAY_IMPORT[sink]) or 'nothing from vitp'} {loc}")
            continue
        if _sink(dst):
            continue
        ls, ld = _layer(src), _layer(dst)
        if ls is None or ld is None or (src, dst) in ALLOWED_UPWARD:
            continue  # loose modules are reported by test_every_module_sits_in_a_layer
        if LAYERS.index(ld) > LAYERS.index(ls):
            problems.append(f"{src} -> {dst}: layer {ls} imports the higher layer {ld} {loc}")
    return sorted(problems)


def test_imports_point_down_the_layers():
    """config -> data -> model -> eval -> train -> tune -> cluster -> cli: an import from a lower
    layer into a higher one fails (exceptions: ALLOWED_UPWARD). Sinks import
    only sinks (tracking also config); every layer may import a sink."""
    problems = _layer_problems(graph())
    _none(problems, f"{len(problems)} import(s) against the layer order {' -> '.join(LAYERS)}")


def test_no_file_over_400_lines():
    g = graph()
    counts = sorted(m.lines for m in g.modules.values())
    median = statistics.median(counts)
    print(f"vitp/: {len(counts)} files, median {median:g} lines, longest {counts[-1]}")
    big = sorted(((m.lines, m.rel) for m in g.modules.values() if m.lines > MAX_LINES), reverse=True)
    _none([f"{rel}: {n}" for n, rel in big],
          f"files over {MAX_LINES} lines (median of {len(counts)} files: {median:g} lines)")


# The names of the work_dir layout (and the node-local folders beside it) that vitp/paths.py owns
LAYOUT_NAMES = {"synth", "shards", "runs", "sweeps", "export", "mlflow.db", "ckpt-staging",
                "mlflow-spool"}


def test_one_module_owns_the_work_dir_layout():
    """No module but vitp/paths.py joins a layout name onto a path (join(..., "runs"), p / "mlflow.db"):
    where a thing lives under work_dir is decided in one place."""
    root = Path(__file__).resolve().parents[1] / "vitp"
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "paths.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                parts = node.args if func == "join" else []
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                parts = [node.right]
            else:
                continue
            names = [a.value for a in parts if isinstance(a, ast.Constant) and a.value in LAYOUT_NAMES]
            if names:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno} joins {names[0]!r}")
    _none(found, "work_dir layout built outside vitp/paths.py (use RunPaths)")


# What a Run computes once (vitp/config/run.py): the places of a run are asked of it, never derived again.
DERIVERS = {"run_dir", "shards_dir", "resolve_tracking_uri"}  # the helpers it replaced


def test_a_run_carries_its_locations():
    """Checkpoint dir, shards, tracking URI and sweep dir come from the resolved Run (run.dir,
    run.shards, run.tracking_uri, run.sweep): no helper derives them from a config again, and
    RunPaths is built from a Run's work_dir only, by the Run (vitp/config/run.py) or from a Run's
    paths. A second derivation is how the same place came to be computed three times on one route."""
    root = Path(__file__).resolve().parents[1] / "vitp"
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root.parent))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.alias)) and node.name in DERIVERS:
                found.append(f"{rel}:{getattr(node, 'lineno', '?')} defines or imports {node.name}")
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in DERIVERS:
                found.append(f"{rel}:{node.lineno} calls {name}")
            elif rel != "vitp/config/run.py" and (name == "RunPaths" or (
                    name == "of" and getattr(f.value, "id", None) == "RunPaths")):
                found.append(f"{rel}:{node.lineno} builds RunPaths")
    _none(found, "a run's location derived outside its Run (ask the Run: run.dir, run.shards, run.tracking_uri)")


# Where a config is resolved (validated, local paths made absolute): the edges where input enters
RESOLVING = {"validate", "absolute_paths", "Run.resolve", "recipes.resolve", "storage.abspath", "abspath"}
EDGES = ("vitp/cli/", "vitp/config/", "vitp/recipes/", "vitp/tune/spec.py", "vitp/cluster/jobspec.py",
         "vitp/cluster/entrypoint.py")


def test_a_run_is_resolved_only_at_the_edges():
    """validate / absolute_paths / Run.resolve / abspath are called where input enters (the CLI, the config
    package, recipes, a sweep's spec, a job spec); training, few-shot, data and the workers take the Run they are
    given (Run.of / Run.from_dict), so none of them validates or re-absolutises again."""
    root = Path(__file__).resolve().parents[1] / "vitp"
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root.parent))
        if rel.startswith(EDGES):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = (f"{f.value.id}.{f.attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                        else getattr(f, "id", ""))
                if name in RESOLVING:
                    found.append(f"{rel}:{node.lineno} calls {name}")
    _none(found, "a config resolved outside the edges (take a Run instead)")


MAX_WORKER_FUNCTION_LINES = 60


def test_the_train_worker_is_split_into_short_functions():
    """vitp/train/worker.py runs on every Train worker and is read when a run misbehaves: setup,
    restore, and report-and-checkpoint are separate functions, none over 60 lines."""
    path = Path(__file__).resolve().parents[1] / "vitp" / "train" / "worker.py"
    tree = ast.parse(path.read_text())
    long = [f"{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_WORKER_FUNCTION_LINES]
    _none(long, f"functions in vitp/train/worker.py over {MAX_WORKER_FUNCTION_LINES} lines")


# ------------------------------------------------------------------ rules of the issue that a
# reader of the code would otherwise have to police by hand


def test_every_module_opens_with_a_short_docstring():
    """What it owns and what it must not do, in 1-5 lines."""
    g = graph()
    bad = [f"{m.rel}: " + ("no docstring" if not m.docstring else f"{len(m.docstring.splitlines())} lines")
           for _, m in sorted(g.modules.items())
           if not m.docstring or len(m.docstring.strip().splitlines()) > 5]
    _none(bad, "module docstrings missing or over 5 lines")


def test_no_private_names_cross_modules():
    """`from vitp.x import _helper` means the helper is public: name it so."""
    g = graph()
    bad = [f"{m.rel}:{i.line}: imports {', '.join(n for n in i.names if n.startswith('_'))} from {i.target}"
           for m in g.modules.values() for i in m.imports
           if i.target in g.modules and i.target != m.name and any(
               n.startswith("_") and not n.startswith("__") for n in i.names)]
    _none(sorted(bad), "private names imported across modules")


def test_uri_checks_go_through_storage():
    """`"://" in path` is decided in one place: vitp.storage.is_uri."""
    bad = []
    for m in graph().modules.values():
        if m.name == "vitp.storage":
            continue
        try:
            tree = ast.parse(m.path.read_text())
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant)
                    and node.left.value == "://" and isinstance(node.ops[0], (ast.In, ast.NotIn))):
                bad.append(f"{m.rel}:{node.lineno}")
    _none(sorted(bad), '`"://" in ...` outside vitp/storage.py (use storage.is_uri)')
