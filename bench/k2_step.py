"""One Kimi-K2-size step's critical path, phase by phase, on this host (issues 42 and 52).

    python bench/k2_step.py                # K2: 61 layers x 384 experts (about 10 minutes, 8 GB, 4 GB of disk)
    python bench/k2_step.py --layers 4     # a slice of it, quicker
    python bench/k2_step.py --no-moto      # without the S3 store (its upload takes minutes at full size)
    python bench/k2_step.py --json out.json

A 1T fp8 MoE (DeepSeek-V3 / Kimi-K2 shapes: 61 layers x 384 experts x 3 matrices of 2048 x 7168,
fp8 e4m3 with fp32 128 x 128 block scales; 140,790 tensors) takes one delta changing 0.3 % of
every weight. The path from the trainer's last optimizer step to every rank serving it, for one
expert-parallel rank of 16 and one tensor-parallel rank of 8, from four stores: a local directory, HTTP on
loopback (the test server, ``tests/servers.py``), the same with 20 ms added to every request (an object
store's first byte: :class:`PerRequest`, which also counts requests), and S3 (``moto_server`` on loopback):

1. **commit** (the sharded publisher, full size): each of the 16 ranks' part manifests (one per
   expert-parallel rank, each listing its experts' cells; rank 0 also the dense tensors) is validated and
   written as format-12 tables by its rank (``table_parts.write_part``: timed one after another here, in
   parallel on a trainer, so the slowest counts), then rank 0 checks the ranks' names, writes the name
   index and signs (``table_parts.commit_tables``). The data blobs are not written: the ranks wrote them
   before, in parallel. ``--joined`` also times the commit before (rank 0 joins every part, validates and
   tables it all: ``merge_parts``, ``commit``), in the same run.
2. **manifest and signature** (every reader; full size): the signed manifest read and verified.
3. **driver** (one per replica; full size): the whole manifest read once (every tensor table and the
   name index), the checks that need every entry (model fingerprints, overlaps), then what the server's
   transaction checks before any rank fetches: every tensor against the served model's names, shapes and
   dtypes, the decode budget, the tensors the version writes. Timed as for every version after a replica's
   first (the names a model keeps are decoded and hashed once per process: ``tensor_records._KnownNames``); the
   first version's read is printed beside it.
4. **rank metadata** (full size): the name index, the tables holding the rank's tensors and the cell
   tables (format 12: the cell sections) of the cells it fetches. Timed as for every version after a rank's
   first, as the driver is (a rank looks up the same names every version: their keys are kept from its last,
   ``tables._held_keys``; 140 k SHA-256s for the TP rank); the first version's read is printed beside it.
5. **fetch** (full size): the rank's byte ranges of the data blobs, read as the rank reads them (close
   ranges as one request, 8 at a time) and hashed. The blobs are laid out as the publisher lays them out
   for ``ENGINE_EXT_READER_TP`` (``engine_ext/trainer/blob_layout.py``), with the sizes a 0.3 % step
   codes to (1.2 B per change); their contents are zeros (sparse files): the bytes are real only below.
6. **decode, 7. apply** (one layer's real data, times the layers): real weights of that rank's share of one
   layer (EP 16: its 24 experts whole; TP 8: its slices of 24 experts, x16 for the layer's 384) are
   published by ``DeltaPublisher`` (anchor, then a delta of 0.3 % +-1 ULP fp8 changes: synthetic, not
   training data), read from a local store, decoded (as for a rank's later versions: the best of 3 runs after
   a first, printed per change too: the goal is 30 ns), and applied in place by the rank code the engines run (``RankUpdater.apply``: undo log and
   fingerprints; the pause). Dense tensors (attention, router,
   norms: 0.3 % of the bytes) and the block scales are left out of the data. Random +-1-ULP changes do not
   pay for the context coder: the publisher codes them v1 (pco).

Each phase is printed with its share of the 5 s goal (docs/SCALE.md), and the rows a GPU node runs the
same (1-5) are summed against theirs (3.65 s); decode and apply are the GPU's on a real deployment.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE), str(HERE.parent / "tests")]

import manifest_size as ms  # noqa: E402
from engine_ext import settings  # noqa: E402
from engine_ext.format.bulk import collector_paused  # noqa: E402
from engine_ext.store import Store, open_store  # noqa: E402
from engine_ext.store.decoding import TensorBases, decode_parts  # noqa: E402
from engine_ext.store.reader import _read_ranges, plan  # noqa: E402
from engine_ext.store.reader import load_cells, open_held, open_manifest, select_cells  # noqa: E402
from engine_ext.store.signing import Signer, Trust, generate_key  # noqa: E402
from engine_ext.format import fingerprint as fpr  # noqa: E402
from engine_ext.format import tables, tensor_records  # noqa: E402
from engine_ext.store import reader  # noqa: E402
from engine_ext.trainer import table_parts  # noqa: E402
from engine_ext.trainer.builder import LATEST_TTL_S, commit, merge_parts  # noqa: E402
from engine_ext.trainer.publisher import DeltaPublisher  # noqa: E402
from fake_ranks import make_rank  # noqa: E402

BUDGET = {"commit": 0.5, "manifest": 0.05, "driver": 0.3, "metadata": 0.3, "fetch": 2.5, "decode": 1.15, "apply": 0.2}
GOAL_S = 5.0  # publish to every replica serving (SCALE.md); the apply is the pause (goal 0.2 s)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


class PerRequest(Store):
    """A store that counts its requests and adds ``latency`` seconds to each: an object store answers a
    request in tens of milliseconds however small it is. A real store (HTTP on loopback) does the reading."""

    def __init__(self, inner: Store, latency: float = 0.0):
        self.inner, self.latency, self.uri = inner, latency, inner.uri
        self.requests, self._lock = 0, threading.Lock()

    def _request(self) -> None:
        with self._lock:
            self.requests += 1
        if self.latency:
            time.sleep(self.latency)

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        self._request()
        return self.inner.read(key, max_bytes)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        self._request()
        return self.inner.read_range(key, start, length)

    def key_uri(self, key: str) -> str:
        return self.inner.key_uri(key)


@contextlib.contextmanager
def http_process(root: Path):
    """The tests' HTTP server (byte ranges, ETags) over ``root``, in a process of its own, as a real store is
    one, each file's ETag made before any phase is timed. Yields its URL."""
    code = ("import sys, time; sys.path[:0] = sys.argv[2:]; from servers import serve_http\n"
            "with serve_http(sys.argv[1]) as s:\n    print(s.url, flush=True)\n    sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(root), str(HERE.parent / "tests"), str(HERE.parent)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        store = open_store(f"{url}/")
        for f in sorted(root.iterdir()):  # each file's ETag, which a real store computes when it is written and
            store.exists(f.name)  # this server at its first request (the SHA-256 of a whole 256 MB blob)
        yield url
    finally:
        proc.stdin.close()  # its stdin ends: it stops serving and exits
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def stores(root: Path, moto: bool):
    """{name: PerRequest store} over ``root``: the local directory, HTTP on loopback, the same with 20 ms a
    request, and (``moto``) moto_server's S3 on loopback with ``root``'s files uploaded."""
    from servers import serve_s3

    with contextlib.ExitStack() as stack:
        url = stack.enter_context(http_process(root))
        out = {"local": PerRequest(open_store(str(root))), "http": PerRequest(open_store(f"{url}/")),
               "http+20ms": PerRequest(open_store(f"{url}/"), 0.020)}
        if moto:
            s3 = stack.enter_context(serve_s3())
            os.environ.update(s3.env)
            stack.enter_context(settings.override(s3_endpoint=s3.endpoint_url))
            bucket = open_store(f"s3://{s3.make_bucket()}/k2")
            t0 = time.perf_counter()
            for f in sorted(root.iterdir()):
                bucket.write_file(f.name, f)
            print(f"moto: {sum(f.stat().st_size for f in root.iterdir()) / (1 << 30):.1f} GiB uploaded in "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
            out["moto"] = PerRequest(bucket)
        yield out


def full_size(layers: int, experts: int, root: Path, key: str, moto: bool, joined: bool = False) -> dict:
    """Phases 1-5 at full size, on the whole model's manifest: commit, manifest, driver, rank metadata, and the
    ranks' fetch of their bytes from blobs laid out as the publisher lays them out (sizes and offsets real,
    contents zeros: the data phases' bytes are measured on one layer, :func:`one_layer`)."""
    shapes = ms.moe_tensors(layers, experts)
    names = [n for n, _, _ in shapes]
    ep = 16

    def ep_parts():  # rank r: its experts; rank 0 the dense tensors too
        owned = [ms.ep_names(names, experts, ep, r) for r in range(ep)]
        return [ms.delta_manifest([s for s in shapes if s[0] in owned[r] and (".experts." in s[0] or r == 0)],
                                  part=f"r{r}.") for r in range(ep)]

    parts = ep_parts()
    out: dict = {"tensors": len(shapes), "cells": sum(len(t.chunks or ()) for p in parts for t in p.tensors)}
    if joined:  # the commit before issue 52's item 1, side by side: rank 0 joins the parts and tables everything
        copies = ep_parts()
        merged, out["joined_merge_s"] = timed(lambda: merge_parts(copies, names))
        del copies
        with tempfile.TemporaryDirectory(dir=root.parent) as other:
            _, out["joined_commit_s"] = timed(functools.partial(commit, open_store(other), merged, Signer([key])))
        with collector_paused():  # as inside commit: its share, timed apart (unpaused, the collector's passes over
            _, out["joined_validate_s"] = timed(merged.validate)  # a million chunks would be counted too)
        del merged
        gc.collect()
    store = open_store(str(root))
    per = table_parts.per_table(len(names), ep)
    model_keys = np.sort(fpr.name_keys(names))  # what the publisher makes once, at its first version
    tparts, shift, rank_s = [], 0, []
    with tempfile.TemporaryDirectory(dir=root.parent) as spool:
        for r, part in enumerate(parts):  # each rank's own tables (in parallel on a real trainer: the slowest counts)
            (tp, file), s = timed(functools.partial(table_parts.write_part, part, spool, split=frozenset(), shift=shift,
                                                    tag=f"v00000002.r{r}", per=per))
            store.create_file(*file)  # uploaded with the rank's data blobs, in parallel: not timed
            shift += len(tp.part.blobs)
            tparts.append(tp)
            rank_s.append(s)
    parts.clear()
    out["rank_tables_s"], out["rank_tables_sum_s"] = max(rank_s), sum(rank_s)
    _, out["commit_s"] = timed(lambda: table_parts.commit_tables(store, tparts, [], model_keys, Signer([key]),
                                                                 LATEST_TTL_S, per))
    del tparts
    doc = json.loads((root / "v00000002.json").read_bytes())
    for b in doc["blobs"]:  # the ranks' data blobs, written before the commit (sparse files of their sizes)
        if not (root / b["key"]).exists():
            with open(root / b["key"], "wb") as f:
                f.truncate(b["size"])
    out["blobs"], out["delta_bytes"] = len(doc["blobs"]), sum(b["size"] for b in doc["blobs"])
    gc.collect()
    trust = Trust.from_public_keys([key + ".pub"])
    raw = (root / "v00000002.json").read_bytes()
    out["manifest_bytes"] = len(raw)
    by_name = {n: s for n, _, s in shapes}
    wants = {"ep16": {n: (((0,) * len(by_name[n]), tuple(by_name[n])),) for n in ms.ep_names(names, experts, ep)},
             "tp8": {n: tuple(ms.tp_boxes(n, s)) for n, s in by_name.items()}}
    for want in wants.values():  # equal box lists as one object each, as RankUpdater.boxes() keeps them
        same: dict = {}
        want.update({n: same.setdefault(b, b) for n, b in want.items()})

    def manifest_and_signature(st):
        raw = st.read("v00000002.json")
        trust.verify_detached(raw, st.read("v00000002.json.sig"), st.key_uri("v00000002.json"))
        return raw

    expected = {n: (tuple(s), d) for n, d, s in shapes}

    def driver(st):  # what the transaction's plan does with a version before any rank fetches (server/transaction.py)
        m = open_manifest(st, raw)
        reader.check_expected(m, expected, "v00000002.json")
        reader.check_decode_budget(m, 1 << 62)
        return m, m.columns().changed()

    def rank_metadata(st, want):  # what RankUpdater.fetch does before it fetches data (selection: its rule)
        m, n = open_held(st, raw, set(want))
        sel, _ = select_cells(m, want)
        n += load_cells(st, m, {k: v for k, v in sel.items() if v is None or v})  # a Selection, as fetch_selected passes
        return m, sel, n + len(raw)

    def fetch(st, m, sel):  # the rank's parts by range, each hashed as it arrives (zeros: not compared)
        parts = plan(m, sel)
        digests = parts.digests()  # as fetch_selected checks each part: its digest looked up, its bytes hashed
        _, read = _read_ranges(st, m, parts.ranges(), 8, lambda k, piece: (digests[k], hashlib.sha256(piece).digest()))
        return read

    with stores(root, moto) as by_name_store:
        tensor_records.forget_names()  # as in a fresh process: the first version's read
        (m, _), out["driver_first_s"] = timed(lambda: driver(by_name_store["local"]))
        del m
        gc.collect()
        for where, st in by_name_store.items():
            _, out[f"manifest_{where}_s"] = timed(lambda: manifest_and_signature(st))
            (m, written), out[f"driver_{where}_s"] = timed(lambda: driver(st))
            assert len(m.tensors) == len(shapes) and written and m.tensors._made is None  # no entry object made
            del m  # the driver's: the ranks are other processes
            gc.collect()
            for rank, want in wants.items():
                if where == "local":  # the rank's first version: its names' keys not yet kept
                    tables._HELD.clear()
                    _, out[f"{rank}_metadata_first_s"] = timed(lambda: rank_metadata(st, want))
                    gc.collect()
                tables._held_keys(frozenset(want))  # kept from its last version, as a rank keeps them
                st.requests = 0
                (m, sel, read), out[f"{rank}_metadata_{where}_s"] = timed(lambda: rank_metadata(st, want))
                out[f"{rank}_metadata_bytes"], out[f"{rank}_metadata_{where}_requests"] = read, st.requests
                st.requests = 0
                out[f"{rank}_fetch_bytes"], out[f"{rank}_fetch_{where}_s"] = timed(lambda: fetch(st, m, sel))
                out[f"{rank}_fetch_{where}_requests"] = st.requests
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
    """Phases 6 and 7 on real weights: one layer's share of an EP 16 rank (24 experts) and a TP 8 rank (its
    slices of the same 24 experts), read from a local store, decoded and applied by the rank code."""

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
    for rank, up in ranks.items():
        up.setup()
        mm, _ = open_held(store, (root / "v00000001.json").read_bytes(), up.held())
        sel = up.selection(mm)
        load_cells(store, mm, sel)
        parts = plan(mm, sel)
        data, _ = _read_ranges(store, mm, parts.ranges(), 8)
        # as for every version after a rank's first (whose decode loads the kernels: 2-4x a later one), best of 3
        runs = [timed(lambda: decode_parts(mm, parts, data.__getitem__, 8, TensorBases(base))) for _ in range(4)]
        deltas, out[f"{rank}_decode_s"] = runs[-1][0], min(s for _, s in runs[1:])
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


SAME_ON_GPU = ("commit", "manifest", "driver", "metadata", "fetch")  # phases a GPU node runs as this host does


def table(full: dict, layer: dict, rank: str, where: list[str], layers: int, experts: int, sample: int) -> list[tuple]:
    """One rank's rows: (phase, seconds per store in ``where``, how it was measured, its share of the goal).
    Decode and apply are one layer's sample (local) times the layers (and the experts per sample: a TP rank
    holds a slice of each); everything else ran at full size."""
    x = layers * (experts // 16) / sample if rank == "ep16" else layers * experts / sample
    per_store = lambda k: tuple(full[f"{k.format(w=w)}"] for w in where)  # noqa: E731
    rows = [("commit (the slowest rank's tables, then rank 0's index and signature)", "commit",
             (full["rank_tables_s"] + full["commit_s"],) * len(where), "full size"),
            ("manifest + signature", "manifest", per_store("manifest_{w}_s"), "full size"),
            ("driver: the whole manifest and the plan's checks, once per replica", "driver", per_store("driver_{w}_s"),
             f"full size (a replica's first version: {full['driver_first_s']:.2f} s local)"),
            ("rank metadata: index, own tables, own cell tables", "metadata", per_store(rank + "_metadata_{w}_s"),
             f"full size (a rank's first version: {full[rank + '_metadata_first_s']:.2f} s local)"),
            ("fetch the rank's bytes", "fetch", per_store(rank + "_fetch_{w}_s"), "full size (zeros)")]
    same = tuple(sum(r[2][i] for r in rows) for i in range(len(where)))
    rows.append(("**phases a GPU node runs the same**", "same", same, "", sum(BUDGET[k] for k in SAME_ON_GPU)))
    rows = [r if len(r) == 5 else (*r, BUDGET[r[1]]) for r in rows]
    ns = 1e9 * layer[f"{rank}_decode_s"] / layer[f"{rank}_changes"]
    rows += [("decode (CPU)", "decode", (layer[f"{rank}_decode_s"] * x,) * len(where),
              f"one layer x{x:g}: {ns:.0f} ns per change", BUDGET["decode"]),
             ("apply in place (CPU: the pause)", "apply", (layer[f"{rank}_apply_s"] * x,) * len(where), f"one layer x{x:g}",
              BUDGET["apply"])]
    total = tuple(same[i] + rows[-2][2][i] + rows[-1][2][i] for i in range(len(where)))
    return rows + [("**total: publish to serving**", "total", total, "", GOAL_S)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--sample-experts", type=int, default=24, help="experts of the one layer whose data is real")
    ap.add_argument("--density", type=float, default=0.003)
    ap.add_argument("--no-moto", action="store_true", help="leave out the S3 store (moto_server): its upload is slow")
    ap.add_argument("--joined", action="store_true",
                    help="also time the commit before issue 52 (rank 0 joins every part and tables it), side by side")
    ap.add_argument("--json", help="write every figure here")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="k2-step-") as tmp:
        tmp = Path(tmp)
        key = str(tmp / "k2.key")
        generate_key(key)
        (tmp / "full").mkdir()
        full = full_size(a.layers, a.experts, tmp / "full", key, moto=not a.no_moto, joined=a.joined)
        (tmp / "layer").mkdir()
        layer = one_layer(a.sample_experts, a.density, tmp / "layer")
    where = ["local", "http", "http+20ms"] + ([] if a.no_moto else ["moto"])
    mb = 1 << 20
    print(f"{full['tensors']:,} tensors, {full['cells']:,} cells; a {full['delta_bytes'] / (1 << 30):.2f} GiB delta in "
          f"{full['blobs']} blobs laid out for TP {settings.current().reader_tp}; signed manifest "
          f"{full['manifest_bytes'] / 1024:.0f} KiB; commit: each rank's tables {full['rank_tables_s']:.2f} s at the "
          f"slowest ({full['rank_tables_sum_s']:.2f} s for all 16), then rank 0 {full['commit_s']:.2f} s")
    if a.joined:
        print(f"the commit before (rank 0 joins and tables every part): {full['joined_merge_s']:.2f} s merge + "
              f"{full['joined_commit_s']:.2f} s (of which validate {full['joined_validate_s']:.2f} s)")
    print(f"one layer's sample ({a.sample_experts} experts): {layer['changes']:,} changes, {layer['delta_bytes'] / mb:.1f} MiB "
          f"({layer['delta_bytes'] / max(1, layer['changes']):.2f} B per change); parts by coder {layer['coders']}")
    by_rank = {}
    for rank, title in (("ep16", "EP 16 rank"), ("tp8", "TP 8 rank")):
        meta, data = full[f"{rank}_metadata_bytes"], full[f"{rank}_fetch_bytes"]
        reqs = ", ".join(f"{w} {full[f'{rank}_metadata_{w}_requests']} + {full[f'{rank}_fetch_{w}_requests']}" for w in where)
        print(f"\n{title}: metadata {meta / mb:.1f} MiB ({100 * meta / data:.1f} % of its data), data {data / mb:.0f} MiB; "
              f"requests (metadata + fetch): {reqs}")
        print(f"| phase | {' | '.join(where)} | how | share s |\n|---|{'---:|' * len(where)}---|---:|")
        by_rank[rank] = table(full, layer, rank, where, a.layers, a.experts, a.sample_experts)
        for name, _, secs, how, budget in by_rank[rank]:
            print(f"| {name} | " + " | ".join(f"{x:.2f}" for x in secs) + f" | {how} | {budget:g} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"full": full, "layer": layer, "tables": by_rank}, indent=1))


if __name__ == "__main__":
    main()
