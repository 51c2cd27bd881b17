"""DeltaPublisher -> real stores (local, S3 via moto_server, HTTP) -> reader: bit-exact chains."""
import json
import time
from pathlib import Path

import pytest
import torch

from engine_ext.format import fingerprint as fpr
from engine_ext.store import decoding, reader, route
from engine_ext.format.delta import apply_tensor
from engine_ext.format.dtypes import as_bits
from engine_ext.errors import BaseMismatchError, IntegrityError
from engine_ext.trainer.publisher import DeltaPublisher, clean_state_dict
from engine_ext.store import open_store

from support.synthetic import AdamRL, llm_shapes  # tests/support (tests/ is on sys.path: conftest.py)

SHAPES = llm_shapes(hidden=64, layers=2, vocab=512, inter=128, kv=32)


def trainer_states(n, seed=0):
    tr = AdamRL(SHAPES, lr=1e-5, seed=seed)
    return [tr.weights()] + [tr.step() for _ in range(n)]


def materialise(base: dict, d) -> dict:
    out = dict(base)
    for t in d.tensors:
        out[t.name] = apply_tensor(None if d.kind == "anchor" else out[t.name], t, check=False)
    for name, fp in d.tensor_fingerprints.items():
        assert fpr.tensor_fingerprint(out[name]) == fp, name
    return out


def equal(a: dict, b: dict):
    assert set(a) == set(b)
    for n in a:
        assert torch.equal(as_bits(a[n]), as_bits(b[n])), n


@pytest.fixture(scope="module")
def states():
    return trainer_states(6)


def publish_all(store, states, anchor_every=3):
    with DeltaPublisher(store, "tiny", anchor_every=anchor_every) as pub:
        uris = [pub.publish(s) for s in states]
    return uris


def check_reads(root, states):
    last = len(states) - 1
    for have in range(last):
        d = route.resolve(root, have_version=have, have_fingerprint=fpr.model_fingerprint(
            {n: fpr.tensor_fingerprint(t) for n, t in states[have].items()}), bases=decoding.TensorBases(states[have]))
        equal(materialise(states[have], d), states[last])
    fresh = route.resolve(root, bases=decoding.TensorBases({}))  # the anchor is the base of the deltas after it
    assert fresh.kind == "anchor" and fresh.manifests[0].endswith(".anchor.json")
    equal(materialise({}, fresh), states[last])


def test_local_chain_anchor_and_composition(tmp_path, states):
    uris = publish_all(str(tmp_path), states)
    assert uris[0].endswith("v00000000.anchor.json") and uris[-1].endswith("v00000006.json")
    check_reads(str(tmp_path), states)
    # reader at 1 wanting 6: the chain (5 deltas) is smaller than anchor 6 -> chain
    d = route.resolve(str(tmp_path), have_version=1, bases=decoding.TensorBases(states[1]))
    assert [Path(u).name for u in d.manifests] == [f"v{k:08d}.json" for k in range(2, 7)]


def test_s3_round_trip(s3_bucket, states):
    root = f"s3://{s3_bucket}/run1"
    publish_all(root, states)
    check_reads(root, states)


def test_http_reader(http_server, states):
    http_server.reset()
    publish_all(str(http_server.root / "run"), states)
    check_reads(f"{http_server.url}/run", states)


def test_clean_state_dict_strips_wrappers_only():
    """Wrapper prefixes go only where they wrap: a prefix every name carries (torch.compile, DDP,
    nested), FSDP1/checkpoint wrapper components; names that merely contain such words stay."""
    t = {n: torch.zeros(1) for n in range(8)}  # one tensor per name (one tensor under two names is a tied pair)
    inner = ["vision_module.weight", "encoder.submodule.proj.weight", "module_list.0.weight", "x._orig_mod_y.bias",
             "modules.module.weight"]
    assert sorted(clean_state_dict({n: t[i] for i, n in enumerate(inner)})) == sorted(inner)
    wrapped = {f"_orig_mod.module.{n}": t[i] for i, n in enumerate(inner)}
    assert sorted(clean_state_dict(wrapped)) == sorted(inner)
    fsdp = {"layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.mlp.weight": t[0], "module.lm_head.weight": t[1]}
    assert sorted(clean_state_dict(fsdp)) == ["layers.0.mlp.weight", "module.lm_head.weight"]  # not every name has module.
    with pytest.raises(ValueError, match="two tensors"):
        clean_state_dict({"a._fsdp_wrapped_module.w": t[0], "a.w": torch.zeros(1)})


