"""`kvmesh demo`: start a local node and hold a short conversation with it, printing what happened."""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import httpx

from node.bench.workload import grow_conversation, text
from node.launcher import NodeProcess, write_toml


def run_demo(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvmesh-demo-") as tmp:
        work = Path(tmp)
        cfg = work / "node-1.toml"
        write_toml(cfg, {"name": "node-1", "api": {"host": "127.0.0.1", "port": 0},
                         "engine": {"kind": args.engine, "slots": 2, "cache_bytes": 512 << 20, "max_context": 32768}})
        node = NodeProcess("node-1", cfg, work)
        print(f"starting node-1 ({args.engine} engine) ...", flush=True)
        node.start()
        try:
            node.wait_ready()
            print(f"node-1 ready at {node.api}\n", flush=True)
            rng = random.Random(1)
            msgs = grow_conversation(rng, 6000)
            model = httpx.get(f"{node.api}/v1/models").json()["data"][0]["id"]
            print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'reused':>7} {'ttft_s':>7}  reply")
            with httpx.Client(timeout=120) as client:
                for turn in range(1, args.turns + 1):
                    t0 = time.monotonic()
                    ttft = None
                    reply = []
                    usage = {}
                    with client.stream("POST", f"{node.api}/v1/chat/completions",
                                       headers={"X-Session-Id": "demo-1"},
                                       json={"model": model, "messages": msgs, "max_tokens": 24, "temperature": 0,
                                             "stream": True, "stream_options": {"include_usage": True}}) as r:
                        r.raise_for_status()
                        for line in r.iter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue


                            obj = json.loads(line[6:])
                            if obj.get("usage"):
                                usage = obj["usage"]
                            for ch in obj.get("choices", []):
                                if ch["delta"].get("content"):
                                    ttft = ttft or time.monotonic() - t0
                                    reply.append(ch["delta"]["content"])
                    content = "".join(reply)
                    cached = usage["prompt_tokens_details"]["cached_tokens"]
                    pct = 100 * cached / usage["prompt_tokens"]
                    print(f"{turn:>4} {usage['prompt_tokens']:>7} {cached:>7} {pct:>6.1f}% {ttft or 0:>7.3f}  {content[:30]!r}",
                          flush=True)
                    msgs += [{"role": "assistant", "content": content},
                             {"role": "tool", "content": text(rng, 800)}]
            print("\nturn 1 prefilled everything; later turns reuse the resident cache (cached tokens).")
        finally:
            node.stop()
    return 0
