"""``kvtier cluster``'s supervision: an instance that exits is restarted, left out, or ends it.

The children are real processes (small Python programs that print the banner
lines ``kvtier serve`` prints and then wait), so this runs in a second; the
cluster with real servers and a real router is in ``test_cluster_router.py``.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout

import pytest

from kvtier.cli.cluster import MAX_FAILED_STARTS, Child, Instance, _spawn, _supervise

#: A stand-in for ``kvtier serve``: its banner (KV events, block size, serving line), then
#: it waits to be killed. PORT and EVENTS are what it "bound".
SERVE = (
    "import functools, sys, time\n"
    "print = functools.partial(print, flush=True)\n"
    "print('  kvtier: KV events (vLLM\\'s format) published on tcp://127.0.0.1:' + sys.argv[2])\n"
    "print('  kvtier: KV cache: 64 blocks of 16 tokens')\n"
    "print('kvtier: serving tiny at http://127.0.0.1:' + sys.argv[1] + '/v1 (OpenAI)')\n"
    "time.sleep(120)\n"
)
EXITS = "import sys; sys.exit(3)"


def _serve(port: int = 41001, events: int = 41002) -> list[str]:
    return [sys.executable, "-c", SERVE, str(port), str(events)]


def _waiter() -> Child:
    return _spawn("router", [sys.executable, "-c", "import time; time.sleep(120)"], echo=False)


@pytest.fixture
def children() -> Iterator[list[Child]]:
    made: list[Child] = []
    yield made
    for child in made:
        child.stop(signal.SIGKILL)


def _instance(name: str, argv: list[str], made: list[Child]) -> Instance:
    child = _spawn(name, argv, echo=False)
    made.append(child)
    assert child.ready.wait(10)
    inst = Instance(name, argv, dict(os.environ), child)
    inst.pin_addresses()
    return inst


def _run(
    router: Child, instances: list[Instance], on_exit: str
) -> tuple[threading.Thread, dict[str, object], io.StringIO]:
    said = io.StringIO()
    result: dict[str, object] = {}

    def body() -> None:
        with redirect_stdout(said), redirect_stderr(said):
            result["died"] = _supervise(router, instances, [], on_exit)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, result, said


def test_an_instance_comes_back_on_the_ports_it_bound(children: list[Child]) -> None:
    argv = ["serve", "--port", "0", "--kv-events", "tcp://127.0.0.1:0"]
    inst = _instance("serve 1", _serve(43210, 43211), children)
    inst.argv = argv
    inst.pin_addresses()
    assert inst.url == "http://127.0.0.1:43210"
    assert argv == ["serve", "--port", "43210", "--kv-events", "tcp://127.0.0.1:43211"]
    inst.pin_addresses()  # a second time changes nothing
    assert argv == ["serve", "--port", "43210", "--kv-events", "tcp://127.0.0.1:43211"]


def test_continue_leaves_a_dead_instance_out_and_stops_when_none_is_left(
    children: list[Child],
) -> None:
    router = _waiter()
    children.append(router)
    first = _instance("serve 1", _serve(), children)
    second = _instance("serve 2", _serve(), children)
    thread, result, said = _run(router, [first, second], "continue")
    second.child.send(signal.SIGKILL)
    thread.join(2)
    assert thread.is_alive(), said.getvalue()  # one instance still serves
    first.child.send(signal.SIGKILL)
    thread.join(10)
    assert not thread.is_alive()
    assert result["died"] is first.child
    out = said.getvalue()
    assert "serve 2 left out (--on-instance-exit continue); 1 instance(s) serving" in out
    assert "serve 1 left out (--on-instance-exit continue); 0 instance(s) serving" in out
    assert router.alive


def test_restart_starts_it_again_and_gives_up_on_one_that_keeps_failing(
    children: list[Child],
) -> None:
    router = _waiter()
    children.append(router)
    steady = _instance("serve 1", _serve(), children)
    flaky = _instance("serve 2", _serve(), children)
    thread, result, said = _run(router, [steady, flaky], "restart")
    old = flaky.child
    old.send(signal.SIGKILL)
    for _ in range(100):
        if flaky.child is not old and not flaky.restarting:
            break
        thread.join(0.1)
    children.append(flaky.child)
    assert flaky.child is not old and flaky.child.alive
    assert "starting serve 2 again at http://127.0.0.1:41001" in said.getvalue()
    assert "serve 2 serving again" in said.getvalue()
    # Now it fails at once on every start: after MAX_FAILED_STARTS of those it is left out.
    flaky.argv = [sys.executable, "-c", EXITS]
    flaky.child.send(signal.SIGKILL)
    for _ in range(100):
        if flaky.down:
            break
        thread.join(0.1)
    assert flaky.down, said.getvalue()
    assert thread.is_alive()  # serve 1 still serves
    out = said.getvalue()
    # Restarted after each death of a serving instance, and after all but the last failed start.
    assert out.count("starting serve 2 again") == 2 + MAX_FAILED_STARTS - 1
    assert f"serve 2 left out (it exited {MAX_FAILED_STARTS} times in a row before serving)" in out
    assert "exited with status 3" in out  # each death says why
    router.send(signal.SIGKILL)
    thread.join(10)
    assert result["died"] is router


def test_the_router_dying_ends_the_cluster(children: list[Child]) -> None:
    router = _waiter()
    children.append(router)
    inst = _instance("serve 1", _serve(), children)
    thread, result, _ = _run(router, [inst], "restart")
    router.send(signal.SIGKILL)
    thread.join(10)
    assert result["died"] is router
    assert inst.child.alive  # run() stops the rest; _supervise only reports