def test_module_with_wrapper_prefix_and_keep_on_cpu(tmp_path):
    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 4, dtype=torch.bfloat16)

    class Compiled(torch.nn.Module):  # what torch.compile's OptimizedModule looks like to state_dict()
        def __init__(self):
            super().__init__()
            self._orig_mod = Inner()

    m = Compiled()
    assert set(clean_state_dict(m)) == {"lin.weight", "lin.bias"}
    assert set(clean_state_dict({"module." + k: v for k, v in m.state_dict().items()})) == {"lin.weight", "lin.bias"}
    snaps = []
    with DeltaPublisher(str(tmp_path), keep_on_cpu=True) as pub:
        for _ in range(3):
            snaps.append({k: v.clone() for k, v in clean_state_dict(m).items()})
            pub.publish(m)
            with torch.no_grad():
                m._orig_mod.lin.weight[0, :3] += 1
    d = route.resolve(str(tmp_path), have_version=0, bases=decoding.TensorBases(snaps[0]))
    equal(materialise(snaps[0], d), snaps[2])


def test_wrong_base_refused(tmp_path, states):
    publish_all(str(tmp_path), states[:3], anchor_every=0)
    (tmp_path / "v00000000.anchor.json").unlink()  # no anchor to fall back to
    with pytest.raises(BaseMismatchError):
        route.resolve(str(tmp_path / "v00000002.json"), have_fingerprint=12345)
    with pytest.raises(BaseMismatchError):
        route.resolve(str(tmp_path / "v00000002.json"), have_version=7)


def test_corrupt_blob_refused(tmp_path, states):
    publish_all(str(tmp_path), states[:2])
    blob = next(tmp_path.glob("v00000001.0.*.bin"))
    data = bytearray(blob.read_bytes())
    data[-1] ^= 1
    blob.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        reader.load_delta(str(tmp_path / "v00000001.json"))


class SlowStore:
    """A local store whose writes take a while (or fail): exercises backpressure and errors."""

    def __init__(self, root, delay=0.3, fail=False):
        self.inner, self.delay, self.fail = open_store(root), delay, fail

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _slow(self):
        time.sleep(self.delay)
        if self.fail:
            raise OSError("disk full (simulated)")

    def write(self, key, data):
        self._slow()
        self.inner.write(key, data)

    def create(self, key, data):
        self._slow()
        self.inner.create(key, data)

    def write_if(self, key, data, check, max_bytes=None):
        self._slow()
        self.inner.write_if(key, data, check)

    def write_file(self, key, path):
        self.write(key, Path(path).read_bytes())

    def create_file(self, key, path):
        self.create(key, Path(path).read_bytes())


def test_backpressure_and_wait(tmp_path, states):
    """publish() returns before its upload (asynchronous) but blocks while the queue is full
    (backpressure): with one queued job, the 5th publish returns only after v2 is uploaded."""
    pub = DeltaPublisher(SlowStore(str(tmp_path)), queue_size=1, anchor_every=0)
    for s in states[:5]:  # jobs: v0 anchor, v1..v4 deltas; every store write takes 0.3 s
        pub.publish(s)
    assert (tmp_path / "v00000002.json").exists(), "publish did not wait for the queue (no backpressure)"
    assert not (tmp_path / "v00000004.json").exists(), "publish waited for its own upload"
    pub.close()
    assert (tmp_path / "v00000004.json").exists() and (tmp_path / "LATEST").exists()
    bad = DeltaPublisher(SlowStore(str(tmp_path / "b"), delay=0, fail=True))
    bad.publish(states[0])
    with pytest.raises(RuntimeError, match="disk full"):
        bad.wait()


