"""CPU benchmark: apply one RL-like delta in place, three ways, same model, same delta.

    PYTHONPATH=. python bench/apply_bench.py [--preset 0.5b|1.5b|tiny] [--density 0.01 0.03]

Methods (each in a fresh subprocess, so peak memory is its own; each is warmed up by one
call first and the model brought back to the same base, then 3 calls are measured, each
from that base: median time, largest peak memory):
  ours     engine_ext.server.apply.apply_delta, torch path, undo log + fingerprint deltas on
  indexput a per-tensor ``index_put_`` loop (no undo, no fingerprints): the naive floor
  vllm     vllm's ``load_checkpoint_weight_patches`` (sparse patches: NaN-filled
           checkpoint-shaped staging + the model's ``load_weights`` with ``copy_`` patched)

The model is a plain torch module with Qwen2.5-shaped bf16 parameters packed the way
vLLM packs them (``qkv_proj`` = q|k|v, ``gate_up_proj`` = gate|up, tied embeddings) and a
``load_weights`` that routes checkpoint names through vLLM-style loaders (narrow +
``copy_``, vLLM's own ``default_weight_loader`` when installed); our maps come from
:func:`engine_ext.server.layout.probe_layout` on that loader. The delta changes ``density`` of
each tensor's elements by +-1..2 ULP (relative steps; vLLM gets the same change as
absolute new values). Extra memory = peak RSS during the apply minus RSS before it
(``/proc/self/clear_refs`` resets the peak), so it includes every temporary and the undo
log (glibc ``malloc_trim`` first, so freed heap memory is not silently reused). Time is
wall-clock and, because the machine is shared, also the process CPU time (1 thread: CPU
time = the work done). After each method the whole model's fingerprint is printed: all must agree.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from support.synthetic import llm_shapes  # noqa: E402  (tests/support)

from engine_ext.format import dtypes  # noqa: E402
from engine_ext.format import fingerprint as fpr  # noqa: E402
from engine_ext.format.delta import TensorDelta  # noqa: E402

PRESETS = {  # Qwen2.5 shapes (hidden, layers, vocab, intermediate, kv dim)
    "0.5b": dict(hidden=896, layers=24, vocab=151936, inter=4864, kv=128),
    "1.5b": dict(hidden=1536, layers=28, vocab=151936, inter=8960, kv=256),
    "tiny": dict(hidden=64, layers=2, vocab=512, inter=128, kv=32),
}
PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> int:
    """Return freed heap to the OS, reset the peak-RSS mark, return the current RSS."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


