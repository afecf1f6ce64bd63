"""kv_share: delta replicas of sessions' KV caches, on the wire and on disk.

`wire` is the sans-I/O protocol (a `Sender` and a `Receiver` that turn bytes
into events and back); `store` is the on-disk `ReplicaStore`; `service` puts
them on sockets: the listener, the pushes and the planning of what to send.
"""
