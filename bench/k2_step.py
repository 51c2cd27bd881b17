"""One Kimi-K2-size step's critical path, phase by phase, on this host (issue 42).

    python bench/k2_step.py                # K2: 61 layers x 384 experts (about 4 minutes, 8 GB)
    python bench/k2_step.py --layers 4     # a slice of it, quicker
    python bench/k2_step.py --json out.json

A 1T fp8 MoE (DeepSeek-V3 / Kimi-K2 shapes: 61 layers x 384 experts x 3 matrices of 2048 x 7168,
fp8 e4m3 with fp32 128 x 128 block scales; 140,790 tensors) takes one delta changing 0.3 % of
every weight. The path from the trainer's last optimizer step to every rank serving it:

1. **commit** (rank 0 of the sharded publisher, measured at full size): the 16 ranks' part manifests
   (one per expert-parallel rank, each listing its experts' cells; rank 0 also the dense tensors)
   are joined (``merge_parts``), validated, written as format 10 (tables and name index) and signed.
   The data blobs are not written: the ranks wrote them before, in parallel.
2. **manifest and signature** (every reader; measured): the signed manifest read and verified.
3. **driver** (one per replica; measured): the whole manifest read once (every tensor table and the
   name index), the checks that need every entry (tensor set, model fingerprints, overlaps).
4. **rank metadata** (measured): one expert-parallel rank of 16 and one tensor-parallel rank of 8
   read the name index, the tables holding their tensors and the cell tables of the cells they fetch,
   from a local store and from the HTTP store on loopback.
5. **fetch, decode, apply** (measured on one layer's data, then extrapolated to 61 layers): real
   weights of that rank's share of one layer (EP 16: its 24 experts whole; TP 8: its slices of 24
   experts, x16 for the layer's 384) are published by ``DeltaPublisher`` (anchor, then a delta of
   0.3 % +-1 ULP fp8 changes: synthetic, not training data), then fetched by range (local store
   and HTTP on loopback: the test server, ``tests/servers.py``), decoded, and applied in place by the
   rank code the engines run (``RankUpdater.apply``: undo log and fingerprints; the pause). Dense
   tensors (attention, router, norms: 0.3 % of the bytes) and the block scales are left out of the
   data. Random +-1-ULP changes do not pay for the context coder: the publisher codes them v1 (pco).

Each phase is printed with its share of the 5 s goal (docs/SCALE.md): figures marked ``measured``
ran at full size; ``x61`` ones are one layer's measured cost times 61 (``x976``: x16 experts, x61 layers).
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE), str(HERE.parent / "tests")]

import manifest_size as ms  # noqa: E402
from engine_ext.store import open_store  # noqa: E402
from engine_ext.store.reader import load_cells, open_held, open_manifest  # noqa: E402
from engine_ext.store.signing import Signer, Trust, generate_key  # noqa: E402
from engine_ext.trainer.builder import commit, merge_parts  # noqa: E402

BUDGET = {"commit": 0.5, "manifest": 0.05, "driver": 0.3, "metadata": 0.3, "fetch": 2.5, "decode": 1.15, "apply": 0.2}
GOAL_S = 5.0  # publish to every replica serving (SCALE.md); the apply is the pause (goal 0.2 s)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def full_size(layers: int, experts: int, root: Path, key: str) -> dict:
    """Phases 1-4 on the whole model's manifest (no data blobs): commit, manifest, driver, rank metadata."""
    from servers import serve_http

    shapes = ms.moe_tensors(layers, experts)
    names = [n for n, _, _ in shapes]
    ep = 16
    parts = []
    for r in range(ep):  # rank r: its experts; rank 0 the dense tensors too
        mine = ms.ep_names(names, experts, ep, r)
        own = [s for s in shapes if s[0] in mine and (".experts." in s[0] or r == 0)]
        parts.append(ms.delta_manifest(own, part=f"r{r}."))
    out: dict = {"tensors": len(shapes)}
    merged, out["merge_s"] = timed(lambda: merge_parts(parts, names))
    out["cells"] = sum(len(t.chunks or ()) for t in merged.tensors)
    parts.clear()  # their chunks: memory the reads below want
    store = open_store(str(root))
    signer = Signer([key])
    _, out["commit_s"] = timed(functools.partial(commit, store, merged, signer))
    _, out["validate_s"] = timed(merged.validate)  # inside commit too: its share, timed apart
    del merged  # rank 0's: the readers below are other processes
    gc.collect()
    trust = Trust.from_public_keys([key + ".pub"])
    raw = (root / "v00000002.json").read_bytes()
    out["manifest_bytes"] = len(raw)
    by_name = {n: s for n, _, s in shapes}
    wants = {"ep16": {n: [((0,) * len(by_name[n]), tuple(by_name[n]))] for n in ms.ep_names(names, experts, ep)},
             "tp8": {n: ms.tp_boxes(n, s) for n, s in by_name.items()}}

    def manifest_and_signature(st):
        raw = st.read("v00000002.json")
        trust.verify_detached(raw, st.read("v00000002.json.sig"), st.key_uri("v00000002.json"))
        return raw

    def rank_metadata(st, want):  # what RankUpdater.fetch does before it fetches data (selection: its rule)
        from engine_ext.format.chunks import meets

        m, n = open_held(st, raw, set(want))
        sel = {}
        for t in m.tensors:
            if t.nnz:
                whole = any(a == (0,) * len(t.shape) and tuple(z) == tuple(t.shape) for a, z in want[t.name])
                sel[t.name] = None if t.grid is None or whole else {
                    i for i, b in enumerate(t.boxes()) if any(meets(b, a, z) for a, z in want[t.name])}
        n += load_cells(st, m, {k for k, v in sel.items() if v is None or v})
        return m, sel, n + len(raw)

    def data_bytes(m, sel):
        return sum(t.length for t in m.tensors if t.nnz and t.grid is None) + sum(
            c.length for t in m.tensors if t.chunks for c in t.chunks if sel[t.name] is None or c.cell in sel[t.name])

    with serve_http(root) as srv:
        for where, st in (("local", store), ("http", open_store(f"{srv.url}/"))):
            _, out[f"manifest_{where}_s"] = timed(lambda: manifest_and_signature(st))
            m, out[f"driver_{where}_s"] = timed(lambda: open_manifest(st, raw))
            assert len(m.tensors) == len(shapes)
            del m  # the driver's: the ranks are other processes
            gc.collect()
            for rank, want in wants.items():
                (m, sel, read), out[f"{rank}_metadata_{where}_s"] = timed(lambda: rank_metadata(st, want))
                out[f"{rank}_metadata_bytes"], out[f"{rank}_data_bytes"] = read, data_bytes(m, sel)
                del m
                gc.collect()
    return out


