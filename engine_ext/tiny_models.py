"""Tiny random checkpoints that real engines load: Qwen2, Llama, tied embeddings.

The demo, the benchmarks and the tests make their models here (no download):
``make_model(dir, "qwen2")`` writes ``config.json`` + ``model.safetensors`` (bf16) via
``save_pretrained`` and a ``tokenizers`` WordLevel tokenizer over ``vocab`` tokens, so
vLLM/SGLang can serve it. Prompts should be given as token ids (the vocabulary is
synthetic). Needs ``transformers`` and ``tokenizers`` (the ``demo`` extra).

    python -m engine_ext.tiny_models DIR [qwen2|llama|qwen2-tied]
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

KINDS = ("qwen2", "llama", "qwen2-tied")


def _config(kind: str, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int):
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
    if kind in ("qwen2", "qwen2-tied"):
        return transformers.Qwen2Config(tie_word_embeddings=(kind == "qwen2-tied"), **common)
    raise ValueError(f"unknown tiny model kind {kind!r}; one of {KINDS}")


def write_tokenizer(path: str | os.PathLike, vocab: int) -> None:
    """A WordLevel tokenizer: token ``t{i}`` has id ``i`` (ids 0-2 are pad/bos/eos)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    words.update({f"t{i}": i for i in range(4, vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
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
) -> Path:
    """Write a tiny random ``kind`` model (bf16) with tokenizer into ``path``; return it.

    Weights are N(0, std) (norm weights 1 + small noise) so that greedy decoding is
    sensitive to small changes, which makes "outputs identical" a meaningful check.
    """
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = _config(kind, vocab, hidden, layers, heads, kv_heads)
    torch.manual_seed(seed)
    cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.Qwen2ForCausalLM
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(std * 50 * torch.randn_like(p) if "embed" in name else std * torch.randn_like(p))
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path, vocab)
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


def save_state_dict(path: str | os.PathLike, state: dict[str, torch.Tensor], like: str | os.PathLike) -> Path:
    """A model dir with ``like``'s config/tokenizer and ``state`` as its weights (cold starts)."""
    import shutil

    from safetensors.torch import save_file

    path, like = Path(path), Path(like)
    path.mkdir(parents=True, exist_ok=True)
    for f in like.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, path / f.name)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path



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
