"""`kvmesh sim`: the mesh's own placement at 2-256 hosts, in virtual time.

`params` holds its parameters and command line (importing nothing heavy, for `kvmesh --help`);
`cluster` models the hosts (slots, a prefill queue, an engine KV cache and a replica store as
block LRUs, an outbound link); `policies` routes turns (kvmesh through node.mesh.placement and
node.mesh.directory, kv_share's push order through node.kvshare.pushorder; and the baselines);
`control` counts control-plane bytes from the real messages' sizes; `run` is the event loop and
its figures; `cli` runs the command.
"""
