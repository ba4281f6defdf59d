"""Command line: ``entry.py [config.yaml] [key.sub=value ...] [--help]``.

A YAML file fills the dataclasses of :mod:`megarl.config`; ``key=value``
overrides (values parsed as YAML) come after it. Unknown keys get a "did you
mean", wrong types name the key and the expected type. :func:`main_guard`
turns a :class:`ConfigError` into one line on stderr and exit code 2.
"""
from __future__ import annotations

import dataclasses
import difflib
import keyword
import os
import sys
import time
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from megarl.errors import ConfigError, UserInputError

QUIET_EXIT_PAUSE_S = 5.0  # a silent process's wait before its exit 2 (the first one prints meanwhile)


def _suggest(key: str, choices) -> str:
    close = difflib.get_close_matches(key.split(".")[-1], list(choices), n=1)
    return f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(sorted(choices))}"


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp, key: str, base=None):
    """Checks ``value`` against the annotation ``tp``; returns the typed value.

    ``base`` is the current value of a nested section, which ``value`` updates.
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for member in inner[:-1]:  # the first member that takes the value (bool | Literal["force"])
            try:
                return _coerce(value, member, key)
            except ConfigError:
                pass
        try:
            return _coerce(value, inner[-1], key)
        except ConfigError:
            if len(inner) == 1:
                raise
            raise ConfigError(f"{key}: expected {' or '.join(_help_type(a) for a in inner)}, got {value!r}") from None
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, args))}")
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key, base)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)] if args else value
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return value
    return _coerce_scalar(value, tp, key)


def _coerce_scalar(value, tp, key):
    if tp in (int, float) and isinstance(value, str):
        try:  # YAML 1.1 reads "3e-4" as a string
            value = tp(value)
        except ValueError:
            pass
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if tp in (int, float, str, bool) and not (isinstance(value, tp) and not (tp is int and isinstance(value, bool))):
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    return value


def field_name(key: str) -> str:
    """The dataclass field of a config key: a Python keyword (``async``) is spelled with a trailing ``_``."""
    return key + "_" if keyword.iskeyword(key) else key


def build(cls, data: Any, prefix: str = "", base=None):
    """Builds dataclass ``cls`` from a mapping over ``base`` (default: ``cls()``)."""
    if data is None:
        data = {}
    if dataclasses.is_dataclass(data):
        data = dataclasses.asdict(data)
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    base = cls() if base is None else base
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else key
        key = field_name(key)
        if key not in names:
            raise ConfigError(f"unknown key '{full}'{_suggest(key, names)}")
        kwargs[key] = _coerce(value, hints[key], full, getattr(base, key))
    return dataclasses.replace(base, **kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``actor.optim.lr=1e-5`` -> ("actor.optim.lr", 1e-05)."""
    if "=" not in text or text.startswith("="):
        raise ConfigError(f"argument '{text}' is not key=value; write e.g. trainer.steps=10")
    key, raw = text.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        return key.strip(), raw


