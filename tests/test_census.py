"""The post-processing census (engine_ext/server/census.py; vLLM's claims: engine_ext/engines/vllm/census.py)
on plain torch modules, no server.

The census follows what post-processing computes from the loaded weights (a provenance tracker over
torch's ops, Triton launches and bytes that leave torch) and what it re-lays. A copy computed from a
checkpoint tensor that no patch refreshes is found without knowing the model, and exactly the checkpoint
tensors it was computed from are refused (409 ``unreproducible``), named at start-up. A copy a patch
refreshes, a parameter the maps write themselves, and state computed from no checkpoint tensor (a KV-cache
scale, a workspace, a rotary cache: even in a module whose children hold checkpoint weights) refuse
nothing. The real models' census runs in every vLLM server of the suite (tests/test_models.py asserts it
names nothing on the architectures we serve); vLLM's own post-processing ops, with each of our patches
reverted, are tests/test_derived_copies.py's.
"""
from __future__ import annotations

import asyncio
import json

import numpy as np
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


class Attention(torch.nn.Module):
    """vLLM's attention layer, in small: a child projection holding a checkpoint weight, a KV-cache scale
    buffer (no checkpoint tensor feeds it), and a post-processing step of its own, as vLLM's
    ``Attention.process_weights_after_loading`` is."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Module()
        self.qkv.weight = _param(4, 8, seed=5)
        self.register_buffer("_k_scale", torch.ones(1))
        self.k_scale = torch.nn.Parameter(-torch.ones(1), requires_grad=False)  # not in the checkpoint

    def process_weights_after_loading(self):
        self._k_scale_cpu = self._k_scale.detach().clone()  # a scale kept on the host: computed from no weight
        self._k_scale_float = 1.0 if self.k_scale < 0 else float(self.k_scale)  # a branch on a non-checkpoint scale
        self.workspace = torch.empty(16, 8)  # a workspace: no bytes of any weight


class Toy(torch.nn.Module):
    """``proj``: post-processing keeps a transposed copy for its kernel (what a GEMM prepack does), refreshed
    by nobody. ``packed``: a copy a patch claims (the CPU GEMM's ``cpu_linear`` closure). ``rope``: a cache
    made at post-processing in a module without checkpoint weights. ``norm``: nothing derived. ``attn``:
    state computed from no checkpoint tensor in a module whose child holds one. ``quant``: a copy made
    through numpy (bytes that left torch). ``mixer``/``conv``: Granite 4's mamba mixer keeps a view of its
    conv weight, and post-processing re-lays the conv weight (packs it) while the loader's writes go to a
    stash: the view is left reading what the loader wrote at start-up."""

    NAMES = ("proj", "packed", "norm", "quant", "conv", "attn.qkv")

    def __init__(self, fixed_conv: bool = False):
        super().__init__()
        for name, seed in (("proj", 1), ("packed", 2), ("norm", 3), ("quant", 4)):
            setattr(self, name, torch.nn.Module())
            getattr(self, name).weight = _param(4, 8, seed=seed)
        self.rope = torch.nn.Module()
        self.attn = Attention()
        self.mixer = torch.nn.Module()
        self.conv = torch.nn.Module()
        self.conv.weight = _param(4, 1, 8, seed=6)
        self.mixer.register_buffer("conv_weights", self.conv.weight.view(4, 8), persistent=False)
        self.fixed_conv = fixed_conv

    def target(self, name: str) -> torch.Tensor:
        mod = self.get_submodule(name)
        kept = getattr(mod, "kept", None)
        return mod.weight if kept is None else kept

    def load(self, name, t):
        target = self.target(name.removesuffix(".weight"))
        target.data.copy_(t.view(target.shape))

    def post_process(self):
        self.proj.w_t = self.proj.weight.data.t().contiguous()  # derived, unclaimed
        packed = self.packed.weight.data.clone()
        self.packed.cpu_linear = lambda x: x @ packed.t()  # derived, claimed by the keep-weights patch
        self.packed._engine_ext_packed = True
        self.rope.cos_sin = torch.randn(16, 8)  # derived from no weight
        self.attn.process_weights_after_loading()
        self.quant.w_np = torch.from_numpy(self.quant.weight.float().numpy() * 2)  # through numpy: out of torch's sight
        original = self.conv.weight.data
        stash = original.view(4, 8).clone()
        self.conv.weight.data = stash.flip(1).contiguous().view(4, 1, 8)  # "packed": what the kernel reads
        # where the loader writes from now on: a stash (the bug) or the original storage (the fix)
        self.conv.kept = torch.nn.Parameter(original if self.fixed_conv else stash.view(4, 1, 8), requires_grad=False)


def _toy(**kw):
    model = Toy(**kw)
    census.take(model, model.post_process)
    specs = [(f"{n}.weight", tuple(model.get_submodule(n).weight.shape), "bfloat16") for n in Toy.NAMES]
    return model, probe_layout(model, model.load, specs)


def test_the_census_names_exactly_the_unclaimed_copies_of_checkpoint_weights():
    model, maps = _toy()
    derived = model.__dict__["_engine_ext_census"].derived  # computed from parameters or buffers
    assert set(derived) == {"proj", "packed", "quant", "mixer", "conv", "attn"}  # not rope: computed from nothing
    # conv: the packed weight, and the stash the loader writes (a copy of another parameter's loaded storage)
    assert census.unclaimed(model, maps, claimed) == {"conv": ["kept", "weight"], "mixer": ["conv_weights"],
                                                      "proj": ["w_t"], "quant": ["w_np"]}
    assert "cpu_linear.<packed>" in census.unclaimed(model, maps)["packed"]  # the patch's claim is what spares it
    found = census.unreproducible(model, maps, claimed)
    assert sorted(found) == ["conv.weight", "proj.weight", "quant.weight"]
    assert "'w_t'" in found["proj.weight"] and "'w_np'" in found["quant.weight"]
    assert "attn.qkv.weight" not in found  # the scale, the workspace and the host copy refuse nothing
    assert census.unclaimed(Toy(), maps) is None  # no census taken: nothing claimed, a warning at start-up


def test_a_relaid_weight_whose_loader_writes_where_the_kernels_read_refuses_nothing():
    """The fix for the mixer's view (engine_ext/engines/vllm/patches.keep_conv_weight): the loader writes the
    storage the view reads, the packed copy is the patch's to refresh; what is left is the transposed copy
    and the numpy copy, refused as before."""
    model, maps = _toy(fixed_conv=True)
    model.conv._engine_ext_conv = model.conv.kept  # as the patch marks the layer: its packed weight is claimed
    found = census.unreproducible(model, maps, claimed)
    assert sorted(found) == ["proj.weight", "quant.weight"]


def test_escapes_belong_to_the_step_that_made_them():
    """Bytes of a weight that leave torch in one module's post-processing step (``numpy()`` here) taint what
    that module makes afterwards, not what another module's step makes: a rotary cache in the next step
    stays independent of the weights."""

    class Quantized(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = _param(4, 8, seed=7)

        def process_weights_after_loading(self):
            self.scale = float(np.abs(self.weight.float().numpy()).max())  # a number: out of torch's sight
            self.w_q = torch.tensor(np.round(self.weight.float().numpy() / self.scale))

    class Rotary(torch.nn.Module):
        def process_weights_after_loading(self):
            self.cos_sin = torch.cos(torch.arange(16.0))

    model = torch.nn.Module()
    model.q, model.rope = Quantized(), Rotary()

    def process():
        for m in (model.q, model.rope):
            m.process_weights_after_loading()

    census.take(model, process)
    maps = probe_layout(model, lambda n, t: model.q.weight.data.copy_(t), [("q.weight", (4, 8), "bfloat16")])
    assert census.unclaimed(model, maps) == {"q": ["scale", "w_q"]}
    assert list(census.unreproducible(model, maps)) == ["q.weight"]


def test_an_update_reaching_an_unclaimed_copy_is_refused_and_changes_nothing(tmp_path):
    model, _ = _toy()
    sd = {f"{n}.weight": model.target(n).data.clone() for n in Toy.NAMES}
    with DeltaPublisher(str(tmp_path / "store"), anchor_every=0) as pub:
        pub.publish(sd)
        pub.publish({n: (t.float() * 1.01).to(torch.bfloat16) for n, t in sd.items()})
    specs = {n: (tuple(t.shape), BY_TORCH[t.dtype]) for n, t in sd.items()}
    up = RankUpdater(model, model.load, specs, read_checkpoint=sd.__getitem__,
                     find_unreproducible=lambda maps: census.unreproducible(model, maps, claimed))
    ctl = Controller(FakeRanks([up]), Sources([str(tmp_path / "store")]), version=0)
    asyncio.run(ctl.start())
    assert list(ctl.status()["layout"]["unreproducible"]) == ["conv.weight", "proj.weight", "quant.weight"]
    before = bits([up])
    with pytest.raises(UnreproducibleError, match="proj.weight") as e:
        asyncio.run(ctl.update(UpdateRequest(url=str(tmp_path / "store" / "v00000001.json"))))
    assert e.value.http_status == 409 and "conv holds 'kept', computed from it" in str(e.value)
    assert same_bits(before, bits([up])) and ctl.status()["version"] == 0
    assert json.dumps(ctl.status()["layout"]["unreproducible"])  # plain data for the status answer
