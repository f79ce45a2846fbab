"""``kvtier serve --config FILE.toml``: a TOML file's settings as the command's defaults.

Keys are the flags without their dashes, at the top level or one table deep
(``[cache]``, ``[tiers]``: tables only group); each value is converted and
checked as the flag's own argument would be, and flags given on the command
line override the file.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Sequence
from typing import Any

from kvtier.errors import ConfigError


def load_config_file(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Settings of a TOML config file as argparse defaults, converted like the flags."""
    try:
        with open(os.path.expanduser(path), "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"the config file {path} is not valid TOML: {exc}") from None
    flat: dict[str, Any] = {}
    for key, value in data.items():
        items = value.items() if isinstance(value, dict) else [(key, value)]
        for k, v in items:
            if isinstance(v, dict):
                raise ConfigError(f"{path}: tables nest one level only ({key}.{k})")
            flat[k] = v
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    out: dict[str, Any] = {}
    for key, value in flat.items():
        dest = key.replace("-", "_")
        action = actions.get(dest)
        if action is None:
            raise ConfigError(
                f"{path}: unknown setting {key!r}; settings are the flags of `kvtier serve "
                "--help` without their dashes"
            )
        out[dest] = _convert(path, key, action, value)
    return out


def _convert(path: str, key: str, action: argparse.Action, value: Any) -> Any:
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: {key} must be true or false, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):
        values = value if isinstance(value, list) else [value]
        return [_convert_one(path, key, action, v) for v in values]
    return _convert_one(path, key, action, value)


def _convert_one(path: str, key: str, action: argparse.Action, value: Any) -> Any:
    if isinstance(value, (list, dict)):
        raise ConfigError(f"{path}: {key} takes one value, got {value!r}")
    text = str(value).lower() if isinstance(value, bool) else str(value)
    if action.type is not None and callable(action.type):
        try:
            result = action.type(text)
        except (argparse.ArgumentTypeError, ValueError, ConfigError) as exc:
            raise ConfigError(f"{path}: {key}: {exc}") from None
    else:
        result = text
    if action.choices is not None and result not in action.choices:
        raise ConfigError(
            f"{path}: {key} must be one of {', '.join(map(str, action.choices))}, got {value!r}"
        )
    return result


def apply_config_file(
    parser: argparse.ArgumentParser,
    serve: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    args: argparse.Namespace,
) -> argparse.Namespace:
    """Parse again with ``--config``'s settings as defaults, so flags override the file."""
    if getattr(args, "config", None) is None:
        return args
    serve.set_defaults(**load_config_file(args.config, serve))
    return parser.parse_args(argv)
