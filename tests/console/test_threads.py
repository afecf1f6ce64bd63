"""A client session's conversations, one affinity group (issue 31): its main and its threads are counted in the
state as rows come and go (state/threads.py), kept together main first in the sessions order whichever the sort
(widgets/window.py), and read as one in the sessions table (widgets/sessions.py)."""

from __future__ import annotations

import random

import pytest
from kvm_helpers import GROUP, NODE1, NODE2, T0, THREADS, Clock, add_group, make_app, make_view, screen_text

from kvmesh.console.state import ConsoleState, group_of_key
from kvmesh.console.synthetic import SyntheticMesh
from kvmesh.console.widgets.sessions import SessionsTable
from kvmesh.console.widgets.window import Window
from kvmesh.node.protocol import ClusterViewEvent, SessionInfo, TurnFinished, TurnStarted

pytestmark = pytest.mark.anyio

THREAD_KEYS = sorted(f"{GROUP}#{h}" for h in THREADS)


def _fed(state: ConsoleState, view: ClusterViewEvent) -> ConsoleState:
    state.node_connected(NODE1)
    state.feed(NODE1, view)
    return state


def _turn(seq: int, session: str, host: str = "node-1") -> TurnStarted:
    return TurnStarted(ts=T0 + 5, node=host, seq=seq, session=session, host=host, prompt_tokens=900, cached_tokens=0)


# ---- state: which conversations are one group -----------------------------------------------------------


def test_a_group_with_a_main_and_three_threads_is_counted(state: ConsoleState) -> None:
    """A snapshot naming cc-1 and three cc-1#<hex> conversations of it: cc-1 is the main, its three threads counted."""
    _fed(state, add_group(make_view()))
    assert state.thread_count(GROUP) == 3 and sorted(state.threads_of(GROUP)) == THREAD_KEYS
    main = state.sessions[GROUP]
    assert main.group_id == GROUP and not main.is_thread
    assert all(state.sessions[k].group_id == GROUP and state.sessions[k].is_thread for k in THREAD_KEYS)
    assert state.sessions["s-000"].group_id == "s-000" and state.thread_count("s-000") == 0


def test_a_thread_that_goes_is_uncounted_and_its_main_drawn_again(clock: Clock) -> None:
    """A thread only a node gone for good listed leaves with that node's part: the group counts one fewer, and its
    main's row (listed by another node, so not rebuilt) is marked to be drawn again with the new count."""
    state = _fed(ConsoleState(clock=clock), add_group(make_view()))
    other = make_view(node="node-2")
    other.cluster.sessions = [SessionInfo(session=f"{GROUP}#deadbeef", group=GROUP, home="node-2",
                                          resident_tokens=100, last_turn_at=T0)]
    state.node_connected(NODE2)
    state.feed(NODE2, other)
    assert state.thread_count(GROUP) == 4
    state.node_disconnected(NODE2, "gone")
    state.tick()  # every lifecycle known: the tick that drops the node marks no row for that
    state.take_changes()
    clock.advance(state.part_grace_s + 1)
    state.tick()
    changes = state.take_changes()
    assert state.thread_count(GROUP) == 3 and f"{GROUP}#deadbeef" in changes.removed_sessions
    assert GROUP in changes.sessions


def test_a_thread_seen_only_live_is_grouped_by_its_key(state: ConsoleState) -> None:
    """Live events carry no group: a conversation first seen in one joins the group its key names
    (`<group>#<8 hex>`); a key of another form is a group of its own."""
    _fed(state, add_group(make_view()))
    state.feed(NODE1, _turn(1, f"{GROUP}#deadbeef"))
    state.feed(NODE1, _turn(2, "tool#run-1"))
    assert state.thread_count(GROUP) == 4 and state.sessions[f"{GROUP}#deadbeef"].group_id == GROUP
    assert state.sessions["tool#run-1"].group_id == "tool#run-1"
    assert group_of_key("x#0123abcd") == "x" and group_of_key("x#0123ABCD") == "x#0123ABCD"


def test_an_older_nodes_empty_group_is_a_group_of_its_own(state: ConsoleState) -> None:
    """group "" (a node before groups) means the session is its own group, whatever its key looks like."""
    view = make_view()
    view.cluster.sessions.append(SessionInfo(session="s-000#deadbeef", home="node-1", resident_tokens=100,
                                             last_turn_at=T0))
    _fed(state, view)
    assert state.sessions["s-000#deadbeef"].group_id == "s-000#deadbeef" and state.thread_count("s-000") == 0


