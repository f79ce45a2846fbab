"""``kvtier route``: a KV-event-aware router in front of several ``kvtier serve``.

Each instance publishes the blocks it caches (``kvtier serve --kv-events``);
this command follows those events and sends each request to the instance
holding the longest prefix of its tokens (:mod:`kvtier.routing`). It loads
only the model's tokenizer, never its weights, and serves the OpenAI API
(``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``) plus
``/health`` and ``/stats`` (the routing decisions).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from typing import Any

from kvtier.cli.args import arg, float_in, non_negative_int, port
from kvtier.errors import ConfigError

_EPILOG = """\
instances (--instance URL=EVENTS, one per kvtier serve):
  URL     the instance's HTTP address, e.g. http://10.0.0.5:8001
  EVENTS  the endpoint the instance was given with --kv-events:
          tcp://*:5557            the instance listens; the router connects to URL's host
          tcp://10.0.0.9:5601     the instance connects there; the router listens on it
          ipc:///tmp/kv-1         the instance listens on the socket file

routing:
  Each request goes to the instance holding the most leading blocks of its
  prompt (read from the instances' KV events), skipping any instance with
  more than --balance-threshold requests in flight above the least loaded
  one; with no cached block anywhere, to the least loaded instance. The
  prompt is tokenized with --model's tokenizer, as the instances do: give
  the same model they serve. An instance that refuses connections is routed
  around until its /health answers again. GET /stats shows the decisions.

examples:
  kvtier serve --port 8001 --kv-events 'tcp://*:5557' &
  kvtier serve --port 8002 --kv-events 'tcp://*:5558' &
  kvtier route --instance http://127.0.0.1:8001=tcp://*:5557 \\
               --instance http://127.0.0.1:8002=tcp://*:5558 --port 8000
  kvtier cluster --router kvtier                   # the same, started and stopped together
"""


def parse_instance(text: str, number: int) -> tuple[str, str, str]:
    """``(name, url, events)`` of an ``--instance URL=EVENTS`` value."""
    url, sep, events = text.rpartition("=")
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if not sep or not url.startswith(("http://", "https://")) or "://" not in events:
        raise ConfigError(
            f"--instance {text!r}: expected URL=EVENTS, e.g. "
            "--instance http://127.0.0.1:8001=tcp://*:5557 (the instance's HTTP address and "
            "the endpoint it was given with --kv-events)"
        )
    return f"instance-{number}", url, events.strip()


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from kvtier.routing.proxy import Instance, create_app
    except ImportError as exc:
        raise ConfigError(
            f"kvtier route needs starlette, uvicorn, httpx, pyzmq and msgspec ({exc}): "
            "pip install 'kvtier[serve]' pyzmq msgspec"
        ) from None
    from kvtier.cli.serve import _bind, _client_url
    from kvtier.model_files import load_tokenizer

    if not args.instance:
        raise ConfigError(
            "kvtier route needs the instances to route to: --instance URL=EVENTS, once per "
            "kvtier serve (see kvtier route --help)"
        )
    parsed = [parse_instance(text, i + 1) for i, text in enumerate(args.instance)]
    urls = [url for _, url, _ in parsed]
    if len(set(urls)) != len(urls):
        raise ConfigError(f"--instance names the same URL twice: {urls}")
    instances = [Instance(name, url, events) for name, url, events in parsed]
    tokenizer = load_tokenizer(os.path.expanduser(args.model) if args.model else None)
    if getattr(tokenizer, "chat_template", None) is None:
        print(
            "kvtier: warning: the model has no chat template: chat requests are routed "
            "without their prefix",
            flush=True,
        )
    app: Any = create_app(
        instances,
        tokenizer,
        balance_threshold=args.balance_threshold,
        health_interval_s=args.health_interval,
        admin_key=args.admin_key or os.environ.get("KVTIER_ADMIN_KEY") or None,
    )
    logging.basicConfig(
        level=args.log_level.upper(), format="kvtier route: %(levelname)s: %(message)s"
    )
    sock = _bind(args.host, args.port)
    try:
        config = uvicorn.Config(
            app, log_level=args.log_level, timeout_graceful_shutdown=5, access_log=False
        )
        server = uvicorn.Server(config)
        sock.listen(config.backlog)
        url = _client_url(args.host, sock.getsockname()[1])
        for inst in instances:
            print(f"kvtier:   {inst.name}: {inst.url}/v1, KV events {inst.events}", flush=True)
        print(
            f"kvtier: routing {len(instances)} instances by their KV events at {url}/v1 "
            f"(OpenAI-compatible; routing decisions: curl {url}/stats)",
            flush=True,
        )
        # uvicorn re-raises Ctrl-C once its graceful shutdown is done.
        with contextlib.suppress(KeyboardInterrupt):
            server.run(sockets=[sock])
    finally:
        sock.close()
    print("kvtier: router stopped", flush=True)
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    route = sub.add_parser(
        "route",
        help="route requests to several kvtier serve by the KV blocks each one caches",
        description="An OpenAI-compatible router that follows each instance's KV events "
        "(kvtier serve --kv-events) and sends every request to the instance caching the "
        "longest prefix of its tokens, the least loaded one when none does.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    route.add_argument(
        "--instance",
        action="append",
        metavar="URL=EVENTS",
        help="an instance's HTTP address and its --kv-events endpoint (repeat per instance)",
    )
    route.add_argument(
        "--model",
        metavar="PATH",
        help="the model the instances serve (a Hugging Face directory or .gguf file), for its "
        "tokenizer only (default: the bundled SmolLM2-135M-Instruct)",
    )
    route.add_argument("--host", default="127.0.0.1", help="address to listen on")
    route.add_argument(
        "--port",
        type=arg(port, "port"),
        default=8000,
        help="port to listen on; 0 picks a free one (default 8000)",
    )
    route.add_argument(
        "--balance-threshold",
        type=arg(non_negative_int, "request count"),
        default=4,
        metavar="N",
        help="skip an instance with more than N requests in flight above the least loaded "
        "one, however much it caches (default 4)",
    )
    route.add_argument(
        "--health-interval",
        type=arg(float_in("number of seconds", 0.0, 3600.0, open_low=True), "seconds"),
        default=2.0,
        metavar="SECONDS",
        help="how often a down instance's /health is asked, to route to it again (default 2)",
    )
    route.add_argument(
        "--admin-key",
        metavar="KEY",
        help="the instances' --admin-key (default: KVTIER_ADMIN_KEY): when an instance's KV "
        "event batches are lost, the router reads what it holds (GET /admin/cache/blocks) "
        "and drops what is gone from its index; without a key a loss is only counted",
    )
    route.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="warning",
        help="log level (default warning)",
    )
    route.set_defaults(func=run)
    return route
