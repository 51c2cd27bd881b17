"""vLLM 0.32's CUDA post-processing, run on CPU tensors in this process (tests/test_gpu_paths.py, docs/GPU.md).

vLLM's Python for the CUDA paths ships in the CPU wheel. What cannot run here is the platform (vLLM asks
``current_platform`` which device it serves on) and the libraries the CUDA paths call (DeepGEMM, FlashInfer,
OpenAI's triton_kernels, vLLM's ``_C`` CUDA ops). :func:`cuda_platform` makes vLLM's platform object answer
CUDA with a given compute capability, for the duration of one post-processing call and nothing else (vLLM's
modules are imported before, under the CPU platform: some decide things at import). The stand-ins below
replace exactly one library function each, and each test that uses one says so.

:func:`outcome` is what a vLLM worker does at start-up on a GPU (engine_ext/engines/vllm/worker.py::build_updater:
no refresh hook off the CPU): the post-processing census, the layout probe through a loader, the load check, and
the checkpoint tensors that updates would be refused for.

``python tests/gpu_emulation.py`` measures the census's cost at load (docs/GPU.md).
"""
from __future__ import annotations

import ast
import contextlib
import functools
import os
import textwrap
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from engine_ext.engines.vllm.census import claimed
from engine_ext.format.dtypes import BY_TORCH
from engine_ext.server import census
from engine_ext.server.rank import RankUpdater


# ---------------------------------------------------------------------------- the platform


def _cached_platform_answers() -> list:
    """vLLM functions that cache an answer about the platform (functools.cache): cleared on entry and exit,
    so that no answer given under the emulation outlives it and none from before leaks in."""
    import vllm.utils.deep_gemm as dg
    from vllm.model_executor.layers.quantization.utils import w8a8_utils

    out = [dg.is_deep_gemm_supported, dg.is_deep_gemm_e8m0_used]
    out += [f for f in vars(w8a8_utils).values() if isinstance(f, functools._lru_cache_wrapper)]
    return out


@contextlib.contextmanager
def cuda_platform(capability: tuple[int, int] = (9, 0)) -> Iterator[None]:
    """vLLM's ``current_platform`` answers CUDA with ``capability`` (9.0: H100/H200; 10.0: B200): ``is_cuda()``,
    ``is_cpu()``, ``get_device_capability()`` and what derives from it (``has_device_capability``,
    ``is_device_capability``, ``is_device_capability_family``), and ``support_deep_gemm()`` (CudaPlatform's rule:
    9.0, 10.x, 12.x). Tensors stay on the CPU; FP8 is OCP e4m3 as on CUDA (``is_fp8_fnuz()`` is False here too)."""
    from vllm.platforms import PlatformEnum, current_platform
    from vllm.platforms.interface import DeviceCapability

    cls = type(current_platform)
    saved = {name: cls.__dict__.get(name) for name in ("get_device_capability", "support_deep_gemm")}
    enum = current_platform._enum
    caches = _cached_platform_answers()
    for f in caches:
        f.cache_clear()
    cls.get_device_capability = classmethod(lambda c, device_id=0: DeviceCapability(*capability))
    cls.support_deep_gemm = classmethod(lambda c: tuple(capability) == (9, 0) or capability[0] in (10, 12))
    current_platform._enum = PlatformEnum.CUDA
    try:
        assert current_platform.is_cuda() and not current_platform.is_cpu() and not current_platform.is_fp8_fnuz()
        yield
    finally:
        current_platform._enum = enum
        for name, value in saved.items():
            if value is None:
                delattr(cls, name)
            else:
                setattr(cls, name, value)
        for f in caches:
            f.cache_clear()


# ---------------------------------------------------------------------------- stand-ins for CUDA libraries


