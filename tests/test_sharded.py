"""Sharded publishing: every trainer rank publishes its own rows, nobody gathers the model.

Real gloo ranks (tests/sharded_procs.py: spawned processes, a model under FSDP2
``fully_shard`` on the CPU, AdamW steps between versions, ``DTensor.full_tensor`` patched to
raise) publish through one ShardedPublisher each. The store is read back by the ordinary
reader and checked bit for bit against the model reassembled from what each rank held (files
the ranks wrote, not a collective), and against a single-process DeltaPublisher fed the same
weights: same fingerprints at every version. A world of 2 trains, then rank 1 is SIGKILLed
in the middle of its part: nothing is committed and LATEST stays; the run restarts at world 4
(an anchor after the burnt version, numbers continuing), where rank 2's store refuses its
blobs once: that version is aborted on every rank, the next one is an anchor, training goes on.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

import sharded_procs
from engine_ext.errors import ManifestError
from engine_ext.format import fingerprint as fpr
from engine_ext.format import manifest as manifest_mod
from engine_ext.format.delta import apply_tensor
from engine_ext.format.dtypes import as_bits
from engine_ext.format.manifest import CellSections, Manifest, manifest_key
from engine_ext.store import decoding, open_store, reader, route
from engine_ext.trainer.publisher import DeltaPublisher
from engine_ext.trainer.shards import agree


def reassemble(out: Path, world: int, version: int) -> dict[str, torch.Tensor]:
    """The whole model at ``version`` from what each rank held (its rows; replicas once)."""
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for r in range(world):
        for name, (start, t) in torch.load(out / f"rank{r}.v{version}.pt").items():
            pieces.setdefault(name, {})[start] = t
    full = {}
    for name, by_start in pieces.items():
        parts = [by_start[s] for s in sorted(by_start)]
        full[name] = parts[0] if parts[0].dim() == 0 else torch.cat([p for p in parts if p.numel() or len(parts) == 1])
    return full


def served(root: str, version: int) -> dict[str, torch.Tensor]:
    """What a reader starting from nothing gets at ``version`` (anchor + chain, every byte verified)."""
    d = route.resolve(f"{root}/v{version:08d}.json" if Path(root, f"v{version:08d}.json").exists()
                      else f"{root}/v{version:08d}.anchor.json", bases=decoding.TensorBases({}))
    out = {}
    for td in d.tensors:  # a route from nothing starts at an anchor: every tensor absolute, then steps
        out[td.name] = apply_tensor(out.get(td.name), td, check=False)
    for name, fp in d.tensor_fingerprints.items():
        assert fpr.tensor_fingerprint(out[name]) == fp, name
    return out


def equal(a: dict, b: dict) -> None:
    assert set(a) == set(b), (sorted(set(a) ^ set(b)))
    for n in a:
        assert a[n].shape == b[n].shape and torch.equal(as_bits(a[n]), as_bits(b[n])), n


def manifests(root: Path) -> dict[str, dict]:
    """Every manifest under ``root`` as JSON; a format-7 one with its tables read (its tensors and
    chunks as an inline manifest lists them), its ``format_version`` as published."""
    out, store = {}, open_store(str(root))
    for p in sorted(root.glob("v*.json")):
        doc = json.loads(p.read_text())
        if doc.get("tables"):
            m = reader.read_manifest(store, p.name)
            reader.load_cells(store, m)
            doc["tensors"] = [dataclasses.asdict(t) for t in m.tensors]
        out[p.name] = doc
    return out


def summaries(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def run2(tmp_path_factory):
    """World 2: v0 (anchor) .. v3, then rank 1 killed in the middle of its part of v4."""
    d = tmp_path_factory.mktemp("sharded")
    (d / "out2").mkdir()
    cfg = {"store": str(d / "store"), "out": str(d / "out2"), "steps": 4, "timeout_s": 60,
           "fault": {"rank": 1, "version": 4, "kind": "kill"}}
    codes = sharded_procs.run(2, cfg)
    return d, codes


def test_world2_fsdp_publishes_per_rank_and_a_killed_rank_commits_nothing(run2):
    d, codes = run2
    root, out = d / "store", d / "out2"
    s0 = json.loads((out / "rank0.json").read_text())
    assert codes[1] == -9 and not (out / "rank1.json").exists()  # rank 1 died mid-part
    assert codes[0] == 0 and "lost each other" in s0["error"], s0  # rank 0's publish raised: the group broke
    assert s0["committed"] == [0, 1, 2, 3] and s0["versions"][-1] == 4
    latest = json.loads((root / "LATEST").read_text())["signed"]
    assert latest["version"] == 3 and not (root / "v00000004.json").exists()  # nothing of v4 committed
    assert not list(root.glob("v00000004.r1.*"))  # rank 1 died before its blobs; rank 0's may stay as orphans
    ms = manifests(root)
    anchor = ms["v00000000.anchor.json"]
    assert anchor["format_version"] == 8 and all(t["chunks"] for t in anchor["tensors"])  # every tensor in rows
    assert all(b["digest"] == "pieces" for b in anchor["blobs"])  # format 8: each rank's part a pieces digest
    for v in (1, 2, 3):  # deltas, inline: format 9 where a part is ctx-rans coded (the version's data decides), else 5
        doc = ms[f"v{v:08d}.json"]
        rans_parts = any(p["positions"]["coder"] == "ctx-rans" for t in doc["tensors"] for p in (t.get("chunks") or [t]))
        assert doc["format_version"] == (9 if rans_parts else 5), (v, doc["format_version"])
    for name, m in ms.items():  # each rank wrote only the cells inside its own rows
        for t in m["tensors"]:
            per_row = len(t["grid"][1]) - 1 if t["grid"] and len(t["grid"]) > 1 else 1
            for c in t["chunks"] or []:
                rank = int(m["blobs"][c["blob"]]["key"].split(".r")[1].split(".")[0])
                i = c["cell"] // per_row
                first, end = t["grid"][0][i], t["grid"][0][i + 1]
                half = -(-t["shape"][0] // 2)  # FSDP2's rows per rank
                assert first // half == rank and (end - 1) // half == rank, (name, t["name"], first, end, rank)
    for v in range(4):  # bit-exact against the model the ranks held, and the same fingerprint a single process gets
        want = reassemble(out, 2, v)
        got = served(str(root), v)
        equal(got, want)
        m = ms.get(f"v{v:08d}.json") or ms[f"v{v:08d}.anchor.json"]
        assert m["fingerprint"] == fpr.fmt(fpr.model_fingerprint({n: fpr.tensor_fingerprint(t) for n, t in want.items()}))
    single = d / "single"
    with DeltaPublisher(str(single), "toy", anchor_every=0) as pub:
        for v in range(4):
            pub.publish(reassemble(out, 2, v))
    for v in range(1, 4):
        assert json.loads((single / f"v{v:08d}.json").read_text())["fingerprint"] == ms[f"v{v:08d}.json"]["fingerprint"]
    held = s0["held_bytes_bf16"]  # each rank keeps only its own rows' bits
    assert s0["kept_bytes"] == held and held < 0.55 * sum(t.numel() * 2 for t in reassemble(out, 2, 0).values())


def test_world4_resumes_with_an_anchor_and_a_failed_part_aborts_the_version_everywhere(run2):
    """The run restarts at world 4 on the store the killed world-2 run left, with tensors LATEST
    does not hold: v5 an anchor after the burnt v4 (on every rank), v6 a delta; rank 2's store refuses its blobs of v7: v7 is aborted on every rank, and v8,
    the retry, is an anchor. These versions are in tables (ENGINE_EXT_INLINE_ENTRIES=0: format 10, tables and their
    name index; the delta format 12, its cut matrices' records in cell sections), read by the same readers."""
    d, _ = run2
    root, out = d / "store", d / "out4"
    out.mkdir()
    cfg = {"store": str(root), "out": str(out), "steps": 3, "timeout_s": 60, "replicated": True,
           "fault": {"rank": 2, "version": 7, "kind": "raise"}, "seed": 1, "env": {"ENGINE_EXT_INLINE_ENTRIES": "0"}}
    codes = sharded_procs.run(4, cfg)
    s = summaries(out, 4)
    assert codes == [0, 0, 0, 0] and not any("error" in x for x in s), [x.get("traceback") for x in s]
    assert all(x["versions"] == [5, 6, 7, 8] for x in s)
    assert all(x["committed"] == [5, 6, 8] and list(x["aborted"]) == ["7"] for x in s), s
    assert "rank 2: OSError" in s[0]["aborted"]["7"] and s[0]["resumed"].startswith("resumed after v3: v5 is an anchor")
    assert "LATEST holds None" in s[0]["resumed"]  # the extra tensors: not in LATEST, so no rank resumes with a delta
    ms = manifests(root)
    assert "v00000007.json" not in ms and "v00000007.anchor.json" not in ms
    assert ms["v00000005.anchor.json"]["format_version"] == 10 and ms["v00000006.json"]["base_version"] == 5
    v6 = ms["v00000006.json"]  # a delta of matrices cut in cells: format 12, their records in cell sections
    assert v6["format_version"] == 12 and json.loads((root / "v00000006.json").read_text())["tensors"] == []
    assert any(isinstance(t.cells, CellSections) for t in reader.open_manifest(open_store(str(root)), (root / "v00000006.json").read_bytes()).tensors)
    assert ms["v00000008.anchor.json"]["format_version"] == 10 and "v00000008.json" not in ms  # the retry: an anchor
    for v in (5, 6, 8):  # each rank's data blobs (an anchor's: a pieces digest), the tables' blobs flat
        doc = json.loads((root / manifest_key(v, "anchor" if v != 6 else "delta")).read_text())
        blobs, tabled = doc["blobs"], {r["blob"] for r in doc["tables"]} | {doc["index"]["blob"]}
        assert all((b.get("digest") is None) == (i in tabled or v == 6) for i, b in enumerate(blobs)), blobs
        # rank 0's blob: the name index and the tables of tensors every rank publishes rows of (joined there);
        # the extras' ranks wrote the tables of the tensors they publish whole into a blob of their own
        assert ".r" not in blobs[doc["index"]["blob"]]["key"] and doc["index"]["blob"] == len(blobs) - 1
        own = [r["count"] for r in doc["tables"] if ".r" in blobs[r["blob"]]["key"]]
        assert sum(own) == 2 and len(ms[manifest_key(v, "anchor" if v != 6 else "delta")]["tensors"]) > 2 + sum(own)
    assert json.loads((root / "LATEST").read_text())["signed"]["version"] == 8
    for v in (5, 6, 8):
        equal(served(str(root), v), reassemble(out, 4, v))
    fps = {x["fingerprint"] for x in s}
    assert fps == {ms["v00000008.anchor.json"]["fingerprint"]}  # every rank knows what was committed
    anchor = {t["name"]: t for t in ms["v00000005.anchor.json"]["tensors"]}
    assert anchor["extra.replicated"]["chunks"] is None and anchor["extra.plain"]["chunks"] is None  # one rank each
    k = anchor["model.layers.0.self_attn.k_proj.weight"]  # 6 rows on 4 ranks: 2, 2, 2 and an empty shard
    assert k["grid"] == [[0, 2, 4, 6]] and len(k["chunks"]) == 3
    total = sum(t.numel() * 2 for n, t in reassemble(out, 4, 5).items() if not n.startswith("extra."))
    assert all(x["held_bytes_bf16"] <= 0.3 * total for x in s)  # about a quarter of the model per rank


def test_a_restart_at_another_world_size_resumes_with_a_delta(tmp_path):
    """World 2 publishes v0 (an anchor cut at its rows) and v1; the trainer restarts at world 3
    (other rows: 1000 embedding rows as 334/334/332, where world 2 cut at 500) and its first
    version is a delta against v1: each rank rebuilt only its rows of LATEST from the cells that
    meet them (rank 1's straddle both of world 2's), and the ranks' partial fingerprints, summed,
    proved every tensor; what a reader rebuilds from the store is, bit for bit, what the ranks held."""
    root, o2, o3 = tmp_path / "store", tmp_path / "out2", tmp_path / "out3"
    o2.mkdir()
    o3.mkdir()
    assert sharded_procs.run(2, {"store": str(root), "out": str(o2), "steps": 1, "timeout_s": 60}) == [0, 0]
    codes = sharded_procs.run(3, {"store": str(root), "out": str(o3), "steps": 2, "timeout_s": 60, "seed": 1})  # v2..v4
    s = summaries(o3, 3)
    assert codes == [0, 0, 0] and not any("error" in x for x in s), [x.get("traceback") for x in s]
    assert all(x["resumed"].startswith("resumed after v1: v2 is a delta against v1") for x in s), s[0]["resumed"]
    assert all(x["versions"] == [2, 3, 4] and x["committed"] == [1, 2, 3, 4] for x in s), [x["committed"] for x in s]
    ms = manifests(root)
    assert ms["v00000002.json"]["base_version"] == 1 and "v00000002.anchor.json" not in ms
    assert json.loads((root / "v00000002.json").read_text())["base_manifests"] == [
        __import__("hashlib").sha256((root / "v00000001.json").read_bytes()).hexdigest()]
    embed = {t["name"]: t for t in ms["v00000002.json"]["tensors"]}["model.embed_tokens.weight"]
    assert embed["grid"][0][:4] == [0, 334, 668, 1000] or {334, 668} <= set(embed["grid"][0]), embed["grid"]
    for v in (2, 3, 4):
        equal(served(str(root), v), reassemble(o3, 3, v))


def test_a_format5_reader_refuses_a_chunked_anchor(run2, monkeypatch):
    d, _ = run2
    raw = (d / "store" / "v00000000.anchor.json").read_bytes()
    Manifest.from_json(raw)
    monkeypatch.setattr(manifest_mod, "READABLE_VERSIONS", (1, 2, 3, 4, 5))  # what a format-5 reader accepts
    with pytest.raises(ManifestError, match="unknown format 'engine-ext-delta' version 8"):  # 8: pieces digests
        Manifest.from_json(raw)
    m = json.loads(raw)
    assert all(b["digest"] == "pieces" for b in m["blobs"])
    for b in m["blobs"]:
        del b["digest"]
    m["format_version"] = 5  # and a chunked anchor labelled format 5 is refused too
    monkeypatch.undo()
    with pytest.raises(ManifestError, match="format-6 anchors"):
        Manifest.from_json(json.dumps(m).encode())
    first = m["tensors"][0]
    m["format_version"], first["chunks"] = 6, first["chunks"][1:]  # a chunked anchor must list every cell
    with pytest.raises(ManifestError):
        Manifest.from_json(json.dumps(m).encode())


def test_placements_agreed_from_every_rank_view():
    """Shard(0) rows (uneven, empty), replicas (one publisher each, spread by name), HSDP-like
    repeated ranges, and refusals: ranges that do not tile, ranks that disagree on a shape."""
    views = [[("w", "bfloat16", (10, 4), 0, 3), ("r", "float32", (5,), 0, 5), ("e", "bfloat16", (2, 2), 0, 1)],
             [("w", "bfloat16", (10, 4), 3, 6), ("r", "float32", (5,), 0, 5), ("e", "bfloat16", (2, 2), 1, 2)],
             [("w", "bfloat16", (10, 4), 6, 9), ("r", "float32", (5,), 0, 5), ("e", "bfloat16", (2, 2), 2, 2)],
             [("w", "bfloat16", (10, 4), 9, 10), ("r", "float32", (5,), 0, 5), ("e", "bfloat16", (2, 2), 2, 2)]]
    p = agree(views)
    assert p["w"].cuts == (0, 3, 6, 9, 10) and p["w"].owners == (0, 1, 2, 3) and p["w"].split
    assert p["e"].cuts == (0, 1, 2) and p["e"].owners == (0, 1)
    assert len(p["r"].owners) == 1 and not p["r"].split
    hsdp = [[("w", "bfloat16", (4, 2), 0, 2)], [("w", "bfloat16", (4, 2), 2, 4)],
            [("w", "bfloat16", (4, 2), 0, 2)], [("w", "bfloat16", (4, 2), 2, 4)]]
    owners = agree(hsdp)["w"].owners
    assert owners[0] in (0, 2) and owners[1] in (1, 3)
    assert len({agree([[(f"t{i}", "bfloat16", (2,), 0, 2)]] * 4)[f"t{i}"].owners[0] for i in range(32)}) == 4
    with pytest.raises(ValueError, match="do not tile"):
        agree([[("w", "bfloat16", (10, 4), 0, 4)], [("w", "bfloat16", (10, 4), 5, 10)]])
    with pytest.raises(ValueError, match="hold it as"):
        agree([[("w", "bfloat16", (10, 4), 0, 5)], [("w", "bfloat16", (10, 2), 5, 10)]])
    assert math.prod(p["w"].grid(None, anchor=True)[0][-1:]) == 10


def test_a_rival_publisher_stops_a_sharded_one_for_good(tmp_path):
    """World 1 (no process group): a DeltaPublisher that takes v1 first makes rank 0's commit of v1
    a ConflictError (the version's claim holds other weights): nothing of it is committed, and
    the sharded publisher stops for good, as a DeltaPublisher does."""
    from engine_ext.errors import ConflictError
    from engine_ext.trainer.publisher import DeltaPublisher
    from engine_ext.trainer.sharded import ShardedPublisher

    g = torch.Generator().manual_seed(0)
    w0 = {"w": torch.randn(64, 8, generator=g).to(torch.bfloat16)}
    store = str(tmp_path / "store")
    pub = ShardedPublisher(store, "toy", anchor_every=0, signing_key=None, timeout_s=30)
    pub.publish(w0)
    pub.wait()
    with DeltaPublisher(store, "toy", anchor_every=0) as rival:
        rival.publish({"w": w0["w"] + 1})
    pub.publish({"w": w0["w"] * 2})
    with pytest.raises(ConflictError):
        pub.wait()
    assert 1 in pub.aborted and json.loads((tmp_path / "store" / "LATEST").read_text())["signed"]["version"] == 1
    with pytest.raises(ConflictError, match="stopped"):
        pub.publish({"w": w0["w"] * 3})
    with pytest.raises(ConflictError, match="stopped"):
        pub.close()  # (as a stopped DeltaPublisher's close: it says so again)


def test_world2_fsdp_moe_publishes_the_checkpoint_layout_per_rank(tmp_path):
    """A transformers 5 Qwen3-MoE holds its experts fused in memory (``mlp.experts.gate_up_proj``
    [E, 2I, H], FSDP2 shards it by experts) and per expert on the Hub, which is what the engines
    load. Each rank converts its own rows with the model's own conversions (an expert per row:
    whole per-expert tensors of the rank holding them), so the versions name exactly the Hub's
    tensors, and hold bit for bit what a single-process publish of the gathered model would
    (``to_checkpoint_layout`` of the model reassembled from the ranks' rows); nothing gathered."""
    import transformers
    from safetensors import safe_open

    from engine_ext.tiny_models import make_model
    from engine_ext.trainer.checkpoint_layout import to_checkpoint_layout

    model_dir = make_model(tmp_path / "model", "qwen3-moe", hidden=64, vocab=256)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        hub = set(f.keys())
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in hub and not any("gate_up_proj" in n for n in hub)
    (tmp_path / "out").mkdir()
    cfg = {"store": str(tmp_path / "store"), "out": str(tmp_path / "out"), "steps": 2, "hf_model": str(model_dir),
           "lr": 1e-3, "timeout_s": 60, "publish_module": True}
    codes = sharded_procs.run(2, cfg)
    s = summaries(tmp_path / "out", 2)
    assert codes == [0, 0] and not any("error" in x for x in s), [x.get("traceback") for x in s]
    layout_model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))  # for its conversions only
    for v in range(3):
        got = served(cfg["store"], v)
        assert set(got) == hub, sorted(set(got) ^ hub)[:6]
        equal(got, to_checkpoint_layout(reassemble(tmp_path / "out", 2, v), layout_model))
    assert served(cfg["store"], 2)["model.layers.0.mlp.experts.5.gate_proj.weight"].shape == (32, 64)


