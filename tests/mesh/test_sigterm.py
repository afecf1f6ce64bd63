"""SIGTERM is a warm drain: /ready goes 503 at once, running turns finish, the node's sessions are pushed to
their next hosts, the node exits on its own, and under load no client turn fails and the moved sessions stay warm."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from typing import Any

import httpx
from support.conversation import Conversation

from kvmesh.node.lab.launcher import wait_for

from .helpers import MODEL, Mesh


def _agent(m: Mesh, conv: Conversation, entries: list[str], stop: threading.Event, failures: list[str]) -> None:
    """Turn after turn through the survivors until told to stop; any failure is recorded."""
    i = 0
    while not stop.is_set():
        try:
            m.turn(conv, entries[i % len(entries)])
        except Exception as e:  # noqa: BLE001 - the test counts them
            failures.append(f"{conv.session}: {type(e).__name__}: {e}")
        i += 1


def test_sigterm_drains_warm_under_load(make_mesh) -> None:  # type: ignore[no-untyped-def]
    """A host with sessions and a running turn gets SIGTERM while agents keep sending turns: it is unready at once,
    finishes the running turn, exits by itself well inside drain_timeout_s; no client turn fails, and each of its
    sessions' next turns runs warm on a survivor."""
    m: Mesh = make_mesh(slots=2)
    convs = [Conversation(f"term-{i}", chars=6000) for i in range(6)]
    for c in convs:
        m.turn(c, "a")
    victim = max(m.names, key=lambda n: sum(c.turns[-1].host == n for c in convs))
    mine = [c for c in convs if c.turns[-1].host == victim]
    others = [c for c in convs if c not in mine]
    survivors = [n for n in m.names if n != victim]
    for c in convs:
        m.settle(c)

    # A long turn running on the victim when the signal comes (a 60k-token tool output: 3 s of sim prefill).
    long_conv = Conversation("term-long", chars=2000)
    long_conv.messages += [{"role": "assistant", "content": "reading"}, {"role": "tool", "content": "x " * 30_000}]
    long_out: dict[str, Any] = {}

    def long_turn() -> None:
        try:
            long_out["turn"] = m.turn(long_conv, victim, pin=True)
        except Exception as e:  # noqa: BLE001
            long_out["error"] = repr(e)

    stop, failures = threading.Event(), []
    # Daemon threads, told to stop in `finally`: a failed step must not leave agents running (pytest would hang).
    agents = [threading.Thread(target=_agent, args=(m, c, survivors, stop, failures), daemon=True) for c in others]
    lt = threading.Thread(target=long_turn, daemon=True)
    lt.start()
    for t in agents:
        t.start()
    try:
        wait_for(lambda: m.host_info(victim, victim)["busy"] >= 1 or long_out, "the long turn to run on the victim")
        assert not long_out, long_out

        proc = m.nodes[victim]
        turns_before = sum(len(c.turns) for c in others)
        t0 = time.monotonic()
        proc.terminate()
        api = proc.api
        ready = wait_for(lambda: (r := httpx.get(api + "/ready", timeout=2)).status_code == 503 and r, "/ready to say 503",
                         timeout=5)
        assert ready.json()["status"] == "stopping" and httpx.get(api + "/health", timeout=2).status_code == 200
        assert proc.proc is not None
        try:
            code = proc.proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.proc.send_signal(signal.SIGUSR1)  # its threads' stacks into its log, for the failure's report
            time.sleep(1)
            raise AssertionError(f"node {victim} did not exit within 60 s of SIGTERM; log:\n{proc.tail(200)}") from None
        took = time.monotonic() - t0
        lt.join(30)
    finally:
        stop.set()
    for t in agents:
        t.join(60)

    assert code == 0, proc.tail()
    assert took < 30, f"the drain took {took:.1f}s"
    assert "turn" in long_out, long_out  # the running turn finished, whole
    assert long_out["turn"].host == victim
    assert failures == [], failures
    # The victim's sessions: their next turn runs on a survivor, warm (the drain pushed them there).
    for c in mine:
        t = m.turn(c, survivors[0])
        assert t.host in survivors and t.handoff == "warm", (c.session, t)
        assert t.reused >= 0.9, t
    assert "drained in" in proc.tail(80), proc.tail(80)
    print(f"sigterm drain: exit after {took:.1f}s; {sum(len(c.turns) for c in others) - turns_before} agent turns "
          f"during it, {len(failures)} failed; {len(mine)} drained sessions, next turns all warm")


def test_a_second_sigterm_exits_at_once(make_mesh) -> None:  # type: ignore[no-untyped-def]
    """A second SIGTERM while a drain waits on a running turn exits at once (warmth lost, nothing else)."""
    m: Mesh = make_mesh(slots=1)
    conv = Conversation("term-twice", chars=2000)
    # A 100k-token tool output: 5 s of sim prefill.
    conv.messages += [{"role": "assistant", "content": "reading"}, {"role": "tool", "content": "x " * 50_000}]
    out: dict[str, Any] = {}

    def turn() -> None:
        try:
            out["turn"] = m.client("b").chat.completions.create(
                model=MODEL, messages=conv.messages, max_tokens=4,  # type: ignore[arg-type]
                extra_headers={"X-Session-Id": conv.session, "X-Kvmesh-Forwarded": "1", **m.peer_headers()})
        except Exception as e:  # noqa: BLE001
            out["error"] = e

    th = threading.Thread(target=turn)
    th.start()
    wait_for(lambda: m.host_info("b", "b")["busy"] >= 1, "the turn to run on b")
    proc = m.nodes["b"]
    assert proc.proc is not None
    proc.terminate()
    wait_for(lambda: httpx.get(proc.api + "/ready", timeout=2).status_code == 503, "b to be unready", timeout=5)
    time.sleep(0.5)
    assert proc.proc.poll() is None, "one SIGTERM waits for the running turn"
    t0 = time.monotonic()
    proc.terminate()
    proc.proc.wait(10)
    assert time.monotonic() - t0 < 5
    th.join(30)
    assert "error" in out  # the client of the turn cut short sees an error, not a hang
