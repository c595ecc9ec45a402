"""docs/ARCHITECTURE.md against the code, so the page cannot go stale: every ``Batch`` field with its writer, every
stage, every role, every registered engine, and the layer table (an import that climbs a layer must be listed as a
known climb; a listed climb that is gone must be removed).  Reads the page and the sources only (no model, no
process group)."""
from __future__ import annotations

import ast
import fnmatch
import os
import re
from dataclasses import fields

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "ARCHITECTURE.md")


def sections() -> dict:
    """Heading (without '## ') -> its text."""
    text = open(DOC).read()
    out = {}
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        head, _, body = part.partition("\n")
        out[head.strip()] = body
    return out


def section(start: str) -> str:
    return next(body for head, body in sections().items() if head.startswith(start))


def table_rows(text: str) -> dict:
    """First cell (backticks stripped) -> the row's cells, for the table rows of ``text``."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0].strip("`")] = cells
    return rows


def test_every_batch_field_is_in_the_table_with_its_writer():
    from rlhf.batch import Batch

    rows = table_rows(section("The step record"))
    for f in fields(Batch):
        assert f.name in rows, f"Batch field {f.name!r} is missing from docs/ARCHITECTURE.md's step-record table"
        writer = rows[f.name][3]
        assert writer.startswith(f.metadata["writer"]), \
            f"{f.name}: the table says writer {writer!r}, rlhf/batch.py says {f.metadata['writer']!r}"
    assert set(rows) == {f.name for f in fields(Batch)}, "the table lists a field Batch no longer has"


def stage_roles() -> dict:
    """Stage name -> its declared role, for every stage class of rlhf.rl.stages (the update stages by role)."""
    from rlhf.rl import stages

    def subclasses(c):
        for s in c.__subclasses__():
            yield s
            yield from subclasses(s)

    out = {c.name: c.role for c in subclasses(stages.Stage) if c.name}
    out.update({s.name: s.role for s in stages.declared_forwards(None, None)})  # the role table's forward stages
    for r in ("critic", "actor"):
        u = stages.UpdateStage(r)
        out[u.name] = u.role
    return out


def test_every_stage_is_in_the_stage_table_with_its_role():
    rows, declared = table_rows(section("One RL step")), stage_roles()
    names = set(declared)
    assert names <= set(rows), f"stages missing from docs/ARCHITECTURE.md: {sorted(names - set(rows))}"
    assert set(rows) <= names, f"the stage table lists stages that no longer exist: {sorted(set(rows) - names)}"
    for name, role in declared.items():
        if role is not None:
            assert rows[name][1].startswith(role), f"stage {name}: the table says role {rows[name][1]!r}, the code {role!r}"


def test_every_role_and_registered_engine_is_named():
    from rlhf.distributed.role_table import ROLE_TABLE
    from rlhf.engines.rollout_registry import engine_kinds
    from rlhf.engines.train_registry import TRAIN_ENGINES

    roles, engines = section("Roles"), section("Engines")
    for name in ROLE_TABLE:
        assert f"`{name}`" in roles, f"role {name!r} (rlhf.distributed.role_table) is not named in the Roles section"
    for name in (*engine_kinds(), *TRAIN_ENGINES):
        assert f"`{name}`" in engines, f"engine {name!r} is registered but not named in the Engines section"


def layer_table() -> list:
    """(pattern, layer) from the layer table: ``config/schema`` a module, ``train_*`` a glob, ``rl`` a folder."""
    out = []
    for line in section("Layers").splitlines():
        m = re.match(r"\| L(\d) \| (.*?) \|", line)
        if m:
            out += [(p, int(m.group(1))) for p in re.findall(r"`([^`]+)`", m.group(2))]
    return out


def layer_of(module: str, table: list) -> int:
    """The layer of ``rlhf.a.b``: the longest pattern that names it, the folder above it, or matches it."""
    path = module.split(".", 1)[1].replace(".", "/") if "." in module else "__init__"
    best = None
    for pat, layer in table:
        if path == pat or path.startswith(pat + "/") or fnmatch.fnmatch(path, pat):
            if best is None or len(pat) > len(best[0]):
                best = (pat, layer)
    assert best is not None, f"{module} is in no layer of docs/ARCHITECTURE.md's table"
    return best[1]


def imports() -> set:
    """(importer, imported) module pairs of the library, module-level and inside functions alike."""
    mods = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, "rlhf")):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].split(os.sep)
                mods[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = os.path.join(dirpath, f)
    pairs = set()
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            pairs |= {(mod, t) for t in targets if t in mods and t != mod}
    return pairs


def test_imports_climb_no_layer_but_the_listed_ones():
    table = layer_table()
    climbs = {f"{a} -> {b}" for a, b in imports() if layer_of(a, table) < layer_of(b, table)}
    known = set(re.findall(r"^- `(rlhf\.[\w.]+ -> rlhf\.[\w.]+)`", section("Layers"), flags=re.M))
    assert climbs <= known, (f"imports that climb a layer (docs/ARCHITECTURE.md, Layers): {sorted(climbs - known)}; "
                             f"import downward instead, or move the module")
    assert known <= climbs, f"listed climbs that are gone: remove {sorted(known - climbs)} from docs/ARCHITECTURE.md"