@contextlib.contextmanager
def deep_gemm_sm90(e8m0: bool = True) -> Iterator[None]:
    """DeepGEMM as vLLM finds it on an H100/H200 (the vendored copy in vLLM's CUDA wheel), in two functions:

    * ``transform_sf_into_required_layout``: DeepGEMM's own SM90 branch for fp32 weight scales with a
      (1, 128, 128) recipe is ``check_sf_layout`` and returns the tensor it was given
      (deepseek-ai/DeepGEMM csrc/apis/layout.hpp); the stand-in returns it too. (On SM100 it packs UE8M0 into
      int32 with a CUDA kernel: not emulated, gpu_acceptance/gpu_proof.py section (e).)
    * ``get_mk_alignment_for_contiguous_layout``: 128, DeepGEMM's M/K alignment (read when the MoE experts are built).

    ``e8m0``: vLLM's default ``VLLM_USE_DEEP_GEMM_E8M0=1`` with DeepGEMM present (``is_deep_gemm_e8m0_used()``
    True): block-fp8 weights are requantised to power-of-two scales. ``per_block_cast_to_fp8`` (vLLM's, wrapped in
    ``torch.compile``) runs its own Python eagerly: Dynamo runs eagerly under the census's dispatch mode anyway,
    and compiling would need a C++ toolchain here."""
    import vllm.utils.deep_gemm as dg
    from vllm.model_executor.layers.quantization.utils import fp8_utils

    saved = (dg._transform_sf_into_required_layout_impl, dg._get_mk_alignment_for_contiguous_layout_impl,
             dg.per_block_cast_to_fp8, fp8_utils.is_deep_gemm_e8m0_used)
    dg._transform_sf_into_required_layout_impl = lambda sf, mn, k, recipe, num_groups=None, is_sfa=None, **kw: sf
    dg._get_mk_alignment_for_contiguous_layout_impl = lambda: 128
    compiled = dg.per_block_cast_to_fp8
    dg.per_block_cast_to_fp8 = getattr(compiled, "_torchdynamo_orig_callable", None) or compiled.__wrapped__
    fp8_utils.is_deep_gemm_e8m0_used = lambda: e8m0
    try:
        yield
    finally:
        (dg._transform_sf_into_required_layout_impl, dg._get_mk_alignment_for_contiguous_layout_impl,
         dg.per_block_cast_to_fp8, fp8_utils.is_deep_gemm_e8m0_used) = saved


@contextlib.contextmanager
def flashinfer_permute_indices() -> Iterator[None]:
    """FlashInfer's row-permutation helpers that vLLM's TRT-LLM MoE conversions import
    (``flashinfer.fused_moe.core._maybe_get_cached_w3_w1_permute_indices`` and ``get_w2_permute_indices_with_cache``
    for bf16, ``flashinfer.utils.get_shuffle_matrix_a_row_indices`` for block fp8), as modules of their own in
    ``sys.modules`` while the call runs: each answers a fixed permutation of the rows (the real ones answer
    FlashInfer's epilogue-tile permutation, also of rows; which permutation does not change what the census and
    the load check see)."""
    import sys
    import types

    def rows(cache, t, epilogue_tile_m, **kwargs):
        return torch.arange(t.shape[0]).flip(0)

    core = types.ModuleType("flashinfer.fused_moe.core")
    core._maybe_get_cached_w3_w1_permute_indices = rows
    core.get_w2_permute_indices_with_cache = rows
    utils = types.ModuleType("flashinfer.utils")
    utils.get_shuffle_matrix_a_row_indices = lambda t, epilogue_tile_m, **kw: torch.arange(t.shape[0]).flip(0)
    stubs = {"flashinfer": types.ModuleType("flashinfer"), "flashinfer.fused_moe": types.ModuleType("flashinfer.fused_moe"),
             "flashinfer.fused_moe.core": core, "flashinfer.utils": utils}
    present = {name: sys.modules.get(name) for name in stubs}
    assert all(m is None for m in present.values()), "a real flashinfer is importable here: use it"
    sys.modules.update(stubs)
    try:
        yield
    finally:
        for name in stubs:
            sys.modules.pop(name, None)


def vllm_method_source(relpath: str, cls: str, method: str, namespace: dict) -> Callable:
    """``cls.method`` as written in vLLM's installed ``relpath``, compiled on its own (its module imports a library
    that is not installed here, e.g. FlashInfer's attention backend): the same source text, run with ``namespace``
    as its globals."""
    import vllm

    path = os.path.join(os.path.dirname(vllm.__file__), relpath)
    tree = ast.parse(open(path).read())
    node = next(f for c in tree.body if isinstance(c, ast.ClassDef) and c.name == cls
                for f in c.body if isinstance(f, ast.FunctionDef) and f.name == method)
    src = textwrap.dedent(ast.get_source_segment(open(path).read(), node))
    scope = dict(namespace)
    exec(compile(src, f"{path}:{cls}.{method}", "exec"), scope)  # noqa: S102 - vLLM's own source, from its wheel
    return scope[method]


# ---------------------------------------------------------------------------- what a GPU worker does at start-up


@dataclass
class Outcome:
    """What start-up decides for a post-processed module: ``derived`` (census: {module: [paths]} computed from the
    weights), ``mismatched`` (load check), ``unreproducible`` (census joined with the maps), ``fallback`` (tensors the
    probe could not map: reloaded densely through the loader)."""

    derived: dict
    mismatched: tuple
    unreproducible: dict
    fallback: tuple
    updater: RankUpdater

    @property
    def refused(self) -> set[str]:
        return set(self.mismatched) | set(self.unreproducible)


