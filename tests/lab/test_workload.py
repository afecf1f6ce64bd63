"""The lab's trace readers (node.lab.workload): Mooncake-format requests joined into conversations, Claude Code
traces as sessions with subagent conversations, bad input named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.node.lab.workload import TRACE_BLOCK_TOKENS, agent_trace, read_claude_code, read_mooncake, read_trace


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _row(ms: int, ids: list[int], out: int = 10) -> dict[str, object]:
    return {"timestamp": ms, "input_length": len(ids) * TRACE_BLOCK_TOKENS - 100, "output_length": out, "hash_ids": ids}


def test_requests_that_extend_or_mostly_share_a_prefix_continue_a_conversation(tmp_path: Path) -> None:
    """An extension and a request sharing half its blocks continue the conversation; a shared first block alone does not."""
    reqs = read_mooncake(_write(tmp_path / "t.jsonl", [
        _row(0, [1, 2, 3]), _row(1000, [1, 2, 3, 4]), _row(1500, [9]), _row(2000, [1, 2, 3, 4, 7, 8, 9, 10]),
        _row(3000, [1, 50, 51, 52, 53]),
    ]))
    s = [r.session for r in reqs]
    assert s[0] == s[1] == s[3] and len({s[0], s[2], s[4]}) == 3
    assert [r.turn for r in reqs] == [0, 1, 0, 2, 0]
    assert reqs[1].shared == 3 * TRACE_BLOCK_TOKENS and reqs[3].shared == 4 * TRACE_BLOCK_TOKENS and reqs[4].shared == 0
    assert reqs[1].t == 1.0 and reqs[1].blocks == (1, 2, 3, 4)


@pytest.mark.parametrize(("line", "says"), [
    ("{not json", "not JSON"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "hash_ids"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "timestamp"),
    ('{"timestamp": 0, "input_length": 5000, "output_length": 1, "hash_ids": [1]}', "does not fit 1 blocks"),
])
def test_a_bad_line_is_refused_naming_its_line_and_field(tmp_path: Path, line: str, says: str) -> None:
    """A malformed request raises ValueError with the file, the line number and what is wrong."""
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(_row(0, [1])) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=rf"bad.jsonl:2: .*{says}"):
        read_mooncake(p)


def test_the_shared_mooncake_trace_reads_whole() -> None:
    """The Mooncake trace kvmesh ships: 3,993 requests over ~17 minutes, 1,770 of them follow-ups of an earlier conversation."""
    reqs = read_mooncake("mooncake")  # shipped gzipped in node/lab/traces
    assert len(reqs) == 3993 and 1000 < reqs[-1].t < 1030
    follow = [r for r in reqs if r.turn > 0]
    assert len(follow) == 1770 and all(0 < r.shared <= r.input_length for r in follow)
    assert all(r.shared == 0 for r in reqs if r.turn == 0)


def test_the_agent_workload_grows_each_conversation_at_its_end() -> None:
    """Each agent turn's blocks extend its previous turn's, `shared` is that turn's prompt, and agents are clients."""
    reqs = agent_trace(agents=3, duration_s=30, seed=4)
    by_session: dict[str, list] = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    assert len({r.client for r in reqs}) == 3
    for turns in by_session.values():
        for a, b in zip(turns, turns[1:], strict=False):
            assert b.blocks[: len(a.blocks)] == a.blocks and b.shared == a.input_length and b.think_s > 0


CLAUDE_CODE = Path(__file__).parent / "data" / "claude_code"  # two small generated traces in kv-cache-tester's format


def test_claude_code_traces_read_as_sessions_whose_subagents_are_conversations_of_their_own() -> None:
    """A directory of trace_*.json.gz: one session per file; a subagent shares its session id, starts at the
    parent's t plus its own times, and is its own conversation and client; 64-token hash ids become 512-token blocks
    (a whole block equal where its eight ids and all before are; the tail is the request's own)."""
    reqs = read_trace(CLAUDE_CODE)
    assert [(r.session, r.thread, r.t) for r in reqs] == [
        ("trace_0001", "trace_0001", 0.0), ("trace_0002", "trace_0002", 5.0),
        ("trace_0001", "trace_0001/agent_001", 20.0), ("trace_0001", "trace_0001/agent_001", 24.0),
        ("trace_0001", "trace_0001", 30.0), ("trace_0001", "trace_0001", 90.0)]
    main = [r for r in reqs if r.thread == "trace_0001"]
    sub = [r for r in reqs if r.thread == "trace_0001/agent_001"]
    assert [len(r.blocks) for r in main] == [3, 4, 2] and [r.turn for r in main] == [0, 1, 2]
    assert main[1].blocks[:2] == main[0].blocks[:2] and main[1].blocks[2] != main[0].blocks[2]  # the tail is not shared
    assert [r.shared for r in main] == [0, 1024, 512]  # the last one rewrote its history (compaction)
    assert [r.think_s for r in main] == [0.0, 25.0, 55.5] and main[0].input_length == 16 * 64 + 10
    assert [r.shared for r in sub] == [0, 512] and sub[0].client != main[0].client
    assert not set(sub[0].blocks) & set(main[0].blocks)
    other = next(r for r in reqs if r.session == "trace_0002")
    assert not set(other.blocks) & {b for r in main for b in r.blocks}  # hash ids are local to their file
    one = read_trace(CLAUDE_CODE / "trace_0002.json.gz")  # one file reads alone too
    assert [(r.session, r.input_length, len(r.blocks)) for r in one] == [("trace_0002", 1024, 2)]


