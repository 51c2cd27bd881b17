"""Offline half of tests/test_vllm_transfer.py, run in a subprocess (vLLM spawns its workers).

A trainer in this process drives ``vllm.LLM(..., weight_transfer_config={"backend": "delta"})``
(the backend's old name, an alias of ``engine_ext``, which the online tests name) through vLLM's
trainer API (``WeightTransferTrainerFactory.trainer_init`` with the ``LLM`` as the client). The
LLM starts cold on the trainer's final weights (its trajectory is seeded: computed first and saved
to ``--out``), whose outputs are the cold-start reference; the trainer then sends v0 (an anchor
that takes the LLM back to the start) and three deltas; then broken copies of v4 (unsigned,
outside the sources, a corrupted blob) and a widening ``init_weight_transfer_engine``, each
refused. Prints one JSON line: the send figures, the cold outputs, outputs at v0 and v3, each
worker's version and label, the fingerprint re-read from every worker's live weights, the
refusals' statuses and reasons. One LLM: no second start for the reference.

    ENGINE_EXT_SOURCES=STORES python tests/vllm_transfer_offline.py --model DIR --store STORES/run --tp 2 \\
        --outside DIR2 --out FINAL_DIR
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STEPS = 3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--outside", required=True, help="a directory outside ENGINE_EXT_SOURCES")
    ap.add_argument("--out", required=True, help="where the trainer's final weights are saved (the LLM starts on them)")
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    from vllm_helpers import Trainer, broken_copy, fingerprint, save_state_dict

    ahead = Trainer(args.model)  # the trajectory the trainer below takes (same seed), run ahead to its end
    for _ in range(STEPS):
        ahead.step()
    final = ahead.served()
    save_state_dict(args.out, final, args.model)
    del ahead
    llm = LLM(args.out, dtype="bfloat16", max_model_len=256, enforce_eager=True, tensor_parallel_size=args.tp,
              weight_transfer_config={"backend": "delta"})
    sp = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3, 250]}, {"prompt_token_ids": [100, 200, 300]}]

    def run():
        return [[list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]]
                for o in llm.generate(prompts, sp, use_tqdm=False)]

    cold = run()  # the reference: a cold start on the final weights

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from engine_ext.format import fingerprint as fpr
    from engine_ext.integrations.vllm_transfer import DeltaTrainerInitInfo, LLMClient, refusal
    from engine_ext.server.protocol import RankReply
    from engine_ext.server.transaction import combine_fingerprints

    def workers(op):
        return [RankReply.from_wire(w) for w in llm.collective_rpc("engine_ext", args=(op,))]

    def live_fingerprint():  # re-read from every worker's live weights, not the bookkept value
        return fpr.fmt(fpr.model_fingerprint(combine_fingerprints(workers("resync"))))

    trainer = Trainer(args.model)
    engine = WeightTransferTrainerFactory.trainer_init(
        DeltaTrainerInitInfo(args.store, rank=0, publisher={"chunk_min_cell": 256}), client=llm,
        source=ModuleSource(trainer.model))
    sends = [engine.send_weights()]  # v0: an anchor, fetched by every worker (the LLM holds the final weights)
    before = run()
    for _ in range(STEPS):
        trainer.step()
        sends.append(engine.send_weights())
    outputs, status = run(), workers("status")
    assert fingerprint(trainer.served()) == fingerprint(final), "the trainer ran ahead on another trajectory"
    fp_v3 = live_fingerprint()

    trainer.step()
    engine.publish_version()  # v4, offered broken
    client, refusals = LLMClient(llm), []
    stores = os.path.dirname(args.store)
    for how in ("unsigned", "outside", "corrupt"):
        url = broken_copy(args.store, os.path.join(args.outside if how == "outside" else stores, how), 4, how)
        client.start_weight_update()
        try:
            client.update_weights({"url": url})
            refusals.append(None)
        except Exception as e:  # noqa: BLE001 - the refusal is the result
            r = refusal(e)
            refusals.append([r.http_status, r.reason])
    try:
        client.init_weight_transfer_engine({"sources": [args.outside]})
        refusals.append(None)
    except Exception as e:  # noqa: BLE001
        r = refusal(e)
        refusals.append([r.http_status, r.reason])
    print(json.dumps({
        "sends": [dataclasses.asdict(s) for s in sends], "cold": cold, "before": before, "outputs": outputs,
        "versions": [r.version for r in status], "labels": [r.label for r in status],
        "weight_version": llm.get_weight_version(), "live_fingerprint": fp_v3,
        "trainer_fingerprint": fingerprint(final), "refusals": refusals, "after_refusals": live_fingerprint()}))
    engine.shutdown()


if __name__ == "__main__":
    main()
