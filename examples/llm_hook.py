"""In-process ``vllm.LLM`` users: take deltas through vLLM's own weight-update API.

    ENGINE_EXT_SOURCES=/path/to/store python examples/llm_hook.py --model DIR --urls /path/to/store/v00000003.json

``VLLM_PLUGINS`` (or nothing: general plugins load by default) registers the ``engine_ext``
weight-transfer backend; ``weight_transfer_config={"backend": "engine_ext"}`` (or its old
name ``delta``) selects it, and the usual ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` calls run the same update transaction as ``POST /update_weights_delta``: the chain (or anchor)
from the held version to each URL, applied in place on every worker, verified by
fingerprints across ranks, rolled back everywhere on any failure. Prints one JSON line:
outputs before and after, each URL's outcome, the version each worker holds and the
fingerprint re-read from the live weights.
"""
from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--urls", required=True, help="comma-separated manifest URIs to apply in order")
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    urls = args.urls.split(",")
    os.environ.setdefault("ENGINE_EXT_SOURCES", os.path.dirname(urls[0]))
    if args.tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(args.tp)))

    from vllm import LLM, SamplingParams

    from engine_ext.format import fingerprint as fpr
    from engine_ext.server.protocol import RankReply
    from engine_ext.server.transaction import combine_fingerprints

    llm = LLM(args.model, dtype="bfloat16", max_model_len=256, enforce_eager=True, tensor_parallel_size=args.tp,
              weight_transfer_config={"backend": "engine_ext"})
    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3, 250]}, {"prompt_token_ids": [100, 200, 300]}]

    def run():
        return [[list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]]
                for o in llm.generate(prompts, sp, use_tqdm=False)]

    def workers(op):
        return [RankReply.from_wire(w) for w in llm.collective_rpc("engine_ext", args=(op,))]

    def live_fingerprint():  # re-read from every worker's live weights, not the bookkept value
        return fpr.fmt(fpr.model_fingerprint(combine_fingerprints(workers("resync"))))

    before = run()
    llm.init_weight_transfer_engine({"init_info": {}})
    results = []
    for url in urls:
        try:
            llm.start_weight_update()
            llm.update_weights({"update_info": {"url": url}})
            version = workers("status")[0].version
            llm.finish_weight_update(weight_version=str(version))
            llm.reset_prefix_cache()
            results.append({"url": url, "ok": True, "version": version, "fingerprint": live_fingerprint()})
        except Exception as e:  # noqa: BLE001 - reported per URL
            results.append({"url": url, "ok": False, "error": str(e)[-400:], "fingerprint": live_fingerprint()})
    print(json.dumps({"before": before, "after": run(), "results": results, "fingerprint": live_fingerprint(),
                      "versions": [r.version for r in workers("status")], "weight_version": llm.get_weight_version()}))


if __name__ == "__main__":
    main()
