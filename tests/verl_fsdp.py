"""verl 0.9.1's real FSDP2 training engine (``FSDPEngineWithLMHead``) on a CPU, over gloo.

verl builds its engines for CUDA or NPU only. Four stand-ins make the real engine run on a CPU;
nothing in verl's files is edited, and everything else is verl's own code (the engine, FSDP2,
its ``get_per_tensor_param()`` with one ``full_tensor()`` per name, ``train_batch`` with its
``sft_loss`` and AdamW step):

1. a CPU ``PlatformBase`` set with ``verl.plugin.platform.set_platform`` before
   ``verl.workers.engine`` is imported (it caches the device name): device ``cpu``, backend
   ``gloo``, ``current_device()`` ``"cpu"`` (verl calls ``tensor.to(get_device_id())``);
2. ``torch.cpu.empty_cache`` as a no-op (verl calls ``get_torch_device().empty_cache()``);
3. ``verl.models.transformers.monkey_patch.is_trl_available`` answering False: with TRL 1.16
   installed, verl imports ``AutoModelForCausalLMWithValueHead``, which TRL 1.16 no longer has;
4. ``VERL_ENGINE_DEVICE=cuda``: verl's own override, since the FSDP engines are registered for
   ``cuda``/``npu`` only.

Configuration only: ``attn_implementation=sdpa``, no remove-padding (flash-attn), no
``torch.compile``, fp32 parameters (the masters). FSDP1 cannot run on a CPU (verl sets
``sync_module_states=True``, which torch refuses for CPU parameters); FSDP2 is verl's default.
"""
from __future__ import annotations

import os
from contextlib import nullcontext

import torch


def install_cpu_platform() -> None:
    """Stand-ins 1 and 2 (idempotent); must run before ``verl.workers.engine`` is imported."""
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry, set_platform

    class PlatformCPU(PlatformBase):
        device_name, vendor_name, device_module = "cpu", "cpu", torch.cpu

        def is_available(self): return True
        def current_device(self): return "cpu"
        def device_count(self): return 1
        def set_device(self, device_index): pass
        def synchronize(self, device_index=None): pass
        def manual_seed(self, seed): torch.manual_seed(seed)
        def manual_seed_all(self, seed): torch.manual_seed(seed)
        def set_allocator_settings(self, settings): pass
        def empty_cache(self): pass
        def get_device_capability(self, device_index=0): return None, None
        def communication_backend_name(self): return "gloo"
        def visible_devices_envvar(self): return "CUDA_VISIBLE_DEVICES"
        def nvtx_range(self, msg): return nullcontext()
        def profiler_start(self): pass
        def profiler_stop(self): pass
        def ray_resource_name(self): return "CPU"
        def ray_noset_envvars(self): return []
        def is_ipc_supported(self): return False
        def cudart(self): return None

    PlatformRegistry.register(platform="cpu")(PlatformCPU)
    set_platform(PlatformCPU())
    if not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = lambda: None


def init_gloo(rank: int = 0, world_size: int = 1, port: int | None = None) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if port is None:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def build_engine(model_dir: str, lr: float):
    """verl's ``FSDPEngineWithLMHead`` (FSDP2, fp32 masters, AdamW at ``lr``), as ``TrainingWorker`` builds it."""
    install_cpu_platform()
    import verl.models.transformers.monkey_patch as vmp

    vmp.is_trl_available = lambda: False  # stand-in 3
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    os.environ["VERL_ENGINE_DEVICE"] = "cuda"  # stand-in 4
    engine = EngineRegistry.new(
        model_type="language_model", backend="fsdp2",
        model_config=HFModelConfig(path=model_dir, override_config={"attn_implementation": "sdpa"},
                                   use_remove_padding=False, enable_gradient_checkpointing=False),
        engine_config=FSDPEngineConfig(strategy="fsdp2", forward_only=False, param_offload=False, optimizer_offload=False,
                                       use_torch_compile=False, use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
                                       use_remove_padding=False,
                                       mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}),
        optimizer_config=FSDPOptimizerConfig(lr=lr, total_training_steps=1000, weight_decay=0.0, clip_grad=1.0,
                                             lr_warmup_steps=0),
        checkpoint_config=CheckpointConfig())
    engine.initialize()
    return engine


def train_step(engine, vocab: int, seed: int, lengths=(12, 16, 9, 14)) -> float:
    """One optimizer step through the engine: ``train_batch`` with verl's ``sft_loss`` on random tokens."""
    from functools import partial

    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import sft_loss

    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, vocab, (n,), generator=g) for n in lengths]
    data = tu.get_tensordict(
        {"input_ids": tu.nested_tensor_from_tensor_list(ids),
         "position_ids": tu.nested_tensor_from_tensor_list([torch.arange(n) for n in lengths]),
         "loss_mask": tu.nested_tensor_from_tensor_list([torch.ones(n, dtype=torch.long) for n in lengths])},
        non_tensor_dict={"temperature": 1.0, "use_remove_padding": False, "use_dynamic_bsz": False,
                         "micro_batch_size_per_gpu": 2, "use_fused_kernels": False})
    with engine.train_mode():
        out = engine.train_batch(data, loss_function=partial(sft_loss, None))
    engine.lr_scheduler_step()
    loss = out.get("loss")
    return float(loss[0] if isinstance(loss, (list, tuple)) else loss)


def served(engine) -> dict[str, torch.Tensor]:
    """The trainer's weights as the replicas must serve them: each parameter once (ties included), bf16.
    Collective (``full_tensor()``): every rank calls it."""
    out = {}
    for name, p in engine.module.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().to(torch.bfloat16)
    return out
