"""StreamSplice (node/mesh/forward.py): one client answer from the SSE streams of the hosts that ran the turn."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvmesh.node.mesh.forward import ResumeDiverged, StreamSplice


def ev(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def chunk(cid: str, text: str | None = None, *, role: bool = False, finish: str | None = None) -> bytes:
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
    return ev({"id": cid, "object": "chat.completion.chunk", "created": 7 if cid == "first" else 9, "model": "m",
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def stream(cid: str, *texts: str, finish: str = "stop") -> list[bytes]:
    return [chunk(cid, role=True), *(chunk(cid, t) for t in texts), chunk(cid, finish=finish), ev(b"[DONE]")]


def texts(events: list[bytes]) -> str:
    out = []
    for e in events:
        data = e.strip()[5:].strip()
        if data != b"[DONE]":
            for c in json.loads(data).get("choices", []):
                out.append(c["delta"].get("content") or "")
    return "".join(out)


def feed_all(s: StreamSplice, parts: list[bytes]) -> list[bytes]:
    return [e for p in parts for e in s.feed(p)]


def test_first_stream_passes_through_byte_for_byte() -> None:
    """Until a resume, every event is relayed unchanged, whatever the read boundaries."""
    s = StreamSplice()
    raw = b"".join(stream("first", "Hel", "lo"))
    out = feed_all(s, [raw[i:i + 5] for i in range(0, len(raw), 5)])
    assert b"".join(out) == raw and s.done and s.finished


def test_resume_drops_the_repeat_and_keeps_the_first_id() -> None:
    """After a resume the new stream's role chunk and its repeat of the sent text are dropped, a chunk
    straddling the boundary is trimmed, and every chunk carries the first stream's id and created."""
    s = StreamSplice()
    first = stream("first", "Hel", "lo, ", "wor")[:4]  # role, "Hel", "lo, ", "wor": then the host died
    out = feed_all(s, first + [chunk("first", "ld")[:20]])  # a torn event is never relayed
    assert texts(out) == "Hello, wor" and not s.done
    s.resume()
    out2 = feed_all(s, stream("second", "Hello", ", w", "orld", "!"))
    assert texts(out) + texts(out2) == "Hello, world!"
    objs = [json.loads(e.strip()[5:]) for e in out2 if not e.strip().endswith(b"[DONE]")]
    assert {(o["id"], o["created"]) for o in objs} == {("first", 7)}
    assert all("role" not in o["choices"][0]["delta"] for o in objs)
    assert objs[-1]["choices"][0]["finish_reason"] == "stop" and s.done


def test_a_second_resume_skips_everything_sent_so_far() -> None:
    """Two hosts die in turn: the third stream resumes after the text of both."""
    s = StreamSplice()
    out = feed_all(s, stream("first", "ab", "cd")[:3])
    s.resume()
    out += feed_all(s, stream("second", "abc", "de")[:3])
    s.resume()
    out += feed_all(s, stream("third", "a", "bcdef", "g"))
    assert texts(out) == "abcdefg" and s.resumes == 2


def test_a_repeat_that_differs_is_refused() -> None:
    """A resumed stream saying something else than the client was sent raises ResumeDiverged."""
    s = StreamSplice()
    feed_all(s, stream("first", "abc", "def")[:3])
    s.resume()
    with pytest.raises(ResumeDiverged):
        feed_all(s, stream("second", "abX", "def"))


def test_a_repeat_that_ends_short_is_refused() -> None:
    """A resumed stream that finishes before reaching the sent text raises ResumeDiverged."""
    s = StreamSplice()
    feed_all(s, stream("first", "abc", "def")[:3])
    s.resume()
    with pytest.raises(ResumeDiverged):
        feed_all(s, stream("second", "ab"))


