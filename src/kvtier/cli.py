"""The ``kvtier`` command line: ``kvtier info`` (and more subcommands as they land)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
from collections.abc import Sequence

from kvtier import __version__
from kvtier.errors import KvTierError
from kvtier.keys import HASH_ALGORITHMS
from kvtier.policy import available_policies

_OPTIONAL = ("torch", "transformers", "fastapi", "redis", "vllm", "libcachesim")


def _info(args: argparse.Namespace) -> int:
    info = {
        "kvtier": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "policies": available_policies(),
        "hash_algorithms": list(HASH_ALGORITHMS),
        "optional_packages": {
            name: importlib.util.find_spec(name) is not None for name in _OPTIONAL
        },
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"kvtier {info['kvtier']} on Python {info['python']} ({info['platform']})")
    print(f"  policies:         {', '.join(info['policies'])}")
    print(f"  hash algorithms:  {', '.join(info['hash_algorithms'])}")
    extras = info["optional_packages"]
    assert isinstance(extras, dict)
    print("  optional packages:")
    for name, present in extras.items():
        print(f"    {name:<13} {'installed' if present else 'missing'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="kvtier: a KV-cache manager for LLM inference (prefix caching, "
        "eviction policies, tiered offload, memory pressure).",
    )
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="show the version, policies and optional packages")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    info.set_defaults(func=_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except KvTierError as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
