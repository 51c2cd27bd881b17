"""Codec v2 (context-conditioned, on by default) against codec v1, the first-order bound and
Fireworks arc_v3, side by side on real training (bench/train_data.py).

    python bench/context_bench.py [--lr 1e-6 3e-6] [--pairs 4]

Per lr, over consecutive bf16 version pairs: bytes per changed element of v1
(``engine_ext.format.codec`` without a base), of v2 (the publisher's choice per tensor: the
context coder where it saves >= 10 %, headers and the version's step tables included), of
arc_v3 (``fireworks-delta-compression``, only where installed: ``bench/fireworks_codec.py``
says how; blob + checksum), and the first-order entropy bound (gaps + steps; the smaller of
pooled over the model and per tensor). Speeds on one thread: encode in MB of bf16 model per
second, decode against ``safetensors.torch.load_file`` of the same tensors from the page
cache, their bytes read (time ratio); then the context pass alone in base elements per second, on one core and
on every core.
"""
from __future__ import annotations

import argparse
import json
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.codec_bench import entropy_bits  # noqa: E402
from bench.train_data import versions  # noqa: E402
from engine_ext import settings  # noqa: E402
from engine_ext.format import codec  # noqa: E402
from engine_ext.format.context import blocks as context_blocks, codec as context_codec  # noqa: E402
from engine_ext.format.context import models as context_models, scan_kernels as context_kernels, symbols as context_symbols  # noqa: E402
from engine_ext.format.dtypes import BY_NAME, as_bits, step_between  # noqa: E402
from engine_ext.format.manifest import CONTEXT_CODERS  # noqa: E402

BF16 = BY_NAME["bfloat16"]
BYTES_FIRST = codec.Readers(mbps=0)  # what v2 codes wherever it saves 10 % (the publisher keeps it where it pays)


def pair_changes(a: dict, b: dict):
    out = []
    for name in a:
        ob, nb = as_bits(a[name]).reshape(-1), as_bits(b[name]).reshape(-1)
        pos = torch.nonzero(ob != nb).reshape(-1)
        if pos.numel():
            out.append((name, tuple(a[name].shape), ob, pos, ob[pos], nb[pos]))
    return out


def step_tables(ch) -> list[bytes]:
    """The version's step tables, as the publisher builds them."""
    return context_models.step_tables("bfloat16", np.concatenate([context_models.exponents(o.numpy(), "bfloat16") for *_, o, _ in ch]),
                                     np.concatenate([step_between(o, n, True).numpy() for *_, o, n in ch]))


def encode_all(ch, context: bool, readers: codec.Readers = BYTES_FIRST):
    tables = step_tables(ch) if context else []
    out = []
    for name, shape, ob, pos, o, nb in ch:
        policy = context_blocks.block_policy(name, shape)
        ctx = codec.Context(ob, policy, tables, readers) if context and policy is not None else None
        out.append(codec.encode(BF16, ob.numel(), pos, nb, o, context=ctx, shape=shape))
    return out, (tables if any(e.pos_coder in CONTEXT_CODERS for e in out) else [])


def decode_all(ch, encs, tables):
    for (_, shape, ob, pos, _, _), e in zip(ch, encs):
        if e.pos_coder in CONTEXT_CODERS:  # what a rank runs, the base read from memory
            base = ob.numpy()
            context_codec.decode(context_codec.StoredPart("bfloat16", shape, None, e.pos, e.val, pos.numel(), tables), lambda box: context_blocks.box_of(base, shape, box))
        else:
            codec.decode_positions(e.pos_coder, e.pos, pos.numel(), ob.numel())
            codec.decode_values(e.val_coder, e.val, pos.numel(), BF16)


def load_all(path: str) -> list:
    """safetensors' load of every tensor, its bytes read (load_file alone maps the file and reads nothing)."""
    return [t.clone() for t in load_file(path).values()]