class PackedQwen(torch.nn.Module):
    """Parameters as vLLM holds them (packed, tied); loaders in vLLM's style: narrow the packed
    parameter to the shard and ``copy_`` the checkpoint tensor into it."""

    def __init__(self, shapes: dict):
        super().__init__()
        self.ckpt_shapes = shapes
        self.params = torch.nn.ParameterDict()
        self.shard: dict = {}  # checkpoint name -> (param key, row offset, rows)
        rows, rest = {}, {}
        for n, s in shapes.items():
            key = n
            for short, (packed, _) in PACKED.items():
                key = key.replace(f".{short}.", f".{packed}.")
            key = key.replace(".", "__")
            off = rows.get(key, 0)
            rows[key], rest[key] = off + s[0], tuple(s[1:])
            self.shard[n] = (key, off, s[0])
        for key in rows:
            self.params[key] = torch.nn.Parameter(torch.empty((rows[key],) + rest[key], dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):
        try:
            from vllm.model_executor.model_loader.weight_utils import default_weight_loader
        except Exception:  # vLLM not installed: the same two lines
            def default_weight_loader(param, w):
                assert param.size() == w.size()
                param.data.copy_(w)
        loaded = set()
        for name, w in weights:
            key, off, n = self.shard[name]
            param = self.params[key]
            if n == param.shape[0]:
                default_weight_loader(param, w)
            else:  # packed shard, as MergedColumnParallelLinear / QKVParallelLinear do at TP=1
                dst = param.data.narrow(0, off, n)
                assert dst.shape == w.shape
                dst.copy_(w)
            loaded.add(name)
        return loaded


def build(preset: str, density: float, seed: int = 0):
    """The model loaded with seeded weights, and the delta (steps; absolute new values for vLLM)."""
    shapes = llm_shapes(**PRESETS[preset])
    model = PackedQwen(shapes)
    g = torch.Generator().manual_seed(seed)
    bf = dtypes.BY_NAME["bfloat16"]
    deltas, abs_vals = [], {}
    with torch.no_grad():
        for n, s in shapes.items():
            w = (0.02 * torch.randn(s, generator=g)).to(torch.bfloat16)
            model.load_weights([(n, w)])
            numel = w.numel()
            k = max(1, int(numel * density))
            pos = torch.unique(torch.randint(0, numel, (k,), generator=g))
            steps = torch.randint(1, 3, (pos.numel(),), generator=g, dtype=torch.int16)
            steps = torch.where(torch.rand(pos.numel(), generator=g) < 0.5, -steps, steps)
            old = dtypes.as_bits(w).reshape(-1)[pos]
            abs_vals[n] = dtypes.apply_step(old, steps, True).view(torch.bfloat16)
            deltas.append(TensorDelta(n, bf, tuple(s), "rel", pos, steps))
            del w
    return model, deltas, abs_vals


def model_fp(model) -> str:
    return fpr.fmt(fpr.model_fingerprint({k: fpr.tensor_fingerprint(p) for k, p in model.params.items()}))


REPS = 3


def _measure(fn, reset=None):
    """Median wall and CPU seconds and the largest peak extra RSS of REPS calls (after the
    caller's warm-up call); ``reset`` brings the model back between calls (not measured)."""
    walls, cpus, mems = [], [], []
    for k in range(REPS):
        if k and reset is not None:
            reset(out)
        base = reset_peak()
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        mems.append(_status("VmHWM") - base)
    return out, statistics.median(walls), statistics.median(cpus), max(mems)


def run_method(method: str, preset: str, density: float) -> dict:
    """Warm up once (first-call costs: lazy init, caches), bring the model back, then measure one apply."""
    torch.manual_seed(0)
    model, deltas, abs_vals = build(preset, density)
    nnz = sum(d.nnz for d in deltas)
    extra = {}
    if method == "ours":
        from engine_ext.server.apply import apply_delta
        from engine_ext.server.layout import probe_layout

        t0 = time.perf_counter()
        maps = probe_layout(model, lambda n, t: model.load_weights([(n, t)]), [(d.name, d.shape, d.dtype) for d in deltas])
        extra["probe_s"] = round(time.perf_counter() - t0, 3)
        apply_delta(deltas, maps, undo=True, backend="torch").undo.rollback()  # warm-up, exact undo
        res, dt, cpu, mem = _measure(lambda: apply_delta(deltas, maps, undo=True, backend="torch"),
                                     lambda r: r.undo.rollback())
        extra["undo_MB"] = round(res.undo.nbytes / 1e6, 1)
        extra["written"] = sum(res.written.values())
    elif method == "indexput":
        views = {}
        for d in deltas:
            key, off, n = model.shard[d.name]
            views[d.name] = dtypes.as_bits(model.params[key].data.narrow(0, off, n)).reshape(-1)

        def loop(sign=1):
            with torch.no_grad():
                for d in deltas:
                    v = views[d.name]
                    v.index_put_((d.positions,), dtypes.apply_step(v[d.positions], sign * d.values, True))

        loop()
        loop(-1)  # warm-up and back (steps are exact inverses in ordered key space)
        _, dt, cpu, mem = _measure(loop, lambda _: loop(-1))
    elif method == "vllm":
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (CheckpointWeightPatch,
                                                                                load_checkpoint_weight_patches)

        patches = [CheckpointWeightPatch(d.name, d.shape, torch.bfloat16, abs_vals[d.name], d.positions) for d in deltas]
        del abs_vals
        load_checkpoint_weight_patches(model, patches)  # warm-up; absolute values: the repeat is idempotent
        _, dt, cpu, mem = _measure(lambda: load_checkpoint_weight_patches(model, patches))
    else:
        raise ValueError(method)
    return dict(method=method, seconds=round(dt, 4), cpu_s=round(cpu, 4), extra_MB=round(mem / 1e6, 1), nnz=nnz,
                model_MB=round(sum(p.numel() * 2 for p in model.params.values()) / 1e6, 1), fp=model_fp(model), **extra)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="0.5b", choices=sorted(PRESETS))
    ap.add_argument("--density", type=float, nargs="+", default=[0.01, 0.03])
    ap.add_argument("--methods", nargs="+", default=["ours", "indexput", "vllm"])
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per method (default 1: on a shared machine, spinning OpenMP threads "
                         "slow every method down by 10-100x)")
    ap.add_argument("--reps", type=int, default=3, help="measured calls per method (median time, max memory)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    global REPS
    REPS = a.reps
    if a.child:
        torch.set_num_threads(a.threads)
        print("RESULT " + json.dumps(run_method(a.child, a.preset, a.density[0])), flush=True)
        return
    try:
        import vllm  # noqa: F401
    except Exception:
        a.methods = [m for m in a.methods if m != "vllm"]
        print("vLLM not installed: skipping its method", file=sys.stderr)
    rows = []
    for dens in a.density:
        for m in a.methods:
            out = subprocess.run([sys.executable, __file__, "--child", m, "--preset", a.preset, "--density", str(dens),
                                  "--reps", str(a.reps), "--threads", str(a.threads)],
                                 capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(a.threads)})
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if out.returncode or not line:
                print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"{m} failed")
            r = json.loads(line[0][7:])
            r["density"] = dens
            rows.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
    print(f"\nPreset {a.preset}: {rows[0]['model_MB']} MB of bf16 parameters, torch {torch.__version__}, "
          f"{a.threads} torch thread(s) per method\n")
    print("| density | method | changed elements | apply wall s | apply CPU s | extra peak MB | vs vLLM (wall) | vs vLLM (CPU time) | vs vLLM (memory) | model fingerprint after |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dens in a.density:
        group = [r for r in rows if r["density"] == dens]
        ref = next((r for r in group if r["method"] == "vllm"), None)
        for r in group:
            sp = f"{ref['cpu_s'] / r['cpu_s']:.1f}x faster" if ref else "-"
            spw = f"{ref['seconds'] / r['seconds']:.1f}x faster" if ref else "-"
            mem = f"{ref['extra_MB'] / max(r['extra_MB'], 0.1):.1f}x less" if ref else "-"
            note = f" (undo {r['undo_MB']} MB, probe {r['probe_s']} s)" if r["method"] == "ours" else ""
            print(f"| {dens:.0%} | {r['method']}{note} | {r['nnz']:,} | {r['seconds']:.3f} | {r['cpu_s']:.3f} | {r['extra_MB']} | {spw} | {sp} | {mem} | {r['fp']} |")
        fps = {r["fp"] for r in group}
        print(f"\nAll methods end at the same weights at {dens:.0%}: {len(fps) == 1}\n" if len(fps) == 1 else
              f"\nMISMATCH at {dens:.0%}: {fps}\n")


if __name__ == "__main__":
    main()
