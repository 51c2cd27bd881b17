"""The parsers under fuzzing (issue 30): a fixed, deterministic budget of every target of
``tests/fuzz_targets.py`` in CI, and one explicit regression test per bug the fuzzers found.

Each target starts from real data (a signed store published by the real publisher, streams
from the real encoders) and mutates it; the only outcomes allowed are an accepted valid
input or the documented refusal, within a time and an allocation bound per example
(``fuzz_targets.judge``). ``derandomize=True``: every CI run tries the same inputs. The long
campaign, with its figures, is ``stress/fuzz_campaign.py`` (docs/RELIABILITY.md).
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings as hsettings

from fuzz_targets import TARGETS


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_fuzz_target(name):
    t = TARGETS[name]
    tried = 0

    @hsettings(max_examples=t.examples, derandomize=True, deadline=None, database=None,
               suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate, Phase.shrink])
    @given(t.strategy())
    def run(case):
        nonlocal tried
        tried += 1
        t.check(case)

    run()
    assert tried >= t.examples  # the budget is spent on inputs, not lost to rejected draws


# --------------------------------------------------------------------------- regressions: one per bug found

DEEP = b"[" * 5000 + b"]" * 5000  # 10 KB: inside every size limit, nested past Python's recursion limit


def test_regression_json_nested_past_the_recursion_limit_is_refused_as_documented():
    """json.loads raises RecursionError (not a ValueError) on deep nesting: every JSON parser let it
    escape (a 500 "internal" on the route) instead of its documented refusal."""
    import asyncio

    from engine_ext.errors import ManifestError
    from engine_ext.format.latest import Latest
    from engine_ext.format.manifest import Manifest
    from engine_ext.server.controller import Auth
    from engine_ext.server.http import post_answer
    from engine_ext.server.protocol import RequestError, UpdateRequest
    from engine_ext.store.signing import SignatureError, Trust

    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.from_json(DEEP)
    with pytest.raises(ManifestError, match="bad LATEST"):
        Latest.from_json(DEEP)
    with pytest.raises(RequestError, match="not valid JSON"):
        UpdateRequest.parse(DEEP)
    with pytest.raises(SignatureError, match="malformed signature"):
        Trust(allow_unsigned=True).verify_detached(b"{}", DEEP, "v1.json")

    async def body():
        return DEEP

    async def controller():
        raise AssertionError("a refused body never reaches the controller")

    status, answer = asyncio.run(post_answer(Auth(("t",)), controller, "Bearer t", body))
    assert status == 400 and answer["reason"] == "bad_request"


def test_regression_manifest_errors_do_not_echo_the_manifest_at_length():
    """A refused manifest's message repeated the offending value whole (a 6 KB message for a nested
    ``kind``; megabytes for a long list): it goes into the route's answer and the logs."""
    import json

    from engine_ext.errors import ManifestError
    from engine_ext.format.manifest import Manifest
    from fuzz_corpus import corpus

    doc = json.loads(corpus().manifests["plain/v1"])
    for field, value in (("kind", "x" * 100_000), ("base_manifests", ["0" * 64] * 50_000), ("version", [1] * 50_000)):
        bad = dict(doc, **{field: value})
        with pytest.raises(ManifestError) as e:
            Manifest.from_json(json.dumps(bad).encode())
        assert len(str(e.value)) < 600, (field, len(str(e.value)))
    for field, value in (("shape", [-1] * 100_000), ("dtype", {"a": ["b" * 100_000]})):  # dtype: the campaign's find
        bad = json.loads(json.dumps(doc))
        bad["tensors"][0][field] = value
        with pytest.raises(ManifestError) as e:
            Manifest.from_json(json.dumps(bad).encode())
        assert len(str(e.value)) < 600, (field, len(str(e.value)))


@pytest.mark.parametrize("written", ["-000000000000001", "+00000000000000f", " 00000000000000f", "0_0000000000000f",
                                     "0x0000000000000f", "000000000000000F"])
