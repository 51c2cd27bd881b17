"""The main job, end to end on the CPU: a trainer learns, publishes a delta every step, and a
live vLLM server takes each one in place; the server's own answers show it learning.

    python examples/demo.py                 # defaults: tiny Qwen2, 10 steps, ./demo_out

What it does (all local, nothing downloaded):
1. makes a tiny random Qwen2 checkpoint (bf16) whose vocabulary holds the words of a target
   sentence, an empty local store, a signing key (``engine-ext keygen``) and a route token;
2. starts ``python -m vllm.entrypoints.openai.api_server`` on it with
   ``VLLM_PLUGINS=engine_ext``, ``ENGINE_EXT_SOURCES=<store>``, the public key as
   ``ENGINE_EXT_TRUSTED_KEYS`` and the token as ``ENGINE_EXT_TOKEN`` (secure by default:
   the server takes only signed versions, and only from callers with the token);
3. trains a copy of the model (fp32 master weights, plain SGD) to continue the prompt
   "the zen of python says" with "beautiful is better than ugly ..."; after every step it
   casts the weights to bf16 and publishes the version with ``engine_ext.trainer.publisher.DeltaPublisher``;
4. asks the server to take each version while a client keeps generating;
5. after each update asks the *server* how likely it finds the target and what it says
   itself (greedy): the served model moves toward the target, version by version;
6. prints a per-step table and saves ``demo_out/demo.png`` and ``demo_out/demo.json``.
At the end the served fingerprint must equal the trainer's last published one.

Plain SGD, not Adam: an RL step at lr ~1e-6 changes 1-3 % of the bf16 weights and moves the
policy slowly over hundreds of steps; SGD on one sentence changes a few % per step too
(small gradients stay below half a bf16 ULP) yet learns it in about ten.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch

PROMPT = "the zen of python says"
TARGET = "beautiful is better than ugly and explicit beats implicit so simple wins"
COLUMNS = (  # (header, what it counts)
    ("step", "training step = version published and served"),
    ("changed", "% of the model's elements whose bf16 bits changed in this version"),
    ("delta KB", "bytes of the published delta (positions and values, entropy coded), in KB"),
    ("smaller", "dense bf16 weights / delta bytes"),
    ("pause ms", "generation paused while every rank applied the delta in place"),
    ("update ms", "the whole update: plan, fetch, decode, pause, apply, verify"),
    ("logp/word", "the served model's mean log-probability of a target word (0 = certain)"),
    ("right", "target words the served greedy continuation gets right, of all"),
    ("gens", "generation requests the background client completed while the update ran"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="demo_out", help="work dir: model, store, log, plot")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.015, help="SGD learning rate")
    args = ap.parse_args()

    import requests
    import transformers

    from engine_ext.format import fingerprint as fpr
    from engine_ext.trainer.publisher import DeltaPublisher
    from engine_ext.store.signing import generate_key
    from engine_ext.tiny_models import make_model, word_ids
    from engine_ext.engines.vllm.launcher import VllmServer

    out = Path(args.out).resolve()
    if out.exists():
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True)
    words = list(dict.fromkeys((PROMPT + " " + TARGET).split()))
    model_dir = make_model(out / "model", "qwen2", hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2, words=words)
    ids = word_ids(words)
    prompt, target = [ids[w] for w in PROMPT.split()], [ids[w] for w in TARGET.split()]
    store = out / "store"
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the server computes on the other core: a second thread here would fight it
    trainer = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.SGD(trainer.parameters(), lr=args.lr)
    batch = torch.tensor([prompt + target])
    labels = batch.clone()
    labels[0, :len(prompt)] = -100  # learn the continuation only

    def bf16_state():
        return {n: t.detach().to(torch.bfloat16) for n, t in trainer.state_dict().items()}

    dense_bytes = sum(t.numel() * 2 for t in bf16_state().values())
    numel = dense_bytes // 2
    print(f"model: qwen2, {numel / 1e6:.2f} M parameters, dense bf16 {dense_bytes / 1e6:.2f} MB\n"
          f"the trainer learns: \"{PROMPT}\" -> \"{TARGET}\"", flush=True)
    print("starting vLLM CPU server with the engine_ext plugin (about a minute)...", flush=True)
    import secrets

    generate_key(out / "publisher.key")
    server = VllmServer(model_dir, sources=str(store), log=out / "server.log", token=secrets.token_hex(16),
                        trusted_keys=str(out / "publisher.key.pub"))
    engine = server.status()["layout"]["engine"][0]
    print(f"server up: CPU GEMM paths {engine.get('gemm')}, attention ISA {engine.get('attention_isa')}", flush=True)

    def served() -> dict:
        """What the server says now: its greedy continuation, and how likely it finds the target."""
        said = server.complete(prompt, max_tokens=len(target), logprobs=0)["choices"][0]
        r = requests.post(server.url + "/v1/completions", timeout=120, json={
            "model": server.model, "prompt": prompt + target, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0})
        r.raise_for_status()
        per_position = r.json()["choices"][0]["prompt_logprobs"][len(prompt):]
        logp = [p[str(t)]["logprob"] for p, t in zip(per_position, target)]
        tokens = said["logprobs"]["tokens"]
        return {"sample": " ".join(tokens), "right": sum(a == b for a, b in zip(tokens, TARGET.split())),
                "logp_per_word": sum(logp) / len(logp)}

    gens = {"ok": 0, "failed": 0}
    stop = threading.Event()

    def client():  # keeps generating while updates happen
        while not stop.is_set():
            try:
                server.complete(prompt, max_tokens=16, logprobs=0)
                gens["ok"] += 1
            except Exception:  # noqa: BLE001 - counted, shown at the end
                gens["failed"] += 1

    rows = []
    try:
        with DeltaPublisher(str(store), anchor_every=0, signing_key=str(out / "publisher.key")) as pub:
            pub.publish(bf16_state())  # v0: anchor of the weights the server started from
            pub.wait()
            rows.append({"step": 0, **served()})
            print_legend(rows[0], len(target))
            th = threading.Thread(target=client, daemon=True)
            th.start()
            for step in range(1, args.steps + 1):
                loss = trainer(input_ids=batch, labels=labels).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
                uri = pub.publish(bf16_state())
                pub.wait()
                before = gens["ok"]
                try:
                    r = server.update({"url": uri})
                except requests.ConnectionError as e:
                    raise SystemExit(f"update to {uri}: {e}; {server.diagnose()}") from None
                if r.status_code != 200:
                    raise SystemExit(f"update to {uri} failed: {r.status_code} {r.text}")
                a = r.json()
                rows.append({
                    "step": step, "version": a["version"], "train_loss": round(loss.item(), 4),
                    "changed_pct": 100 * a["elements"] / numel, "delta_bytes": a["payload_bytes"],
                    "dense_bytes": dense_bytes, "pause_ms": a["pause_ms"], "update_ms": a["phases_ms"]["total"],
                    "gens": gens["ok"] - before, "fingerprint": a["fingerprint"], **served()})
                print_row(rows[-1], len(target))
        stop.set()
        th.join(60)
        final_fp = server.status()["fingerprint"]
        trainer_fp = fpr.fmt(fpr.model_fingerprint({n: fpr.tensor_fingerprint(t) for n, t in bf16_state().items()}))
    finally:
        stop.set()
        server.stop()
    ok = final_fp == trainer_fp and gens["failed"] == 0
    print(f"\nserved fingerprint {final_fp}, trainer's last version {trainer_fp}: "
          f"{'identical' if final_fp == trainer_fp else 'DIFFERENT'}; generation requests during the run: "
          f"{gens['ok']} served, {gens['failed']} failed")
    (out / "demo.json").write_text(json.dumps({"rows": rows, "ok": ok, "args": vars(args), "prompt": PROMPT,
                                               "target": TARGET, "columns": dict(COLUMNS)}, indent=1))
    plot(rows, len(target), out / "demo.png")
    print(f"table: {out / 'demo.json'}, plot: {out / 'demo.png'}")
    if not ok:
        raise SystemExit(1)


def print_legend(start: dict, n: int) -> None:
    print("\ncolumns:")
    for head, what in COLUMNS:
        print(f"  {head:>9}: {what}")
    print(f"\nbefore training the server says: \"{start['sample']}\" "
          f"(logp/word {start['logp_per_word']:.2f}, right {start['right']}/{n})\n")
    print("  ".join(f"{h:>9}" for h, _ in COLUMNS) + "  served continuation (greedy)", flush=True)


def print_row(r: dict, n: int) -> None:
    cells = [f"{r['step']}", f"{r['changed_pct']:.2f}%", f"{r['delta_bytes'] / 1e3:.1f}",
             f"{r['dense_bytes'] / max(r['delta_bytes'], 1):.0f}x", f"{r['pause_ms']:.1f}", f"{r['update_ms']:.0f}",
             f"{r['logp_per_word']:.2f}", f"{r['right']}/{n}", f"{r['gens']}"]
    print("  ".join(f"{c:>9}" for c in cells) + f"  {r['sample']}", flush=True)


def plot(rows: list[dict], n: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    upd = rows[1:]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    ax[0].plot(steps, [r["logp_per_word"] for r in rows], "o-", label="log p(target word), served")
    ax[0].set(title="the served model learns the target", xlabel="version served", ylabel="mean log-probability")
    twin = ax[0].twinx()
    twin.plot(steps, [r["right"] for r in rows], "s--", color="tab:green", label="target words right (greedy)")
    twin.set(ylabel=f"words right, of {n}", ylim=(-0.5, n + 0.5))
    ax[0].legend(loc="center left")
    twin.legend(loc="lower right")
    ax[1].semilogy([r["step"] for r in upd], [r["delta_bytes"] for r in upd], "o-", label="delta published")
    ax[1].semilogy([r["step"] for r in upd], [r["dense_bytes"] for r in upd], "--", label="dense bf16 weights")
    ax[1].set(title="bytes per version", xlabel="version", ylabel="bytes")
    ax[1].legend()
    ax[2].plot([r["step"] for r in upd], [r["pause_ms"] for r in upd], "o-", label="generation paused")
    ax[2].plot([r["step"] for r in upd], [r["update_ms"] for r in upd], "o-", label="whole update")
    ax[2].set(title="server-side update time", xlabel="version", ylabel="ms")
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
