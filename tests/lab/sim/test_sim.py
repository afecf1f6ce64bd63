"""`kvmesh sim`: the real placement in virtual time; kvmesh against the other policies; one hop; control bytes."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from kvmesh.node.lab.sim.cluster import BlockLRU, Cluster, Held, SimHost, StoreLRU
from kvmesh.node.lab.sim.policies import POLICIES, KvmeshRouter
from kvmesh.node.lab.sim.run import SimParams, Simulation
from kvmesh.node.lab.workload import agent_trace, read_mooncake
from kvmesh.node.mesh.placement import choose, push_target


def _sim(policy: str, hosts: int, reqs: list, **kw: object) -> dict[str, object]:
    p = SimParams(hosts=hosts, policy=policy, **kw)  # type: ignore[arg-type]
    s = Simulation(p, reqs)
    s.run()
    return s.summary(max(p.until_s or 0.0, s.fig.end))


def test_kvmesh_is_at_least_as_warm_and_as_fast_at_p99_as_every_other_policy() -> None:
    """8 hosts, coding agents at about 0.6 of each host: kvmesh's warm % and TTFT p99 are the best of the five."""
    reqs = agent_trace(agents=60, duration_s=120, seed=3)
    out = {pol: _sim(pol, 8, reqs, until_s=120.0) for pol in POLICIES}
    km = out["kvmesh"]
    for pol, r in out.items():
        assert km["warm_pct"] >= r["warm_pct"], (pol, km["warm_pct"], r["warm_pct"])  # type: ignore[operator]
        assert km["ttft_p99_s"] <= r["ttft_p99_s"], (pol, km["ttft_p99_s"], r["ttft_p99_s"])  # type: ignore[operator]
    assert out["round_robin"]["warm_pct"] < 50  # type: ignore[operator]  # the comparison has teeth


def test_replicas_keep_the_moves_off_a_busy_home_warm() -> None:
    """Busy homes move turns to hosts with a free slot; with replicas those moves are warm, without them (no session
    replicates) they are cold or, as a cold move must pay for itself, not made. (At 50 agents on these 16 slots no
    host has a slot free, and nothing moves: a move into another queue gains nothing.)"""
    reqs = agent_trace(agents=24, duration_s=90, seed=5)
    on = _sim("kvmesh", 4, reqs, until_s=90.0, slots=4)
    off = _sim("kvmesh", 4, reqs, until_s=90.0, slots=4, replicate_min_tokens=10**9)
    assert on["moves"] >= 20 and on["replica_bytes"] > 0, on  # type: ignore[operator]
    assert on["moves_warm_pct"] >= 90, on  # type: ignore[operator]
    assert off["replica_bytes"] == 0 and (off["moves"] == 0 or off["moves_warm_pct"] < 50), off  # type: ignore[operator]


def test_at_256_hosts_a_turn_takes_one_lookup_and_one_forward_within_the_control_budget() -> None:
    """256 hosts: at most one directory lookup and one forward per turn, and each host's control plane under
    1% of a 1 GbE link (1.25 MB/s in and out)."""
    reqs = agent_trace(agents=2000, duration_s=20, seed=6)
    r = _sim("kvmesh", 256, reqs, until_s=20.0)
    assert r["requests"] > 5000
    assert 0.9 < r["lookups_per_turn"] <= 1.0 and r["forwards_per_turn"] <= 1.0, r  # type: ignore[operator]
    assert 0 < r["control_bytes_per_host_s"] < 1.25e6, r  # type: ignore[operator]


