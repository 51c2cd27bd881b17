"""Tensor parallelism 2 with tied embeddings and a padded vocabulary, on a real vLLM CPU server.

Each rank holds half of the (tied) embedding rows, of q/k/v and of the MLP; the
padded vocabulary (1000 -> 1024 rows) leaves padding rows on rank 1. Most parts of the
deltas are context coded (codec v2, the default), each rank decoding the blocks it holds
from its own weights. The deltas are cut
into small cells (as a big model's are at the default size), so each rank fetches only
the rows or columns it holds: at most 0.6x of the delta. The versions are format 12 (their
tensor entries in tables in a blob, as a model of very many tensors publishes them, the cut matrices'
chunk records in cell sections for 8 TP shares): each rank reads the name index, the tensor tables of the
tensors it holds and only the cell sections of its own shares (on top of its 0.6x). Then rank 1 fails in the middle
of an update, after writing its part (tests/server_hooks): every rank rolls back, the
served weights and outputs are those of before, and the same update lands next time.
After K + 1 deltas through the endpoint the outputs equal a TP 2 cold start on the final
weights: the server itself, which starts cold on them (version unknown, its weights known
by fingerprint: the reference) and is taken back to v0 by the anchor (``rollback``, each
rank fetching its rows of a format-7 anchor) before the deltas. No second server is started.
"""
from __future__ import annotations

import json

import pytest

from engine_ext import settings
from engine_ext.format.manifest import CellSections
from engine_ext.store import open_store
from engine_ext.store.reader import load_cells, read_manifest

pytest.importorskip("vllm")
from vllm_helpers import HOOKS, Server, assert_layout_on_this_host, make_model, rl_trajectory, save_state_dict  # noqa: E402

pytestmark = pytest.mark.vllm
K = 3


def test_tp2_tied_embeddings(tmp_path):
    model = make_model(tmp_path / "model", "qwen2-tied", vocab=1000)
    root = tmp_path / "stores"
    with settings.override(inline_entries=0):  # format 12: tables and cell sections in a blob (tests/test_cell_sections.py)
        final = rl_trajectory(model, root / "run", K + 1, seed=3, chunk_min_cell=256)
    assert not any(n.startswith("lm_head") for n in final)
    store = open_store(str(root / "run"))
    for n in range(1, K + 2):  # codec v2 by default: most parts context coded, the padded embedding's among them
        assert json.loads((root / "run" / f"v{n:08d}.json").read_text())["tensors"] == []
        m = read_manifest(store, f"v{n:08d}.json")
        assert m.format_version == 12 and any(isinstance(t.cells, CellSections) for t in m.tensors)  # q/k/v, MLP, vocab
        load_cells(store, m)
        assert any(t.grid for t in m.tensors)  # tables (and ctx-rans parts)
        coders = [p.positions.coder for t in m.tensors if t.nnz for p in (t.chunks or [t])]
        embed = next(t for t in m.tensors if t.name == "model.embed_tokens.weight")
        assert coders.count("ctx-rans") > len(coders) / 2 and any(p.positions.coder == "ctx-rans" for p in embed.chunks)
    fault = tmp_path / "fault"  # tests/server_hooks: rank N fails its next apply while this file holds N
    env = HOOKS | {"ENGINE_EXT_TEST_FAULT": str(fault)}
    fp = {n: json.loads((root / "run" / (f"v{n:08d}.json" if n else "v00000000.anchor.json")).read_text())["fingerprint"]
          for n in range(K + 2)}
    server = Server(save_state_dict(tmp_path / "final", final, model), sources=str(root), tp=2, env=env,
                    log=tmp_path / "tp2.log")  # cold on the final weights; version unknown: matched by fingerprint
    try:
        st = server.status()
        assert st["version"] is None and st["fingerprint"] == fp[K + 1], st
        assert_layout_on_this_host(st)
        cold = server.outputs()  # the reference: a TP 2 cold start on the final weights
        r = server.update({"url": str(root / "run" / "v00000000.anchor.json"), "rollback": True})
        assert r.status_code == 200 and r.json()["version"] == 0 and len(r.json()["fetched_bytes"]) == 2, r.text
        assert server.status()["fingerprint"] == fp[0]
        before = server.outputs()
        for n in range(1, K + 1):
            r = server.update({"url": str(root / "run" / f"v{n:08d}.json")})
            assert r.status_code == 200, r.text
            a = r.json()
            assert a["version"] == n and a["fallback"] == []
            m = read_manifest(store, f"v{n:08d}.json")
            tables = m.blobs[-1].size  # the tables' blob: the name index, tensor tables and cell tables
            entries = m.index.length + sum(r.length for r in m.tables)  # each rank holds a share of every tensor
            assert len(a["fetched_bytes"]) == 2 and max(a["fetched_bytes"]) <= 0.6 * (a["payload_bytes"] - tables) + tables, (
                a["fetched_bytes"], tables)
            assert min(a["fetched_bytes"]) >= entries  # counted: the index and the tables of its tensors
        at_k, st = server.outputs(), server.status()
        assert st["fingerprint"] == fp[K]
        fault.write_text("1")
        r = server.update({"url": str(root / "run" / f"v{K + 1:08d}.json")})
        assert r.status_code == 500 and r.json()["reason"] == "apply" and "injected fault on rank 1" in r.json()["error"], r.text
        assert not fault.exists()  # rank 1 did fail, after writing its part
        assert (server.status()["fingerprint"], server.outputs()) == (st["fingerprint"], at_k)  # both ranks rolled back
        r = server.update({"url": str(root / "run" / f"v{K + 1:08d}.json")})
        assert r.status_code == 200 and r.json()["version"] == K + 1, r.text
        updated, st = server.outputs(), server.status()
        assert st["fingerprint"] == fp[K + 1]
    finally:
        server.stop()
    assert updated != before and at_k != before
    assert updated == cold  # K + 1 deltas from v0 serve what a cold start on the final weights does
