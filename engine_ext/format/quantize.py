"""fp8 block quantisation of a checkpoint: the DeepSeek-V3 / Qwen3-FP8 layout the servers load.

Why here: a trainer keeps bf16 (or fp32) master weights but its rollout servers load an
fp8 checkpoint. :class:`~engine_ext.trainer.publisher.DeltaPublisher` with
``quantize="fp8-block"`` runs this recipe on every version before diffing, so a delta
carries exactly the fp8 bytes and scales that changed, and the served bytes after K
deltas equal a cold load of the final fp8 checkpoint.

The recipe, per 2-D linear weight ``W`` [N, K] (tiles of ``BLOCK`` x ``BLOCK``; the last
row/column of tiles may be partial)::

    amax[i, j]             = max |W[tile i, j]|           (float32)
    weight_scale_inv[i, j] = max(amax, tiny) / 448        (float32; 448 = max of e4m3fn)
    weight[tile i, j]      = cast_e4m3fn(W[tile] / weight_scale_inv[i, j])   (round to nearest even)

so ``weight.float() * weight_scale_inv`` (broadcast over tiles) dequantises. A tile whose
maximum moves gets a new scale and re-quantises; at RL step sizes the scale moves by
~1e-5 relative, far below fp8's 6-12 % value spacing, so few of the tile's bytes change
(docs/benchmarks.md, "fp8 vs bf16": from fp32 masters nearly every scale changes each
step while 0.1-0.3 % of the fp8 weights do, 10x fewer than the bf16 weights of the same step).
Embeddings, ``lm_head``, norms, biases and MoE router gates stay in the master dtype
(the published FP8 checkpoints leave them unquantised too).
"""

from __future__ import annotations

import re

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
SCALE_SUFFIX = "weight_scale_inv"
# Linear weights that stay in the master dtype: embeddings, the output head, norms, and the
# MoE router and shared-expert gates (small, and vLLM/SGLang load them unquantised).
KEEP = re.compile(
    r"(^|\.)(embed_tokens|lm_head|wte|wpe)\.|norm[^.]*\.weight$|\.mlp\.gate\.weight$|shared_expert_gate\.weight$"
)
QUANTIZATIONS = ("fp8-block",)


def quantizes(name: str, t: torch.Tensor) -> bool:
    """Whether the fp8-block recipe quantises this checkpoint tensor (2-D float ``*.weight`` of a linear layer)."""
    return (
        name.endswith(".weight")
        and t.dim() == 2
        and t.is_floating_point()
        and t.dtype != FP8
        and KEEP.search(name) is None
    )


def scale_name(weight_name: str) -> str:
    """``...proj.weight`` -> ``...proj.weight_scale_inv`` (the name vLLM and SGLang load)."""
    return weight_name[: -len("weight")] + SCALE_SUFFIX


def quantize_fp8_block(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight [N, K], float32 weight_scale_inv [ceil(N/block), ceil(K/block)]) of a 2-D ``w``."""
    if w.dim() != 2:
        raise ValueError(f"fp8 block quantisation needs a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    x = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    x[:n, :k] = w.float()
    tiles = x.view(nb, block, kb, block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale_inv = amax.clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX
    q = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(nb * block, kb * block)[:n, :k].contiguous(), scale_inv.contiguous()


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """float32 weights from an fp8 weight and its block scales (the reference for tests)."""
    n, k = q.shape
    s = scale_inv.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return q.float() * s


def fp8_block_state_dict(
    sd: dict[str, torch.Tensor], block: int = BLOCK, rest_dtype: torch.dtype | None = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """The fp8 checkpoint of ``sd`` (master weights): each quantised weight followed by its
    ``weight_scale_inv``; every other floating tensor cast to ``rest_dtype`` (bf16, as the
    published FP8 checkpoints keep embeddings, norms and biases; None: as held). Names and
    order are stable."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if quantizes(name, t):
            out[name], out[scale_name(name)] = quantize_fp8_block(t.detach(), block)
        else:
            cast = rest_dtype is not None and t.is_floating_point() and t.dtype != FP8
            out[name] = t.detach().to(rest_dtype) if cast else t
    return out


def quantization_config(sd: dict[str, torch.Tensor] | None = None, block: int = BLOCK) -> dict:
    """The ``quantization_config`` of an fp8-block checkpoint's ``config.json`` (as DeepSeek-V3 and
    Qwen3-FP8 ship it), which makes vLLM and SGLang pick their block-fp8 linear methods.

    ``ignored_layers`` lists the linear layers of ``sd`` (the master state dict) left unquantised
    (router gates...): without it vLLM builds them as fp8 layers and loads the bf16 gate into an
    fp8 weight with an uninitialised scale (garbage routing, no error)."""
    ignored = sorted(
        n[: -len(".weight")]
        for n, t in (sd or {}).items()
        if n.endswith(".weight")
        and t.dim() == 2
        and not quantizes(n, t)
        and not re.search(r"(^|\.)(embed_tokens|lm_head|wte|wpe)\.", n)
    )
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
        **({"ignored_layers": ignored} if ignored else {}),
    }


def quantizer(name: str | None):
    """The state-dict transform a publisher applies before diffing (None: publish as given)."""
    if name is None:
        return None
    if name == "fp8-block":
        return fp8_block_state_dict
    raise ValueError(f"unknown quantize={name!r}; one of {QUANTIZATIONS}")
