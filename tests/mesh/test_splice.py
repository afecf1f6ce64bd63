"""StreamSplice (node/mesh/forward.py): one client answer from the answer events of the hosts that ran the turn."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvmesh.node.engine.boundary import TokenLogprob
from kvmesh.node.mesh.answer import (
    AnswerEvent,
    ContentDelta,
    Failed,
    Finish,
    Logprobs,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
)
from kvmesh.node.mesh.forward import HopChunks, ResumeDiverged, StreamSplice


def ev(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def chunk(cid: str, text: str | None = None, *, role: bool = False, finish: str | None = None) -> bytes:
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
    return ev({"id": cid, "object": "chat.completion.chunk", "created": 7 if cid == "first" else 9, "model": "m",
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def stream(cid: str, *texts: str, finish: str = "stop") -> list[bytes]:
    return [chunk(cid, role=True), *(chunk(cid, t) for t in texts), chunk(cid, finish=finish), ev(b"[DONE]")]


class Relay:
    """What EntryTurn.relay does: each host's stream read into events (a fresh reader per stream), then spliced."""

    def __init__(self) -> None:
        self.splice, self.hop = StreamSplice(), HopChunks()

    def feed(self, parts: list[bytes]) -> list[AnswerEvent]:
        return [out for p in parts for e in self.hop.feed(p) for out in self.splice.feed(e)]

    def resume(self) -> None:
        self.hop = HopChunks()  # a torn event of the dead stream is dropped with its reader
        self.splice.resume()


def texts(events: list[AnswerEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, ContentDelta))


def test_first_stream_passes_through_unchanged() -> None:
    """Until a resume, every event is passed on unchanged, whatever the read boundaries."""
    r = Relay()
    raw = b"".join(stream("first", "Hel", "lo"))
    out = r.feed([raw[i:i + 5] for i in range(0, len(raw), 5)])
    events = [ContentDelta("Hel"), ContentDelta("lo"), Finish("stop")]
    assert out == events and r.hop.done
    s = StreamSplice()
    assert [o for e in events for o in s.feed(e)] == events


def test_resume_drops_the_repeat() -> None:
    """After a resume the new stream's repeat of the sent text is dropped, a chunk straddling the
    boundary is trimmed, and a torn event of the dead stream is never passed on."""
    r = Relay()
    first = stream("first", "Hel", "lo, ", "wor")[:4]  # role, "Hel", "lo, ", "wor": then the host died
    out = r.feed(first + [chunk("first", "ld")[:20]])
    assert texts(out) == "Hello, wor" and not r.hop.done
    r.resume()
    out2 = r.feed(stream("second", "Hello", ", w", "orld", "!"))
    assert texts(out) + texts(out2) == "Hello, world!"
    assert out2 == [ContentDelta("ld"), ContentDelta("!"), Finish("stop")] and r.hop.done


def test_a_second_resume_skips_everything_sent_so_far() -> None:
    """Two hosts die in turn: the third stream resumes after the text of both."""
    r = Relay()
    out = r.feed(stream("first", "ab", "cd")[:3])
    r.resume()
    out += r.feed(stream("second", "abc", "de")[:3])
    r.resume()
    out += r.feed(stream("third", "a", "bcdef", "g"))
    assert texts(out) == "abcdefg" and r.splice.resumes == 2


def test_a_repeat_that_differs_is_refused() -> None:
    """A resumed stream saying something else than the client was sent raises ResumeDiverged."""
    r = Relay()
    r.feed(stream("first", "abc", "def")[:3])
    r.resume()
    with pytest.raises(ResumeDiverged):
        r.feed(stream("second", "abX", "def"))


def test_a_repeat_that_ends_short_is_refused() -> None:
    """A resumed stream that finishes before reaching the sent text raises ResumeDiverged."""
    r = Relay()
    r.feed(stream("first", "abc", "def")[:3])
    r.resume()
    with pytest.raises(ResumeDiverged):
        r.feed(stream("second", "ab"))


