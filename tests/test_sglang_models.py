"""The conformance matrix on SGLang 0.5.23 (CPU): the architectures of tests/test_models.py, loaded by
SGLang's own ``get_model`` (its model classes and loaders), updated through the SGLang adapter's
rank handler (:class:`~engine_ext.engines.sglang.rank.RankAgent`) and the controller.

One worker process (TP 1) takes every case in turn: it loads the trajectory's last version cold
(the Hub's layout, as served) and keeps its parameters' bits as the reference, then for each call
path of tests/model_matrix.py takes the model back to that path's v0 anchor (``rollback``) and
forward through its two deltas: every parameter must equal the cold load bit for bit, in place,
with the trainer's fingerprint (every trainer path publishes the Hub's layout, MoE and VLM too); an
architecture SGLang cannot load on the CPU records SGLang's error.
What stands in: the scheduler and TokenizerManager processes (as in tests/test_sglang_tp.py);
generation is not run, the parameters are compared instead. docs/MODELS.md has the table.

Run with the SGLang virtualenv's python (.ci/setup-sglang.sh).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.engine]
if __name__ != "__main__":
    pytest.importorskip("sglang", reason="needs the SGLang virtualenv (.ci/setup-sglang.sh)")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STUBS = HERE / "sglang_stubs"
sys.path.insert(0, str(HERE))

# Tensors whose SGLang loader computes what it stores are reloaded whole through it (the dense
# fallback, still bit-exact): FALLBACK says which, per kind; every other tensor is written in place.
# SGLang's DeepSeek loader (deepseek_common/deepseek_weight_loader.py) calls the weight loaders in a
# ThreadPoolExecutor: the layout probe runs its tasks in the probing thread (engine_ext/server/layout.py).
TRAINER_PATHS = ("module", "state_dict", "trl_iterator")
CASES = ("qwen2-tied", "qwen3", "llama-tied", "mistral", "gemma2", "phi3", "qwen3-moe", "qwen2-moe", "deepseek-v2",
         "qwen2.5-vl")
STORES = [f"{p}/fp32" for p in TRAINER_PATHS] + ["checkpoint/fp32"]
FALLBACK = {"gemma2": r"norm\.weight$"}  # SGLang 0.5.23's GemmaRMSNorm loads 1 + w (vLLM adds the 1 in forward)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case's trajectory (built here), then one worker process over all of them."""
    import model_matrix as mm

    tmp = tmp_path_factory.mktemp("sglang_models")
    t0 = time.perf_counter()
    spec = {}
    for kind in CASES:
        traj = mm.trajectory(kind, tmp / kind, paths=TRAINER_PATHS + ("checkpoint",))
        spec[kind] = {"final": str(traj.final), "root": str(tmp / kind), "fingerprints": traj.fingerprints,
                      "urls": {s: [traj.url(s, v) for v in range(mm.VERSIONS)] for s in STORES}}
    (tmp / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [str(STUBS), str(ROOT), os.environ.get("PYTHONPATH")] if p),
               OMP_NUM_THREADS="1", SGLANG_PLUGINS="engine_ext")
    with open(tmp / "worker.log", "w") as log:
        p = subprocess.run([sys.executable, __file__, str(tmp / "spec.json"), str(tmp / "out.json")], env=env,
                           stdout=log, stderr=subprocess.STDOUT, timeout=900)
    text = (tmp / "worker.log").read_text(errors="replace")
    assert p.returncode == 0, f"worker failed (rc {p.returncode}):\n{text[-6000:]}"
    out = json.loads((tmp / "out.json").read_text())
    print(f"\nSGLang matrix wall time: {time.perf_counter() - t0:.1f} s; per case: "
          + json.dumps({k: v.get("seconds") for k, v in out.items()}))
    for kind, res in out.items():  # the table's cells (docs/MODELS.md)
        cells = {s: "ok" if c["reason"] is None and not c["mismatched"] else c["reason"] for s, c in res["paths"].items()}
        print(f"[sglang matrix] {kind}: {'loaded' if res['loaded'] else 'not loaded: ' + res.get('error', '')} {cells} "
              f"tied={(res.get('layout') or {}).get('tied')}")
    return out


@pytest.mark.parametrize("kind,store", [(k, s) for k in CASES for s in STORES], ids=lambda x: x.replace("/", "-"))
def test_versions_through_each_path_equal_a_cold_load(results, kind, store):
    got = results[kind]
    assert got["loaded"] and "error" not in got, got  # "changed_at_start": what a failed start-up left behind
    # SGLang's post-processing derived nothing the updates write (its adapter refreshes nothing: it would be refused)
    assert got["census"] is not None and got["census"]["modules"] > 0, got["census"]  # taken at load
    assert got["layout"]["unreproducible"] == {} and got["layout"]["mismatched"] == [], got["layout"]
    cell = got["paths"][store]
    assert cell["reason"] is None, cell
    assert cell["versions"] == [0, 1, 2], cell
    assert all(re.search(FALLBACK.get(kind, "^$"), n) for n in cell["fallback"]), cell["fallback"]
    assert bool(cell["fallback"]) == (kind in FALLBACK), cell["fallback"]
    assert cell["fingerprint"] == got["cold_fingerprint"] == got["fingerprints"][store], cell
    assert cell["mismatched"] == [] and cell["moved"] == [], cell  # bit-exact, in place
    assert cell["differed_at_v0"], cell  # the anchor really took the model elsewhere