def read_yaml(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{path}' not found; pass a path such as yaml/tiny.yaml")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        raise ConfigError(f"{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return data


def _get_dotted(tree: dict, dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def resolve_yaml_paths(tree: dict, yaml_path: str, keys) -> None:
    """A relative input path written in the yaml (``keys``, dotted) is read from the working
    directory when it exists there, else from the yaml's directory when it exists there; otherwise
    it stays as written (a hub id, or a missing file the checks name)."""
    base = os.path.dirname(yaml_path)
    for key in keys:
        if "[]." in key:  # "data.train_mix[].path": that field of every entry of a list
            list_key, field = key.split("[].", 1)
            entries = _get_dotted(tree, list_key)
            for entry in entries if isinstance(entries, list) else []:
                if isinstance(entry, dict) and _beside_yaml(entry.get(field), base):
                    entry[field] = _beside_yaml(entry[field], base)
            continue
        beside = _beside_yaml(_get_dotted(tree, key), base)
        if beside:
            _set_dotted(tree, key, beside)


def _beside_yaml(value: Any, base: str) -> str | None:
    """``value`` under the yaml's directory ``base`` when it is a relative path that exists there and
    not in the working directory; else None."""
    if not isinstance(value, str) or not value or os.path.isabs(value) or os.path.exists(value):
        return None
    beside = os.path.normpath(os.path.join(base, value))
    return beside if os.path.exists(beside) else None


def add_import_dirs(yaml_path: str | None) -> None:
    """The working directory and the yaml's directory go on ``sys.path`` (after what is there), so
    ``module:function`` extension points (rewards, row maps, metrics, tools) import on every rank
    without ``PYTHONPATH``."""
    dirs = [os.getcwd()] + ([os.path.dirname(os.path.abspath(yaml_path))] if yaml_path else [])
    for d in dirs:
        if d not in sys.path:
            sys.path.append(d)


def load_config(argv: list[str], cls):
    """YAML file (optional, first) plus overrides -> an instance of ``cls``.

    ``cls.INPUT_PATH_KEYS`` (dotted keys) are the inputs :func:`resolve_yaml_paths` resolves;
    ``cls.RUN_DIR_KEY``, when neither the yaml nor an override sets it, becomes
    ``runs/<yaml file name without .yaml>``.
    """
    tree: dict = {}
    args = list(argv)
    yaml_path = None
    if args and "=" not in args[0]:
        yaml_path = args.pop(0)
        tree = read_yaml(yaml_path)
        resolve_yaml_paths(tree, yaml_path, getattr(cls, "INPUT_PATH_KEYS", ()))
    add_import_dirs(yaml_path)
    for text in args:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    run_dir_key = getattr(cls, "RUN_DIR_KEY", None)
    if yaml_path and run_dir_key and _get_dotted(tree, run_dir_key) is None:
        _set_dotted(tree, run_dir_key, os.path.join("runs", Path(yaml_path).stem))
    return build(cls, tree)


def _help_type(tp) -> str:
    """``Optional[str]`` -> "str | None"; ``Literal["a", "b"]`` -> "a | b"."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(map(str, args))
    if origin in (Union, types.UnionType):
        return " | ".join(_help_type(a) if a is not type(None) else "None" for a in args)
    if origin is not None:
        return str(tp).replace("typing.", "")
    return _type_name(tp)


def help_text(cls, prefix: str = "", defaults=None) -> str:
    """Every key with its default, type and doc, one per line.

    Defaults come from an instance, so a section whose default differs from its
    class's (``critic.optim.lr``) shows the value that applies.
    """
    defaults = cls() if defaults is None else defaults
    lines, sections = [], []  # a section's own keys first, then its sub-sections under their headers
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, tp, default = f"{prefix}{f.name.rstrip('_')}", hints[f.name], getattr(defaults, f.name)
        if dataclasses.is_dataclass(tp):
            sections.append(f"\n[{key}] {f.metadata.get('doc', '')}")
            sections.append(help_text(tp, key + ".", default))
            continue
        if isinstance(default, list) and default and dataclasses.is_dataclass(default[0]):
            default = [dataclasses.asdict(d) for d in default]
        lines.append(f"  {key} = {default!r}  ({_help_type(tp)})  {f.metadata.get('doc', '')}")
    return "\n".join(lines + sections)


_LOCAL_RANK_KEYS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")


def first_on_host() -> bool:
    """True unless a launcher says this is not the host's first process.

    Every rank reads the same config and fails alike; one line per host is
    enough (a missing file on one host is still reported by that host).
    """
    local = next((os.environ[k] for k in _LOCAL_RANK_KEYS if k in os.environ), "0")
    return local.strip() in ("", "0")


def main_guard(main, argv=None, cls=None, usage: str = "") -> None:
    """Runs ``main(argv)``; a user mistake (ConfigError, DataError, a bad checkpoint
    directory) becomes one stderr line and exit 2.

    Under a launcher only the first process of each host prints the line; every
    process exits 2, the others after a pause: a launcher stops the rest once one
    fails, and under load it stopped the first before it printed (seen in CI).
    A CUDA out-of-memory error that ends the run first prints the largest live
    device tensors (megarl/monitor/oom_report.py), then propagates.
    """
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        text = usage + ("\n" + help_text(cls) if cls is not None else "")
        try:
            print(text, flush=True)
        except BrokenPipeError:  # `--help | head`: the reader left; not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    try:
        main(argv)
    except UserInputError as e:
        if first_on_host():
            print(f"{e.kind}: {e}", file=sys.stderr, flush=True)
        else:
            time.sleep(QUIET_EXIT_PAUSE_S)
        sys.exit(2)
    except Exception as e:
        torch = sys.modules.get("torch")  # not imported here for --help's sake; a run has imported it
        if torch is not None and isinstance(e, torch.OutOfMemoryError):
            from megarl.monitor.oom_report import oom_report

            print(f"rank {os.environ.get('RANK', '0')}: CUDA out of memory; {oom_report()}", file=sys.stderr,
                  flush=True)
        raise
