"""The conformance matrix on vLLM CPU: real transformers architectures, every trainer call path, in place.

Each case is one architecture, served by one real vLLM CPU server with the plugin (module-scoped,
shared by the case's cells). The server starts cold on the trajectory's last version, in the
Hub's layout (``save_pretrained``, what users serve): its outputs and fingerprint are the cold
start reference. Then, for each call path (tests/model_matrix.py: ``publish(model)``,
``publish(model.state_dict())``, TRL's ``named_parameters()`` iterator, and ``save_pretrained``
checkpoints through the CLI), the server is taken back to that path's v0 anchor
(``"rollback": true``) and forward through its two deltas: the served fingerprint must be the
trainer's and the greedy outputs (tokens, logprobs, top-k) those of the cold start, bit for bit.
No second server is started for the reference.

Where transformers 5 holds a model's weights under other names than its Hub checkpoint (fused
MoE experts, a VLM's ``model.language_model.`` prefix), every trainer path publishes the Hub's
layout (engine_ext/trainer/checkpoint_layout.py), so every cell serves. Every architecture
listed serves on vLLM CPU. docs/MODELS.md is the table of all of it; the quick tier's part (no
server) is at the end.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import model_matrix as mm

STUBS = Path(__file__).resolve().parent / "sglang_stubs"
HOOKS = Path(__file__).resolve().parent / "server_hooks"


def _amx_host() -> bool:
    try:
        import torch

        return bool(torch.cpu._is_amx_tile_supported())
    except (ImportError, AttributeError):
        return False


@dataclass(frozen=True)
class Case:
    kind: str
    tp: int = 1
    tied_copy: bool = False  # the Hub checkpoint also stores the tied lm_head.weight
    dtypes: tuple[str, ...] = ("fp32",)  # trainer dtypes of the trainer paths
    env: tuple[tuple[str, str], ...] = ()  # extra server environment (the VLM's torchvision stub)
    ci: bool = False  # CI serves one case per distinct server-side path; the rest run with `--full` (below)
    hide_amx: bool = False  # served as on an AVX-512 host without AMX (tests/server_hooks: ENGINE_EXT_TEST_HIDE_AMX)
    fallback: tuple[str, ...] = ()  # tensors the engine computes at load on every path: reloaded through its loader

    @property
    def id(self) -> str:
        return f"{self.kind}-tp{self.tp}" + ("-tiedcopy" if self.tied_copy else "") + ("-noamx" if self.hide_amx else "")

    def server_env(self) -> dict:
        env = {"ENGINE_EXT_COLD_AUDIT": "1", **dict(self.env)}  # the cold-load audit: the test's reference
        if self.hide_amx:
            env["ENGINE_EXT_TEST_HIDE_AMX"] = "1"
            env["PYTHONPATH"] = os.pathsep.join(p for p in [str(HOOKS), env.get("PYTHONPATH")] if p)
        return env

    def stores(self) -> list[str]:
        return [f"{p}/{d}" for d in self.dtypes for p in mm.TRAINER_PATHS] + ["checkpoint/fp32"]


CASES = [
    Case("qwen2-tied", tied_copy=True, dtypes=("fp32", "bf16"), ci=True),
    Case("qwen2-tied", tp=2),
    Case("qwen2"),
    Case("qwen3"),
    Case("llama-tied"),
    Case("mistral"),
    Case("gemma2"),
    Case("phi3"),
    Case("qwen3-moe"),
    Case("qwen2-moe"),
    # GPT-OSS: MoE experts with biases (loaded transposed, then made contiguous), attention sinks, sliding and
    # full layers; Qwen3-Next: hybrid Gated DeltaNet (a causal-conv1d weight vLLM packs on AVX-512 BF16 hosts)
    # and full attention, MoE with a shared expert. Built from each class's own defaults (tiny_models.tiny_config)
    Case("gpt-oss", ci=True),
    Case("qwen3-next", ci=True),
    Case("deepseek-v2", ci=True),
    # MLA's other CPU path: AMX hosts serve it through AMXMLAImpl (packed W_UK/W_UV, refreshed), other hosts
    # through CPUMLAImpl (views of kv_b_proj): on an AMX host this case takes the other hosts' path (elsewhere it
    # is the case above, and is skipped)
    Case("deepseek-v2", hide_amx=True, ci=True),
    # Granite 4: mamba2 and attention layers (the Hub's config shape, tiny_models.HUB_SHAPES), MoE with a shared
    # MLP, tied embeddings. Its mixer reads a view of the conv1d weight vLLM packs on AVX-512 BF16 hosts;
    # A = -exp(A_log) is computed at load, so A_log is reloaded through vLLM's loader at every version
    Case("granite-4-hybrid", ci=True, fallback=("model.layers.0.mamba.A_log",)),
    Case("granite-4-hybrid", hide_amx=True, fallback=("model.layers.0.mamba.A_log",)),
    # vLLM builds Qwen2.5-VL's HF processor at start, whose video processor needs torchvision; the CUDA
    # wheel cannot load beside the CPU torch, so the server gets the test-only stub (tests/sglang_stubs):
    # text prompts never call it
    Case("qwen2.5-vl", ci=True,
         env=(("PYTHONPATH", os.pathsep.join(p for p in [str(STUBS), os.environ.get("PYTHONPATH")] if p)),)),
]
# CI (2 cores, 20 minutes) serves five cases, one per distinct post-processing path: the README's tied
# model (every trainer path, fp32 and bf16 masters, the Hub's tied copy), DeepSeek-V2 (MLA, vLLM's packed
# projections), GPT-OSS (MoE experts with biases), Qwen3-Next (hybrid linear attention, packed conv1d) and
# Qwen2.5-VL (a VLM's name prefix). The trainer side of every case is engine-independent and runs in CI against
# SGLang (tests/test_sglang_models.py, all cases); tied embeddings at TP 2 are tests/test_vllm_tp2.py's,
# MoE at TP 2 tests/test_moe.py's. The other cases (a server each, ~40 s) are `full`: `scripts/test.sh --full`.
AMX = _amx_host()
CELLS = [pytest.param(c, s, id=f"{c.id}-{s.replace('/', '-')}", marks=(
    pytest.mark.skip(reason="no AMX on this host: the case without hide_amx takes this path") if c.hide_amx and not AMX
    else () if c.ci else pytest.mark.full)) for c in CASES for s in c.stores()]
TIMES: dict[str, float] = {}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """``servers(case)``: the case's trajectory and its server, started cold on the last version (the
    reference). One server at a time, started when a case's first cell asks and stopped when the
    next case's does (cells are in case order), so each case starts exactly one server."""
    pytest.importorskip("vllm")
    from vllm_helpers import Server

    current = {"case": None, "world": None, "error": None, "t0": 0.0}

    def stop():
        if current["world"] is not None:
            current["world"]["server"].stop()
        if current["case"] is not None:  # shown with -s: the matrix's cost per case (docs/MODELS.md)
            TIMES[current["case"].id] = time.perf_counter() - current["t0"]
            print(f"\n[matrix] {current['case'].id}: {TIMES[current['case'].id]:.1f} s (trajectory, server, every path)")
        current.update(case=None, world=None, error=None)

    def get(case: Case) -> dict:
        if current["case"] != case:
            stop()
            current.update(case=case, t0=time.perf_counter())
            root = tmp_path_factory.mktemp(case.id)
            try:
                traj = mm.trajectory(case.kind, root, dtypes=case.dtypes, tied_copy=case.tied_copy)
                server = Server(traj.final, sources=str(root), tp=case.tp, env=case.server_env(), log=root / "server.log",
                                fallback=case.fallback)
                current["world"] = {"case": case, "traj": traj, "server": server}
                current["world"].update(cold=server.outputs(), status=server.status())
            except BaseException as e:  # every cell of the case reports it (the server is not started again)
                current["error"] = e
        if current["error"] is not None:
            raise current["error"]
        return current["world"]

    yield get
    stop()


