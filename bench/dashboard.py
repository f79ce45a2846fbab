"""The Grafana dashboard's panels, evaluated by a real Prometheus scraping a real ``kvtier serve``.

docs/grafana/kvtier.json is a Grafana dashboard of PromQL queries. This
script checks those queries where they will run, and draws what they show:

1. starts ``kvtier serve`` on the bundled SmolLM2-135M with a host tier, a
   small device pool (so blocks are evicted to the tier and loaded back),
   the pool's occupancy as the memory-pressure source and short engine steps
   (``--max-num-batched-tokens 128``: a scrape is answered between two steps,
   so a step longer than the scrape interval makes that scrape time out and
   leaves a gap), on a free loopback port; and (``--vlm``, on by default) a
   second one on a tiny random-weight LLaVA saved to a temporary directory,
   with a small encoder cache over a host tier, for the encoder-cache panels;
2. starts a ``prometheus`` process on loopback with a temporary config that
   scrapes the servers' ``/metrics`` every ``--scrape-interval`` (and a
   temporary storage directory), and waits until the targets are up;
3. drives ``--duration`` seconds of mixed traffic with the ``openai`` client:
   chats sharing a long system prompt (device prefix hits), several
   concurrent multi-turn streams, and long documents revisited after the
   pool has evicted them (host-tier loads), more clients than the server runs
   at once (a queue); and image chats to the LLaVA, popular images coming
   back (encoder-cache hits, tier hits) and rare ones encoded (misses);
4. evaluates every panel target through Prometheus's ``/api/v1/query_range``
   over the run, with Grafana's variables replaced: ``$__rate_interval`` by
   ``--rate-interval``, ``$__interval`` by the query step, ``$__range`` by the
   range, and ``$instance`` by the instances its variable query
   (``label_values(...)``) finds, formatted as Grafana formats a multi-value
   regex variable; the variable query itself is run too. Each target is
   ``ok`` (some finite point), ``empty`` (no series, or only NaN) or ``error``
   (Prometheus refused it);
5. renders the panels into one PNG, laid out by their ``gridPos``, with
   their titles, units, overrides and value mappings: it is drawn by
   matplotlib from Prometheus's answers, not a Grafana screenshot;
6. stops every process it started (also on Ctrl-C or an error).

The encoder-cache panels are for vision-language models: a text-only model
exposes none of their series, so with ``--no-vlm`` they are ``empty``. With
the LLaVA, every other panel sums the two servers (Grafana's "All"
instances): its many small requests weigh on the request rates and the
time-to-first-token quantiles.

Writes ``--out``/dashboard.json (per-panel results, traffic, scrape
health, versions) and the PNG to ``--image`` (``--out``/dashboard.png with
``--image ''``), and exits 1 when a query errors. Run ``python
bench/dashboard.py --help``; needs ``prometheus`` on PATH (Debian:
``apt-get install prometheus``) or ``--prometheus``.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _common import REPO, git_state, log, machine_info, package_version, write_json

DASHBOARD = REPO / "docs" / "grafana" / "kvtier.json"
_SERVING = re.compile(r"^kvtier: serving (?P<name>.+) at (?P<url>\S+)/v1\b")
_LABEL_VALUES = re.compile(
    r"^\s*label_values\(\s*(?:(?P<match>.+?)\s*,\s*)?(?P<label>\w+)\s*\)\s*$"
)
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")


# -- processes ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def stop_process(proc: subprocess.Popen[Any], name: str, grace_s: float = 30) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``: the process is gone when this returns."""
    if proc.poll() is not None:
        return
    log(f"stopping {name} (pid {proc.pid}) ...")
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        log(f"{name} did not stop in {grace_s:g} s: killing it")
        proc.kill()
        proc.wait()


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass
class Served:
    """A running ``kvtier serve``: its base URL, and its periodic step-cost log lines."""

    url: str
    name: str = ""
    steps: list[str] = field(default_factory=list)


@contextmanager
def kvtier_server(flags: list[str], log_path: Path, timeout_s: float) -> Iterator[Served]:
    """``kvtier serve FLAGS --port 0``; yields it once it serves."""
    command = [sys.executable, "-m", "kvtier.cli", "serve", *flags, "--port", "0"]
    log("starting: " + " ".join(command[1:]))
    out = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    # A session of its own: Ctrl-C reaches this script only, which then stops the
    # server itself, in order, instead of both racing to shut down.
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    assert proc.stdout is not None
    found: list[str] = []
    served = Served("")
    ready = threading.Event()

    def follow(stream: Any) -> None:
        for line in stream:
            out.write(line)
            out.flush()
            m = _SERVING.match(line)
            if m and not found:
                found.append(m.group("url"))
                served.name = m.group("name")
                ready.set()
            elif "engine: " in line and " steps of " in line:
                served.steps.append(line.split("engine: ", 1)[1].strip())
        ready.set()

    reader = threading.Thread(target=follow, args=(proc.stdout,), daemon=True)
    reader.start()
    try:
        if not ready.wait(timeout_s) or not found:
            raise RuntimeError(
                f"kvtier serve printed no 'kvtier: serving' line in {timeout_s:g} s:\n"
                + log_tail(log_path)
            )
        log(f"kvtier serve (pid {proc.pid}) serves at {found[0]}")
        served.url = found[0]
        yield served
    finally:
        stop_process(proc, "kvtier serve")
        reader.join(5)
        out.close()


