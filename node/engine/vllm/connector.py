"""kvmesh's KV connector, loaded into vLLM (`kv_connector_module_path`): the node's block pool <-> vLLM's paged cache.

Runs inside the vLLM process, so it imports vllm, torch, numpy and the standard library only (and its
sibling `layout`). The node keeps the only index of the pool (node.engine.vllm.engine); each request
carries its part of it in `kv_transfer_params["kvmesh"]`:
- `load`: pool block ids of the prompt's leading kvmesh blocks the node holds;
- `store`: pool block ids for the kvmesh blocks from index `first` on (-1: the node has that one already),
  prompt and reply alike, to be written once vLLM has computed them (delta only).

Scheduler side: `get_num_new_matched_tokens` answers the tokens the load list covers beyond what vLLM
computed itself; the plan of each step (`build_connector_meta`) names the vLLM blocks to fill from the
pool before the forward and the full blocks to copy out after it. Worker side: loads run before the
forward (`start_load_kv`: synchronous, the forward reads them), saves after it (`wait_for_save`), each
block's digest checked before a load and written after a save (node.engine.vllm.layout). A block that
does not check is not copied and is reported through `get_block_ids_with_load_errors`: vLLM recomputes
it (kv_load_failure_policy "recompute"), and its state byte tells the node to stop advertising it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .layout import BAD, PoolFile

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


@dataclass
class Copy:
    """One kvmesh block: its pool id and the vLLM blocks (K of them, in order) it maps to."""

    pool_id: int
    vllm_ids: list[int]


@dataclass
class KvmeshMeta(KVConnectorMetadata):
    loads: list[Copy] = field(default_factory=list)
    saves: list[Copy] = field(default_factory=list)


@dataclass
class _Plan:
    """A request's part of the node's index, and how far its blocks are saved."""

    load: list[int]
    store: list[int]
    first: int
    vllm_ids: list[int] = field(default_factory=list)
    saved: int = 0  # kvmesh blocks before this one are saved (or were never the connector's to save)
    matched: tuple[int, int] = (0, 0)  # what the last get_num_new_matched_tokens answered: (local, external)
    pending_load: tuple[int, int] | None = None  # token range to load at the next step


class KvmeshConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.vllm_block = vllm_config.cache_config.block_size
        self.block_size = int(extra["block_size"])
        if self.block_size % self.vllm_block:
            raise ValueError(f"kvmesh's block of {self.block_size} tokens is not a multiple of vLLM's {self.vllm_block}")
        self.k = self.block_size // self.vllm_block
        self.pool_path = Path(extra["pool"])
        self.plans: dict[str, _Plan] = {}
        # Worker side, once the caches are registered.
        self.pool: PoolFile | None = None
        self.caches: list[tuple[torch.Tensor, int]] = []  # (one layer's cache, its block dimension)
        self.slabs: torch.Tensor | None = None  # the pool as [blocks, layers, K, *slab]
        self.errors: set[int] = set()

    # ---- scheduler side ------------------------------------------------------

    def _plan(self, request: Request) -> _Plan | None:
        plan = self.plans.get(request.request_id)
        if plan is None:
            p = (request.kv_transfer_params or {}).get("kvmesh")
            if not p:
                return None
            plan = self.plans[request.request_id] = _Plan([int(x) for x in p.get("load", [])],
                                                          [int(x) for x in p.get("store", [])], int(p.get("first", 0)))
        return plan

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        plan = self._plan(request)
        if plan is None:
            return 0, False
        n = len(request.prompt_token_ids or [])
        # At least one prompt token is computed (for its logits), and loads end on a vLLM block boundary.
        can = min(len(plan.load) * self.block_size, (n - 1) // self.vllm_block * self.vllm_block)
        ext = max(0, can - num_computed_tokens)
        plan.matched = (num_computed_tokens, ext)
        return ext, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        plan = self._plan(request)
        if plan is None:
            return
        if num_external_tokens > 0:
            local = plan.matched[0]
            plan.pending_load = (local, local + num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvmeshMeta()
        for new in scheduler_output.scheduled_new_reqs:
            plan = self.plans.get(new.req_id)
            if plan is None:
                continue
            plan.vllm_ids = list(new.block_ids[0])
            self._steps(meta, new.req_id, plan, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            plan = self.plans.get(req_id)
            if plan is None:
                continue
            ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                plan.vllm_ids = list(ids[0]) if ids is not None else []
            elif ids is not None:
                plan.vllm_ids += ids[0]
            self._steps(meta, req_id, plan, cached.num_computed_tokens[i], scheduler_output)
        return meta

    def _steps(self, meta: KvmeshMeta, req_id: str, plan: _Plan, computed: int, out: SchedulerOutput) -> None:
        """This step's loads for the request, and its saves of the kvmesh blocks full once the step has run."""
        k, bs = self.k, self.block_size
        if plan.pending_load is not None:
            lo, hi = plan.pending_load
            plan.pending_load = None
            for j in range(lo // bs, math.ceil(hi / bs)):
                sub = [v for v in range(j * k, (j + 1) * k) if lo // self.vllm_block <= v < hi // self.vllm_block]
                meta.loads.append(Copy(plan.load[j], [plan.vllm_ids[v] if v in sub else -1 for v in range(j * k, (j + 1) * k)]))
        done = computed + out.num_scheduled_tokens.get(req_id, 0)
        plan.saved = max(plan.saved, plan.first)
        while plan.saved < done // bs and plan.saved - plan.first < len(plan.store):
            j = plan.saved
            pool_id = plan.store[j - plan.first]
            if pool_id >= 0 and (j + 1) * k <= len(plan.vllm_ids):
                meta.saves.append(Copy(pool_id, plan.vllm_ids[j * k : (j + 1) * k]))
            plan.saved += 1

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.plans.pop(request.request_id, None)
        return False, None

    # ---- worker side ---------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map the pool and check that one kvmesh block of every layer fills exactly the node's block bytes."""
        num_blocks = self._kv_cache_config.num_blocks
        seen: set[int] = set()
        for cache in kv_caches.values():
            if cache.data_ptr() in seen:
                continue  # layers sharing one cache store it once
            seen.add(cache.data_ptr())
            dim = next(d for d in range(cache.dim()) if cache.shape[d] == num_blocks)
            self.caches.append((cache, dim))
        slab = tuple(self.caches[0][0].select(self.caches[0][1], 0).shape)
        dtype = self.caches[0][0].dtype
        if any(tuple(c.select(d, 0).shape) != slab or c.dtype != dtype for c, d in self.caches):
            raise ValueError("kvmesh's connector needs every attention layer's cache in one shape and dtype")
        self.pool = PoolFile.open(self.pool_path)
        layers = len(self.caches)
        want = layers * self.k * math.prod(slab) * dtype.itemsize
        if want != self.pool.geometry.block_bytes:
            raise ValueError(f"a kvmesh block here is {want} bytes ({layers} layers x {self.k} x {slab} {dtype}); "
                             f"the node's pool has blocks of {self.pool.geometry.block_bytes}")
        self.slabs = (torch.frombuffer(self.pool.blocks, dtype=torch.uint8).view(dtype)
                      .view(self.pool.geometry.num_blocks, layers, self.k, *slab))
        self.pool.set_layout({"layers": layers, "sub_blocks": self.k, "vllm_block": self.vllm_block, "slab": list(slab),
                              "dtype": str(dtype).removeprefix("torch."), "block_dim": self.caches[0][1],
                              "device": self.caches[0][0].device.type})

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvmeshMeta) and self.pool is not None and self.slabs is not None
        for c in meta.loads:
            if not self.pool.check(c.pool_id):
                self.pool.states[c.pool_id] = BAD
                self.errors.update(v for v in c.vllm_ids if v >= 0)
                continue
            for layer, (cache, dim) in enumerate(self.caches):
                for s, v in enumerate(c.vllm_ids):
                    if v >= 0:
                        cache.select(dim, v).copy_(self.slabs[c.pool_id, layer, s], non_blocking=True)
        if meta.loads and self.caches and self.caches[0][0].is_cuda:
            torch.cuda.current_stream().synchronize()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every load finished in start_load_kv, before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves copy whole blocks once the step's forward is done (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvmeshMeta)
        if not meta.saves:
            return
        assert self.pool is not None and self.slabs is not None
        for c in meta.saves:
            for layer, (cache, dim) in enumerate(self.caches):
                for s, v in enumerate(c.vllm_ids):
                    self.slabs[c.pool_id, layer, s].copy_(cache.select(dim, v))
            self.pool.seal(c.pool_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self.errors = self.errors, set()
        return errors

    def shutdown(self) -> None:
        if self.pool is not None:
            self.slabs = None
            self.pool.close()
