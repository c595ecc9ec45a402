"""Structure counts of a checkout, read from the source with ``ast`` (issue 43, "Counted on the result").

    python bench/structure.py                 # this checkout
    python bench/structure.py /tmp/base       # another one
    python bench/structure.py --check         # exit 1 when a gated number is over its target

The rules (each count prints the names it counted, so a rule can be judged by its hits):
- cfg functions: functions and methods with a parameter named ``cfg`` (the whole config), outside the config
  package and the entry points (``ENTRY``; serve_rm.py only its ``main``).
- stage functions taking the trainer: the functions a ``Stage(name, run, ...)`` call names as its ``run`` whose
  parameters include a trainer name (``TRAINER_NAMES``); printed with the trainer attributes they read.
- record types for one step: dataclasses and NamedTuples with at least two fields annotated as tensors (the
  annotation mentions ``Tensor``); the async queue's own records (``ASYNC_RECORDS``, token lists) are listed
  apart, not gated.
- engine probes: ``getattr`` / ``hasattr`` calls whose first argument names an engine (its last dotted part is
  ``engine``, ``eng``, ``llm`` or ends in ``_engine``, e.g. ``self.engine``, ``rollout_engine``).
- long files: library files (every module under rlhf/ except the vendored ``compat/``) over 400 lines.
- up imports: an import (module level or inside a function; ``if TYPE_CHECKING:`` blocks excluded) of a library
  module (``from pkg import name`` is the submodule ``pkg.name`` when there is one, else ``pkg``) whose target
  sits in a higher layer of ``LAYERS`` (docs/ARCHITECTURE.md) than the importer.  Imports within one layer are never "up".
- import circles: the strongly connected components of more than one module in the graph of all imports (as
  above: a function-level import that only avoids the load-time circle still ties the two modules together);
  "across folders" when a component spans more than one folder of rlhf/.  (On 5118a58 this reads the issue's
  "7 import circles (2 across folders)".)
"""
from __future__ import annotations

import ast
import fnmatch
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Set, Tuple

import click

# Layers, bottom up: read from the one declaration, docs/ARCHITECTURE.md's "Layers" table (a row per layer, its
# folders and top-level modules in backticks: ``rl`` a folder, ``errors`` rlhf/errors.py, ``config/schema`` one
# module inside a folder, ``train_*`` a glob); a module may import its own layer and the ones below.  The longest
# pattern that names a file wins; a file no pattern names is an error asking for a row.
DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "ARCHITECTURE.md")


def read_layers(path: str = DOC) -> List[Tuple[str, int]]:
    """(pattern, layer) for every backticked name of the doc's layer table rows (``| L<n> | ... |``)."""
    out: List[Tuple[str, int]] = []
    with open(path) as f:
        for line in f:
            m = re.match(r"\| L(\d+) \| (.*?) \|", line)
            if m:
                out += [(p, int(m.group(1))) for p in re.findall(r"`([^`]+)`", m.group(2))]
    return out


LAYERS: List[Tuple[str, int]] = read_layers()
ENTRY: Dict[str, Optional[Set[str]]] = {  # entry-point files (glob) -> the functions exempt there (None: all)
    "rlhf/train_*.py": None, "rlhf/plan.py": None, "rlhf/demo.py": None, "rlhf/serve_rm.py": {"main"},
}
TRAINER_NAMES = {"trainer", "tr"}
ENGINE_NAME = re.compile(r"^(engine|eng|llm|\w+_engine)$")
ASYNC_RECORDS = {"Sample", "Group"}
LONG_FILE = 400
TARGETS = {"cfg functions": 10, "stage functions taking the trainer": 0, "record types for one step": 1,
           "engine probes": 0, "library files over 400 lines": 3, "imports up a layer": 0,
           "import circles across folders": 0}


def module_name(path: str) -> str:
    """rlhf/a/b.py -> rlhf.a.b; rlhf/a/__init__.py -> rlhf.a."""
    parts = path[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def folder(path: str) -> str:
    """The folder of rlhf/ a file is in (a file directly in rlhf/: its own name)."""
    parts = path.split("/")
    return parts[1] if len(parts) > 2 else parts[-1]


def rank(path: str) -> int:
    """The layer of ``rlhf/...py``: the longest LAYERS pattern that is the module, a folder above it, or a glob
    matching it."""
    mod = path[len("rlhf/"):-3]
    mod = mod[:-len("/__init__")] if mod.endswith("/__init__") else mod
    best = None
    for pat, layer in LAYERS:
        if mod == pat or mod.startswith(pat + "/") or fnmatch.fnmatch(mod, pat):
            if best is None or len(pat) > len(best[0]):
                best = (pat, layer)
    if best is None:
        raise KeyError(f"{path}: {mod.split('/')[0]!r} is in no row of LAYERS, docs/ARCHITECTURE.md's layer table: "
                       "add it to the row it belongs to")
    return best[1]


def is_entry(path: str) -> bool:
    return any(fnmatch.fnmatch(path, g) for g in ENTRY)


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _params(fn) -> List[str]:
    a = fn.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]


