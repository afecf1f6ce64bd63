"""kv_share: delta replicas of sessions' KV caches, on the wire and on disk.

`wire` is the sans-I/O protocol (a `Sender` and a `Receiver` that turn bytes
into events and back); `store` is the on-disk `ReplicaStore`. Sockets, the
listener and the planning of what to send live elsewhere and build on these.
"""
