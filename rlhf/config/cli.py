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

from rlhf.config import openrlhf_compat
from rlhf.config.hierarchical import HierarchicalError, flatten_yaml, translate_argv, translate_yaml
from rlhf.config.schema import GROUPS, TrainConfig, flag_index
from rlhf.config.validate import ConfigError, validate
from rlhf.console import is_rank0, print0


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


class ConfigUsageError(click.UsageError):
    """A ConfigError found while parsing: shown as one line (its message names the flag and the fix), no usage
    banner; exit code 2 like any usage error."""

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", file=file or sys.stderr)


def yaml_error(path: str, e: yaml.YAMLError) -> ConfigError:
    """One line for a YAML syntax error: the file, line and column (1-based, as editors count) and what the
    parser expected (PyYAML's MarkedYAMLError: ``problem``/``problem_mark``, ``context``/``context_mark``)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "somewhere"
    what = "; ".join(x for x in (getattr(e, "problem", None), getattr(e, "context", None)) if x)
    what = what or (str(e).splitlines() or ["unreadable"])[0]
    ctx = getattr(e, "context_mark", None)
    if ctx is not None and mark is not None and (ctx.line, ctx.column) != (mark.line, mark.column):
        what += f" (opened at line {ctx.line + 1}, column {ctx.column + 1})"
    return ConfigError("config", f"--config {path}: YAML syntax error at {where}: {what}; fix the file there")


def load_yaml(path: str) -> dict:
    """Read a YAML recipe into a flat {flag: value} dict; groups may nest."""
    if not os.path.isfile(path):
        raise ConfigError("config", f"config file {path} does not exist")
    with open(path) as fh:
        try:
            raw = yaml.safe_load(fh) or {}
        except yaml.YAMLError as e:
            raise yaml_error(path, e) from None
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
            if key not in index and key not in openrlhf_compat.active(index):
                close = difflib.get_close_matches(key, list(index), n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise ConfigError(key, f"{path}: unknown key '{key}'{hint}")
            flat[key] = val
    return flat


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def coerce_bool(name: str, value) -> bool:
    """Strict: YAML true/false, 0/1, or the strings true/false/yes/no/on/off/1/0 (any case); anything else is an error."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(name, f"--{name} is a switch: give true or false, got {value!r}")


