"""A sharded trainer feeds a real vLLM CPU server (TP 1) that follows the store while it trains.

FSDP2 ``fully_shard`` ranks (gloo, tests/sharded_procs.py) fine-tune a tiny Qwen2 with AdamW
and publish every version per rank (ShardedPublisher; nobody gathers, ``full_tensor`` raises).
One server, cold-started on the initial checkpoint, follows the store (``ENGINE_EXT_FOLLOW``):

1. world 2 publishes v0 (the initial weights: the server adopts it by fingerprint), v1, v2;
   rank 1 is SIGKILLed in the middle of its part of v3: nothing of v3 is committed, LATEST
   stays on v2, and the server keeps serving v2;
2. the trainer restarts at world 4 (another layout): v4 is an anchor (format 6, its tensors
   in the ranks' rows) and v5, v6 deltas; the server follows to v6 through the anchor and
   serves the full model's bf16 fingerprint (the model reassembled from what the ranks held);
3. the store moved away (the follower stops), pushed back to v0 (the chunked anchor,
   ``rollback``), its outputs equal its cold start's.
"""
from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("vllm")
import sharded_procs  # noqa: E402
from test_sharded import reassemble  # noqa: E402
from vllm_helpers import Server, make_model  # noqa: E402

from engine_ext.format import fingerprint as fpr  # noqa: E402

# Redundant with tests/test_sharded_vllm_tp2.py (a killed rank, a new world, the bf16 fingerprint, a cold
# start's outputs, at TP 2) but for TP 1 and the follower: kept out of CI (`scripts/test.sh --full` runs it).
pytestmark = [pytest.mark.vllm, pytest.mark.full]


def model_fp(weights: dict) -> str:
    return fpr.fmt(fpr.model_fingerprint({n: fpr.tensor_fingerprint(t) for n, t in weights.items()}))


def wait_version(server, version: int, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while (st := server.status())["version"] != version:
        assert time.monotonic() < deadline, (version, st.get("version"), st.get("follow"))
        time.sleep(0.5)
    return st


def test_tp1_server_follows_a_sharded_trainer_through_a_killed_rank_and_a_new_world(tmp_path):
    model = make_model(tmp_path / "model", "qwen2")
    root = tmp_path / "stores" / "run"
    follow = {"ENGINE_EXT_FOLLOW": str(root), "ENGINE_EXT_FOLLOW_INTERVAL": "1"}
    server = Server(model, sources=str(tmp_path / "stores"), env=follow, log=tmp_path / "tp1.log")
    try:
        cold, cold_fp = server.outputs(), server.status()["fingerprint"]
        out2, out4 = tmp_path / "out2", tmp_path / "out4"
        out2.mkdir()
        out4.mkdir()
        codes = sharded_procs.run(2, {"store": str(root), "out": str(out2), "steps": 3, "hf_model": str(model),
                                      "lr": 1e-3, "fault": {"rank": 1, "version": 3, "kind": "kill"}})
        assert codes[1] == -9, codes
        assert json.loads((root / "LATEST").read_text())["signed"]["version"] == 2
        assert model_fp(reassemble(out2, 2, 0)) == cold_fp  # v0 is the checkpoint the server started from
        st = wait_version(server, 2)
        assert st["fingerprint"] == model_fp(reassemble(out2, 2, 2))
        time.sleep(3)  # a few polls later: still v2 (nothing of v3 was committed)
        assert server.status()["version"] == 2 and not (root / "v00000003.json").exists()

        codes = sharded_procs.run(4, {"store": str(root), "out": str(out4), "steps": 2, "hf_model": str(model),
                                      "lr": 1e-3})
        s = [json.loads((out4 / f"rank{r}.json").read_text()) for r in range(4)]
        assert codes == [0] * 4 and not any("error" in x for x in s), [x.get("traceback") for x in s]
        anchor = json.loads((root / "v00000004.anchor.json").read_text())
        assert anchor["format_version"] == 8 and not (root / "v00000004.json").exists()  # 8: pieces digests
        assert all(b["digest"] == "pieces" for b in anchor["blobs"])
        final = reassemble(out4, 4, 6)
        st = wait_version(server, 6)
        assert st["fingerprint"] == model_fp(final) == json.loads((root / "v00000006.json").read_text())["fingerprint"]
        assert server.outputs() != cold

        moved = root.rename(root.parent / "moved")  # the follower finds no LATEST any more: it stops moving
        r = server.update({"url": str(moved / "v00000000.anchor.json"), "rollback": True})
        assert r.status_code == 200 and r.json()["version"] == 0, r.text
        assert server.status()["fingerprint"] == cold_fp
        assert server.outputs() == cold  # the chunked anchor serves what a cold start on those weights does
    finally:
        server.stop()
