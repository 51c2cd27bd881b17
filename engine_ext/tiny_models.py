"""Tiny random checkpoints that real engines load: Qwen2, Llama, tied embeddings, MoE.

The demo, the benchmarks and the tests make their models here (no download):
``make_model(dir, "qwen2")`` writes ``config.json`` + ``model.safetensors`` (bf16) via
``save_pretrained`` and a ``tokenizers`` WordLevel tokenizer over ``vocab`` tokens, so
vLLM/SGLang can serve it. Prompts should be given as token ids (the vocabulary is
synthetic). Needs ``transformers`` and ``tokenizers`` (the ``demo`` extra).

    python -m engine_ext.tiny_models DIR [KIND]   # KIND: one of KINDS

MoE kinds (8 experts, top 2): ``qwen3-moe`` names each expert
(``mlp.experts.N.gate_proj.weight``, as most Hub checkpoints do), ``qwen3-moe-fused``
stores them fused (``mlp.experts.gate_up_proj`` [E, 2*I, H] and ``mlp.experts.down_proj``
[E, H, I], the transformers 5 in-memory layout), ``qwen2-moe`` adds a shared expert with
its sigmoid gate.

The conformance matrix (tests/test_models.py, docs/MODELS.md) adds real transformers classes
of the architectures RL users train: ``qwen3`` (q/k norms, tied), ``llama-tied`` (Llama 3.2
style), ``mistral``, ``gemma2`` (embedding scale, soft-capping), ``phi3`` (fused qkv and
gate_up in the checkpoint), ``deepseek-v2`` (MLA + MoE with a shared expert) and
``qwen2.5-vl`` (a VLM with a vision tower). :func:`build` gives the float32 model a trainer
holds; :func:`save_trainer_layout` writes a served dir under the names that model holds.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any, TypedDict

import torch
from safetensors.torch import load_file, save_file
from typing_extensions import Unpack  # typing's own from Python 3.11 (torch requires typing_extensions)

from .format.quantize import quantization_config, quantizer
from .trainer.publisher import clean_state_dict

KINDS = (
    "qwen2",
    "llama",
    "qwen2-tied",
    "qwen3-moe",
    "qwen3-moe-fused",
    "qwen2-moe",
    "qwen3",
    "llama-tied",
    "mistral",
    "gemma2",
    "phi3",
    "deepseek-v2",
    "qwen2.5-vl",
    "gpt-oss",
    "qwen3-next",
    "granite-4-hybrid",
)
MOE_KINDS = ("qwen3-moe", "qwen3-moe-fused", "qwen2-moe", "deepseek-v2", "gpt-oss", "qwen3-next", "granite-4-hybrid")
# Kinds built by :func:`tiny_config` from the class's own defaults (any vLLM architecture name is a kind too)
ARCH_KINDS = {
    "gpt-oss": "GptOssForCausalLM",
    "qwen3-next": "Qwen3NextForCausalLM",
    "granite-4-hybrid": "GraniteMoeHybridForCausalLM",
}
VLM_KINDS = ("qwen2.5-vl",)
# The vision special tokens of a tiny VLM are words of its tokenizer (ids 4.. in this order, before any others).
VISION_WORDS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def _config(
    kind: str, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, moe_intermediate: int | None = None
):
    import transformers  # the optional [demo] extra

    common: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 512,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    head_dim = hidden // heads
    moe = moe_intermediate or hidden // 2
    if kind == "llama":
        return transformers.LlamaConfig(tie_word_embeddings=False, **common)
    if kind == "llama-tied":  # Llama 3.2 1B/3B: tied embeddings, llama3 rope scaling
        return transformers.LlamaConfig(
            tie_word_embeddings=True,
            head_dim=head_dim,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
            **common,
        )
    # Qwen's MoE layers in every layer: 8 experts, top 2
    qwen_moe = {
        "tie_word_embeddings": False,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": moe,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    if kind in ("qwen3-moe", "qwen3-moe-fused"):
        return transformers.Qwen3MoeConfig(**qwen_moe, head_dim=head_dim, **common)
    if kind == "qwen2-moe":  # and a shared expert with its sigmoid gate
        return transformers.Qwen2MoeConfig(**qwen_moe, shared_expert_intermediate_size=hidden, **common)
    if kind in ("qwen2", "qwen2-tied"):
        return transformers.Qwen2Config(tie_word_embeddings=(kind == "qwen2-tied"), **common)
    if kind == "qwen3":  # Qwen3 0.6-4B: q/k RMS norms, tied embeddings
        return transformers.Qwen3Config(tie_word_embeddings=True, head_dim=head_dim, **common)
    if kind == "mistral":
        return transformers.MistralConfig(tie_word_embeddings=False, head_dim=head_dim, sliding_window=None, **common)
    if kind == "gemma2":  # embedding scale sqrt(hidden), attention and final logit soft-capping, sliding/full layers
        # hidden_act beside hidden_activation, as google/gemma-2-* configs have it (SGLang reads hidden_act)
        return transformers.Gemma2Config(
            tie_word_embeddings=True,
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=64,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            hidden_activation="gelu_pytorch_tanh",
            hidden_act="gelu_pytorch_tanh",
            **common,
        )
    if kind == "phi3":  # qkv_proj and gate_up_proj fused in the checkpoint itself
        return transformers.Phi3Config(tie_word_embeddings=False, **common)
    if kind == "deepseek-v2":  # MLA (latent 512 + rope 64: vLLM's CPU MLA kernel's only head size) + MoE with a
        # shared expert; yarn rope scaling, one expert group, moe_layer_freq and scoring_func as DeepSeek-V2-Lite's
        # config has them (transformers 5 drops the last two; SGLang reads them; vLLM's CPU router asserts topk_group)
        return transformers.DeepseekV2Config(
            tie_word_embeddings=False,
            **{**common, "num_key_value_heads": heads},
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=moe,
            n_shared_experts=1,
            first_k_dense_replace=1,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=32,
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            moe_layer_freq=1,
            scoring_func="softmax",
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
        )
    if kind == "qwen2.5-vl":  # Qwen2.5-VL 3B-style: tied embeddings, mrope, a (tiny) vision tower
        ids = word_ids(VISION_WORDS)
        text = {k: v for k, v in common.items() if k != "torch_dtype"}
        return transformers.Qwen2_5_VLConfig(
            text_config=dict(
                text,
                tie_word_embeddings=True,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 1000000.0,
                    "mrope_section": [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16],
                },
            ),
            vision_config={
                "depth": 2,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_heads": 2,
                "out_hidden_size": hidden,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "window_size": 112,
                "fullatt_block_indexes": [1],
            },
            tie_word_embeddings=True,
            torch_dtype="bfloat16",
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    raise ValueError(f"unknown tiny model kind {kind!r}; one of {KINDS}")


def model_class(kind: str):
    """The transformers class of ``kind`` (what a trainer holds)."""
    import transformers  # the optional [demo] extra

    if kind in ARCH_KINDS or kind[:1].isupper():
        return arch_class(ARCH_KINDS.get(kind, kind))
    return {
        "llama": transformers.LlamaForCausalLM,
        "llama-tied": transformers.LlamaForCausalLM,
        "qwen3-moe": transformers.Qwen3MoeForCausalLM,
        "qwen3-moe-fused": transformers.Qwen3MoeForCausalLM,
        "qwen2-moe": transformers.Qwen2MoeForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "gemma2": transformers.Gemma2ForCausalLM,
        "phi3": transformers.Phi3ForCausalLM,
        "deepseek-v2": transformers.DeepseekV2ForCausalLM,
        "qwen2.5-vl": transformers.Qwen2_5_VLForConditionalGeneration,
    }.get(kind, transformers.Qwen2ForCausalLM)


def word_ids(words: list[str] | tuple[str, ...]) -> dict[str, int]:
    """The ids :func:`write_tokenizer` gives ``words``: 4, 5, ... in order (prompts are given as ids)."""
    return {w: 4 + i for i, w in enumerate(words)}


def write_tokenizer(path: str | os.PathLike, vocab: int, words: list[str] | tuple[str, ...] = ()) -> None:
    """A WordLevel tokenizer: ``words`` take ids 4, 5, ... (readable samples), every other id ``i``
    is the token ``t{i}`` (ids 0-3 are pad/bos/eos/unk)."""
    from tokenizers import Tokenizer, models, pre_tokenizers  # the optional [demo] extra
    from transformers import PreTrainedTokenizerFast

    if len(set(words)) != len(words) or 4 + len(words) > vocab:
        raise ValueError(
            f"{len(words)} words must be distinct and fit in a vocabulary of {vocab} after the 4 special tokens"
        )
    vocab_ids = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab_ids.update(word_ids(words))
    vocab_ids.update({f"t{i}": i for i in range(4 + len(words), vocab)})
    tok = Tokenizer(models.WordLevel(vocab=vocab_ids, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(str(path))


DEFAULT_VOCAB = 1024


def build(
    kind: str = "qwen2",
    *,
    vocab: int = DEFAULT_VOCAB,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    std: float = 0.02,
    moe_intermediate: int | None = None,
) -> torch.nn.Module:
    """A tiny random ``kind`` model in float32 (a trainer's master weights), initialised as :func:`make_model` does."""
    if kind in ARCH_KINDS or kind[:1].isupper():  # a vLLM architecture name: its class's tiny defaults
        cfg = tiny_config(ARCH_KINDS.get(kind, kind))
    else:
        cfg = _config(kind, vocab, hidden, layers, heads, kv_heads, moe_intermediate)
    torch.manual_seed(seed)
    model = model_class(kind)(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(std * 50 * torch.randn_like(p) if "embed" in name else std * torch.randn_like(p))
    return model


class Shape(TypedDict, total=False):
    """A tiny model's sizes and initialisation: :func:`build`'s keywords, which :func:`make_model` passes on."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    seed: int
    std: float
    moe_intermediate: int | None


def make_model(
    path: str | os.PathLike, kind: str = "qwen2", *, words: list[str] | tuple[str, ...] = (), **shape: Unpack[Shape]
) -> Path:
    """Write a tiny random ``kind`` model (bf16) with tokenizer into ``path``; return it.

    MoE kinds: each expert's intermediate width is ``moe_intermediate`` (default hidden / 2);
    vLLM's CPU MoE pads a width per rank that is not a multiple of 32 (96 at TP 2: 48 -> 64).

    Weights are N(0, std) (norm weights 1 + small noise) so that greedy decoding is
    sensitive to small changes, which makes "outputs identical" a meaningful check.
    The checkpoint is ``save_pretrained``'s (the Hub layout; see :func:`save_trainer_layout`).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = build(kind, **shape).to(torch.bfloat16)
    model.save_pretrained(str(path), safe_serialization=True)
    if kind == "qwen3-moe-fused":
        save_state_dict(path, fuse_experts(load_state_dict(path)), path)
    finish_dir(path, kind, shape.get("vocab", DEFAULT_VOCAB), words)
    return path


def save_trainer_layout(
    path: str | os.PathLike,
    model,
    state: dict | None = None,
    *,
    kind: str = "qwen2",
    tied_copy: bool = False,
    words: list[str] | tuple[str, ...] = (),
) -> Path:
    """A served model dir whose checkpoint holds ``state`` (default: ``model``'s weights) in bf16 under the
    trainer's own names: what ``model.state_dict()`` holds, each storage once (transformers 5 keeps
    fused experts and a VLM's ``model.language_model.`` names in memory; ``save_pretrained``
    writes the Hub's per-expert and ``model.`` names instead). ``tied_copy``: also store the tied
    ``lm_head.weight`` beside the embedding, as some checkpoints do."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = clean_state_dict(model if state is None else state)
    sd = {n: (t.detach().to(torch.bfloat16) if t.is_floating_point() else t).contiguous() for n, t in sd.items()}
    if tied_copy:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    model.config.save_pretrained(str(path))
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    finish_dir(path, kind, model.config.get_text_config().vocab_size, words)
    return path


def finish_dir(path: Path, kind: str, vocab: int, words) -> None:
    """Tokenizer (a VLM's vision tokens first, and its image processor) and both dtype keys of config.json."""
    if kind in VLM_KINDS:
        from transformers import Qwen2VLImageProcessor  # the optional [demo] extra

        words = VISION_WORDS + tuple(words)
        Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2).save_pretrained(str(path))
    write_tokenizer(path, vocab, words)
    # transformers 5 writes "dtype"; older readers look for "torch_dtype": keep both.
    cfg_path = path / "config.json"
    cfg_json = json.loads(cfg_path.read_text())
    cfg_json.setdefault("torch_dtype", "bfloat16")
    cfg_json["dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg_json, indent=2))


def load_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of a model dir (all ``*.safetensors`` files), by name."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def save_state_dict(
    path: str | os.PathLike, state: dict[str, torch.Tensor], like: str | os.PathLike, quantize: str | None = None
) -> Path:
    """A model dir with ``like``'s config/tokenizer and ``state`` as its weights (cold starts).

    ``quantize="fp8-block"``: write the fp8 checkpoint of ``state`` (master weights) instead,
    with its ``quantization_config`` (:mod:`engine_ext.format.quantize`)."""
    path, like = Path(path), Path(like)
    path.mkdir(parents=True, exist_ok=True)
    for f in like.iterdir() if path.resolve() != like.resolve() else ():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, path / f.name)
    if quantize is not None:
        cfg_path = path / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["quantization_config"] = quantization_config(state)
        cfg_path.write_text(json.dumps(cfg, indent=2))
        state = quantizer(quantize)(state)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def fuse_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors ``...mlp.experts.N.{gate,up,down}_proj.weight`` -> the fused
    ``...mlp.experts.gate_up_proj`` [E, 2*I, H] (gate rows first) and ``...mlp.experts.down_proj`` [E, H, I]."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}  # experts prefix -> expert id -> gate/up/down
    for name, t in sd.items():
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if m is None:
            out[name] = t
        else:
            groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
    for prefix, experts in groups.items():
        ids = sorted(experts)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate"], experts[e]["up"]]) for e in ids])
        out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down"] for e in ids])
    return out


def perturb(sd: dict, gen: torch.Generator, density: float = 0.03) -> dict:
    """An RL-like step: a few % of the elements of every tensor move by a small amount."""
    out = {}
    for name, t in sd.items():
        flat = t.float().reshape(-1).clone()
        mask = torch.rand(flat.numel(), generator=gen) < density
        flat[mask] += 1e-2 * torch.randn(int(mask.sum()), generator=gen) * (flat[mask].abs() + 1e-3)
        out[name] = flat.to(t.dtype).reshape(t.shape)
    return out


# --------------------------------------------------------------------------- any architecture, by class name

# Qwen3.5's text layers (the 0.8B dense model's and the 35B-A3B MoE's): 3 Gated DeltaNet layers per full-attention
# layer (gated output, q/k norms, partial rotary 0.25, interleaved mrope); attention heads x head dim = 2 x hidden;
# linear heads 128 wide (vLLM's CPU GDN kernel takes no other), conv 4
_QWEN3_5_LAYERS = {
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [3, 3, 2],  # the Hub's [11, 11, 10] of 64 / 2
        "mrope_interleaved": True,
    },
}
# What a tiny config of any transformers architecture gets, where its config has the attribute. Widths are
# small, multiples of 32 where vLLM's CPU kernels need them (the grouped MoE GEMM; its padded path is
# tests/test_moe.py's, at TP 2).
TINY = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "sliding_window": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "full_attention_interval": 2,  # linear heads keep their width: vLLM's CPU GDN takes 128
    "decoder_sparse_step": 1,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


