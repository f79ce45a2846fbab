"""``kvtier info``: the version, the registered policies and which optional packages are here."""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform

from kvtier._version import __version__
from kvtier.keys import HASH_ALGORITHMS
from kvtier.policy import available_policies

_OPTIONAL = ("torch", "transformers", "fastapi", "redis", "vllm", "libcachesim")


def run(args: argparse.Namespace) -> int:
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


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    info = sub.add_parser("info", help="show the version, policies and optional packages")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    info.set_defaults(func=run)
