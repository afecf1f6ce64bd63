"""The engine boundary: the torch and sim engines both satisfy `EngineAPI` (mypy checks the
assignments below statically; the tests check presence and call signatures at run time)."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest

from kvmesh.node.engine.boundary import BlockPins, EngineAPI, ImportAPI, PoolBytes, SlotLoad
from kvmesh.node.engine.engine import Engine, ImportTxn
from kvmesh.node.engine.hashing import block_hashes


def _as_api(e: Engine) -> EngineAPI:
    return e  # mypy: Engine is structurally an EngineAPI


def _as_import(t: ImportTxn) -> ImportAPI:
    return t  # mypy: ImportTxn is structurally an ImportAPI


def _protocol_methods(proto: type) -> dict[str, Any]:
    """The protocol's plain methods (properties excluded), by name."""
    return {n: v for n, v in vars(proto).items() if not n.startswith("_") and inspect.isfunction(v)}


def _assert_signatures_fit(impl: object, proto: type) -> None:
    """Each protocol method's parameters appear in the implementation, same names and kinds, in order;
    any extra parameter of the implementation has a default."""
    methods = _protocol_methods(proto)
    assert methods, proto
    for name, want in methods.items():
        got = inspect.signature(getattr(impl, name))
        want_params = list(inspect.signature(want).parameters.values())[1:]  # drop self
        got_params = list(got.parameters.values())
        assert [(p.name, p.kind) for p in got_params[: len(want_params)]] == [(p.name, p.kind) for p in want_params], name
        assert all(p.default is not inspect.Parameter.empty for p in got_params[len(want_params) :]), name


@pytest.mark.parametrize("kind", ["tiny", "sim"])
def test_engines_satisfy_the_engine_boundary(kind: str, make_engine, sim_cfg, tiny_cfg) -> None:  # type: ignore[no-untyped-def]
    """The torch and sim engines, their import transactions, slots, block pins and pool satisfy the boundary's protocols."""
    e: Engine = make_engine(cfg=sim_cfg() if kind == "sim" else tiny_cfg(block_size=16))
    api = _as_api(e)
    assert isinstance(api, EngineAPI)
    assert isinstance(api.blocks, BlockPins) and isinstance(api.pool, PoolBytes) and isinstance(api.slots, SlotLoad)
    _assert_signatures_fit(e, EngineAPI)
    _assert_signatures_fit(e.blocks, BlockPins)
    _assert_signatures_fit(e.pool, PoolBytes)
    _assert_signatures_fit(e.slots, SlotLoad)
    tokens = np.arange(2 * e.block_size, dtype=np.int32) % 200
    hashes = block_hashes(e.seed_hash, tokens, e.block_size)
    txn = _as_import(e.begin_import("s", e.fingerprint, tokens, hashes))
    try:
        assert isinstance(txn, ImportAPI)
        assert txn.missing == [0, 1]
        _assert_signatures_fit(txn, ImportAPI)
    finally:
        txn.abort()