TINY_MAX_PARAMS = 20_000_000

# What the Hub's config.json of a family carries that the class's defaults shrunk by :data:`TINY` would not:
# the layer pattern users serve and the state-space widths vLLM's kernels take (a head count times a head width
# equal to the inner width). Applied over :data:`TINY` by :func:`tiny_config`.
HUB_SHAPES: dict[str, dict[str, Any]] = {
    # ibm-granite/granite-4.0-h-*: mamba2 and attention layers, MoE with a shared MLP, tied embeddings
    "GraniteMoeHybridForCausalLM": {
        "layer_types": ["mamba", "attention"],
        "mamba_n_heads": 8,
        "mamba_d_head": 32,
        "mamba_d_state": 16,
        "mamba_n_groups": 1,
        "mamba_expand": 2,
        "mamba_d_conv": 4,
        "mamba_chunk_size": 256,
        "shared_intermediate_size": 64,
        "tie_word_embeddings": True,
    },
    # nvidia/Nemotron-H-8B-Base-8K, NVIDIA-Nemotron-Nano-9B-v2: mamba2 ("M"), squared-ReLU MLP ("-") and attention
    # ("*") blocks, no MoE ("E" is Nemotron 3's: vLLM CPU's fused MoE refuses its ungated relu2, is_act_and_mul=False);
    # no rope. Heads x head dim = expand x hidden (128 x 64 = 2 x 4096), 8 groups of 16 heads, state 128, conv 4,
    # attention head dim hidden / heads, untied; mamba_ssm_cache_dtype "float32" (the class default, as the Hub's)
    "NemotronHForCausalLM": {
        "layer_types": ["linear_attention", "mlp", "full_attention", "mlp"],  # layers_block_type "M-*-"
        "mamba_num_heads": 4,
        "mamba_head_dim": 64,
        "n_groups": 2,
        "ssm_state_size": 128,
        "conv_kernel": 4,
        "expand": 2,
        "chunk_size": 128,
        "use_conv_bias": True,
        "use_bias": False,
        "mamba_hidden_act": "silu",
        "mlp_hidden_act": "relu2",
        "head_dim": 32,
        "tie_word_embeddings": False,
    },
    # tiiuae/Falcon-H1-0.5B-Base: every layer runs attention and mamba2 side by side (no layer pattern); the inner
    # width is mamba_d_ssm = 1.5 x hidden (24 heads x 64), one group, state 128, conv 4; muP multipliers (these are
    # the 0.5B's), rope theta 1e11, untied
    "FalconH1ForCausalLM": {
        "mamba_d_ssm": 192,
        "mamba_n_heads": 3,
        "mamba_d_head": 64,
        "mamba_n_groups": 1,
        "mamba_d_state": 128,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 128,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "mamba_rms_norm": False,
        "mamba_norm_before_gate": False,
        "embedding_multiplier": 5.656854249492381,
        "lm_head_multiplier": 0.0390625,
        "key_multiplier": 0.39062499999999994,
        "attention_in_multiplier": 1.0,
        "attention_out_multiplier": 0.9375,
        "ssm_in_multiplier": 1.25,
        "ssm_out_multiplier": 0.23570226039551587,
        "mlp_multipliers": [0.8838834764831844, 0.5859375],
        "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000000000.0},
        "tie_word_embeddings": False,
    },
    # ai21labs/Jamba-v0.1, AI21-Jamba-Mini-1.5: mamba (v1) layers with attention every 8th from offset 4 and MoE every
    # 2nd from offset 1 (16 experts, top 2); state 16, conv 4, expand 2, dt rank hidden / 16; no rope; untied. Here
    # period 4, offset 2 over 4 layers: mamba+MLP, mamba+MoE, attention+MLP, mamba+MoE
    "JambaForCausalLM": {
        "num_hidden_layers": 4,
        "attn_layer_period": 4,
        "attn_layer_offset": 2,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_dt_rank": 8,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "tie_word_embeddings": False,
    },
    # ibm-ai-platform/Bamba-9B: mamba2 layers with attention at attn_layer_indices [9, 18, 27]; 128 heads x 64 =
    # 2 x 4096, one group, state 128, conv 4; half-rotary attention; untied
    "BambaForCausalLM": {
        "num_hidden_layers": 2,
        "attn_layer_indices": [1],
        "mamba_n_heads": 4,
        "mamba_d_head": 64,
        "mamba_n_groups": 1,
        "mamba_d_state": 128,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 256,
        "tie_word_embeddings": False,
    },
    # Zyphra/Zamba2-2.7B/-7B: mamba2 layers and "hybrid" layers that run one of num_mem_blocks (2) shared attention+MLP
    # blocks in turn (A, B, A, ...: one module each, held once in the checkpoint) on the hidden state concatenated
    # with the embeddings (attention width 2 x hidden, head dim 2 x hidden / heads, as many KV heads as heads),
    # per-layer LoRA adapters on the shared MLP, rope in the shared attention (use_mem_rope); mamba head dim 64,
    # 2 groups, state 64, conv 4; tied
    "Zamba2ForCausalLM": {
        "layers_block_type": ["mamba", "hybrid"] * 3,
        "num_mem_blocks": 2,
        "head_dim": 64,  # blocks A, B, A
        "layer_types": ["mamba", "hybrid"] * 3,  # (its alias: both, or hybrid_layer_ids comes out empty)
        "num_key_value_heads": 4,
        "n_mamba_heads": 4,
        "mamba_ngroups": 2,
        "mamba_d_state": 64,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "chunk_size": 256,
        "use_shared_attention_adapter": False,
        "adapter_rank": 16,
        "use_mem_rope": True,
        "tie_word_embeddings": True,
    },
    # LiquidAI/LFM2-1.2B: gated short-conv layers (conv_L_cache 3, no bias) and attention layers (conv, conv,
    # attention, ... as the Hub's layer_types begin); the config.json also carries block_dim, conv_dim and the feed-
    # forward sizing (block_ff_dim 12288 -> 2/3 rounded to a multiple of 256), which vLLM reads; tied
    "Lfm2ForCausalLM": {
        "layer_types": ["conv", "conv", "full_attention"],
        "conv_L_cache": 3,
        "conv_bias": False,
        "block_dim": 128,
        "conv_dim": 128,
        "conv_dim_out": 128,
        "intermediate_size": 384,
        "block_ff_dim": 384,
        "block_auto_adjust_ff_dim": True,
        "block_ffn_dim_multiplier": 1.0,
        "block_multiple_of": 256,
        "tie_word_embeddings": True,
    },
    # LiquidAI/LFM2-8B-A1B: the same conv/attention layers, the first num_dense_layers (2) dense, MoE after (32
    # experts, top 4, sigmoid routing with an expert bias, normalized); tied
    "Lfm2MoeForCausalLM": {
        "layer_types": ["conv", "conv", "full_attention", "conv"],
        "num_dense_layers": 2,
        "conv_L_cache": 3,
        "conv_bias": False,
        "use_expert_bias": True,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "tie_word_embeddings": True,
    },
    # Qwen/Qwen3.5-0.8B's text model: its layers (_QWEN3_5_LAYERS); tied
    "Qwen3_5ForCausalLM": {**_QWEN3_5_LAYERS, "tie_word_embeddings": True},
    # Qwen/Qwen3.5-35B-A3B's text model: the same layers, MoE in every layer (256 experts, top 8, and a gated shared
    # expert); untied
    "Qwen3_5MoeForCausalLM": {**_QWEN3_5_LAYERS, "tie_word_embeddings": False},
}


