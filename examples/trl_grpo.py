"""TRL's GRPO on the CPU, its weights synced to a live vLLM server as signed deltas (docs/TRL.md).

    python examples/trl_grpo.py                  # tiny Qwen2, 8 GRPO steps, ./trl_out

What runs: a tiny random Qwen2 (bf16 checkpoint, fp32 master weights in the trainer), a
local store, a signing key, and a vLLM CPU server with the engine_ext plugin and TRL's
server-mode flags. ``DeltaGRPOTrainer`` (TRL's ``GRPOTrainer`` plus ``delta_store=``) trains
with rollouts from the server; every sync publishes one version and pushes it (no NCCL,
no shared world: the server could sit in another cluster and read the store over S3).
At the end it prints, per sync, what crossed the network against the dense model TRL's
NCCL path broadcasts, and checks that the server holds the trainer's weights in bf16.
"""
from __future__ import annotations

import argparse
import secrets
import shutil
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="trl_out")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    args = ap.parse_args()

    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig

    from engine_ext.engines.vllm.launcher import VllmServer
    from engine_ext.format import fingerprint as fpr
    from engine_ext.integrations.trl import delta_grpo_trainer_class
    from engine_ext.store.signing import generate_key
    from engine_ext.tiny_models import make_model

    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model = make_model(out / "model", "qwen2", hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2)
    generate_key(out / "publisher.key")
    token = secrets.token_hex(16)
    print("starting a vLLM CPU server with the plugin and TRL's server flags (about a minute)...", flush=True)
    server = VllmServer(model, sources=str(out / "store"), token=token, trusted_keys=str(out / "publisher.key.pub"),
                        env={"VLLM_SERVER_DEV_MODE": "1"}, log=out / "server.log",
                        args=["--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"])
    try:
        tok = PreTrainedTokenizerFast.from_pretrained(model)
        config = GRPOConfig(output_dir=str(out / "trainer"), use_cpu=True, use_vllm=True, vllm_mode="server",
                            vllm_server_base_url=server.url, per_device_train_batch_size=8, num_generations=8,
                            max_completion_length=16, max_steps=args.steps, learning_rate=args.lr, logging_steps=1,
                            report_to="none", save_strategy="no", model_init_kwargs={"dtype": torch.float32})

        def reward(completion_ids, **_):  # a toy task: use the lower half of the vocabulary
            return [sum(t < 512 for t in ids) / max(len(ids), 1) for ids in completion_ids]

        trainer = delta_grpo_trainer_class()(
            model=str(model), reward_funcs=reward, args=config, processing_class=tok,
            train_dataset=Dataset.from_dict({"prompt": [f"t{i} t{i + 1} t{i + 2}" for i in range(100, 164)]}),
            delta_store=str(out / "store"), delta_token=token, signing_key=str(out / "publisher.key"),
            delta_options={"anchor_every": 0})
        trainer.train()
        served = server.status()["fingerprint"]
        trained = fpr.fmt(fpr.model_fingerprint({n: fpr.tensor_fingerprint(p.detach().to(torch.bfloat16))
                                                 for n, p in trainer.model.named_parameters()}))
        syncs = trainer.weight_transfer.syncs
        trainer.weight_transfer.destroy()
    finally:
        server.stop()
    print(f"\n{'version':>7} {'changed':>8} {'delta KB':>9} {'dense KB':>9} {'smaller':>8} {'publish s':>9} {'push s':>7}")
    for s in syncs:
        smaller = f"{s.dense_bytes / s.delta_bytes:>7.0f}x" if s.delta_bytes else f"{'-':>8}"
        print(f"{s.version:>7} {100 * s.changed:>7.2f}% {s.delta_bytes / 1e3:>9.1f} {s.dense_bytes / 1e3:>9.1f} "
              f"{smaller} {s.publish_s:>9.3f} {s.push_s:>7.3f}")
    print("(v0: the server already held those weights and adopted the version: nothing fetched)")
    print(f"\nserved fingerprint {served}, trainer's weights in bf16 {trained}: {'identical' if served == trained else 'DIFFERENT'}")
    if served != trained:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
