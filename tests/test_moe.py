"""Mixture-of-experts models on a real vLLM CPU server, both checkpoint styles, TP 1 and TP 2,
expert widths the engine pads and ones it does not.

A tiny Qwen3-MoE (8 experts, top 2, router gate) saved per expert
(``mlp.experts.N.gate_proj.weight``) or fused (``mlp.experts.gate_up_proj`` [E, 2*I, H]),
and a Qwen2-MoE (per expert, plus a shared expert with its gate).
vLLM's CPU MoE pads each rank's expert width to its GEMM alignment and prepacks the experts
after loading; the plugin keeps the checkpoint-layout experts for the loader and our maps,
and pads and re-packs only the experts an update touched.
After K deltas the fingerprint and the greedy outputs with logprobs equal a server
cold-started on the final checkpoint; a corrupt delta and a delta for other weights
change nothing, and the latter names the tensors that differ.

The unit tests below check the two facts the re-pack relies on without a server: vLLM
packs each expert independently, and :class:`engine_ext.server.touched.Touched` names exactly
the experts an apply wrote; and that a layout derived after loading is named at start-up.
"""
from __future__ import annotations

import json

import pytest
import torch

from engine_ext.errors import UnsupportedError
from engine_ext.format import fingerprint as fpr
from engine_ext.format.delta import ABS, TensorDelta
from engine_ext.format.dtypes import BY_TORCH
from engine_ext.server.layout import probe_layout
from engine_ext.server.rank import RankUpdater
from engine_ext.server.touched import Touched

BF16 = BY_TORCH[torch.bfloat16]
E, N, K_DIM = 8, 16, 32


