"""In-process ``vllm.LLM`` users: take deltas through vLLM's own weight-update API.

    ENGINE_EXT_SOURCES=/path/to/store python examples/llm_hook.py --model DIR --store /path/to/store --upto 3

``VLLM_PLUGINS`` (or nothing: general plugins load by default) registers the
``delta`` weight-transfer backend; ``weight_transfer_config={"backend": "delta"}``
selects it, and the usual ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` calls apply a delta in place on every worker, verified
by fingerprints across ranks (rolled back on mismatch). ``collective_rpc("engine_ext",
args=("status",))`` reports each worker's state. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--store", required=True, help="store root holding v00000001.json ...")
    ap.add_argument("--upto", type=int, default=3, help="apply versions 1..upto")
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    os.environ.setdefault("ENGINE_EXT_SOURCES", args.store)

    from vllm import LLM, SamplingParams

    from engine_ext import fingerprint as fpr
    from engine_ext.service import combine_fingerprints

    llm = LLM(args.model, dtype="bfloat16", max_model_len=256, enforce_eager=True, tensor_parallel_size=args.tp,
              weight_transfer_config={"backend": "delta"})
    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [100, 200, 300]}]

    def run():
        return [[list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]]
                for o in llm.generate(prompts, sp, use_tqdm=False)]

    def fingerprint():
        reports = llm.collective_rpc("engine_ext", args=("setup",))
        return fpr.fmt(fpr.model_fingerprint(combine_fingerprints([r["fingerprints"] for r in reports])))

    before = run()
    llm.init_weight_transfer_engine({"init_info": {}})
    for v in range(1, args.upto + 1):
        llm.start_weight_update()
        llm.update_weights({"update_info": {"url": os.path.join(args.store, f"v{v:08d}.json")}})
        llm.finish_weight_update(weight_version=str(v))
        llm.reset_prefix_cache()
    error = None
    try:  # a delta on the wrong base fails verification and is rolled back on every rank
        llm.start_weight_update()
        llm.update_weights({"update_info": {"url": os.path.join(args.store, "v00000001.json")}})
    except Exception as e:  # noqa: BLE001
        error = str(e)[-300:]
    print(json.dumps({"before": before, "after": run(), "fingerprint": fingerprint(),
                      "weight_version": llm.get_weight_version(), "wrong_base_error": error,
                      "status": llm.collective_rpc("engine_ext", args=("status",))}))


if __name__ == "__main__":
    main()
