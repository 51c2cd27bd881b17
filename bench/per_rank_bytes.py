"""Bytes each tensor-parallel rank fetches from the store, against the whole delta, in one run.

    python bench/per_rank_bytes.py                 # torch path, TP 1/2/4/8, ~1 min
    python bench/per_rank_bytes.py --vllm          # plus a real vLLM CPU server at TP 2, ~3 min

A Qwen2-shaped model (default hidden 1024, 4 layers, vocab 16384, 69 M parameters) takes
``--steps`` RL-like steps (Adam-like sign steps of size ``--lr`` on fp32 masters, cast to
bf16: a few % of the elements change), published to a local store with the default cell
size. The torch path shards every tensor as vLLM's Qwen2 does (vocabulary, q/k/v, gate and
up along dimension 0; o_proj and down_proj along dimension 1; norms replicated) over
``world`` in-process ranks, drives each update through the real
:class:`~engine_ext.server.controller.Controller` and checks every rank's shard against the
final weights bit for bit. ``--vllm`` serves the same model at TP 2 on vLLM's CPU build
and takes the per-rank figures from the endpoint's answers (``fetched_bytes``).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import add_tiny_model_args, publish_sign_steps, signed_run, tiny_model  # noqa: E402

DIM1 = ("o_proj", "down_proj")  # row-parallel: sharded along the input dimension
REPLICATED = ("norm",)


def shard_dim(name: str, t: torch.Tensor) -> int | None:
    if any(k in name for k in REPLICATED):
        return None
    if any(k in name for k in DIM1):
        return 1
    return 0


class ShardedRank(torch.nn.Module):
    """Holds part ``r`` of ``world`` of every tensor along the dimension vLLM shards it on."""

    def __init__(self, r: int, world: int, sd: dict):
        super().__init__()
        self.r, self.world, self.names = r, world, {}
        for i, (name, t) in enumerate(sd.items()):
            d = shard_dim(name, t)
            shape = list(t.shape)
            if d is not None:
                shape[d] //= world
            self.names[name] = (f"p{i}", d)
            self.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(shape, dtype=t.dtype), requires_grad=False))

    def shard(self, name: str, t: torch.Tensor) -> torch.Tensor:
        _, d = self.names[name]
        if d is None:
            return t
        n = t.shape[d] // self.world
        return t.narrow(d, self.r * n, n)

    def load(self, name: str, t: torch.Tensor) -> None:
        with torch.no_grad():
            getattr(self, self.names[name][0]).copy_(self.shard(name, t))


class InProcessRanks:
    """:class:`engine_ext.server.transaction.Ranks` over ranks in this process (replies cross the wire format)."""

    def __init__(self, updaters):
        self.updaters = updaters

    async def call(self, op, **kw):
        from engine_ext.server.protocol import RankReply
        from engine_ext.server.rank import run_op

        return [RankReply.from_wire(run_op(up, op, kw)) for up in self.updaters]

    async def pause(self, mode):
        pass

    async def resume(self):
        pass

    async def after_update(self, version):
        pass


def torch_path(store: Path, versions: list[dict], world: int) -> list[dict]:
    from engine_ext.server.controller import Controller
    from engine_ext.format.dtypes import BY_TORCH
    from engine_ext.server.protocol import UpdateRequest
    from engine_ext.server.rank import RankUpdater
    from engine_ext.store.sources import Sources

    base = versions[0]
    specs = {n: (tuple(t.shape), BY_TORCH[t.dtype]) for n, t in base.items()}
    modules = [ShardedRank(r, world, base) for r in range(world)]
    for m in modules:
        for n, t in base.items():
            m.load(n, t)
    ctl = Controller(InProcessRanks([RankUpdater(m, m.load, specs, rank=m.r) for m in modules]), Sources([str(store)]),
                     version=0)
    asyncio.run(ctl.start())
    rows = []
    for v in range(1, len(versions)):
        a = asyncio.run(ctl.update(UpdateRequest.parse({"url": str(store / f"v{v:08d}.json")})))
        rows.append({"payload": a["payload_bytes"], "ranks": a["fetched_bytes"]})
    for m in modules:  # bit-exact: every shard equals the final weights' shard
        for n, t in versions[-1].items():
            assert torch.equal(getattr(m, m.names[n][0]).view(torch.int16), m.shard(n, t).view(torch.int16)), n
    return rows


def vllm_path(model_dir: Path, store: Path, steps: int, log: Path) -> list[dict]:
    from engine_ext.engines.vllm.launcher import VllmServer

    rows = []
    with VllmServer(model_dir, sources=str(store), tp=2, base_version=0, log=log) as srv:
        for v in range(1, steps + 1):
            r = srv.update({"url": str(store / f"v{v:08d}.json")})
            assert r.status_code == 200, r.text
            a = r.json()
            rows.append({"payload": a["payload_bytes"], "ranks": a["fetched_bytes"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    add_tiny_model_args(ap)
    ap.add_argument("--worlds", default="1,2,4,8")
    ap.add_argument("--vllm", action="store_true", help="also a real vLLM CPU server at TP 2")
    args = ap.parse_args()

    run = signed_run(None, "engine_ext_rank_bytes_")
    os.environ.setdefault("ENGINE_EXT_TOKEN", "bench")
    work = run.work
    model_dir = tiny_model(args, work, heads=max(8, args.hidden // 128), kv_heads=4)
    versions = publish_sign_steps(model_dir, run.store, args.steps, args.lr)
    numel = sum(t.numel() for t in versions[0].values())
    print(f"Qwen2-shaped, {numel / 1e6:.1f} M params (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}), "
          f"{args.steps} steps at lr {args.lr:g}\n")
    print("| path | TP | whole delta (KB) | largest rank (KB) | smallest rank (KB) | largest rank / whole |")
    print("|---|---:|---:|---:|---:|---:|")

    def row(path: str, world: int, rows: list[dict]) -> None:
        whole = statistics.median(r["payload"] for r in rows)
        hi = statistics.median(max(r["ranks"]) for r in rows)
        lo = statistics.median(min(r["ranks"]) for r in rows)
        print(f"| {path} | {world} | {whole / 1e3:.1f} | {hi / 1e3:.1f} | {lo / 1e3:.1f} | {hi / whole:.3f} |", flush=True)

    for world in (int(w) for w in args.worlds.split(",")):
        row("torch (bit-exact checked)", world, torch_path(work / "store", versions, world))
    if args.vllm:
        row("vLLM CPU server", 2, vllm_path(model_dir, work / "store", args.steps, work / "vllm_tp2.log"))
    print(f"\n(median over {args.steps} steps; work dir {work})")


if __name__ == "__main__":
    main()
