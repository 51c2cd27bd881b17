"""SGLang's real Qwen2 and Llama model classes at TP 1 and TP 2 (gloo, one process per
rank), updated through the scheduler-side handler of the SGLang adapter.

What is real: SGLang 0.5.23's model classes, its model loader (``get_model``), its
parallel state (``publish`` + ``init_distributed_environment`` +
``initialize_model_parallel`` on gloo), its ``broadcast_pyobj`` (how scheduler rank 0
hands requests to the other TP ranks), its IPC encoding (``msgpack_encode`` /
``msgpack_decode`` with ``wrap_as_pickle``), our :class:`RankAgent` (the very handler
the scheduler hook calls) and the engine-agnostic controller, reader and publisher.
What stands in: the Scheduler/TokenizerManager processes themselves, so that every
rank's parameters can be compared with a cold load, bit for bit, for three model
kinds at TP 1 and 2 within the time budget (tests/test_sglang_live.py runs a live
server). Rank 0 plays the TokenizerManager's part by calling the controller directly.

Checks: after K deltas every rank's parameters equal, bit for bit, those of a model
loaded by SGLang from the final checkpoint, with every parameter's storage in place;
a corrupt blob, a delta on another base, a delta whose result fingerprint is wrong,
and a failure on one rank only all leave every rank exactly unchanged.

Run with the SGLang virtualenv's python (.ci/setup-sglang.sh).
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.engine]
if __name__ != "__main__":  # the TP workers import SGLang themselves, after the stubs
    pytest.importorskip("sglang", reason="needs the SGLang virtualenv (.ci/setup-sglang.sh)")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STUBS = HERE / "sglang_stubs"
# case name -> (tiny model kind, quantize, make_model options). fp8 sizes keep every TP 2 shard a
# whole number of 128x128 blocks (SGLang's block-fp8 layers refuse other shards).
CASES = {
    "qwen2": ("qwen2", None, {}), "llama": ("llama", None, {}), "qwen2-tied": ("qwen2-tied", None, {}),
    "qwen3-moe": ("qwen3-moe", None, {}),  # fused experts: SGLang 0.5.23 does not load them (docs/MOE_FP8.md)
    "qwen2-moe": ("qwen2-moe", None, {}),  # a shared expert and its gate
    # expert widths vLLM's CPU MoE pads at TP 2 (48 rows per rank): the same widths on SGLang
    "qwen3-moe-96": ("qwen3-moe", None, {"moe_intermediate": 96}),
    "qwen2-moe-96": ("qwen2-moe", None, {"moe_intermediate": 96}),
    "qwen2-fp8": ("qwen2", "fp8-block", {"hidden": 512, "heads": 4, "kv_heads": 2}),
    "qwen3-moe-fp8": ("qwen3-moe", "fp8-block", {"hidden": 512, "heads": 4, "kv_heads": 2}),
}
KINDS = tuple(CASES)
STEPS = 3
VOCAB = 1000  # not a multiple of 64: SGLang pads the vocabulary (and shards the padding)


# --------------------------------------------------------------------------- parent: data


def _rewrite_manifest_fp(store: Path, version: int) -> str:
    """A copy of version ``version`` whose first changed tensor promises a wrong result fingerprint
    (the model fingerprint recomputed, so the manifest is valid and only the apply's verify can tell)."""
    from engine_ext.format import fingerprint as fpr

    key = f"v{version:08d}.json"
    m = json.loads((store / key).read_text())
    t = next(t for t in m["tensors"] if t["nnz"] > 0)
    t["fingerprint"] = fpr.fmt(fpr.parse(t["fingerprint"]) ^ 1)
    m["fingerprint"] = fpr.fmt(fpr.model_fingerprint((x["name"], fpr.parse(x["fingerprint"])) for x in m["tensors"]))
    bad = store.parent / f"{store.name}-badfp"
    bad.mkdir(exist_ok=True)
    for f in store.iterdir():
        if f.name != key and f.is_file():
            (bad / f.name).write_bytes(f.read_bytes())
    (bad / key).write_text(json.dumps(m))
    from engine_ext.store.signing import Signer

    Signer.from_settings().sign_file(bad / key)  # signed by the trusted key: only the apply's verify can tell
    return str(bad / key)


def _corrupt_blob(store: Path, version: int) -> str:
    key = f"v{version:08d}.json"
    m = json.loads((store / key).read_text())
    bad = store.parent / f"{store.name}-corrupt"
    bad.mkdir(exist_ok=True)
    for f in store.iterdir():
        if f.is_file():
            (bad / f.name).write_bytes(f.read_bytes())
    blob = bad / m["blobs"][0]["key"]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    return str(bad / key)


def make_case(tmp: Path, name: str) -> dict:
    """Model dir, K published deltas, the final checkpoint, and three bad deltas.

    fp8 cases keep float32 master weights, perturb those, and publish (and cold-load) the
    fp8-block checkpoint quantised from them, as a trainer with ``quantize="fp8-block"`` does."""
    import torch

    sys.path.insert(0, str(HERE))
    from engine_ext.tiny_models import load_state_dict, make_model, perturb, save_state_dict

    from engine_ext.trainer.publisher import DeltaPublisher

    kind, quantize, options = CASES[name]
    model = make_model(tmp / name / "model", kind, vocab=VOCAB, **options)
    sd = load_state_dict(model)
    if quantize:
        sd = {n: t.float() for n, t in sd.items()}
        model = save_state_dict(tmp / name / "model-fp8", sd, model, quantize=quantize)
    kind = name
    gen = torch.Generator().manual_seed(1234)
    store = tmp / kind / "store"
    urls = []
    with DeltaPublisher(str(store), model=kind, anchor_every=0, workers=1, chunk_min_cell=256,
                        quantize=quantize) as pub:  # cells, as a big model's
        pub.publish(sd, version=0)
        for v in range(1, STEPS + 2):
            sd = perturb(sd, gen)
            urls.append(pub.publish(sd, version=v))
            if v == STEPS:
                final = save_state_dict(tmp / kind / "final", sd, model, quantize=quantize)
    # A store whose history started from other weights: its v1 has another base.
    other = tmp / kind / "other"
    sd2 = perturb({n: t.float() for n, t in sd.items()} if quantize else load_state_dict(model),
                  torch.Generator().manual_seed(99), density=0.5)
    with DeltaPublisher(str(other), model=kind, anchor_every=0, workers=1, quantize=quantize) as pub:
        pub.publish(sd2, version=0)
        wrong_base = pub.publish(perturb(sd2, gen), version=STEPS + 1)
    for f in other.glob("*.anchor.json"):  # no anchor to fall back on: the base really mismatches
        f.unlink()
    return {
        "kind": kind, "model": str(model), "final": str(final), "urls": urls[:STEPS],
        "bad": {"integrity": _corrupt_blob(store, STEPS + 1), "base_mismatch": wrong_base,
                "verify": _rewrite_manifest_fp(store, STEPS + 1)},
        "sources": [str(store), f"{store}-corrupt", f"{store}-badfp", str(other)],
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_world(cases: list[dict], tp: int, tmp: Path, timeout: int = 400) -> list[dict]:
    """One process per TP rank (each writes its log to a file: no pipe to fill up)."""
    spec = tmp / f"spec_tp{tp}.json"
    spec.write_text(json.dumps({"cases": cases, "tp": tp, "port": _free_port(), "out": str(tmp)}))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [str(STUBS), str(ROOT), os.environ.get("PYTHONPATH")] if p),
               OMP_NUM_THREADS="1", SGLANG_PLUGINS="engine_ext")
    logs = [tmp / f"log_tp{tp}_rank{r}.txt" for r in range(tp)]
    procs = []
    try:
        for r in range(tp):
            with open(logs[r], "w") as f:
                procs.append(subprocess.Popen([sys.executable, __file__, str(spec), str(r)], env=env,
                                              stdout=f, stderr=subprocess.STDOUT))
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = [log.read_text(errors="replace") for log in logs]
    if os.environ.get("ENGINE_EXT_TEST_VERBOSE"):
        print("\n".join(line for t in texts for line in t.splitlines() if line.startswith("[rank")))
    for r, (p, out) in enumerate(zip(procs, texts)):
        assert p.returncode == 0, f"TP rank {r} failed (rc {p.returncode}):\n{out[-6000:]}"
    return [json.loads((tmp / f"result_tp{tp}_rank{r}.json").read_text()) for r in range(tp)]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sglang_tp")
    return tmp, [make_case(tmp, k) for k in KINDS]