def test_regression_fingerprints_are_exactly_16_lower_case_hex_digits(written):
    """``int(s, 16)`` took signs, spaces, underscores, ``0x`` and upper case: a manifest whose tensor
    fingerprint read "-000000000000001" (-1, never equal to a computed fingerprint) was accepted, its
    update then failing verification after the apply (500) instead of being refused up front (400)."""
    import json

    from engine_ext.errors import ManifestError
    from engine_ext.format import fingerprint as fpr
    from engine_ext.format.manifest import Manifest
    from fuzz_corpus import corpus
    from fuzz_targets import _reseal_fingerprints

    with pytest.raises(ValueError):
        fpr.parse(written)
    doc = json.loads(corpus().manifests["plain/v1"])
    doc["tensors"][0]["fingerprint"] = written
    _reseal_fingerprints(doc)  # what a lying signer would do: the model fingerprint agrees
    with pytest.raises(ManifestError, match="fingerprint"):
        Manifest.from_json(json.dumps(doc).encode())
    assert fpr.parse(fpr.fmt(2**64 - 1)) == 2**64 - 1


def test_regression_an_anchors_bogus_base_fingerprint_is_refused_before_any_blob():
    """An anchor's tensors carry no base fingerprint, so ``validate`` never looked at one: a manifest
    with ``"base_fingerprint": "zz"`` on an anchor tensor was accepted, then the rank's decode raised
    ValueError (500) from ``fpr.parse``. Refused as malformed now (400), before any blob is read."""
    import json

    from engine_ext.errors import ManifestError
    from engine_ext.format.manifest import Manifest
    from fuzz_corpus import corpus

    for where in ("tensor", "model"):
        doc = json.loads(corpus().manifests["plain/v0"])
        (doc["tensors"][0] if where == "tensor" else doc)["base_fingerprint"] = "zz"
        with pytest.raises(ManifestError, match="fingerprint"):
            Manifest.from_json(json.dumps(doc).encode())


@pytest.mark.parametrize("field,value", [("anchor_version", "3"), ("anchor_version", -1), ("anchor_version", 2),
                                         ("anchor_version", 1.0), ("model", 7), ("created_unix", "yesterday"),
                                         ("created_unix", True), ("format_version", True), ("format_version", 5.0)])
def test_regression_manifest_fields_of_the_wrong_type_are_refused(field, value):
    """Fields ``validate`` did not check were accepted with any type: an ``anchor_version`` of "3"
    (the route planner's ``manifest_key`` then raised ValueError: 500), a numeric ``model``, a
    ``format_version`` of ``true`` (== 1) or 5.0."""
    import json

    from engine_ext.errors import ManifestError
    from engine_ext.format.manifest import Manifest
    from fuzz_corpus import corpus

    doc = json.loads(corpus().manifests["plain/v1"])  # version 1
    Manifest.from_json(json.dumps(doc).encode())
    doc[field] = value
    with pytest.raises(ManifestError):
        Manifest.from_json(json.dumps(doc).encode())


@pytest.mark.parametrize("field,value", [("expires_unix", float("nan")), ("expires_unix", float("inf")), ("expires_unix", True),
                                         ("fingerprint", None), ("fingerprint", "84g55bbe26237a39"), ("anchor_version", "0"),
                                         ("anchor_version", -310), ("anchor_version", 2)])
def test_regression_latest_fields_are_checked(field, value):
    """``Latest.from_json`` checked version, manifest, sha256 and the type of expires_unix only: a
    signed pointer expiring at NaN or infinity never went stale (``nan < now`` is false), and one
    with no fingerprint or a non-numeric anchor_version was accepted (the CLI and the TRL
    integration then raised ValueError parsing it)."""
    from engine_ext.errors import ManifestError
    from engine_ext.format.latest import Latest
    from engine_ext.store.reader import read_latest
    from engine_ext.store.local import LocalStore
    from engine_ext.store.signing import Signer
    from fuzz_corpus import NOW, corpus, trust_of

    c = corpus()
    good = Latest(1, "v00000001.json", "84a55bbe26237a39", 0, "0" * 64, NOW + 3600)
    Latest.from_json(good.to_json())
    bad = Latest(**{**good.__dict__, field: value})
    raw = bad.to_json(Signer(c.key).signatures(bad.signed_bytes()))  # signed: only the field checks stand in the way
    with pytest.raises(ManifestError, match="malformed"):
        Latest.from_json(raw)
    d = c.root / f"regression-latest-{field}-{value}".replace(".", "_")
    d.mkdir(exist_ok=True)
    (d / "LATEST").write_bytes(raw)
    with pytest.raises(ManifestError):
        read_latest(LocalStore(str(d)), trust_of(c, "one"))


@pytest.mark.parametrize("what", ["short", "too-long", "deep", "list", "no-dtype", "meta-int", "negative",
                                  "string-shape", "none-shape"])
