"""Click command built from the config dataclasses; YAML overlay.

Precedence (lowest first): dataclass defaults < the trainer's defaults < the
YAML file given with ``--config`` < flags on the command line.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import typing
from typing import Callable, Dict, Optional

import click
import yaml
from click.core import ParameterSource

from .hierarchical import HierarchicalError, flatten_yaml, translate_argv, translate_yaml
from .schema import GROUPS, TrainConfig, flag_index
from .validate import ConfigError, validate


def _click_type(f: dataclasses.Field):
    meta = f.metadata
    if "choices" in meta:
        choices = meta["choices"]
        if all(isinstance(c, int) for c in choices):
            return click.IntRange(min(choices), max(choices))
        return click.Choice(list(choices))
    if "type" in meta:
        return meta["type"]
    ann = f.type if not isinstance(f.type, str) else eval(f.type, vars(typing))  # noqa: S307 - our own annotations
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    base = args[0] if typing.get_origin(ann) is typing.Union and args else ann
    return {int: int, float: float, str: str}.get(base, str)


def _is_bool(f: dataclasses.Field) -> bool:
    return f.type in (bool, "bool")


class GroupedCommand(click.Command):
    """``--help`` lists flags under their concern."""

    def format_options(self, ctx, formatter):
        index = flag_index()
        by_group: Dict[str, list] = {g: [] for g in GROUPS}
        other = []
        for p in self.get_params(ctx):
            rec = p.get_help_record(ctx)
            if rec is None:
                continue
            g = index.get(p.name, (None,))[0]
            (by_group[g] if g else other).append(rec)
        if other:
            with formatter.section("General"):
                formatter.write_dl(other)
        for g, recs in by_group.items():
            if recs:
                with formatter.section(g.capitalize()):
                    formatter.write_dl(recs)

    def parse_args(self, ctx, args):
        known = {o for p in self.get_params(ctx) for o in list(p.opts) + list(getattr(p, "secondary_opts", []))}
        try:  # OpenRLHF's dotted spelling (--actor.adam.lr ...) -> our flat flags
            args = translate_argv(args, sorted(o[2:] for o in known if o.startswith("--")))
        except HierarchicalError as e:
            raise click.UsageError(str(e), ctx) from None
        for a in args:
            if a.startswith("--"):
                name = a.split("=", 1)[0]
                if name not in known:
                    close = difflib.get_close_matches(name, sorted(known), n=1)
                    hint = f"; did you mean {close[0]}?" if close else ""
                    raise click.UsageError(f"unknown flag {name}{hint} (see --help)", ctx)
        return super().parse_args(ctx, args)


def load_yaml(path: str) -> dict:
    """Read a YAML recipe into a flat {flag: value} dict; groups may nest."""
    if not os.path.isfile(path):
        raise ConfigError("config", f"config file {path} does not exist")
    with open(path) as fh:
        raw = yaml.safe_load(fh) or {}
    if not isinstance(raw, dict):
        raise ConfigError("config", f"{path} must hold a mapping of flag: value")
    index = flag_index()
    raw, dotted = flatten_yaml(raw, lambda g, k: g in GROUPS and k in index and index[k][0] == g,
                               lambda g: g in GROUPS)
    try:
        flat = translate_yaml(dotted, list(index))
    except HierarchicalError as e:
        raise ConfigError("config", f"{path}: {e}") from None
    for key, val in raw.items():
        if key in GROUPS and isinstance(val, dict):
            for k, v in val.items():
                if k not in index or index[k][0] != key:
                    raise ConfigError(k, f"{path}: '{k}' is not a flag of group '{key}'")
                flat[k] = v
        else:
            key = key.replace("-", "_")
            if key not in index:
                close = difflib.get_close_matches(key, list(index), n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise ConfigError(key, f"{path}: unknown key '{key}'{hint}")
            flat[key] = val
    return flat


def _coerce(f: dataclasses.Field, value):
    if value is None:
        return None
    if f.metadata.get("nargs"):
        if not isinstance(value, (list, tuple)) or len(value) != f.metadata["nargs"]:
            raise ConfigError(f.name, f"--{f.name} takes {f.metadata['nargs']} values, got {value!r}")
        return tuple(float(v) for v in value)
    if _is_bool(f):
        if isinstance(value, str):
            return value.lower() in ("1", "true", "yes", "on")
        return bool(value)
    typ = _click_type(f)
    try:
        if isinstance(typ, click.Choice):
            if str(value) not in typ.choices:
                raise ConfigError(f.name, f"--{f.name} must be one of {', '.join(typ.choices)}, got {value!r}")
            return str(value)
        if isinstance(typ, click.IntRange):
            v = int(value)
            if v not in f.metadata["choices"]:
                raise ConfigError(f.name, f"--{f.name} must be one of {f.metadata['choices']}, got {value!r}")
            return v
        return typ(value)
    except ConfigError:
        raise
    except (TypeError, ValueError):
        raise ConfigError(f.name, f"--{f.name} expects {getattr(typ, '__name__', typ)}, got {value!r}") from None


def build_config(values: dict, kind: str, trainer_defaults: Optional[dict] = None) -> TrainConfig:
    """Assemble and validate a TrainConfig from a flat {flag: value} mapping."""
    index = flag_index()
    merged = dict(trainer_defaults or {})
    merged.update(values)
    cfg = TrainConfig()
    for name, val in merged.items():
        if name not in index:
            raise ConfigError(name, f"unknown flag --{name}")
        g, f = index[name]
        setattr(getattr(cfg, g), name, _coerce(f, val))
    validate(cfg, kind)
    return cfg


def make_command(kind: str, run: Callable[[TrainConfig], None], trainer_defaults: Optional[dict] = None,
                 help: str = "") -> click.Command:
    """A click command with one option per config field, grouped in --help."""
    trainer_defaults = trainer_defaults or {}
    params = [click.Option(["--config"], type=click.Path(), default=None,
                           help="YAML recipe; flags given on the command line override it"),
              # the `deepspeed` launcher appends --local_rank=N; torchrun sets LOCAL_RANK instead
              click.Option(["--local_rank", "--local-rank"], type=int, default=None, hidden=True)]
    for name, (g, f) in flag_index().items():
        default = trainer_defaults.get(name, f.default)
        if _is_bool(f):
            decl = f"--{name}/--no_{name}" if default else f"--{name}"
            params.append(click.Option([decl], is_flag=True, default=bool(default), help=f.metadata["help"]))
        else:
            params.append(click.Option([f"--{name}"], type=_click_type(f), nargs=f.metadata.get("nargs", 1),
                                       default=default, show_default=default is not None,
                                       help=f.metadata["help"]))

    def callback(**kwargs):
        ctx = click.get_current_context()
        local_rank = kwargs.pop("local_rank", None)
        if local_rank is not None:
            os.environ.setdefault("LOCAL_RANK", str(local_rank))
        explicit = {k: v for k, v in kwargs.items()
                    if k != "config" and ctx.get_parameter_source(k) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)}
        try:
            values = load_yaml(kwargs["config"]) if kwargs.get("config") else {}
            values.update(explicit)
            cfg = build_config(values, kind, trainer_defaults)
        except ConfigError as e:
            raise click.UsageError(str(e)) from None
        return run(cfg)

    return GroupedCommand(name=kind, params=params, callback=callback, help=help,
                          context_settings={"max_content_width": 120, "help_option_names": ["-h", "--help"]})


def parse(kind: str, argv, trainer_defaults: Optional[dict] = None) -> TrainConfig:
    """Parse argv into a validated TrainConfig without running anything (tests, tools)."""
    holder = {}
    cmd = make_command(kind, lambda cfg: holder.setdefault("cfg", cfg), trainer_defaults)
    cmd.main(list(argv), standalone_mode=False)
    return holder["cfg"]


def main_entry(kind: str, run: Callable[[TrainConfig], None], trainer_defaults: Optional[dict] = None, help: str = ""):
    make_command(kind, run, trainer_defaults, help).main(sys.argv[1:], prog_name=f"rlhf.{kind}")
