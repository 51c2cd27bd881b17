"""engine-ext diff / anchor / apply / inspect round trips on sharded bf16 checkpoints (real files, real CLI)."""
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine_ext.store.checkpoint import CheckpointDir
from engine_ext.cli import main
from engine_ext.format.dtypes import as_bits

from support.synthetic import AdamRL, llm_shapes  # tests/support (tests/ is on sys.path: conftest.py)


def write_sharded(path: Path, sd: dict, shards: int = 2) -> Path:
    """An HF-style checkpoint dir with an index file and ``shards`` shard files."""
    path.mkdir(parents=True)
    names = list(sd)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: sd[n].contiguous() for n in names[s::shards]}
        save_file(part, str(path / fname))
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text("{}")
    return path


def same(dir_a, dir_b):
    a, b = CheckpointDir(dir_a), CheckpointDir(dir_b)
    assert set(a.tensors) == set(b.tensors)
    for n in a.tensors:
        assert torch.equal(as_bits(a.load(n)), as_bits(b.load(n))), n
    assert sorted(p.name for p in Path(dir_a).iterdir()) == sorted(p.name for p in Path(dir_b).iterdir())


def run(*args) -> tuple[int, str]:
    """The CLI in-process (torch imports once); test_console_script runs the real executable."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, err.getvalue() + out.getvalue()  # stdout last: it ends with the URI


def test_console_script(versions, tmp_path):
    """The ``engine-ext`` script pip installed beside this interpreter (a virtualenv's bin need not be on PATH)."""
    script = shutil.which("engine-ext", path=os.path.dirname(sys.executable))
    assert script, f"no engine-ext console script beside {sys.executable}"
    p = subprocess.run([script, "diff", str(versions[0]), str(versions[1]), "--out", str(tmp_path / "s")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == str(tmp_path / "s" / "v00000001.json")


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    tr = AdamRL(llm_shapes(hidden=64, layers=2, vocab=512, inter=128, kv=32), lr=1e-5, seed=3)
    dirs = [write_sharded(root / "v0", tr.weights())]
    for k in range(1, 4):
        dirs.append(write_sharded(root / f"v{k}", tr.step()))
    return dirs


def test_chain_round_trip(versions, tmp_path):
    store = tmp_path / "store"
    code, out = run("anchor", versions[0], "--out", store)
    assert code == 0, out
    uris = []
    for k in range(1, len(versions)):
        code, out = run("diff", versions[k - 1], versions[k], "--out", store)
        assert code == 0, out
        uris.append(out.strip().splitlines()[-1])
        assert uris[-1].endswith(f"v{k:08d}.json")
    cur = versions[0]
    for k, uri in enumerate(uris, 1):
        nxt = tmp_path / f"applied{k}"
        code, out = run("apply", uri, "--base", cur, "--out", nxt)
        assert code == 0, out
        same(nxt, versions[k])
        cur = nxt
    anchor_out = tmp_path / "from_anchor"
    assert main(["apply", str(store / "v00000000.anchor.json"), "--out", str(anchor_out)]) == 0
    assert all(torch.equal(as_bits(CheckpointDir(anchor_out).load(n)), as_bits(CheckpointDir(versions[0]).load(n)))
               for n in CheckpointDir(versions[0]).tensors)
    code, out = run("inspect", uris[0])
    assert code == 0 and "bytes per changed element" in out, out
    code, out = run("inspect", uris[0], "--json")
    info = json.loads(out)
    assert info["version"] == 1 and 0 < info["changed_elements"] < info["elements"]


def test_wrong_base_refused(versions, tmp_path):
    store = tmp_path / "store"
    code, out = run("diff", versions[1], versions[2], "--out", store, "--base-version", "1")
    assert code == 0, out
    uri = out.strip().splitlines()[-1]
    code, out = run("apply", uri, "--base", versions[0], "--out", tmp_path / "o")
    assert code == 1 and "engine-ext apply: error:" in out and "(wrong base)" in out, out
    assert not (tmp_path / "o").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".o.tmp")]


@pytest.mark.parametrize("damage,says", [("corrupt", "SHA-256 mismatch"), ("truncate", "bytes, manifest says"),
                                         ("manifest", "not signed by 1 trusted key")])  # tampering breaks the signature first
def test_damaged_store_refused(versions, tmp_path, damage, says):
    store = tmp_path / "store"
    code, out = run("diff", versions[0], versions[1], "--out", store)
    assert code == 0, out
    uri = out.strip().splitlines()[-1]
    blob = next(store.glob("v00000001.0.*.bin"))
    data = bytearray(blob.read_bytes())
    if damage == "corrupt":
        data[len(data) // 2] ^= 0x40
        blob.write_bytes(bytes(data))
    elif damage == "truncate":
        blob.write_bytes(bytes(data[: len(data) // 2]))
    else:
        Path(uri).write_text(Path(uri).read_text()[:-40])
    code, out = run("apply", uri, "--base", versions[0], "--out", tmp_path / "o")
    assert code == 1 and "engine-ext apply: error:" in out and says in out, out
    assert not (tmp_path / "o").exists()


def test_single_file_checkpoint_and_out_exists(versions, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for src, dst in ((versions[0], a), (versions[1], b)):
        dst.mkdir()
        sd = {n: t for n, t in CheckpointDir(src).iter_tensors()}
        save_file(sd, str(dst / "model.safetensors"))
    code, out = run("diff", a, b, "--out", tmp_path / "s")
    assert code == 0, out
    uri = out.strip().splitlines()[-1]
    code, out = run("apply", uri, "--base", a, "--out", tmp_path / "c")
    assert code == 0, out
    same(tmp_path / "c", b)
    code, out = run("apply", uri, "--base", a, "--out", tmp_path / "c")
    assert code == 1 and "exists; refusing to overwrite it" in out, out


def _tied_dirs(tmp_path, versions, with_copy: tuple[bool, ...], dtype=None):
    """The versions as tied checkpoints (config.json: tie_word_embeddings), each with or without
    the tied copy ``lm_head.weight`` on disk (some checkpoints store it, save_pretrained does not)."""
    out = []
    for k, (src, copy) in enumerate(zip(versions, with_copy)):
        sd = dict(CheckpointDir(src).iter_tensors())
        if dtype is not None:
            sd = {n: t.to(dtype) for n, t in sd.items()}
        if copy:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
        d = write_sharded(tmp_path / f"tied{k}", sd)
        (d / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
        out.append(d)
    return out


def test_tied_copy_on_disk_is_published_once(versions, tmp_path):
    """Tied checkpoint dirs, with or without the tied copy on disk: anchor and diff publish the
    embedding once (saying so), apply takes a base holding the copy, and a "tied" copy whose bytes
    differ from the embedding is refused by name."""
    dirs = _tied_dirs(tmp_path, versions[:3], (True, False, True))
    store = tmp_path / "store"
    code, out = run("anchor", dirs[0], "--out", store)
    assert code == 0 and "lm_head.weight is tied to model.embed_tokens.weight" in out, out
    for k in (1, 2):
        code, out = run("diff", dirs[k - 1], dirs[k], "--out", store)
        assert code == 0, out
    for name in ("v00000000.anchor.json", "v00000001.json", "v00000002.json"):
        names = [t["name"] for t in json.loads((store / name).read_text())["tensors"]]
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names, name
    code, out = run("apply", store / "v00000001.json", "--base", dirs[0], "--out", tmp_path / "applied")
    assert code == 0, out
    got = CheckpointDir(tmp_path / "applied")
    assert set(got.tensors) == set(CheckpointDir(versions[1]).tensors)
    assert "lm_head.weight" not in json.loads((tmp_path / "applied" / "model.safetensors.index.json").read_text())["weight_map"]
    bad = CheckpointDir(dirs[2]).tensors["lm_head.weight"].file
    sd = dict(CheckpointDir(dirs[2]).iter_tensors())
    sd["lm_head.weight"] = sd["lm_head.weight"] * 2
    save_file({n: t.contiguous() for n, t in sd.items() if CheckpointDir(dirs[2]).tensors[n].file == bad}, str(dirs[2] / bad))
    code, out = run("diff", dirs[1], dirs[2], "--out", store)
    assert code == 1 and "lm_head.weight differs from model.embed_tokens.weight" in out, out
    untied = tmp_path / "untied"
    shutil.copytree(dirs[0], untied)
    (untied / "config.json").write_text(json.dumps({"text_config": {"tie_word_embeddings": False}}))
    code, out = run("anchor", untied, "--out", tmp_path / "store2")
    assert code == 0 and "lm_head.weight" in [t["name"] for t in json.loads(
        (tmp_path / "store2" / "v00000000.anchor.json").read_text())["tensors"]]  # untied: both are tensors


def test_dtype_casts_checkpoints_to_the_served_dtype(versions, tmp_path):
    """--dtype: fp32 checkpoint dirs published as the bf16 versions a bf16 server holds (the default
    publishes as stored); apply onto the bf16 base gives the bf16 checkpoint of the fp32 one."""
    dirs = _tied_dirs(tmp_path, versions[:2], (False, False), dtype=torch.float32)
    store = tmp_path / "store"
    assert run("anchor", dirs[0], "--out", tmp_path / "asis")[0] == 0
    assert {t["dtype"] for t in json.loads((tmp_path / "asis" / "v00000000.anchor.json").read_text())["tensors"]} == {"float32"}
    code, out = run("anchor", dirs[0], "--out", store, "--dtype", "bfloat16")
    assert code == 0, out
    code, out = run("diff", dirs[0], dirs[1], "--out", store, "--dtype", "bfloat16")
    assert code == 0, out
    doc = json.loads((store / "v00000001.json").read_text())
    assert {t["dtype"] for t in doc["tensors"]} == {"bfloat16"} and doc["base_version"] == 0  # on top of the bf16 anchor
    code, out = run("apply", store / "v00000001.json", "--base", versions[0], "--out", tmp_path / "applied")
    assert code == 0, out
    same_bits = CheckpointDir(tmp_path / "applied")
    assert all(torch.equal(as_bits(same_bits.load(n)), as_bits(CheckpointDir(versions[1]).load(n))) for n in same_bits.tensors)



def run_cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse's --help and --version
            code = e.code
    return code, out.getvalue(), err.getvalue()


def test_cli_conventions(tmp_path, monkeypatch):
    """--version; help on every argument with its default, an examples section, no RST markup; the token
    from the environment or a file (argv's --token still works, with a deprecation warning); every error
    one line with a non-zero exit, the traceback only with --debug; Ctrl-C exits 130."""
    import engine_ext.cli as cli

    code, out, _ = run_cli("--version")
    assert code == 0 and out.startswith("engine-ext ")
    code, out, _ = run_cli("--help")
    assert code == 0 and "examples:" in out and "ENGINE_EXT_TOKEN" in out and "``" not in out
    commands = set(next(a for a in cli.build_parser()._actions if a.dest == "cmd").choices)
    assert commands == {"keygen", "diff", "anchor", "apply", "inspect", "push", "report", "compact"}  # scripts/core_roundtrip.py runs each
    for cmd in sorted(commands):
        code, out, _ = run_cli(cmd, "--help")
        assert code == 0 and "``" not in out, cmd
        # every positional and option has help: argparse prints a bare name when it has none
        lines = [ln for ln in out.split("\n\n", 2)[-1].splitlines() if ln.startswith("  ") and not ln.startswith("   ")]
        assert all(len(ln.split()) > 1 or ln.strip().endswith(",") for ln in lines), (cmd, lines)
    code, out, _ = run_cli("push", "--help")
    assert "(default: 4)" in out and "(default: 900.0)" in out and "--token-file" in out
    assert "KEY" in run_cli("diff", "--help")[1] and "PUBKEY" in run_cli("diff", "--help")[1]

    seen = {}

    class FakeFleet:
        def __init__(self, urls, token, **kw):
            seen["token"] = token

        def update(self, uri, **kw):
            from engine_ext.fleet import FleetResult, ReplicaResult

            return FleetResult(uri, 1, [ReplicaResult("http://s", ok=True, version_after=1)])

    import engine_ext.fleet

    monkeypatch.setattr(engine_ext.fleet, "Fleet", FakeFleet)  # a mock: no server in this unit test
    (tmp_path / "tok").write_text("from-file\n")
    assert run_cli("push", "s3://b/r", "--servers", "http://s", "--token-file", str(tmp_path / "tok"), "--json")[0] == 0
    assert seen["token"] == "from-file"
    code, _, err = run_cli("push", "s3://b/r", "--servers", "http://s", "--token", "in-argv", "--json")
    assert code == 0 and seen["token"] == "in-argv" and "deprecated" in err

    def boom(a):
        raise RuntimeError("something\nbroke")

    monkeypatch.setattr(cli, "cmd_keygen", boom)
    code, _, err = run_cli("keygen", str(tmp_path / "k"))
    assert code == 1 and err.count("\n") == 1 and "RuntimeError: something broke" in err and "Traceback" not in err
    code, _, err = run_cli("keygen", str(tmp_path / "k"), "--debug")
    assert code == 1 and "Traceback" in err
    code, _, err = run_cli("--debug", "keygen", str(tmp_path / "k"))
    assert code == 1 and "Traceback" in err

    def interrupted(a):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_keygen", interrupted)
    code, _, err = run_cli("keygen", str(tmp_path / "k"))
    assert code == 130 and "interrupted" in err


def test_a_command_that_needs_an_extra_names_it(tmp_path, monkeypatch):
    """Each optional package a command imports maps to the extra of pyproject.toml that installs it, and a
    missing one ends the command with one line naming that extra (here matplotlib is hidden from the finder;
    scripts/core_roundtrip.py runs ``engine-ext report`` in a real core install, where it is missing)."""
    import importlib.util
    import tomllib

    import engine_ext.cli as cli

    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for module, extra in cli.EXTRA_OF.items():
        names = [r.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip().replace("-", "_") for r in extras[extra]]
        assert module in names, (module, extra, extras[extra])
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    code, out, err = run_cli("report", str(tmp_path / "store"), "--out", str(tmp_path / "out"))
    assert code == 1 and err.count("\n") == 1, err
    assert 'needs the package \'matplotlib\'' in err and 'pip install "engine-ext[report]"' in err, err
