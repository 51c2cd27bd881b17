"""GPU check of fp8 block-quantised serving: a real vLLM server on an fp8-block checkpoint
(the DeepSeek-V3 / Qwen3-FP8 layout) takes K deltas published with
``DeltaPublisher(quantize="fp8-block")`` and then equals a server cold-started on the final
fp8 checkpoint: same fingerprint over every served fp8 byte and scale, same greedy tokens
and logprobs.

Why a script: vLLM's CPU build has no fp8 path on AVX2 hosts and VNNI-prepacks fp8 weights
on AMX hosts (the plugin refuses those at start-up, docs/MOE_FP8.md), so the suite checks
fp8 through SGLang's layer classes in-process; this checks a real fp8 server when a GPU
is lent. ``--kind qwen3-moe`` checks fp8 experts too (per-expert checkpoint).

What it checks: the start-up probe maps every tensor (no dense fallback) and finds every
live tensor equal to the checkpoint (``mismatched`` empty: a layout the fp8 method derives
at load would be named there); each update answers 200; the final fingerprint is the
last manifest's and the cold server's; outputs equal the cold start's.

    python gpu_acceptance/vllm_fp8_gpu_check.py --out gpu_acceptance/results/vllm_fp8_gpu.json [--kind qwen3-moe] [--tp 2]
    python gpu_acceptance/vllm_fp8_gpu_check.py --dry-run     # data only (no GPU): checks the publishing side
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from sglang_gpu_check import save_result  # noqa: E402  (same results layout as the SGLang GPU check)
PROMPTS = [[5, 17, 99, 3, 250], [100, 200, 300, 400, 17, 9], [9, 9, 9, 9, 9, 9], [999, 17, 450, 3, 77]]


def prepare(work: Path, args) -> dict:
    """bf16 masters -> fp8 model dir, store with v0 + K fp8 deltas, final fp8 checkpoint."""
    import torch

    from engine_ext.trainer.publisher import DeltaPublisher
    from engine_ext.tiny_models import load_state_dict, make_model, perturb, save_state_dict

    base = make_model(work / "bf16", args.kind, vocab=args.vocab, hidden=args.hidden, layers=args.layers,
                      heads=args.heads, kv_heads=args.kv_heads)
    master = {n: t.float() for n, t in load_state_dict(base).items()}
    model = save_state_dict(work / "model", master, base, quantize="fp8-block")
    gen = torch.Generator().manual_seed(0)
    store, urls, sizes = work / "store", [], []
    t = time.perf_counter()
    with DeltaPublisher(str(store), model="vllm-fp8-check", anchor_every=0, quantize="fp8-block") as pub:
        pub.publish(master, version=0)
        for v in range(1, args.steps + 1):
            master = perturb(master, gen, args.density)
            urls.append(pub.publish(master, version=v))
    for u in urls:
        m = json.loads(Path(u).read_text())
        sizes.append({"payload_bytes": m.get("payload_bytes") or sum(b["size"] for b in m["blobs"]),
                      "fp8_changed": sum(t["nnz"] for t in m["tensors"] if t["dtype"] == "float8_e4m3fn"),
                      "scales_changed": sum(t["nnz"] for t in m["tensors"] if t["name"].endswith("weight_scale_inv"))})
    final = save_state_dict(work / "final", master, base, quantize="fp8-block")
    return {"model": str(model), "final": str(final), "store": str(store), "urls": urls, "deltas": sizes,
            "publish_s": time.perf_counter() - t}


def outputs(server, max_new: int) -> list:
    """Greedy tokens and logprobs per prompt (compared exactly with the cold start's)."""
    out = []
    for p in PROMPTS:
        c = server.complete(p, max_tokens=max_new, logprobs=3)["choices"][0]
        out.append((c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "gpu_acceptance" / "results" / "vllm_fp8_gpu.json"))
    ap.add_argument("--kind", default="qwen2", choices=["qwen2", "llama", "qwen3-moe"])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--density", type=float, default=0.03)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--work", help="working dir (default: a temp dir, removed at the end)")
    ap.add_argument("--dry-run", action="store_true", help="prepare the data and print it; start no server")
    ap.add_argument("server_args", nargs=argparse.REMAINDER, help="extra vLLM server args after --")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="vllm_fp8_check_"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"argv": sys.argv, "ok": False}
    try:
        import torch

        result["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        data = prepare(work, args)
        result.update(publish_s=data["publish_s"], deltas=data["deltas"])
        if args.dry_run:
            print(json.dumps({"model": data["model"], "urls": data["urls"], "deltas": data["deltas"]}, indent=1))
            return 0
        from engine_ext.engines.vllm.launcher import VllmServer

        extra = [a for a in args.server_args if a != "--"]
        env = {"ENGINE_EXT_ALLOW_UNSIGNED": "1", "ENGINE_EXT_NO_AUTH": "1"}
        live = VllmServer(data["model"], sources=data["store"], tp=args.tp, base_version=0, env=env, args=extra,
                          log=work / "live.log", startup_s=900)
        try:
            result["status_before"] = st = live.status()
            result["before"] = outputs(live, args.max_new)
            result["answers"] = [dict(status=r.status_code, **r.json())
                                 for r in (live.update({"url": u}) for u in data["urls"])]
            result["after"], result["status_after"] = outputs(live, args.max_new), live.status()
        finally:
            live.stop()
        with VllmServer(data["final"], tp=args.tp, env=env, args=extra, log=work / "cold.log", startup_s=900) as cold:
            result["cold"], result["status_cold"] = outputs(cold, args.max_new), cold.status()
        layout = st.get("layout") or {}
        last_fp = json.loads(Path(data["urls"][-1]).read_text())["fingerprint"]
        result["checks"] = {
            "no_dense_fallback": layout.get("fallback") == [],
            "live_equals_checkpoint_at_start": layout.get("mismatched") == [],
            "all_updates_200": all(a["status"] == 200 for a in result["answers"]),
            "fingerprint_is_final_manifests": result["status_after"].get("fingerprint") == last_fp,
            "fingerprint_equals_cold_load": result["status_cold"].get("fingerprint") == last_fp,
            "outputs_identical_to_cold_start": result["after"] == result["cold"],
            "outputs_changed_by_updates": result["after"] != result["before"],
        }
        result["ok"] = all(result["checks"].values())
        print(json.dumps({k: result[k] for k in ("device", "deltas", "checks", "ok")}, indent=1))
        return 0 if result["ok"] else 1
    finally:
        save_result(Path(args.out), result, work, ("live.log", "cold.log"), remove_work=not args.work)


if __name__ == "__main__":
    sys.exit(main())
