"""The main job, end to end on the CPU: a trainer publishes a delta every step, a live
vLLM server takes each one in place through ``POST /update_weights_delta``.

    python examples/demo.py                 # defaults: tiny Qwen2, 10 steps, ./demo_out

What it does (all local, nothing downloaded):
1. makes a tiny random Qwen2 checkpoint (bf16), an empty local store, a signing key
   (``engine-ext keygen``) and a route token;
2. starts ``python -m vllm.entrypoints.openai.api_server`` on it with
   ``VLLM_PLUGINS=engine_ext``, ``ENGINE_EXT_SOURCES=<store>``, the public key as
   ``ENGINE_EXT_TRUSTED_KEYS`` and the token as ``ENGINE_EXT_TOKEN`` (secure by default:
   the server takes only signed versions, and only from callers with the token);
3. trains a toy copy of the model (fp32 master weights, Adam lr 3e-6 on random-token
   language-model batches plus gradient noise) and after every step casts to bf16 and
   publishes the version with ``engine_ext.publish.DeltaPublisher``;
4. asks the server to take each version while a client keeps generating;
5. prints a per-step table and saves ``demo_out/demo.png`` and ``demo_out/demo.json``.
At the end the served fingerprint must equal the trainer's last published one.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch

# Generation prompt (token ids: the tiny model's vocabulary is synthetic). Longer than 4
# tokens: on AMX hosts vLLM 0.32 died on a first step of <= 4 tokens unless the process had
# asked for AMX permission (the plugin does; docs/vllm.md, "Known vLLM CPU issues").
PROMPT = [5, 17, 99, 3, 250, 42, 7, 8]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="demo_out", help="work dir: model, store, log, plot")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--kind", default="qwen2", choices=["qwen2", "llama", "qwen2-tied"])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--grad-noise", type=float, default=1.0, help="std of noise added to each gradient, relative to its RMS")
    args = ap.parse_args()

    import requests
    import transformers

    from engine_ext import fingerprint as fpr
    from engine_ext.publish import DeltaPublisher
    from engine_ext.signing import generate_key
    from engine_ext.tiny_models import make_model
    from engine_ext.vllm.launcher import VllmServer

    out = Path(args.out).resolve()
    if out.exists():
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True)
    model_dir = make_model(out / "model", args.kind, hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2)
    store = out / "store"
    torch.manual_seed(0)
    trainer = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.Adam(trainer.parameters(), lr=args.lr)
    vocab = trainer.config.vocab_size

    def bf16_state():
        return {n: t.detach().to(torch.bfloat16) for n, t in trainer.state_dict().items()}

    dense_bytes = sum(t.numel() * 2 for t in bf16_state().values())
    numel = dense_bytes // 2
    print(f"model: {args.kind}, {numel / 1e6:.2f} M parameters, dense bf16 {dense_bytes / 1e6:.2f} MB", flush=True)
    print("starting vLLM CPU server with the engine_ext plugin (about a minute)...", flush=True)
    import secrets

    generate_key(out / "publisher.key")
    server = VllmServer(model_dir, sources=str(store), log=out / "server.log", token=secrets.token_hex(16),
                        trusted_keys=str(out / "publisher.key.pub"))
    engine = server.status()["layout"]["engine"][0]
    print(f"server up: CPU GEMM paths {engine.get('gemm')}, attention ISA {engine.get('attention_isa')}", flush=True)
    served = {"ok": 0, "failed": 0}
    stop = threading.Event()

    def client():  # keeps generating while updates happen
        while not stop.is_set():
            try:
                server.complete(PROMPT, max_tokens=16, logprobs=0)
                served["ok"] += 1
            except Exception:  # noqa: BLE001 - counted, shown in the table
                served["failed"] += 1

    rows = []
    try:
        with DeltaPublisher(str(store), anchor_every=0, signing_key=str(out / "publisher.key")) as pub:
            pub.publish(bf16_state())  # v0: anchor of the weights the server started from
            pub.wait()
            th = threading.Thread(target=client, daemon=True)
            th.start()
            for step in range(1, args.steps + 1):
                batch = torch.randint(4, vocab, (4, 32))
                loss = trainer(input_ids=batch, labels=batch).loss
                opt.zero_grad()
                loss.backward()
                with torch.no_grad():
                    for p in trainer.parameters():
                        if p.grad is not None:
                            rms = p.grad.pow(2).mean().sqrt() + 1e-12
                            p.grad.add_(torch.randn_like(p.grad) * rms * args.grad_noise)
                opt.step()
                t = time.perf_counter()
                uri = pub.publish(bf16_state())
                pub.wait()
                publish_ms = (time.perf_counter() - t) * 1e3
                before = dict(served)
                try:
                    r = server.update({"url": uri})
                except requests.ConnectionError as e:
                    raise SystemExit(f"update to {uri}: {e}; {server.diagnose()}") from None
                during = served["ok"] - before["ok"]
                if r.status_code != 200:
                    raise SystemExit(f"update to {uri} failed: {r.status_code} {r.text}")
                a = r.json()
                gen = server.complete(PROMPT, max_tokens=8, logprobs=0)["choices"][0]["text"]
                rows.append({
                    "step": step, "version": a["version"], "loss": round(loss.item(), 4),
                    "density_pct": 100 * a["elements"] / numel, "payload_bytes": a["payload_bytes"],
                    "dense_bytes": dense_bytes, "publish_ms": publish_ms, "pause_ms": a["pause_ms"],
                    "apply_ms": a["phases_ms"]["apply"], "fetch_decode_ms": a["phases_ms"]["fetch"],
                    "total_ms": a["phases_ms"]["total"], "served_during": during,
                    "failed": served["failed"], "sample": gen, "fingerprint": a["fingerprint"]})
                print_row(rows[-1], header=step == 1)
        stop.set()
        th.join(60)
        final_fp = server.status()["fingerprint"]
        want = json.loads((store / f"v{args.steps:08d}.json").read_text())["fingerprint"]
        trainer_fp = fpr.fmt(fpr.model_fingerprint({n: fpr.tensor_fingerprint(t) for n, t in bf16_state().items()}))
    finally:
        stop.set()
        server.stop()
    ok = final_fp == want == trainer_fp and served["failed"] == 0
    print(f"\nserved fingerprint {final_fp}, trainer's last version {trainer_fp}: {'identical' if final_fp == trainer_fp else 'DIFFERENT'}; "
          f"generation requests served during the run: {served['ok']}, failed: {served['failed']}")
    (out / "demo.json").write_text(json.dumps({"rows": rows, "ok": ok, "args": vars(args)}, indent=1))
    plot(rows, out / "demo.png")
    print(f"table: {out / 'demo.json'}, plot: {out / 'demo.png'}")
    if not ok:
        raise SystemExit(1)


def print_row(r: dict, header: bool) -> None:
    if header:
        print(f"{'step':>4} {'density':>8} {'payload':>10} {'dense':>10} {'ratio':>6} {'pause ms':>9} {'apply ms':>9} "
              f"{'fetch ms':>9} {'total ms':>9} {'served':>6}  sample (greedy, after the update)")
    print(f"{r['step']:>4} {r['density_pct']:>7.2f}% {r['payload_bytes']:>10,} {r['dense_bytes']:>10,} "
          f"{r['dense_bytes'] / max(r['payload_bytes'], 1):>5.0f}x {r['pause_ms']:>9.1f} {r['apply_ms']:>9.1f} "
          f"{r['fetch_decode_ms']:>9.1f} {r['total_ms']:>9.1f} {r['served_during']:>6}  {r['sample'][:24]}", flush=True)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    ax[0].plot(steps, [r["density_pct"] for r in rows], "o-")
    ax[0].set(title="changed elements per step", xlabel="step", ylabel="% of parameters")
    ax[1].semilogy(steps, [r["payload_bytes"] for r in rows], "o-", label="delta payload")
    ax[1].semilogy(steps, [r["dense_bytes"] for r in rows], "--", label="dense bf16 weights")
    ax[1].set(title="bytes per version", xlabel="step", ylabel="bytes")
    ax[1].legend()
    for key, label in (("pause_ms", "pause window"), ("apply_ms", "apply (all ranks)"), ("total_ms", "total update")):
        ax[2].plot(steps, [r[key] for r in rows], "o-", label=label)
    ax[2].set(title="server-side update time", xlabel="step", ylabel="ms")
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
