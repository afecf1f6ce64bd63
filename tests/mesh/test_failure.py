"""A peer that dies (SIGKILL) is routed around: nothing a client sent is lost, and the mesh shows it unreachable."""

from __future__ import annotations

import copy
import signal
import time

import pytest
from support.conversation import Conversation

from kvmesh.node.engine.tokenizer import ByteTokenizer
from kvmesh.node.lab.launcher import wait_for

from .helpers import MODEL, Mesh, whole_blocks


def test_killed_home_is_routed_around_and_shown_unreachable(make_mesh, events) -> None:  # type: ignore[no-untyped-def]
    """Kill a session's home: its next turns succeed on the survivors, whole; the dead peer shows unreachable."""
    m: Mesh = make_mesh(slots=2)
    conv = Conversation("kill-1", seed=901)
    t1 = m.turn(conv, "a")
    home = t1.host
    m.settle(conv)
    holder = m.wait_replica(conv.session, home, whole_blocks(t1.prompt_tokens))
    entry = next(n for n in m.names if n not in (home, holder))  # forwards, finds the home dead, places again
    watch = {n: events(m.api(n)) for n in (entry, holder)}
    tok = ByteTokenizer()

    m.nodes[home].kill()
    killed_at = time.monotonic()
    sent = copy.deepcopy(conv.messages)
    t2 = m.turn(conv, entry)  # at once: the entry still believes the home is up
    assert t2.status == 200 and t2.reply, t2
    assert t2.host != home
    assert t2.prompt_tokens == len(tok.apply_chat_template(sent)), "the serving host did not get the whole prompt"
    assert t2.host == holder and t2.handoff == "warm" and t2.reused >= 0.9, t2

    # Streaming, through the other survivor: the whole answer, then [DONE].
    sent = copy.deepcopy(conv.messages)
    t3, finish = m.stream_turn(conv, holder)
    assert t3.status == 200 and finish in ("stop", "length"), (t3, finish)
    assert t3.host == holder and t3.prompt_tokens == len(tok.apply_chat_template(sent))

    # A new session through either survivor never goes to the dead host.
    for n in (entry, holder):
        fresh = Conversation(f"kill-new-{n}", seed=950 + ord(n))
        t = m.turn(fresh, n)
        assert t.status == 200 and t.host in (entry, holder), t

    # Within stale_after (plus one poll), every survivor shows the dead peer unreachable, still listed.
    bound = m.stale_s + m.poll_s + 1.0
    for n in (entry, holder):
        wait_for(lambda n=n: m.host_info(n, home)["reachable"] is False, f"{n} to show {home} unreachable",
                 timeout=max(0.1, bound - (time.monotonic() - killed_at)))
        hosts = m.cluster(n)["hosts"]
        assert sorted(h["name"] for h in hosts) == sorted(m.names), "a dead peer must be shown, not hidden"
        assert all(h["reachable"] for h in hosts if h["name"] != home)
        watch[n].wait(lambda e: e.type == "peer_down" and e.peer == home, f"a peer_down event for {home} on {n}")


def _metric(m: Mesh, node: str, name: str) -> float:
    text = m.http.get(m.api(node) + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith((name + " ", name + "{")))


@pytest.mark.parametrize(("temperature", "fault"), [(0.0, "kill"), (0.9, "kill"), (0.0, "stop"), (0.0, "segv")])
def test_stream_continues_on_a_survivor_when_its_host_dies(make_mesh, temperature: float, fault: str) -> None:  # type: ignore[no-untyped-def]
    """The serving host is killed, segfaults (SIGSEGV: what a native crash in llama_decode delivers) or
    stops answering (SIGSTOP) mid-answer: the client's stream goes on from a survivor, one whole answer
    with no error (greedy: the never-failing answer; sampled: the entry's seed repeats it)."""
    m: Mesh = make_mesh(slots=2, sim={"decode_tps": 25.0})  # 40 ms a token: the fault lands mid-answer
    conv = Conversation(f"resume-{temperature}", seed=977)
    home = m.turn(conv, "a").host
    m.settle(conv)
    entry = next(n for n in m.names if n != home)
    sent = copy.deepcopy(conv.messages)
    # Sampled: a fixed seed, so the answer is one known to run past the fault (an entry-drawn seed sometimes
    # ended it within three tokens, before the kill); the entry forwards a client's seed as it does its own.
    seed = {"seed": 5} if temperature > 0 else {}
    stream = m.client(entry).chat.completions.with_raw_response.create(
        model=MODEL, messages=sent, max_tokens=300, temperature=temperature, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, extra_headers={"X-Session-Id": conv.session}, **seed)
    assert stream.headers["x-kvmesh-host"] == home
    parts: list[str] = []
    before_kill, finish, usage, ids = None, None, None, set()
    for chunk in stream.parse():
        ids.add(chunk.id)
        usage = chunk.usage or usage
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
        if before_kill is None and sum(1 for p in parts if p) >= 3:
            assert finish is None, "the answer ended before the kill: pick a longer one"
            before_kill = "".join(parts)
            if fault == "kill":
                m.nodes[home].kill()
            elif fault == "segv":
                crashed = m.nodes[home].proc
                assert crashed is not None
                crashed.send_signal(signal.SIGSEGV)
                # died of the segfault itself (faulthandler re-raises it), as systemd's on-failure sees it
                assert crashed.wait(10) == -signal.SIGSEGV, crashed.returncode
            else:
                stopped = m.nodes[home].proc
                assert stopped is not None
                stopped.send_signal(signal.SIGSTOP)
    if fault == "stop":
        stopped.send_signal(signal.SIGCONT)  # the stream did not wait for it
    answer = "".join(parts)
    assert before_kill is not None and finish in ("stop", "length") and usage is not None, (answer, finish)
    assert len(answer) > len(before_kill) and answer.startswith(before_kill), (before_kill, answer)
    assert len(ids) == 1, f"the resumed chunks must carry the first stream's id: {ids}"
    assert _metric(m, entry, "kvmesh_streams_resumed_total") == 1
    if temperature == 0.0:
        # What a never-failing host answers to the same conversation.
        ref = m.client(entry).chat.completions.create(model=MODEL, messages=sent, max_tokens=300, temperature=0,  # type: ignore[arg-type]
                                                      extra_headers={"X-Session-Id": conv.session})
        assert ref.choices[0].message.content == answer