def fp8_step(shape, density: float, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A base fp8 matrix and the next version: ``density`` of its elements moved by one ULP (bits +-1)."""
    base = (torch.randn(shape, generator=g) * 0.05).to(torch.float8_e4m3fn)
    bits = base.view(torch.uint8).clone().reshape(-1)
    n = bits.numel()
    idx = torch.randperm(n, generator=g)[:int(n * density)]
    step = torch.where(torch.rand(len(idx), generator=g) < 0.5, -1, 1)
    moved = (bits[idx].to(torch.int16) + step).clamp(1, 0x7E)  # stays finite, never the sign bit
    bits[idx] = moved.to(torch.uint8)
    return base, bits.view(torch.float8_e4m3fn).reshape(shape)


def one_layer(experts: int, density: float, root: Path) -> dict:
    """Phase 5 on real weights: one layer's share of an EP 16 rank (24 experts) and a TP 8 rank (its
    slices of the same 24 experts), fetched (local, HTTP), decoded and applied by the rank code."""
    from servers import serve_http

    from engine_ext.store.reader import TensorBases, _decode_parts, _parts, _read_ranges
    from engine_ext.trainer.publisher import DeltaPublisher
    from fake_ranks import make_rank
    import hashlib

    g = torch.Generator().manual_seed(0)
    base, new = {}, {}
    for e in range(experts):
        for proj, shape in (("gate_proj", (2048, 7168)), ("up_proj", (2048, 7168)), ("down_proj", (7168, 2048))):
            name = f"model.layers.0.mlp.experts.{e}.{proj}.weight"
            base[name], new[name] = fp8_step(shape, density, g)
    with DeltaPublisher(str(root), "k2-layer", anchor_every=0, dtype=None) as pub:
        pub.publish(base)
        _, publish_s = timed(lambda: pub.publish(new))
    out = {"publish_delta_s": publish_s, "changes": 0}
    store = open_store(str(root))
    m = open_manifest(store, (root / "v00000001.json").read_bytes())
    out["changes"] = sum(t.nnz for t in m.tensors)
    out["delta_bytes"] = m.payload_bytes
    load_cells(store, m)
    coders = [p.positions.coder for t in m.tensors if t.nnz for p in (t.chunks or [t])]
    out["coders"] = {c: coders.count(c) for c in sorted(set(coders))}
    rows = [n for n in base if "down_proj" not in n]
    ranks = {"ep16": make_rank(0, base, sharded=(), world=1),
             "tp8": make_rank(0, base, sharded=tuple(base), by_column=tuple(n for n in base if n not in rows), world=8)}
    with serve_http(root) as srv:
        for rank, up in ranks.items():
            up.setup()
            for where, st in (("local", store), ("http", open_store(f"{srv.url}/"))):
                mm, _ = open_held(st, (root / "v00000001.json").read_bytes(), up.held())
                sel = up.selection(mm)
                load_cells(st, mm, sel)
                parts = _parts(mm, sel)
                sha = {(p.blob, p.offset): p.sha256 for p in parts}

                def check(k, piece):
                    assert hashlib.sha256(piece).hexdigest() == sha[k]

                (data, read), out[f"{rank}_fetch_{where}_s"] = timed(
                    lambda: _read_ranges(st, mm, [(p.blob, p.offset, p.length) for p in parts], 8, check))
                out[f"{rank}_fetch_bytes"] = read
            deltas, out[f"{rank}_decode_s"] = timed(lambda: _decode_parts(parts, data.__getitem__, 8, TensorBases(base)))
            out[f"{rank}_changes"] = sum(d.nnz for d in deltas)
            _, out[f"{rank}_apply_s"] = timed(lambda: up.apply(deltas))
            up.commit(1)
            for name in list(base)[:3]:  # bit-exact: the rank's share equals the new version's
                held = up.module.param(name)
                assert torch.equal(held.view(torch.uint8), _share(new[name], up.module, name).view(torch.uint8)), name
    return out


def _share(t: torch.Tensor, module, name: str) -> torch.Tensor:
    p = module.param(name)
    if name not in module.sharded:
        return t
    if name in module.by_column:
        return t[:, :p.shape[1]]
    return t[:p.shape[0]]


def table(full: dict, layer: dict, layers: int, experts: int, sample: int) -> list[tuple]:
    """(phase, EP 16 local, EP 16 HTTP, TP 8 local, TP 8 HTTP, how, budget) in seconds; the data phases are
    one layer's sample times the layers (and the experts per sample: a TP rank holds a slice of each)."""
    x_ep, x_tp = layers * (experts // 16) / sample, layers * experts / sample
    both = lambda k: (full[f"{k}_local_s"], full[f"{k}_http_s"]) * 2  # noqa: E731 - the same for either rank
    rows = [("commit (rank 0: merge, validate, tables, sign)", *(full["merge_s"] + full["commit_s"],) * 4, "measured", BUDGET["commit"]),
            ("manifest + signature", *both("manifest"), "measured", BUDGET["manifest"]),
            ("driver: the whole manifest, once per replica", *both("driver"), "measured", BUDGET["driver"]),
            ("rank metadata: index, own tables, own cell tables", full["ep16_metadata_local_s"], full["ep16_metadata_http_s"],
             full["tp8_metadata_local_s"], full["tp8_metadata_http_s"], "measured", BUDGET["metadata"]),
            ("fetch the rank's bytes", layer["ep16_fetch_local_s"] * x_ep, layer["ep16_fetch_http_s"] * x_ep,
             layer["tp8_fetch_local_s"] * x_tp, layer["tp8_fetch_http_s"] * x_tp, f"x{x_ep:g} / x{x_tp:g}", BUDGET["fetch"]),
            ("decode", *(layer["ep16_decode_s"] * x_ep,) * 2, *(layer["tp8_decode_s"] * x_tp,) * 2,
             f"x{x_ep:g} / x{x_tp:g}", BUDGET["decode"]),
            ("apply in place (the pause)", *(layer["ep16_apply_s"] * x_ep,) * 2, *(layer["tp8_apply_s"] * x_tp,) * 2,
             f"x{x_ep:g} / x{x_tp:g}", BUDGET["apply"])]
    total = tuple(sum(r[i] for r in rows) for i in range(1, 5))
    return rows + [("total: publish to serving", *total, "", GOAL_S)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--sample-experts", type=int, default=24, help="experts of the one layer whose data is real")
    ap.add_argument("--density", type=float, default=0.003)
    ap.add_argument("--json", help="write every figure here")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="k2-step-") as tmp:
        tmp = Path(tmp)
        key = str(tmp / "k2.key")
        generate_key(key)
        (tmp / "full").mkdir()
        full = full_size(a.layers, a.experts, tmp / "full", key)
        (tmp / "layer").mkdir()
        layer = one_layer(a.sample_experts, a.density, tmp / "layer")
    rows = table(full, layer, a.layers, a.experts, a.sample_experts)
    mb = 1 << 20
    print(f"{full['tensors']:,} tensors, {full['cells']:,} cells; signed manifest {full['manifest_bytes'] / 1024:.0f} KiB; "
          f"commit {full['merge_s']:.2f} s merge + {full['commit_s']:.2f} s (of which validate {full['validate_s']:.2f} s)")
    for rank in ("ep16", "tp8"):
        meta, data = full[f"{rank}_metadata_bytes"], full[f"{rank}_data_bytes"]
        print(f"{rank}: metadata {meta / mb:.1f} MiB for {data / mb:.1f} MiB of data ({100 * meta / data:.1f} %)")
    print(f"one layer's sample ({a.sample_experts} experts): {layer['changes']:,} changes, {layer['delta_bytes'] / mb:.1f} MiB "
          f"({layer['delta_bytes'] / max(1, layer['changes']):.2f} B per change); EP 16 rank fetched "
          f"{layer['ep16_fetch_bytes'] / mb:.1f} MiB, TP 8 rank {layer['tp8_fetch_bytes'] / mb:.1f} MiB; parts by coder "
          f"{layer['coders']}")
    print("| phase | EP 16, local | EP 16, HTTP | TP 8, local | TP 8, HTTP | how | budget s |\n|---|---:|---:|---:|---:|---|---:|")
    for name, *secs, how, budget in rows:
        print(f"| {name} | " + " | ".join(f"{x:.2f}" for x in secs) + f" | {how} | {'' if budget is None else budget} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"full": full, "layer": layer, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
