"""Tiny random checkpoints that real engines load: Qwen2, Llama, tied embeddings, MoE.

The demo, the benchmarks and the tests make their models here (no download):
``make_model(dir, "qwen2")`` writes ``config.json`` + ``model.safetensors`` (bf16) via
``save_pretrained`` and a ``tokenizers`` WordLevel tokenizer over ``vocab`` tokens, so
vLLM/SGLang can serve it. Prompts should be given as token ids (the vocabulary is
synthetic). Needs ``transformers`` and ``tokenizers`` (the ``demo`` extra).

    python -m engine_ext.tiny_models DIR [qwen2|llama|qwen2-tied|qwen3-moe|qwen3-moe-fused|qwen2-moe]

MoE kinds (8 experts, top 2): ``qwen3-moe`` names each expert
(``mlp.experts.N.gate_proj.weight``, as most Hub checkpoints do), ``qwen3-moe-fused``
stores them fused (``mlp.experts.gate_up_proj`` [E, 2*I, H] and ``mlp.experts.down_proj``
[E, H, I], the transformers 5 in-memory layout), ``qwen2-moe`` adds a shared expert with
its sigmoid gate.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

KINDS = ("qwen2", "llama", "qwen2-tied", "qwen3-moe", "qwen3-moe-fused", "qwen2-moe")
MOE_KINDS = ("qwen3-moe", "qwen3-moe-fused", "qwen2-moe")


def _config(kind: str, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, moe_intermediate: int | None = None):
    import transformers

    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if kind == "llama":
        return transformers.LlamaConfig(tie_word_embeddings=False, **common)
    if kind in ("qwen3-moe", "qwen3-moe-fused"):
        return transformers.Qwen3MoeConfig(tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                                           moe_intermediate_size=moe_intermediate or hidden // 2, decoder_sparse_step=1,
                                           mlp_only_layers=[], head_dim=hidden // heads, **common)
    if kind == "qwen2-moe":
        return transformers.Qwen2MoeConfig(tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                                           moe_intermediate_size=moe_intermediate or hidden // 2, shared_expert_intermediate_size=hidden,
                                           decoder_sparse_step=1, mlp_only_layers=[], **common)
    if kind in ("qwen2", "qwen2-tied"):
        return transformers.Qwen2Config(tie_word_embeddings=(kind == "qwen2-tied"), **common)
    raise ValueError(f"unknown tiny model kind {kind!r}; one of {KINDS}")


def word_ids(words: list[str] | tuple[str, ...]) -> dict[str, int]:
    """The ids :func:`write_tokenizer` gives ``words``: 4, 5, ... in order (prompts are given as ids)."""
    return {w: 4 + i for i, w in enumerate(words)}


def write_tokenizer(path: str | os.PathLike, vocab: int, words: list[str] | tuple[str, ...] = ()) -> None:
    """A WordLevel tokenizer: ``words`` take ids 4, 5, ... (readable samples), every other id ``i``
    is the token ``t{i}`` (ids 0-3 are pad/bos/eos/unk)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if len(set(words)) != len(words) or 4 + len(words) > vocab:
        raise ValueError(f"{len(words)} words must be distinct and fit in a vocabulary of {vocab} after the 4 special tokens")
    vocab_ids = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab_ids.update(word_ids(words))
    vocab_ids.update({f"t{i}": i for i in range(4 + len(words), vocab)})
    tok = Tokenizer(models.WordLevel(vocab=vocab_ids, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(str(path))


def make_model(
    path: str | os.PathLike,
    kind: str = "qwen2",
    *,
    vocab: int = 1024,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    std: float = 0.02,
    words: list[str] | tuple[str, ...] = (),
    moe_intermediate: int | None = None,
) -> Path:
    """Write a tiny random ``kind`` model (bf16) with tokenizer into ``path``; return it.

    MoE kinds: each expert's intermediate width is ``moe_intermediate`` (default hidden / 2);
    vLLM's CPU MoE pads a width per rank that is not a multiple of 32 (96 at TP 2: 48 -> 64).

    Weights are N(0, std) (norm weights 1 + small noise) so that greedy decoding is
    sensitive to small changes, which makes "outputs identical" a meaningful check.
    """
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = _config(kind, vocab, hidden, layers, heads, kv_heads, moe_intermediate)
    torch.manual_seed(seed)
    cls = {"llama": transformers.LlamaForCausalLM, "qwen3-moe": transformers.Qwen3MoeForCausalLM,
           "qwen3-moe-fused": transformers.Qwen3MoeForCausalLM,
           "qwen2-moe": transformers.Qwen2MoeForCausalLM}.get(kind, transformers.Qwen2ForCausalLM)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(std * 50 * torch.randn_like(p) if "embed" in name else std * torch.randn_like(p))
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(path), safe_serialization=True)
    if kind == "qwen3-moe-fused":
        save_state_dict(path, fuse_experts(load_state_dict(path)), path)
    write_tokenizer(path, vocab, words)
    # transformers 5 writes "dtype"; older readers look for "torch_dtype": keep both.
    cfg_path = path / "config.json"
    cfg_json = json.loads(cfg_path.read_text())
    cfg_json.setdefault("torch_dtype", "bfloat16")
    cfg_path.write_text(json.dumps(cfg_json, indent=2))
    return path


def load_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of a model dir (all ``*.safetensors`` files), by name."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def save_state_dict(path: str | os.PathLike, state: dict[str, torch.Tensor], like: str | os.PathLike,
                    quantize: str | None = None) -> Path:
    """A model dir with ``like``'s config/tokenizer and ``state`` as its weights (cold starts).

    ``quantize="fp8-block"``: write the fp8 checkpoint of ``state`` (master weights) instead,
    with its ``quantization_config`` (:mod:`engine_ext.format.quantize`)."""
    import shutil

    from safetensors.torch import save_file

    path, like = Path(path), Path(like)
    path.mkdir(parents=True, exist_ok=True)
    for f in like.iterdir() if path.resolve() != like.resolve() else ():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, path / f.name)
    if quantize is not None:
        from .format.quantize import quantization_config, quantizer

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
    import re

    out, groups = {}, {}
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


if __name__ == "__main__":
    import sys

    out = make_model(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "qwen2")
    print(out, sorted((k, tuple(v.shape)) for k, v in load_state_dict(out).items())[:3])
