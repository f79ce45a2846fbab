"""``kvtier serve``: an OpenAI-compatible server over the reference engine.

The flags (or ``--config FILE``, a TOML file of the same settings, which the
flags override) become an :class:`~kvtier.engine.config.EngineConfig` and
:class:`~kvtier.server.limits.ServerLimits`. Everything cheap is checked
before the model loads: the port, the model's files and geometry, the KV
cache's size against the context length and the chat template, the tiers'
sizes and whether their media answer. The engine runs on one thread; if
that thread dies, ``/health`` turns unhealthy and the process exits with
status 70 so a supervisor restarts it.

This module starts the server; the flags are in :mod:`kvtier.cli.serve_flags`,
what they configure in :mod:`kvtier.cli.serve_config`, and API keys, tenants
and TLS in :mod:`kvtier.cli.serve_auth`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket
import sys
import time
from typing import Any

from kvtier.cli.serve_auth import (
    AUTH_EPILOG,
    access_lines,
    server_auth,
    tls_settings,
)
from kvtier.cli.serve_config import (
    default_max_tokens_line,
    engine_config,
    image_limits,
    pd_role,
    server_limits,
    state_block_size,
)
from kvtier.cli.serve_flags import DEFAULT_MAX_TOKENS, EPILOG, add_flags
from kvtier.errors import ConfigError

log = logging.getLogger("kvtier.serve")

#: The exit status when the engine thread dies (EX_SOFTWARE): a supervisor should restart.
EXIT_ENGINE_FAILED = 70

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "EXIT_ENGINE_FAILED",
    "add_parser",
    "default_max_tokens_line",
    "engine_config",
    "image_limits",
    "preflight",
    "run",
    "server_limits",
]


# -- startup --------------------------------------------------------------------------------


def _bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket on ``host:port`` (port 0: any free port)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise ConfigError(f"--host {host!r} cannot be resolved: {exc}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc} "
            "(is another server using the port? pick another with --port)"
        ) from None
    sock.set_inheritable(True)
    return sock


def _client_url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else "[::1]" if host == "::" else host
    if ":" in shown and not shown.startswith("["):
        shown = f"[{shown}]"
    return f"http://{shown}:{port}"


def _check_device(name: str) -> None:
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError(
            f"--device {name!r} is not a torch device: use cpu, cuda, cuda:1, mps, ..."
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available on this machine")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"--device {name}: MPS is not available on this machine")


def preflight(config: Any) -> tuple[Any, list[str]]:
    """Check a configuration before any weights load; the tokenizer and warnings, or ConfigError.

    Reads the model's metadata, sizes the
    KV cache and the context, checks that the weights and the KV cache fit the
    device's free memory, loads the tokenizer to fit the chat template in the
    cache, and checks every tier's size and medium.
    """
    from kvtier.engine.config import check_memory
    from kvtier.engine.engine import check_config
    from kvtier.engine.model import load_tokenizer, probe_model, weight_size

    info = probe_model(config.model, model_id=config.model_id)
    layout = info.layout(config.cache.block_size, config.dtype)
    plan = config.plan(layout, info.max_positions)
    stored = plan.layout
    weights = weight_size(config.model, config.dtype, model_id=config.model_id)
    if weights is not None:
        check_memory(
            weights, plan.num_blocks * stored.bytes_per_block, config.device, info.model_id
        )
    print(
        f"kvtier: {info.model_id}: {plan.num_blocks} KV blocks of {stored.block_size} tokens "
        f"({plan.num_blocks * stored.bytes_per_block / 2**20:.0f} MiB, "
        f"{stored.dtype}{' with per-head scales' if stored.scaled else ''}), context "
        f"{plan.max_model_len} tokens",
        flush=True,
    )
    warnings: list[str] = []
    for spec in config.tiers:
        problem = spec.probe()
        if problem is not None:
            warnings.append(problem)
    tokenizer = load_tokenizer(config.model)
    if getattr(tokenizer, "chat_template", None) is None:
        warnings.append(f"{info.model_id} has no chat template: only /v1/completions will work")
    check_config(config, tokenizer)
    return tokenizer, warnings


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from kvtier.engine import DEFAULT_MODEL_ID, Engine, EngineWorker
        from kvtier.engine.gguf_meta import gguf_parsed_once
        from kvtier.model_files import is_gguf
        from kvtier.server import create_app
    except ImportError as exc:
        raise ConfigError(
            f"kvtier serve needs the torch and serve extras ({exc.name} is missing): "
            "pip install 'kvtier[torch,serve]'"
        ) from None
    config = engine_config(args)
    config.check_prefetch(bool(config.tiers))
    role = pd_role(args, config)
    limits = server_limits(args)
    images = image_limits(args)
    auth, auth_warnings = server_auth(args)
    limits.tenants.check_tenants(auth.tenants())
    tls = tls_settings(args)
    _check_device(args.device)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s"
    )
    for warning in auth_warnings:
        log.warning("%s", warning)
    sock = _bind(args.host, args.port)
    try:
        block_line = None
        # A GGUF file is parsed once for the checks and the load together.
        with gguf_parsed_once(is_gguf(config.model)):
            if args.block_size is None:
                config, block_line = state_block_size(config)
            tokenizer, warnings = preflight(config)
            if block_line is not None:
                print(f"kvtier: {block_line}", flush=True)
            for warning in warnings:
                log.warning("%s", warning)
            what = args.model or f"{DEFAULT_MODEL_ID} (the bundled default)"
            print(f"kvtier: loading {what} ({args.dtype}, {args.device}) ...", flush=True)
            started = time.perf_counter()
            engine = Engine.from_config(config, tokenizer=tokenizer)
        print(f"kvtier: loaded in {time.perf_counter() - started:.1f}s", flush=True)
        for line in engine.describe():
            print(f"kvtier: {line}", flush=True)
        name = args.served_model_name or engine.model_id
        server: Any = None
        failed: list[BaseException] = []

        def on_fatal(exc: BaseException) -> None:
            failed.append(exc)
            if server is not None:
                server.should_exit = True

        worker = EngineWorker(engine, on_fatal=on_fatal).start()
        try:
            app = create_app(
                worker,
                served_model_name=name,
                limits=limits,
                image_limits=images,
                auth=auth,
                role=role,
            )
            uv_config = uvicorn.Config(
                app, log_level=args.log_level, timeout_graceful_shutdown=5, **tls
            )
            server = uvicorn.Server(uv_config)
            if failed or worker.fatal is not None:  # it died before the server existed
                server.should_exit = True
            # Listen now, so a client told the address below is queued, never refused.
            sock.listen(uv_config.backlog)
            url = _client_url(args.host, sock.getsockname()[1])
            if tls:
                url = "https" + url.removeprefix("http")
            for line in access_lines(auth, tls):
                print(f"kvtier: {line}", flush=True)
            print(f"kvtier: {limits.tenants.describe()}", flush=True)
            print(f"kvtier: {default_max_tokens_line(limits, engine.max_model_len)}", flush=True)
            print(
                f"kvtier: serving {name} at {url}/v1 (OpenAI-compatible; "
                f"try: curl {url}/v1/models)",
                flush=True,
            )
            # uvicorn re-raises Ctrl-C once its graceful shutdown is done.
            with contextlib.suppress(KeyboardInterrupt):
                server.run(sockets=[sock])
        finally:
            worker.stop()
            engine.close()
        if failed or worker.fatal is not None:
            why = failed[0] if failed else worker.fatal
            print(
                f"kvtier: error: the engine thread died ({type(why).__name__}: {why}); "
                f"exiting with status {EXIT_ENGINE_FAILED} so a supervisor can restart the "
                "server",
                file=sys.stderr,
                flush=True,
            )
            return EXIT_ENGINE_FAILED
        print("kvtier: server stopped", flush=True)
    except KeyboardInterrupt:
        print("kvtier: interrupted", file=sys.stderr, flush=True)
        return 130
    finally:
        sock.close()
    return 0


# -- the subcommand ---------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    serve = sub.add_parser(
        "serve",
        help="serve a model behind an OpenAI-compatible HTTP API, KV cache managed by kvtier",
        description="Serve a causal language model behind an OpenAI-compatible API "
        "(chat completions, completions, streaming), generating through kvtier's KV-cache "
        "manager with prefix caching. Default model: SmolLM2-135M-Instruct, bundled offline.",
        epilog=EPILOG + "\n" + AUTH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(serve)
    serve.set_defaults(func=run)
    return serve
