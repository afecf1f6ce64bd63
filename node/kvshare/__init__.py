"""kv_share: delta replicas of sessions' KV caches, on the wire and on disk.

`wire` is the sans-I/O protocol (a `Sender` and a `Receiver` that turn bytes into events and
back); `store` is the on-disk `ReplicaStore` (index, manifests, segments, writes, imports);
`service` is the `KVShare` facade that puts them on sockets through its parts: `links`
(accounting), `sender` and `stream` (pushes), `receiver` and `landing` (the listener and its
decisions), `imports` (the import before a turn), `explain` and `writebehind`.
"""