def test_a_bad_claude_code_trace_is_refused_naming_its_file_and_request(tmp_path: Path) -> None:
    """A request whose `in` is under its hash ids' tokens: ValueError naming the file, the conversation and the request."""
    bad = tmp_path / "trace_0009.json"
    bad.write_text(json.dumps({"id": "x", "requests": [{"t": 0, "in": 100, "out": 1, "hash_ids": [1, 2]}]}))
    with pytest.raises(ValueError, match=r"trace_0009\.json: x request 0: in \(100\)"):
        read_trace(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no trace_"):
        read_claude_code(tmp_path / "empty")


def test_the_sim_replays_a_claude_code_directory() -> None:
    """`kvmesh sim --trace DIR`: every request of the traces runs; the three that continue a conversation are follow-ups."""
    out = subprocess.run([sys.executable, "-m", "kvmesh", "sim", "--hosts", "2", "--trace", str(CLAUDE_CODE), "--json"],
                         capture_output=True, text=True, timeout=120, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["requests"] == 6 and r["follow_ups"] == 3, r


def test_a_replayed_conversation_s_prompt_grows_as_a_client_s_history_does() -> None:
    """TracePrompts: a request that replaces the previous one's last blocks extends its text (so node.mesh.threads
    sees one conversation), a rewritten history does not, and equal block ids are equal text across conversations."""
    from kvmesh.node.lab.workload import TracePrompts, TraceRequest

    def req(session: str, blocks: tuple[int, ...], length: int) -> TraceRequest:
        return TraceRequest(t=0.0, session=session, turn=0, input_length=length, output_length=1, blocks=blocks)

    tp = TracePrompts(64)
    first = tp.prompt(req("a", (1, 2, 3), 1100))  # 2 blocks and a part of the third
    assert len(first) == 1100 * 64 // TRACE_BLOCK_TOKENS
    grown = tp.prompt(req("a", (1, 2, 4, 5), 1900))  # the trace gives the part-held block a new id
    assert grown.startswith(first) and len(grown) == 1900 * 64 // TRACE_BLOCK_TOKENS
    retail = tp.prompt(req("a", (1, 2, 6, 7, 8), 2400))  # two trailing blocks replaced, as Mooncake's trace does
    assert retail.startswith(grown)
    long = tp.prompt(req("d", tuple(range(30, 42)), 6144))
    compacted = tp.prompt(req("d", (30, 31, *range(50, 60)), 6144))  # ten of twelve blocks rewritten: new text
    assert not compacted.startswith(long) and compacted[:128] == long[:128]
    other = TracePrompts(64).prompt(req("b", (1, 2, 3), 1536))  # another conversation, the same ids: the same text
    assert other.startswith(first)
    assert tp.prompt(req("c", (1, 2, 4, 5), 2048))[:len(grown)] == grown


def test_scaling_spreads_sessions_whose_start_the_trace_does_not_record() -> None:
    """scale_trace: Claude Code's sessions (times from their own start) are shifted within the span in the first
    copy too, subagents with their parent; Mooncake's (absolute times) keep theirs in it."""
    import random

    from kvmesh.node.lab.workload import scale_trace

    cc = read_trace(CLAUDE_CODE)
    out = scale_trace(cc, 1.0, 100.0, random.Random(3))
    assert len(out) == len(cc) and all(not r.start_known for r in out)
    key = {(r.thread, r.turn): r.t for r in cc}
    first = {s: min((r for r in cc if r.session == s), key=lambda r: r.t) for s in {r.session for r in cc}}
    shift = {s: next(o.t for o in out if (o.thread, o.turn) == (f.thread, f.turn)) - f.t for s, f in first.items()}
    assert all(s != 0 for s in shift.values()) and len(set(shift.values())) == len(shift)
    for r in out:  # every request of a session moved by its session's shift (subagents with their parent)
        assert r.t == max(0.0, key[(r.thread, r.turn)] + shift[r.session])
    mc = read_trace("mooncake")[:200]
    assert scale_trace(mc, 1.0, 100.0, random.Random(3)) == sorted(mc, key=lambda r: r.t)
