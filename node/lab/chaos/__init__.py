"""`kvmesh chaos`: fault drills on a local three-node sim mesh, with invariants checked after each.

Every scenario starts a fresh mesh of three `kvmesh node` processes on loopback
(sim engine, 2 slots, kv_scale 0.02, small `replicate_min_tokens`, a store dir
per node, a mesh secret and an admin token). Every directed kv_share link goes
through a TCP proxy run here (each node's peer `kvshare` address in the TOML
written here is the proxy), so the drill sees every transfer, can slow one
down to hit it mid-stream, cut it after N bytes or flip one bit of a block.
The coding-agent workload (`node.lab.load`) runs throughout, plus turns the drill
drives itself; one fault is injected while turns are in flight, then healed.

After each scenario the drill checks, and fails the scenario on any breach:

- failed turns: the load generator's error count and non-200 statuses plus
  the drill's own turns. A turn may be slower or cold, never lost. Clients
  use only entry nodes that are up (a load balancer drops a dead entry); a
  turn the mesh placed on a host that then died counts as lost.
- corrupt or partial replicas: once the nodes have stopped, each replica
  store is re-read file by file, independently of `ReplicaStore`: manifest,
  token file against the chained hashes, segment sizes, every block's payload
  digest, and every block's bytes against the sim engine's content (a function
  of the previous block's hash and the block's tokens, `node.engine.simkv`). The
  receiver writes every imported block behind to its store from its engine
  pool, so a bad byte that reached an engine reaches this check too.
- identical output: every turn (messages, max_tokens, temperature, seed) is
  replayed on a reference node that never fails and the replies compared.
  The reference runs the same model (same fingerprint) with faster sim rates;
  the rates set timing only. The sim seeds its logits from a digest of the KV
  bytes each turn attends, read from its pool, so equal replies mean the
  serving host attended the same KV as the reference: a wrong, stale or
  corrupt import would change the reply.
- leaked temp files: no '~' name in any store once kv_share is idle (checked
  live, and again after a clean stop).
- serving afterwards: a turn pinned on each node, and one through each node
  as the entry, succeed after the fault is healed.

Each scenario also measures that its fault really happened (a drill that
never hit its fault must not pass) and checks what that fault is about (a
retried transfer lands whole, a replica survives a restart, ...).

A scenario whose fault cannot be injected here reports "not_run" with the reason, never "passed".

The last stdout line is one JSON object: `{"scenarios": N, "passed": N, "failed": N, "not_run": N,
"failed_turns": 0, "corrupt_imports": 0, "details": [...]}`. Exit status 0 only when every
scenario passed; 1 when any failed; 3 when none failed but some were not run.

Every process, proxy and mount started here is cleaned up on exit, on error
and on Ctrl-C; only PIDs started here are signalled.

Modules: `cleanup` (the undo registry), `proxy` (the fault proxy, also used by the kv_share
tests), `verify` (the store re-read), `clocklint` (the static clock check), `clockshim` (the
clock-jump drill's wall clock), `turns` and `harness` (one scenario's mesh and turns),
`scenarios` (the drills), `invariants` (how each is judged), `runner` (`kvmesh chaos`).
"""

from __future__ import annotations

from kvmesh.node.lab.chaos.clocklint import wall_clock_findings
from kvmesh.node.lab.chaos.proxy import Fault, LinkProxy
from kvmesh.node.lab.chaos.runner import run_chaos
from kvmesh.node.lab.chaos.verify import verify_store

__all__ = ["Fault", "LinkProxy", "run_chaos", "verify_store", "wall_clock_findings"]
