"""OpenRLHF's own command-line flags, read from its parsers (``openrlhf/cli/*.py``) without importing OpenRLHF.

    python -m rlhf.tools.openrlhf_flags --wheel 0.10.1=DIR --wheel 0.11.0=DIR --wheel 0.11.2=DIR

DIR is an unpacked OpenRLHF wheel (``pip download --no-deps openrlhf==X`` then unzip) or a source checkout; the
``parser.add_argument`` calls of each ``openrlhf/cli`` module are read from the source (ast) and written to
``openrlhf_flags.json`` next to this file: {version: {cli module: {flag: {default, type, action, nargs,
choices}}}}.  docs/FLAGS.md's OpenRLHF table (rlhf/tools/flags_md.py) and bench/openrlhf_examples.py read it.
"""
from __future__ import annotations

import ast
import glob
import json
import os
from typing import Dict

import click

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "openrlhf_flags.json")
CLI_MODULES = ("train_sft", "train_rm", "train_dpo", "train_ppo_ray", "serve_rm")


def _value(node, env):
    """A keyword's value: a literal, a type name (``type=int`` -> "int"), or an expression over the loop variable
    (``1e-6 if prefix == "actor" else 9e-6``); anything else as its source text."""
    if isinstance(node, ast.Name) and node.id not in env:
        return node.id
    try:
        return eval(compile(ast.Expression(node), "<flag>", "eval"), {"__builtins__": {}}, dict(env))
    except Exception:  # noqa: BLE001 - a computed default (datetime.now(), ...) is kept as its source text
        return ast.unparse(node)


def _calls(tree, env=()):
    """(add_argument call, loop bindings) pairs; ``for prefix in ("actor", "critic"):`` bodies once per value."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
            try:
                values = ast.literal_eval(node.iter)
            except ValueError:
                values = None
            if values is not None:
                for v in values:
                    for stmt in node.body:
                        yield from _calls(stmt, env + ((node.target.id, v),))
                continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            yield node, env
        yield from _calls(node, env)


def parser_flags(source: str) -> Dict[str, dict]:
    """{flag without dashes: {default, type, action, nargs, choices}} of every ``add_argument`` call in source."""
    out = {}
    for node, env in _calls(ast.parse(source)):
        names = [_value(a, env) for a in node.args]
        names = [n for n in names if isinstance(n, str) and n.startswith("--")]
        kw = {k.arg: _value(k.value, env) for k in node.keywords
              if k.arg in ("default", "type", "action", "nargs", "choices", "dest")}
        if kw.get("action") == "store_true" and "default" not in kw:
            kw["default"] = False
        for n in names:
            out[n[2:]] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in kw.items()}
    return out


def read_version(root: str) -> Dict[str, Dict[str, dict]]:
    """{cli module: flags} of one unpacked OpenRLHF wheel or checkout."""
    found = {}
    for module in CLI_MODULES:
        hits = glob.glob(os.path.join(root, "**", "openrlhf", "cli", module + ".py"), recursive=True)
        if hits:
            with open(hits[0]) as fh:
                found[module] = parser_flags(fh.read())
    if not found:
        raise click.UsageError(f"no openrlhf/cli/*.py under {root}")
    return found


def load() -> Dict[str, Dict[str, Dict[str, dict]]]:
    """The stored table: {version: {cli module: {flag: spec}}}."""
    with open(PATH) as fh:
        return json.load(fh)


@click.command()
@click.option("--wheel", "wheels", multiple=True, required=True, help="VERSION=DIR (an unpacked OpenRLHF wheel)")
def main(wheels):
    table = {}
    for spec in wheels:
        version, _, root = spec.partition("=")
        table[version] = read_version(root)
    with open(PATH, "w") as fh:
        json.dump(table, fh, indent=1, sort_keys=True, default=str)
        fh.write("\n")
    click.echo(f"wrote {PATH}: " + ", ".join(f"{v} ({sum(map(len, m.values()))} flags)" for v, m in table.items()))


if __name__ == "__main__":
    main()