def test_a_big_partitioned_mesh_counts_every_group(clock: Clock) -> None:
    """32 hosts, 4,000 conversations as 1,000 client sessions of a main and 3 threads, each host's snapshot its
    part: every main counts its 3 threads, whichever parts listed them."""
    mesh = SyntheticMesh(hosts=32, sessions=4000, threads=3, t0=T0)
    state = ConsoleState(clock=clock)
    for view in mesh.views(T0):
        url = f"synthetic://mesh/{view.node}"
        state.node_connected(url)
        state.feed(url, view)
    mains = {sid for sid, row in state.sessions.items() if not row.is_thread}
    assert len(state.sessions) == 4000 and len(mains) == 1000
    assert all(state.thread_count(m) == 3 for m in mains)
    win = Window()
    for sid, row in state.sessions.items():
        win.put(sid, (-row.resident_tokens, sid), row.group_id)
    win.settle()
    order = [win.at(i) for i in range(win.total)]
    for i, sid in enumerate(order):
        if sid in mains:
            assert {state.sessions[k].group_id for k in order[i : i + 4]} == {sid}


# ---- order: a group's rows together, main first --------------------------------------------------------


def _grouped_truth(own: dict[str, tuple[int, str]], group: dict[str, str], reverse: bool) -> list[str]:
    """The order the window must keep, derived from scratch: groups where their foremost member sorts, main
    first, then threads by their own keys (each direction read as displayed)."""
    members: dict[str, list[str]] = {}
    for k in own:
        members.setdefault(group.get(k, k), []).append(k)
    pick = max if reverse else min
    heads = {g: pick(own[k] for k in ks) for g, ks in members.items()}
    out = []
    for g in sorted(members, key=heads.__getitem__, reverse=reverse):
        threads = sorted((k for k in members[g] if k != g), key=own.__getitem__, reverse=reverse)
        out += ([g] if g in own else []) + threads
    return out


def test_a_group_is_ordered_main_first_then_its_threads_either_way() -> None:
    """Main cc-1 and three threads: they sit together where the group's foremost member sorts, the main first,
    ascending and descending; a thread's key change moves the whole group."""
    win = Window()
    own = {"a": (5, "a"), "z": (1, "z"), GROUP: (4, GROUP)}
    for i, k in enumerate(THREAD_KEYS):
        own[k] = (2 + 2 * i, k)  # 2, 4, 6
    groups = {k: GROUP for k in THREAD_KEYS}
    for k, v in own.items():
        win.put(k, v, groups.get(k))
    win.settle()
    t0, t1, t2 = THREAD_KEYS
    assert win.rows() == ["z", GROUP, t0, t1, t2, "a"]  # the group's head is its thread at 2
    win.set_reverse(True)
    win.settle()
    assert win.rows() == [GROUP, t2, t1, t0, "a", "z"]  # largest first: the thread at 6 leads the group
    win.put(t2, (0, t2), GROUP)  # the thread at 6 falls to 0: the group's head is now the main at 4
    win.settle()
    assert win.rows() == ["a", GROUP, t1, t0, t2, "z"]
    assert [win.index(k) for k in win.rows()] == list(range(6))


def test_the_grouped_order_survives_random_changes_and_both_directions() -> None:
    """After random puts, discards and regroupings the window's order equals the grouped order derived from
    scratch, in either direction, and index finds every key."""
    rng = random.Random(31)
    win = Window(page=10_000)
    own: dict[str, tuple[int, str]] = {}
    group: dict[str, str] = {}
    mains = [f"g{i:02d}" for i in range(30)]
    for step in range(60):
        for _ in range(rng.choice([2, 20, 200])):
            g = rng.choice(mains)
            k = g if rng.random() < 0.3 else f"{g}#{rng.randrange(6):08x}"
            if rng.random() < 0.2:
                win.discard(k)
                own.pop(k, None)
                group.pop(k, None)
                continue
            own[k] = (rng.randrange(20), k)
            if k != g:
                group[k] = g
            win.put(k, own[k], group.get(k))
        win.set_reverse(step % 5 == 0)
        win.settle()
        want = _grouped_truth(own, group, win.reverse)
        assert win.rows() == want and win.total == len(want)
        k = rng.choice(want)
        assert win.index(k) == want.index(k)


# ---- the sessions table ----------------------------------------------------------------------------


async def _settle(pilot, seconds: float = 0.0) -> None:  # type: ignore[no-untyped-def]
    await pilot.pause(seconds) if seconds else await pilot.pause()
    pilot.app.refresh_view()
    await pilot.pause()


def _ids(table: SessionsTable) -> dict[str, str]:
    return {k: table.get_cell(k, "session").plain[2:].rstrip() for k in table.shown_keys()}