def _update(server, url, **kw):
    r = server.update({"url": url, **kw})
    return r.status_code, r.json()


@pytest.mark.vllm
def test_the_readme_trainer_example_on_fp32_weights(servers):
    """The README's trainer side, as written, on a tied Qwen2 loaded with ``from_pretrained`` in
    float32 (a trainer's master weights) and trained by AdamW: every version lands on the server
    (pushed with ``Fleet``), which then serves the trainer's weights in bf16, bit for bit. First
    on its server, which still holds the checkpoint it started from (no version yet)."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine_ext import DeltaPublisher, Fleet
    from engine_ext.format import fingerprint as fpr

    served = servers(CASES[0])
    server = served["server"]
    assert server.status()["version"] is None, "runs first on its server (the README's anchor is v0)"
    model = AutoModelForCausalLM.from_pretrained(str(served["traj"].final), dtype=torch.float32)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.tensor([[5, 17, 99, 3, 250, 7, 8, 9]])

    def train_step(model):
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()

    fleet = Fleet([server.url], server.token)
    store = served["traj"].final.parent / "readme-store"  # under the server's ENGINE_EXT_SOURCES
    pub = DeltaPublisher(str(store), model="tiny-qwen2-tied", anchor_every=50,
                         signing_key=os.environ["ENGINE_EXT_SIGNING_KEY"])
    try:
        for step in range(3):
            train_step(model)
            uri = pub.publish(model)  # diffs on the model's device, encodes + uploads in the background
            pub.wait()
            result = fleet.update(uri)
            assert result.ok, [r.error for r in result.replicas]
        pub.wait()
    finally:
        pub.close()
    served_fp = fpr.fmt(fpr.model_fingerprint({n: fpr.tensor_fingerprint(p.detach().to(torch.bfloat16))
                                               for n, p in model.named_parameters()}))
    st = server.status()
    assert st["version"] == 2 and st["fingerprint"] == served_fp == fpr.fmt(pub.fingerprint)


@pytest.mark.vllm
@pytest.mark.parametrize("case,store", CELLS)
def test_versions_through_each_path_equal_a_cold_start(servers, case, store):
    served = servers(case)
    traj, server = served["traj"], served["server"]
    cold_fp = served["status"]["fingerprint"]
    layout = served["status"]["layout"]
    # every tensor in place, none re-laid behind the maps, no derived copy that no refresh keeps in step
    fallback = sorted(case.fallback)
    assert layout["fallback"] == fallback and layout["mismatched"] == [] and layout["unreproducible"] == {}, layout
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if case.tied_copy else {}
    assert layout["tied"] == tied, layout
    assert traj.fingerprints[store] == cold_fp  # the trainer's last version is what the cold server holds
    code, body = _update(server, traj.url(store, 0), rollback=True)
    assert code == 200 and body["version"] == 0 and sorted(body["fallback"]) == fallback, body
    # The copies the kernels read (packed GEMM weights, MLA's W_UK/W_UV, packed experts) must follow the
    # weights: at the end of the chain a stale copy would equal the cold start's again, so check here.
    audit = server.status(audit=True)["audit"]
    assert audit["ok"] and audit["derived"]["stale"] == [], audit
    if "at_v0" not in served:  # once per server: the served computation reads the weights the updates write
        served["at_v0"] = server.outputs()
        assert served["at_v0"] != served["cold"]
        # Every tensor each module holds equals a cold load's of v0 (engines/vllm/cold_audit.py): state the
        # updates never reach (Granite 4's view of its packed conv1d weight) still holds the start-up's last
        # version here, where the outputs alone would not show it at the end of the chain.
        cold = server.status(cold=traj.first)["cold_audit"]
        assert cold["ok"] and cold["compared"] > 0, cold
    for v in range(1, mm.VERSIONS):
        code, body = _update(server, traj.url(store, v))
        assert code == 200 and body["version"] == v and sorted(body["fallback"]) == fallback, body
        assert body["tensors"] > 0 and body["elements"] > 0
    assert server.status()["fingerprint"] == cold_fp
    assert server.outputs() == served["cold"]
    final = server.status(audit=True, cold=traj.final)
    assert final["audit"]["ok"] and final["cold_audit"]["ok"], final["cold_audit"]
    changed = mm.delta_names(traj, store)
    assert traj.frozen == () or all(changed[n] == 0 for n in traj.frozen if n in changed)  # a frozen tower: no deltas


# --------------------------------------------------------------------------- quick tier (no server)


@pytest.mark.parametrize("kind,differ", [
    ("qwen3-moe", ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]),
    ("qwen2.5-vl", ["model.visual.patch_embed.proj.weight", "model.language_model.embed_tokens.weight"]),
])
def test_the_names_a_trainer_holds_against_a_hub_checkpoint(tmp_path, kind, differ):
    """transformers 5 holds MoE experts fused and a VLM's text model under ``model.language_model.``,
    while ``save_pretrained`` (the Hub's layout) writes per-expert tensors and ``model.``: every trainer
    path publishes the Hub's layout (``publish(model)`` by itself, a state dict and TRL's iterator
    with ``checkpoint_layout=model``), the same versions as the saved checkpoints (the CLI path),
    which a server of the Hub checkpoint takes. Published as held (``checkpoint_layout=None``), the
    trainer's own names are refused by name (model_mismatch, before anything is read)."""
    from engine_ext.errors import ModelMismatchError
    from engine_ext.store import open_store, reader
    from engine_ext.store.checkpoint import CheckpointDir
    from engine_ext.tiny_models import build
    from engine_ext.trainer.publisher import DeltaPublisher

    traj = mm.trajectory(kind, tmp_path, dtypes=("fp32",))  # asserts every path published the same versions
    served = {n: (list(s), d.name) for n, (s, d) in CheckpointDir(traj.final).specs().items()}
    for store in traj.stores:
        reader.check_expected(reader.read_manifest(open_store(str(traj.stores[store])), "v00000000.anchor.json"),
                              served, store)
    model = build(kind, vocab=mm.VOCAB)
    assert set(differ) <= set(model.state_dict())  # what the trainer holds in memory
    with DeltaPublisher(str(tmp_path / "as-held"), anchor_every=0, checkpoint_layout=None) as pub:
        pub.publish(model)
    m = reader.read_manifest(open_store(str(tmp_path / "as-held")), "v00000000.anchor.json")
    with pytest.raises(ModelMismatchError) as e:
        reader.check_expected(m, served, "as-held")
    assert f"not in the served model: ['{differ[0]}'" in str(e.value) and e.value.http_status == 409, str(e.value)
    assert set(differ) <= {t.name for t in m.tensors} and not set(differ) & set(served)