def scan_rates(n: int = 1 << 26, density: float = 0.01) -> dict[str, tuple[float, float]]:
    """Base elements per second of the context pass over a bf16 part of ``n`` elements cut into
    8 x 8 blocks at ``density`` changes, K = 16 classes, per build of the pass (numba and every
    compiled variant this CPU runs, measured alternately): {pass: (one core, every core)}."""
    rng = np.random.default_rng(0)
    shape = (1 << 13, n >> 13)
    base = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 0.02).bfloat16()
    u = as_bits(base).numpy().view(np.uint16)
    bl = context_blocks.part_blocks(shape, None, 0b0011)
    edges = list(range(110, 125))
    shift, mask, lut = context_models.class_key(edges, "bfloat16", n)
    K = len(edges) + 1
    ranks, starts = [], np.zeros((bl.S, K + 1), np.int64)
    at = 0
    for b in range(bl.S):
        cls = lut[(u.reshape(shape)[tuple(slice(x, y) for x, y in zip(*bl.boxes[b]))].reshape(-1) >> shift) & mask]
        pops = np.bincount(cls, minlength=K)
        starts[b, 0] = at
        for c in range(K):
            k = int(pops[c] * density)
            ranks.append(np.sort(rng.choice(pops[c], k, replace=False)) if k else np.empty(0, np.int64))
            at += k
            starts[b, c + 1] = at
    ranks = np.concatenate(ranks).astype(np.int64)
    passes = ["numba", *(context_kernels._scan_native.ISAS if context_kernels._scan_native is not None else ())]
    want = None
    for p in passes:  # compiled, pages touched, and every build finds the same positions
        with settings.override(context_pass=p):
            got = context_kernels.scan(u, "bfloat16", edges, bl, ranks, starts)
        assert want is None or (np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])), p
        want = got
    times = {(p, c): float("inf") for p in passes for c in (1, os.cpu_count() or 1)}
    old = context_kernels.PARALLEL_MIN
    try:
        for _ in range(3):  # alternately, so that a noisy neighbour slows every build alike
            for p, cores in times:
                context_kernels.PARALLEL_MIN = n + 1 if cores == 1 else 0
                with settings.override(context_pass=p):
                    t = time.perf_counter()
                    context_kernels.scan(u, "bfloat16", edges, bl, ranks, starts)
                    times[p, cores] = min(times[p, cores], time.perf_counter() - t)
    finally:
        context_kernels.PARALLEL_MIN = old
    return {p: (n / times[p, 1], n / times[p, os.cpu_count() or 1]) for p in passes}


def print_scan_rates(rates: dict[str, tuple[float, float]]) -> None:
    print(f"context pass, ns per base element (bf16, 8 x 8 blocks, 16 classes), one core and {os.cpu_count()}:")
    print("| pass | one core | every core | numba / this, one core |\n|---|---|---|---|")
    for p, (one, every) in rates.items():
        print(f"| {p} | {1e9 / one:.3f} | {1e9 / every:.3f} | {one / rates['numba'][0]:.2f}x |")


def best(fn, repeat=3):
    t = float("inf")
    for _ in range(repeat):
        s = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - s)
    return t