def cfg_functions(path: str, tree: ast.AST) -> List[str]:
    """``path:function`` for each function taking ``cfg``, unless the file is the config package or exempt."""
    if path.startswith("rlhf/config/"):
        return []
    exempt = next((e for g, e in ENTRY.items() if fnmatch.fnmatch(path, g)), set())
    return [f"{path}:{fn.name}" for fn in _functions(tree) if "cfg" in _params(fn)
            and not (exempt is None or fn.name in exempt)]


def stage_runs(tree: ast.AST) -> Set[str]:
    """The names given as ``run`` (second positional or ``run=``) to ``Stage(...)`` calls."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Stage":
            run = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "run"),
                                                              None)
            if isinstance(run, ast.Name):
                names.add(run.id)
    return names


def trainer_stages(path: str, tree: ast.AST, runs: Set[str]) -> Dict[str, Set[str]]:
    """``path:function`` -> the trainer attributes it reads, for each stage run function taking the trainer."""
    out = {}
    for fn in _functions(tree):
        held = TRAINER_NAMES & set(_params(fn))
        if fn.name in runs and held:
            out[f"{path}:{fn.name}"] = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)
                                        and isinstance(n.value, ast.Name) and n.value.id in held}
    return out


def _is_record(node: ast.ClassDef) -> bool:
    deco = {ast.unparse(d.func if isinstance(d, ast.Call) else d).split(".")[-1] for d in node.decorator_list}
    bases = {ast.unparse(b).split(".")[-1] for b in node.bases}
    return "dataclass" in deco or "NamedTuple" in bases


def record_types(path: str, tree: ast.AST) -> List[str]:
    """Dataclasses / NamedTuples with two or more tensor-annotated fields, and those named in ``ASYNC_RECORDS``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and _is_record(node):
            tensors = [s for s in node.body if isinstance(s, ast.AnnAssign) and "Tensor" in ast.unparse(s.annotation)]
            if len(tensors) >= 2 or node.name in ASYNC_RECORDS:
                out.append(f"{path}:{node.name}")
    return out


def _names_engine(expr: ast.expr) -> bool:
    while isinstance(expr, ast.Call) and expr.args and ast.unparse(expr.func) == "type":
        expr = expr.args[0]  # getattr(type(engine), ...)
    last = ast.unparse(expr).split(".")[-1]
    return isinstance(expr, (ast.Name, ast.Attribute)) and bool(ENGINE_NAME.match(last))


def engine_probes(path: str, tree: ast.AST) -> List[str]:
    """``path:line getattr(x, "name")`` for each getattr/hasattr on an engine."""
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and node.args and _names_engine(node.args[0])):
            what = ast.unparse(node.args[1]) if len(node.args) > 1 else "?"
            out.append(f"{path}:{node.lineno} {node.func.id}({ast.unparse(node.args[0])}, {what})")
    return out


def _type_checking(node: ast.If) -> bool:
    return ast.unparse(node.test).split(".")[-1] == "TYPE_CHECKING"


def _imports(tree: ast.AST) -> Iterator[ast.stmt]:
    """Import statements anywhere (functions included), skipping ``if TYPE_CHECKING:`` blocks."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _type_checking(node):
            stack.extend(node.orelse)
        else:
            stack.extend(c for c in ast.iter_child_nodes(node) if not isinstance(c, ast.expr))


def import_targets(path: str, tree: ast.AST, modules: Dict[str, str]) -> Set[str]:
    """The library files ``path`` imports (``modules``: module name -> file); ``from pkg import name`` counts as
    the submodule when ``pkg.name`` is one, else as ``pkg`` itself."""
    me = module_name(path)
    pkg = me if path.endswith("__init__.py") else me.rpartition(".")[0]
    out = set()
    for node in _imports(tree):
        if isinstance(node, ast.Import):
            cands = [[a.name] for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            cands = [[f"{base}.{a.name}", base] for a in node.names]
        for options in cands:
            hit = next((modules[m] for m in options if m in modules), None)
            if hit is not None and hit != path:
                out.add(hit)
    return out


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative), each sorted."""
    index, low, on, stack, out, n = {}, {}, set(), [], [], [0]

    def visit(v):
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            u, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[u])
                if low[u] == index[u]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == u:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = n[0]
                n[0] += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(graph.get(w, ())))))
            elif w in on:
                low[u] = min(low[u], index[w])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@dataclass
