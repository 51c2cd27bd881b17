"""GPU check and benchmark of the fused apply kernel, for one short call on a lent GPU.

    cd <repo root>; PYTHONPATH=. python3 gpu_acceptance/gpu_kernels.py --out DIR     # GPU, < 4 minutes
    TRITON_INTERPRET=1 PYTHONPATH=. python3 gpu_acceptance/gpu_kernels.py --small    # CPU smoke test

1. Bit-exactness on the device: Triton == torch path (storage bytes, fingerprint deltas,
   written counts) on small random layouts (packed, sliced, transposed, padded, foreign
   shard, dense) for one dtype of each width, abs and rel; undo restores the exact bits.
2. A Qwen2-7B-shaped bf16 parameter set (~15 GB, q/k/v packed into qkv, gate/up into
   gate_up) and an RL-like delta (1 % and 3 % of elements, +-1..2 ULP steps). Timed:
   our Triton kernel (one launch, undo + fingerprints on), its rollback, our torch path
   on the GPU, and a re-implementation of vLLM's sparse-patch algorithm
   (``load_checkpoint_weight_patches``: a NaN-filled checkpoint-shaped staging tensor per
   patch, ``index_copy_`` of the new values, then a ``where(isnan(src), dst, src)`` copy;
   vLLM itself is not installed on the GPU machine). All methods must end at the same
   model fingerprint. Effective bandwidth counts the bytes an apply must move: positions
   (8 B) + values (2 B) read, old bits read (2 B), new bits written (2 B), undo written
   (2 B) per changed element; the floor is those bytes at the device's measured copy
   bandwidth (a sector-granular floor, 32 B read + 32 B written per scattered element, is
   shown too).
Writes a markdown table to stdout and to ``$OUT/gpu_kernels.md``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine_ext.format import dtypes  # noqa: E402
from engine_ext.format import fingerprint as fpr  # noqa: E402
from engine_ext.server.apply import apply_delta  # noqa: E402
from engine_ext.server.maps import Piece, TensorMap, row_major_strides, validate  # noqa: E402
from engine_ext.format.delta import TensorDelta  # noqa: E402

BF16 = dtypes.BY_NAME["bfloat16"]


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- 1. exactness


def small_case(g, d, dev, layout, mode, dense):
    """A 2-D checkpoint tensor (7 x 5) placed by ``layout`` into a shared storage with other data."""
    shape = (7, 5)
    buf = torch.randint(-(1 << 62), 1 << 62, (200,), generator=g, dtype=torch.int64).to(d.int_view).to(dev)
    view = buf if d.torch == d.int_view else (buf.view(torch.uint8).view(torch.bool) if d.torch == torch.bool else buf.view(d.torch))
    P = lambda start, stop, off, strides, count=True: Piece(view, start, stop, off, strides, count)
    pieces = {
        "full": [P((0, 0), (7, 5), 3, (5, 1))],
        "packed_rows": [P((2, 0), (6, 5), 50, (5, 1))],
        "col_shard": [P((0, 1), (7, 4), 10, (3, 1))],
        "transposed": [P((0, 0), (7, 5), 40, (1, 7))],
        "padded": [P((0, 0), (7, 5), 5, (8, 1))],
        "two_copies": [P((0, 0), (7, 5), 0, (5, 1)), P((0, 0), (7, 5), 100, (1, 9), False)],
    }[layout]
    n = 35
    pos = None if dense else torch.nonzero(torch.rand(n, generator=g) < 0.4).reshape(-1)
    k = n if dense else pos.numel()
    vals = torch.randint(-(1 << 62), 1 << 62, (k,), generator=g, dtype=torch.int64).to(d.int_view)
    td = TensorDelta("t", d, shape, mode, pos, vals)
    return td, TensorMap("t", shape, d, pieces), buf


def check_exact(dev, log):
    names = ["bfloat16", "float32", "float8_e4m3fn", "int64", "float64", "bool"]
    n_ok = 0
    for dn in names:
        d = dtypes.BY_NAME[dn]
        for layout in ["full", "packed_rows", "col_shard", "transposed", "padded", "two_copies"]:
            for mode in ("abs", "rel"):
                for dense in (False, True):
                    outs = []
                    for be in ("triton", "torch"):
                        g = torch.Generator().manual_seed(hash((dn, layout, mode, dense)) & 0xFFFF)
                        td, m, buf = small_case(g, d, dev, layout, mode, dense)
                        before = buf.clone()
                        r = apply_delta([td], {"t": m}, backend=be)
                        after = buf.clone()
                        r.undo.rollback()
                        assert torch.equal(buf, before), f"undo failed: {dn} {layout} {mode} {be}"
                        outs.append((after.cpu(), r.fingerprint_delta, r.written))
                    assert torch.equal(outs[0][0], outs[1][0]), f"bits differ: {dn} {layout} {mode} dense={dense}"
                    assert outs[0][1:] == outs[1][1:], f"fp/written differ: {dn} {layout} {mode} dense={dense}"
                    n_ok += 1
    log(f"Exactness on {dev}: Triton == torch path on {n_ok} cases (6 dtypes x 6 layouts x abs/rel x sparse/dense), undo exact.")


# ----------------------------------------------------------------------------- 2. 7B benchmark


def qwen2_shapes(hidden, layers, vocab, inter, kv):
    s = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        s.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                  p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.q_proj.bias": (hidden,),
                  p + "self_attn.k_proj.weight": (kv, hidden), p + "self_attn.k_proj.bias": (kv,),
                  p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.v_proj.bias": (kv,),
                  p + "self_attn.o_proj.weight": (hidden, hidden),
                  p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                  p + "mlp.down_proj.weight": (hidden, inter)})
    return s


def build_model(shapes, dev, g):
    """Packed bf16 parameters (qkv, gate_up) and the checkpoint->parameter maps."""
    packs = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
    rows, rest, where = {}, {}, {}
    for n, s in shapes.items():
        key = n
        for a, b in packs.items():
            key = key.replace(f".{a}.", f".{b}.")
        off = rows.get(key, 0)
        rows[key], rest[key] = off + s[0], tuple(s[1:])
        where[n] = (key, off)
    params = {}
    for key in rows:
        t = torch.empty((rows[key],) + rest[key], dtype=torch.bfloat16, device=dev)
        t.normal_(0, 0.02, generator=g)
        params[key] = t
    maps, views = {}, {}
    for n, s in shapes.items():
        key, off = where[n]
        p = params[key]
        inner = p[0].numel() if p.dim() > 1 else 1
        maps[n] = TensorMap(n, tuple(s), BF16, [Piece(p, (0,) * len(s), tuple(s), off * inner, row_major_strides(s))])
        views[n] = p.narrow(0, off, s[0])
    return params, maps, views


def make_delta(shapes, views, density, dev, g):
    deltas, newvals = [], {}
    for n, s in shapes.items():
        numel = views[n].numel()
        k = max(1, int(numel * density))
        pos = torch.unique(torch.randint(0, numel, (k,), device=dev, generator=g))
        steps = torch.randint(1, 3, (pos.numel(),), device=dev, dtype=torch.int16, generator=g)
        sign = torch.randint(0, 2, (pos.numel(),), device=dev, dtype=torch.int16, generator=g) * 2 - 1
        deltas.append(TensorDelta(n, BF16, tuple(s), "rel", pos, steps * sign))
    return deltas


def abs_values(deltas, views):
    """The same change as absolute new bf16 values (what vLLM's sparse patches carry)."""
    out = {}
    for d in deltas:
        old = dtypes.as_bits(views[d.name]).reshape(-1)[d.positions]
        out[d.name] = dtypes.apply_step(old, d.values, True).view(torch.bfloat16)
    return out


def vllm_nan_patch(deltas, newvals, views):
    """Re-implementation of vLLM's sparse checkpoint patch algorithm (per patch: full NaN staging,
    index_copy_, then the loader's final copy_ replaced by where(isnan(src), dst, src, out=dst))."""
    for d in deltas:
        flat = torch.full((d.numel,), float("nan"), dtype=torch.bfloat16, device=views[d.name].device)
        flat.index_copy_(0, d.positions, newvals[d.name])
        src = flat.view(d.shape)
        dst = views[d.name]
        torch.where(torch.isnan(src), dst, src, out=dst)


def ckpt_fps(views) -> dict:
    return {n: fpr.tensor_fingerprint(v) for n, v in views.items()}


def model_fp(views) -> int:
    return fpr.model_fingerprint(ckpt_fps(views))


def negate(deltas):
    """The exact inverse of a relative delta (steps wrap in ordered key space)."""
    return [TensorDelta(d.name, d.dtype, d.shape, "rel", d.positions, -d.values) for d in deltas]


class KernelTimer:
    """CUDA-event time of the apply/rollback launches (with their per-segment reduction) inside a call; host-side work excluded."""

    def __init__(self, dev):
        import engine_ext.triton_kernels.apply_kernel as ak

        self.ak, self.dev, self.events = ak, dev, []

        def timed_launch(orig):
            def launch(*a, **k):
                if dev.type != "cuda":
                    return orig(*a, **k)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                out = orig(*a, **k)
                e1.record()
                self.events.append((e0, e1))
                return out

            return launch

        ak.apply_segments = timed_launch(ak.apply_segments)  # engine_ext.server.apply_fused calls them by module attribute
        ak.rollback_segments = timed_launch(ak.rollback_segments)

    def take(self) -> float:
        sync(self.dev)
        t = sum(a.elapsed_time(b) for a, b in self.events) / 1e3
        self.events = []
        return t


def timed(fn, dev, reps=1):
    ts = []
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        out = fn()
        sync(dev)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), out