def test_rows_convert_to_the_checkpoint_layout_like_the_whole_tensor():
    """Any cut of a transformers 5 MoE's in-memory tensors into row ranges (uneven, an empty one,
    one row) converts, range by range, into exactly what ``save_pretrained`` writes for the
    whole model; a conversion that mixes rows is refused, not guessed."""
    from transformers.core_model_loading import Chunk, SplitModulelist, Transpose, revert_weight_conversion

    from engine_ext.tiny_models import build
    from engine_ext.trainer import checkpoint_layout as cl

    model = build("qwen3-moe", vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, seed=0, std=0.02)
    state = {n: p.detach() for n, p in model.named_parameters()}
    want = revert_weight_conversion(model, dict(state))
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        n = len(t) if t.dim() else 1
        for a, b in [(0, 3), (3, 3), (3, 4), (4, n)] if n > 4 else [(0, n)]:
            for r in cl.rows_in_checkpoint_layout(model, name, t[a:b] if t.dim() else t, tuple(t.shape), a):
                assert r.shape == tuple(want[r.name].shape)
                pieces.setdefault(r.name, {})[r.start] = r.tensor
        assert set(cl.checkpoint_names(model, name, tuple(t.shape), t.dtype)) <= set(want)
    assert set(pieces) == set(want)
    for name, by_start in pieces.items():
        got = torch.cat([by_start[s] for s in sorted(by_start)]) if len(by_start) > 1 else next(iter(by_start.values()))
        assert torch.equal(got, want[name]), name
    assert cl._row_local([Chunk(dim=1), SplitModulelist(dim=0)]) is True
    assert cl._row_local([Chunk(dim=2)]) is False
    assert cl._row_local([Chunk(dim=0)]) is None and cl._row_local([Transpose(dim0=0, dim1=1)]) is None