class Counts:
    hits: Dict[str, List[str]] = field(default_factory=dict)  # count name -> what it counted
    notes: Dict[str, List[str]] = field(default_factory=dict)  # printed, not gated


def scan(files: Dict[str, str]) -> Counts:
    """All counts for ``files`` (path relative to the checkout, e.g. "rlhf/a/b.py" -> source text)."""
    trees = {p: ast.parse(s, p) for p, s in sorted(files.items())}
    modules = {module_name(p): p for p in trees}
    c = Counts()
    c.hits["cfg functions"] = [h for p, t in trees.items() for h in cfg_functions(p, t)]
    c.notes["cfg functions, config and entry points too"] = [
        f"{p}:{fn.name}" for p, t in trees.items() for fn in _functions(t) if "cfg" in _params(fn)]
    runs = set().union(*(stage_runs(t) for t in trees.values())) if trees else set()
    stages = {k: v for p, t in trees.items() for k, v in trainer_stages(p, t, runs).items()}
    c.hits["stage functions taking the trainer"] = sorted(stages)
    c.notes["trainer attributes the stages read"] = sorted(set().union(*stages.values())) if stages else []
    records = [h for p, t in trees.items() for h in record_types(p, t)]
    c.hits["record types for one step"] = [r for r in records if r.split(":")[1] not in ASYNC_RECORDS]
    c.notes["async records (not gated)"] = [r for r in records if r.split(":")[1] in ASYNC_RECORDS]
    c.hits["engine probes"] = [h for p, t in trees.items() for h in engine_probes(p, t)]
    lines = {p: s.count("\n") + (not s.endswith("\n")) for p, s in files.items() if not p.startswith("rlhf/compat/")}
    c.hits["library files over 400 lines"] = [f"{p} ({n})" for p, n in sorted(lines.items()) if n > LONG_FILE]
    c.notes["library files over 300 lines"] = [f"{p} ({n})" for p, n in sorted(lines.items()) if n > 300]
    every = {p: import_targets(p, t, modules) for p, t in trees.items()}
    c.hits["imports up a layer"] = [f"{p} -> {q}" for p, qs in every.items() for q in sorted(qs) if rank(q) > rank(p)]
    comps = circles(every)
    c.notes["import circles"] = [" <-> ".join(x) for x in comps]
    c.hits["import circles across folders"] = [" <-> ".join(x) for x in comps if len({folder(p) for p in x}) > 1]
    return c


def read_tree(root: str) -> Dict[str, str]:
    out = {}
    for d, _, names in os.walk(os.path.join(root, "rlhf")):
        for n in names:
            if n.endswith(".py"):
                p = os.path.join(d, n)
                out[os.path.relpath(p, root).replace(os.sep, "/")] = open(p, encoding="utf-8").read()
    return out


def over_target(c: Counts) -> List[str]:
    return [k for k, limit in TARGETS.items() if len(c.hits[k]) > limit]


def render(c: Counts, verbose: bool = True) -> str:
    lines = [f"{'count':44} {'now':>5} {'target':>7}"]
    for k, limit in TARGETS.items():
        flag = "  OVER" if len(c.hits[k]) > limit else ""
        lines.append(f"{k:44} {len(c.hits[k]):>5} {'<= ' + str(limit):>7}{flag}")
    for k, v in c.notes.items():
        lines.append(f"{k:44} {len(v):>5}")
    if verbose:
        for k, v in [*c.hits.items(), *c.notes.items()]:
            lines += [f"\n{k}:"] + [f"  {x}" for x in v]
    return "\n".join(lines)


@click.command()
@click.argument("root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
@click.option("--check", is_flag=True, help="exit 1 when a gated count is over its target")
@click.option("--brief", is_flag=True, help="the table only, not the names counted")
def main(root, check, brief):
    c = scan(read_tree(root))
    print(render(c, verbose=not brief))
    over = over_target(c)
    if check and over:
        print("over target: " + ", ".join(over), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