def test_in_band_error_and_usage_chunks() -> None:
    """An in-band error ends the stream; a usage chunk (no choices) after a resume is relayed with the first id."""
    s = StreamSplice()
    out = feed_all(s, [chunk("first", role=True), ev({"error": {"message": "boom", "type": "server_error"}}), chunk("first", "x")])
    assert s.done and not s.finished and len(out) == 2
    s2 = StreamSplice()
    feed_all(s2, stream("first", "ab")[:2])
    s2.resume()
    out2 = feed_all(s2, [chunk("second", "ab", finish="length"), ev({"id": "second", "created": 9, "model": "m", "choices": [],
                                                                       "usage": {"prompt_tokens": 3}}), ev(b"[DONE]")])
    usage = json.loads(out2[1].strip()[5:])
    assert usage["id"] == "first" and usage["usage"] == {"prompt_tokens": 3} and s2.finished


def tool_chunk(cid: str, index: int, *, call_id: str | None = None, name: str | None = None, args: str = "") -> bytes:
    entry: dict[str, Any] = {"index": index, "function": {"arguments": args}}
    if call_id is not None:
        entry |= {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
    return ev({"id": cid, "object": "chat.completion.chunk", "created": 7 if cid == "first" else 9, "model": "m",
               "choices": [{"index": 0, "delta": {"tool_calls": [entry]}, "finish_reason": None}]})


def tool_stream(cid: str, content: list[str], calls: list[tuple[str, str, list[str]]]) -> list[bytes]:
    """A stream of some content, then tool calls (id, name, argument fragments), finish_reason tool_calls."""
    out = [chunk(cid, role=True), *(chunk(cid, t) for t in content)]
    for i, (call_id, name, frags) in enumerate(calls):
        out.append(tool_chunk(cid, i, call_id=call_id, name=name))
        out += [tool_chunk(cid, i, args=f) for f in frags]
    return out + [chunk(cid, finish="tool_calls"), ev(b"[DONE]")]


def client_view(events: list[bytes]) -> tuple[str, dict[int, dict[str, str]]]:
    """The content and tool calls a client accumulates from the relayed events; a call's id sent twice fails."""
    text, calls = [], {}
    for e in events:
        data = e.strip()[5:].strip()
        if data == b"[DONE]":
            continue
        for c in json.loads(data).get("choices", []):
            text.append(c["delta"].get("content") or "")
            for tc in c["delta"].get("tool_calls") or []:
                call = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
                if "id" in tc:
                    assert not call["id"], f"call {tc['index']} started twice: {call['id']} then {tc['id']}"
                    call["id"] = tc["id"]
                call["name"] += tc["function"].get("name") or ""
                call["arguments"] += tc["function"].get("arguments") or ""
    return "".join(text), calls


def test_resume_does_not_repeat_tool_call_deltas() -> None:
    """A stream that dies mid tool call resumes with each call started once, under its first id, arguments whole."""
    s = StreamSplice()
    first = tool_stream("first", ["Let me see."], [("call_A", "get_weather", ['{"ci', 'ty": "P', 'aris"}'])])
    out = feed_all(s, first[:4])  # role, text, call 0's start, '{"ci': then the host died
    s.resume()
    out += feed_all(s, tool_stream("second", ["Let me", " see."], [("call_B", "get_weather", ['{"city"', ': "Paris"}']),
                                                                    ("call_C", "read_file", ["{}"])]))
    text, calls = client_view(out)
    assert text == "Let me see."
    assert calls == {0: {"id": "call_A", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                     1: {"id": "call_C", "name": "read_file", "arguments": "{}"}}
    assert b"call_B" not in b"".join(out) and s.done and s.finished


@pytest.mark.parametrize("repeat", [
    [("call_B", "read_file", ['{"city": "Paris"}'])],  # another function
    [("call_B", "get_weather", ['{"city": "Rome"}'])],  # other arguments
], ids=["name", "arguments"])
def test_a_tool_call_repeat_that_differs_is_refused(repeat: list[tuple[str, str, list[str]]]) -> None:
    """A resumed stream calling another function, or with other arguments, than the client was sent raises ResumeDiverged."""
    s = StreamSplice()
    feed_all(s, tool_stream("first", [], [("call_A", "get_weather", ['{"city": "P'])])[:3])
    s.resume()
    with pytest.raises(ResumeDiverged):
        feed_all(s, tool_stream("second", [], repeat))
