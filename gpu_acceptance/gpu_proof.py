"""One prepared GPU proof of the update path, for one short call on a lent GPU.

    PYTHONPATH=. python3 gpu_acceptance/gpu_proof.py --out DIR               # one H200: under 9 minutes
    PYTHONPATH=. python3 gpu_acceptance/gpu_proof.py --out DIR --cpu-smoke   # the same code, tiny, on the CPU (CI)

Writes one markdown report, ``DIR/gpu_proof.md``. Each section runs in a process of its own
under its own time box (a hung kernel, an out-of-memory or a crash costs that section only),
and the report is rewritten after each section, so it exists whatever happens:

(a) the fused apply (``engine_ext.server.apply_fused``, one Triton launch per width) at 1 % and
    3 % of a Qwen2-7B-shaped model, bf16 and fp8 block (fp8 weights with their fp32 scales),
    against the floors: the bytes an apply must move at the device's copy bandwidth, and a
    sector floor (every scattered element costs a 32-byte sector read and written); undo and
    fingerprints on, the rollback timed too (helpers of ``gpu_acceptance/gpu_kernels.py``);
(b) codec v2 decoded where the base lives (``engine_ext.triton_kernels.context_decode``: the streams on
    the host, the context pass in Triton on the device): ns per base element and per changed
    element, against the host decoder (numba) and against ``safetensors`` ``load_file`` of the
    same tensors to the device; bit-exact with the host decoder, and the device-to-host copies
    during a decode counted (a copy of the base would show);
(c) a transformers Qwen2 model on the device, captured once with ``torch.cuda.graph``, takes
    three versions (codec v2, bytes first) through the server-side transaction
    (``Controller`` over a local ``Ranks`` with one ``RankUpdater``: device decode, fused
    apply, fingerprints verified) and one update whose apply is failed on purpose (undo);
    after each, the graph's replay equals a fresh eager model loaded with that version's
    weights, bit for bit, and no parameter's storage moved;
(d) the publisher's diff on device-resident weights (the training step waits for it) and
    until stored, against ``save_file`` of the same state dict;
(e) vLLM 0.32's CUDA post-processing under the census (docs/GPU.md): first the census's
    provenance tracker on the device's own ops (aten, ``torch.compile``, a Triton launch; no
    vLLM needed), then, where vLLM is importable, the paths whose derived copies a CUDA op
    makes (DeepGEMM, the MoE backend vLLM picks for bf16, block fp8 and GPT-OSS mxfp4, MLA on
    DeepGEMM): each checkpoint tensor refused at start-up, failing loudly, or written in place
    and compared with a cold start. vLLM's CUDA wheel cannot travel to a lent machine (64 MiB
    carry), so there this part says it is skipped.

With ``--cpu-smoke`` every section runs the same functions on tiny shapes on the CPU: Triton
kernels in Triton's interpreter (timings meaningless) and (c) without a CUDA graph (the
served module's eager forward stands in for the replay; the report says so); (e) runs its
vLLM rows emulated (the platform answering CUDA, DeepGEMM stood in: tests/gpu_emulation.py).
Only (e) imports vLLM.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

if "--cpu-smoke" in sys.argv:  # before anything imports Triton: kernels must be decorated for its interpreter
    os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

REPORT = "gpu_proof.md"
# (key, title, seconds on a GPU); the whole run stays under --budget
SECTIONS = [
    ("a", "Fused apply against the copy-bandwidth and sector floors", 110),
    ("b", "Codec v2 decoded on the device, against load_file", 100),
    ("c", "A CUDA-graph-captured Qwen2 takes three versions through the transaction", 130),
    ("d", "The publisher's diff on device-resident weights, against save_file", 100),
    ("e", "vLLM's CUDA post-processing under the census: what start-up refuses, what an update keeps equal to a cold start", 90),
]


# ============================================================================ the parent: time boxes, the report


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001 - a copy of the tree without .git
        return "unknown"


def _tail(text, n: int = 40) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").strip().splitlines()[-n:])


def run_all(args) -> int:
    """Run every section in a child process under its time box; rewrite the report after each."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    deadline = t0 + args.budget
    scale = 1.0 if not args.cpu_smoke else args.smoke_scale
    head = [f"# GPU proof{' (CPU smoke: Triton interpreter, tiny shapes, no CUDA graph)' if args.cpu_smoke else ''}", "",
            f"Command: `PYTHONPATH=. python3 gpu_acceptance/gpu_proof.py --out DIR{' --cpu-smoke' if args.cpu_smoke else ''}` "
            f"(commit {_git_commit()}, {time.strftime('%Y-%m-%d %H:%M:%S')}, python {sys.version.split()[0]}); "
            f"every section in its own process under its own time box, {args.budget:.0f} s in all.", ""]
    done: list[str] = []
    failures = 0

    def write(running: str | None = None):
        body = head + done + ([f"## ({running}) ... running", ""] if running else [])
        body.append(f"Report written after {time.monotonic() - t0:.0f} s.")
        (out / REPORT).write_text("\n".join(body) + "\n")

    for key, title, budget in SECTIONS:
        if args.only and key not in args.only:
            continue
        frag = out / f".section_{key}.md"
        frag.unlink(missing_ok=True)
        left = deadline - time.monotonic() - 5
        if left < 20:
            done += [f"## ({key}) {title}", "", f"**Skipped**: {left + 5:.0f} s of the {args.budget:.0f} s budget left.", ""]
            failures += 1
            write()
            continue
        limit = min(budget * scale, left)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--section", key, "--out", str(out)]
        if args.cpu_smoke:
            cmd.append("--cpu-smoke")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        write(running=key)
        t = time.monotonic()
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit, cwd=ROOT)
            status = "ok" if p.returncode == 0 else f"FAILED (exit code {p.returncode})"
            log_tail = _tail(p.stderr) if p.returncode else ""
        except subprocess.TimeoutExpired as e:
            status, log_tail = f"TIMED OUT after {limit:.0f} s (partial results above)", _tail((e.stderr or b"")) + "\n" + _tail(e.stdout or b"", 10)
        took = time.monotonic() - t
        body = frag.read_text() if frag.exists() else ""
        frag.unlink(missing_ok=True)
        failures += status != "ok"
        done += [f"## ({key}) {title}", "", body.rstrip(), "", f"Section status: **{status}** ({took:.0f} s).", ""]
        if log_tail:
            done += ["```", log_tail, "```", ""]
        write()
        print(f"({key}) {status} in {took:.0f} s", flush=True)
    write()
    print(f"report: {out / REPORT}", flush=True)
    return 1 if failures else 0


# ============================================================================ the child: one section


class Fragment:
    """A section's markdown, appended to its file line by line (a timed-out section keeps what it wrote)."""

    def __init__(self, path: Path):
        self.path = path
        path.write_text("")

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        with self.path.open("a") as f:
            f.write(line + "\n")


def _keys_in_env():
    """A signing key for this process's publisher and the same key trusted by its ranks."""
    import tempfile

    from engine_ext.store.signing import generate_key

    d = tempfile.mkdtemp(prefix="gpu_proof_keys_")
    generate_key(os.path.join(d, "k"))
    os.environ["ENGINE_EXT_SIGNING_KEY"] = os.path.join(d, "k")
    os.environ["ENGINE_EXT_TRUSTED_KEYS"] = os.path.join(d, "k.pub")
    os.environ.pop("ENGINE_EXT_ALLOW_UNSIGNED", None)