def coerce_int(name: str, value) -> int:
    """Strict: an int, an integral float (4.0) or a string of one; 4.9, 32.5, "many" and booleans are errors."""
    if isinstance(value, bool):
        raise ConfigError(name, f"--{name} expects an integer, got the boolean {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(name, f"--{name} expects int, got {value!r}") from None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ConfigError(name, f"--{name} expects int, got {value!r}: not a whole number (it is not rounded or cut; "
                            f"write the integer you mean)")


def coerce_float(name: str, value) -> float:
    if isinstance(value, bool) or isinstance(value, (list, tuple, dict)):
        raise ConfigError(name, f"--{name} expects float, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(name, f"--{name} expects float, got {value!r}") from None


def _coerce(f: dataclasses.Field, value):
    if value is None:
        return None
    if f.metadata.get("nargs"):
        if not isinstance(value, (list, tuple)) or len(value) != f.metadata["nargs"]:
            raise ConfigError(f.name, f"--{f.name} takes {f.metadata['nargs']} values, got {value!r}")
        return tuple(coerce_float(f.name, v) for v in value)
    if _is_bool(f):
        return coerce_bool(f.name, value)
    typ = _click_type(f)
    if isinstance(typ, click.Choice):
        if str(value) not in typ.choices:
            raise ConfigError(f.name, f"--{f.name} must be one of {', '.join(typ.choices)}, got {value!r}")
        return str(value)
    if isinstance(typ, click.IntRange):
        v = coerce_int(f.name, value)
        if v not in f.metadata["choices"]:
            raise ConfigError(f.name, f"--{f.name} must be one of {f.metadata['choices']}, got {value!r}")
        return v
    if typ is int:
        return coerce_int(f.name, value)
    if typ is float:
        return coerce_float(f.name, value)
    if isinstance(value, (list, tuple, dict)):
        raise ConfigError(f.name, f"--{f.name} expects a string, got {value!r}")
    return str(value)


def _coerce_compat(name: str, c, value):
    if value is None:
        return None
    if c.nargs > 1:
        if not isinstance(value, (list, tuple)) or len(value) != c.nargs:
            raise ConfigError(name, f"--{name} takes {c.nargs} values, got {value!r}")
        return tuple(coerce_float(name, v) for v in value)
    if c.type is bool:
        return coerce_bool(name, value)
    if c.type is int:
        return coerce_int(name, value)
    if c.type is float:
        return coerce_float(name, value)
    return str(value)


def build_config(values: dict, kind: str, trainer_defaults: Optional[dict] = None) -> TrainConfig:
    """Assemble and validate a TrainConfig from a flat {flag: value} mapping."""
    index = flag_index()
    compat = openrlhf_compat.active(index)
    values = {k: _coerce_compat(k, compat[k], v) if k in compat else v for k, v in values.items()}
    values, notices = openrlhf_compat.translate(values, index)
    for n in notices:
        print0(n, file=sys.stderr)
    merged = dict(trainer_defaults or {})
    merged.update(values)
    cfg = TrainConfig()
    for name, val in merged.items():
        if name not in index:
            raise ConfigError(name, f"unknown flag --{name}")
        g, f = index[name]
        setattr(getattr(cfg, g), name, _coerce(f, val))
    from rlhf.config.openrlhf_meaning import resolve_given  # OpenRLHF's meaning of flags given (or not): --max_len in RL, ...

    resolve_given(cfg, kind, values)
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
    index = flag_index()
    for name, c in openrlhf_compat.active(index).items():
        if name == "local_rank":
            continue
        if c.type is bool:
            params.append(click.Option([f"--{name}"], is_flag=True, default=False, hidden=True))
        else:
            params.append(click.Option([f"--{name}"], type=c.type, nargs=c.nargs, default=None, hidden=True))
    for name, (g, f) in index.items():
        default = trainer_defaults.get(name, f.default)
        if f.metadata.get("optional_value"):
            params.append(click.Option([f"--{name}"], type=str, is_flag=False, flag_value=f.metadata["optional_value"],
                                       default=default, help=f.metadata["help"]))
        elif _is_bool(f):
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
            raise ConfigUsageError(str(e)) from None
        return run(cfg)

    return GroupedCommand(name=kind, params=params, callback=callback, help=help,
                          context_settings={"max_content_width": 120, "help_option_names": ["-h", "--help"]})


def parse(kind: str, argv, trainer_defaults: Optional[dict] = None) -> TrainConfig:
    """Parse argv into a validated TrainConfig without running anything (tests, tools)."""
    holder = {}
    cmd = make_command(kind, lambda cfg: holder.setdefault("cfg", cfg), trainer_defaults)
    cmd.main(list(argv), standalone_mode=False)
    return holder["cfg"]


EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: checkpointed and stopped before the end; run again to resume


def main_entry(kind: str, run: Callable[[TrainConfig], None], trainer_defaults: Optional[dict] = None, help: str = ""):
    """The trainers' CLI.  Exit codes: 0 the run completed; 75 (EXIT_PREEMPTED) a stop request (stop file,
    SIGUSR1/TERM/INT/HUP) checkpointed an incomplete run (resume with --load_checkpoint); 1 a failure; 2 bad input."""
    def run_and_exit(cfg):
        trainer = run(cfg)
        if getattr(getattr(trainer, "cadence", None), "preempted", False):
            sys.exit(EXIT_PREEMPTED)

    cmd = make_command(kind, run_and_exit, trainer_defaults, help)
    try:
        cmd.main(sys.argv[1:], prog_name=f"rlhf.{kind}", standalone_mode=False)
    except click.ClickException as e:  # bad input: every rank parses the same argv; the message once, from rank 0
        if is_rank0():
            e.show()
        sys.exit(e.exit_code)
    except click.Abort:
        sys.exit(1)
    except Exception as e:  # a 1-rank job: failfast.guarded let it through (more ranks: guarded ended the job)
        refuse_one_line(e)
        raise


def refuse_one_line(e: BaseException) -> None:
    """A refusal (``failfast.is_input_error``: an ``rlhf.errors.Refusal`` or a click usage error) as the one line
    ``error: <message>`` and exit 2 before any process group (1 after), as ``failfast.guarded`` does on more ranks;
    anything else returns (and its traceback follows)."""
    from rlhf.distributed import failfast

    if not failfast.is_input_error(e):
        return
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(failfast.refusal_code())
