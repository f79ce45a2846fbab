"""kvtier's OpenAI-compatible HTTP server (``kvtier serve``).

:func:`create_app` turns an :class:`~kvtier.engine.EngineWorker` into a
FastAPI application with ``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``, ``/health``, ``/metrics`` (Prometheus) and ``/v1/cache/stats``.
Needs the ``serve`` extra (fastapi, uvicorn) and the engine's dependencies.
"""

from kvtier.server.app import create_app

__all__ = ["create_app"]