def test_a_published_version_frees_its_changes(tmp_path, states, monkeypatch):
    """Once a version is in the store, nothing holds its changes (positions, bits, encodings): not the
    background thread until the next version arrives. They are O(changes) bytes (GBs on a big model), and the
    next diff reuses that memory instead of taking fresh pages."""
    import gc
    import weakref

    from engine_ext.trainer import publisher as publisher_mod

    seen = []
    snapshot = publisher_mod.DeltaPublisher._snapshot_delta

    def watched(self, sd, version):
        job = snapshot(self, sd, version)
        seen.extend(weakref.ref(t) for c in job.payload for t in (c.positions, c.new_bits, c.old_bits))
        return job
    monkeypatch.setattr(publisher_mod.DeltaPublisher, "_snapshot_delta", watched)
    gc.disable()  # freed by reference counts alone, as the memory must be (no cycle waits for a collection)
    try:
        with DeltaPublisher(str(tmp_path), anchor_every=0) as pub:
            pub.publish(states[0])
            pub.publish(states[1])
            pub.wait()
            assert seen and all(r() is None for r in seen), "a published version's changes are still held"
    finally:
        gc.enable()


def test_partial_fetch_by_range(http_server, states):
    """A reader can fetch and verify single tensors by byte range (what a TP rank needs)."""
    http_server.reset()
    publish_all(str(http_server.root / "part"), states[:2])
    uri = f"{http_server.url}/part/v00000001.json"
    full = reader.load_delta(uri, bases=decoding.TensorBases(states[0]))
    names = {t.name for t in full.tensors[:2]}
    http_server.requests.clear()
    part = reader.load_delta(uri, names=names, bases=decoding.TensorBases(states[0]))
    assert {t.name for t in part.tensors} == names
    for t in part.tensors:
        ref = next(x for x in full.tensors if x.name == t.name)
        assert torch.equal(t.positions, ref.positions) and torch.equal(t.values, ref.values)
    ranged = [h["Range"] for m, _, h in http_server.requests if m == "GET" and "Range" in h]
    m = json.loads((http_server.root / "part" / "v00000001.json").read_text())
    wanted = [t for t in m["tensors"] if t["name"] in names]
    parts = [(c["offset"], c["positions"]["length"] + c["values"]["length"]) for t in wanted for c in (t.get("chunks") or [t])]
    fetched = sum(int(b) - int(a) + 1 for a, b in (r.removeprefix("bytes=").split("-") for r in ranged))
    # close parts are read together (at most GAP bytes between them); nothing else of the blob
    assert 1 <= len(ranged) <= len(parts) and fetched <= sum(n for _, n in parts) + reader.GAP * len(parts)
    assert fetched < sum(b["size"] for b in m["blobs"]) // 2


# ---------------------------------------------------------------- tied names and the served dtype


def _tiny_qwen2(tied: bool, dtype=torch.float32):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).to(dtype)


