"""What a manifest weighs for a model of very many tensors, inline (format 5) and in tables (format 10).

    python bench/manifest_size.py                     # a Kimi-K2-like MoE: 61 layers x 384 experts, fp8 + scales
    python bench/manifest_size.py --layers 4 --ep 16  # a slice of it, quicker

No weights are made: the manifest of one delta version is built from the model's shapes with
every expert matrix changed (a 0.3 % step changes every cell of a 7168 x 2048 matrix), each cut
by the publisher's default grid, with byte ranges and hashes of realistic sizes. It is then
written as the publisher writes it (:func:`engine_ext.trainer.builder._tables_blob`), read back
whole (:func:`engine_ext.format.tables.resolve`: what the driver reads, once per version) and as one
expert-parallel rank and one tensor-parallel rank read it (the name index, the tables holding their
tensors, the cell tables of the cells they need: :func:`rank_read`), and measured.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine_ext import settings  # noqa: E402
from engine_ext.format import cell_reads, chunks  # noqa: E402
from engine_ext.format import fingerprint as fpr  # noqa: E402
from engine_ext.format import tables as tables_mod  # noqa: E402
from engine_ext.format.context.blocks import shard_dim  # noqa: E402
from engine_ext.format.manifest import Blob, Chunk, Manifest, Segment, TensorEntry  # noqa: E402
from engine_ext.trainer import blob_layout  # noqa: E402


def moe_tensors(layers: int, experts: int, hidden: int = 7168, inter: int = 2048, block: int = 128):
    """(name, dtype, shape) of a DeepSeek-V3 / Kimi-K2-like MoE's expert weights (fp8 e4m3, 128 x 128
    block scales in fp32) and the few dense tensors per layer, in checkpoint order."""
    out = [("model.embed_tokens.weight", "bfloat16", [163840, hidden])]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", "bfloat16", [hidden]),
                (p + "post_attention_layernorm.weight", "bfloat16", [hidden]),
                (p + "self_attn.o_proj.weight", "float8_e4m3fn", [hidden, 8192]),
                (p + "mlp.gate.weight", "bfloat16", [experts, hidden])]
        for e in range(experts):
            for proj, shape in (("gate_proj", [inter, hidden]), ("up_proj", [inter, hidden]), ("down_proj", [hidden, inter])):
                name = f"{p}mlp.experts.{e}.{proj}.weight"
                out += [(name, "float8_e4m3fn", shape),
                        (name + "_scale_inv", "float32", [-(-shape[0] // block), -(-shape[1] // block)])]
    out.append(("lm_head.weight", "bfloat16", [163840, hidden]))
    return out


def delta_manifest(tensors, density: float = 0.003, bytes_per_change: float = 1.2, part: str = "",
                   reader_tp: int | None = None) -> Manifest:
    """One delta version's manifest: every tensor changed at ``density`` (at least one element),
    big ones cut into the publisher's grid's cells, bytes laid out in 256 MB blobs as the publisher lays them
    out for readers of TP ``reader_tp`` (default ``ENGINE_EXT_READER_TP``: :mod:`engine_ext.trainer.blob_layout`),
    blobs named after ``part`` (a sharded version's parts each name their own)."""
    shares = settings.current().reader_tp if reader_tp is None else reader_tp
    blobs, entries, open_blob = [], [], [blob_layout.Sections.for_shares(shares)]
    sha = hashlib.sha256(b"x").hexdigest()

    def place(n: int, section: int) -> tuple[int, int]:
        if not blobs or open_blob[0].size() + n > 256 << 20:
            open_blob[0].finish()
            open_blob[0] = blob_layout.Sections.for_shares(shares)
            blobs.append(Blob(f"v00000002.{part}{len(blobs)}.{sha[:32]}.bin", 0, sha))
        offset = open_blob[0].add(n, section)
        blobs[-1].size = open_blob[0].size()
        return len(blobs) - 1, offset

    lists: dict[tuple, list] = {}  # one list per distinct shape and grid, as the publisher's VersionBuilder shares
    for k, (name, dtype, shape) in enumerate(tensors):
        numel = 1
        for s in shape:
            numel *= s
        nnz = max(1, int(numel * density))
        fp, base = fpr.fmt(k * 7919 + 1), fpr.fmt(k * 104729 + 3)
        cuts = chunks.grid(shape, along=shard_dim(name, shape))  # as the publisher cuts it (DeltaEncoder.cuts)
        shape = lists.setdefault(("shape", *shape), list(shape))
        cuts = None if cuts is None else lists.setdefault(("grid", *map(tuple, cuts)), cuts)
        if cuts is None:
            n = max(2, int(nnz * bytes_per_change))
            blob, offset = place(n, blob_layout.COMMON)
            entries.append(TensorEntry(name, dtype, shape, nnz, fp, base, blob=blob, offset=offset, sha256=sha,
                                       positions=Segment("pco", n // 2), values=Segment("pco", n - n // 2, "rel")))
            open_blob[0].place(entries[-1], blob_layout.COMMON)
            continue
        cells = []
        boxes = chunks.boxes(cuts, shape)
        for c, box in enumerate(boxes):
            cn = nnz // len(boxes) + (1 if c < nnz % len(boxes) else 0)
            if not cn:
                continue
            n = max(2, int(cn * bytes_per_change))
            section = blob_layout.cell_section(name, shape, cuts, c, shares)
            blob, offset = place(n, section)
            cells.append(Chunk(c, cn, blob, offset, sha, Segment("pco", n // 2), Segment("pco", n - n // 2, "rel")))
            open_blob[0].place(cells[-1], section)
        entries.append(TensorEntry(name, dtype, shape, nnz, fp, base, grid=cuts, chunks=cells))
    open_blob[0].finish()
    m = Manifest(kind="delta", model="kimi-k2-like", version=2, base_version=1, anchor_version=0,
                 fingerprint="", base_fingerprint="", base_manifests=[sha], blobs=blobs, tensors=entries)
    m.fingerprint = fpr.fmt(fpr.model_fingerprint((t.name, fpr.parse(t.fingerprint)) for t in entries))
    m.base_fingerprint = fpr.fmt(fpr.model_fingerprint((t.name, fpr.parse(t.base_fingerprint)) for t in entries))
    m.format_version = m.lowest_version()
    return m


def ep_names(tensors, experts: int, ep: int, rank: int = 0) -> set[str]:
    """What one expert-parallel rank of ``ep`` holds: its experts' tensors and every dense one."""
    per = experts // ep
    mine = {f".experts.{e}." for e in range(rank * per, (rank + 1) * per)}
    return {n for n in tensors if ".experts." not in n or any(s in n for s in mine)}


def tp_boxes(name: str, shape) -> list:
    """What tensor-parallel rank 0 of 8 holds of a tensor (start, stop): rows of column-parallel
    weights (experts' gate and up, the embeddings), columns of row-parallel ones (down, o_proj),
    norms, scales of those and the router whole."""
    if len(shape) < 2 or "norm" in name or name.endswith("mlp.gate.weight"):
        return [((0,) * len(shape), tuple(shape))]
    by_column = "down_proj" in name or "o_proj" in name
    stop = (shape[0], -(-shape[1] // 8)) if by_column else (-(-shape[0] // 8), shape[1])
    return [((0, 0), stop)]


def rank_read(raw: bytes, bytes_of, want: dict) -> dict:
    """One rank's metadata read of a format-10 (or 12) manifest: the signed manifest, the name index, the
    tables holding ``want`` {name: its boxes}, the cell tables of the cut tensors it needs cells of (format
    12: the cell sections holding them). Returns the seconds, the bytes read and the data bytes it then
    fetches."""
    from engine_ext.store.reader import select_cells

    t0 = time.perf_counter()
    m = Manifest.from_json(raw)
    places, found = tables_mod.lookup(m, bytes_of(m.index), want)
    got = {i: bytes_of(m.tables[i]) for i in places}
    tables_mod.select(m, places, got, want, found)
    read = len(raw) + m.index.length + sum(len(b) for b in got.values())
    selection, _ = select_cells(m, {n: tuple(b) for n, b in want.items()})  # the cells it fetches
    cut = cell_reads.CutTensors.of(m, selection, keep=True)
    own = [None if r is None else bytes_of(r) for r in cut.tables]
    sections = {k: bytes_of(r) for k, r in cell_reads.sections_wanted(cut).items()}
    read += sum(len(b) for b in own if b is not None) + sum(map(len, sections.values()))
    cell_reads.set_cells(m, cut, own, sections)
    seconds = time.perf_counter() - t0
    data = sum(t.length for t in m.tensors if t.nnz and t.grid is None)
    data += sum(c.length for i in cut.rows.tolist() for c in m.tensors[i].chunks)  # the chunks of the cells it fetches
    return {"seconds": seconds, "read_bytes": read, "data_bytes": data, "tensors": len(m.tensors)}


def measure(layers: int, experts: int, ep: int, tp: bool = True, reader_tp: int = 8) -> dict:
    """The manifest, its tables and two ranks' metadata reads, published for ``reader_tp``-way readers (cell
    sections, format 12; 1: format 10's cell tables)."""
    from engine_ext.trainer.builder import _tables_blob

    t0 = time.perf_counter()
    shapes = moe_tensors(layers, experts)
    m = delta_manifest(shapes)
    built = time.perf_counter() - t0
    inline = len(m.to_json())
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        wire, (_, path) = _tables_blob(m, tmp, shares=reader_tp)
        written = time.perf_counter() - t0
        raw = wire.to_json()
        blob = open(path, "rb").read()
    base = len(m.blobs)  # the tables' blob

    def bytes_of(ref):
        assert ref.blob == base
        return blob[ref.offset:ref.offset + ref.length]

    t0 = time.perf_counter()
    r = Manifest.from_json(raw)
    tables_mod.resolve(r, [bytes_of(ref) for ref in r.tables], bytes_of(r.index))
    whole = time.perf_counter() - t0
    tensor_tables = sum(ref.length for ref in r.tables) + r.index.length
    by_name = {n: s for n, _, s in shapes}
    ep_rank = rank_read(raw, bytes_of, {n: [((0,) * len(by_name[n]), tuple(by_name[n]))]
                                        for n in ep_names(by_name, experts, ep)})
    tp_rank = rank_read(raw, bytes_of, {n: tp_boxes(n, s) for n, s in by_name.items()}) if tp else None
    return {"layers": layers, "experts": experts, "tensors": len(m.tensors),
            "cells": sum(len(t.chunks or ()) for t in m.tensors), "payload_bytes": m.payload_bytes,
            "inline_manifest_bytes": inline, "manifest_bytes": len(raw), "format_version": wire.format_version, "tensor_tables_bytes": tensor_tables,
            "cell_tables_bytes": len(blob) - tensor_tables, "ep_rank": ep_rank, "tp_rank": tp_rank,
            "seconds": {"build": round(built, 2), "write_tables": round(written, 2),
                        "read_whole": round(whole, 2), "ep_rank_read": round(ep_rank["seconds"], 3),
                        "tp_rank_read": round(tp_rank["seconds"], 3) if tp else None}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--ep", type=int, default=16, help="expert-parallel ranks (rank 0's cell tables are measured)")
    ap.add_argument("--reader-tp", type=int, default=settings.current().reader_tp,
                    help="the TP degree cell sections are written for (format 12); 1: format 10's cell tables")
    a = ap.parse_args()
    r = measure(a.layers, a.experts, a.ep, reader_tp=a.reader_tp)
    mb = 1 << 20
    print(f"{r['tensors']:,} tensors, {r['cells']:,} cells, a {r['payload_bytes'] / (1 << 30):.1f} GiB delta")
    print(f"| | bytes |\n|---|---:|\n| format 5 manifest (inline) | {r['inline_manifest_bytes'] / mb:.1f} MiB |")
    print(f"| format {r['format_version']} manifest (signed) | {r['manifest_bytes'] / 1024:.1f} KiB |")
    print(f"| tensor tables and name index (all) | {r['tensor_tables_bytes'] / mb:.1f} MiB |")
    print(f"| cell tables and sections (all) | {r['cell_tables_bytes'] / mb:.1f} MiB |")
    for what, k in ((f"one EP {a.ep} rank", "ep_rank"), ("one TP 8 rank", "tp_rank")):
        x = r[k]
        print(f"| {what}: metadata read / data fetched | {x['read_bytes'] / mb:.1f} MiB / {x['data_bytes'] / mb:.1f} MiB "
              f"({100 * x['read_bytes'] / x['data_bytes']:.1f} %), {x['seconds']:.2f} s |")
    print(json.dumps(r["seconds"]))

if __name__ == "__main__":
    main()
