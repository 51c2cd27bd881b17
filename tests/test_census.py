"""The post-processing census (engine_ext/server/census.py; vLLM's claims: engine_ext/engines/vllm/census.py)
on plain torch modules, no server.

A module kind whose post-processing derives a copy that no patch refreshes is found without knowing
the model, and the checkpoint tensors that reach it are refused (409 ``unreproducible``), named at
start-up; a copy a patch refreshes, a copy in a module holding no checkpoint weight, and a parameter the
maps write themselves are not counted. The real models' census runs in every vLLM server of the suite
(tests/test_models.py asserts it names nothing on the architectures we serve).
"""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

from engine_ext.engines.vllm.census import claimed
from engine_ext.server import census
from engine_ext.errors import UnreproducibleError
from engine_ext.format.dtypes import BY_TORCH
from engine_ext.server.controller import Controller
from engine_ext.server.layout import probe_layout
from engine_ext.server.protocol import UpdateRequest
from engine_ext.server.rank import RankUpdater
from engine_ext.store.sources import Sources
from engine_ext.trainer.publisher import DeltaPublisher
from fake_ranks import FakeRanks, bits, same_bits


def _param(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(*shape, generator=g).to(torch.bfloat16), requires_grad=False)


class Toy(torch.nn.Module):
    """``proj``: post-processing keeps a transposed copy for its kernel (what a GEMM prepack does), refreshed
    by nobody. ``packed``: a copy a patch claims (the CPU GEMM's ``cpu_linear`` closure). ``rope``: a cache
    made at post-processing in a module without checkpoint weights. ``norm``: nothing derived."""

    def __init__(self):
        super().__init__()
        for name, seed in (("proj", 1), ("packed", 2), ("norm", 3)):
            setattr(self, name, torch.nn.Module())
            getattr(self, name).weight = _param(4, 8, seed=seed)
        self.rope = torch.nn.Module()

    def load(self, name, t):
        getattr(self, name.split(".")[0]).weight.data.copy_(t)

    def post_process(self):
        self.proj.w_t = self.proj.weight.data.t().contiguous()  # derived, unclaimed
        packed = self.packed.weight.data.clone()
        self.packed.cpu_linear = lambda x: x @ packed.t()  # derived, claimed by the keep-weights patch
        self.packed._engine_ext_packed = True
        self.rope.cos_sin = torch.randn(16, 8)  # derived from no weight


def _toy():
    model = Toy()
    census.take(model, model.post_process)
    specs = [(f"{n}.weight", (4, 8), "bfloat16") for n in ("proj", "packed", "norm")]
    return model, probe_layout(model, model.load, specs)


def test_the_census_names_exactly_the_unclaimed_copy_that_reaches_checkpoint_weights():
    model, maps = _toy()
    assert set(model.__dict__["_engine_ext_census"].derived) == {"proj", "packed", "rope"}
    assert census.unclaimed(model, maps, claimed) == {"proj": ["w_t"], "rope": ["cos_sin"]}
    assert census.unclaimed(model, maps) == {"proj": ["w_t"], "packed": ["cpu_linear.<packed>"], "rope": ["cos_sin"]}
    found = census.unreproducible(model, maps, claimed)
    assert list(found) == ["proj.weight"] and "'w_t'" in found["proj.weight"]
    assert census.unclaimed(Toy(), maps) is None  # no census taken: nothing claimed, a warning at start-up


def test_an_update_reaching_an_unclaimed_copy_is_refused_and_changes_nothing(tmp_path):
    model, _ = _toy()
    sd = {n: getattr(model, n.split(".")[0]).weight.data.clone() for n in ("proj.weight", "packed.weight", "norm.weight")}
    with DeltaPublisher(str(tmp_path / "store"), anchor_every=0) as pub:
        pub.publish(sd)
        pub.publish({n: (t.float() * 1.01).to(torch.bfloat16) for n, t in sd.items()})
    specs = {n: (tuple(t.shape), BY_TORCH[t.dtype]) for n, t in sd.items()}
    up = RankUpdater(model, model.load, specs, read_checkpoint=sd.__getitem__,
                     find_unreproducible=lambda maps: census.unreproducible(model, maps, claimed))
    ctl = Controller(FakeRanks([up]), Sources([str(tmp_path / "store")]), version=0)
    asyncio.run(ctl.start())
    assert list(ctl.status()["layout"]["unreproducible"]) == ["proj.weight"]
    before = bits([up])
    with pytest.raises(UnreproducibleError, match="proj.weight") as e:
        asyncio.run(ctl.update(UpdateRequest(url=str(tmp_path / "store" / "v00000001.json"))))
    assert e.value.http_status == 409 and "w_t" in str(e.value)
    assert same_bits(before, bits([up])) and ctl.status()["version"] == 0
    assert json.dumps(ctl.status()["layout"]["unreproducible"])  # plain data for the status answer