def test_in_band_error_and_usage_chunks() -> None:
    """An in-band error ends the stream; a usage chunk after a resume brings the usage with the finish."""
    r = Relay()
    out = r.feed([chunk("first", role=True), ev({"error": {"message": "boom", "type": "server_error"}}), chunk("first", "x")])
    assert r.hop.done and not r.hop.finished and out == [Failed("boom", "server_error", None)]
    r2 = Relay()
    r2.feed(stream("first", "ab")[:2])
    r2.resume()
    out2 = r2.feed([chunk("second", "ab", finish="length"), ev({"id": "second", "created": 9, "model": "m", "choices": [],
                                                                "usage": {"prompt_tokens": 3}}), ev(b"[DONE]")])
    assert out2 == [Finish("length", prompt_tokens=3)] and r2.hop.finished


def test_the_log_probabilities_of_repeated_text_are_dropped() -> None:
    """After a resume, the log probabilities right after a repeated text go with it; those of new text stay."""
    lp = Logprobs((TokenLogprob(b"a", -0.5, ()),))
    s = StreamSplice()
    s.feed(ContentDelta("ab"))
    s.resume()
    assert s.feed(ContentDelta("ab")) == [] and s.feed(lp) == []
    assert s.feed(ContentDelta("c")) == [ContentDelta("c")] and s.feed(lp) == [lp]


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


def client_view(events: list[AnswerEvent]) -> tuple[str, dict[int, dict[str, str]]]:
    """The content and tool calls a client accumulates from the events; a call started or ended twice fails."""
    text, calls, ended = [], {}, set()
    for e in events:
        if isinstance(e, ContentDelta):
            text.append(e.text)
        elif isinstance(e, ToolCallStart):
            assert e.index not in calls, f"call {e.index} started twice: {calls.get(e.index)} then {e.id}"
            calls[e.index] = {"id": e.id, "name": e.name, "arguments": ""}
        elif isinstance(e, ToolCallArgs):
            calls[e.index]["arguments"] += e.text
        elif isinstance(e, ToolCallEnd):
            assert e.index not in ended, f"call {e.index} ended twice"
            ended.add(e.index)
    assert ended == set(calls)
    return "".join(text), calls


def test_resume_does_not_repeat_tool_call_deltas() -> None:
    """A stream that dies mid tool call resumes with each call started once, under its first id, arguments whole."""
    r = Relay()
    first = tool_stream("first", ["Let me see."], [("call_A", "get_weather", ['{"ci', 'ty": "P', 'aris"}'])])
    out = r.feed(first[:4])  # role, text, call 0's start, '{"ci': then the host died
    r.resume()
    out += r.feed(tool_stream("second", ["Let me", " see."], [("call_B", "get_weather", ['{"city"', ': "Paris"}']),
                                                             ("call_C", "read_file", ["{}"])]))
    text, calls = client_view(out)
    assert text == "Let me see."
    assert calls == {0: {"id": "call_A", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                     1: {"id": "call_C", "name": "read_file", "arguments": "{}"}}
    assert not any(isinstance(e, ToolCallStart) and e.id == "call_B" for e in out) and r.hop.done and r.hop.finished


def test_an_ended_call_is_not_ended_again() -> None:
    """A call whose end the client was sent before its host died is not ended again by the repeat."""
    s = StreamSplice()
    first: list[AnswerEvent] = [ToolCallStart(0, "call_A", "f"), ToolCallArgs(0, "{}"), ToolCallEnd(0), ContentDelta("x")]
    out = [o for e in first for o in s.feed(e)]
    s.resume()
    out += [o for e in [ToolCallStart(0, "call_B", "f"), ToolCallArgs(0, "{}"), ToolCallEnd(0), ContentDelta("xy"),
                        Finish("stop")] for o in s.feed(e)]
    assert client_view(out) == ("xy", {0: {"id": "call_A", "name": "f", "arguments": "{}"}})


@pytest.mark.parametrize("repeat", [
    [("call_B", "read_file", ['{"city": "Paris"}'])],  # another function
    [("call_B", "get_weather", ['{"city": "Rome"}'])],  # other arguments
], ids=["name", "arguments"])
def test_a_tool_call_repeat_that_differs_is_refused(repeat: list[tuple[str, str, list[str]]]) -> None:
    """A resumed stream calling another function, or with other arguments, than the client was sent raises ResumeDiverged."""
    r = Relay()
    r.feed(tool_stream("first", [], [("call_A", "get_weather", ['{"city": "P'])])[:3])
    r.resume()
    with pytest.raises(ResumeDiverged):
        r.feed(tool_stream("second", [], repeat))
