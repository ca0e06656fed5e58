"""`tinkerd serve`'s flags, derived from ServerConfig's fields: one name, one default, one help text.

Each field is a flag named `--` + the field with dashes, its help the field's description, its shown
default the field's default, its values checked by the field's own type and constraints (a bad value
is argparse's usage error naming the flag, exit 2, before anything starts). A flag not given leaves
its field alone, so ServerConfig's default applies, environment variables included (ServerConfig is
the only place they are read). tests/unit/test_config_flags.py keeps the fields, the flags and
docs/configuration.md's tables one to one."""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from tinkerd.config import ServerConfig

# Flags whose names predate the rule; tests, scripts, benchmarks and the docs use these.
RENAMED = {"base_models": "--base-model", "torch_threads": "--threads"}
# Fields whose None ("no bound") is given as 0 on the command line, which has no word for None.
ZERO_IS_NONE = frozenset({"max_queued_ops_per_model", "max_queued_ops"})
# Fields deliberately without a flag, each with the reason (none today: every setting is a flag).
NOT_FLAGS: dict[str, str] = {}


def flag_name(field: str) -> str:
    return RENAMED.get(field, "--" + field.replace("_", "-"))


def flag_fields() -> dict[str, FieldInfo]:
    return {name: info for name, info in ServerConfig.model_fields.items() if name not in NOT_FLAGS}


def add_flags(parser: argparse.ArgumentParser, fields: dict[str, FieldInfo] | None = None) -> None:
    """One flag per field (default: all of ServerConfig's but NOT_FLAGS). Its default is SUPPRESS: a
    flag not given is absent from the namespace, apart from one given a value that means None."""
    for name, info in (flag_fields() if fields is None else fields).items():
        parser.add_argument(flag_name(name), dest=name, default=argparse.SUPPRESS, help=_help(info),
                            **_value_spec(name, info))


def config_values(args: argparse.Namespace, fields: dict[str, FieldInfo] | None = None) -> dict[str, Any]:
    """The ServerConfig fields the command line gave, by field name (only `fields`' when given: a
    command's own options may share a field's name, as `accounts set-quota --max-concurrent-runs`)."""
    given = vars(args)
    return {name: given[name] for name in (fields or ServerConfig.model_fields) if name in given}


def pick(*names: str) -> dict[str, FieldInfo]:
    """Some of ServerConfig's fields, for a command that takes their flags too."""
    return {name: ServerConfig.model_fields[name] for name in names}


# The flags of every command that opens a data directory's store (keys, accounts, usage, fsck):
# `serve`'s own, so each has one definition and one default.
STORE_FIELDS = ("data_dir", "db_url")


def add_store_flags(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, pick(*STORE_FIELDS))


def store_config(args: argparse.Namespace, fields: dict[str, FieldInfo] | None = None) -> ServerConfig:
    """ServerConfig from a store command's flags (and `fields`' when given); the rest its defaults."""
    return ServerConfig(**config_values(args, pick(*STORE_FIELDS) | (fields or {})))


def _help(info: FieldInfo) -> str:
    text = info.description or ""
    if info.default_factory is None and info.default is not None:
        # A default computed at start (an environment variable, a list) or None ("not set": what that
        # means differs per field) is said in the description itself.
        text += f" (default: {_shown(info.default)})"
    return text.replace("%", "%%")  # argparse formats help with %


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _value_spec(name: str, info: FieldInfo) -> dict[str, Any]:
    annotation = _without_none(info.annotation)
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}  # --metrics / --no-metrics
    if typing.get_origin(annotation) is Literal:
        return {"choices": typing.get_args(annotation)}
    word = flag_name(name).rsplit("-", 1)[-1].upper()  # --db-url URL, --base-model MODEL
    if typing.get_origin(annotation) is list:  # repeatable: --base-model A --base-model B
        (item,) = typing.get_args(annotation)
        return {"action": "append", "type": _parser(item, name), "metavar": word}
    constrained = Annotated[(annotation, *info.metadata)] if info.metadata else annotation  # gt=0 and such
    return {"type": _parser(constrained, name), "metavar": word if annotation in (str, Path) else "N"}


def _without_none(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def _parser(annotation: Any, name: str):
    """argparse's type= for one value: the field's own validation, so the flag and ServerConfig
    accept the same values; Paths expanded and made absolute (a relative --data-dir is the cwd's)."""
    adapter = TypeAdapter(annotation)

    def parse(text: str):
        if name in ZERO_IS_NONE and text.strip() == "0":
            return None
        try:
            value = adapter.validate_python(text)
        except ValidationError as e:
            hint = " or 0 for no bound" if name in ZERO_IS_NONE else ""
            raise argparse.ArgumentTypeError(f"{e.errors()[0]['msg'].lower()}{hint}, got {text!r}") from None
        return value.expanduser().resolve() if isinstance(value, Path) else value

    parse.__name__ = name  # argparse names the type in some of its messages
    return parse