def copy_bandwidth(dev):
    n = (1 << 30) if dev.type == "cuda" else (1 << 24)
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    t, _ = timed(lambda: b.copy_(a), dev, reps=5)
    return 2 * n / t  # bytes read + written per second


def bench(dev, small, densities, log):
    g = torch.Generator(device=dev).manual_seed(0)
    if small:
        shapes = qwen2_shapes(hidden=64, layers=2, vocab=256, inter=128, kv=16)
    else:  # Qwen2-7B: hidden 3584, 28 layers, vocab 152064, intermediate 18944, 4 KV heads x 128
        shapes = qwen2_shapes(hidden=3584, layers=28, vocab=152064, inter=18944, kv=512)
    t0 = time.perf_counter()
    params, maps, views = build_model(shapes, dev, g)
    numel = sum(p.numel() for p in params.values())
    bw = copy_bandwidth(dev)
    log(f"Parameters: {numel / 1e9:.2f} B bf16 elements ({numel * 2 / 1e9:.1f} GB) in {len(params)} tensors, "
        f"{len(shapes)} checkpoint tensors; device copy bandwidth {bw / 1e9:.0f} GB/s (read+write); setup {time.perf_counter() - t0:.1f} s")
    rows = []
    kt = KernelTimer(dev)
    for dens in densities:
        deltas = make_delta(shapes, views, dens, dev, g)
        nnz = sum(d.nnz for d in deltas)
        fps0 = ckpt_fps(views)
        fp0 = fpr.model_fingerprint(fps0)
        r = apply_delta(deltas, maps, backend="triton")  # warm-up: compiles
        r.undo.rollback()
        apply_delta(deltas, maps, backend="triton", undo=False)
        apply_delta(negate(deltas), maps, backend="triton", undo=False)
        assert model_fp(views) == fp0, "rollback after warm-up"
        kt.take()
        t_tri, t_rb, k_tri, k_rb = [], [], [], []
        for k in range(5):
            t, r = timed(lambda: apply_delta(deltas, maps, backend="triton"), dev)
            t_tri.append(t)
            k_tri.append(kt.take())
            if k == 0:  # fused per-tensor fingerprint deltas == full recomputation, every tensor
                fps1 = ckpt_fps(views)
                fp1 = fpr.model_fingerprint(fps1)
                bad = [n for n in fps0 if (fps0[n] + r.fingerprint_delta[n]) & fpr.MASK64 != fps1[n]]
                assert not bad, f"fingerprint deltas wrong for {bad[:3]}"
                assert sum(r.written.values()) == nnz
            t, _ = timed(r.undo.rollback, dev)
            t_rb.append(t)
            k_rb.append(kt.take())
        assert model_fp(views) == fp0, "Triton rollback did not restore the exact bits"
        t_noundo, _ = timed(lambda: apply_delta(deltas, maps, backend="triton", undo=False), dev)
        k_noundo = kt.take()
        assert model_fp(views) == fp1
        apply_delta(negate(deltas), maps, backend="triton", undo=False)
        assert model_fp(views) == fp0
        t_torch, r = timed(lambda: apply_delta(deltas, maps, backend="torch"), dev)
        assert model_fp(views) == fp1, "torch path and Triton end at different weights"
        r.undo.rollback()
        assert model_fp(views) == fp0
        newvals = abs_values(deltas, views)
        t_vllm, _ = timed(lambda: vllm_nan_patch(deltas, newvals, views), dev)
        assert model_fp(views) == fp1, "vLLM-algorithm result differs"
        apply_delta(negate(deltas), maps, backend="triton", undo=False)
        kt.take()
        rows.append(dict(density=dens, nnz=nnz, t_tri=statistics.median(t_tri), t_tri_noundo=t_noundo,
                         t_rb=statistics.median(t_rb), t_torch=t_torch, t_vllm=t_vllm, same=True,
                         k_tri=statistics.median(k_tri), k_rb=statistics.median(k_rb), k_noundo=k_noundo))
        log(f"  density {dens:.0%}: {nnz:,} changed; Triton {rows[-1]['t_tri'] * 1e3:.2f} ms, torch {t_torch * 1e3:.1f} ms, "
            f"vLLM algorithm {t_vllm * 1e3:.1f} ms; all end at fingerprint {fpr.fmt(fp1)}")
        del newvals, deltas, r
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows, numel, bw


