"""The fuzzers' oracle (issue 30): what counts as an allowed outcome, the bounds, the mutators.

:func:`judge` runs one input through an entry point and allows only the documented refusal (the
:mod:`engine_ext.errors` class with its HTTP status and a short message) or a return; the caller
then checks what was accepted against docs/FORMAT.md with the ``*_spec_errors`` functions here,
written independently of the parsers. Each input is held to a CPU-time bound and an allocation
bound (:class:`Meter`). The mutators turn real data into hostile data: :func:`mutated_doc` (JSON
documents, field by field), :func:`mutated_bytes` (byte level), :class:`Deep` (nesting past the
recursion limit). The targets are in ``tests/fuzz_targets.py``.
"""
from __future__ import annotations

import json
import math
import re
import signal
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from hypothesis import strategies as st

from engine_ext.errors import DeltaError
from engine_ext.format.dtypes import BY_NAME, BY_SAFETENSORS
from engine_ext.format.latest import Latest
from engine_ext.format.manifest import ANCHOR, DELTA, FORMAT, READABLE_VERSIONS, Manifest
from engine_ext.server.controller import error_answer
from engine_ext.store.checkpoint import CheckpointDir


MAX_MESSAGE = 2000  # characters of an error message (docs/SECURITY.md: errors never echo the input at length)
HEX16 = re.compile(r"[0-9a-f]{16}")
SHA = re.compile(r"[0-9a-f]{64}")
KEY = re.compile(r"[A-Za-z0-9._-]+")


# --------------------------------------------------------------------------- outcomes, bounds, measuring one input


class Violation(AssertionError):
    """An outcome the contract does not allow: another exception, a wrong acceptance, over a bound."""


class Hang(BaseException):
    """Raised by the alarm inside an example that runs past the hang bound (a BaseException so
    that no ``except Exception`` in the code under test swallows it)."""


def _on_alarm(signum, frame):
    raise Hang()


class Meter:
    """Runs one example: its outcome, CPU time and peak allocation.

    Allocation is measured two ways, since neither sees everything: tracemalloc's peak (Python
    objects and numpy buffers, even untouched ones) and the growth of the peak resident set
    (``VmHWM``, reset per example through ``/proc/self/clear_refs``, less the file pages mapped in
    meanwhile: native allocations of pcodec, zstd, constriction, torch once touched, not the code of
    a library a first call pages in). Where the kernel does not allow the
    reset, tracemalloc alone. A hang is cut by SIGALRM after ``hang_s`` (main thread only)."""

    def __init__(self, hang_s: float = 60.0):
        self.hang_s = hang_s
        self.rss = self._rss_resettable()
        self.examples = 0

    @staticmethod
    def _rss_resettable() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    @staticmethod
    def _status(*names: str) -> list[int]:
        out = dict.fromkeys(names, 0)
        with open("/proc/self/status") as f:
            for line in f:
                name = line.split(":", 1)[0]
                if name in out:
                    out[name] = int(line.split()[1]) * 1024
        return [out[n] for n in names]

    def run(self, fn: Callable[[], Any]) -> tuple[Any, BaseException | None, float, int]:
        """(result, exception, CPU seconds (all threads), peak bytes above the start) of ``fn()``."""
        tracemalloc.start()  # per example: traced outside, hypothesis's own work would be slowed down too
        traced0 = tracemalloc.get_traced_memory()[0]
        if self.rss:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            rss0, file0 = self._status("VmRSS", "RssFile")
        alarm = signal.getsignal(signal.SIGALRM)
        in_main = _main_thread()
        if in_main:
            signal.signal(signal.SIGALRM, _on_alarm)
            signal.setitimer(signal.ITIMER_REAL, self.hang_s)
        result, exc = None, None
        t = time.process_time()  # CPU time of the process: the bound holds on a loaded machine too
        try:
            result = fn()
        except Hang as e:
            exc = e
        except Exception as e:  # noqa: BLE001 - judged by the caller
            exc = e
        finally:
            seconds = time.process_time() - t
            if in_main:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, alarm)
        peak = tracemalloc.get_traced_memory()[1] - traced0
        tracemalloc.stop()
        if self.rss:
            hwm, file1 = self._status("VmHWM", "RssFile")
            peak = max(peak, hwm - rss0 - (file1 - file0))  # pages of shared libraries a first call maps in are not allocations
        self.examples += 1
        return result, exc, seconds, peak


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