def process(model: torch.nn.Module, post_process: Callable[[], object], capability=(9, 0)) -> None:
    """vLLM's post-processing under the census (as the plugin wraps it) with the platform answering CUDA."""
    def run():
        with cuda_platform(capability):
            post_process()

    census.take(model, run)


def outcome(model: torch.nn.Module, checkpoint: dict[str, torch.Tensor], load: Callable | None = None) -> Outcome:
    """The start-up of an updater over ``model`` as on a GPU worker (no refresh hook): the layout probe through
    ``load`` (default: copy each checkpoint tensor into the parameter of its name, the write vLLM's weight loaders
    make), the load check against ``checkpoint`` (the tensors as loaded, before post-processing) and the census with
    the vLLM adapter's claims."""
    def copy_into(name, t):
        model.get_parameter(name).data.copy_(t)

    specs = {n: (tuple(t.shape), BY_TORCH[t.dtype]) for n, t in checkpoint.items()}
    up = RankUpdater(model, load or copy_into, specs, read_checkpoint=checkpoint.__getitem__,
                     find_unreproducible=lambda maps: census.unreproducible(model, maps, claimed))
    reply = up.setup()
    derived = {name: sorted(paths) for name, paths in model.__dict__[census.CENSUS_ATTR].derived.items()}
    return Outcome(derived, tuple(reply.mismatched), dict(reply.unreproducible), tuple(reply.fallback), up)


def checkpoint_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters as loaded (clones): the checkpoint the load check compares with."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------- the census's cost at load


def census_cost(layers: int = 64, reps: int = 3) -> dict:
    """The census's cost at load, on the CPU: vLLM's block-fp8 DeepGEMM post-processing (the UE8M0 requantisation,
    pure torch, about 40 aten ops per layer) of ``layers`` x 7 linear layers (fp8 128 x 256, scales 1 x 2), and the
    bf16 linear layers' post-processing of as many layers (nothing to do on CUDA: the census's two walks alone),
    each timed with and without the census around it (interleaved, best of ``reps``); ``ops``: aten ops the
    post-processing ran (counted under a dispatch mode of its own), ``us_per_op``: the census's extra time per op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from vllm.model_executor.kernels.linear.scaled_mm.deep_gemm import DeepGemmFp8BlockScaledMMKernel
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    def fp8_model(seed):
        g = torch.Generator().manual_seed(seed)
        model = torch.nn.Module()
        for i in range(layers * 7):
            layer = torch.nn.Module()
            layer.weight = torch.nn.Parameter((torch.randn(128, 256, generator=g) * 100).clamp(-448, 448)
                                              .to(torch.float8_e4m3fn), requires_grad=False)
            layer.weight_scale_inv = torch.nn.Parameter(torch.rand(1, 2, generator=g) * 1e-3 + 1e-4, requires_grad=False)
            layer.weight_block_size = [128, 128]
            kernel = object.__new__(DeepGemmFp8BlockScaledMMKernel)
            kernel.use_deep_gemm_e8m0, kernel.is_deep_gemm_supported = True, True
            method = object.__new__(Fp8LinearMethod)
            method.use_marlin, method.block_quant, method.act_q_static, method.fp8_linear = False, True, False, kernel
            layer.quant_method = method
            model.add_module(f"l{i}", layer)
        return model

    def bf16_model(seed):
        model = torch.nn.Module()
        for i in range(layers * 7):
            layer = torch.nn.Module()
            layer.weight = torch.nn.Parameter(torch.zeros(128, 256, dtype=torch.bfloat16), requires_grad=False)
            layer.quant_method = UnquantizedLinearMethod()
            model.add_module(f"l{i}", layer)
        return model

    def vllm_loop(model):  # model_loader/utils.py::process_weights_after_loading's loop over the quant methods
        for m in model.modules():
            if getattr(m, "quant_method", None) is not None:
                m.quant_method.process_weights_after_loading(m)

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    out = {"modules": layers * 7, "threads": torch.get_num_threads()}
    with deep_gemm_sm90(), cuda_platform((9, 0)):
        for label, build in (("fp8_deepgemm", fp8_model), ("bf16", bf16_model)):
            plain, traced = [], []
            for r in range(reps):
                model = build(r)
                t = time.perf_counter()
                vllm_loop(model)
                plain.append(time.perf_counter() - t)
                model = build(r)
                t = time.perf_counter()
                census.take(model, functools.partial(vllm_loop, model))
                traced.append(time.perf_counter() - t)
            count = Count()
            model = build(0)
            with count:
                vllm_loop(model)
            extra = min(traced) - min(plain)
            out[label] = {"without_s": round(min(plain), 4), "with_census_s": round(min(traced), 4),
                          "ops": count.n, "us_per_op": round(extra / count.n * 1e6, 1) if count.n else None}
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(census_cost(), indent=1))
