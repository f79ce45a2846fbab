"""The ``kvtier`` command line, one module per command: info, replay, serve, top, cluster, route."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvtier._version import __version__
from kvtier.cli import cluster, config_file, info, replay, route, serve, top
from kvtier.errors import KvTierError
from kvtier.units import parse_memory_size

__all__ = ["build_parser", "main", "parse_memory_size"]


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The top-level parser and the ``serve`` subparser (its defaults take ``--config``)."""
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="kvtier: a KV-cache manager for LLM inference (prefix caching, "
        "eviction policies, tiered offload, memory pressure).",
    )
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    info.add_parser(sub)
    replay.add_parser(sub)
    serve_parser = serve.add_parser(sub)
    top.add_parser(sub)
    cluster.add_parser(sub)
    route.add_parser(sub)
    return parser, serve_parser


def main(argv: Sequence[str] | None = None) -> int:
    parser, serve_parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        if args.command == "serve":
            args = config_file.apply_config_file(parser, serve_parser, argv, args)
        return int(args.func(args))
    except KvTierError as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
