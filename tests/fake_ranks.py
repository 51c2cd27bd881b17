"""Two in-process "ranks" for driving the controller without an engine.

Each rank is a plain torch module whose loader keeps half of the rows of the sharded
checkpoint tensors (tensor parallelism) and a full copy of the others; replies cross the
wire format, as in the engine adapters. Used by tests/test_transaction.py,
tests/test_hostile.py and others; the same code runs inside real vLLM and SGLang servers elsewhere.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from engine_ext.format.dtypes import BY_TORCH
from engine_ext.trainer.publisher import DeltaPublisher
from engine_ext.server.protocol import RankReply
from engine_ext.server.rank import RankUpdater, run_op


class Rank(torch.nn.Module):
    """Holds share r of ``world`` of every tensor named in ``sharded`` (rows, or columns for the
    names in ``by_column``), all of the others. Names in ``padded`` are split as vLLM splits a
    vocabulary: rows padded to a multiple of 64 first, so the last shares hold fewer real rows
    (their parameter keeps the padding rows, never loaded). Names in ``absent`` it does not hold at
    all (another expert-parallel rank's experts): no parameter, its loader skips them."""

    def __init__(self, r: int, sd: dict, sharded=("w",), world: int = 2, by_column=(), padded=(), absent=()):
        super().__init__()
        self.r, self.world, self.sharded = r, world, set(sharded)
        self.by_column, self.padded, self.absent = set(by_column), set(padded), set(absent)
        self.names = {}
        for i, (name, t) in enumerate(sd.items()):
            if name in self.absent:
                continue
            shape = list(t.shape)
            if name in self.sharded:
                axis = 1 if name in self.by_column else 0
                n = -(-shape[0] // 64) * 64 if name in self.padded else shape[axis]
                shape[axis] = n // world
            self.names[name] = name if "." not in name else f"p{i}"  # a parameter's name holds no dots
            self.register_parameter(self.names[name], torch.nn.Parameter(torch.zeros(shape, dtype=t.dtype), requires_grad=False))

    def load(self, name: str, t: torch.Tensor) -> None:
        if name in self.absent:
            return
        p = getattr(self, self.names[name])
        with torch.no_grad():
            if name not in self.sharded:
                p.copy_(t)
            elif name in self.by_column:
                cols = t.shape[1] // self.world
                p.copy_(t[:, self.r * cols:(self.r + 1) * cols])
            else:
                rows = p.shape[0]
                mine = t[self.r * rows:(self.r + 1) * rows]
                p[:mine.shape[0]].copy_(mine)

    def param(self, name: str) -> torch.Tensor:
        return getattr(self, self.names[name])


def make_rank(r: int, sd: dict, sharded=("w",), world: int = 2, by_column=(), padded=(), absent=()) -> RankUpdater:
    m = Rank(r, sd, sharded, world, by_column, padded, absent)
    for n, t in sd.items():
        m.load(n, t)
    specs = {n: (tuple(t.shape), BY_TORCH[t.dtype]) for n, t in sd.items()}
    return RankUpdater(m, m.load, specs, rank=r)


class NoEngineRanks:
    """:class:`engine_ext.server.transaction.Ranks` with no engine behind the ranks: no generation to pause
    or resume, no cache to drop after an update. Subclasses answer :meth:`call`."""

    async def call(self, op, **kw) -> list[RankReply]:
        raise NotImplementedError

    async def pause(self, mode):
        pass

    async def resume(self):
        pass

    async def after_update(self, version):
        pass


def publish_run(root: Path, steps: int = 3) -> list[dict]:
    """Publish a small run to the store at ``root``: v0 (an anchor) of an 8x16 ``w`` and a 16-long ``b``
    (bf16), then ``steps`` versions that each move every element a little. Returns every version's state."""
    g = torch.Generator().manual_seed(0)
    versions = [{"w": torch.randn(8, 16, generator=g).to(torch.bfloat16), "b": torch.randn(16, generator=g).to(torch.bfloat16)}]
    with DeltaPublisher(str(root), anchor_every=0) as pub:
        pub.publish(versions[0])
        for _ in range(steps):
            versions.append({n: (t.float() + 0.02 * torch.randn(t.shape, generator=g)).to(torch.bfloat16)
                             for n, t in versions[-1].items()})
            pub.publish(versions[-1])
    return versions


class FakeRanks:
    """:class:`engine_ext.server.transaction.Ranks` over ranks in this process; records every call."""

    def __init__(self, ranks, fail_rank=None, pause_s=0.0):
        self.ranks, self.fail_rank, self.pause_s, self.calls = ranks, fail_rank, pause_s, []
        self.gate = None  # a threading.Event: a pause holds until it is set (a condition, where pause_s is a time)

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
        if self.gate is not None:
            await asyncio.to_thread(self.gate.wait, 120)

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
