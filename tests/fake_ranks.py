"""Two in-process "ranks" for driving the controller without an engine.

Each rank is a plain torch module whose loader keeps half of the rows of the sharded
checkpoint tensors (tensor parallelism) and a full copy of the others; replies cross the
wire format, as in the engine adapters. Used by tests/test_transaction.py and
tests/test_hostile.py; the same code runs inside real vLLM and SGLang servers elsewhere.
"""
from __future__ import annotations

import asyncio

import torch

from engine_ext.format.dtypes import BY_TORCH
from engine_ext.server.protocol import RankReply
from engine_ext.server.rank import RankUpdater, run_op


class Rank(torch.nn.Module):
    """Holds rows [r*n/2, (r+1)*n/2) of every tensor named in ``sharded``, all of the others."""

    def __init__(self, r: int, sd: dict, sharded=("w",), world: int = 2):
        super().__init__()
        self.r, self.world, self.sharded = r, world, set(sharded)
        for name, t in sd.items():
            shape = (t.shape[0] // world, *t.shape[1:]) if name in self.sharded else tuple(t.shape)
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape, dtype=t.dtype), requires_grad=False))

    def load(self, name: str, t: torch.Tensor) -> None:
        p = getattr(self, name)
        with torch.no_grad():
            if name in self.sharded:
                rows = t.shape[0] // self.world
                p.copy_(t[self.r * rows:(self.r + 1) * rows])
            else:
                p.copy_(t)


def make_rank(r: int, sd: dict, sharded=("w",), world: int = 2) -> RankUpdater:
    m = Rank(r, sd, sharded, world)
    for n, t in sd.items():
        m.load(n, t)
    specs = {n: (tuple(t.shape), BY_TORCH[t.dtype]) for n, t in sd.items()}
    return RankUpdater(m, m.load, specs, rank=r)


class FakeRanks:
    """:class:`engine_ext.server.transaction.Ranks` over ranks in this process; records every call."""

    def __init__(self, ranks, fail_rank=None, pause_s=0.0):
        self.ranks, self.fail_rank, self.pause_s, self.calls = ranks, fail_rank, pause_s, []

    async def call(self, op, **kw):
        self.calls.append(op)
        out = []
        for up in self.ranks:
            if op == "apply" and up.rank == self.fail_rank:
                out.append(RankReply.failure(up.rank, RuntimeError("injected kernel failure")).to_wire())
                continue
            out.append(run_op(up, op, kw))
        return [RankReply.from_wire(w) for w in out]

    async def pause(self, mode):
        self.calls.append(f"pause:{mode}")
        await asyncio.sleep(self.pause_s)

    async def resume(self):
        self.calls.append("resume")

    async def after_update(self, version):
        self.calls.append(f"after:{version}")


def bits(ranks) -> list:
    """Every parameter of every rank, as raw bits (for "nothing changed" checks)."""
    return [[p.detach().view(torch.uint8).clone() for p in up.module.parameters()] for up in ranks]


def same_bits(a, b) -> bool:
    return all(torch.equal(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


class RankActor:
    """One rank in its own process (a Ray actor in tests/test_ray.py): builds its shard from the
    checkpoint ``sd`` and answers ops as the engine adapters do (``run_op``, wire format)."""

    def __init__(self, r: int, sd: dict, sharded=("w",), world: int = 2):
        self.updater = make_rank(r, sd, sharded, world)

    def op(self, name: str, kwargs: dict) -> dict:
        return run_op(self.updater, name, kwargs)

    def shard(self, name: str) -> torch.Tensor:
        return getattr(self.updater.module, name).detach().clone()

    def env(self, name: str) -> str | None:
        import os

        return os.environ.get(name)
