"""A sharded trainer end to end on one real vLLM CPU server at TP 2, whose shards are not the trainer's.

One dev-mode server (TP 2, weight-transfer backend ``engine_ext``) serves a tiny Qwen2 with tied
embeddings and a padded vocabulary (1000 rows: the server's rank 1 holds padding). FSDP2
``fully_shard`` trainer ranks (gloo, tests/sharded_procs.py; ``DTensor.full_tensor`` raises in
them: nobody gathers) fine-tune it with AdamW and push every version to the live server:

1. world 4 through ``DeltaGRPOTrainer``'s sync under FSDP (its generation's ``sync_weights``:
   ``DeltaWeightTransfer(sharded=True).send_shards(model)``, TRL's gathering iterator never walked): v0 (adopted by fingerprint), v1, v2; rank 1 is
   SIGKILLed in the middle of its part of v3: nothing of v3 is committed, LATEST stays on v2, and
   the server keeps serving v2;
2. restarted at world 2 through vLLM's own trainer-side API (``WeightTransferTrainerFactory``,
   backend ``engine_ext``, ``source=ShardSource(model)``, vLLM's HTTP client): the store is
   continued with a delta against LATEST (v4 on v2: another world, another layout, each rank
   rebuilt its rows of v2 from the store), then v5, v6;
3. each time the server serves the full model's bf16 fingerprint (reassembled from what the
   ranks held, never gathered). Its two ranks cut the tensors where vLLM does, the trainer's
   ranks at their own rows: each server rank fetches only the cells that meet what it holds;
   pushed back to v0 (a chunked anchor) its outputs equal its cold start's.

tests/test_sharded_vllm.py does the same at TP 1 with a follower (``@pytest.mark.full``: this
module covers its path at TP 2).
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
import sharded_procs  # noqa: E402
from test_sharded import reassemble  # noqa: E402
from vllm_helpers import Server, make_model  # noqa: E402

from engine_ext.format import fingerprint as fpr  # noqa: E402

pytestmark = pytest.mark.vllm
BACKEND = json.dumps({"backend": "engine_ext"})


def model_fp(weights: dict) -> str:
    return fpr.fmt(fpr.model_fingerprint({n: fpr.tensor_fingerprint(t) for n, t in weights.items()}))


def test_tp2_server_follows_fsdp_trainers_through_trl_and_vllm_apis_a_killed_rank_and_a_new_world(tmp_path):
    model = make_model(tmp_path / "model", "qwen2-tied", vocab=1000)
    root = tmp_path / "stores" / "run"
    out4, out2 = tmp_path / "out4", tmp_path / "out2"
    out4.mkdir()
    out2.mkdir()
    server = Server(model, sources=str(tmp_path / "stores"), tp=2, env={"VLLM_SERVER_DEV_MODE": "1"},
                    args=["--weight-transfer-config", BACKEND], log=tmp_path / "tp2.log")
    try:
        cold, cold_fp = server.outputs(), server.status()["fingerprint"]
        common = {"store": str(root), "steps": 3, "hf_model": str(model), "lr": 1e-3, "chunk_min_cell": 1024,
                  "server": server.url, "token": server.token}
        codes = sharded_procs.run(4, {**common, "out": str(out4), "via": "trl",
                                      "fault": {"rank": 1, "version": 3, "kind": "kill"}})
        assert codes[1] == -9, codes
        s4 = [json.loads((out4 / f"rank{r}.json").read_text()) for r in (0, 2, 3)]
        assert "error" in s4[0], s4[0]  # the survivors learn that the group broke: nothing more is committed
        assert s4[0]["sent"] == [0, 1, 2], s4[0]  # rank 0 pushed every committed version
        assert json.loads((root / "LATEST").read_text())["signed"]["version"] == 2
        assert not (root / "v00000003.json").exists() and not (root / "v00000003.anchor.json").exists()
        assert model_fp(reassemble(out4, 4, 0)) == cold_fp  # v0 is the checkpoint the server started from
        st = server.status()
        assert st["version"] == 2 and st["fingerprint"] == model_fp(reassemble(out4, 4, 2))

        codes = sharded_procs.run(2, {**common, "out": str(out2), "steps": 2, "via": "vllm", "seed": 1})
        s2 = [json.loads((out2 / f"rank{r}.json").read_text()) for r in range(2)]
        assert codes == [0, 0] and not any("error" in x for x in s2), [x.get("traceback") for x in s2]
        assert s2[0]["versions"] == [4, 5, 6] and s2[0]["resumed"].startswith(
            "resumed after v2: v4 is a delta against v2"), s2[0]  # world 4's rows rebuilt by world 2's ranks
        v4 = json.loads((root / "v00000004.json").read_text())
        assert v4["base_version"] == 2 and not (root / "v00000004.anchor.json").exists()
        assert not any(t["name"].startswith("lm_head") for t in v4["tensors"])  # tied: published once
        v0 = json.loads((root / "v00000000.anchor.json").read_text())
        assert v0["format_version"] == 8 and all(b["digest"] == "pieces" for b in v0["blobs"])  # 8: pieces digests
        final = reassemble(out2, 2, 6)
        st = server.status()
        assert st["version"] == 6
        assert st["fingerprint"] == model_fp(final) == json.loads((root / "v00000006.json").read_text())["fingerprint"]
        assert server.outputs() != cold

        # each server rank fetches the cells it holds: of a chunked anchor, and of a delta cut at the trainer's rows
        r = server.update({"url": str(root / "v00000000.anchor.json"), "rollback": True})
        assert r.status_code == 200 and r.json()["version"] == 0, r.text
        a = r.json()
        assert max(a["fetched_bytes"]) < a["payload_bytes"], a
        r = server.update({"url": str(root / "v00000001.json")})
        a = r.json()
        assert r.status_code == 200 and max(a["fetched_bytes"]) <= 0.6 * a["payload_bytes"], a
        assert a["fingerprint"] == model_fp(reassemble(out4, 4, 1))
        r = server.update({"url": str(root / "v00000000.anchor.json"), "rollback": True})
        assert r.status_code == 200 and server.status()["fingerprint"] == cold_fp
        assert server.outputs() == cold  # the chunked anchor serves what a cold start on those weights does
    finally:
        server.stop()
