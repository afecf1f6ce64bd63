"""Which host answers for a session: the directory, by rendezvous (highest random weight) hashing.

Past `mesh.directory_after_hosts` hosts a node no longer mirrors every session of every peer:
each host streams a session's changes only to that session's directory host (plus its load to
everyone), and an entry node that is not the directory asks it (`GET /v1/peer/directory/...`)
before placing a turn: one lookup, then at most one forward to the host placement picks. Any
host computes the same directory from the same member set with no coordination; a host joining
or leaving moves only the sessions it wins or held (1/N of them), and a session a directory
does not know (membership just changed) is looked up on every peer, as a small mesh does.
`kvmesh sim` runs this same function.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash


def directory_host(session: str, members: Iterable[str]) -> str:
    """The member that answers for `session` (members: every host's name, this one's included)."""
    return max(members, key=lambda m: (xxhash.xxh64_intdigest(f"{m}\x00{session}".encode()), m))
