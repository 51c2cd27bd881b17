"""The actor side of a verl job on a CPU, for tests/test_verl.py and bench/verl_bench.py.

:class:`VerlActor` is one actor rank the way verl builds it (``ActorRolloutRefWorker.init_model``'s
step 4): ``import_external_libs(custom_backend_module)`` and ``CheckpointEngineRegistry.new(backend,
is_master=..., bucket_size=..., **engine_kwargs)``; its sync is verl's own
``ActorRolloutRefWorker.update_weights`` (called through ``__wrapped__``, as verl's CPU tests do),
which hands the checkpoint engine ``self.actor.engine.get_per_tensor_param()``.

The one fake: :class:`GatheredParams` stands in for verl's FSDP engine (``FSDPEngine`` needs a GPU
to build): its ``get_per_tensor_param()`` yields ``state_dict()`` in order, each tensor a fresh
full copy, which is what ``DTensor.full_tensor()`` gives on one rank (a tied embedding comes
twice, as two tensors that share nothing). The model is a real transformers model trained by
real AdamW steps in fp32.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

BACKEND_MODULE = "engine_ext.integrations.verl"
CONFIG_LINES = [  # docs/VERL.md: what a verl user adds
    "actor_rollout_ref.rollout.checkpoint_engine.backend=engine_ext",
    "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=engine_ext.integrations.verl",
    "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.engine_ext.store=s3://bucket/run1",
    "+actor_rollout_ref.rollout.checkpoint_manager_class=engine_ext.integrations.verl.EngineExtCheckpointManager",
]


def verl_config(store: str | None = None, **engine_kwargs):
    """verl's ``ppo_trainer`` config with the config lines (the store replaced), composed as verl's CLI does."""
    from hydra import compose, initialize_config_module

    lines = [ln.replace("s3://bucket/run1", store) if store else ln for ln in CONFIG_LINES]
    lines += [f"+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.engine_ext.{k}={v}" for k, v in engine_kwargs.items()]
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=lines)


def manager_for(cfg, actor, replicas):
    """The manager as ``RayPPOTrainer`` builds it (``trainer/ppo/ray_trainer.py``)."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import load_class_from_fqn

    cls = load_class_from_fqn(cfg.actor_rollout_ref.rollout.get("checkpoint_manager_class"), "CheckpointEngineManager")
    return cls(config=omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine),
               actor_wg=ActorGroup(actor), replicas=replicas)


class GatheredParams:
    """verl's ``BaseEngine.get_per_tensor_param()`` on one rank (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def get_per_tensor_param(self, **kwargs):
        gen = ((name, t.detach().clone()) for name, t in self.model.state_dict().items())
        return gen, None


class VerlActor:
    """One verl actor rank (rank 0, the sender) holding a tiny model's fp32 masters and an AdamW."""

    def __init__(self, model_dir: str, engine_kwargs: dict, *, lr: float = 1e-4, seed: int = 0,
                 bucket_megabytes: int = 64):
        import transformers
        from omegaconf import OmegaConf
        from verl.checkpoint_engine import CheckpointEngineRegistry
        from verl.utils.import_utils import import_external_libs

        torch.manual_seed(seed)
        self.config = OmegaConf.create({"rollout": {"checkpoint_engine": {
            "backend": "engine_ext", "custom_backend_module": BACKEND_MODULE,
            "update_weights_bucket_megabytes": bucket_megabytes, "engine_kwargs": {"engine_ext": engine_kwargs}}}})
        ce = self.config.rollout.checkpoint_engine
        import_external_libs(ce.custom_backend_module)  # what verl does before the registry lookup
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            ce.backend, is_master=True, bucket_size=ce.update_weights_bucket_megabytes << 20,
            **OmegaConf.to_container(ce.engine_kwargs.get(ce.backend), resolve=True))
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.vocab = self.model.config.vocab_size
        self.actor = SimpleNamespace(engine=GatheredParams(self.model))

    def train_step(self, batch: int = 4, length: int = 16) -> float:
        """One real AdamW step of next-token loss on random tokens."""
        ids = torch.randint(0, self.vocab, (batch, length))
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss)

    def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict:
        """verl's own ``ActorRolloutRefWorker.update_weights`` on this stand-in worker."""
        from verl.workers.engine_workers import ActorRolloutRefWorker

        return asyncio.run(ActorRolloutRefWorker.update_weights.__wrapped__(self, global_steps=global_steps, mode=mode))

    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        """verl's own ``ActorRolloutRefWorker.execute_checkpoint_engine`` on this stand-in worker."""
        from verl.workers.engine_workers import ActorRolloutRefWorker

        return ActorRolloutRefWorker.execute_checkpoint_engine.__wrapped__(self, method, *args, **kwargs)

    def served(self) -> dict[str, torch.Tensor]:
        """The weights the replicas must serve: the masters in bf16, each tied tensor once."""
        return {n: p.detach().to(torch.bfloat16) for n, p in self.model.named_parameters()}


class ActorGroup:
    """verl's actor ``RayWorkerGroup`` as the manager uses it: ``update_weights(...)`` returns one
    ``ObjectRef`` per rank (here one rank, a Ray actor)."""

    def __init__(self, *actors):
        self.actors = actors

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def update_weights(self, **kwargs):
        return [a.update_weights.remote(**kwargs) for a in self.actors]

    def execute_checkpoint_engine(self, methods: list, *args: list):
        """``Dispatch.DP_COMPUTE``: rank i gets the i-th element of each list."""
        return [a.execute_checkpoint_engine.remote(m, *(x[i] for x in args)) for i, (a, m) in enumerate(zip(self.actors, methods))]


class Replica:
    """verl's ``RolloutReplica`` as the manager uses it: its rank, its server's ``host:port``, and
    the abort/resume calls (recorded). A fake: verl's ``vLLMReplica`` places its servers on GPUs; the
    server behind it is a real vLLM CPU server."""

    def __init__(self, replica_rank: int, url: str):
        self.replica_rank, self.server_address = replica_rank, url.removeprefix("http://")
        self.calls: list[str] = []

    async def abort_all_requests(self, reject_request: bool = False):
        self.calls.append("abort")
        return {}

    async def resume_generation(self):
        self.calls.append("resume")