class Prometheus:
    """A ``prometheus`` process on loopback scraping one target, and its HTTP API."""

    def __init__(self, base: str, proc: subprocess.Popen[bytes]) -> None:
        self.base = base
        self.proc = proc
        self.http = httpx.Client(base_url=base, timeout=30)

    def api(self, path: str, params: dict[str, Any] | list[tuple[str, Any]]) -> dict[str, Any]:
        """A ``/api/v1`` answer: Prometheus sends JSON for errors (HTTP 400/422) too."""
        r = self.http.get(f"/api/v1/{path}", params=params)
        try:
            body: dict[str, Any] = r.json()
        except ValueError:
            return {"status": "error", "errorType": f"http {r.status_code}", "error": r.text}
        return body

    def query_range(self, expr: str, start: float, end: float, step: float) -> dict[str, Any]:
        return self.api("query_range", {"query": expr, "start": start, "end": end, "step": step})

    def instant(self, expr: str, at: float) -> float | None:
        """The single value of an instant query at ``at`` (None when it has none)."""
        body = self.api("query", {"query": expr, "time": at})
        result = body.get("data", {}).get("result", []) if body.get("status") == "success" else []
        return float(result[0]["value"][1]) if result else None

    def counters(self, at: float) -> dict[str, float]:
        """Every ``kvtier_*_total`` series at ``at``, keyed by name and labels (instance too)."""
        body = self.api("query", {"query": '{__name__=~"kvtier_.+_total"}', "time": at})
        out: dict[str, float] = {}
        for s in body.get("data", {}).get("result", []) if body.get("status") == "success" else []:
            labels = {k: v for k, v in s["metric"].items() if k not in ("__name__", "job")}
            inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            out[s["metric"]["__name__"] + (f"{{{inner}}}" if inner else "")] = float(s["value"][1])
        return dict(sorted(out.items()))

    def scrape_health(self, start: float, end: float) -> dict[str, float | None]:
        """Scrapes tried and failed over ``[start, end]``, and the slowest one's seconds."""
        window = f"{max(1, math.ceil(end - start))}s"
        return {
            "scrapes": self.instant(f"sum(count_over_time(up[{window}]))", end),
            "failed": self.instant(f"sum(count_over_time((up == 0)[{window}:]))", end),
            "slowest_s": self.instant(
                f"max(max_over_time(scrape_duration_seconds[{window}]))", end
            ),
        }

    def label_values(self, label: str, match: str | None, start: float, end: float) -> list[str]:
        params: list[tuple[str, Any]] = [("start", start), ("end", end)]
        if match:
            params.append(("match[]", match))
        body = self.api(f"label/{label}/values", params)
        if body.get("status") != "success":
            raise RuntimeError(f"label_values({match}, {label}): {body.get('error')}")
        return list(body["data"])

    def version(self) -> str:
        body = self.api("status/buildinfo", {})
        return str(body.get("data", {}).get("version", "unknown"))

    def wait_for_targets(self, expected: int, timeout_s: float) -> None:
        """Until the ``expected`` scrape targets are up (each scraped once)."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with status {self.proc.returncode}")
            try:
                body = self.api("targets", {"state": "active"})
                targets = body.get("data", {}).get("activeTargets", [])
                if len(targets) == expected and all(t.get("health") == "up" for t in targets):
                    return
                if targets:
                    last = f"{targets[0].get('health')}: {targets[0].get('lastError') or ''}"
            except httpx.HTTPError as exc:
                last = str(exc)
            time.sleep(0.2)
        raise RuntimeError(f"the Prometheus targets were not up in {timeout_s:g} s ({last})")


def prometheus_config(targets: list[str], scrape_interval: str) -> str:
    # YAML is a superset of JSON: no YAML library needed to write the config.
    return json.dumps(
        {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
            "scrape_configs": [
                {
                    "job_name": "kvtier",
                    "scrape_interval": scrape_interval,
                    "scrape_timeout": scrape_interval,
                    "metrics_path": "/metrics",
                    "static_configs": [{"targets": targets}],
                }
            ],
        },
        indent=2,
    )


@contextmanager
def prometheus(
    binary: str, targets: list[str], scrape_interval: str, workdir: Path, timeout_s: float = 60
) -> Iterator[Prometheus]:
    """A ``prometheus`` scraping ``targets`` (host:port) on a free loopback port."""
    config = workdir / "prometheus.yml"
    config.write_text(prometheus_config(targets, scrape_interval))
    log_path = workdir / "prometheus.log"
    port = free_port()
    command = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={workdir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=1d",
        "--log.level=warn",
    ]
    log("starting: " + " ".join(command))
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    prom = Prometheus(f"http://127.0.0.1:{port}", proc)
    try:
        try:
            prom.wait_for_targets(len(targets), timeout_s)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{log_tail(log_path)}") from None
        log(f"prometheus (pid {proc.pid}) at {prom.base} scrapes {', '.join(targets)}: up")
        yield prom
    finally:
        prom.http.close()
        stop_process(proc, "prometheus")


# -- traffic -----------------------------------------------------------------------------------
def _docs_text() -> str:
    parts = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return "\n\n".join(p.read_text(encoding="utf-8") for p in parts if p.is_file())


@dataclass
class Traffic:
    """What the clients sent and got, per kind of request."""

    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, outcome: str) -> None:
        with self.lock:
            row = self.counts.setdefault(kind, {})
            row[outcome] = row.get(outcome, 0) + 1

    def summary(self) -> dict[str, dict[str, int]]:
        with self.lock:
            return {k: dict(v) for k, v in self.counts.items()}


def drive(
    base: str, duration_s: float, streams: int, stop: threading.Event, vlm_base: str | None = None
) -> Traffic:
    """``duration_s`` of mixed chat traffic against ``base`` (and images against ``vlm_base``)."""
    import openai

    # Typed loosely: the messages are plain dicts, not the SDK's TypedDicts.
    client: Any = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    text = _docs_text()
    system = (
        "You are a careful assistant for the kvtier project. Use this excerpt of its "
        "documentation:\n" + text[:1600]
    )
    # Long documents, revisited in turn: more of them than the device pool holds,
    # so a revisit finds its blocks on the host tier rather than the device.
    documents = [text[2000 + i * 4200 : 2000 + i * 4200 + 3800] for i in range(5)]
    traffic = Traffic()
    deadline = time.monotonic() + duration_s

    def call(kind: str, fn: Callable[..., str], *args: Any) -> str:
        try:
            reply = fn(*args)
        except openai.APIStatusError as exc:
            traffic.add(kind, f"http {exc.status_code}")
            stop.wait(0.5)
            return ""
        except openai.APIError as exc:
            traffic.add(kind, type(exc).__name__)
            stop.wait(0.5)
            return ""
        traffic.add(kind, "ok")
        return reply

    def chat(messages: list[dict[str, str]], max_tokens: int) -> str:
        r = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
        )
        return r.choices[0].message.content or ""

    def stream(messages: list[dict[str, str]], max_tokens: int) -> str:
        parts = []
        for chunk in client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0.7,
            stream=True,
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        return "".join(parts)

    def shared_prefix() -> None:
        i = 0
        while not stop.is_set() and time.monotonic() < deadline:
            i += 1
            question = f"Question {i}: in one sentence, what does section {i % 17} say?"
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ]
            call("shared-prefix chat", chat, messages, 12)

    def conversation(k: int) -> None:
        messages = [{"role": "system", "content": f"You are assistant number {k}. Be brief."}]
        turn = 0
        while not stop.is_set() and time.monotonic() < deadline:
            turn += 1
            messages.append(
                {"role": "user", "content": f"Turn {turn}: tell me one more fact about caches."}
            )
            reply = call("multi-turn stream", stream, messages, 40)
            messages.append({"role": "assistant", "content": reply or "(no reply)"})
            if len(messages) > 15:  # a new conversation, before the context fills up
                messages = messages[:1]

    def long_documents() -> None:
        i = 0
        while not stop.is_set() and time.monotonic() < deadline:
            doc = documents[i % len(documents)]
            i += 1
            messages = [{"role": "user", "content": doc + "\n\nSummarize the text above."}]
            call("long prompt", chat, messages, 4)

    workers = [threading.Thread(target=shared_prefix, daemon=True)]
    workers += [
        threading.Thread(target=conversation, args=(k,), daemon=True) for k in range(streams)
    ]
    workers.append(threading.Thread(target=long_documents, daemon=True))
    if vlm_base is not None:
        vlm: Any = openai.OpenAI(base_url=f"{vlm_base}/v1", api_key="x", max_retries=0, timeout=300)
        vlm_model = vlm.models.list().data[0].id
        pngs = [random_png(seed) for seed in range(24)]
        popularity = [1 / (i + 1) for i in range(len(pngs))]

        def image_chat(url: str, n: int) -> str:
            # Words of their own before the image: the KV prefix cache cannot cover
            # the image's tokens, so every request looks its encoder output up.
            intro = {"type": "text", "text": f"Picture {n}:"}
            part = {"type": "image_url", "image_url": {"url": url}}
            question = {"type": "text", "text": "What is in it?"}
            r = vlm.chat.completions.create(
                model=vlm_model,
                messages=[{"role": "user", "content": [intro, part, question]}],
                max_tokens=2,
                temperature=0,
            )
            return str(r.choices[0].message.content or "")

        def images(k: int) -> None:
            # Popular images come back (memory hits, tier hits once evicted), rare
            # ones are encoded (misses); two clients sometimes send the same one at
            # once (coalesced). Paced, so the text server's requests stay the many.
            rng = random.Random(k)
            n = 0
            while not stop.is_set() and time.monotonic() < deadline:
                n += 1
                url = pngs[rng.choices(range(len(pngs)), popularity)[0]]
                call("image chat (tiny VLM)", image_chat, url, 1000 * k + n)
                stop.wait(2.5)

        workers += [threading.Thread(target=images, args=(k,), daemon=True) for k in range(2)]
    for w in workers:
        w.start()
    started = time.monotonic()
    while any(w.is_alive() for w in workers):
        for w in workers:
            w.join(10)
            if not w.is_alive():
                continue
            elapsed = time.monotonic() - started
            log(f"traffic: {elapsed:4.0f} s of {duration_s:g}: {traffic.summary()}")
            break
    return traffic


def random_png(seed: int, size: int = 48) -> str:
    """A data URL of a PNG of seeded random pixels."""
    import io

    from PIL import Image

    rng = random.Random(seed)
    img = Image.frombytes("RGB", (size, size), rng.randbytes(size * size * 3))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tiny_vlm(path: Path, seed: int = 0) -> None:
    """A LLaVA of random weights (a 2-layer CLIP tower of 32 px, 8 px patches; a 2-layer
    Llama over a character vocabulary) saved for ``kvtier serve --model``.

    Its answers are noise: it is there to give the encoder-cache panels an encoder.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        PreTrainedTokenizerFast,
    )
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    specials = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"]
    chars = ["\n", "\t", *(chr(c) for c in range(32, 127))]
    core = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(specials + chars)}, merges=[], unk_token="<unk>"
        )
    )
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<image>"],
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = _CHATML
    image_token = tok.convert_tokens_to_ids("<image>")
    assert isinstance(image_token, int)
    text = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        projection_dim=32,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(config).save_pretrained(path)
    tok.save_pretrained(path)
    LlavaImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    ).save_pretrained(path)