async def test_the_sessions_table_reads_a_group_as_one(clock: Clock) -> None:
    """The main row counts the group's other conversations ("cc-1 +3") and its threads follow it as branches
    ("› #a1b2c3d4") whatever the sort; the line under the table names the group and its threads."""
    app, state = make_app(clock, snapshot=add_group(make_view()))
    async with app.run_test(size=(120, 40)) as pilot:
        await _settle(pilot)
        table = app.main.query_one(SessionsTable)
        order = table.window.rows()
        at = order.index(GROUP)
        assert order[at : at + 4] == [GROUP, *THREAD_KEYS]
        ids = _ids(table)
        assert ids[GROUP] == "cc-1 +3" and ids[THREAD_KEYS[0]] == f"› #{THREAD_KEYS[0][-8:]}"
        assert ids["s-000"] == "s-000"
        table.move_cursor(row=at, animate=False)
        await _settle(pilot)
        assert str(table.border_subtitle) == f"cc-1 · main + 3 threads: {', '.join(k[4:] for k in THREAD_KEYS)}"
        table.move_cursor(row=at + 2, animate=False)
        await _settle(pilot)
        assert str(table.border_subtitle).startswith(f"{THREAD_KEYS[1]} · thread of cc-1: main + 3 threads")
        table.set_sort("tokens")  # largest first: the main's 42k leads, its threads (5-6.4k) right under it
        await _settle(pilot)
        assert table.window.rows()[:4] == [GROUP, *sorted(THREAD_KEYS, key=lambda k: -state.sessions[k].resident_tokens)]
        assert "cc-1 +3" in screen_text(app)


async def test_filter_and_find_by_the_group_id_bring_its_threads(clock: Clock) -> None:
    """/ cc-1 keeps the main and its three threads; a filter matching one thread alone shows its whole id;
    f cc-1 jumps to the main and says how many threads it has."""
    app, state = make_app(clock, snapshot=add_group(make_view()))
    async with app.run_test(size=(120, 40)) as pilot:
        await _settle(pilot)
        table = app.main.query_one(SessionsTable)
        await pilot.press("slash", *GROUP, "enter")
        await _settle(pilot, 0.3)
        assert table.window.rows() == [GROUP, *THREAD_KEYS]
        await pilot.press("escape")
        await pilot.press("slash", *THREADS[0][:4], "enter")
        await _settle(pilot, 0.3)
        assert _ids(table) == {f"{GROUP}#{THREADS[0]}": f"{GROUP}#…{THREADS[0][-5:]}"}
        sid, note = table.find(state, GROUP)
        assert sid == GROUP and note == "found cc-1 (main + 3 threads); filter cleared"


async def test_a_thread_running_lifts_its_group_and_a_new_one_is_counted_live(clock: Clock) -> None:
    """Sorted by state, a turn starting on one thread brings the whole group up among the running, main first;
    a new thread seen live joins the count on the main row."""
    app, state = make_app(clock, snapshot=add_group(make_view()))
    async with app.run_test(size=(120, 40)) as pilot:
        await _settle(pilot)
        table = app.main.query_one(SessionsTable)
        state.feed(NODE1, _turn(1, THREAD_KEYS[2]))
        state.feed(NODE1, _turn(2, f"{GROUP}#deadbeef"))
        await _settle(pilot)
        rows = table.window.rows()
        # running first (the thread just started, then the new one), then the idle ones
        assert rows[:6] == [GROUP, THREAD_KEYS[2], f"{GROUP}#deadbeef", THREAD_KEYS[0], THREAD_KEYS[1], "s-000"]
        assert _ids(table)[GROUP] == "cc-1 +4"
        state.feed(NODE1, TurnFinished(ts=T0 + 6, node="node-1", seq=3, session=THREAD_KEYS[2], host="node-1",
                                       prompt_tokens=900, cached_tokens=0, completion_tokens=10, ttft_s=0.1,
                                       total_s=0.5))
        await _settle(pilot)
        assert table.window.rows()[:2] == [GROUP, f"{GROUP}#deadbeef"]


async def test_threads_whose_main_ends_read_by_their_whole_id(clock: Clock) -> None:
    """Live sessions only: when the main conversation ends while its threads go on, the threads stay together
    and show their whole ids (no main row above them to branch from)."""
    app, state = make_app(clock, snapshot=add_group(make_view()))
    async with app.run_test(size=(120, 40)) as pilot:
        for seq, key in enumerate(THREAD_KEYS, 1):
            state.feed(NODE1, TurnFinished(ts=T0 + 200, node="node-1", seq=seq, session=key, host="node-1",
                                           prompt_tokens=900, cached_tokens=0, completion_tokens=10, ttft_s=0.1,
                                           total_s=0.5))
        clock.now = T0 + 250
        await _settle(pilot)
        table = app.main.query_one(SessionsTable)
        assert _ids(table)[THREAD_KEYS[0]] == f"› #{THREADS[1]}"
        clock.now = T0 + 350  # the main's last turn was at T0-2: ended; its threads' at T0+200: idle
        state.tick()
        await _settle(pilot)
        assert GROUP not in table.window
        order = table.window.rows()
        at = order.index(THREAD_KEYS[0])
        assert order[at : at + 3] == THREAD_KEYS
        assert _ids(table)[THREAD_KEYS[0]] == "cc-1#…e0d0c"  # both ends: the group's threads differ at the end