@pytest.mark.parametrize("tp", [1, 2])
def test_deltas_reach_every_rank_bit_exact_and_bad_ones_change_nothing(cases, tp):
    tmp, cs = cases
    results = _run_world(cs, tp, tmp)
    for r, res in enumerate(results):
        for kind in KINDS:
            got = res[kind]
            # K deltas: equal to a cold load of the final checkpoint, in place.
            assert got["mismatched_params"] == [], f"rank {r} {kind}: differs from final checkpoint"
            assert got["moved_params"] == [], f"rank {r} {kind}: parameter storage moved"
            assert got["versions"] == list(range(1, STEPS + 1))
            assert got["params"] > 0 and got["sharded"] == (tp > 1)
            assert (got["fp8_params"] > 0) == (CASES[kind][1] == "fp8-block"), (kind, got["fp8_params"])  # served as fp8
            assert (got["expert_params"] > 0) == ("moe" in kind), (kind, got["expert_params"])
            # Bad deltas: refused with the right reason, nothing changed on any rank.
            for case, want in {"integrity": "integrity", "base_mismatch": "base_mismatch",
                               "verify": "verify", "rank_fault": "apply"}.items():
                assert got["bad"][case]["reason"] == want, (kind, case, got["bad"][case])
                assert got["bad"][case]["unchanged"] is True, (r, kind, case)
            assert got["after_update"]["version"] == STEPS
            if r == 0:  # each rank fetched its own part from the store: at TP 2 at most 0.6x of the delta
                assert len(got["fetched"]) == STEPS and all(len(f) == tp for f, _ in got["fetched"])
                assert all(max(f) <= (0.6 if tp == 2 else 1.0) * whole for f, whole in got["fetched"]), got["fetched"]