def arch_class(arch: str):
    """The transformers class named ``arch`` (vLLM's registry keys are transformers class names), or None."""
    import transformers  # the optional [demo] extra

    names = {
        n.replace("_", "").lower(): n
        for n in dir(transformers)
        if n.endswith(("ForCausalLM", "ForConditionalGeneration"))
    }
    name = (
        arch if arch in dir(transformers) else names.get(arch.replace("_", "").lower())
    )  # vLLM's Ernie4_5_ForCausalLM
    try:
        return None if name is None else getattr(transformers, name)
    except (AttributeError, ImportError, RuntimeError):
        return None


def tiny_config(arch: str):
    """A tiny config of transformers' ``arch`` class: :data:`TINY` over the class's own defaults, with one
    layer of each layer type the full-size default has (sliding and full attention, linear and full
    attention), in the order they first appear. Raises ValueError where the class has no plain config."""
    cls = arch_class(arch)
    if cls is None:
        raise ValueError(f"transformers {version('transformers')} has no class {arch}")
    cfg_cls = cls.config_class
    default = cfg_cls()
    if getattr(default, "sub_configs", None) and any(
        k in default.sub_configs for k in ("text_config", "vision_config")
    ):
        raise ValueError(f"{arch}: a composite config ({sorted(default.sub_configs)}): no generic tiny form")
    kw: dict[str, Any] = {k: v for k, v in TINY.items() if hasattr(default, k)}
    types = getattr(default, "layer_types", None)
    field = getattr(cfg_cls, "attribute_map", {}).get("layer_types", "layer_types")
    derived = getattr(cfg_cls, field, None)
    if isinstance(derived, property) and derived.fset is None:  # computed from other fields (Jamba's attn_layer_period,
        types = None  # Bamba's attn_layer_indices): HUB_SHAPES sets those
    if isinstance(types, list) and types:
        distinct = list(dict.fromkeys(types))
        kw["layer_types"] = distinct if len(distinct) > 1 else distinct * 2
        kw["num_hidden_layers"] = len(kw["layer_types"])
    for k, v in vars(default).items():  # per-layer lists sized for the full depth (not layer_types)
        if k != "layer_types" and isinstance(v, list) and len(v) == default.num_hidden_layers and k not in kw:
            kw[k] = v[: kw["num_hidden_layers"]]
    kw["tie_word_embeddings"] = bool(getattr(default, "tie_word_embeddings", False))
    kw.update(copy.deepcopy(HUB_SHAPES.get(arch, {})))  # a config may adjust its nested dicts in place
    if isinstance(kw.get("layer_types"), list):
        kw["num_hidden_layers"] = len(kw["layer_types"])
    cfg = cfg_cls(**kw)
    with torch.device("meta"):  # what the shrunk defaults weigh, before anything is allocated
        n = sum(p.numel() for p in cls(cfg).parameters())
    if n > TINY_MAX_PARAMS:
        raise ValueError(
            f"{arch}: {n / 1e6:.0f} M parameters after shrinking its defaults (widths this sweep does not know)"
        )
    return cfg


if __name__ == "__main__":
    out = make_model(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "qwen2")
    print(out, sorted((k, tuple(v.shape)) for k, v in load_state_dict(out).items())[:3])