def at_scale(tensors: int = 8, rows: int = 4096, cols: int = 4096, density: float = 0.01):
    """Decode of one version of big tensors (synthetic: small weights change more often, as in
    training) against load_file of the same tensors, where per-part costs no longer count:
    (changed elements, seconds to decode on one thread, on every core, seconds to load_file)."""
    from concurrent.futures import ThreadPoolExecutor

    g = torch.Generator().manual_seed(0)
    parts, new_sd = [], {}
    for i in range(tensors):
        w = (torch.randn(rows, cols, generator=g) * 0.02).bfloat16()
        rate = (density * 0.004 / w.float().abs().clamp(min=1e-4)).clamp(max=0.5)
        chg = torch.rand(rows, cols, generator=g) < rate
        bits = as_bits(w).clone()
        bits[chg] += torch.where(torch.rand(rows, cols, generator=g) < 0.5, 1, -1)[chg].to(torch.int16)
        new_sd[f"model.layers.{i}.mlp.up_proj.weight"] = bits.view(torch.bfloat16)
        parts.append((f"model.layers.{i}.mlp.up_proj.weight", (rows, cols), as_bits(w).reshape(-1), chg.reshape(-1)))
    ch = [(n, shape, ob, torch.nonzero(c).reshape(-1), ob[c], as_bits(new_sd[n]).reshape(-1)[c]) for n, shape, ob, c in parts]
    t0 = time.perf_counter()
    encs, tables = encode_all(ch, True)
    encode_s = time.perf_counter() - t0
    assert all(e.pos_coder == "ctx-rans" for e in encs)
    one = best(lambda: decode_all(ch, encs, tables), 2)
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        every = best(lambda: list(pool.map(lambda i: decode_all([ch[i]], [encs[i]], tables), range(len(ch)))), 2)
    path = os.path.join(tempfile.mkdtemp(), "big.safetensors")
    save_file(new_sd, path)
    load = best(lambda: load_all(path), 3)
    return sum(c[3].numel() for c in ch), sum(c[2].numel() for c in ch), one, every, load, encode_s


def _synthetic(rows: int, cols: int, dens: float, g: torch.Generator, name: str):
    """A bf16 tensor and its next version where small weights change more often (as in training)."""
    w = (torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, cols, generator=g)) * 0.02).bfloat16()
    inv = 1.0 / w.float().abs().clamp(min=1e-4)
    hit = torch.rand(rows, cols, generator=g) < (inv * (dens / inv.mean())).clamp(max=0.9)
    bits = as_bits(w).clone()
    bits[hit] += torch.where(torch.rand(rows, cols, generator=g) < 0.5, 1, -1)[hit].to(torch.int16)
    ob, nb = as_bits(w).reshape(-1), bits.reshape(-1)
    pos = torch.nonzero(ob != nb).reshape(-1)
    return (name, (rows, cols), ob, pos, ob[pos], nb[pos])