class Experts(torch.nn.Module):
    """A fused-experts parameter loaded from per-expert (``experts.N.weight``) or fused (``experts.weight``) tensors."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(E, N, K_DIM, dtype=torch.bfloat16), requires_grad=False)

    def load(self, name: str, t: torch.Tensor) -> None:
        if name == "experts.weight":
            self.w.data.copy_(t)
        else:
            self.w.data[int(name.split(".")[1])].copy_(t)


def _delta(name, shape, positions, values=None):
    pos = torch.tensor(positions, dtype=torch.int64)
    vals = torch.full((len(positions),), 0x3F80, dtype=torch.int16) if values is None else values
    return TensorDelta(name, BF16, tuple(shape), ABS, pos, vals)


def test_touched_names_the_experts_an_apply_wrote():
    m = Experts()
    per_expert = probe_layout(m, m.load, [(f"experts.{e}.weight", (N, K_DIM), BF16) for e in range(E)])
    fused = probe_layout(m, m.load, [("experts.weight", (E, N, K_DIM), BF16)])
    ptr, block = m.w.untyped_storage().data_ptr(), N * K_DIM
    t = Touched([_delta("experts.1.weight", (N, K_DIM), [0, 5]), _delta("experts.5.weight", (N, K_DIM), [511])], per_expert)
    assert ptr in t and t.blocks(ptr, block).tolist() == [1, 5]
    t = Touched([_delta("experts.weight", (E, N, K_DIM), [2 * block + 3, 3 * block, 3 * block + 7])], fused)
    assert t.blocks(ptr, block).tolist() == [2, 3]
    dense = TensorDelta("experts.4.weight", BF16, (N, K_DIM), ABS, None, torch.zeros(block, dtype=torch.int16))
    assert Touched([dense], per_expert).blocks(ptr, block).tolist() == [4]
    assert Touched([], per_expert).storages() == set()


def test_start_up_names_tensors_served_with_other_weights():
    """A layout the engine derives after loading (here: expert 3 is served reversed) is named at
    start-up instead of surfacing as a bare base mismatch at the first update."""
    torch.manual_seed(0)
    ckpt = {f"experts.{e}.weight": torch.randn(N, K_DIM).to(torch.bfloat16) for e in range(E)}
    m = Experts()
    for name, t in ckpt.items():
        m.load(name, t)
    m.w.data[3] = m.w.data[3].flip(0)  # derived copy: the maps do not follow it
    up = RankUpdater(m, m.load, {n: ((N, K_DIM), BF16) for n in ckpt}, read_checkpoint=ckpt.__getitem__)
    reply = up.setup()
    assert reply.mismatched == ("experts.3.weight",)
    assert {n: r.fingerprint for n, r in reply.fingerprints.items() if n != "experts.3.weight"} == {
        n: fpr.tensor_fingerprint(t) for n, t in ckpt.items() if n != "experts.3.weight"}


def test_vllm_packs_each_expert_independently():
    """The CPU MoE prepack of [E, N, K] is, expert by expert, the prepack of that expert alone
    (so re-packing only the touched experts gives the whole layer's packing)."""
    pytest.importorskip("vllm")
    from engine_ext.engines.vllm import compat

    torch.manual_seed(0)
    w = (0.02 * torch.randn(E, 64, 96)).to(torch.bfloat16)
    isa = compat.cpu_moe_experts_class().isa
    whole = compat.cpu_prepack_moe_weight(w, isa)
    assert not torch.equal(whole, w)  # it is a derived layout
    idx = torch.tensor([1, 6])
    assert torch.equal(compat.cpu_prepack_moe_weight(w[idx].contiguous(), isa), whole[idx])


# --------------------------------------------------------------------------- real servers

STEPS = 3


# (kind, TP, expert width): 64 wide experts split into 32 rows per rank, which vLLM's CPU grouped GEMM
# takes as they are; 96 wide ones into 48, which it zero-pads to 64 (the maps follow the checkpoint-layout
# experts the plugin keeps; the touched experts are padded and re-packed). qwen2-moe: a shared expert and its gate.
# qwen3-moe at TP 1 (64 wide) is a cell of the conformance matrix (tests/test_models.py), every call path.
# CI: fused experts at a width that pads (96) and Qwen2-MoE's shared expert; the other widths and
# layouts (a server each) run with `scripts/test.sh --full`
MOE_CASES = [pytest.param("qwen3-moe", 2, 64, marks=pytest.mark.full),
             pytest.param("qwen3-moe-fused", 2, 64, marks=pytest.mark.full),
             pytest.param("qwen3-moe", 2, 96, marks=pytest.mark.full),
             ("qwen3-moe-fused", 2, 96), ("qwen2-moe", 2, 96)]


@pytest.mark.vllm
@pytest.mark.parametrize("kind,tp,width", MOE_CASES)
def test_moe_updates_equal_a_cold_start(tmp_path, kind, tp, width):
    """One server: cold-started on the final checkpoint (the reference), taken back to v0 by the
    anchor (``rollback``), then through the deltas to the final version again."""
    pytest.importorskip("vllm")
    from vllm_helpers import Server, copy_store, make_model, rl_trajectory, save_state_dict

    model = make_model(tmp_path / "model", kind, moe_intermediate=width)
    root = tmp_path / "stores"
    final = rl_trajectory(model, root / "run", STEPS, seed=7, chunk_min_cell=256)
    rl_trajectory(model, root / "other", 2, seed=8)
    (root / "other" / "v00000000.anchor.json").unlink()
    corrupt = copy_store(root / "run", root / "corrupt")
    for blob in sorted(corrupt.glob("v00000002.*.bin")):
        b = bytearray(blob.read_bytes())
        b[len(b) // 2] ^= 0x40
        blob.write_bytes(bytes(b))
    manifest = json.loads((root / "run" / "v00000001.json").read_text())
    assert any(".experts." in t["name"] and t["nnz"] for t in manifest["tensors"])
    want_fp = json.loads((root / "run" / f"v{STEPS:08d}.json").read_text())["fingerprint"]
    with Server(save_state_dict(tmp_path / "final", final, model), sources=str(root), tp=tp,
                log=tmp_path / "server.log") as server:
        st = server.status()
        assert st["fingerprint"] == want_fp, st
        assert st["layout"]["fallback"] == [] and st["layout"]["mismatched"] == [], st["layout"]
        padded = (width // tp) % 32 != 0  # vLLM CPU's grouped GEMM aligns the per-rank width to 32
        for engine in st["layout"]["engine"]:
            assert engine["moe"]["layers"] > 0 and bool(engine["moe"]["padded"]) == padded, engine
        cold = server.outputs()  # a cold start on the final weights
        r = server.update({"url": str(root / "run" / "v00000000.anchor.json"), "rollback": True})
        assert r.status_code == 200 and r.json()["version"] == 0, r.text
        r = server.update({"url": str(root / "run" / "v00000001.json")})
        assert r.status_code == 200, r.text
        at_v1 = (server.status()["fingerprint"], server.outputs())
        assert at_v1[1] != cold
        r = server.update({"url": str(root / "corrupt" / "v00000002.json")})
        assert r.status_code == 422 and r.json()["reason"] == "integrity", r.text
        r = server.update({"url": str(root / "other" / "v00000002.json")})
        assert r.status_code == 409 and r.json()["reason"] == "base_mismatch", r.text
        assert "experts" in r.json()["error"]  # names the tensors that differ
        assert (server.status()["fingerprint"], server.outputs()) == at_v1  # nothing changed
        for n in range(2, STEPS + 1):
            r = server.update({"url": str(root / "run" / f"v{n:08d}.json")})
            assert r.status_code == 200, r.text
            assert r.json()["version"] == n and r.json()["fallback"] == []
        st = server.status()
        assert st["fingerprint"] == want_fp
        assert server.outputs() == cold


def test_vllm_cpu_refuses_layers_whose_method_derives_the_served_weights(monkeypatch):
    """vLLM's CPU fp8 methods VNNI-prepack weights into new parameters at load; with no refresh
    for them, the start-up refuses (naming the method) instead of writing where nothing is served."""
    from engine_ext.engines.vllm import compat, worker

    Fp8LinearMethod = type("Fp8LinearMethod", (), {})
    UnquantizedLinearMethod = type("UnquantizedLinearMethod", (), {})
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[0].quant_method, model[1].quant_method = UnquantizedLinearMethod(), Fp8LinearMethod()
    assert worker.derived_layers(model) == {"1": "Fp8LinearMethod"}
    monkeypatch.setattr(compat, "is_cpu", lambda: True)
    with pytest.raises(UnsupportedError, match=r"\['Fp8LinearMethod'\] derive the served weights"):
        worker.build_updater(model, vllm_config=None)


def test_a_checkpoint_tensor_the_engine_ignores_is_named():
    """SGLang 0.5.23's Qwen3-MoE loader silently skips fused experts (``mlp.experts.gate_up_proj``):
    no rank holds any element, and the start-up says so by name."""
    from engine_ext.errors import VerifyError
    from engine_ext.server.protocol import RankReply, TensorReport
    from engine_ext.server.transaction import combine_fingerprints

    replies = [RankReply(True, r, fingerprints={"m.experts.gate_up_proj": TensorReport(0, 0, 64)}) for r in range(2)]
    with pytest.raises(VerifyError, match="m.experts.gate_up_proj: the engine's loader writes none"):
        combine_fingerprints(replies)
