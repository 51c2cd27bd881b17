"""Fuzz targets for everything a server parses from a hostile store or caller (issue 30, item 2).

Each :class:`Target` drives one entry point a server uses, with a hypothesis strategy that
starts from real encoded data (a store published by :class:`DeltaPublisher`, streams from
the real encoders, a real signed ``LATEST``) and mutates it: field by field, byte by byte,
truncated, with huge declared sizes, nested past the recursion limit. The oracle allows two
outcomes only, an accepted valid input (checked against the spec, independently of the
parser) or the documented refusal (the :mod:`engine_ext.errors` class of docs/SECURITY.md
and docs/vllm.md, with its HTTP status and a short message). Every example is timed and its
allocations measured (tracemalloc's peak for Python and numpy, the peak resident set for
native code), each against a bound. The oracle and the mutators are ``tests/fuzz_oracle.py``,
the real data ``tests/fuzz_corpus.py``. ``tests/test_fuzz.py`` runs a fixed budget of every
target in CI; ``stress/fuzz_campaign.py`` runs them for minutes.

Where an entry point needs the rest of a server, the real parts run: a :class:`LocalStore`
over a directory, :class:`TensorBases` holding the base weights a rank would hold, the real
``post_answer`` with a real :class:`Auth`. The one stand-in is the controller behind
``post_answer`` (:class:`_RecordingController`): the update itself is out of scope here
(tests/test_hostile.py runs it); what is fuzzed is the body's parsing and status mapping.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import math
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from hypothesis import strategies as st

from engine_ext.errors import (BaseMismatchError, IntegrityError, ManifestError, ModelMismatchError, NotFoundError,
                               PartlyHeldError, SourceError)
from engine_ext.format import chunks, codec
from engine_ext.format.context import blocks as cb, codec as cc, models as cm
from engine_ext.format import fingerprint as fpr
from engine_ext.format.delta import apply_tensor
from engine_ext.format.dtypes import BY_NAME, as_bits
from engine_ext.format.latest import Latest
from engine_ext.format.manifest import ANCHOR, DELTA, MAX_MANIFEST_BYTES, Manifest
from engine_ext.server.controller import Auth
from engine_ext.server.http import post_answer
from engine_ext.server.protocol import MAX_BODY_BYTES, PAUSE_MODES, RequestError, UpdateRequest
from engine_ext.store import decoding, reader
from engine_ext.store.checkpoint import CheckpointDir, read_header
from engine_ext.store.local import LocalStore
from engine_ext.store.signing import MAX_SIGNATURE_BYTES, SignatureError, Trust, key_id

from fuzz_corpus import NOW, Corpus, corpus, safetensors_sample, signer, trust_of, v2_pool
from fuzz_oracle import (MAX_MESSAGE, Violation, _copy, _int, check_decoded, checkpoint_spec_errors, dump, judge,
                         latest_spec_errors, manifest_spec_errors, meter, mutated_bytes, mutated_doc)


# ---- the registry --------------------------------------------------------------------------------


@dataclass
class Target:
    """One entry point: ``strategy`` draws an input, ``check(input)`` runs it through the entry point
    under :func:`judge` and raises :class:`Violation` on any outcome the contract does not allow."""

    name: str
    entry: str  # the entry point(s), for the reports
    strategy: Callable[[], st.SearchStrategy]
    check: Callable[[Any], None]
    examples: int  # CI budget


TARGETS: dict[str, Target] = {}


def target(name: str, entry: str, examples: int):
    def register(fn):
        strategy = globals()[f"_{name}_inputs"]
        TARGETS[name] = Target(name, entry, strategy, fn, examples)
        return fn

    return register


# ---- manifest JSON, through what a driver and a rank do with it ----------------------------------


@dataclass
class ManifestCase:
    source: str  # which manifest of the corpus
    doc_ops: int
    doc: Any
    byte_ops: int
    raw: bytes | None  # after byte mutations (None: dump(doc))
    reseal: bool  # recompute model fingerprints and hashes after the mutations (a signer that lies)
    blob_edits: list  # (blob index, part index, offset in part, xor byte) in-place edits of a part's bytes
    select: int  # 0: every tensor; else a bitmask of the tensors and cells a rank holds
    bases: str  # "right", "wrong", "none"

    @property
    def pristine(self) -> bool:
        return not (self.doc_ops or self.byte_ops or self.blob_edits)


@st.composite
def _manifest_inputs(draw):
    c = corpus()
    source = draw(st.sampled_from(sorted(c.manifests)))
    doc, k = draw(consistent_mutations(c.manifest_doc(source)))
    doc, n = draw(mutated_doc(doc, max_ops=draw(st.sampled_from([0, 1, 1, 2, 3]))))
    n += k
    byte_ops, raw = 0, None
    if draw(st.integers(0, 9)) == 0:
        raw, byte_ops = draw(mutated_bytes(dump(doc), max_ops=2, min_ops=1))
    edits = []
    if draw(st.integers(0, 3)) == 0:
        for _ in range(draw(st.integers(1, 3))):
            edits.append((draw(st.integers(0, 2**16)), draw(st.integers(0, 2**16)), draw(st.integers(1, 255))))
    return ManifestCase(source, n, doc, byte_ops, raw, draw(st.booleans()), edits, draw(st.integers(0, 2**12)),
                        draw(st.sampled_from(["right", "right", "right", "wrong", "none"])))


@st.composite
def consistent_mutations(draw, doc: dict):
    """Mutations of a manifest's parts that its own rules cannot see, so that they reach the
    decoders through the whole path: a declared count off (and the tensor's total with it), the
    boundary between positions and values bytes moved, coders or the value mode swapped, cells
    renumbered, a grid's cut moved, a step table replaced by another valid one. Returns the document and how many were applied."""
    n = draw(st.integers(0, 3))
    tensors = [t for t in doc["tensors"] if t["nnz"]]
    for _ in range(n):
        t = draw(st.sampled_from(tensors))
        e = draw(st.sampled_from(t["chunks"])) if t.get("chunks") else t
        op = draw(st.sampled_from(["nnz", "nnz", "split", "coder", "mode", "cell", "grid", "tables"]))
        if op == "nnz":
            d = draw(st.sampled_from([-2, -1, 1, 2, 64, 2**20, -e["nnz"] + 1]))
            e["nnz"] += d
            if e is not t:
                t["nnz"] += d
        elif op == "split":
            d = draw(st.integers(-8, 8))
            e["positions"]["length"] += d
            e["values"]["length"] -= d
        elif op == "coder":
            pc, vc = draw(st.sampled_from([("pco", "pco"), ("zstd", "zstd"), ("pco", "zstd"), ("zstd", "raw"),
                                           ("pco", "raw"), ("ctx", "ctx"), ("all", "raw")]))
            e["positions"]["coder"], e["values"]["coder"] = pc, vc
        elif op == "mode":
            e["values"]["mode"] = "abs" if e["values"]["mode"] == "rel" else "rel"
        elif op == "cell" and t.get("chunks"):
            a, b = draw(st.sampled_from(t["chunks"])), draw(st.sampled_from(t["chunks"]))
            a["cell"], b["cell"] = b["cell"], a["cell"]
        elif op == "grid" and t.get("grid"):  # an inner cut moved: the cells' boxes change under their bytes
            cuts = draw(st.sampled_from(t["grid"]))
            if len(cuts) > 2:
                i = draw(st.integers(1, len(cuts) - 2))
                cuts[i] = max(cuts[i - 1] + 1, min(cuts[i + 1] - 1, cuts[i] + draw(st.sampled_from([-3, -1, 1, 3]))))
        elif op == "tables" and doc.get("step_tables"):  # other valid step tables: the steps decode otherwise
            dtype = draw(st.sampled_from(sorted(doc["step_tables"])))
            tables = doc["step_tables"][dtype]
            i = draw(st.integers(0, len(tables) - 1))
            tables[i] = bytes(draw(st.lists(st.integers(1, 255), min_size=len(tables[i]) // 2,
                                            max_size=len(tables[i]) // 2))).hex()
    return doc, n


def _parts_of(doc) -> list[dict]:
    """The entries (tensors or chunks) of a manifest document that carry bytes."""
    out = []
    tensors = doc.get("tensors") if isinstance(doc, dict) else None
    for t in tensors if isinstance(tensors, list) else []:
        if not isinstance(t, dict):
            continue
        if isinstance(t.get("chunks"), list):
            out += [ch for ch in t["chunks"] if isinstance(ch, dict)]
        elif _int(t.get("blob")):
            out.append(t)
    return out


def _segment_len(e: dict) -> int:
    try:
        return int(e["positions"]["length"]) + int(e["values"]["length"])
    except (KeyError, TypeError, ValueError):
        return 0


def _materialize(case: ManifestCase, c: Corpus) -> tuple[bytes, set]:
    """The manifest bytes (the blobs it names written to the scratch store), and the bytes changed
    behind the manifest's back, as (blob key, offset): unless resealed, its hashes refuse any part
    that covers one."""
    doc = _copy(case.doc)
    blobs_doc = doc.get("blobs") if isinstance(doc, dict) else None
    written, tampered = {}, set()
    if case.blob_edits and isinstance(blobs_doc, list) and blobs_doc:
        parts = _parts_of(doc)
        for bi, pi, xor in case.blob_edits:
            if not parts:
                break
            e = parts[pi % len(parts)]
            b = e.get("blob")
            if not (_int(b) and 0 <= b < len(blobs_doc) and isinstance(blobs_doc[b], dict)):
                continue
            key = blobs_doc[b].get("key")
            if not isinstance(key, str) or key not in c.blobs:
                continue
            data = bytearray(written.get(key, c.blobs[key]))
            off, n = e.get("offset"), _segment_len(e)
            if not (_int(off) and n > 0 and 0 <= off and off + n <= len(data)):
                continue
            data[off + bi % n] ^= xor
            written[key] = bytes(data)
            if case.reseal:
                e["sha256"] = hashlib.sha256(data[off:off + n]).hexdigest()
        for key, data in written.items():
            fz = "fz." + key
            changed = np.flatnonzero(np.frombuffer(data, np.uint8) != np.frombuffer(c.blobs[key], np.uint8))
            tampered |= {(fz, int(i)) for i in changed}  # two edits of one byte may cancel
            for bd in blobs_doc:
                if isinstance(bd, dict) and bd.get("key") == key:
                    bd["key"] = fz
                    if case.reseal:
                        bd["sha256"] = hashlib.sha256(data).hexdigest()
                        bd["size"] = len(data)
            (c.scratch / fz).write_bytes(data)
    if case.reseal and isinstance(doc, dict) and isinstance(doc.get("tensors"), list):
        _reseal_fingerprints(doc)
    raw = case.raw if case.raw is not None else dump(doc)
    return raw, set() if case.reseal else tampered


def _reseal_fingerprints(doc: dict) -> None:
    """Model fingerprints recomputed from the (mutated) tensor list, where it parses: mutations then
    reach past the model-fingerprint check, as a lying signer's would."""
    try:
        fps = [(t["name"], fpr.parse(t["fingerprint"])) for t in doc["tensors"]]
        doc["fingerprint"] = fpr.fmt(fpr.model_fingerprint(fps))
        if doc.get("kind") == DELTA:
            base = [(t["name"], fpr.parse(t["base_fingerprint"])) for t in doc["tensors"]]
            doc["base_fingerprint"] = fpr.fmt(fpr.model_fingerprint(base))
    except Exception:  # noqa: BLE001 - a tensor list too broken to reseal is left as it is
        pass


def _selection(m: Manifest, mask: int):
    if mask == 0:
        return None
    sel, bit = {}, 0
    for t in m.tensors:
        bit += 1
        if not mask >> (bit % 12) & 1:
            continue
        if t.chunks is None:
            sel[t.name] = None
        else:
            sel[t.name] = {i for i in range(len(t.boxes())) if mask >> ((bit + i) % 12) & 1}
    return sel


@target("manifest", "Manifest.from_json -> check_expected, check_decode_budget -> fetch_selected (a rank's fetch and decode, "
        "v1 and v2 streams, cells, anchors) from a LocalStore", examples=600)
def check_manifest(case: ManifestCase) -> None:
    c = corpus()
    _kernels_loaded()
    raw, tampered = _materialize(case, c)
    store = LocalStore(str(c.scratch))
    bases = {"right": decoding.TensorBases(c.a), "wrong": decoding.TensorBases(c.b), "none": None}[case.bases]
    model_bytes = sum(t.numel() * t.element_size() for t in c.a.values())
    state = {}

    def run():
        m = Manifest.from_json(raw)
        errors = manifest_spec_errors(json.loads(raw))
        if errors:
            raise Violation(f"accepted a manifest that breaks the spec: {errors[:3]}")
        state["m"] = m
        reader.check_expected(m, c.expected, "fuzz")
        reader.check_decode_budget(m, 8 * model_bytes)
        sel = _selection(m, case.select)
        decoded, _ = reader.fetch_selected(store, m, sel, workers=2, bases=bases)
        check_decoded(m, decoded, sel)
        return m, sel, decoded

    out, exc = judge(run, (ManifestError, IntegrityError, BaseMismatchError, ModelMismatchError, NotFoundError), 5.0,
                     64 * len(raw) + (48 << 20), "manifest")
    if case.pristine and case.bases == "right":
        if exc is not None:
            raise Violation(f"a genuine manifest refused: {type(exc).__name__}: {exc}")
        m, sel, decoded = out
        _check_round_trip(m, decoded, sel, c)
    if tampered and exc is None:
        m, sel, decoded = out
        parts = reader.plan(m, sel)
        for row, (blob, offset, length) in zip(parts.rows.tolist(), parts.ranges()):
            key = m.blobs[blob].key
            if any(k == key and offset <= o < offset + length for k, o in tampered):
                name = m.columns().names[row]
                raise Violation(f"tensor {name!r}: bytes changed behind the manifest's hashes were decoded")


def _check_round_trip(m: Manifest, decoded: list, sel, c: Corpus) -> None:
    """A genuine version decodes to exactly its weights (where a rank holds whole tensors)."""
    want = c.b if m.version == 1 else c.a
    by_name: dict[str, list] = {}
    for td in decoded:
        by_name.setdefault(td.name, []).append(td)
    for name, tds in by_name.items():
        if sel is not None and sel.get(name) is not None:
            continue  # some cells only
        out = None if m.kind == ANCHOR else c.a[name]
        for td in tds:
            out = apply_tensor(out, td, check=False)
        if not torch.equal(as_bits(out).reshape(-1), as_bits(want[name]).reshape(-1)):
            raise Violation(f"{name}: a genuine version decoded to other bits")


# ---- signatures: read_link on hostile .sig objects -----------------------------------------------


@dataclass
class SigCase:
    trust: str
    sig: bytes | None  # the .sig object (None: absent)
    manifest_ops: int
    raw: bytes


@st.composite
def _signature_inputs(draw):
    c = corpus()
    raw = c.manifests[draw(st.sampled_from(["ctx/v1", "plain/v0"]))]
    other_raw = c.manifests["plain/v1"]
    manifest_ops = 0
    if draw(st.integers(0, 4)) == 0:
        raw, manifest_ops = draw(mutated_bytes(raw, max_ops=2, min_ops=1))
    trust = draw(st.sampled_from(["one", "one", "two", "one_or_unsigned", "unsigned", "none"]))
    pub, oth = signer(c.key), signer(c.other)
    entries = []
    for _ in range(draw(st.integers(0, 3))):
        who = draw(st.sampled_from(["pub", "pub", "other", "replay", "junk"]))
        if who == "pub":
            entries += pub.signatures(raw)
        elif who == "other":
            entries += oth.signatures(raw)
        elif who == "replay":  # a genuine signature of another manifest
            entries += pub.signatures(other_raw)
        else:
            entries.append({"keyid": key_id(b"\x00" * 32), "sig": "00" * 64})
    doc = {"signatures": entries}
    if draw(st.booleans()):
        doc, _ = draw(mutated_doc(doc, max_ops=3, min_ops=1))
    sig = dump(doc)
    choice = draw(st.integers(0, 9))
    if choice == 0:
        sig = None
    elif choice == 1:
        sig, _ = draw(mutated_bytes(sig, max_ops=3, min_ops=1))
    elif choice == 2:
        sig = sig[:1] + b" " * MAX_SIGNATURE_BYTES + sig[1:]  # over the size limit
    return SigCase(trust, sig, manifest_ops, raw)


def _reference_signed(t: Trust, raw: bytes, sig: bytes | None) -> tuple[str, int]:
    """What the signature rules (docs/SECURITY.md, FORMAT.md "Signatures") say of ``raw`` with the
    ``.sig`` object ``sig``: ("ok", signed keys), ("unsigned", 0), ("refused", 0), ("too_large", 0);
    computed with the cryptography library directly."""
    from cryptography.exceptions import InvalidSignature

    if not t.keys:
        return ("unsigned", 0) if t.allow_unsigned else ("refused", 0)
    if sig is not None and len(sig) > MAX_SIGNATURE_BYTES:
        return "too_large", 0
    signatures = None
    if sig is not None:
        try:
            doc = json.loads(sig)
            signatures = doc["signatures"]
        except Exception:  # noqa: BLE001
            return "refused", 0
        if not isinstance(signatures, list):
            return "refused", 0
    good = set()
    for s in signatures or []:
        if isinstance(s, dict) and isinstance(s.get("keyid"), str) and isinstance(s.get("sig"), str) and s["keyid"] in t.keys:
            try:
                t.keys[s["keyid"]].verify(bytes.fromhex(s["sig"]), raw)
                good.add(s["keyid"])
            except (InvalidSignature, ValueError):
                pass
    if len(good) >= t.threshold:
        return "ok", len(good)
    if not signatures and t.allow_unsigned:
        return "unsigned", 0
    return "refused", 0


@target("signature", "reader.read_link (Trust.verify_detached on the .sig object, then Manifest.from_json)", examples=300)
def check_signature(case: SigCase) -> None:
    c = corpus()
    d = c.root / "sig"
    d.mkdir(exist_ok=True)
    (d / "v00000001.json").write_bytes(case.raw)
    sig_path = d / "v00000001.json.sig"
    if case.sig is None:
        sig_path.unlink(missing_ok=True)
    else:
        sig_path.write_bytes(case.sig)
    t = trust_of(c, case.trust)
    want, n = _reference_signed(t, case.raw, case.sig)
    link, exc = judge(lambda: reader.read_link(LocalStore(str(d)), "v00000001.json", t),
                      (SignatureError, ManifestError, SourceError), 2.0,
                      MAX_MANIFEST_BYTES + MAX_SIGNATURE_BYTES + 32 * len(case.raw) + (16 << 20), "signature")
    if want == "too_large":
        if not (isinstance(exc, SourceError) and not isinstance(exc, NotFoundError)):
            raise Violation(f"an oversized .sig object gave {exc!r:.200}")
        return
    if want == "refused":
        if not isinstance(exc, SignatureError):
            raise Violation(f"a manifest without {t.threshold} valid trusted signature(s) gave {exc!r:.200}"
                            + ("" if exc else ": ACCEPTED"))
        return
    if isinstance(exc, SignatureError):
        raise Violation(f"signatures that verify were refused: {exc}")
    if exc is None and link.signed != n:
        raise Violation(f"read_link counts {link.signed} signatures, the reference {n}")
    if case.manifest_ops == 0 and exc is not None:
        raise Violation(f"a genuine signed manifest refused: {exc!r:.200}")


# ---- LATEST: Latest.from_json and read_latest ----------------------------------------------------


@dataclass
class LatestCase:
    raw: bytes
    trust: str
    allow_expired: bool
    ops: int


@st.composite
def _latest_inputs(draw):
    c = corpus()
    raw_manifest = c.manifests["ctx/v1"]
    m = json.loads(raw_manifest)
    now = NOW
    signed = {"version": 1, "manifest": "v00000001.json", "fingerprint": m["fingerprint"], "anchor_version": 0,
              "sha256": hashlib.sha256(raw_manifest).hexdigest(),
              "expires_unix": draw(st.sampled_from([now + 3600, now - 3600, now + 1e9]))}
    signed, ops = draw(mutated_doc(signed, max_ops=3))
    sigs = []
    how = draw(st.sampled_from(["resign", "resign", "keep", "other", "none"]))
    try:
        lt = Latest(**signed)
        canon = lt.signed_bytes()
    except Exception:  # noqa: BLE001 - fields a Latest cannot hold: sign their canonical JSON anyway
        canon = json.dumps(signed, sort_keys=True, separators=(",", ":"), default=str).encode()
    if how == "resign":  # a signer that signs whatever it is given: field checks must still hold
        sigs = signer(c.key).signatures(canon)
    elif how == "keep":  # the genuine pointer's signature
        sigs = signer(c.key).signatures(Latest(1, "v00000001.json", m["fingerprint"], 0,
                                               hashlib.sha256(raw_manifest).hexdigest(), now + 3600).signed_bytes())
    elif how == "other":
        sigs = signer(c.other).signatures(canon)
    outer = {"signed": signed, "signatures": sigs}
    form = draw(st.integers(0, 9))
    if form == 0:
        outer = signed  # a format-1 pointer
    elif form == 1:
        outer, n = draw(mutated_doc(outer, max_ops=2, min_ops=1))
        ops += n
    raw = dump(outer)
    if draw(st.integers(0, 7)) == 0:
        raw, n = draw(mutated_bytes(raw, max_ops=2, min_ops=1))
        ops += n
    return LatestCase(raw, draw(st.sampled_from(["one", "one", "two", "one_or_unsigned", "unsigned"])), draw(st.booleans()), ops)


@target("latest", "Latest.from_json and reader.read_latest (signature, expiry, binding)", examples=300)
def check_latest(case: LatestCase) -> None:
    c = corpus()
    d = c.root / "latest"
    d.mkdir(exist_ok=True)
    (d / "LATEST").write_bytes(case.raw)
    t = trust_of(c, case.trust)
    parsed, exc = judge(lambda: Latest.from_json(case.raw), (ManifestError,), 1.0, 64 * len(case.raw) + (8 << 20),
                        "Latest.from_json")
    if exc is None:
        lt, sigs = parsed
        errors = latest_spec_errors(lt)
        if errors:
            raise Violation(f"accepted a LATEST that breaks the spec: {errors}")
    lt2, exc2 = judge(lambda: reader.read_latest(LocalStore(str(d)), t, case.allow_expired),
                      (ManifestError, SignatureError, SourceError), 2.0, 64 * len(case.raw) + (8 << 20), "read_latest")
    if (exc is None) != (exc2 is None) and not isinstance(exc2, SignatureError):
        raise Violation(f"read_latest and Latest.from_json disagree: {exc!r:.100} / {exc2!r:.100}")
    if exc2 is None:
        lt, sigs = parsed
        want, n = _reference_signed(t, lt.signed_bytes(), json.dumps({"signatures": sigs}).encode())
        if want == "refused":
            raise Violation("read_latest accepted a pointer without the trusted signatures")
        if want == "ok":
            if lt.sha256 is None:
                raise Violation("read_latest accepted a signed pointer that does not name its manifest by SHA-256")
            if lt.expires_unix is None or (lt.expires_unix < time.time() and not case.allow_expired):
                raise Violation("read_latest accepted an expired pointer")


# ---- grids of cells ------------------------------------------------------------------------------


@st.composite
def _grid_inputs(draw):
    shape = draw(st.lists(st.integers(0, 70), min_size=0, max_size=4))
    how = draw(st.integers(0, 3))
    if how == 0 and shape:
        cuts = chunks.grid(shape, min_cell=draw(st.sampled_from([1, 4, 64])), parts=draw(st.sampled_from([2, 4, 8]))) or []
    elif how == 1:
        cuts = [sorted(set(draw(st.lists(st.integers(0, n), max_size=6))) | {0, n}) for n in shape[:draw(st.integers(0, 3))]]
    else:
        cuts = draw(st.lists(st.lists(st.integers(-2, 80), max_size=6), max_size=3))
    cuts, _ = draw(mutated_doc(cuts, max_ops=draw(st.sampled_from([0, 0, 1, 2]))))
    return cuts, shape


def _reference_valid_cuts(cuts, shape) -> bool:
    if not isinstance(cuts, list) or not 1 <= len(cuts) <= min(2, len(shape)):
        return False
    for d, c in enumerate(cuts):
        if not isinstance(c, list) or not 2 <= len(c) <= 257 or not all(_int(x) for x in c):
            return False
        if c[0] != 0 or c[-1] != shape[d] or any(b <= a for a, b in zip(c, c[1:])):
            return False
    return True


@target("grid", "chunks.valid_cuts, boxes, split/to_local/to_global (format 3 grids of a manifest)", examples=500)
def check_grid(case) -> None:
    cuts, shape = case
    ok, _ = judge(lambda: chunks.valid_cuts(cuts, shape), (), 0.5, 1 << 20, "valid_cuts")
    if ok is not _reference_valid_cuts(cuts, shape):
        raise Violation(f"valid_cuts({str(cuts)[:100]}, {shape}) = {ok}")
    if not ok:
        return
    numel = math.prod(shape)
    boxes = chunks.boxes(cuts, shape)
    if len(boxes) != math.prod(len(c) - 1 for c in cuts) or sum(chunks.box_numel(b) for b in boxes) != numel:
        raise Violation("the cells do not tile the tensor")
    if numel and numel <= 4096:
        pos = np.arange(numel, dtype=np.int64)[::3]
        for cell, idx in chunks.split(pos, shape, cuts):
            local = chunks.to_local(pos[idx], shape, boxes[cell])
            back = chunks.to_global(torch.from_numpy(local), shape, boxes[cell]).numpy()
            if not np.array_equal(back, pos[idx]) or (local < 0).any() or (local >= chunks.box_numel(boxes[cell])).any():
                raise Violation("cell-local positions do not map back")


# ---- v1 streams: codec.decode_positions / decode_values ------------------------------------------


@dataclass
class StreamCase:
    kind: str  # "positions" or "values"
    coder: str
    data: bytes
    nnz: int
    numel: int
    dtype: str
    truth: Any  # the decoded truth when data and counts are as encoded
    pristine: bool


@st.composite
def _v1_streams_inputs(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["positions", "values"]))
    nnz = draw(st.sampled_from([0, 1, 2, 3, 17, 100, 1000, 5000]))
    if kind == "positions":
        numel = max(nnz, draw(st.sampled_from([1, 2, 100, 4096, 70_000, 2**32 + 5, 2**40])))
        pos = np.unique(rng.integers(0, numel, size=nnz, dtype=np.int64)) if numel > 4 * nnz else \
            np.sort(rng.choice(numel, size=nnz, replace=False)).astype(np.int64)
        nnz = pos.size
        gaps = np.diff(pos, prepend=np.int64(0)).astype(codec._gap_dtype(numel))
        coder = draw(st.sampled_from(["pco", "zstd", "all"]))
        data = {"pco": lambda: codec._pco(gaps), "zstd": lambda: codec._zstd(gaps.tobytes()), "all": lambda: b""}[coder]()
        if coder == "all":
            nnz = numel = min(numel, 5000)
        truth, dtype = (None if coder == "all" else pos), "int64"
    else:
        dtype = draw(st.sampled_from(sorted(BY_NAME)))
        dt = BY_NAME[dtype]
        vals = rng.integers(-2**(dt.bits - 1), 2**(dt.bits - 1), size=nnz, dtype=np.int64).astype(codec._NP_INT[dt.bits])
        coder = draw(st.sampled_from(["pco", "zstd", "raw"]))
        data = {"pco": lambda: codec._pco(codec._for_pco(vals)), "zstd": lambda: codec._zstd(codec._planes(vals)),
                "raw": lambda: vals.tobytes()}[coder]()
        numel, truth = nnz, vals
    pristine = True
    if draw(st.booleans()):
        data, n = draw(mutated_bytes(data, max_ops=3, min_ops=1))
        pristine = False
    declared = draw(st.sampled_from(["same", "same", "off", "huge", "zero"]))
    if declared != "same":
        pristine = False
        nnz = {"off": max(0, nnz + draw(st.sampled_from([-2, -1, 1, 2]))), "huge": draw(st.sampled_from([2**20, 2**22])),
               "zero": 0}[declared]
    if kind == "positions" and draw(st.integers(0, 5)) == 0:
        pristine = False
        numel = draw(st.sampled_from([max(1, numel // 2), numel + 1, 2**32 + 1, 1]))
    declared_coder = draw(st.sampled_from([coder] * 12 + ["lz4", "none", "ctx", "raw", "all"]))
    return StreamCase(kind, declared_coder, data, nnz, numel, dtype, truth, pristine and declared_coder == coder)


@functools.cache
def _kernels_loaded() -> None:
    """Run each numba kernel a reader's decode calls once, outside the meter: its first call per signature
    loads it from numba's cache or compiles it (seconds, ~25 MiB on a fresh clone), a one-time cost that is
    no input's; every case after is metered whole. codec_kernels: positions from uint32 and uint64 gaps,
    8-bit values; cell_kernels.place: values of each width."""
    from engine_ext.format import cell_kernels

    for numel in (1000, 2**33):
        codec.decode_positions(*codec.encode_positions(np.array([3, 10], np.int64), numel), 2, numel)
    codec.decode_values("pco", codec._pco(np.array([1, -2], np.int16)), 2, BY_NAME["float8_e4m3fn"])
    for dt in (np.int8, np.int16, np.int32, np.int64):
        cell_kernels.place((4, 4), [((0, 0), (2, 2)), ((0, 2), (2, 4))], [np.array([0, 3]), np.array([1])],
                           [np.zeros(2, dt), np.zeros(1, dt)])


@target("v1_streams", "codec.decode_positions / decode_values (pco, zstd, raw, all)", examples=800)
def check_v1_streams(case: StreamCase) -> None:
    _kernels_loaded()
    if case.kind == "positions":
        fn = lambda: codec.decode_positions(case.coder, case.data, case.nnz, case.numel)  # noqa: E731
    else:
        fn = lambda: codec.decode_values(case.coder, case.data, case.nnz, BY_NAME[case.dtype])  # noqa: E731
    width = 8 if case.kind == "positions" else BY_NAME[case.dtype].itemsize
    out, exc = judge(fn, (IntegrityError,), 2.0, 3 * case.nnz * max(width, 2) + 8 * len(case.data) + (8 << 20), f"v1 {case.kind}")
    if exc is not None:
        if case.pristine and _expected_coder(case):
            raise Violation(f"a genuine {case.coder} stream refused: {exc}")
        return
    if case.kind == "positions":
        if out is None:
            if case.coder != "all" or case.nnz != case.numel:
                raise Violation("'all' positions accepted for a partial count")
            return
        p = out.numpy()
        if out.dtype != torch.int64 or p.size != case.nnz or (p.size and (p[0] < 0 or p[-1] >= case.numel)) or (np.diff(p) <= 0).any():
            raise Violation(f"positions: {p.size} for {case.nnz} declared, or unsorted / out of range")
    else:
        dt = BY_NAME[case.dtype]
        if out.dtype != dt.int_view or out.numel() != case.nnz:
            raise Violation(f"values: {out.numel()} of {out.dtype} for {case.nnz} {dt.name}")
    if case.pristine and case.truth is not None and _expected_coder(case):
        got = out.numpy()
        if not np.array_equal(got, case.truth):
            raise Violation("a genuine stream decoded to other values")


def _expected_coder(case: StreamCase) -> bool:
    return case.coder in (("pco", "zstd", "all") if case.kind == "positions" else ("pco", "zstd", "raw"))


# ---- v2 streams: context.codec.decode ------------------------------------------------------------


@dataclass
class V2Case:
    i: int
    pos: bytes
    val: bytes
    nnz: int
    tables: list
    held: str  # "all", "none", "blocks" (a rank that holds some blocks), "wrong" (another base)
    blocks_mask: int
    pristine: bool


@st.composite
def _v2_streams_inputs(draw):
    pool = v2_pool()
    i = draw(st.integers(0, len(pool) - 1))
    p = pool[i]
    pos, val, pristine = p["e"].pos, p["e"].val, True
    streams = tuple(q["e"].pos for q in pool) + tuple(q["e"].val for q in pool)
    which = draw(st.sampled_from(["none", "pos", "val", "both", "header"]))
    if which in ("pos", "both"):
        pos, _ = draw(mutated_bytes(pos, max_ops=3, min_ops=1, pool=streams))
    if which in ("val", "both"):
        val, _ = draw(mutated_bytes(val, max_ops=3, min_ops=1, pool=streams))
    if which == "header":  # a field of the positions header rewritten (K, policy, edges, counts)
        b = bytearray(pos)
        at = draw(st.integers(2, min(len(b) - 1, 24)))
        b[at] = draw(st.sampled_from([0, 1, 2, 15, 16, 17, 0x1F, 0x20, 0x7F, 0x80, 0xFF]))
        pos = bytes(b)
    pristine = which == "none"
    nnz = p["pos"].size
    if draw(st.integers(0, 5)) == 0:
        nnz = draw(st.sampled_from([0, 1, nnz - 1, nnz + 1, 2**31, 2**40]))
        pristine = False
    tables = p["tables"]
    if draw(st.integers(0, 5)) == 0:
        A = cm.alphabet(p["dtype"])
        tables = [bytes(draw(st.lists(st.integers(1, 255), min_size=A, max_size=A)))
                  for _ in range(draw(st.integers(1, 4)))]
        pristine = False
    held = draw(st.sampled_from(["all", "all", "blocks", "none", "wrong"]))
    return V2Case(i, pos, val, nnz, tables, held, draw(st.integers(0, 2**16)), pristine)


@target("v2_streams", "context.codec.decode (positions header, ranks, steps, the pass over the base; "
        "a rank holding all, some or none of the blocks)", examples=500)
def check_v2_streams(case: V2Case) -> None:
    p = v2_pool()[case.i]
    shape, box, name = p["shape"], p["box"], p["dtype"]
    full = shape if box is None else tuple(b - a for a, b in zip(*box))
    base = p["base"]
    if case.held == "wrong":
        base = base.copy()
        base[::7] ^= base.dtype.type(1 << (8 * base.itemsize - 2))  # other exponents: ranks land elsewhere
    policy_blocks = cb.part_blocks(shape, box, p["e"].pos[3] if len(p["e"].pos) > 3 else 0)
    held_blocks = {b for b in range(policy_blocks.S) if case.blocks_mask >> (b % 16) & 1}

    def base_of(sub):
        if case.held == "none":
            return None
        if case.held == "blocks":
            whole = tuple(sub[0]) == (0,) * len(full) and tuple(sub[1]) == tuple(full)
            if whole and policy_blocks.S > 1:
                raise PartlyHeldError("some blocks")
            idx = [b for b, bx in enumerate(policy_blocks.boxes) if tuple(bx[0]) == tuple(sub[0]) and tuple(bx[1]) == tuple(sub[1])]
            if idx and idx[0] not in held_blocks:
                return None
        return cb.box_of(base, full, sub)

    out, exc = judge(lambda: cc.decode(cc.StoredPart(name, shape, box, case.pos, case.val, case.nnz, case.tables), base_of),
                     (IntegrityError,), 3.0, 48 * (base.size + min(case.nnz, 10 * base.size)) + 32 * (len(case.pos) + len(case.val)) + (16 << 20),
                     "v2 decode")
    if exc is not None:
        if case.pristine and case.held in ("all", "none", "blocks"):
            raise Violation(f"a genuine context-coded part refused: {exc}")
        return
    pos, steps = out
    n = int(np.prod(full))
    if pos.dtype != np.int64 or pos.size != steps.size or steps.dtype != cm.INT[cm.ITEMSIZE[name]]:
        raise Violation(f"decode gave {pos.size} {pos.dtype} positions and {steps.size} {steps.dtype} steps")
    if pos.size > max(case.nnz, 0) or (pos.size and (pos[0] < 0 or pos[-1] >= n)) or (np.diff(pos) <= 0).any():
        raise Violation("positions beyond the part, unsorted, repeated, or more than declared")
    if (steps == 0).any():
        raise Violation("a zero step decoded")
    if case.pristine:
        if case.held == "all" and not (np.array_equal(pos, p["pos"]) and np.array_equal(steps, p["steps"])):
            raise Violation("a genuine part decoded to other changes")
        if case.held == "none" and pos.size:
            raise Violation("changes decoded without a base")
        if case.held == "blocks":
            keep = np.isin(policy_blocks.block_of(p["pos"]), sorted(held_blocks))
            if not (np.array_equal(pos, p["pos"][keep]) and np.array_equal(steps, p["steps"][keep])):
                raise Violation("the held blocks of a genuine part decoded to other changes")


# ---- v2 positions header: parse_positions_header -------------------------------------------------


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        out.append((v & 0x7F) | (0x80 if v >= 0x80 else 0))
        v >>= 7
        if not out[-1] & 0x80:
            return bytes(out)


@st.composite
def _v2_header_inputs(draw):
    dtype = draw(st.sampled_from(sorted(cm.EXPONENT) + ["int8", "float64"]))
    numel = draw(st.sampled_from([1, 7, 100, 6144, 2**20, 2**40]))
    nnz = draw(st.integers(0, min(numel, 10_000)))
    K = draw(st.integers(0, 18))
    mask = cm.EXPONENT.get(dtype, (0, 0xFF))[1]
    edges = sorted(draw(st.sets(st.integers(0, mask + 2), min_size=max(0, K - 1), max_size=max(0, K - 1))))
    pops = draw(st.lists(st.integers(0, numel), min_size=K, max_size=K))
    if pops and draw(st.booleans()):
        pops[-1] = max(0, numel - sum(pops[:-1]))
    totals = [min(p, draw(st.integers(0, nnz))) for p in pops]
    if totals and draw(st.booleans()):
        totals[-1] = max(0, nnz - sum(totals[:-1]))
    head = b"X2" + bytes([K % 256, draw(st.integers(0, 40))]) + bytes(e % 256 for e in edges)
    head += b"".join(_varint(v) for v in pops + totals)
    if draw(st.integers(0, 5)) == 0:
        head += b"\xff" * draw(st.integers(1, 12)) + b"\x01"  # an overlong varint
    head += draw(st.binary(max_size=16))
    head, _ = draw(mutated_bytes(head, max_ops=draw(st.sampled_from([0, 0, 1, 2]))))
    return dtype, head, nnz, numel


@target("v2_header", "context.codec.parse_positions_header (classes, edges, populations, counts)", examples=500)
def check_v2_header(case) -> None:
    dtype, head, nnz, numel = case
    h, exc = judge(lambda: cc.parse_positions_header(head, nnz, numel, dtype), (IntegrityError,), 0.5, 4 << 20, "v2 header")
    if exc is None:
        mask = cm.EXPONENT[dtype][1]
        if not (1 <= h.K <= cc.MAX_CLASSES and len(h.edges) == h.K - 1 and all(0 < e <= mask for e in h.edges)
                and all(a < b for a, b in zip(h.edges, h.edges[1:])) and int(h.pops.sum()) == numel
                and int(h.totals.sum()) == nnz and (h.totals <= h.pops).all() and (h.totals >= 0).all()
                and h.policy <= cb.MAX_POLICY):
            raise Violation(f"accepted an inconsistent header: K={h.K} edges={h.edges} pops={h.pops} totals={h.totals}")


# ---- the safetensors header (anchor blobs, checkpoints) ------------------------------------------


@st.composite
def _safetensors_inputs(draw):
    data = safetensors_sample()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    rest = data[8 + n:]
    how = draw(st.sampled_from(["doc", "doc", "length", "bytes", "short"]))
    if how == "doc":
        header, _ = draw(mutated_doc(header, max_ops=3, min_ops=1))
        raw = dump(header)
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw + rest
    if how == "length":
        return struct.pack("<Q", draw(st.sampled_from([0, 1, n - 1, n + 1, n + 8, 100 << 20, (100 << 20) + 1, 2**63, 2**64 - 1])))\
            + data[8:]
    if how == "short":
        return data[:draw(st.integers(0, 12))]
    out, _ = draw(mutated_bytes(data[:8 + n + 64], max_ops=3, min_ops=1))
    return out


@target("safetensors", "store.checkpoint.read_header and CheckpointDir (a safetensors file's header: anchor blobs, "
        "checkpoints)", examples=400)
def check_safetensors(data: bytes) -> None:
    c = corpus()
    d = c.root / "ckpt"
    d.mkdir(exist_ok=True)
    path = d / "model.safetensors"
    path.write_bytes(data)
    header, exc = judge(lambda: read_header(path), (ValueError,), 1.0, 64 * len(data) + (8 << 20), "read_header")
    if exc is None and not isinstance(header, dict):
        raise Violation(f"read_header accepted a header that is a {type(header).__name__}")
    ck, exc = judge(lambda: CheckpointDir(d), (ValueError,), 1.0, 64 * len(data) + (8 << 20), "CheckpointDir")
    if exc is None:
        errors = checkpoint_spec_errors(ck)
        if errors:
            raise Violation(f"CheckpointDir accepted a header that breaks the format: {errors[:3]}")


# ---- the update routes' request body -------------------------------------------------------------


class _RecordingController:
    """The controller ``post_answer`` hands a parsed request to: records it and answers 200 (the
    update itself is tests/test_hostile.py's; here only the route's parsing and statuses)."""

    def __init__(self):
        self.requests = []

    async def update(self, req):
        self.requests.append(req)
        return {"ok": True, "version": 1}


TOKEN = "fuzz-token"


@st.composite
def _update_body_inputs(draw):
    body = {"url": draw(st.sampled_from(["/runs/a", "s3://bucket/run1", "http://127.0.0.1:1/x/v00000001.json"]))}
    for k, pool in (("base_version", [None, 0, 3, 2**70]), ("pause_mode", [None, *PAUSE_MODES]),
                    ("wait", [None, True, False]), ("rollback", [None, True, False])):
        if draw(st.booleans()):
            body[k] = draw(st.sampled_from(pool))
    body, ops = draw(mutated_doc(body, max_ops=3))
    raw = dump(body)
    form = draw(st.integers(0, 11))
    if form == 0:
        raw, _ = draw(mutated_bytes(raw, max_ops=3, min_ops=1))
    elif form == 1:
        raw = raw[:1] + b" " * MAX_BODY_BYTES + raw[1:]
    elif form == 2:
        raw = draw(st.sampled_from([b"", b"null", b"[]", b'"x"', b"\xef\xbb\xbf" + raw, raw.decode().encode("utf-16"),
                                    b"\xff\xfe", b"{" * 40000]))
    auth = draw(st.sampled_from([f"Bearer {TOKEN}"] * 6 + [f"bearer  {TOKEN} ", f"BEARER {TOKEN}", None, "", "Bearer",
                                                          f"Basic {TOKEN}", f"Bearer {TOKEN}x", "Bearer é\xff",
                                                          f"Bearer{TOKEN}"]))
    return raw, auth


def _reference_request(raw: bytes):
    """(accepted, fields) by the documented rules of the body (docs/vllm.md), without the parser."""
    if len(raw) > MAX_BODY_BYTES:
        return False, None
    try:
        body = json.loads(raw or b"")
    except (ValueError, RecursionError):
        return False, None
    types = {"url": str, "base_version": int, "pause_mode": str, "wait": bool, "rollback": bool}
    if not isinstance(body, dict) or not set(body) <= set(types):
        return False, None
    for k, v in body.items():
        if v is None and k != "url":
            continue
        if not isinstance(v, types[k]) or (types[k] is int and isinstance(v, bool)):
            return False, None
    if not body.get("url") or body.get("pause_mode") not in (None, *PAUSE_MODES):
        return False, None
    return True, {k: v for k, v in body.items() if v is not None}


def _reference_auth(authorization) -> bool:
    scheme, _, given = (authorization or "").strip().partition(" ")
    return scheme.lower() == "bearer" and given.strip() == TOKEN


_LOOP: asyncio.AbstractEventLoop | None = None


def _loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
    return _LOOP


@target("update_body", "UpdateRequest.parse and server.http.post_answer (the body and token of POST /update_weights_delta, "
        "shared by the vLLM and SGLang routes)", examples=500)
def check_update_body(case) -> None:
    raw, authorization = case
    want, fields = _reference_request(raw)
    req, exc = judge(lambda: UpdateRequest.parse(raw), (RequestError,), 0.5, 64 * len(raw) + (8 << 20), "UpdateRequest.parse")
    if (exc is None) != want:
        raise Violation(f"parse {'accepted' if exc is None else 'refused'} a body the rules {'refuse' if exc is None else 'accept'}: "
                        f"{raw[:120]!r} ({exc!r:.120})")
    if exc is None and {k: getattr(req, k) for k in fields} != fields:
        raise Violation(f"parse read {req} from {raw[:120]!r}")
    ctl = _RecordingController()

    async def read_body():
        return raw

    async def get_controller():
        return ctl

    answer, exc = judge(lambda: _loop().run_until_complete(post_answer(Auth((TOKEN,)), get_controller, authorization, read_body)),
                        (), 0.5, 64 * len(raw) + (8 << 20), "post_answer")
    status, body = answer
    expect = 401 if not _reference_auth(authorization) else 200 if want else 400
    if status != expect or (status != 200 and (body.get("ok") is not False or len(body.get("error", "")) > MAX_MESSAGE)):
        raise Violation(f"post_answer answered {status} {str(body)[:200]}, expected {expect}")
    if status == 200 and ctl.requests != [req]:
        raise Violation("post_answer handed the controller another request than the body's")


# ---- the vLLM route itself: the same bodies through the real router, in process (ASGI) -----------


@functools.lru_cache(maxsize=1)
def _vllm_app():
    """vLLM's update routes (the router the endpoint plugin attaches) on a bare FastAPI app, called in
    process through ASGI (no socket, no vLLM), with the recording controller behind them."""
    from fastapi import FastAPI

    from engine_ext.engines.vllm.endpoint import EndpointPlugin

    app = FastAPI()
    EndpointPlugin().attach_router(app)
    app.state.engine_ext, app.state.engine_ext_auth = _RecordingController(), Auth((TOKEN,))
    return app


async def _asgi_post(app, path: str, chunks: list, headers: list) -> tuple[int, bytes]:
    """One POST as an HTTP server hands it to the app: the body in the given chunks (made before the
    measurement, so that what is measured is the app's own holding of it)."""
    pending = list(chunks)
    sent = []

    async def receive():
        if not pending:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": pending.pop(0), "more_body": bool(pending)}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("fuzz", 80)}
    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@st.composite
def _update_route_inputs(draw):
    raw, auth = draw(_update_body_inputs())
    if draw(st.integers(0, 4)) == 0:  # a body far over the limit: the route must not hold it all
        raw = raw[:1] + b" " * draw(st.sampled_from([1 << 20, 8 << 20])) + raw[1:]
    return raw, auth


@target("update_route", "POST /update_weights_delta through vLLM's real router (ASGI, in process): the body as the "
        "route reads it", examples=200)
def check_update_route(case) -> None:
    from engine_ext.server.protocol import ROUTE

    raw, authorization = case
    app = _vllm_app()
    ctl = app.state.engine_ext
    ctl.requests.clear()
    headers = [] if authorization is None else [(b"authorization", authorization.encode("latin-1"))]
    chunks = [raw[i:i + (64 << 10)] for i in range(0, len(raw), 64 << 10)] or [b""]
    want, fields = _reference_request(raw)
    out, _ = judge(lambda: _loop().run_until_complete(_asgi_post(app, ROUTE, chunks, headers)), (), 2.0,
                   32 * MAX_BODY_BYTES + (4 << 20), "vLLM route")
    status, body = out[0], json.loads(out[1])
    expect = 401 if not _reference_auth(authorization) else 200 if want else 400
    if status != expect or (expect != 200 and body.get("ok") is not False):
        raise Violation(f"the route answered {status} {str(body)[:200]}, expected {expect}")
    if expect == 200 and [{k: getattr(q, k) for k in fields} for q in ctl.requests] != [fields]:
        raise Violation(f"the route handed the controller {ctl.requests}, the body says {fields}")


__all__ = ["TARGETS", "Target", "Violation", "corpus", "judge", "meter"]
