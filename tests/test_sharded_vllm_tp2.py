"""A sharded trainer's versions on a real vLLM CPU server at TP 2, whose shards are not the trainer's.

A tiny Qwen2 with tied embeddings and a padded vocabulary (1000 rows: the server's rank 1
holds padding) is fine-tuned under FSDP2 at world 4, then restarted at world 2 publishing
through vLLM's trainer-side source (``ShardSource``: local shards, no gather). The server's
two ranks cut the tensors where vLLM does (column-parallel rows, row-parallel columns), the
trainer's ranks at their own rows: each server rank fetches only the cells that meet what it
holds (at most 0.6x of a delta). Every version is pushed; at the end the server serves the
full model's bf16 fingerprint, and pushed back to v0 (a chunked anchor) its outputs equal
its cold start's.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
import sharded_procs  # noqa: E402
from test_sharded import reassemble  # noqa: E402
from test_sharded_vllm import model_fp  # noqa: E402
from vllm_helpers import Server, make_model  # noqa: E402

pytestmark = pytest.mark.vllm


def test_tp2_server_takes_versions_of_trainers_at_world_4_then_2(tmp_path):
    model = make_model(tmp_path / "model", "qwen2-tied", vocab=1000)
    root = tmp_path / "stores" / "run"
    out4, out2 = tmp_path / "out4", tmp_path / "out2"
    out4.mkdir()
    out2.mkdir()
    codes = sharded_procs.run(4, {"store": str(root), "out": str(out4), "steps": 2, "hf_model": str(model),
                                  "lr": 1e-3, "chunk_min_cell": 1024})
    codes += sharded_procs.run(2, {"store": str(root), "out": str(out2), "steps": 2, "hf_model": str(model),
                                   "lr": 1e-3, "chunk_min_cell": 1024, "shard_source": True, "seed": 1})
    s = [json.loads((o / f"rank{r}.json").read_text()) for o, w in ((out4, 4), (out2, 2)) for r in range(w)]
    assert codes == [0] * 6 and not any("error" in x for x in s), [x.get("traceback") for x in s]
    anchors = {v: json.loads((root / f"v{v:08d}.anchor.json").read_text()) for v in (0, 3)}
    assert all(a["format_version"] == 6 for a in anchors.values())
    assert not any(t["name"].startswith("lm_head") for t in anchors[0]["tensors"])  # tied: published once
    server = Server(model, sources=str(tmp_path / "stores"), tp=2, log=tmp_path / "tp2.log")
    try:
        cold, cold_fp = server.outputs(), server.status()["fingerprint"]
        assert model_fp(reassemble(out4, 4, 0)) == cold_fp
        for v, key in [(0, "v00000000.anchor.json"), (1, "v00000001.json"), (2, "v00000002.json"),
                       (3, "v00000003.anchor.json"), (4, "v00000004.json"), (5, "v00000005.json")]:
            r = server.update({"url": str(root / key)})
            assert r.status_code == 200 and r.json()["version"] == v, r.text
            a = r.json()
            if v == 0:
                assert a.get("noop"), a  # the server already holds v0's weights: adopted by fingerprint
            elif "anchor" in key:
                assert max(a["fetched_bytes"]) < a["payload_bytes"], a  # each rank its cells of the anchor
            else:
                assert max(a["fetched_bytes"]) <= 0.6 * a["payload_bytes"], a
            out, world, at = (out4, 4, v) if v < 3 else (out2, 2, v)
            assert server.status()["fingerprint"] == model_fp(reassemble(out, world, at)) == a["fingerprint"]
        assert server.outputs() != cold
        r = server.update({"url": str(root / "v00000000.anchor.json"), "rollback": True})
        assert r.status_code == 200 and r.json()["version"] == 0, r.text
        assert server.status()["fingerprint"] == cold_fp and server.outputs() == cold
    finally:
        server.stop()