def decode_costs(tensors: int = 4, rows: int = 4096, cols: int = 4096, densities=(0.01, 0.03)) -> list[dict]:
    """What a reader pays to decode v2 instead of v1, side by side in one run: per change, v1's whole decode,
    today's v2 streams (format 5's range coder, ``tests/legacy_ctx.py``'s writer) and the new v2 streams
    (format 9, ``ctx-rans``) on one thread and on every core; bytes per change of each; and a part's fixed
    cost (the streams of a 4096-element part with 64 changes). The publisher's rule
    (``engine_ext.format.codec.Readers``) takes its constants from here."""
    from concurrent.futures import ThreadPoolExecutor
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import legacy_ctx

    g = torch.Generator().manual_seed(0)
    out = []
    for dens in densities:
        ch = [_synthetic(rows, cols, dens, g, f"model.layers.{i}.mlp.up_proj.weight") for i in range(tensors)]
        v1, _ = encode_all(ch, False)
        v2, tables = encode_all(ch, True)
        assert all(e.pos_coder == "ctx-rans" for e in v2)
        old = [legacy_ctx.encode("bfloat16", shape, None, context_blocks.block_policy(n, shape), ob.numpy(), pos.numpy(),
                                 step_between(o, nb, True).numpy(), tables) for n, shape, ob, pos, o, nb in ch]
        nnz = sum(c[3].numel() for c in ch)

        def streams(i, encs=v2, one_thread=False):
            _, shape, _, pos, _, _ = ch[i]
            keep = context_codec.PARALLEL_CHANGES
            context_codec.PARALLEL_CHANGES = 1 << 62 if one_thread else keep
            try:
                context_codec.decode_streams(context_codec.StoredPart("bfloat16", shape, None, encs[i].pos, encs[i].val, pos.numel(), tables))
            finally:
                context_codec.PARALLEL_CHANGES = keep

        [streams(i) for i in range(len(ch))]  # warm
        t1 = best(lambda: decode_all(ch, v1, []), 5)
        t_old = best(lambda: [streams(i, old) for i in range(len(ch))], 3)
        t_new1 = best(lambda: [streams(i, v2, True) for i in range(len(ch))], 5)
        t_new = best(lambda: [streams(i) for i in range(len(ch))], 5)  # a big part's chunks on every core
        with ThreadPoolExecutor(os.cpu_count()) as pool:  # or parts across threads, one thread each
            t_newp = best(lambda: list(pool.map(lambda i: streams(i, v2, True), range(len(ch)))), 5)
        b1 = sum(len(e.pos) + len(e.val) for e in v1)
        b_old = sum(len(e.pos) + len(e.val) for e in old)
        b2 = sum(len(e.pos) + len(e.val) for e in v2)
        out.append(dict(density=nnz / len(ch) / (rows * cols), v1=t1 / nnz * 1e9, old=t_old / nnz * 1e9,
                        new1=t_new1 / nnz * 1e9, new=min(t_new, t_newp) / nnz * 1e9, b1=b1 / nnz, b_old=b_old / nnz,
                        b2=b2 / nnz))
    small = _synthetic(64, 64, 64 / 4096, g, "model.layers.0.self_attn.o_proj.weight")
    name, shape, ob, pos, o, nb = small
    tables = step_tables([small])
    policy = context_blocks.block_policy(name, shape)
    e = context_codec.encode("bfloat16", shape, None, policy, ob.numpy(), pos.numpy(), step_between(o, nb, True).numpy(),
                             tables)
    n = pos.numel()
    one = lambda: context_codec.decode_streams(context_codec.StoredPart("bfloat16", shape, None, e.pos, e.val, n, tables))  # noqa: E731
    one()
    part_s = best(lambda: [one() for _ in range(1000)], 5) / 1000
    return out, (part_s, n, "ctx-rans", context_blocks.part_blocks(shape, None, policy).S)