def run_section(args) -> int:
    _keys_in_env()
    import torch

    log = Fragment(Path(args.out) / f".section_{args.section}.md")
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu")
    try:
        {"a": section_a, "b": section_b, "c": section_c, "d": section_d, "e": section_e}[args.section](dev, args.cpu_smoke, log)
    except BaseException:
        log("")
        log("**Failed here:**")
        log("```")
        log(traceback.format_exc().rstrip())
        log("```")
        return 1
    return 0


def sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev, reps: int = 1):
    """(median seconds over ``reps``, the last result), the device synchronised around each."""
    import statistics

    ts, out = [], None
    for _ in range(reps):
        sync(dev)
        t = time.perf_counter()
        out = fn()
        sync(dev)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), out


def environment(dev, log):
    import torch

    try:
        import triton
        tv = triton.__version__
    except Exception:  # noqa: BLE001
        tv = "absent"
    try:
        import transformers
        hv = transformers.__version__
    except Exception:  # noqa: BLE001
        hv = "absent"
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (Triton interpreter: timings meaningless)"
    log(f"Device: {name}; torch {torch.__version__}, triton {tv}, transformers {hv}.")
    log("")


# ---------------------------------------------------------------------------- (a) fused apply


def _fp8_model(shapes, dev, g):
    """The linear weights of ``shapes`` as fp8 (e4m3) with fp32 block scales [ceil(out/128), ceil(in/128)],
    each its own parameter, and their maps (what an fp8-block checkpoint's linear layers hold)."""
    import torch

    from engine_ext.format.dtypes import BY_TORCH
    from engine_ext.server.maps import Piece, TensorMap, row_major_strides

    maps, views = {}, {}
    for n, s in shapes.items():
        if len(s) != 2 or "embed" in n or "lm_head" in n:
            continue
        w = torch.empty(s, device=dev).normal_(0, 64, generator=g).to(torch.float8_e4m3fn)
        sc = torch.empty((-(-s[0] // 128), -(-s[1] // 128)), device=dev).uniform_(1e-4, 1e-3, generator=g)
        for name, t in ((n, w), (n + "_scale_inv", sc)):
            maps[name] = TensorMap(name, tuple(t.shape), BY_TORCH[t.dtype],
                                   [Piece(t, (0, 0), tuple(t.shape), 0, row_major_strides(t.shape))])
            views[name] = t
    return maps, views


def _rl_delta(views, density, dev, g):
    """``density`` of each tensor's elements step by +-1 or 2 in the ordered bit space."""
    import torch

    from engine_ext.format.delta import TensorDelta
    from engine_ext.format.dtypes import BY_TORCH

    out = []
    for n, v in views.items():
        d = BY_TORCH[v.dtype]
        k = max(1, int(v.numel() * density))
        pos = torch.unique(torch.randint(0, v.numel(), (k,), device=dev, generator=g))
        step = torch.randint(1, 3, (pos.numel(),), device=dev, generator=g) * (
            torch.randint(0, 2, (pos.numel(),), device=dev, generator=g) * 2 - 1)
        out.append(TensorDelta(n, d, tuple(v.shape), "rel", pos, step.to(d.int_view)))
    return out


def _apply_rows(label, maps, views, dens, dev, g, kt, bw, smoke, log):
    from gpu_acceptance.gpu_kernels import ckpt_fps
    from engine_ext.format import fingerprint as fpr
    from engine_ext.server.apply import apply_delta

    deltas = _rl_delta(views, dens, dev, g)
    nnz = sum(d.nnz for d in deltas)
    fps0 = ckpt_fps(views)
    r = apply_delta(deltas, maps, backend="triton")  # warm-up: compiles
    r.undo.rollback()
    assert ckpt_fps(views) == fps0, "the warm-up's rollback did not restore the exact bits"
    kt.take()
    t_apply, k_apply, t_rb, k_rb = [], [], [], []
    for k in range(1 if smoke else 3):
        t, r = timed(lambda: apply_delta(deltas, maps, backend="triton"), dev)
        t_apply.append(t)
        k_apply.append(kt.take())
        if k == 0:  # the fused fingerprint changes equal a recomputation of every tensor
            fps1 = ckpt_fps(views)
            bad = [n for n in fps0 if (fps0[n] + r.fingerprint_delta[n]) & fpr.MASK64 != fps1[n]]
            assert not bad, f"fingerprint changes wrong for {bad[:3]}"
            assert sum(r.written.values()) == nnz
        t, _ = timed(r.undo.rollback, dev)
        t_rb.append(t)
        k_rb.append(kt.take())
    assert ckpt_fps(views) == fps0, "rollback did not restore the exact bits"
    useful = sum(d.nnz * (8 + 4 * d.dtype.itemsize) for d in deltas)  # pos, val, old, new, undo
    sector = sum(d.nnz * (8 + 2 * d.dtype.itemsize + 64) for d in deltas)  # pos, val, undo streamed; a sector each way
    back = sum(d.nnz * (8 + 2 * d.dtype.itemsize) for d in deltas)  # rollback: pos, undo read, old written
    sector_back = sum(d.nnz * (8 + d.dtype.itemsize + 64) for d in deltas)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    for what, t, k, b, sb in ((f"{label} apply, undo + fingerprints", med(t_apply), med(k_apply), useful, sector),
                              (f"{label} rollback", med(t_rb), med(k_rb), back, sector_back)):
        kk = k or t
        log(f"| {dens:.0%} | {what} | {nnz:,} | {t * 1e3:.2f} | {f'{k * 1e3:.2f}' if k else '-'} | {b / 1e9:.3f} | "
            f"{b / bw * 1e3:.3f} | {sb / bw * 1e3:.3f} | {kk / (b / bw):.1f} | {kk / (sb / bw):.1f} |")


def section_a(dev, smoke, log):
    import torch

    from gpu_acceptance.gpu_kernels import KernelTimer, build_model, copy_bandwidth, qwen2_shapes

    environment(dev, log)
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = qwen2_shapes(64, 2, 256, 128, 16) if smoke else qwen2_shapes(3584, 28, 152064, 18944, 512)
    bw = copy_bandwidth(dev)
    t0 = time.perf_counter()
    params, maps, views = build_model(shapes, dev, g)
    numel = sum(p.numel() for p in params.values())
    log(f"Qwen2-7B-shaped bf16 model{' (tiny: smoke)' if smoke else ''}: {numel / 1e6:,.1f} M elements in {len(params)} "
        f"parameters (q/k/v and gate/up packed), {len(shapes)} checkpoint tensors; copy bandwidth {bw / 1e9:.0f} GB/s "
        f"(read + write); built in {time.perf_counter() - t0:.1f} s. Medians of {1 if smoke else 3}; kernel = CUDA-event "
        "time of the launches, total = the whole call (validation, tables, one sync).")
    log("")
    log("| density | what | changed elements | total ms | kernel ms | bytes moved GB | copy floor ms | sector floor ms | "
        "kernel / copy floor | kernel / sector floor |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    kt = KernelTimer(dev)
    for dens in (0.01, 0.03):
        _apply_rows("bf16", maps, views, dens, dev, g, kt, bw, smoke, log)
    del params, maps, views
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    maps8, views8 = _fp8_model(shapes, dev, g)
    for dens in (0.01, 0.03):
        _apply_rows("fp8 block", maps8, views8, dens, dev, g, kt, bw, smoke, log)
    n8 = sum(v.numel() for v in views8.values())
    log("")
    log(f"fp8 block: the {len(views8) // 2} linear weights as fp8 e4m3 ({n8 / 1e6:,.1f} M elements with their fp32 "
        "128 x 128 block scales, the same density of each changing). Bytes moved per changed element of width w: "
        "positions 8 + values, old, new and undo w each (rollback: 8 + 2w); sector floor: 8 + 2w streamed and one 32-byte "
        "sector read and written. Each result is checked: the fused fingerprint changes equal a recomputation of every "
        "tensor, and the rollback restores the exact bits.")


# ---------------------------------------------------------------------------- (b) v2 decode on the device


def _v2_pair(shape, dens, gen):
    """bf16 weights ~ N(0, 0.02) with a spread of magnitudes, and a next version where about ``dens`` of
    them move one or two ULPs, small weights more often (as in training, so the context coder pays)."""
    import torch

    w = (torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen)) * 0.02).to(torch.bfloat16)
    inv = 1.0 / w.float().abs().clamp(min=1e-4)
    rate = (inv * (dens / inv.mean())).clamp(max=0.9)
    hit = torch.rand(shape, generator=gen) < rate
    step = (torch.randint(0, 2, shape, generator=gen) * 2 - 1) * (1 + (torch.rand(shape, generator=gen) < 0.2).int())
    bits = w.view(torch.int16).clone()
    bits[hit] += step[hit].to(torch.int16)
    return w, bits.view(torch.bfloat16)


def section_b(dev, smoke, log):
    import tempfile

    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    from engine_ext.format import codec
    from engine_ext.format.context import blocks as context_blocks, codec as context_codec
    from engine_ext.triton_kernels import context_decode
    from engine_ext.format.dtypes import BY_NAME, as_bits

    environment(dev, log)
    bf16 = BY_NAME["bfloat16"]
    n_t, shape = (2, (96, 64)) if smoke else (8, (4096, 4096))
    names = [f"model.layers.{i}.mlp.{'up' if i % 2 == 0 else 'down'}_proj.weight" for i in range(n_t)]
    log(f"{n_t} bf16 tensors of {shape[0]} x {shape[1]} (up_proj and down_proj names: blocks cut for TP 2-8 along "
        "rows and columns), changes following the magnitudes as in training. Host = "
        f"`context_codec.decode` (numba, {os.cpu_count()} cores); device = `context_decode.decode` (streams on the "
        "host, the pass in Triton on the device, the base read in place); streams = the host part alone; load = "
        "`safetensors.torch.load_file` of the same tensors to the device from the page cache.")
    log("")
    log("| density | changed | payload B / change | host decode ns / base el | device decode ns / base el | "
        "device ns / change | streams ns / change | pass ns / base el | load_file ns / el | device decode / load_file | "
        "bit-exact | D2H copies in a decode |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for dens in ((0.05,) if smoke else (0.01, 0.03)):
        pairs = [_v2_pair(shape, dens, gen) for _ in names]
        bases = [as_bits(w).reshape(-1) for w, _ in pairs]
        changes = []
        for (w, new), ob in zip(pairs, bases):
            nb = as_bits(new).reshape(-1)
            pos = torch.nonzero(ob != nb).reshape(-1)
            changes.append((pos, ob[pos], nb[pos]))
        tables = codec.step_tables_by_dtype((bf16, o, n) for _, o, n in changes)["bfloat16"]
        encs = []
        for name, ob, (pos, o, n) in zip(names, bases, changes):
            ctx = codec.Context(ob, context_blocks.block_policy(name, shape), tables, codec.Readers(mbps=0))
            e = codec.encode(bf16, ob.numel(), pos, n, o, context=ctx, shape=shape)
            if e.pos_coder != "ctx-rans":
                raise AssertionError(f"{name}: the publisher's choice is not codec v2 here ({e.pos_coder})")
            encs.append(e)
        nnz = sum(p.numel() for p, _, _ in changes)
        numel = sum(b.numel() for b in bases)
        payload = sum(len(e.pos) + len(e.val) for e in encs)

        def host():
            out = []
            for e, ob, (pos, _, _) in zip(encs, bases, changes):
                base = ob.numpy()
                out.append(context_codec.decode(context_codec.StoredPart("bfloat16", shape, None, e.pos, e.val, pos.numel(), tables), lambda box, base=base: context_blocks.box_of(base, shape, box)))
            return out

        on_dev = [b.to(dev) for b in bases]

        def device():
            out = []
            for e, b, (pos, _, _) in zip(encs, on_dev, changes):
                view = b.view(shape)
                out.append(context_decode.decode(context_codec.StoredPart("bfloat16", shape, None, e.pos, e.val, pos.numel(), tables), lambda box, view=view: view[tuple(slice(a, z) for a, z in zip(*box))]))
            return out

        def streams():
            for e, (pos, _, _) in zip(encs, changes):
                context_codec.decode_streams(context_codec.StoredPart("bfloat16", shape, None, e.pos, e.val, pos.numel(), tables))

        want = host()  # warm-ups (numba, Triton compile)
        got = device()
        exact = all(np.array_equal(w[0], g_[0].cpu().numpy()) and np.array_equal(w[1], g_[1].cpu().numpy())
                    for w, g_ in zip(want, got))
        reps = 1 if smoke else 3
        t_host, _ = timed(host, dev, reps)
        t_dev, _ = timed(device, dev, reps)
        t_streams, _ = timed(streams, dev, reps)
        d2h = "-"
        if dev.type == "cuda":
            d2h = _count_d2h(device)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "base.safetensors")
            save_file({n: w.contiguous() for n, (w, _) in zip(names, pairs)}, path)
            load_file(path, device=str(dev))  # the page cache holds it

            def load():
                got = load_file(path, device=str(dev))
                if dev.type == "cpu":  # load_file maps the file: read every byte, as a load to a device does
                    for t in got.values():
                        t.clone()
                return got

            t_load, _ = timed(load, dev, reps)
        log(f"| {dens:.0%} | {nnz:,} | {payload / nnz:.3f} | {t_host / numel * 1e9:.3f} | {t_dev / numel * 1e9:.3f} | "
            f"{t_dev / nnz * 1e9:.1f} | {t_streams / nnz * 1e9:.1f} | {(t_dev - t_streams) / numel * 1e9:.4f} | "
            f"{t_load / numel * 1e9:.3f} | {t_dev / t_load:.2f}x | {exact} | {d2h} |")
        if not exact:
            raise AssertionError("the device decode differs from the host decode")
    log("")
    log("The device decode returns positions and values on the device (what the fused apply reads); the host decode "
        "needs the base on the host (a GPU rank would first copy its changed weights there). `pass` is the device "
        "decode less the streams: the context pass and its launches.")
    _rans_streams(dev, smoke, log)


def _rans_streams(dev, smoke, log):
    """(b), its ctx-rans streams alone: ``engine_ext.triton_kernels.rans_decode`` (one launch per part, one program
    per chunk, the part's bytes already on the device) against the host decoder (``rans_stage.decode``, numba, on
    one thread and on every core), in ns per change, bit-exact; the host's plan of a part (header and directory)
    timed apart, as both decoders need it."""
    import numpy as np
    import torch

    from engine_ext.format import codec
    from engine_ext.format.context import blocks as context_blocks, codec as context_codec, rans_stage
    from engine_ext.format.context.scan_kernels import pool as scan_pool
    from engine_ext.format.dtypes import BY_NAME, as_bits, step_between
    from engine_ext.triton_kernels import rans_decode

    n_t, shape, dens = (2, (96, 64), 0.05) if smoke else (8, (4096, 4096), 0.01)
    gen = torch.Generator().manual_seed(1)
    parts = []
    for i in range(n_t):
        w, new = _v2_pair(shape, dens, gen)
        ob, nb = as_bits(w).reshape(-1), as_bits(new).reshape(-1)
        pos = torch.nonzero(ob != nb).reshape(-1)
        parts.append((f"model.layers.{i}.mlp.{'up' if i % 2 == 0 else 'down'}_proj.weight", ob, pos, ob[pos], nb[pos]))
    tables = codec.step_tables_by_dtype((BY_NAME["bfloat16"], o, n) for *_, o, n in parts)["bfloat16"]
    plans = []  # (bytes, plan, header, blocks, the bytes on the device)
    for name, ob, pos, o, n in parts:
        e = context_codec.encode("bfloat16", shape, None, context_blocks.block_policy(name, shape), ob.numpy(),
                                 pos.numpy(), step_between(o, n, True).numpy(), tables)
        data = e if isinstance(e, bytes) else e.pos  # ctx-rans: the part in one segment
        d = np.frombuffer(data, np.uint8)
        h, bl = context_codec.part_header("bfloat16", shape, None, data, pos.numel())
        p = rans_stage.plan(d, h, bl, np.int16, tables)
        plans.append((d, p, h, bl, torch.from_numpy(d.copy()).to(dev)))
    nnz = sum(p.n for _, p, *_ in plans)
    cores = os.cpu_count() or 1

    def host(workers):
        return [rans_stage.decode(d, p, workers, scan_pool()) for d, p, *_ in plans]

    def device():
        return [rans_decode.decode(t, p) for _, p, _, _, t in plans]

    def plan_all():
        for d, _, h, bl, _ in plans:
            rans_stage.plan(d, h, bl, np.int16, tables)

    want, got = host(1), device()  # warm-ups (numba, Triton's compile)
    exact = all(np.array_equal(w[0], g[0].cpu().numpy()) and np.array_equal(w[1], g[1].cpu().numpy())
                for w, g in zip(want, got))
    reps = 1 if smoke else 5
    t_one, _ = timed(lambda: host(1), dev, reps)
    t_all, _ = timed(lambda: host(cores), dev, reps)
    t_dev, _ = timed(device, dev, reps)
    t_plan, _ = timed(plan_all, dev, reps)
    chunks = [len(p.which) for _, p, *_ in plans]
    log("")
    log(f"**ctx-rans streams alone** ({n_t} parts of {shape[0]} x {shape[1]} bf16 at {dens:.0%}): the device decoder "
        "(`engine_ext.triton_kernels.rans_decode`: one launch per part, one program per chunk, the part's bytes "
        f"already on the device) against the host's (`rans_stage.decode`, numba: 1 thread and {cores}); plan = the "
        "host's parse of a part's header and directory, which both need.")
    log("")
    log("| changes | chunks (programs) per part | lanes | host 1 thread ns / change | host all cores ns / change | "
        "device ns / change | device ms / part | plan ns / change | bit-exact |")
    log("|---|---|---|---|---|---|---|---|---|")
    log(f"| {nnz:,} | {min(chunks)}-{max(chunks)} | {int(max(p.lanes.max() for _, p, *_ in plans))} | "
        f"{t_one / nnz * 1e9:.2f} | {t_all / nnz * 1e9:.2f} | {t_dev / nnz * 1e9:.2f} | {t_dev / n_t * 1e3:.3f} | "
        f"{t_plan / nnz * 1e9:.2f} | {exact} |")
    if not exact:
        raise AssertionError("the device's ctx-rans decode differs from the host's")


def _count_d2h(fn) -> str:
    """Device-to-host copies while ``fn`` runs, from the profiler: their count and total time (a copy of
    the base, hundreds of MB, would take milliseconds; the decode's own are a few scalars per part)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
        copies = [e for e in prof.events() if "dtoh" in e.name.lower() or "device -> host" in e.name.lower()
                  or "devicetohost" in e.name.lower()]
        us = sum(getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0) for e in copies)
        return f"{len(copies)} ({us:.0f} us)"
    except Exception as e:  # noqa: BLE001 - the profiler is evidence, not the result
        return f"not counted ({type(e).__name__})"


def _v2_parts(store: str, version: int) -> tuple[int, int, int]:
    """(context-coded parts, changed parts, payload bytes) of a published delta."""
    from engine_ext.format.manifest import Manifest

    m = Manifest.from_json(Path(store, f"v{version:08d}.json").read_bytes())
    parts = [p for t in m.tensors if t.nnz for p in (t.chunks or [t])]
    return sum(p.positions.coder == "ctx-rans" for p in parts), len(parts), m.payload_bytes


# ---------------------------------------------------------------------------- (c) CUDA graph through the transaction


class LocalRanks:
    """:class:`engine_ext.server.transaction.Ranks` over updaters in this process (as tests/fake_ranks.py):
    ``fail_next_apply`` answers the next apply with a failure *after* the rank applied it (another rank
    failing), so the driver must roll the applied rank back."""

    def __init__(self, updaters):
        self.updaters, self.fail_next_apply = updaters, False

    async def call(self, op, **kw):
        from engine_ext.server.protocol import RankReply
        from engine_ext.server.rank import run_op

        out = []
        for up in self.updaters:
            w = run_op(up, op, kw)
            if op == "apply" and self.fail_next_apply:
                self.fail_next_apply = False
                w = RankReply.failure(up.rank, RuntimeError("another rank failed (injected)")).to_wire()
            out.append(RankReply.from_wire(w))
        return out

    async def pause(self, mode):
        pass

    async def resume(self):
        pass

    async def after_update(self, version):
        pass


def section_c(dev, smoke, log):
    import asyncio
    import tempfile

    import torch
    import transformers

    from engine_ext import settings
    from engine_ext.errors import DeltaError
    from engine_ext.triton_kernels import context_decode
    from engine_ext.format.dtypes import BY_TORCH, as_bits
    from engine_ext.server import apply_fused
    from engine_ext.server.controller import Controller
    from engine_ext.server.protocol import UpdateRequest
    from engine_ext.server.rank import RankUpdater
    from engine_ext.store.sources import Sources
    from engine_ext.trainer.publisher import DeltaPublisher

    environment(dev, log)
    size = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2) if smoke else \
        dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4)
    cfg = transformers.Qwen2Config(max_position_embeddings=256, tie_word_embeddings=False, **size)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)

    def fresh(sd):
        m = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
        m.load_state_dict(sd)
        return m.to(dev).eval()

    versions = [{n: t.detach().clone() for n, t in transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16).state_dict().items()}]
    master = {n: t.float() for n, t in versions[0].items()}
    g = torch.Generator().manual_seed(1)
    for _ in range(3):  # sign steps of fixed size: small weights cross a bf16 rounding edge more often
        for t in master.values():
            t.add_(torch.sign(torch.randn(t.shape, generator=g)) * 1e-5)
        versions.append({n: t.to(torch.bfloat16) for n, t in master.items()})
    numel = sum(t.numel() for t in versions[0].values())
    dims = ", ".join(f"{k} {v}" for k, v in size.items())
    log(f"Qwen2 ({dims}; {numel / 1e6:.1f} M bf16 parameters, "
        "sdpa attention), versions from sign steps of 1e-5 on fp32 masters; published by `DeltaPublisher` bytes first "
        "(`ENGINE_EXT_READER_MBPS=0`: codec v2 wherever it saves 10 %, so that the ranks decode it; the deployed "
        "default would code v1 for fast GPU readers), applied by one `RankUpdater` (device decode, fused apply) under a "
        "`Controller`.")
    log("")
    with tempfile.TemporaryDirectory() as store:
        with settings.override(reader_mbps=0), DeltaPublisher(store, anchor_every=0) as pub:  # bytes first: v2 decoded
            for sd in versions:
                pub.publish(sd)
        ctx_parts = [_v2_parts(store, v) for v in (1, 2, 3)]
        served = fresh(versions[0])
        L = 16
        ids = torch.randint(4, cfg.vocab_size, (1, L), generator=g).to(dev)
        mask = {"full_attention": torch.ones(L, L, dtype=torch.bool, device=dev).tril()[None, None]}
        how = "an explicit causal mask (the same attention path in the graph and in eager runs)"
        try:  # decided once, before any capture: a prepared mask (transformers >= 4.53 takes a dict of them)
            with torch.no_grad():
                served(input_ids=ids, attention_mask=mask, use_cache=False)
        except (TypeError, AttributeError, KeyError, ValueError, RuntimeError):
            mask, how = None, "no mask: this transformers takes no prepared mask, so the graph may differ from eager"

        def forward(m):
            with torch.no_grad():
                return m(input_ids=ids, attention_mask=mask, use_cache=False).logits

        forward(served)
        if dev.type == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    forward(served)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static = forward(served)

            def replay():
                graph.replay()
                return static.clone()
            log(f"Captured once with `torch.cuda.graph` ({how}); every result below is `graph.replay()`.")
        else:
            def replay():
                return forward(served)
            log(f"**No CUDA graph on the CPU (smoke)**: the served module's own eager forward stands in for the "
                f"replay ({how}); the storage check below is what the graph relies on.")
        log("")
        ptrs = {n: p.data_ptr() for n, p in served.named_parameters()}

        def load(name, t):
            with torch.no_grad():
                served.get_parameter(name).copy_(t)

        specs = {n: (tuple(t.shape), BY_TORCH[t.dtype]) for n, t in versions[0].items()}
        up = RankUpdater(served, load, specs, read_checkpoint=versions[0].__getitem__,
                         decode_backend="device" if smoke else "auto", apply_backend="triton" if smoke else "auto")
        ranks = LocalRanks([up])
        ctl = Controller(ranks, Sources([store]), version=0)
        asyncio.run(ctl.start())
        calls = {"decode": 0, "fused": 0}
        real_decode, real_fused = context_decode.decode, apply_fused.apply_fused

        def count_decode(*a, **k):
            calls["decode"] += 1
            return real_decode(*a, **k)

        def count_fused(*a, **k):
            calls["fused"] += 1
            return real_fused(*a, **k)

        context_decode.decode, apply_fused.apply_fused = count_decode, count_fused

        def check(v):
            out = replay()
            ref = forward(fresh(versions[v]))
            same = torch.equal(out, ref)
            diff = (out.float() - ref.float()).abs().max().item()
            exact = all(torch.equal(as_bits(p.detach()), as_bits(versions[v][n].to(dev))) for n, p in served.named_parameters())
            still = all(p.data_ptr() == ptrs[n] for n, p in served.named_parameters())
            return same, diff, exact, still

        log("| step | version served | v2 parts / changed parts | pause ms | device decodes | fused applies | "
            "replay == fresh eager model | max abs diff | weights bit-exact | no storage moved |")
        log("|---|---|---|---|---|---|---|---|---|---|")
        same, diff, exact, still = check(0)
        log(f"| start | 0 | - | - | - | - | {same} | {diff:.3g} | {exact} | {still} |")
        ok = same and exact and still
        for v in (1, 2, 3):
            if v == 2:  # an apply that another rank fails: this rank must undo what it wrote
                ranks.fail_next_apply = True
                before = dict(calls)
                try:
                    asyncio.run(ctl.update(UpdateRequest.parse({"url": str(Path(store, f"v{v:08d}.json"))})))
                    refused = False
                except DeltaError:
                    refused = True
                same, diff, exact, still = check(1)
                ok &= refused and same and exact and still
                log(f"| v2 applied, then failed by another rank: undone | {ctl.state.version} | {ctx_parts[1][0]} / "
                    f"{ctx_parts[1][1]} | - | {calls['decode'] - before['decode']} | {calls['fused'] - before['fused']} | "
                    f"{same} | {diff:.3g} | {exact} | {still} |")
            before = dict(calls)
            a = asyncio.run(ctl.update(UpdateRequest.parse({"url": str(Path(store, f"v{v:08d}.json"))})))
            same, diff, exact, still = check(v)
            ok &= same and exact and still and a["version"] == v
            log(f"| update to v{v} (fingerprints verified) | {a['version']} | {ctx_parts[v - 1][0]} / {ctx_parts[v - 1][1]} | "
                f"{a['pause_ms']:.1f} | {calls['decode'] - before['decode']} | {calls['fused'] - before['fused']} | {same} | "
                f"{diff:.3g} | {exact} | {still} |")
        context_decode.decode, apply_fused.apply_fused = real_decode, real_fused
    log("")
    log(f"All hold: **{ok}**. Device decodes: context-coded parts decoded by `context_decode.decode` (the pass where "
        "the weights live); fused applies: calls of `apply_fused` (the Triton executor).")
    if not ok:
        raise AssertionError("a replay, a weight or a storage check failed (table above)")


# ---------------------------------------------------------------------------- (d) the publisher's diff


def section_d(dev, smoke, log):
    import shutil
    import tempfile

    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "tests"))  # support.synthetic (tests/support)
    from support.synthetic import llm_shapes
    from engine_ext.format import codec
    from engine_ext.format import fingerprint as fpr
    from engine_ext.format.dtypes import as_bits
    from engine_ext.trainer.publisher import DeltaPublisher

    environment(dev, log)
    shapes = llm_shapes(hidden=64, layers=2, vocab=256, inter=128, kv=16) if smoke else \
        llm_shapes(hidden=1536, layers=28, vocab=151936, inter=8960, kv=256)
    g = torch.Generator(device=dev).manual_seed(0)
    sd = {}
    for n, s in shapes.items():
        t = torch.empty(s, dtype=torch.float32, device=dev)
        t.normal_(1.0, 0.05, generator=g) if n.endswith("norm.weight") else t.normal_(0, 0.02, generator=g)
        sd[n] = (t * torch.exp(torch.empty_like(t).normal_(0, 1, generator=g)) if t.dim() > 1 else t).to(torch.bfloat16)
    numel = sum(t.numel() for t in sd.values())
    log(f"A Qwen2-1.5B-shaped bf16 state dict{' (tiny: smoke)' if smoke else ''} on the {dev.type} ({numel / 1e6:,.1f} M "
        "elements); the next version moves "
        "1 % of the elements by one ULP, small weights more often (as training does). The training step waits for "
        "`publish` (the diff on the device, the kept bits follow in the same pass); `until stored` adds the background "
        "encode, hashes and writes (fsync). `save_file` writes the same state dict (from the device). The publisher's "
        f"readers: {codec.Readers.from_settings()} (`ENGINE_EXT_READER_*`; codec v2 only where it pays on them).")
    log("")
    tmp = tempfile.mkdtemp(prefix="gpu_proof_d_")
    try:
        store = os.path.join(tmp, "store")
        with DeltaPublisher(store, anchor_every=0) as pub:
            t_anchor, _ = timed(lambda: pub.publish(sd), dev)
            t_anchor_stored, _ = timed(pub.wait, dev)
            t_save, _ = timed(lambda: save_file(sd, os.path.join(tmp, "dense.safetensors")), dev)
            t = time.perf_counter()
            fd = os.open(os.path.join(tmp, "dense.safetensors"), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            t_fsync = time.perf_counter() - t
            deltas = []
            for _ in range(2):  # the first delta pays one-time costs (kernels loaded); the second is the steady state
                for t in sd.values():  # the next version, in place on the device
                    bits = as_bits(t).view(-1)
                    inv = 1.0 / t.float().abs().clamp(min=1e-4).view(-1)
                    hit = torch.rand(bits.shape, device=dev, generator=g) < inv * (0.01 / inv.mean())
                    bits[hit] += 1
                t_delta, _ = timed(lambda: pub.publish(sd), dev)
                t_delta_stored, _ = timed(pub.wait, dev)
                deltas.append((t_delta, t_delta_stored, pub.last_changed))
            want = fpr.model_fingerprint({n: fpr.tensor_fingerprint(t) for n, t in sd.items()})
            same = pub.fingerprint == want
        log("| version | the training step waits (s) | until stored (s) | save_file (s) | save_file + fsync (s) | "
            "step wait / save_file | changed | payload B / change | v2 parts / parts |")
        log("|---|---|---|---|---|---|---|---|---|")
        log(f"| 0 (anchor) | {t_anchor:.3f} | {t_anchor + t_anchor_stored:.2f} | {t_save:.2f} | {t_save + t_fsync:.2f} | "
            f"{t_anchor / t_save:.3f} | all | - | - |")
        for v, (t_delta, t_stored, changed) in enumerate(deltas, 1):
            n_ctx, n_parts, payload = _v2_parts(store, v)
            log(f"| {v} (1 % delta{', first' if v == 1 else ''}) | {t_delta:.3f} | {t_delta + t_stored:.2f} | {t_save:.2f} | "
                f"{t_save + t_fsync:.2f} | {t_delta / t_save:.3f} | {changed:,} | {payload / max(changed, 1):.3f} | "
                f"{n_ctx} / {n_parts} |")
        log("")
        log(f"The publisher's model fingerprint equals one recomputed from the device tensors: **{same}**.")
        if not same:
            raise AssertionError("the published fingerprint differs from the weights'")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------- (e) vLLM's CUDA post-processing


def _census_rows(dev, smoke, log):
    """(e), part 1 (no vLLM): the census's provenance tracker on the device's own ops. Each row derives a copy of a
    weight during a post-processing run under ``census.take`` and asks whether the census names the weight."""
    import torch

    from engine_ext.server import census

    def named(derive) -> bool:
        m = torch.nn.Module()
        m.weight = torch.nn.Parameter(torch.randn(256, 256, device=dev), requires_grad=False)
        census.take(m, lambda: setattr(m, "copy", derive(m.weight)))
        return "copy" in m.__dict__[census.CENSUS_ATTR].derived.get("", {})

    def triton_copy(w):
        import triton
        import triton.language as tl

        @triton.jit
        def _twice(src, dst, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(dst + i, tl.load(src + i, mask=i < n) * 2, mask=i < n)

        out = torch.empty_like(w)
        _twice[(triton.cdiv(w.numel(), 1024),)](w, out, w.numel(), BLOCK=1024)
        return out

    compiled = torch.compile(lambda w: (w.t() * 2).contiguous().to(torch.bfloat16), dynamic=True)
    rows = [("aten ops (`w.t().contiguous().to(bfloat16)`)", lambda w: w.t().contiguous().to(torch.bfloat16), True),
            ("a `torch.compile`d derivation (Dynamo under the census's dispatch mode)", compiled, True)]
    if dev.type == "cuda":
        rows.append(("a Triton kernel launch (`JITFunction.run`)", triton_copy, True))
    log("| a copy of a weight made during post-processing by | named by the census | expected |")
    log("|---|---|---|")
    ok = True
    for what, derive, want in rows:
        got = named(derive)
        ok &= got == want
        log(f"| {what} | {got} | {want} |")
    # Under the tracker's dispatch mode Dynamo runs a compiled function eagerly: the bytes must be those the
    # compiled code makes without the census (a cold start of vLLM without the plugin).
    w = torch.randn(256, 256, device=dev)
    outside = compiled(w)
    m = torch.nn.Module()
    m.weight = torch.nn.Parameter(w, requires_grad=False)
    census.take(m, lambda: setattr(m, "copy", compiled(m.weight)))
    same = bool(torch.equal(outside.view(torch.int16), m.copy.view(torch.int16)))
    ok &= same
    log(f"| the same `torch.compile`d derivation: its bytes under the census equal those without it | {same} | True |")
    if dev.type != "cuda":
        log("| a Triton kernel launch | not checked: the census hooks `JITFunction.run`, which Triton's interpreter "
            "does not use (on the CPU a launch is out of its sight; CI cannot check this row) | - |")
    log("")
    return ok


def _outcome_rows(label, build, post, ckpt0, ckpt1, dev, log, known_gap=False):
    """Post-process a module built from ``ckpt0`` under the census, start an updater over it as a GPU worker does,
    write ``ckpt1`` into every tensor it accepts (through the loader), and compare every tensor the module holds with
    a cold start: a module built from what the served checkpoint now is, post-processed. One table row per checkpoint
    tensor: refused (load check / census), fails loudly (the loader raised), in place = cold start, or DIVERGES."""
    import torch

    from engine_ext.server import census
    from gpu_emulation import outcome

    served = build(ckpt0)
    census.take(served, lambda: post(served))
    out = outcome(served, ckpt0)
    now, verdicts = dict(ckpt0), {}
    for name in ckpt0:
        if name in out.mismatched:
            verdicts[name] = "refused (load check)"
        elif name in out.unreproducible:
            verdicts[name] = "refused (census)"
        else:
            try:
                out.updater.load(name, ckpt1[name])
                now[name] = ckpt1[name]
                verdicts[name] = None
            except Exception as e:  # noqa: BLE001 - the engine's loader refusing the write is the verdict
                verdicts[name] = f"fails loudly ({type(e).__name__})"
    cold = build(now)
    census.take(cold, lambda: post(cold))

    def state(m):
        """Its parameters and every tensor the census found computed from the weights (not workspaces)."""
        got = {f"{n}": t for n, t in m.named_parameters()}
        derived = m.__dict__[census.CENSUS_ATTR].derived
        for mod_name, mod in m.named_modules():
            tensors = {}
            census.module_state(mod, tensors)
            got.update({f"{mod_name}:{p}": t for p, t in tensors.items() if p in derived.get(mod_name, {})})
        return got

    a, b = state(served), state(cold)
    diff = sorted(p for p in set(a) | set(b) if p not in a or p not in b or a[p].shape != b[p].shape
                  or a[p].dtype != b[p].dtype or not torch.equal(a[p].contiguous().view(torch.uint8),
                                                                  b[p].contiguous().view(torch.uint8)))
    ok = True
    for name, v in verdicts.items():
        if v is None:
            v = "DIVERGES from a cold start" if diff else "in place, equals a cold start"
            ok &= not diff or known_gap
        log(f"| {label} | `{name}` | {v} | {', '.join(f'`{p}`' for p in diff[:4]) or '-'} |")
    return ok


def _vllm_rows(dev, smoke, log):
    """(e), part 2: vLLM's own post-processing of the paths whose copies need a CUDA op (docs/GPU.md), on the device;
    on the CPU (smoke) the rows tests/test_gpu_paths.py emulates, with its stand-ins, so that this code cannot rot."""
    import contextlib

    import torch

    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001
        log(f"**Skipped**: vLLM is not importable here ({type(e).__name__}: {e}). Its CUDA wheel (hundreds of MiB) "
            "cannot travel to a lent machine (64 MiB carry); the rows below need a machine with vLLM and a GPU. "
            "The CPU-emulated rows run in CI: tests/test_gpu_paths.py.")
        return True
    sys.path.insert(0, str(ROOT / "tests"))
    import gpu_emulation as emu
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEParallelConfig, RoutingMethodType
    from vllm.model_executor.layers.quantization import fp8 as vllm_fp8

    emulate = dev.type != "cuda"
    vcfg = VllmConfig()
    import tempfile

    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(vcfg):  # one rank, as a single-GPU server (weight shapes read the TP size)
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="file://" + os.path.join(tempfile.mkdtemp(), "pg"))
        initialize_model_parallel(1, 1)
    cap = torch.cuda.get_device_capability() if not emulate else (9, 0)
    platform = (lambda: emu.cuda_platform(cap)) if emulate else contextlib.nullcontext
    stand_ins = (lambda: emu.deep_gemm_sm90()) if emulate else contextlib.nullcontext
    g = torch.Generator().manual_seed(0)

    def fp8(*shape):
        return (torch.randn(*shape, generator=g) * 120).clamp(-448, 448).to(torch.float8_e4m3fn).to(dev)

    def scales(*shape, ue8m0=False):
        s = torch.rand(*shape, generator=g) * 1e-3 + 1e-4
        return (torch.exp2(torch.round(torch.log2(s))) if ue8m0 else s).to(dev)

    def param(t):
        return torch.nn.Parameter(t, requires_grad=False)

    log(f"{'Emulated (CPU smoke: the platform answers CUDA 9.0, DeepGEMM stood in as in tests/gpu_emulation.py)' if emulate else f'On the device (compute capability {cap[0]}.{cap[1]})'}. "
        "Each checkpoint tensor of each path: refused at start-up (by the load check or the census), its write failing "
        "loudly in the engine's loader, or written in place and then compared with a cold start (every tensor the "
        "post-processed module holds, bit for bit).")
    log("")
    log("| path | checkpoint tensor | verdict | tensors that differ from a cold start |")
    log("|---|---|---|---|")
    ok = True

    # fp8 block dense, DeepGEMM (H100/H200/B200 default when DeepGEMM is present)
    from vllm.model_executor.kernels.linear.scaled_mm.deep_gemm import DeepGemmFp8BlockScaledMMKernel
    from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used, is_deep_gemm_supported

    def dense(ckpt):
        layer = torch.nn.Module()
        for n, t in ckpt.items():
            layer.register_parameter(n, param(t.clone()))
        layer.weight_block_size = [128, 128]
        k = object.__new__(DeepGemmFp8BlockScaledMMKernel)
        with platform(), stand_ins():
            k.use_deep_gemm_e8m0 = True if emulate else is_deep_gemm_e8m0_used()
            k.is_deep_gemm_supported = True if emulate else is_deep_gemm_supported()
        method = object.__new__(vllm_fp8.Fp8LinearMethod)
        method.use_marlin, method.block_quant, method.act_q_static, method.fp8_linear = False, True, False, k
        layer.quant_method = method
        return layer

    def dense_post(layer):
        with platform(), stand_ins():
            layer.quant_method.process_weights_after_loading(layer)

    for ue8m0 in (False, True):
        w0 = fp8(256, 256)
        if ue8m0:  # every block's largest magnitude in (224, 448], as a UE8M0 quantiser leaves it
            w0 = w0.float()
            w0[0, 0], w0[0, 128], w0[128, 0], w0[128, 128] = 400, -320, 300, 448
            w0 = w0.to(torch.float8_e4m3fn)
        ckpt0 = {"weight": w0, "weight_scale_inv": scales(2, 2, ue8m0=ue8m0)}
        ckpt1 = {"weight": fp8(256, 256), "weight_scale_inv": scales(2, 2)}
        label = f"fp8 block dense, DeepGEMM{', UE8M0 checkpoint (the requantisation changes no byte)' if ue8m0 else ''}"
        ok &= _outcome_rows(label, dense, dense_post, ckpt0, ckpt1, dev, log)

    # MoE: the backend vLLM's oracle picks on this device (bf16, block fp8)
    E, H, I = 4, 256, 256
    parallel = FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=1, ep_size=1, tp_rank=0, pcp_rank=0, dp_rank=0,
                                      ep_rank=0, sp_size=1, use_ep=False, all2all_backend="naive", enable_eplb=False)

    def moe_config(h=H, i=I, **kw):
        base = dict(num_experts=E, experts_per_token=2, hidden_dim=h, intermediate_size=i, num_local_experts=E,
                    num_logical_experts=E, activation=MoEActivation.SILU, device=str(dev),
                    routing_method=RoutingMethodType.Renormalize, moe_parallel_config=parallel, in_dtype=torch.bfloat16,
                    intermediate_size_per_partition=i, intermediate_size_per_partition_unpadded=i, hidden_dim_unpadded=h)
        base.update(kw)
        return FusedMoEConfig(**base)

    def moe_layer(make_method, ckpt, cfg):
        layer = torch.nn.Module()
        h, i = cfg.hidden_dim, cfg.intermediate_size_per_partition
        layer.moe_config, layer.local_num_experts, layer.intermediate_size_per_partition = cfg, E, i
        layer.activation = cfg.activation
        layer._expert_routing_tables = lambda: None
        with set_current_vllm_config(vcfg), platform(), torch.device(dev):
            method = make_method(layer, cfg)
            method.create_weights(layer, E, h, i, torch.bfloat16, weight_loader=None)
        with torch.no_grad():
            for n, t in ckpt.items():
                getattr(layer, n).data.copy_(t)
        layer.quant_method = method
        return layer

    def moe_post(layer):
        with set_current_vllm_config(vcfg), platform(), stand_ins():
            layer.quant_method.process_weights_after_loading(layer)

    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    bf16 = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16).to(dev)  # noqa: E731
    ck = lambda: {"w13_weight": bf16(E, 2 * I, H), "w2_weight": bf16(E, H, I)}  # noqa: E731
    try:
        probe = moe_layer(lambda layer, cfg: UnquantizedFusedMoEMethod(cfg), ck(), moe_config())
        label = f"bf16 MoE, {probe.quant_method.unquantized_backend.value} (vLLM's choice)"
        ok &= _outcome_rows(label, lambda c: moe_layer(lambda layer, cfg: UnquantizedFusedMoEMethod(cfg), c, moe_config()),
                            moe_post, ck(), ck(), dev, log)
    except Exception as e:  # noqa: BLE001
        ok = False
        log(f"| bf16 MoE | - | FAILED: {type(e).__name__}: {str(e)[:300]} | - |")

    def fp8_method(layer, cfg):
        layer.moe_config = cfg
        qc = vllm_fp8.Fp8Config(activation_scheme="dynamic", weight_block_size=[128, 128])
        m = vllm_fp8.Fp8MoEMethod(qc, layer)
        if emulate:  # the oracle's pick on an emulated H100 is Marlin (CUDA ops): DeepGEMM's path is the emulated one
            from vllm.model_executor.layers.fused_moe.oracle import fp8 as oracle

            m.fp8_backend = oracle.Fp8MoeBackend.DEEPGEMM
            m.experts_cls = oracle.backend_to_kernel_cls(m.fp8_backend)[0]
        return m

    ck8 = lambda: {"w13_weight": fp8(E, 2 * I, H), "w2_weight": fp8(E, H, I),  # noqa: E731
                   "w13_weight_scale_inv": scales(E, 2 * I // 128, H // 128), "w2_weight_scale_inv": scales(E, H // 128, I // 128)}
    try:
        probe = moe_layer(fp8_method, ck8(), moe_config())
        label = f"block-fp8 MoE, {probe.quant_method.fp8_backend.value}{' (forced: emulated)' if emulate else ' (vLLM`s choice)'}"
        ok &= _outcome_rows(label, lambda c: moe_layer(fp8_method, c, moe_config()), moe_post, ck8(), ck8(), dev, log)
    except Exception as e:  # noqa: BLE001
        ok = False
        log(f"| block-fp8 MoE | - | FAILED: {type(e).__name__}: {str(e)[:300]} | - |")

    if emulate:
        log("| GPT-OSS mxfp4 MoE; MLA with a block-fp8 `kv_b_proj` on DeepGEMM | - | not emulated: the copies are made by "
            "CUDA ops (triton_kernels' swizzle, FlashInfer, Marlin; DeepGEMM's GEMM); on a GPU with vLLM only | - |")
        log("")
        return ok

    # GPT-OSS mxfp4 MoE: the backend vLLM's oracle picks on this device
    from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4MoEMethod

    def u8(*s, lo=0, hi=256):
        return torch.randint(lo, hi, s, generator=g, dtype=torch.uint8).to(dev)

    h, i = 1024, 1024  # GPT-OSS's kernels align hidden and intermediate sizes to 256 (and up): 1024 needs no rounding
    oss = lambda: {"w13_weight": u8(E, 2 * i, h // 2), "w2_weight": u8(E, h, i // 2),  # noqa: E731
                   "w13_weight_scale": u8(E, 2 * i, h // 32, lo=118, hi=128), "w2_weight_scale": u8(E, h, i // 32, lo=118, hi=128),
                   "w13_bias": bf16(E, 2 * i), "w2_bias": bf16(E, h)}
    oss_cfg = lambda: moe_config(h, i, has_bias=True, activation=MoEActivation.SWIGLUOAI)  # noqa: E731
    try:
        probe = moe_layer(lambda layer, cfg: GptOssMxfp4MoEMethod(cfg), oss(), oss_cfg())
        label = f"GPT-OSS mxfp4 MoE, {probe.quant_method.mxfp4_backend.value} (vLLM's choice)"
        ok &= _outcome_rows(label, lambda c: moe_layer(lambda layer, cfg: GptOssMxfp4MoEMethod(cfg), c, oss_cfg()),
                            moe_post, oss(), oss(), dev, log)
    except Exception as e:  # noqa: BLE001
        ok = False
        log(f"| GPT-OSS mxfp4 MoE | - | FAILED: {type(e).__name__}: {str(e)[:300]} | - |")

    # MLA whose block-fp8 kv_b_proj runs on DeepGEMM: W_UK_T/W_UV dequantised by the layer's own GEMM on an identity
    try:
        from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import FP8ScaledMMLinearLayerConfig
        from vllm.model_executor.layers.attention.attention import set_default_quant_scales
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention
        from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8Dynamic128Sym, kFp8Static128BlockSym
        from vllm.v1.attention.backends.mla.triton_mla import TritonMLAImpl

        n, p, v, latent = 2, 64, 64, 512

        def mla(ckpt):
            model = torch.nn.Module()
            kv = torch.nn.Module()
            for name, t in ckpt.items():
                kv.register_parameter(name.split(".")[-1], param(t.clone()))
            kv.weight_block_size, kv.input_size_per_partition = [128, 128], latent
            with set_current_vllm_config(vcfg):
                kernel = DeepGemmFp8BlockScaledMMKernel(FP8ScaledMMLinearLayerConfig(
                    weight_quant_key=kFp8Static128BlockSym, activation_quant_key=kFp8Dynamic128Sym,
                    input_dtype=torch.bfloat16, out_dtype=torch.bfloat16, weight_shape=(n * (p + v), latent)))
            method = object.__new__(vllm_fp8.Fp8LinearMethod)
            method.use_marlin, method.use_deep_gemm, method.block_quant, method.act_q_static = False, True, True, False
            method.fp8_linear, method.weight_block_size = kernel, [128, 128]
            kv.quant_method = method
            attn = MLAAttention.__new__(MLAAttention)
            torch.nn.Module.__init__(attn)
            attn.impl = TritonMLAImpl.__new__(TritonMLAImpl)
            attn.is_amx_bmm_enabled = attn.dcp_q_replicate = False
            attn.is_aiter_triton_fp4_bmm_enabled = attn.is_aiter_triton_fp8_bmm_enabled = False
            attn.kv_b_proj, attn.kv_lora_rank, attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim = kv, latent, n, p, v
            attn.quant_config, attn.layer_name = None, "attn"
            with torch.device(dev):
                set_default_quant_scales(attn, register_buffer=True)
            model.kv_b_proj, model.attn = kv, attn
            return model

        def mla_post(model):
            with set_current_vllm_config(vcfg):
                model.kv_b_proj.quant_method.process_weights_after_loading(model.kv_b_proj)
                model.attn.process_weights_after_loading(torch.bfloat16)

        ckm = lambda: {"kv_b_proj.weight": fp8(n * (p + v), latent),  # noqa: E731
                       "kv_b_proj.weight_scale_inv": scales(n * (p + v) // 128, latent // 128)}
        ok &= _outcome_rows("MLA, block-fp8 `kv_b_proj` on DeepGEMM", mla, mla_post, ckm(), ckm(), dev, log)
    except Exception as e:  # noqa: BLE001
        ok = False
        log(f"| MLA, block-fp8 `kv_b_proj` on DeepGEMM | - | FAILED: {type(e).__name__}: {str(e)[:300]} | - |")
    log("")
    return ok


def section_e(dev, smoke, log):
    environment(dev, log)
    log("**Part 1: the census's tracker on this device's ops** (no vLLM needed).")
    log("")
    ok = _census_rows(dev, smoke, log)
    log("**Part 2: vLLM 0.32's CUDA post-processing** (docs/GPU.md), paths whose copies a CUDA op makes.")
    log("")
    ok &= _vllm_rows(dev, smoke, log)
    log(f"All hold: **{ok}** (a known gap, docs/GPU.md, is reported and does not count).")
    if not ok:
        raise AssertionError("a census row or a vLLM path did not hold (tables above)")


# ============================================================================ entry


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU, kernels in Triton's interpreter")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for all sections together")
    ap.add_argument("--smoke-scale", type=float, default=1.0, help=argparse.SUPPRESS)
    ap.add_argument("--only", default="", help="run only these sections (e.g. 'ab')")
    ap.add_argument("--section", help=argparse.SUPPRESS)  # internal: run one section (a child process)
    args = ap.parse_args()
    if args.section:
        return run_section(args)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
