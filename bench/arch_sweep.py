"""Conformance sweep: every architecture vLLM's registry offers, as a new user would meet it.

For each architecture name in vLLM's model registry that transformers also has a class for,
a tiny random config of that class (:func:`engine_ext.tiny_models.tiny_config`: the class's own
defaults, shrunk; one layer of each layer type; the matrix's hand-made config where it has one) is trained for two steps on float32 masters and
published through the README's ``DeltaPublisher(...).publish(model)`` (3 versions: an anchor and
two deltas). A vLLM CPU server with the plugin starts cold on the last version (the reference),
is taken back to v0 (``rollback``) and forward through both deltas, and must then serve the
cold start's fingerprint and greedy outputs (tokens, logprobs, top-k) bit for bit, with no stale
derived copy (``?audit=1``). At v0 and at the end, the server also compares every tensor each module
holds with a cold load of that version, byte for byte (the cold-load audit,
engine_ext/engines/vllm/cold_audit.py): state the updates never reach would still hold the start-up's
version at v0, where no output comparison looks. Each architecture ends in one row:

* ``pass``: bit-equal to the cold start after the chain;
* ``refused``: an update was refused with a clear reason and changed nothing (the reason is shown);
* ``cannot serve``: vLLM CPU does not start or answer on it (the reason is shown);
* ``no tiny config`` / ``no transformers class`` / ``not generative``: nothing to run;
* ``DIVERGED``: every update accepted, yet the server computes otherwise than a cold start. The
  sweep exits 1 on any such row: it must never appear.

    python bench/arch_sweep.py                 # the CI subset (one per post-processing path)
    python bench/arch_sweep.py --full --write  # every registry architecture; table into docs/MODELS.md
    python bench/arch_sweep.py --archs GptOssForCausalLM Qwen3NextForCausalLM
    .venv-sglang/bin/python bench/arch_sweep.py --engine sglang --full --write   # SGLang's registry

One server at a time (about 30-60 s each on 2 cores).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the matrix's trainer side (model_matrix) and prompts (vllm_helpers)

# One architecture per distinct post-processing path vLLM's CPU backend takes (tests/test_arch_sweep.py
# runs these in CI): padded MoE experts with biases, hybrid linear attention (packed conv1d), MLA, dense
# with sliding windows, MoE with a shared expert.
CI_ARCHS = ("GptOssForCausalLM", "Qwen3NextForCausalLM")
NAMED = ("GptOssForCausalLM", "Qwen3NextForCausalLM", "Ernie4_5_ForCausalLM", "HunYuanDenseV1ForCausalLM",
         "Exaone4ForCausalLM", "Qwen3MoeForCausalLM")
GENERATIVE = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")  # what RL rolls out
MARK = ("<!-- arch_sweep: begin -->", "<!-- arch_sweep: end -->")
SGLANG_MARK = ("<!-- arch_sweep sglang: begin -->", "<!-- arch_sweep sglang: end -->")


@dataclass
class Row:
    arch: str
    result: str  # pass | refused | cannot serve | no tiny config | no transformers class | DIVERGED
    detail: str = ""
    seconds: float = 0.0


def registry_archs() -> list[str]:
    """vLLM's text-generation architectures (its registry's names), sorted."""
    from vllm.model_executor.models.registry import ModelRegistry

    return sorted(ModelRegistry.get_supported_archs())


def curated_kinds() -> dict[str, str]:
    """{architecture: tiny_models kind} where the matrix has a hand-made tiny config (DeepSeek-V2's MLA needs
    the only head sizes vLLM's CPU MLA kernel takes); a VLM's needs its test-only stubs and stays the matrix's."""
    from engine_ext.tiny_models import ARCH_KINDS, KINDS, VLM_KINDS, model_class

    out: dict[str, str] = {}
    for kind in KINDS:
        if kind not in VLM_KINDS and kind not in ARCH_KINDS and kind != "qwen3-moe-fused":
            out.setdefault(model_class(kind).__name__, kind)
    return out


def _short(text: str, n: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


_ROOT_CAUSE = re.compile(r"^(?:\(\w+ pid=\d+\) ERROR [^\]]*\] )?((?:\w+\.)*\w*(?:Error|Exception)(?:: .*)?)$")
_GENERIC = ("Engine core initialization failed", "EngineCore encountered", "Worker failed with error", "HTTPError")


def root_cause(log_path: Path, fallback: BaseException | str) -> str:
    """The first line of the server's log that names an exception other than the engine's generic wrappers."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    for i, line in enumerate(lines):
        m = _ROOT_CAUSE.match(line.strip())
        if m and not any(g in m.group(1) for g in _GENERIC):
            if m.group(1).endswith("Error") and i >= 2:  # a bare AssertionError: the failing line is above it
                return _short(f"{m.group(1)} at {lines[i - 2].split(']', 1)[-1].strip()} {lines[i - 1].split(']', 1)[-1].strip()}", 200)
            return _short(m.group(1), 200)
    return _short(str(fallback).splitlines()[0] if str(fallback) else type(fallback).__name__, 200)


def secure_env(work: Path) -> None:
    """Run as deployed (tests/conftest.py does the same): every version signed, the route behind a token."""
    import secrets

    from engine_ext.store.signing import generate_key

    key = work / "publisher.key"
    if not key.exists():
        work.mkdir(parents=True, exist_ok=True)
        generate_key(str(key))
    os.environ.update(ENGINE_EXT_SIGNING_KEY=str(key), ENGINE_EXT_TRUSTED_KEYS=f"{key}.pub",
                      ENGINE_EXT_TOKEN=os.environ.get("ENGINE_EXT_TOKEN") or secrets.token_hex(16))


def trajectory(arch: str, work: Path):
    """``arch``'s 3 versions through ``publish(model)`` into ``work`` (both engines' first step), or the
    :class:`Row` that says why there is nothing to run."""
    import model_matrix as mm

    from engine_ext.tiny_models import arch_class, tiny_config

    t0 = time.perf_counter()
    if not arch.endswith(GENERATIVE):
        return Row(arch, "not generative", "a pooling/classification model: no policy to roll out")
    if arch_class(arch) is None:
        return Row(arch, "no transformers class")
    kind = curated_kinds().get(arch, arch)
    try:
        if kind == arch:
            tiny_config(arch)
        return mm.trajectory(kind, work, paths=("module",), dtypes=("fp32",))
    except Exception as e:  # noqa: BLE001 - the row says why
        return Row(arch, "no tiny config", _short(f"{type(e).__name__}: {e}"), time.perf_counter() - t0)


def run_arch(arch: str, work: Path) -> Row:
    """One row: the arch's trajectory through ``publish(model)``, a cold server, the chain, the comparison."""
    import model_matrix as mm
    from vllm_helpers import PROMPTS, WARMUP_PROMPT

    from engine_ext.engines.vllm.launcher import VllmServer

    t0 = time.perf_counter()
    traj = trajectory(arch, work)
    if isinstance(traj, Row):
        return traj
    try:
        server = VllmServer(traj.final, sources=str(work), log=work / "server.log", startup_s=240,
                            env={"ENGINE_EXT_COLD_AUDIT": "1"})
    except Exception as e:  # noqa: BLE001
        return Row(arch, "cannot serve", root_cause(work / "server.log", e), time.perf_counter() - t0)
    try:
        def outputs():
            out = []
            for p in PROMPTS:
                c = server.complete(p)["choices"][0]
                out.append((c["text"], c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"]))
            return out

        try:
            server.complete(WARMUP_PROMPT, max_tokens=1, logprobs=0)
            cold, status = outputs(), server.status()
        except Exception as e:  # noqa: BLE001
            return Row(arch, "cannot serve", "generation failed: " + root_cause(work / "server.log", e), time.perf_counter() - t0)
        layout = status.get("layout") or {}
        notes = [f"{k} {len(layout[k])}" for k in ("fallback", "mismatched", "refused") if layout.get(k)]
        weak, pause = "", []  # (the sampled check of derived copies, the pause), ms, per delta
        for v in range(mm.VERSIONS):
            if v == 1 and outputs() == cold:  # v0 computes as the final version: the comparison sees little
                weak = "; v0's outputs equal the final's (a weak comparison)"
            before = server.status()["fingerprint"]
            r = server.update({"url": traj.url("module/fp32", v), **({"rollback": True} if v == 0 else {})})
            if r.status_code == 200 and v:
                ms = r.json()["phases_ms"]
                pause.append((ms.get("verify_derived", 0.0), r.json()["pause_ms"]))
            if r.status_code != 200:
                after = server.status()["fingerprint"]
                body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {"error": r.text}
                if after != before:
                    return Row(arch, "DIVERGED", f"v{v} refused ({r.status_code}) yet the served fingerprint moved",
                               time.perf_counter() - t0)
                return Row(arch, "refused", _short(f"v{v}: {r.status_code} {body.get('error', body)}", 240),
                           time.perf_counter() - t0)
            if v == 0:  # every tensor each module holds against a cold load of v0: state no update reaches shows here
                at_v0 = server.status(cold=traj.first)["cold_audit"]
                if not at_v0["ok"]:
                    return Row(arch, "DIVERGED", "at v0, differs from a cold load: " + _short(", ".join(at_v0["differ"]), 200),
                               time.perf_counter() - t0)
        final = server.status(audit=True, cold=traj.final)
        same = final["fingerprint"] == status["fingerprint"] and outputs() == cold
        audit, cold_audit = final.get("audit") or {}, final.get("cold_audit") or {}
        if not same or not audit.get("ok", False) or not cold_audit.get("ok", False):
            why = ("outputs differ from a cold start" if not same else f"audit: {_short(json.dumps(audit), 200)}"
                   if not audit.get("ok", False) else "differs from a cold load: " + _short(", ".join(cold_audit["differ"]), 200))
            return Row(arch, "DIVERGED", why + (f" ({', '.join(notes)})" if notes else ""), time.perf_counter() - t0)
        derived = audit.get("derived") or {}
        detail = (f"derived copies checked {derived.get('checked', 0)}, opaque {derived.get('opaque', 0)}; cold-load audit "
                  f"{cold_audit['compared'] + at_v0['compared']} tensors, {cold_audit['gemms']} GEMMs; sampled check "
                  f"{sum(c for c, _ in pause):.1f} of {sum(p for _, p in pause):.0f} ms paused")
        return Row(arch, "pass", detail + (f"; {', '.join(notes)}" if notes else "") + weak, time.perf_counter() - t0)
    finally:
        server.stop()


def sglang_archs() -> list[str]:
    """SGLang's model classes (its registry's names), sorted. Run with the SGLang virtualenv's python."""
    sys.path.insert(0, str(ROOT / "tests" / "sglang_stubs"))  # torchvision, which the CPU venv cannot hold (a stub)
    from sglang.srt.models.registry import import_model_classes

    return sorted(import_model_classes("sglang.srt.models"))


def run_sglang_arch(arch: str, work: Path) -> Row:
    """One row on SGLang CPU: the matrix's worker (tests/test_sglang_models.py: SGLang's own ``get_model``, the
    adapter's rank handler and the controller, in one process of its own), then every parameter compared
    with the cold load bit for bit (no generation: SGLang's scheduler does not run here)."""
    import subprocess

    import model_matrix as mm

    t0 = time.perf_counter()
    traj = trajectory(arch, work)
    if isinstance(traj, Row):
        return traj
    store = "module/fp32"
    spec = {arch: {"final": str(traj.final), "root": str(work), "fingerprints": traj.fingerprints,
                   "urls": {store: [traj.url(store, v) for v in range(mm.VERSIONS)]}}}
    (work / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "sglang_stubs"), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", SGLANG_PLUGINS="engine_ext")
    with open(work / "worker.log", "w") as log:
        try:
            p = subprocess.run([sys.executable, str(ROOT / "tests" / "test_sglang_models.py"), str(work / "spec.json"),
                                str(work / "out.json")], env=env, stdout=log, stderr=subprocess.STDOUT, timeout=600)
        except subprocess.TimeoutExpired:
            return Row(arch, "cannot serve", "SGLang's load or update took over 600 s", time.perf_counter() - t0)
    if p.returncode != 0 or not (work / "out.json").exists():
        return Row(arch, "cannot serve", "worker died: " + root_cause(work / "worker.log", f"rc {p.returncode}"),
                   time.perf_counter() - t0)
    res = json.loads((work / "out.json").read_text())[arch]
    took = time.perf_counter() - t0
    if not res["loaded"]:
        return Row(arch, "cannot serve", _short(res.get("error", ""), 200), took)
    if "error" in res:
        return Row(arch, "refused", _short("start-up: " + res["error"], 200), took)
    cell = res["paths"][store]
    layout = res.get("layout") or {}
    notes = [f"{k} {len(layout[k])}" for k in ("fallback", "mismatched", "unreproducible") if layout.get(k)]
    if cell["reason"] is not None:
        if not cell.get("unchanged"):
            return Row(arch, "DIVERGED", f"refused ({cell['reason']}) yet the parameters moved", took)
        return Row(arch, "refused", _short(f"{cell['reason']}: {cell.get('error', '')}", 240), took)
    if cell["mismatched"] or cell["moved"] or cell["fingerprint"] != res["cold_fingerprint"]:
        return Row(arch, "DIVERGED", _short(f"parameters differ from the cold load: {cell['mismatched'][:3]}"), took)
    return Row(arch, "pass", "every parameter equals the cold load's" + (f"; {', '.join(notes)}" if notes else ""), took)


def table(rows: list[Row], command: str, engine: str = "vLLM 0.32 CPU") -> str:
    head = ["| architecture | result | detail |", "|---|---|---|"]
    body = [f"| `{r.arch}` | {r.result} | {r.detail.replace('|', '/')} |" for r in rows]
    counts = {}
    for r in rows:
        counts[r.result] = counts.get(r.result, 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    marks = SGLANG_MARK if engine.startswith("SGLang") else MARK
    return "\n".join([marks[0], f"`{command}` ({time.strftime('%Y-%m-%d')}, {engine}; {summary}):", "", *head, *body, marks[1]])


def write_table(text: str, path: Path = ROOT / "docs" / "MODELS.md", marks=MARK) -> None:
    doc = path.read_text()
    if marks[0] not in doc:
        raise SystemExit(f"{path} has no {marks[0]} ... {marks[1]} section to write the table into")
    a, b = doc.index(marks[0]), doc.index(marks[1]) + len(marks[1])
    path.write_text(doc[:a] + text + doc[b:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", nargs="*", help="architecture names (default: the CI subset)")
    ap.add_argument("--engine", choices=("vllm", "sglang"), default="vllm",
                    help="sglang: SGLang's registry and loaders (run with the SGLang virtualenv's python)")
    ap.add_argument("--full", action="store_true", help="every architecture in vLLM's registry")
    ap.add_argument("--named", action="store_true", help="the architectures issue 39 names")
    ap.add_argument("--write", action="store_true", help="write the table into docs/MODELS.md")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    ap.add_argument("--work", type=Path, help="keep each architecture's stores and server log here (default: a temporary dir)")
    args = ap.parse_args(argv)
    sglang = args.engine == "sglang"
    everything = sglang_archs() if sglang else registry_archs()
    archs = everything if args.full else list(NAMED) if args.named else list(args.archs or CI_ARCHS)
    run = run_sglang_arch if sglang else run_arch
    rows = []
    with tempfile.TemporaryDirectory(prefix="arch-sweep-") as tmp:
        tmp = args.work or tmp
        secure_env(Path(tmp))
        for arch in archs:
            try:
                row = run(arch, Path(tmp) / arch)
            except Exception as e:  # noqa: BLE001 - a harness failure is a row too, never a silent skip
                row = Row(arch, "harness error", _short(f"{type(e).__name__}: {e}"))
                traceback.print_exc()
            rows.append(row)
            print(f"{row.arch:40s} {row.result:14s} {row.seconds:6.1f} s  {row.detail}", flush=True)
    command = "python bench/arch_sweep.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = table(rows, command.strip(), "SGLang 0.5.23 CPU" if sglang else "vLLM 0.32 CPU")
    print(text)
    if args.write:
        write_table(text, marks=SGLANG_MARK if sglang else MARK)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 1 if any(r.result in ("DIVERGED", "harness error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