def format_bytes(pairs_per_lr: int = 3) -> list[tuple[str, int, int, int]]:
    """Format 9's bytes against format 5's on bench/codec_configs.py's data (real AdamW steps, both learning rates:
    the bf16 cast, the fp32 masters, their fp8 block quantisation): every changed tensor the context coder may take
    (a block policy, ``CONTEXT_MIN`` changes), coded both ways under the version's step tables. (run, parts,
    format-9 bytes, format-5 bytes)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import legacy_ctx
    from engine_ext.format.quantize import fp8_block_state_dict

    out = []
    for label, convert in (("bf16", lambda v: v), ("fp32 masters", lambda v: v), ("fp8 block", fp8_block_state_dict)):
        parts = new_b = old_b = 0
        for lr in (1e-6, 3e-6):
            vs = [convert(v) for v in versions(lr, 8, masters=label != "bf16", log=lambda *x: None)]
            for old, new in list(itertools.pairwise(vs))[:pairs_per_lr]:
                by_dtype: dict = {}
                for name, o in old.items():
                    dt = str(o.dtype).removeprefix("torch.")
                    ob, nb = as_bits(o).reshape(-1), as_bits(new[name]).reshape(-1)
                    pos = torch.nonzero(ob != nb).reshape(-1)
                    policy = context_blocks.block_policy(name, tuple(o.shape))
                    if context_symbols.supports(dt) and policy is not None and codec.CONTEXT_MIN <= pos.numel() < ob.numel():
                        by_dtype.setdefault(dt, []).append((name, tuple(o.shape), policy, ob, pos, ob[pos], nb[pos]))
                for dt, items in by_dtype.items():
                    tables = context_models.step_tables(dt, np.concatenate([context_models.exponents(x[5].numpy(), dt) for x in items]),
                                                        np.concatenate([step_between(x[5], x[6], True).numpy() for x in items]))
                    for name, shape, policy, ob, pos, o, nb in items:
                        args = (dt, shape, None, policy, ob.numpy(), pos.numpy(), step_between(o, nb, True).numpy(), tables)
                        e, lg = context_codec.encode(*args), legacy_ctx.encode(*args)
                        parts, new_b, old_b = parts + 1, new_b + len(e.pos) + len(e.val), old_b + len(lg.pos) + len(lg.val)
        out.append((label, parts, new_b, old_b))
    return out


def read_costs(layers: int = 4, vocab: int = 151936, density: float = 0.042, repeat: int = 3) -> dict:
    """A reader's whole read of one version, v2 (bytes first) against v1 on the same delta: ``reader.load_delta``
    from a local store (fetch, verify every byte, decode) against the base held in memory, on a Qwen2-shaped
    model (``tests/support/synthetic.py``'s ``llm_shapes``: 4 layers of Qwen2.5-0.5B and its 151,936-token vocabulary, ~200 M
    parameters) whose small weights change more often; each read timed best of ``repeat``, alternating."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.synthetic import llm_shapes
    from engine_ext import settings
    from engine_ext.store import reader as _reader
    from engine_ext.store.decoding import TensorBases
    load_delta = _reader.load_delta
    from engine_ext.store.signing import Trust, generate_key
    from engine_ext.trainer.publisher import DeltaPublisher

    g = torch.Generator().manual_seed(1)
    old, new = {}, {}
    for name, shape in llm_shapes(layers=layers, vocab=vocab).items():
        w = (torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g)) * 0.02).bfloat16()
        inv = 1.0 / w.float().abs().clamp(min=1e-4)
        hit = torch.rand(shape, generator=g) < (inv * (density / inv.mean())).clamp(max=0.9)
        bits = as_bits(w).clone()
        bits[hit] += torch.where(torch.rand(shape, generator=g) < 0.5, 1, -1)[hit].to(torch.int16)
        old[name], new[name] = w, bits.view(torch.bfloat16)
    numel = sum(t.numel() for t in old.values())
    nnz = sum(int((as_bits(old[n]) != as_bits(new[n])).sum()) for n in old)
    root = Path(tempfile.mkdtemp())
    generate_key(root / "key")
    trust = Trust.from_public_keys([str(root / "key.pub")])  # the read verifies signatures, as a server's does
    uris = {}
    for coder, over in (("v1", dict(context_coder=False)), ("v2", dict(reader_mbps=0.0)), ("default", {})):
        with settings.override(**over), DeltaPublisher(str(root / coder), anchor_every=0, model="read",
                                                       signing_key=str(root / "key")) as pub:
            pub.publish(old, version=0)
            pub.publish(new, version=1)
            pub.wait()
        uris[coder] = str(root / coder / "v00000001.json")
    times = {c: float("inf") for c in uris if c != "default"}
    for _ in range(repeat):
        for coder in times:
            uri = uris[coder]
            t = time.perf_counter()
            load_delta(uri, bases=TensorBases(old), workers=os.cpu_count() or 1, trust=trust)
            times[coder] = min(times[coder], time.perf_counter() - t)
    doc = json.loads((root / "default" / "v00000001.json").read_text())
    parts = [p for t in doc["tensors"] if t["nnz"] for p in (t.get("chunks") or [t])]
    return dict(numel=numel, nnz=nnz, v1_s=times["v1"], v2_s=times["v2"],
                **{f"{c}_bytes": sum(p.stat().st_size for p in (root / c).glob("v00000001.*.bin")) for c in uris},
                default_v2_parts=sum(p["positions"]["coder"] == "ctx-rans" for p in parts), default_parts=len(parts))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-6, 3e-6])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--costs", action="store_true", help="only the decode costs the publisher's rule uses (synthetic, ~1 min)")
    ap.add_argument("--read", action="store_true", help="only a reader's whole read, v2 against v1 (~200 M params, ~3 min)")
    ap.add_argument("--formats", action="store_true", help="only format 9's bytes against format 5's (codec_configs' data)")
    ap.add_argument("--pass", dest="scan_pass", action="store_true", help="only the context pass, every build side by side (~1 min)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.scan_pass:
        print("command: python bench/context_bench.py --pass")
        print_scan_rates(scan_rates())
        return
    if a.formats:
        print("command: python bench/context_bench.py --formats")
        print("| versions | context-coded parts | format 9 (ctx-rans) bytes | format 5 (ctx) bytes | 9 / 5 |\n|---|---|---|---|---|")
        for label, parts, nb, ob in format_bytes():
            print(f"| {label} | {parts} | {nb:,} | {ob:,} | {nb / ob:.4f} |", flush=True)
        return
    if a.read:
        r = read_costs()
        print("command: python bench/context_bench.py --read")
        print(f"Qwen2-shaped, {r['numel'] / 1e6:.0f} M params, {100 * r['nnz'] / r['numel']:.2f} % changed; load_delta from a "
              f"local store against the base in memory, best of 3, on {os.cpu_count()} cores")
        print("| coding | payload MB | B / change | whole read s | ns / change | v2 / v1 time | v2 / v1 bytes |")
        print("|---|---|---|---|---|---|---|")
        for c in ("v1", "v2"):
            print(f"| {c} | {r[c + '_bytes'] / 1e6:.2f} | {r[c + '_bytes'] / r['nnz']:.3f} | {r[c + '_s']:.3f} | "
                  f"{r[c + '_s'] / r['nnz'] * 1e9:.1f} | {r[c + '_s'] / r['v1_s']:.2f}x | {r[c + '_bytes'] / r['v1_bytes']:.3f} |")
        print(f"the default publisher (GPU readers at 100 MB/s): {r['default_bytes'] / 1e6:.2f} MB "
              f"({r['default_bytes'] / r['v1_bytes']:.3f} of v1's), {r['default_v2_parts']} of {r['default_parts']} parts ctx-rans")
        return
    if a.costs:
        print("command: python bench/context_bench.py --costs")
        rows, (part_s, n, coder, S) = decode_costs()
        print(f"ns per change on {os.cpu_count()} cores; B = bytes per change; 4 synthetic bf16 parts of 4096 x 4096")
        print("| density | v1 decode | v2 streams today (format 5) | v2 streams new, 1 thread | v2 streams new, every core "
              "| scaling | v1 B | v2 B today | v2 B new | new / today bytes |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {100 * r['density']:.2f} % | {r['v1']:.1f} | {r['old']:.1f} | {r['new1']:.2f} | {r['new']:.2f} | "
                  f"{r['new1'] / r['new']:.2f}x | {r['b1']:.3f} | {r['b_old']:.3f} | {r['b2']:.3f} | {r['b2'] / r['b_old']:.4f} |",
                  flush=True)
        print(f"fixed cost: the streams of a 64 x 64 part ({coder}, {S} blocks, {n} changes): {part_s * 1e6:.1f} us")
        print_scan_rates(scan_rates())
        return
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import fireworks_codec as fw
        have_fw = fw.available()
    except Exception:  # noqa: BLE001 - the benchmark says so
        have_fw = False
    print("command: python bench/context_bench.py " + " ".join(sys.argv[1:]))
    print("| lr | density | bound B | v1 B | v2 B | v2 / bound | v1 / v2 | arc_v3 B | arc_v3 / v2 | enc v1 MB/s | enc v2 MB/s "
          "| dec v1 MB/s | dec v2 MB/s | load_file MB/s | dec v2 / load_file time | default B | default / bound |")
    print("|" + "---|" * 17)
    tmp = tempfile.mkdtemp()
    warm = pair_changes(*versions(a.lr[0], 8, log=lambda *x: None)[:2])
    decode_all(warm, *encode_all(warm, True))  # the numba kernels loaded from their cache, not timed
    for lr in a.lr:
        vs = versions(lr, 8, log=lambda *x: None)
        tot = np.zeros(8)
        for old, new in list(itertools.pairwise(vs))[:a.pairs]:
            ch = pair_changes(old, new)
            nnz = sum(c[3].numel() for c in ch)
            numel = sum(t.numel() for t in old.values())
            mb = 2 * numel / 1e6
            gaps = [np.diff(c[3].numpy(), prepend=-1) - 1 for c in ch]
            steps = [step_between(c[4], c[5], True).numpy() for c in ch]
            pooled = (entropy_bits(np.concatenate(gaps)) + entropy_bits(np.concatenate(steps))) / 8
            per_tensor = sum(entropy_bits(g) + entropy_bits(s) for g, s in zip(gaps, steps)) / 8
            t_e1 = best(lambda: encode_all(ch, False), 1)
            v1, _ = encode_all(ch, False)
            t_e2 = best(lambda: encode_all(ch, True), 1)
            v2, tables = encode_all(ch, True)
            vd, tables_d = encode_all(ch, True, codec.Readers())  # the default: GPU readers at 100 MB/s
            bd = sum(len(e.pos) + len(e.val) for e in vd) + sum(len(t) for t in tables_d)
            t_d1 = best(lambda: decode_all(ch, v1, []))
            t_d2 = best(lambda: decode_all(ch, v2, tables))
            path = os.path.join(tmp, "changed.safetensors")
            save_file({n: new[n].contiguous() for n, *_ in ch}, path)
            t_load = best(lambda: load_all(path), 5)
            b1 = sum(len(e.pos) + len(e.val) for e in v1)
            b2 = sum(len(e.pos) + len(e.val) for e in v2) + sum(len(t) for t in tables)
            arc = sum(fw.arc_v3_bytes(old[n], new[n]) for n, *_ in ch) if have_fw else float("nan")
            tot += [nnz, numel, min(pooled, per_tensor), b1, b2, arc, bd, 0]
            print(f"| {lr:g} | {100 * nnz / numel:.2f} % | {min(pooled, per_tensor) / nnz:.3f} | {b1 / nnz:.3f} | {b2 / nnz:.3f} "
                  f"| {b2 / min(pooled, per_tensor):.3f} | {b1 / b2:.2f} | {arc / nnz:.3f} | {arc / b2:.2f} "
                  f"| {mb / t_e1:.0f} | {mb / t_e2:.0f} | {mb / t_d1:.0f} | {mb / t_d2:.0f} | {mb / t_load:.0f} "
                  f"| {t_d2 / t_load:.1f} | {bd / nnz:.3f} | {bd / min(pooled, per_tensor):.3f} |", flush=True)
        n, _, bound, b1, b2, arc, bd, _ = tot
        print(f"lr {lr:g} all pairs: v2/bound {b2 / bound:.3f}, v1/bound {b1 / bound:.3f}, v1/v2 {b1 / b2:.2f}, "
              f"arc_v3/v2 {arc / b2:.2f}, arc_v3/v1 {arc / b1:.2f}, default/bound {bd / bound:.3f}", flush=True)
    print_scan_rates(scan_rates())
    nnz, numel, t1, tn, tl, te = at_scale()
    print(f"at scale (8 x 4096 x 4096 bf16, {100 * nnz / numel:.2f} % changed, synthetic): decode {t1:.3f} s on one thread "
          f"({t1 / tl:.1f}x load_file), {tn:.3f} s on {os.cpu_count()} ({tn / tl:.1f}x); load_file {tl:.3f} s "
          f"({2 * numel / tl / 1e9:.1f} GB/s); per element of the model: {1e9 * t1 / numel:.2f} ns decode, "
          f"{1e9 * tl / numel:.2f} ns load_file; encode {2 * numel / te / 1e6:.0f} MB of model/s on one thread")


if __name__ == "__main__":
    main()