def test_the_candidate_hosts_give_the_decision_over_every_host() -> None:
    """Random loads and holdings: `choose` and `push_target` over the router's candidates pick what they pick over all hosts."""
    rng = random.Random(11)
    for trial in range(300):
        n = rng.choice([3, 8, 40])
        hosts = [SimHost(f"h{i:02d}", 4, 10_000.0, 50.0, 2e10, BlockLRU(10_000), StoreLRU(10_000)) for i in range(n)]
        for h in hosts:
            h.busy, h.mean_turn_s = rng.randint(0, 4), rng.uniform(0.5, 5)
            h.queue.extend(range(rng.randint(0, 3) if h.busy == 4 else 0))
        c = Cluster(hosts)
        for h in hosts:
            c.changed(h)
        blocks = tuple(range(trial * 100, trial * 100 + rng.randint(2, 60)))
        for h in rng.sample(hosts, rng.randint(0, min(3, n))):
            k = rng.randint(1, len(blocks))
            h.engine.add(blocks[:k])
            c.held["s"][h.name] = Held(blocks=blocks[:k], home_seq=rng.randint(0, 3), turn_seq=rng.randint(0, 3))
        router = KvmeshRouter(c, rng, kv_bytes_per_token=131_072, directory_after_hosts=16)
        held = c.holdings("s", 0.0)
        prompt = len(blocks) * 512
        full = choose(c.loads(), held, prompt, router.placement, session="s")
        assert full is not None and router.route(_req(blocks, prompt), "h00", 0.0).host == full.host, trial
        assert router.replica_target("s", 0.0) == push_target(c.loads(), held, router.placement, session="s"), trial