def profile(dev, small):
    """Where the host time of one apply goes (cProfile; CUDA waits show up in .cpu()/sync)."""
    import cProfile
    import pstats

    g = torch.Generator(device=dev).manual_seed(0)
    shapes = (qwen2_shapes(hidden=64, layers=2, vocab=256, inter=128, kv=16) if small
              else qwen2_shapes(hidden=3584, layers=28, vocab=152064, inter=18944, kv=512))
    params, maps, views = build_model(shapes, dev, g)
    deltas = make_delta(shapes, views, 0.01, dev, g)
    for _ in range(3):
        r = apply_delta(deltas, maps, backend="triton")
        r.undo.rollback()
    sync(dev)
    for label, fn in [("apply", lambda: apply_delta(deltas, maps, backend="triton")),
                      ("validate only", lambda: validate(deltas, maps))]:
        pr = cProfile.Profile()
        t0 = time.perf_counter()
        pr.enable()
        out = fn()
        sync(dev)
        pr.disable()
        print(f"== {label}: {(time.perf_counter() - t0) * 1e3:.1f} ms")
        pstats.Stats(pr).sort_stats("tottime").print_stats(18)
        if label == "apply":
            out.undo.rollback()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test, with TRITON_INTERPRET=1)")
    ap.add_argument("--density", type=float, nargs="+", default=[0.01, 0.03])
    ap.add_argument("--profile", action="store_true", help="cProfile the host side of one 1%% apply, then exit")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.profile:
        return profile(dev, a.small)
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("no GPU: run with --small and TRITON_INTERPRET=1")
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    import triton

    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (Triton interpreter; timings meaningless)"
    log(f"# Fused apply kernel on {name}\n")
    log(f"torch {torch.__version__}, triton {triton.__version__}, python {sys.version.split()[0]}\n")
    t0 = time.perf_counter()
    check_exact(dev, log)
    log(f"(exactness checks incl. compilation: {time.perf_counter() - t0:.1f} s)\n")
    rows, numel, bw = bench(dev, a.small, a.density, log)
    log("\n| density | changed elements | method | total ms | kernel ms | bytes moved GB | effective GB/s (kernel) | floor ms (bytes at copy BW) | sector floor ms | kernel / floor |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        n = r["nnz"]
        useful = n * 16  # pos 8 + val 2 + old 2 + new 2 + undo 2
        sector = n * (8 + 2 + 32 + 32 + 2) / bw
        for label, t, k, b in [("Triton, undo + fingerprints (one launch)", r["t_tri"], r["k_tri"], useful),
                               ("Triton, no undo", r["t_tri_noundo"], r["k_noundo"], n * 14),
                               ("Triton rollback", r["t_rb"], r["k_rb"], n * 12),
                               ("torch path on GPU (undo + fingerprints)", r["t_torch"], None, useful),
                               ("vLLM NaN-dense patch algorithm (re-implemented)", r["t_vllm"], None, numel * 12)]:
            fl = b / bw
            kk = k if k else t
            log(f"| {r['density']:.0%} | {n:,} | {label} | {t * 1e3:.2f} | {f'{k * 1e3:.2f}' if k else '-'} | {b / 1e9:.2f} | "
                f"{b / kk / 1e9:.0f} | {fl * 1e3:.2f} | {sector * 1e3:.2f} | {kk / fl:.1f} |")
        log(f"\nAt {r['density']:.0%}: Triton (total, incl. validation and host work) is {r['t_vllm'] / r['t_tri']:.1f}x faster than the "
            f"vLLM algorithm and {r['t_torch'] / r['t_tri']:.1f}x faster than the torch path; all methods end at the same model "
            f"fingerprint: {r['same']}.\n")
    log("Bytes: ours per changed element = positions 8 + values 2 + old 2 + new 2 + undo 2 = 16 B (14 without undo; rollback 12); "
        "the vLLM algorithm moves ~12 B per model element (NaN fill 2, isnan read 2 + mask write 1, where reads 2+2+1, writes 2). "
        "Sector floor: 8 + 2 streamed + one 32 B sector read and written + 2 undo per scattered element.")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gpu_kernels.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