def _step(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # a tied parameter is one parameter: it moves once
            p.add_(1e-2 * torch.randn(p.shape, generator=g) * (torch.rand(p.shape, generator=g) < 0.2))


PATHS = {"module": lambda m: m, "state_dict": lambda m: m.state_dict(), "trl_iterator": lambda m: m.named_parameters()}


@pytest.mark.parametrize("tied", [True, False])
def test_every_call_path_publishes_each_storage_once_in_the_served_dtype(tmp_path, tied):
    """publish(model), publish(model.state_dict()) and TRL's iterator of named_parameters() on fp32
    weights publish the same versions: bf16 (the default served dtype), a tied embedding once,
    under the name the engines load (model.embed_tokens.weight); an untied model keeps lm_head."""
    fps, docs = {}, {}
    for path, given in PATHS.items():
        model = _tiny_qwen2(tied)
        with DeltaPublisher(str(tmp_path / path), anchor_every=0) as pub:
            for step in range(3):
                if step:
                    _step(model, step)
                pub.publish(given(model))
            assert pub.aliases == ({"lm_head.weight": "model.embed_tokens.weight"} if tied and path != "trl_iterator" else {})
        docs[path] = [json.loads((tmp_path / path / n).read_text()) for n in ("v00000000.anchor.json", "v00000002.json")]
        fps[path] = [d["fingerprint"] for d in docs[path]]
    assert fps["module"] == fps["state_dict"] == fps["trl_iterator"]
    for doc in docs["module"]:
        names = {t["name"]: t["dtype"] for t in doc["tensors"]}
        assert ("lm_head.weight" in names) == (not tied) and "model.embed_tokens.weight" in names
        assert set(names.values()) == {"bfloat16"}
    served = {n: fpr.tensor_fingerprint(p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()}
    assert fps["module"][-1] == fpr.fmt(fpr.model_fingerprint(served))  # the trainer's weights, in bf16, each once


def test_fresh_tensors_freed_once_cast_are_never_taken_for_aliases():
    """An iterator of gathered tensors (``full_tensor()`` per name: each fresh, freed once cast to bf16)
    hands the allocator's freed addresses to the next tensor of the same shape; none of them is an
    alias (measured before the fix: 7 of 20 dropped as aliases)."""
    g = torch.Generator().manual_seed(0)
    params = {f"layers.{i}.w": torch.randn(64, 64, generator=g) for i in range(20)}
    kept = {}
    sd = clean_state_dict(((n, p.clone()) for n, p in params.items()), kept, cast=lambda t: t.to(torch.bfloat16))
    assert list(sd) == list(params) and kept == {}
    assert all(torch.equal(sd[n], p.to(torch.bfloat16)) for n, p in params.items())


def test_aliases_are_one_storage_seen_the_same_way():
    """Only names seeing the same elements the same way are one tensor: views of one storage at
    another offset, shape or stride (a fused qkv split by rows, a transpose) stay apart, and
    the first name in state dict order is the one kept."""
    w = torch.randn(6, 4)
    kept = {}
    sd = clean_state_dict({"a": w, "b": w[:3], "c": w[3:], "d": w.t(), "e": w.view(6, 4), "f": torch.zeros(0),
                           "g": torch.zeros(0)}, kept)
    assert list(sd) == ["a", "b", "c", "d", "f", "g"] and kept == {"e": "a"}
    model = _tiny_qwen2(True)
    first = torch.nn.Module()
    first.lm_head, first.model = model.lm_head, model.model  # the head registered first: its name is kept
    kept = {}
    assert "lm_head.weight" in clean_state_dict(first, kept) and kept == {"model.embed_tokens.weight": "lm_head.weight"}
    wrapped = torch.nn.Module()
    wrapped._orig_mod = model  # a compiled model: the prefix goes, on the names dropped too
    kept = {}
    assert "lm_head.weight" not in clean_state_dict(wrapped, kept) and kept == {"lm_head.weight": "model.embed_tokens.weight"}


def test_served_dtype_casts_floats_only(tmp_path):
    """fp32 masters and fp16 tensors are published in the served dtype; integer, bool and fp8
    tensors as they are; dtype=None publishes everything as held."""
    sd = {"w": torch.randn(8, 8), "h": torch.randn(8).half(), "steps": torch.arange(4), "mask": torch.ones(3, dtype=torch.bool),
          "q": torch.randn(4, 4).to(torch.float8_e4m3fn)}
    with DeltaPublisher(str(tmp_path / "bf16"), anchor_every=0) as pub:
        pub.publish(sd)
    with DeltaPublisher(str(tmp_path / "held"), anchor_every=0, dtype=None) as pub:
        pub.publish(sd)
    with DeltaPublisher(str(tmp_path / "fp16"), anchor_every=0, dtype="float16") as pub:
        pub.publish(sd)
    for store, want in [("bf16", {"w": "bfloat16", "h": "bfloat16"}), ("held", {"w": "float32", "h": "float16"}),
                        ("fp16", {"w": "float16", "h": "float16"})]:
        got = {t["name"]: t["dtype"] for t in json.loads((tmp_path / store / "v00000000.anchor.json").read_text())["tensors"]}
        assert got == {**want, "steps": "int64", "mask": "bool", "q": "float8_e4m3fn"}, store
    d = route.resolve(str(tmp_path / "bf16"))
    got = materialise({}, d)
    assert torch.equal(as_bits(got["w"]), as_bits(sd["w"].to(torch.bfloat16))) and torch.equal(got["steps"], sd["steps"])
    with pytest.raises(ValueError, match="served dtype"):
        DeltaPublisher(str(tmp_path / "bad"), dtype=torch.int8)


def test_a_tied_fp32_state_dict_into_a_bf16_served_model_is_named_not_a_wrong_base(tmp_path):
    """What a served model refuses is named as a model mismatch (which tensor, what each side holds),
    never as a wrong base: a tied copy it does not hold, an fp32 tensor where it serves bf16."""
    from engine_ext.errors import ModelMismatchError

    model = _tiny_qwen2(True)
    served = {n: (list(p.shape), "bfloat16") for n, p in model.named_parameters()}
    with DeltaPublisher(str(tmp_path / "held"), anchor_every=0, dtype=None) as pub:
        pub.publish(model.named_parameters())
    m = reader.read_manifest(open_store(str(tmp_path / "held")), "v00000000.anchor.json")
    with pytest.raises(ModelMismatchError, match=r"'model.embed_tokens.weight' is \[96, 32\]/float32, the served model "
                                                 r"has \[96, 32\]/bfloat16.*DeltaPublisher\(dtype=") as e:
        reader.check_expected(m, served, "v0")
    assert (e.value.reason, e.value.http_status) == ("model_mismatch", 409)
    untied = {n: s for n, s in served.items() if n != "model.norm.weight"}
    with DeltaPublisher(str(tmp_path / "bf16"), anchor_every=0) as pub:
        pub.publish(model.named_parameters())
    m = reader.read_manifest(open_store(str(tmp_path / "bf16")), "v00000000.anchor.json")
    reader.check_expected(m, served, "v0")
    with pytest.raises(ModelMismatchError, match=r"1 tensor\(s\) not in the served model: \['model.norm.weight'\]"):
        route.plan(str(tmp_path / "bf16" / "v00000000.anchor.json"), expected=untied)


def test_the_planner_walks_the_anchors_chain_only_where_the_anchor_could_be_cheaper(tmp_path, monkeypatch):
    """A replica one version behind reads the target and the anchor (to price it), not every manifest since
    the anchor; one far behind still takes the anchor where the anchor and its chain cost less."""
    g = torch.Generator().manual_seed(5)
    sd = {"w": torch.randn(64, 64, generator=g).to(torch.bfloat16)}
    with DeltaPublisher(str(tmp_path), anchor_every=8) as pub:
        for v in range(13):  # anchors at v0 and v8; every element moves every step (the chain grows fast)
            pub.publish({"w": (sd["w"].float() * (1.0 + 0.05 * (v + 1))).to(torch.bfloat16)})
    reads = []
    real = route.read_link
    monkeypatch.setattr(route, "read_link", lambda store, key, *a, **k: reads.append(key) or real(store, key, *a, **k))
    target = str(tmp_path / "v00000012.json")
    r = route.plan(target, 11, None)
    assert [link.key for link in r.links] == ["v00000012.json"]
    assert reads == ["v00000012.json", "v00000008.anchor.json"], reads
    reads.clear()
    r = route.plan(target, 1, None)
    assert [link.key for link in r.links][0] == "v00000008.anchor.json", [link.key for link in r.links]
    assert len(reads) > 10  # the chain from v1 and the anchor's were both priced
