"""What the integration suites share: the conversations they drive (`support.conversation`) and the
/v1/events reader (`support.events`). The mesh builder and `wait_for` are `kvmesh.node.lab.launcher`'s,
shared with the benchmarks.

Imported as `support`: pytest puts tests/ on sys.path for the test packages under it (tests/ itself
is not a package: the default "prepend" import mode), so a suite that uses it has an __init__.py.
"""
