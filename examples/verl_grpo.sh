#!/usr/bin/env bash
# verl GRPO whose rollout replicas take every policy version as a signed delta from a store
# (docs/VERL.md). The three checkpoint_engine lines are the whole trainer-side change; the
# replicas' servers read the trust roots from their environment.
#
#   bash examples/verl_grpo.sh                 # Qwen2.5-0.5B-Instruct on GSM8K, verl's quick-start sizes
#
# It runs verl (FSDP2 actor, standalone vLLM rollout, Ray), so it needs GPUs: 2 for the actor and
# 2 for the rollout as written. What the CPU tests run of it is in tests/test_verl.py.
set -euo pipefail
STORE=${STORE:-s3://my-bucket/grpo-run1}          # or a shared path, or http(s)://
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
DATA=${DATA:-$HOME/data/gsm8k}                     # verl repository: python examples/data_preprocess/gsm8k.py

[ -f publisher.key ] || engine-ext keygen publisher.key   # private key (actors), publisher.key.pub (replicas)
export ENGINE_EXT_SIGNING_KEY=$PWD/publisher.key
export ENGINE_EXT_TRUSTED_KEYS=$PWD/publisher.key.pub
export ENGINE_EXT_SOURCES=$STORE
export ENGINE_EXT_TOKEN=${ENGINE_EXT_TOKEN:-$(python -c "import secrets; print(secrets.token_hex(16))")}
export VLLM_PLUGINS=engine_ext   # vLLM mounts endpoint plugins (the update route) only when named here
# A Ray cluster started here passes this environment on to the actors and the rollout servers; on a
# cluster started elsewhere, give these variables to its nodes (or the job's runtime_env).

python -m verl.experimental.fully_async_policy.fully_async_main \
  algorithm.adv_estimator=grpo \
  data.train_files=$DATA/train.parquet data.val_files=$DATA/test.parquet \
  data.max_prompt_length=512 data.max_response_length=256 \
  actor_rollout_ref.model.path=$MODEL \
  actor_rollout_ref.actor.strategy=fsdp2 actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=32 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
  actor_rollout_ref.hybrid_engine=False \
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.mode=async \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  rollout.nnodes=1 rollout.n_gpus_per_node=2 rollout.n=4 rollout.total_rollout_steps=1000 \
  actor_rollout_ref.rollout.checkpoint_engine.backend=engine_ext \
  actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=engine_ext.integrations.verl \
  +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.engine_ext.store=$STORE \
  +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.engine_ext.anchor_every=50 \
  trainer.nnodes=1 trainer.n_gpus_per_node=2 trainer.total_epochs=1 trainer.logger='["console"]' "$@"