def test_regression_safetensors_headers_refused_with_value_error(tmp_path, what):
    """Bugs of the safetensors header parse: a file shorter than 8 bytes raised struct.error
    ("short"); a declared header length beyond the file (up to 100 MB) was allocated before the
    short read ("too-long"); one nested too deep raised RecursionError; a header that is a list, or entries without a dtype, not objects, or
    with shapes of negative numbers, a string or None raised TypeError / KeyError or were accepted.
    Each is a ValueError now, and nothing is allocated by a declared length alone."""
    import json
    import struct
    import tracemalloc

    from engine_ext.store.checkpoint import CheckpointDir, read_header
    from fuzz_corpus import safetensors_sample

    good = safetensors_sample()
    (n,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8:8 + n])
    name = next(k for k in header if k != "__metadata__")

    def file_with(header_obj):
        raw = json.dumps(header_obj).encode()
        return struct.pack("<Q", len(raw)) + raw + good[8 + n:]

    data = {"short": lambda: good[:5], "too-long": lambda: struct.pack("<Q", 100 << 20) + good[8:],
            "deep": lambda: struct.pack("<Q", len(DEEP)) + DEEP + good[8 + n:],
            "list": lambda: file_with([1, 2]), "no-dtype": lambda: file_with({name: {"shape": [2]}}),
            "meta-int": lambda: file_with({name: 3}), "negative": lambda: file_with({name: {**header[name], "shape": [-64, 128]}}),
            "string-shape": lambda: file_with({name: {**header[name], "shape": "ab"}}),
            "none-shape": lambda: file_with({name: {**header[name], "shape": [None]}})}[what]()
    (tmp_path / "model.safetensors").write_bytes(data)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError):
            read_header(tmp_path / "model.safetensors") if what in ("short", "too-long", "deep", "list") else CheckpointDir(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak
    (tmp_path / "model.safetensors").write_bytes(good)
    assert CheckpointDir(tmp_path).tensors[name].shape == tuple(header[name]["shape"])


@pytest.mark.parametrize("missing", ["format", "format_version"])
def test_regression_a_manifest_without_its_format_is_refused(missing):
    """A manifest that named no ``format`` or ``format_version`` was read as this reader's own format
    (the dataclass defaults): a document of another or a future format, read as format 5."""
    import json

    from engine_ext.errors import ManifestError
    from engine_ext.format.manifest import Manifest
    from fuzz_corpus import corpus

    doc = json.loads(corpus().manifests["plain/v1"])
    del doc[missing]
    with pytest.raises(ManifestError, match="format"):
        Manifest.from_json(json.dumps(doc).encode())


def test_regression_a_tensor_written_as_key_value_pairs_is_refused():
    """``dict(t)`` turned a tensor written as a list of [key, value] pairs into an entry: a manifest
    that is not the documented JSON object was accepted."""
    import json

    from engine_ext.errors import ManifestError
    from engine_ext.format.manifest import Manifest
    from fuzz_corpus import corpus

    doc = json.loads(corpus().manifests["plain/v1"])
    doc["tensors"][0] = [[k, v] for k, v in doc["tensors"][0].items()]
    with pytest.raises(ManifestError, match="object"):
        Manifest.from_json(json.dumps(doc).encode())


def test_regression_the_update_route_never_holds_a_body_past_its_limit():
    """The routes handed ``request.body`` to ``post_answer``, which reads the whole body before its
    size is looked at: an authorised caller's 8 MiB body was held whole (any size, in fact) to be
    refused as "over 65536 bytes". Now read chunk by chunk and refused past the limit."""
    import asyncio
    import json
    import tracemalloc

    from engine_ext.server.protocol import MAX_BODY_BYTES, ROUTE
    from fuzz_targets import TOKEN, _asgi_post, _vllm_app

    app = _vllm_app()
    body = b'{"url": "/runs/a"' + b" " * (8 << 20) + b"}"
    chunks = [body[i:i + (64 << 10)] for i in range(0, len(body), 64 << 10)]
    headers = [(b"authorization", f"Bearer {TOKEN}".encode())]
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(_asgi_post(app, ROUTE, [b'{"url": "/warm"}'], headers))
        tracemalloc.start()
        status, answer = loop.run_until_complete(_asgi_post(app, ROUTE, chunks, headers))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    finally:
        loop.close()
    assert status == 400 and json.loads(answer)["reason"] == "bad_request"
    assert peak < 4 * MAX_BODY_BYTES + (1 << 20), peak