# --------------------------------------------------------------------------- worker (one process, TP 1)


def _worker(spec_path: str, out_path: str) -> None:
    import asyncio

    sys.path.insert(0, str(STUBS))
    import torch

    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import get_tp_group, init_distributed_environment, initialize_model_parallel
    from sglang.srt.model_loader import get_model
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    from engine_ext.engines.sglang.messages import RankOpReq
    from engine_ext.engines.sglang.rank import RankAgent
    from engine_ext.errors import DeltaError
    from engine_ext.server.controller import Controller
    from engine_ext.server.protocol import RankReply, UpdateRequest
    from engine_ext.store.sources import Sources
    from fake_ranks import NoEngineRanks

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    from engine_ext.engines.sglang.census import wrap_post_processing

    assert wrap_post_processing()  # as the plugin does in a scheduler: the census of what post-processing derives

    def load(model_dir: str):
        sa = ServerArgs(model_path=model_dir, tp_size=1, device="cpu", skip_tokenizer_init=True, dtype="bfloat16")
        publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
        if not torch.distributed.is_initialized():
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method="tcp://127.0.0.1:" + str(_free_port()))
            initialize_model_parallel()
        return get_model(model_config=ModelConfig.from_server_args(sa), load_config=LoadConfig(load_format="auto"),
                         device_config=DeviceConfig("cpu"))

    def raw(t):
        return t.detach().reshape(-1).contiguous().view(torch.uint8)

    class Ranks(NoEngineRanks):  # the controller's view of one rank, minus the scheduler process
        def __init__(self, agent):
            self.agent = agent

        async def call(self, op, **kwargs):
            return [RankReply.from_wire(w) for w in self.agent.handle(RankOpReq(op, kwargs)).replies]

    out = {}
    for kind, case in spec.items():
        t0 = time.perf_counter()
        res = out[kind] = {"loaded": False, "fingerprints": case["fingerprints"], "paths": {}}
        try:
            live = load(case["final"])
        except Exception as e:  # noqa: BLE001 - recorded: the table says why
            import traceback

            where = traceback.extract_tb(e.__traceback__)[-1]
            res["error"] = f"{type(e).__name__}: {str(e)[:1500]} (at {Path(where.filename).name}:{where.lineno}: {where.line})"
            print(f"[{kind}] load failed: {res['error']}", file=sys.stderr, flush=True)
            continue
        res["loaded"] = True
        census = live.__dict__.get("_engine_ext_census")
        res["census"] = None if census is None else {"modules": census.modules, "derived": sorted(census.derived)}
        cold = {n: raw(p).clone() for n, p in live.named_parameters()}
        ptrs = {n: p.data_ptr() for n, p in live.named_parameters()}
        agent = RankAgent(live, case["final"], rank=0, group=get_tp_group().cpu_group)
        ctl = Controller(Ranks(agent), Sources([case["root"]]), engine_name="sglang")

        async def drive():
            await ctl.start()
            res["cold_fingerprint"] = ctl.status()["fingerprint"]
            res["layout"] = ctl.status()["layout"]
            for store, urls in case["urls"].items():
                cell = res["paths"][store] = {"reason": None, "versions": [], "fallback": []}
                before_fp, before = ctl.status()["fingerprint"], {n: raw(p).clone() for n, p in live.named_parameters()}
                try:
                    for v, url in enumerate(urls):
                        ans = await ctl.update(UpdateRequest(url=url, rollback=v == 0))
                        cell["versions"].append(ans["version"])
                        cell["fallback"] += ans["fallback"]
                        if v == 0:
                            cell["differed_at_v0"] = any(not torch.equal(raw(p), cold[n]) for n, p in live.named_parameters())
                except DeltaError as e:
                    cell["reason"], cell["error"] = e.reason, str(e)
                    cell["unchanged"] = ctl.status()["fingerprint"] == before_fp and all(
                        torch.equal(raw(p), before[n]) for n, p in live.named_parameters())
                cell["fingerprint"] = ctl.status()["fingerprint"]
                cell["mismatched"] = [n for n, p in live.named_parameters() if not torch.equal(raw(p), cold[n])]
                cell["moved"] = [n for n, p in live.named_parameters() if p.data_ptr() != ptrs[n]]

        try:
            asyncio.run(drive())
        except Exception as e:  # noqa: BLE001
            res["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
            # what the failed start-up left in the weights (the probe must never write them)
            res["changed_at_start"] = [n for n, p in live.named_parameters() if not torch.equal(raw(p), cold[n])]
        res["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"[{kind}] {json.dumps(res)[:600]}", file=sys.stderr, flush=True)
        del live, agent, ctl
    Path(out_path).write_text(json.dumps(out))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # SGLang leaves non-daemon helpers behind that delay a normal exit by ~40 s