# --------------------------------------------------------------------------- worker (one per TP rank)


class _TestRanks:
    """The controller's view of the ranks as the SGLang adapter gives it, minus the
    other processes: requests and replies cross a real ZMQ socket pair with SGLang's
    ``sock_send``/``sock_recv`` (its IPC encoding, ``wrap_as_pickle`` envelope
    included), then ``broadcast_pyobj`` like scheduler requests; pause/resume are
    recorded (no scheduler runs here)."""

    def __init__(self, step, world):
        import zmq

        self.step, self.world, self.events = step, world, []
        ctx = zmq.Context.instance()
        self.a, self.b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        self.a.bind(f"inproc://engine_ext_{id(self)}")
        self.b.connect(f"inproc://engine_ext_{id(self)}")

    async def call(self, op, **kwargs):
        from sglang.srt.managers.io_struct import sock_recv, sock_send, wrap_as_pickle

        from engine_ext.server.protocol import RankReply
        from engine_ext.engines.sglang.messages import RankOpReply, RankOpReq

        sock_send(self.a, wrap_as_pickle(RankOpReq(op, kwargs)))  # tokenizer -> scheduler rank 0
        req = sock_recv(self.b)
        assert isinstance(req, RankOpReq), type(req)
        sock_send(self.b, self.step(req))  # rank 0's dispatcher output -> tokenizer
        reply = sock_recv(self.a)
        assert isinstance(reply, RankOpReply), type(reply)
        return [RankReply.from_wire(w) for w in reply.replies]

    async def pause(self, mode):
        self.events.append(("pause", mode))

    async def resume(self):
        self.events.append(("resume",))

    async def after_update(self, version):
        replies = await self.call("after_update", version=version)
        assert all(r.ok for r in replies), replies


