"""``kvtier serve``'s access flags: API keys and tenants, the admin key, migration peers, TLS.

The flags become a :class:`~kvtier.server.auth.ServerAuth` (checked before
the model loads) and uvicorn's TLS settings; the startup banner says what is
open and what needs a key, and never shows a key.
"""

from __future__ import annotations

import argparse
import os
import ssl
from typing import Any

from kvtier.errors import ConfigError

AUTH_EPILOG = """\
access (API keys, tenants, admin, TLS):
  --api-key KEY            clients send 'Authorization: Bearer KEY' (OpenAI clients: api_key=KEY);
                           without any key the API is open, as vLLM's is
  --api-key KEY:TENANT     the key's requests belong to TENANT: tenants never share cached
                           prefixes (nor cached image encodings, nor workflows)
  --api-key-file FILE      one 'KEY' or 'KEY TENANT' a line ('#' comments); keeps keys out of ps
  KVTIER_API_KEY=KEY[:TENANT]   one more key from the environment
  requests may send "cache_salt": "..." (vLLM's field): prefixes are shared only among
  requests of the same tenant and salt
  --admin-key KEY (or KVTIER_ADMIN_KEY)   turns /admin/... on (off, 404, without it)
  --migrate-peer URL       a server /admin/migrate may move requests to (repeatable)
  --ssl-certfile CERT --ssl-keyfile KEY   serve https
"""


def add_auth_flags(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group(
        "access",
        "Who may call the server. Without an API key the API is open to anyone who can reach "
        "the port; /health is always open. Keys are compared in constant time and never "
        "logged.",
    )
    group.add_argument(
        "--api-key",
        action="append",
        metavar="KEY[:TENANT]",
        help="an API key clients must send as 'Authorization: Bearer KEY' (repeatable); "
        "KEY:TENANT makes the key's requests those of TENANT (letters, digits, '.', '_', '-'), "
        "whose cached prefixes no other tenant can hit. Keys on the command line show in ps: "
        "prefer --api-key-file or KVTIER_API_KEY",
    )
    group.add_argument(
        "--api-key-file",
        action="append",
        metavar="FILE",
        help="a file of API keys, one 'KEY' or 'KEY TENANT' a line; blank lines and '#' "
        "comments are skipped (repeatable)",
    )
    group.add_argument(
        "--admin-key",
        metavar="KEY",
        help="turn on the /admin/... endpoints (list and move requests) and require this key "
        "for them (default: KVTIER_ADMIN_KEY; without either they answer 404). Servers that "
        "move requests to each other share it",
    )
    group.add_argument(
        "--migrate-peer",
        action="append",
        metavar="URL",
        help="the base URL of a server /admin/migrate may move requests to, e.g. "
        "http://10.0.0.6:8000 (repeatable; any other target is refused with 403)",
    )
    group.add_argument(
        "--metrics-require-key",
        action="store_true",
        help="make /metrics need an API key or the admin key (default: open, for scrapers)",
    )
    group.add_argument(
        "--ssl-certfile",
        metavar="FILE",
        help="serve https with this PEM certificate (chain); with --ssl-keyfile",
    )
    group.add_argument(
        "--ssl-keyfile",
        metavar="FILE",
        help="the PEM private key of --ssl-certfile (default: read from the certificate file)",
    )


def server_auth(args: argparse.Namespace) -> tuple[Any, list[str]]:
    """The :class:`~kvtier.server.auth.ServerAuth` the flags and environment describe."""
    from kvtier.server.auth import build_auth

    return build_auth(
        args.api_key or (),
        args.api_key_file or (),
        admin_key=args.admin_key,
        metrics_require_key=args.metrics_require_key,
        migrate_peers=args.migrate_peer or (),
    )


def tls_settings(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's ``ssl_certfile``/``ssl_keyfile``, checked by loading them now (or ``{}``)."""
    cert, key = args.ssl_certfile, args.ssl_keyfile
    if cert is None:
        if key is not None:
            raise ConfigError("--ssl-keyfile needs --ssl-certfile")
        return {}
    cert = os.path.expanduser(cert)
    key = os.path.expanduser(key) if key is not None else None
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"cannot load the TLS certificate {cert}"
            + (f" with the key {key}" if key else "")
            + f": {exc}"
        ) from None
    out: dict[str, Any] = {"ssl_certfile": cert}
    if key is not None:
        out["ssl_keyfile"] = key
    return out


def access_lines(auth: Any, tls: dict[str, Any]) -> list[str]:
    """The banner's lines about access: keys (counted, never shown), admin, TLS."""
    lines = list(auth.describe())
    if tls:
        lines.append(f"TLS: on (certificate {tls['ssl_certfile']})")
    else:
        lines.append("TLS: off (plain http; --ssl-certfile and --ssl-keyfile turn it on)")
    return lines


__all__ = ["AUTH_EPILOG", "access_lines", "add_auth_flags", "server_auth", "tls_settings"]
