"""Ranks in Ray worker processes fetch their own part of an update from an HTTP store.

vLLM's Ray executor cannot run on this machine (vLLM's CPU build refuses Ray:
``current platform cpu does not support ray``; docs/SCALE.md), so this drives the
engine-agnostic part under real Ray: two rank processes started by Ray (as on two
nodes), each holding half of the rows of ``w`` behind a real ``RankUpdater``, reached
only through Ray calls that carry the ops, and a real ``Controller`` in this process.
The ranks get the engine_ext settings through Ray's runtime environment and reach the
store over HTTP by themselves; nothing but manifest keys and hashes crosses to them.
"""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from engine_ext.server.controller import Controller  # noqa: E402
from engine_ext.server.protocol import RankReply, UpdateRequest  # noqa: E402
from engine_ext.trainer.publisher import DeltaPublisher  # noqa: E402
from engine_ext.store.sources import Sources  # noqa: E402
from fake_ranks import NoEngineRanks  # noqa: E402

HERE = Path(__file__).resolve().parent


class RayRanks(NoEngineRanks):
    """:class:`engine_ext.server.transaction.Ranks` over Ray actors (pause and resume: no engine here)."""

    def __init__(self, actors):
        self.actors = actors

    async def call(self, op, **kw):
        refs = [a.op.remote(op, kw) for a in self.actors]
        return [RankReply.from_wire(w) for w in await asyncio.to_thread(ray.get, refs)]


def _states(steps: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(11)
    out = [{"w": torch.randn(256, 128, generator=g).to(torch.bfloat16), "b": torch.randn(64, generator=g).to(torch.bfloat16)}]
    for _ in range(steps):
        out.append({k: (t.float() + 0.02 * torch.randn(t.shape, generator=g) * (torch.rand(t.shape, generator=g) < 0.05))
                    .to(torch.bfloat16) for k, t in out[-1].items()})
    return out


def test_ray_ranks_fetch_their_rows_from_an_http_store(ray_cluster, http_server):
    from fake_ranks import RankActor

    states = _states()
    root = http_server.root / "ray_run"
    with DeltaPublisher(str(root), anchor_every=0, chunk_min_cell=512) as pub:
        for sd in states:
            pub.publish(sd)
    actor = ray.remote(num_cpus=0)(RankActor)
    ranks = [actor.remote(r, states[0]) for r in range(2)]
    assert all(w["ok"] for w in ray.get([a.op.remote("status", {}) for a in ranks]))
    assert ray.get(ranks[1].env.remote("ENGINE_EXT_TOKEN")) == os.environ["ENGINE_EXT_TOKEN"]  # the settings reached it
    ctl = Controller(RayRanks(ranks), Sources([f"{http_server.url}/ray_run"]), version=0)
    asyncio.run(ctl.start())
    a = asyncio.run(ctl.update(UpdateRequest.parse({"url": f"{http_server.url}/ray_run/v00000003.json"})))
    assert a["version"] == 3 and len(a["fetched_bytes"]) == 2
    assert max(a["fetched_bytes"]) <= 0.6 * a["payload_bytes"], (a["fetched_bytes"], a["payload_bytes"])
    for r, rank in enumerate(ranks):
        w = ray.get(rank.shard.remote("w"))
        assert torch.equal(w.view(torch.int16), states[3]["w"][r * 128:(r + 1) * 128].view(torch.int16))
        assert torch.equal(ray.get(rank.shard.remote("b")).view(torch.int16), states[3]["b"].view(torch.int16))
    assert ctl.status()["fingerprint"] == json.loads((root / "v00000003.json").read_text())["fingerprint"]