def _worker(spec_path: str, rank: int) -> None:
    import time

    t0 = time.time()

    def _tick(what):  # progress lines, shown with ENGINE_EXT_TEST_VERBOSE=1
        print(f"[rank {rank}] {time.time() - t0:6.1f}s {what}", file=sys.stderr, flush=True)

    sys.path.insert(0, str(STUBS))
    import torch

    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import get_tp_group, init_distributed_environment, initialize_model_parallel
    from sglang.srt.model_loader import get_model
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.common import broadcast_pyobj

    from engine_ext.errors import DeltaError
    from engine_ext.server.controller import Controller
    from engine_ext.server.protocol import UpdateRequest
    from engine_ext.store.sources import Sources
    from engine_ext.engines.sglang.messages import RankOpReq
    from engine_ext.engines.sglang.rank import RankAgent

    spec = json.loads(Path(spec_path).read_text())
    tp = spec["tp"]
    torch.set_num_threads(1)

    def load(model_dir: str):
        sa = ServerArgs(model_path=model_dir, tp_size=tp, device="cpu", skip_tokenizer_init=True, dtype="bfloat16")
        publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=rank, dp_rank=None, gpu_id=0))
        if not torch.distributed.is_initialized():
            init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{spec['port']}")
            initialize_model_parallel()
        return get_model(model_config=ModelConfig.from_server_args(sa), load_config=LoadConfig(load_format="auto"),
                         device_config=DeviceConfig("cpu"))

    def bits(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    def raw(t):  # the bytes: exact for NaN payloads, -0.0 and dtypes torch.equal lacks (fp8)
        return t.detach().reshape(-1).contiguous().view(torch.uint8)

    def same(model, snap) -> bool:
        return all(torch.equal(raw(p), raw(snap[n])) for n, p in model.named_parameters())

    results = {}
    _tick("imports")
    for case in spec["cases"]:
        live = load(case["model"])
        _tick(f"{case['kind']} loaded")
        group = get_tp_group()
        ptrs = {n: p.data_ptr() for n, p in live.named_parameters()}
        versions_seen: list[str] = []
        agent = RankAgent(live, case["model"], rank=group.rank_in_group, group=group.cpu_group,
                          flush_cache=lambda: True, set_version=versions_seen.append)
        state = {"snap": None}

        def step(req):
            """One request on this rank, as the scheduler's dispatcher would run it."""
            if req.op == "_snapshot":
                state["snap"] = bits(live)
                return None
            if req.op == "_same":
                ok = same(live, state["snap"])
                out = [None] * tp
                torch.distributed.all_gather_object(out, ok, group=group.cpu_group)
                return all(out)
            if req.op == "_fault":  # make this rank's next apply write, then fail
                if group.rank_in_group == req.kwargs["rank"]:
                    up = agent.updater
                    orig = up.apply

                    def failing(*a, **k):
                        up.apply = orig
                        orig(*a, **k)
                        raise RuntimeError("injected fault after the write on this rank")

                    up.apply = failing
                return None
            from sglang.srt.managers.io_struct import wrap_as_pickle

            return wrap_as_pickle(agent.handle(req))  # what rank.handle_in_scheduler returns

        if group.rank_in_group == 0:
            def lead(req):
                broadcast_pyobj([req], group.rank, group.cpu_group, src=group.ranks[0])
                return step(req)

            async def drive():
                eng = _TestRanks(lead, tp)
                ctl = Controller(eng, Sources(case["sources"]), version=0, engine_name="sglang")
                await ctl.start()
                versions, fallback, fetched = [], set(), []
                for url in case["urls"]:
                    ans = await ctl.update(UpdateRequest(url=url))
                    versions.append(ans["version"])
                    fallback.update(ans["fallback"])
                    fetched.append((ans["fetched_bytes"], ans["payload_bytes"]))
                assert not fallback, f"dense fallback for {sorted(fallback)}: the probe should map every tensor in place"
                bad = {}
                lead(RankOpReq("_snapshot"))
                for name, url in list(case["bad"].items()) + [("rank_fault", "FAULT")]:
                    if name == "rank_fault":
                        lead(RankOpReq("_fault", {"rank": tp - 1}))
                        url = case["bad"]["verify"].replace("-badfp", "")  # a good delta, failing on the last rank
                    try:
                        await ctl.update(UpdateRequest(url=url))
                        reason = None
                    except DeltaError as e:
                        reason = e.reason
                    bad[name] = {"reason": reason, "unchanged": lead(RankOpReq("_same")), "version": ctl.version}
                assert ctl.version == len(case["urls"]), ctl.version
                return versions, bad, eng.events, fetched

            versions, bad, events, fetched = asyncio.run(drive())
            broadcast_pyobj([RankOpReq("_stop")], group.rank, group.cpu_group, src=group.ranks[0])
        else:
            while True:
                [req] = broadcast_pyobj(None, group.rank, group.cpu_group, src=group.ranks[0])
                if req.op == "_stop":
                    break
                step(req)
            versions, bad, events, fetched = list(range(1, STEPS + 1)), None, [], []
        # Every rank: its own view of the "bad" outcomes comes from rank 0's gathered checks.
        _tick("updates done")
        bad = broadcast_pyobj([bad], group.rank, group.cpu_group, src=group.ranks[0])[0]
        ref = load(case["final"])
        ref_p = dict(ref.named_parameters())
        mismatched = [n for n, p in live.named_parameters()
                      if not torch.equal(raw(p), raw(ref_p[n]))]
        moved = [n for n, p in live.named_parameters() if p.data_ptr() != ptrs[n]]
        sharded = dict(live.named_parameters())["model.embed_tokens.weight"].shape[0] < VOCAB
        results[case["kind"]] = {
            "mismatched_params": mismatched, "moved_params": moved, "versions": versions, "bad": bad,
            "params": len(ptrs), "sharded": sharded,
            "fp8_params": sum(p.dtype == torch.float8_e4m3fn for p in live.parameters()),
            "expert_params": sum(".experts." in n for n in ptrs), "events": events, "fetched": fetched,
            "after_update": {"version": int(versions_seen[-1]) if versions_seen else None},
        }
        del live, ref, agent
    Path(spec["out"], f"result_tp{tp}_rank{rank}.json").write_text(json.dumps(results))
    torch.distributed.barrier()
    _tick("done")


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]))
    # SGLang leaves non-daemon helpers behind that delay a normal exit by ~40 s;
    # everything is written and every rank passed the final barrier.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