_METER: Meter | None = None


def meter() -> Meter:
    global _METER
    if _METER is None:
        _METER = Meter()
    return _METER


def judge(fn: Callable[[], Any], allowed: tuple[type, ...], seconds: float, max_bytes: int, what: str) -> tuple[Any, BaseException | None]:
    """Run ``fn`` under the meter and enforce the contract: it returns, or raises one of ``allowed``
    (documented refusals, whose HTTP status is the class's and whose message is short); within
    ``seconds`` and ``max_bytes``. :class:`Violation` otherwise."""
    result, exc, took, peak = meter().run(fn)
    if isinstance(exc, Violation):
        raise exc
    if isinstance(exc, Hang):
        raise Violation(f"{what}: hung (cut after {meter().hang_s} s)")
    if exc is not None:
        if not isinstance(exc, allowed):
            raise Violation(f"{what}: undocumented {type(exc).__name__}: {str(exc)[:300]}") from exc
        if isinstance(exc, DeltaError):
            status, body = error_answer(exc)
            if status != type(exc).http_status or status == 500:
                raise Violation(f"{what}: {type(exc).__name__} answered {status}")
        if len(str(exc)) > MAX_MESSAGE:
            raise Violation(f"{what}: a {len(str(exc))}-character error message ({type(exc).__name__}: {str(exc)[:200]}...)")
    if took > seconds:
        raise Violation(f"{what}: took {took:.3f} s, over the {seconds} s bound")
    if peak > max_bytes:
        raise Violation(f"{what}: allocated {peak / 2**20:.1f} MiB, over the {max_bytes / 2**20:.1f} MiB bound")
    return result, exc


# --------------------------------------------------------------------------- mutators


@dataclass(frozen=True)
class Deep:
    """A value nested ``depth`` lists deep, written into the JSON text after serialisation (json.dumps
    would refuse it): parsers must refuse it, not recurse past the stack."""

    depth: int
    kind: str = "["


SPECIAL_INTS = [-2**64, -2**63, -1, 0, 1, 2, 3, 7, 8, 255, 256, 4095, 4096, 65535, 2**16, 2**24, 2**31 - 1, 2**31,
                2**32 - 1, 2**32, 2**32 + 1, 2**40, 2**40 + 1, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64, 10**30]
SPECIAL_STRS = ["", "a", "0" * 16, "f" * 16, "F" * 16, "0" * 64, "0" * 63, "g" * 64, "-000000000000001", "+00000000000000f",
                " 000000000000001", "000000000000001 ", "0_00000000000001", "0x0000000000000f", "０" * 16, "../x", "a/b",
                ".hidden", "x" * 3000, "\x00", "é", "none", "all", "pco", "zstd", "ctx", "raw", "abs", "rel",
                "delta", "anchor", "bfloat16", "float32", "float8_e4m3fn", "int8", "bool", "complex64",
                "engine-ext-delta", "keep", "wait", "abort", "LATEST", "v00000001.json", "NaN"]
DEPTHS = [3, 50, 900, 1000, 2000, 20000]


def scalars() -> st.SearchStrategy:
    return st.one_of(st.none(), st.booleans(), st.sampled_from(SPECIAL_INTS), st.integers(),
                     st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0, 0.5]),
                     st.sampled_from(SPECIAL_STRS), st.text(max_size=8))


def hostile_values() -> st.SearchStrategy:
    small = scalars()
    return st.one_of(small, small, small, st.lists(small, max_size=4), st.dictionaries(st.text(max_size=6), small, max_size=3),
                     st.builds(Deep, st.sampled_from(DEPTHS), st.sampled_from(["[", "{"])))