# -- queries -----------------------------------------------------------------------------------
def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows' nested (collapsed) panels included, in the dashboard's order."""
    found: list[dict[str, Any]] = []

    def walk(ps: list[dict[str, Any]]) -> None:
        for p in ps:
            found.append(p)
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    return found


def regex_escape(value: str) -> str:
    """As Grafana escapes a regex variable's values for Prometheus (inside a string literal)."""
    return re.sub(r"([\\^$*+?.()|{}\[\]/])", r"\\\\\1", value)


def multi_value(values: list[str]) -> str:
    """A multi-value variable in a regex matcher, as Grafana writes it: ``(a|b)``."""
    escaped = [regex_escape(v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def substitute(expr: str, values: dict[str, str]) -> str:
    """``expr`` with ``$name``, ``${name}`` and ``[[name]]`` replaced; unknown names raise."""

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in values:
            raise KeyError(f"no value for the Grafana variable ${name}")
        return values[name]

    return _VARIABLE.sub(repl, expr)


def seconds(duration: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration)
    if not m:
        raise argparse.ArgumentTypeError(f"{duration!r}: a duration such as 500ms, 15s, 1m")
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def duration_arg(text: str) -> str:
    seconds(text)
    return text


def _finite(series: dict[str, Any]) -> bool:
    return any(math.isfinite(float(v)) for _, v in series.get("values", []))


def evaluate(
    prom: Prometheus,
    dashboard: dict[str, Any],
    start: float,
    end: float,
    step: float,
    rate_interval: str,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The variables' values, and every panel target's result over ``[start, end]``."""
    values = {
        "__rate_interval": rate_interval,
        "__interval": f"{step:g}s",
        "__range": f"{max(1, round(end - start))}s",
    }
    variables: dict[str, Any] = {}
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        definition = var.get("definition") or var.get("query", {}).get("query", "")
        m = _LABEL_VALUES.match(definition)
        row: dict[str, Any] = {"definition": definition}
        if not m:
            row.update(status="error", error="only label_values(...) variables are handled")
        else:
            try:
                found = prom.label_values(m.group("label"), m.group("match"), start, end)
            except RuntimeError as exc:
                row.update(status="error", error=str(exc))
            else:
                row.update(status="ok" if found else "empty", values=found)
                # Grafana's "All" (includeAll) picks every value; a custom allValue
                # would match more than the instances found, so list them instead.
                values[var["name"]] = multi_value(found) if found else var.get("allValue", ".*")
        variables[var["name"]] = row
    results: list[dict[str, Any]] = []
    for p in panels(dashboard):
        if p.get("type") == "row":
            continue
        targets = []
        for t in p.get("targets", []):
            row = {"refId": t.get("refId"), "expr": t["expr"], "legend": t.get("legendFormat")}
            try:
                query = substitute(t["expr"], values)
            except KeyError as exc:
                row.update(status="error", error=str(exc.args[0]), series=[])
                targets.append(row)
                continue
            body = prom.query_range(query, start, end, step)
            row["query"] = query
            if body.get("status") != "success":
                row.update(status="error", error=f"{body.get('errorType')}: {body.get('error')}")
                row["series"] = []
            else:
                series = body["data"]["result"]
                row["series"] = series
                row["status"] = "ok" if any(_finite(s) for s in series) else "empty"
                if body.get("warnings"):
                    row["warnings"] = body["warnings"]
            targets.append(row)
        statuses = {t["status"] for t in targets}
        status = "error" if "error" in statuses else "ok" if "ok" in statuses else "empty"
        results.append(
            {"id": p.get("id"), "title": p.get("title"), "status": status, "targets": targets}
        )
    return variables, results


def _last_values(target: dict[str, Any]) -> dict[str, float | None]:
    """Each series' last finite value, by its legend name (Grafana's "Last *")."""
    out: dict[str, float | None] = {}
    for s in target["series"]:
        finite = [float(v) for _, v in s["values"] if math.isfinite(float(v))]
        name = legend_name(target.get("legend"), s["metric"], target["expr"])
        out[name] = finite[-1] if finite else None
    return out


# -- rendering ---------------------------------------------------------------------------------
_PALETTE = ["#5794F2", "#73BF69", "#FF9830", "#F2495C", "#B877D9", "#FADE2A", "#8AB8FF", "#37872D"]
_NAMED = {
    "green": "#73BF69",
    "blue": "#5794F2",
    "yellow": "#FADE2A",
    "orange": "#FF9830",
    "red": "#F2495C",
    "purple": "#B877D9",
}
_PX_PER_ROW = 32
_PX_PER_COL = 75


def _si(v: float, suffix: str = "") -> str:
    for factor, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= factor:
            return f"{v / factor:.3g}{prefix}{suffix}"
    return f"{v:.3g}{suffix}"


def unit_formatter(unit: str | None) -> Callable[[float, Any], str]:
    """Axis tick labels for a Grafana unit (the common ones; others plain)."""

    def fmt(v: float, _pos: Any = None) -> str:
        if unit == "percentunit":
            return f"{v * 100:.0f}%"
        if unit == "percent":
            return f"{v:.0f}%"
        if unit in ("s", "ms"):
            secs = v if unit == "s" else v / 1000
            return f"{secs * 1000:.0f} ms" if abs(secs) < 1 else f"{secs:.3g} s"
        if unit in ("bytes", "decbytes"):
            base = 1024 if unit == "bytes" else 1000
            names = ["B", "KiB", "MiB", "GiB", "TiB"] if base == 1024 else ["B", "kB", "MB", "GB"]
            i = 0
            while abs(v) >= base and i < len(names) - 1:
                v, i = v / base, i + 1
            return f"{v:.3g} {names[i]}"
        if unit == "reqps":
            return _si(v, " req/s")
        if unit == "ops":
            return _si(v, " ops/s")
        return _si(v)

    return fmt


def legend_name(fmt: str | None, labels: dict[str, str], expr: str) -> str:
    if not fmt or fmt == "__auto":
        inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
        return "{" + inner + "}" if inner else expr[:40]
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


def _overrides(panel: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per refId: the override properties (``byFrameRefID`` matchers) of a panel."""
    out: dict[str, dict[str, Any]] = {}
    for o in panel.get("fieldConfig", {}).get("overrides", []):
        matcher = o.get("matcher", {})
        if matcher.get("id") == "byFrameRefID":
            props = {p["id"]: p.get("value") for p in o.get("properties", [])}
            out.setdefault(str(matcher.get("options")), {}).update(props)
    return out


def render(
    dashboard: dict[str, Any],
    results: list[dict[str, Any]],
    span: tuple[float, float, float],
    step: float,
    path: Path,
    subtitle: str,
) -> None:
    """The panels, laid out by gridPos, drawn from the query results, into ``path``.

    ``span`` is (start, end, origin) in Unix seconds: the x axes run from start
    to end, labelled in seconds since origin (when the traffic began).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle
    from matplotlib.ticker import FuncFormatter

    start, end, origin = span
    by_id = {r["id"]: r for r in results}
    all_panels = panels(dashboard)
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in all_panels)
    header = 155
    width_px = 24 * _PX_PER_COL
    height_px = header + rows * _PX_PER_ROW + 20
    dpi = 100
    fig = plt.figure(figsize=(width_px / dpi, height_px / dpi), dpi=dpi, facecolor="white")

    def frac(x_px: float, y_px: float) -> tuple[float, float]:
        """Pixels from the top-left corner to figure fractions from the bottom-left."""
        return x_px / width_px, 1 - y_px / height_px

    fig.text(
        *frac(20, 30),
        "kvtier dashboard panels, rendered from Prometheus",
        fontsize=22,
        weight="bold",
        va="center",
    )
    fig.text(*frac(20, 102), subtitle, fontsize=11, va="center", color="#444444", linespacing=1.5)

    for p in all_panels:
        g = p["gridPos"]
        x0, y0 = g["x"] * _PX_PER_COL, header + g["y"] * _PX_PER_ROW
        w, h = g["w"] * _PX_PER_COL, g["h"] * _PX_PER_ROW
        if p.get("type") == "row":
            fig.text(
                *frac(x0 + 12, y0 + h / 2 + 4),
                p.get("title", ""),
                fontsize=14,
                weight="bold",
                va="center",
            )
            continue
        left, bottom = frac(x0 + 6, y0 + h - 6)
        fig.patches.append(
            Rectangle(
                (left, bottom),
                (w - 12) / width_px,
                (h - 12) / height_px,
                transform=fig.transFigure,
                fill=False,
                edgecolor="#c8c8c8",
                lw=1,
            )
        )
        fig.text(
            *frac(x0 + 16, y0 + 22), p.get("title", ""), fontsize=12, weight="bold", va="center"
        )
        result = by_id.get(p.get("id"))
        defaults = p.get("fieldConfig", {}).get("defaults", {})
        unit = defaults.get("unit")
        overrides = _overrides(p)
        twin_unit = next(
            (o["unit"] for o in overrides.values() if o.get("unit") not in (None, unit)), None
        )
        # Room on the left for the tick labels: a state timeline's are series names.
        margin = 130 if p.get("type") == "state-timeline" else 80
        ax_left, ax_bottom = frac(x0 + margin, y0 + h - 78)
        ax_w = (w - margin - (90 if twin_unit else 30)) / width_px
        ax_h = (h - 78 - 42) / height_px
        ax = fig.add_axes((ax_left, ax_bottom, ax_w, ax_h))
        ax.tick_params(labelsize=9)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.grid(True, color="#eeeeee")
        if result is None or result["status"] == "error":
            _no_data(ax, "query error" if result else "not evaluated", "#F2495C")
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        if p.get("type") == "state-timeline":
            _state_timeline(ax, p, result, origin, step, Patch)
        else:
            twin = ax.twinx() if twin_unit else None
            n = 0
            handles = []
            for t in result["targets"]:
                target_unit = overrides.get(str(t["refId"]), {}).get("unit", unit)
                on = twin if twin is not None and target_unit == twin_unit else ax
                for s in t["series"]:
                    xs, ys = _with_gaps(s["values"], origin, step)
                    name = legend_name(t.get("legend"), s["metric"], t["expr"])
                    if on is twin:
                        name += " (right axis)"
                    (line,) = on.plot(xs, ys, color=_PALETTE[n % len(_PALETTE)], lw=1.4, label=name)
                    handles.append(line)
                    n += 1
            ax.yaxis.set_major_formatter(FuncFormatter(unit_formatter(unit)))
            _limits(ax, defaults)
            if twin is not None:
                twin.yaxis.set_major_formatter(FuncFormatter(unit_formatter(twin_unit)))
                twin.tick_params(labelsize=9)
                twin.spines["top"].set_visible(False)
                twin.set_ylim(bottom=0)
            if handles:
                ax.legend(
                    handles=handles,
                    loc="upper left",
                    bbox_to_anchor=(0, -0.17),
                    ncol=min(len(handles), 4),
                    fontsize=8,
                    frameon=False,
                    handlelength=1.5,
                    columnspacing=1.2,
                )
            else:
                _no_data(ax)
        ax.set_xlim(start - origin, end - origin)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:.0f} s"))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def _no_data(ax: Any, text: str = "No data", color: str = "#888888") -> None:
    ax.text(
        0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=14, color=color
    )


def _with_gaps(
    values: list[list[Any]], origin: float, step: float
) -> tuple[list[float], list[float]]:
    """A series' points, with a NaN wherever points are missing (a failed scrape), as a gap."""
    xs: list[float] = []
    ys: list[float] = []
    for ts, v in values:
        x = float(ts) - origin
        if xs and x - xs[-1] > 1.5 * step:
            xs.append(xs[-1] + step)
            ys.append(math.nan)
        xs.append(x)
        ys.append(float(v))
    return xs, ys


def _limits(ax: Any, defaults: dict[str, Any]) -> None:
    lo, hi = defaults.get("min"), defaults.get("max")
    if lo is not None:
        ax.set_ylim(bottom=lo)
    if hi is not None:
        ax.set_ylim(top=hi * 1.02)


def _state_timeline(
    ax: Any, panel: dict[str, Any], result: dict[str, Any], origin: float, step: float, patch: Any
) -> None:
    """Runs of equal values as coloured bars, one lane per series, named by the mappings."""
    mapping: dict[str, dict[str, Any]] = {}
    for m in panel.get("fieldConfig", {}).get("defaults", {}).get("mappings", []):
        if m.get("type") == "value":
            mapping.update({str(k): v for k, v in m.get("options", {}).items()})
    lanes: list[tuple[str, list[tuple[float, float]]]] = []
    for t in result["targets"]:
        for s in t["series"]:
            points = [(float(ts) - origin, float(v)) for ts, v in s["values"]]
            lanes.append((legend_name(t.get("legend"), s["metric"], t["expr"]), points))
    if not lanes:
        _no_data(ax)
        return
    seen: dict[str, str] = {}
    for lane, (_, points) in enumerate(lanes):
        width = points[-1][0] - points[0][0] + step
        run_start, run_value = points[0]
        for i in range(1, len(points) + 1):
            # A run ends where the value changes or points are missing (a gap).
            if (
                i < len(points)
                and points[i][1] == run_value
                and points[i][0] - points[i - 1][0] <= 1.5 * step
            ):
                continue
            end = points[i - 1][0] + step
            key = f"{run_value:g}"
            info = mapping.get(key, {})
            color = _NAMED.get(str(info.get("color")), info.get("color") or "#888888")
            text = str(info.get("text", key))
            seen[text] = color
            ax.broken_barh([(run_start, end - run_start)], (lane + 0.05, 0.9), color=color)
            if end - run_start > 0.08 * width:
                ax.text(run_start + 1, lane + 0.5, text, va="center", fontsize=8)
            if i < len(points):
                run_start, run_value = points[i]
    ax.set_yticks([i + 0.5 for i in range(len(lanes))], [name for name, _ in lanes], fontsize=8)
    ax.set_ylim(0, len(lanes))
    ax.grid(False)
    ax.legend(
        handles=[patch(color=c, label=t) for t, c in seen.items()],
        loc="upper left",
        bbox_to_anchor=(0, -0.17),
        ncol=len(seen),
        fontsize=8,
        frameon=False,
    )


# -- main --------------------------------------------------------------------------------------
def _raise_interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--duration", type=float, default=90, help="seconds of traffic (default 90)")
    ap.add_argument(
        "--streams", type=int, default=4, help="concurrent multi-turn streaming clients (default 4)"
    )
    ap.add_argument("--model", default=None, help="--model of kvtier serve (default: SmolLM2)")
    ap.add_argument(
        "--num-blocks",
        type=int,
        default=160,
        help="device KV blocks (default 160: small, so blocks move to the tier)",
    )
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=128,
        help="--max-num-batched-tokens of kvtier serve (default 128: a scrape waits for the "
        "engine step under way, and shorter steps keep it within the scrape interval on a CPU)",
    )
    ap.add_argument(
        "--tier", default="host:256MiB", help="--tier of kvtier serve (default host:256MiB)"
    )
    ap.add_argument(
        "--serve-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="one more kvtier serve argument (repeatable), e.g. --serve-flag=--policy=arc",
    )
    ap.add_argument(
        "--vlm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also serve a tiny random-weight LLaVA (a second kvtier serve, scraped too) and "
        "send it image chats, so the encoder-cache panels have data; the other panels then "
        "sum both servers, as Grafana's 'All' instances does (default on)",
    )
    ap.add_argument("--prometheus", default="prometheus", help="the prometheus binary")
    ap.add_argument(
        "--scrape-interval",
        type=duration_arg,
        default="1s",
        help="Prometheus scrape interval (default 1s)",
    )
    ap.add_argument("--step", type=float, default=2, help="query_range step, seconds (default 2)")
    ap.add_argument(
        "--rate-interval",
        type=duration_arg,
        default="15s",
        help="what $__rate_interval stands for (default 15s)",
    )
    ap.add_argument("--dashboard", type=Path, default=DASHBOARD, help="the dashboard JSON")
    ap.add_argument(
        "--out",
        type=Path,
        default=REPO / "bench" / "results" / "dashboard",
        help="directory for dashboard.json, and the logs of a failed run "
        "(default bench/results/dashboard)",
    )
    ap.add_argument(
        "--image",
        default=str(REPO / "docs" / "img" / "dashboard.png"),
        help="the PNG (default docs/img/dashboard.png; '': OUT/dashboard.png)",
    )
    ap.add_argument(
        "--startup-timeout",
        type=float,
        default=600,
        help="seconds kvtier serve may take to start (default 600)",
    )
    args = ap.parse_args(argv)
    if args.duration <= 0 or args.streams < 0 or args.step <= 0:
        ap.error("--duration and --step must be positive, --streams not negative")
    binary = shutil.which(args.prometheus)
    if binary is None:
        ap.error(
            f"no {args.prometheus!r} binary: install Prometheus (Debian: apt-get install "
            "prometheus) or pass --prometheus PATH"
        )
    dashboard = json.loads(args.dashboard.read_text())
    signal.signal(signal.SIGTERM, _raise_interrupt)

    flags = ["--tier", args.tier, "--num-blocks", str(args.num_blocks), "--pressure", "pool"]
    flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.model:
        flags += ["--model", args.model]
    flags += args.serve_flag
    stop = threading.Event()
    failed = False
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-dashboard-")))

        def keep_logs() -> None:
            """On a failure, the processes' logs, once both have stopped, outlive the temp dir."""
            if not failed:
                return
            args.out.mkdir(parents=True, exist_ok=True)
            for name in ("server.log", "vlm-server.log", "prometheus.log"):
                if (work / name).is_file():
                    shutil.copy(work / name, args.out / name)
            log(f"failed or interrupted; the processes' logs are in {args.out}")

        stack.callback(keep_logs)
        try:
            server = stack.enter_context(
                kvtier_server(flags, work / "server.log", args.startup_timeout)
            )
            servers = [server]
            targets = [server.url.split("://", 1)[1]]
            vlm_url = None
            if args.vlm:
                log("saving a tiny random-weight LLaVA ...")
                save_tiny_vlm(work / "tiny-vlm")
                vlm_flags = [
                    "--model", str(work / "tiny-vlm"), "--served-model-name", "tiny-llava-random",
                    "--num-blocks", "64", "--pressure", "pool",
                    # Room for a few encoder outputs only, and a tier below: evictions,
                    # then tier hits.
                    "--encoder-cache-size", "24KiB", "--encoder-cache-tier", "host:1MiB",
                ]  # fmt: skip
                vlm = stack.enter_context(
                    kvtier_server(vlm_flags, work / "vlm-server.log", args.startup_timeout)
                )
                vlm_url = vlm.url
                servers.append(vlm)
                targets.append(vlm_url.split("://", 1)[1])
            prom = stack.enter_context(prometheus(binary, targets, args.scrape_interval, work))
            version = prom.version()
            start = time.time()
            log(
                f"traffic: {args.duration:g} s, 1 shared-prefix client, {args.streams} streams, "
                "1 long-prompt client" + (", 2 image clients (tiny LLaVA)" if args.vlm else "")
            )
            traffic_start = time.time()
            traffic = drive(server.url, args.duration, args.streams, stop, vlm_url)
            traffic_end = time.time()
            # Two more scrapes, so the last requests' counts are in.
            time.sleep(2 * seconds(args.scrape_interval) + 0.5)
            end = time.time()
            log("evaluating the panels' queries ...")
            variables, results = evaluate(
                prom, dashboard, start, end, args.step, args.rate_interval
            )
            scrapes = prom.scrape_health(start, end)
            counters = prom.counters(end)
        except BaseException:
            stop.set()
            failed = True
            raise

    png = Path(args.image) if args.image else args.out / "dashboard.png"
    model = args.model or "SmolLM2-135M-Instruct"
    lines = [
        f"The PromQL of docs/grafana/kvtier.json, evaluated by Prometheus {version} scraping every "
        f"{args.scrape_interval}: kvtier serve on {model} ({args.num_blocks} device blocks, tier "
        f"{args.tier}),",
        f"{args.duration:g} s of mixed chat traffic; $__rate_interval = {args.rate_interval}, "
        f"step {args.step:g} s; x axes: seconds since the traffic began.",
    ]
    if args.vlm:
        lines.append(
            "A second kvtier serve on a tiny random-weight LLaVA (image chats) feeds the "
            "encoder-cache panels; the other panels sum both servers, as Grafana's 'All' "
            "instances does."
        )
    lines.append(
        f"{scrapes['failed'] or 0:.0f} of {scrapes['scrapes'] or 0:.0f} scrapes timed out "
        "(a scrape waits for the engine step under way): the gaps, and the dips of sums. "
        "Drawn with matplotlib from Prometheus's answers: not a Grafana screenshot."
    )
    subtitle = "\n".join(lines)
    render(dashboard, results, (start, end, traffic_start), args.step, png, subtitle)

    counts = {s: sum(r["status"] == s for r in results) for s in ("ok", "empty", "error")}
    print(f"{'panel':<48} {'status':<7} targets (ok/empty/error)")
    for r in results:
        per = [t["status"] for t in r["targets"]]
        print(
            f"{r['title']:<48} {r['status']:<7} "
            f"{per.count('ok')}/{per.count('empty')}/{per.count('error')}"
        )
        for t in r["targets"]:
            if t["status"] != "ok":
                print(f"    {t['refId']} {t['status']}: {t.get('error') or t['expr']}")
    for name, var in variables.items():
        print(f"variable ${name}: {var['status']} {var.get('values') or var.get('error')}")
    print(f"panels: {counts['ok']} ok, {counts['empty']} empty, {counts['error']} error")
    print(f"traffic: {json.dumps(traffic.summary())}")
    print(
        f"scrapes: {scrapes['scrapes']} tried, {scrapes['failed']} failed (a scrape fails when "
        f"/metrics takes over {args.scrape_interval}), slowest {scrapes['slowest_s']} s"
    )

    summary = {
        "benchmark": "dashboard",
        "dashboard": str(
            args.dashboard.relative_to(REPO)
            if args.dashboard.is_relative_to(REPO)
            else args.dashboard
        ),
        "prometheus_version": version,
        "kvtier_version": package_version("kvtier"),
        "serve_flags": flags,
        "instances": {s.url.split("://", 1)[1]: s.name for s in servers},
        "vlm": args.vlm,
        "duration_s": args.duration,
        "streams": args.streams,
        "scrape_interval": args.scrape_interval,
        "rate_interval": args.rate_interval,
        "step_s": args.step,
        "range": {
            "start": start,
            "end": end,
            "traffic_start": traffic_start,
            "traffic_end": traffic_end,
        },
        "traffic": traffic.summary(),
        "scrapes": scrapes,
        "counters_at_end": counters,
        # What the server's engine steps cost meanwhile (it logs them every 10 s of work):
        # a scrape waits for the step under way, so long steps make failed scrapes.
        "server_step_log": {s.name: s.steps for s in servers},
        "variables": variables,
        "counts": counts,
        "panels": [
            {
                "id": r["id"],
                "title": r["title"],
                "status": r["status"],
                "targets": [
                    {k: v for k, v in t.items() if k != "series"}
                    | {"series": len(t["series"]), "last": _last_values(t)}
                    for t in r["targets"]
                ],
            }
            for r in results
        ],
        "image": str(png.relative_to(REPO) if png.is_relative_to(REPO) else png),
        "machine": machine_info(),
        "git": git_state(REPO),
    }
    write_json(args.out / "dashboard.json", summary)
    log(f"wrote {args.out / 'dashboard.json'} and {png}")
    return 1 if counts["error"] else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted")
        sys.exit(130)
