"""The signed CLI round trip on the core package alone (no extras, no engine): what a trainer
machine with ``pip install engine-ext`` can do.

    python scripts/core_roundtrip.py [WORKDIR]

Makes two versions of a small bf16 checkpoint with torch and safetensors only, then runs
the installed ``engine-ext`` console script: ``--help`` of every command, ``keygen``, ``anchor``
(signed), ``diff`` (signed, reading the store's own LATEST with no ENGINE_EXT_TRUSTED_KEYS set),
``inspect`` and ``apply`` (verifying with the public key), and checks that the applied checkpoint
is bit for bit the new one and that a stranger's key is refused. Then the two commands that reach
beyond the core: ``push`` to a replica that is not there (exit 1, naming it; no engine runs in a
core install) and ``report``, whose plots need the ``[report]`` extra (exit 1, naming it). Exit 0
when all holds.
``scripts/core_check.sh`` runs it in a fresh virtualenv holding ``pip install .`` alone.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def engine_ext(*args: str, ok: bool = True) -> str:
    script = shutil.which("engine-ext", path=os.path.dirname(sys.executable)) or shutil.which("engine-ext")
    if script is None:
        raise SystemExit(f"no engine-ext console script beside {sys.executable}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGINE_EXT_")}  # nothing preconfigured
    p = subprocess.run([script, *args], capture_output=True, text=True, env=env)
    if (p.returncode == 0) != ok:
        raise SystemExit(f"engine-ext {' '.join(args)}: exit {p.returncode} (wanted {'0' if ok else 'non-zero'})\n"
                         f"{p.stdout}{p.stderr}")
    print(f"$ engine-ext {' '.join(args)}\n{(p.stdout + p.stderr).strip()[:2000]}\n", flush=True)
    return p.stdout if ok else p.stdout + p.stderr


def checkpoint(path: Path, sd: dict) -> Path:
    path.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in sd.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "toy"}))
    return path


def main() -> None:
    work = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="engine_ext_core_"))
    work.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    master = {"embed.weight": 0.02 * torch.randn(512, 64, generator=g), "layer.0.weight": 0.02 * torch.randn(64, 64, generator=g),
              "layer.0.bias": torch.zeros(64), "norm.weight": torch.ones(64)}
    v0 = checkpoint(work / "v0", {n: t.to(torch.bfloat16) for n, t in master.items()})
    for t in master.values():  # one RL-sized step: a few % of the bf16 elements change
        t.add_(5e-6 * torch.randn(t.shape, generator=g))
    v1 = checkpoint(work / "v1", {n: t.to(torch.bfloat16) for n, t in master.items()})
    store, key, stranger = work / "store", work / "publisher.key", work / "stranger.key"

    from engine_ext.cli import build_parser

    commands = next(a for a in build_parser()._actions if a.dest == "cmd").choices
    for cmd in commands:
        assert "usage: engine-ext " + cmd in engine_ext(cmd, "--help"), cmd
    engine_ext("keygen", str(key))
    engine_ext("keygen", str(stranger))
    engine_ext("anchor", str(v0), "--out", str(store), "--sign", str(key))
    uri = engine_ext("diff", str(v0), str(v1), "--out", str(store), "--sign", str(key)).strip().splitlines()[-1]
    info = json.loads(engine_ext("inspect", uri, "--trust", f"{key}.pub", "--json"))
    assert info["signatures"] == 1 and info["base_version"] == 0 and info["version"] == 1, info
    assert 0 < info["changed_elements"] < info["elements"], info
    engine_ext("apply", uri, "--base", str(v0), "--out", str(work / "applied"), "--trust", f"{key}.pub")
    got, want = load_file(str(work / "applied" / "model.safetensors")), load_file(str(v1 / "model.safetensors"))
    assert set(got) == set(want)
    for n in want:
        assert torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)), f"{n} differs after apply"
    engine_ext("apply", uri, "--base", str(v0), "--out", str(work / "refused"), "--trust", f"{stranger}.pub", ok=False)
    assert not (work / "refused").exists()

    for t in master.values():  # a second step, then the catch-up delta v0 -> v2 composed from the store's two
        t.add_(5e-6 * torch.randn(t.shape, generator=g))
    v2 = checkpoint(work / "v2", {n: t.to(torch.bfloat16) for n, t in master.items()})
    engine_ext("diff", str(v1), str(v2), "--out", str(store), "--sign", str(key))
    said = engine_ext("compact", str(store), "--spans", "2", "--sign", str(key))
    assert "v0 -> v2 (2 links" in said and "v00000002.from00000000.json" in said, said
    engine_ext("apply", str(store / "v00000002.from00000000.json"), "--base", str(v0), "--out", str(work / "caught_up"),
               "--trust", f"{key}.pub")
    got, want = load_file(str(work / "caught_up" / "model.safetensors")), load_file(str(v2 / "model.safetensors"))
    for n in want:
        assert torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)), f"{n} differs after the catch-up"

    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{s.getsockname()[1]}"
    said = engine_ext("push", uri, "--servers", nobody, "--retries", "0", "--timeout", "10", ok=False)
    assert f"did not reach v1: {nobody}" in said, said
    said = engine_ext("report", str(store), "--out", str(work / "report"), "--trust", f"{key}.pub", ok=False)
    assert 'pip install "engine-ext[report]"' in said and said.count("error:") == 1, said
    print(f"core round trip ok: {info['changed_elements']} of {info['elements']} elements changed, "
          f"{info['payload_bytes']} payload bytes, applied checkpoint bit-exact, a stranger's key refused; a catch-up delta composed and applied bit-exact; "
          f"every command's --help; push names the replica it could not reach; report names its extra "
          f"({len(commands)} commands)")


if __name__ == "__main__":
    main()