def _copy(v):
    """A copy of a JSON document (dicts and lists copied, leaves shared): deepcopy's memo is slow."""
    if isinstance(v, dict):
        return {k: _copy(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_copy(x) for x in v]
    return v


def _paths(doc, path=()):
    """Every (parent, key) in a JSON document, containers and leaves."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield doc, k
            yield from _paths(v)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield doc, i
            yield from _paths(v)


def _tweak(draw, v):
    """A near miss of ``v``: off by a little, of another type, cut short."""
    if isinstance(v, bool):
        return draw(st.sampled_from([not v, int(v), str(v).lower(), None]))
    if isinstance(v, int):
        return draw(st.sampled_from([v + 1, v - 1, -v, 2 * v, v + 2**32, v * 2**20, float(v), str(v), [v], v ^ 1]))
    if isinstance(v, float):
        return draw(st.sampled_from([v + 1, -v, math.nan, math.inf, int(v) if math.isfinite(v) else 0, str(v)]))
    if isinstance(v, str):
        if not v:
            return draw(st.sampled_from(["x", None, 0]))
        i = draw(st.integers(0, len(v) - 1))
        return draw(st.sampled_from([v[:i], v[:i] + "g" + v[i + 1:], v[:i] + "0" + v[i + 1:], v.upper(), v + v[-1],
                                     " " + v, v + "\n", v.encode().hex()]))
    if isinstance(v, list):
        if not v:
            return draw(st.sampled_from([[None], [0], {}, None]))
        i = draw(st.integers(0, len(v) - 1))
        return draw(st.sampled_from([v[:i], v[:i] + v[i + 1:], v + [v[i]], v[::-1], v * 2, [v], {str(k): x for k, x in enumerate(v)}]))
    if isinstance(v, dict):
        if not v:
            return draw(st.sampled_from([[], None, {"": 0}]))
        k = draw(st.sampled_from(sorted(v, key=str)))
        return draw(st.sampled_from([{a: b for a, b in v.items() if a != k}, list(v.items()), [v], dict(v, **{k + "_": v[k]})]))
    return draw(hostile_values())


@st.composite
def mutated_doc(draw, doc, max_ops: int = 3, min_ops: int = 0):
    """``doc`` (a JSON document) after up to ``max_ops`` structured mutations: a field set to a
    hostile value, nudged, deleted, duplicated, renamed, an unknown field added. Returns the
    document and how many mutations were applied."""
    doc = _copy(doc)
    n = draw(st.integers(min_ops, max_ops))
    for _ in range(n):
        paths = list(_paths(doc))
        if not paths:
            doc = draw(hostile_values())
            continue
        parent, key = paths[draw(st.integers(0, len(paths) - 1))]
        op = draw(st.sampled_from(["set", "tweak", "tweak", "delete", "add", "dup"]))
        if op == "set":
            parent[key] = draw(hostile_values())
        elif op == "tweak":
            parent[key] = _tweak(draw, parent[key])
        elif op == "delete":
            del parent[key]
        elif op == "add":
            if isinstance(parent, dict):
                parent[draw(st.sampled_from(["extra", "x", "grid", "chunks", "step_tables", "mode", "signed"]))] = draw(hostile_values())
            else:
                parent.insert(key, draw(hostile_values()))
        elif op == "dup" and isinstance(parent, list):
            parent.insert(key, _copy(parent[key]))
    return doc, n


def dump(doc) -> bytes:
    """JSON bytes of ``doc``, with :class:`Deep` values written nested (and NaN, as Python writes it)."""
    deep: dict[str, Deep] = {}

    def walk(v):
        if isinstance(v, Deep):
            token = f"\x00deep{len(deep)}\x00"
            deep[token] = v
            return token
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x) for x in v]
        return v

    text = json.dumps(walk(doc))
    for token, d in deep.items():
        opener, closer = (d.kind, "]") if d.kind == "[" else ('{"a":', "}")
        text = text.replace(json.dumps(token), opener * d.depth + "0" + closer * d.depth)
    return text.encode("utf-8", "surrogatepass")


@st.composite
def mutated_bytes(draw, data: bytes, max_ops: int = 2, min_ops: int = 0, pool: tuple = ()):
    """``data`` after byte-level mutations: bit flips, bytes set, spans deleted, inserted or
    repeated, a truncation, a splice from ``pool`` (other real streams)."""
    b = bytearray(data)
    n = draw(st.integers(min_ops, max_ops))
    for _ in range(n):
        op = draw(st.sampled_from(["flip", "flip", "set", "delete", "insert", "truncate", "repeat", "splice", "extend"]))
        i = draw(st.integers(0, max(0, len(b) - 1)))
        if op == "flip" and b:
            b[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and b:
            b[i] = draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF, ord("["), ord('"'), ord("{"), ord("9")]))
        elif op == "delete":
            del b[i:i + draw(st.integers(1, 16))]
        elif op == "insert":
            b[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif op == "truncate":
            del b[i:]
        elif op == "repeat":
            b[i:i] = b[i:i + draw(st.integers(1, 64))]
        elif op == "splice" and pool:
            other = draw(st.sampled_from(pool))
            j = draw(st.integers(0, max(0, len(other) - 1)))
            b[i:i + draw(st.integers(1, 64))] = other[j:j + draw(st.integers(1, 64))]
        elif op == "extend":
            b += draw(st.binary(min_size=1, max_size=32))
    return bytes(b), n


# --------------------------------------------------------------------------- spec checks of accepted input


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


MANIFEST_KEYS = {"kind", "model", "version", "fingerprint", "base_version", "base_fingerprint", "anchor_version",
                 "base_manifests", "created_unix", "blobs", "tensors", "step_tables", "format", "format_version"}
TENSOR_KEYS = {"name", "dtype", "shape", "nnz", "fingerprint", "base_fingerprint", "blob", "offset", "sha256",
               "positions", "values", "grid", "chunks"}
CHUNK_KEYS = {"cell", "nnz", "blob", "offset", "sha256", "positions", "values"}


def manifest_spec_errors(doc) -> list[str]:
    """What in an accepted manifest's JSON breaks docs/FORMAT.md (independent of the parser; the
    rules the parser's own ``validate`` states are re-checked only where cheap)."""
    out = []
    if not isinstance(doc, dict):
        return ["not an object"]
    if not set(doc) <= MANIFEST_KEYS:
        out.append(f"unknown fields {sorted(set(doc) - MANIFEST_KEYS)}")
    kind, version = doc.get("kind"), doc.get("version")
    if kind not in (DELTA, ANCHOR):
        out.append("kind")
    if not isinstance(doc.get("model"), str):
        out.append("model is not a string")
    if not _int(version) or version < 0:
        out.append("version")
    if not (isinstance(doc.get("fingerprint"), str) and HEX16.fullmatch(doc["fingerprint"])):
        out.append("fingerprint is not 16 lower-case hex digits")
    bfp = doc.get("base_fingerprint")
    if kind == DELTA and not (isinstance(bfp, str) and HEX16.fullmatch(bfp)):
        out.append("base_fingerprint of a delta")
    if kind == ANCHOR and bfp is not None and not (isinstance(bfp, str) and HEX16.fullmatch(bfp)):
        out.append("base_fingerprint of an anchor is neither null nor a fingerprint")
    av = doc.get("anchor_version")
    if av is not None and not (_int(av) and 0 <= av <= (version if _int(version) else av)):
        out.append("anchor_version is neither null nor a version at or before this one")
    if "created_unix" in doc and not _num(doc["created_unix"]):
        out.append("created_unix is not a number")
    if doc.get("format") != FORMAT or not _int(doc.get("format_version")) or doc["format_version"] not in READABLE_VERSIONS:
        out.append("format")
    for b in doc.get("blobs", []):
        if not isinstance(b, dict) or not {"key", "size", "sha256"} <= set(b) <= {"key", "size", "sha256", "digest"}:
            out.append("a blob is not an object of key, size, sha256 (and digest)")
        elif "digest" in b and (b["digest"] != "pieces" or not _int(doc.get("format_version")) or doc["format_version"] < 8):
            out.append("a blob's digest is 'pieces', from format 8")
    tensors = doc.get("tensors")
    if not isinstance(tensors, list):
        return out + ["tensors"]
    for t in tensors:
        if not isinstance(t, dict) or not set(t) <= TENSOR_KEYS:
            out.append("a tensor is not an object of the known fields")
            continue
        if not (isinstance(t.get("fingerprint"), str) and HEX16.fullmatch(t["fingerprint"])):
            out.append(f"tensor fingerprint {str(t.get('fingerprint'))[:40]!r}")
        tb = t.get("base_fingerprint")
        if (kind == DELTA or tb is not None) and not (isinstance(tb, str) and HEX16.fullmatch(tb)):
            out.append(f"tensor base_fingerprint {str(tb)[:40]!r}")
        for seg in ("positions", "values"):
            s = t.get(seg, {})
            if not isinstance(s, dict) or not set(s) <= {"coder", "length", "mode"}:
                out.append(f"tensor {seg} is not an object of coder, length, mode")
        for c in t.get("chunks") or []:
            if not isinstance(c, dict) or not set(c) <= CHUNK_KEYS:
                out.append("a chunk is not an object of the known fields")
            else:
                for seg in ("positions", "values"):
                    if not isinstance(c.get(seg), dict) or not set(c[seg]) <= {"coder", "length", "mode"}:
                        out.append(f"chunk {seg} is not an object of coder, length, mode")
    return out


def check_decoded(m: Manifest, decoded: list, selection) -> None:
    """What a rank hands its apply: per tensor, sorted unique positions inside the tensor (inside the
    selected cells), as many values of the tensor's width, never more changes than declared."""
    entries = {t.name: t for t in m.tensors}
    seen: dict[str, int] = {}
    for td in decoded:
        t = entries.get(td.name)
        if t is None or (selection is not None and td.name not in selection):
            raise Violation(f"decoded a tensor nobody asked for: {td.name!r}")
        if td.dtype is not BY_NAME[t.dtype] or tuple(td.shape) != tuple(t.shape) or td.mode not in ("abs", "rel"):
            raise Violation(f"{td.name}: decoded as {td.dtype.name}{td.shape} {td.mode}")
        if td.values.dtype != td.dtype.int_view or td.values.dim() != 1:
            raise Violation(f"{td.name}: values of {td.values.dtype}")
        if td.positions is None:
            if td.values.numel() != t.numel or t.nnz != t.numel:
                raise Violation(f"{td.name}: dense values of the wrong count")
            seen[td.name] = seen.get(td.name, 0) + t.numel
            continue
        p = td.positions
        if p.dtype != torch.int64 or p.numel() != td.values.numel():
            raise Violation(f"{td.name}: {p.numel()} positions, {td.values.numel()} values")
        if p.numel() and (int(p.min()) < 0 or int(p.max()) >= t.numel or bool((p[1:] <= p[:-1]).any())):
            raise Violation(f"{td.name}: positions not sorted, unique and inside the tensor")
        if t.chunks is not None and selection is not None and selection.get(td.name) is not None and p.numel():
            boxes = t.boxes()
            allowed = [boxes[c.cell] for c in t.chunks if c.cell in selection[td.name]]
            coords = np.stack(np.unravel_index(p.numpy(), tuple(t.shape)), axis=1)
            inside = np.zeros(len(coords), bool)
            for lo, hi in allowed:
                inside |= np.all((coords >= np.array(lo)) & (coords < np.array(hi)), axis=1)
            if not inside.all():
                raise Violation(f"{td.name}: positions outside the selected cells")
        seen[td.name] = seen.get(td.name, 0) + p.numel()
    for name, n in seen.items():
        if n > entries[name].nnz:
            raise Violation(f"{name}: {n} changes decoded, the manifest declares {entries[name].nnz}")


def latest_spec_errors(lt: Latest) -> list[str]:
    out = []
    if not _int(lt.version) or lt.version < 0:
        out.append("version")
    if not (isinstance(lt.manifest, str) and KEY.fullmatch(lt.manifest) and not lt.manifest.startswith(".")):
        out.append("manifest key")
    if not (isinstance(lt.fingerprint, str) and HEX16.fullmatch(lt.fingerprint)):
        out.append(f"fingerprint {str(lt.fingerprint)[:40]!r}")
    if lt.anchor_version is not None and not (_int(lt.anchor_version) and 0 <= lt.anchor_version <= lt.version):
        out.append(f"anchor_version {str(lt.anchor_version)[:40]!r}")
    if lt.sha256 is not None and not (isinstance(lt.sha256, str) and SHA.fullmatch(lt.sha256)):
        out.append("sha256")
    if lt.expires_unix is not None and not (_num(lt.expires_unix) and math.isfinite(lt.expires_unix)):
        out.append(f"expires_unix {lt.expires_unix!r:.40}")
    return out


def checkpoint_spec_errors(ck: CheckpointDir) -> list[str]:
    out = []
    for name, info in ck.tensors.items():
        if not isinstance(name, str) or info.dtype not in BY_SAFETENSORS.values():
            out.append(f"{name!r:.40}: dtype")
        if not (isinstance(info.shape, tuple) and all(_int(s) and s >= 0 for s in info.shape)):
            out.append(f"{name!r:.40}: shape {info.shape!r:.60}")
    return out
