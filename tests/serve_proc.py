"""A real ``kvtier serve`` process for fault tests: its output kept, its HTTP API at hand.

:class:`ServeProcess` starts ``kvtier serve --port 0 ...`` the way
:mod:`cli_launch` does, reads its stdout and stderr on background threads
(a pipe nobody drains would block the server once full; files would be cut
short under ``RLIMIT_FSIZE``), waits for the ``kvtier: serving`` line and
talks to it over loopback with the standard library only. Every process it
starts is stopped, however the test ends.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from cli_launch import kvtier_cli

START_TIMEOUT_S = 180.0


class ServeProcess:
    """``kvtier serve ARGS`` in a child process (see the module docstring)."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        preexec_fn: Callable[[], None] | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.args = ["serve", "--port", "0", *args]
        self.preexec_fn = preexec_fn
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.out: list[str] = []
        self.err: list[str] = []
        self.base = ""
        self._readers: list[threading.Thread] = []
        #: ``/health`` answers other than 200 seen while the server ran (-1: no answer).
        self.unhealthy: list[int] = []
        #: How many times ``/health`` was asked in the background.
        self.health_checks = 0
        self._stop_watching = threading.Event()
        self._watcher: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> ServeProcess:
        self.proc = subprocess.Popen(
            kvtier_cli(*self.args),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=self.preexec_fn,
        )
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            reader = threading.Thread(target=_drain, args=(stream, sink), daemon=True)
            reader.start()
            self._readers.append(reader)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            for line in list(self.out):
                if line.startswith("kvtier: serving"):
                    url = line.split(" at ", 1)[1].split(" ", 1)[0]
                    self.base = url.removesuffix("/v1")
                    self._watcher = threading.Thread(target=self._watch_health, daemon=True)
                    self._watcher.start()
                    return self
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the readers catch the last lines
                raise AssertionError(f"kvtier serve exited early:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"kvtier serve did not start:\n{self.output()}")
            time.sleep(0.05)

    def stop(self) -> int | None:
        """Stop the server (Ctrl-C, then SIGKILL after a while); its exit status."""
        self._stop_watching.set()
        if self._watcher is not None:
            self._watcher.join(30)
            self._watcher = None
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for reader in self._readers:
            reader.join(5)
        return proc.returncode

    def __enter__(self) -> ServeProcess:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- output ---------------------------------------------------------------------------
    def output(self) -> str:
        return "".join(self.out) + "".join(self.err)

    def lines(self, pattern: str) -> list[str]:
        """Lines the server wrote (stdout and stderr) that match the regular expression."""
        rx = re.compile(pattern)
        return [ln.rstrip("\n") for ln in [*self.out, *self.err] if rx.search(ln)]

    # -- HTTP -----------------------------------------------------------------------------
    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout: float = 120.0,
        key: str | None = None,
    ) -> tuple[int, Any]:
        """``(status, JSON body or text)`` of one request; error statuses are returned.

        ``key`` is sent as ``Authorization: Bearer KEY``.
        """
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def get(self, path: str) -> Any:
        status, body = self.request("GET", path)
        assert status == 200, (path, status, body)
        return body

    def health(self) -> int:
        return self.request("GET", "/health", timeout=30)[0]

    def _watch_health(self) -> None:
        """Ask ``/health`` every 0.2 s while the server runs; keep what is not 200."""
        while not self._stop_watching.wait(0.2):
            try:
                status = self.health()
            except OSError:
                status = -1
            self.health_checks += 1
            if status != 200:
                self.unhealthy.append(status)

    def stats(self) -> dict[str, Any]:
        body: dict[str, Any] = self.get("/v1/cache/stats")
        return body

    def tier(self, name: str) -> dict[str, float]:
        tiers: dict[str, dict[str, float]] = self.stats()["tiers"]
        return tiers[name]

    def metrics(self) -> str:
        status, body = self.request("GET", "/metrics")
        assert status == 200, body
        return str(body)

    def complete(self, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
        """A greedy ``/v1/completions`` of token ids; asserts it answered 200."""
        body = completion_body(prompt, max_tokens, **extra)
        status, body = self.request("POST", "/v1/completions", body)
        assert status == 200, (status, body)
        choice: dict[str, Any] = body["choices"][0]
        return choice

    def text(self, prompt: list[int], max_tokens: int) -> str:
        return str(self.complete(prompt, max_tokens)["text"])

    def open_stream(
        self, prompt: list[int], max_tokens: int, *, timeout: float = 120.0, **extra: Any
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """A streamed completion, its response headers read; the caller reads and closes it."""
        host, port = self.base.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
        body = completion_body(prompt, max_tokens, stream=True, **extra)
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        return conn, resp


def completion_body(prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def sse_events(resp: http.client.HTTPResponse) -> Any:
    """The JSON events of a server-sent event stream, until ``[DONE]``."""
    while True:
        line = resp.readline()
        if not line:
            return
        text = line.decode().strip()
        if not text.startswith("data: "):
            continue
        data = text.removeprefix("data: ")
        if data == "[DONE]":
            return
        yield json.loads(data)


def wait_for(
    what: str, check: Callable[[], bool], timeout_s: float = 60.0, interval_s: float = 0.1
) -> None:
    """Poll ``check`` until it is true; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(interval_s)


def _drain(stream: Any, sink: list[str]) -> None:
    for line in stream:
        sink.append(line)


__all__ = ["ServeProcess", "completion_body", "sse_events", "wait_for"]