def _req(blocks: tuple[int, ...], prompt: int):  # type: ignore[no-untyped-def]
    from kvmesh.node.lab.workload import TraceRequest

    return TraceRequest(t=0.0, session="s", turn=1, input_length=prompt, output_length=8, blocks=blocks, shared=prompt // 2)


def test_the_store_drops_received_replicas_before_its_own_sessions() -> None:
    """A store full of its own blocks takes a replica only in what room replicas may have; own blocks stay."""
    s = StoreLRU(10)
    s.add(tuple(range(6)), own=True)
    s.add(tuple(range(100, 106)), own=False)
    assert s.prefix(range(6)) == 6 and len(s) == 10
    s.add(tuple(range(6, 10)), own=True)
    assert s.prefix(range(10)) == 10 and s.prefix(range(100, 106)) == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_the_cli_prints_the_issue_keys_on_the_shipped_trace(policy: str) -> None:
    """`kvmesh sim --trace mooncake --json` ends with one JSON object holding every key the sim promises."""
    out = subprocess.run([sys.executable, "-m", "kvmesh", "sim", "--hosts", "2", "--trace", "mooncake", "--policy", policy,
                          "--json"], capture_output=True, text=True, timeout=240, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    for k in ("hosts", "policy", "requests", "warm_pct", "ttft_p50_s", "ttft_p99_s", "prefill_tokens", "replica_bytes",
              "control_bytes_per_host_s", "utilisation", "link_utilisation"):
        assert k in r, k
    # Every turn of the trace is either served or failed in its client's face (out of retries, or timed out).
    assert r["hosts"] == 2 and r["policy"] == policy
    assert r["requests"] + r["failed_turns"] == len(read_mooncake("mooncake"))


def test_the_cli_refuses_a_missing_trace_with_a_clear_error() -> None:
    """A trace that is not there: exit 2 and a message naming it, no traceback."""
    out = subprocess.run([sys.executable, "-m", "kvmesh", "sim", "--trace", "/nonexistent/t.jsonl", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "/nonexistent/t.jsonl" in out.stderr and "Traceback" not in out.stderr


def test_the_cli_refuses_a_host_without_slots() -> None:
    """A model parameter at 0: exit 2 naming the flag, no traceback."""
    out = subprocess.run([sys.executable, "-m", "kvmesh", "sim", "--slots", "0", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--slots must be above 0" in out.stderr and "Traceback" not in out.stderr


def _trace_sim(policy: str, hosts: int, load: float, trace: str = "mooncake", *, admission: bool = True) -> dict[str, object]:
    import argparse

    from kvmesh.node.lab.sim.cli import workload

    args = argparse.Namespace(trace=trace, load=load, seed=1, span=None)
    reqs, span, _, p = workload(args, SimParams(hosts=hosts, policy=policy, admission=admission))
    s = Simulation(p, reqs)
    s.run()
    return s.summary(max(span, s.fig.end))


@pytest.mark.parametrize(("hosts", "load"), [(2, 0.7), (8, 0.9)])
def test_under_load_kvmesh_recomputes_no_more_than_session_hashing(hosts: int, load: float) -> None:
    """The shipped Mooncake trace under load: kvmesh's moves pay for themselves, so it recomputes at most 5% more
    prompt tokens than session hashing, is as warm (to 0.3 points) and no slower at p99 (cold moves onto busy hosts
    once recomputed 1.6x and 2.2x session hashing's tokens here: load turned into recompute). The move rule alone:
    admission off (it refuses turns, which the test below covers). The 0.3: placing a new conversation where its id
    hashes once every queue is past a minute (Policy.spread_new_after_s) costs 0.3 points at 8 hosts and 0.9 (93.21%
    against 93.49%) and fails 268 turns instead of 655 at 1.2, where session hashing fails 266."""
    km, sh = _trace_sim("kvmesh", hosts, load, admission=False), _trace_sim("session_hash", hosts, load)
    assert km["requests"] == sh["requests"]
    assert km["prefill_tokens"] <= 1.05 * sh["prefill_tokens"], (km, sh)  # type: ignore[operator]
    assert km["warm_pct"] >= sh["warm_pct"] - 0.3, (km, sh)  # type: ignore[operator]
    assert km["ttft_p99_s"] <= sh["ttft_p99_s"], (km, sh)  # type: ignore[operator]


@pytest.mark.parametrize(("hosts", "load"), [(2, 0.7), (8, 0.9)])
def test_past_capacity_refusing_early_bounds_the_queue(hosts: int, load: float) -> None:
    """Past capacity (session hashing's median turn queues for over a minute here) kvmesh refuses what no host can
    start within the bound: its served turns' TTFT p50 and p99 and its goodput beat session hashing's, every
    request is still served (after its retries), and it is no less warm than with admission off minus 1.5 points."""
    km, sh = _trace_sim("kvmesh", hosts, load), _trace_sim("session_hash", hosts, load)
    off = _trace_sim("kvmesh", hosts, load, admission=False)
    assert km["requests"] == sh["requests"] and km["refused"] > 0 and sh["refused"] == 0, (km, sh)
    assert sh["ttft_p50_s"] > 60, sh  # precondition: past capacity  # type: ignore[operator]
    for key in ("ttft_p50_s", "ttft_p99_s"):
        assert km[key] < sh[key], (key, km, sh)  # type: ignore[operator]
    assert km["goodput_per_s"] > sh["goodput_per_s"], (km, sh)  # type: ignore[operator]
    assert km["warm_pct"] >= off["warm_pct"] - 1.5, (km, off)  # type: ignore[operator]


def test_the_sim_replicates_from_the_nodes_default_size() -> None:
    """The sim's replication threshold is the node's unset kvshare.replicate_min_tokens, so both replicate alike."""
    from kvmesh.node.config import REPLICATE_MIN_TOKENS

    assert SimParams(hosts=2).replicate_min_tokens == REPLICATE_MIN_TOKENS


def test_past_capacity_pushes_to_queued_hosts_are_held_back_and_counted() -> None:
    """Past capacity the host a session would move to often has turns queued: kvmesh holds those pushes back and
    counts them, and still pushes the others; a baseline pushes nothing and holds nothing back."""
    km, sh = _trace_sim("kvmesh", 2, 0.7), _trace_sim("session_hash", 2, 0.7)
    assert km["pushes_held_back"] > 0 and km["replica_bytes"] > 0, km  # type: ignore[operator]
    assert sh["pushes_held_back"] == 0 and sh["replica_bytes"] == 0, sh
