"""Layout probe on plain torch modules that load like vLLM (packed, sharded, padded, tied, transposed, quantised).

Expected pieces are written by hand from each loader's definition, not from the probe.
End to end, a probed map plus apply_delta must equal loading the new full tensor
through the same loader, bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from engine_ext.format import dtypes
from engine_ext.format import fingerprint as fpr
from engine_ext.server.apply import apply_delta
from engine_ext.server.maps import local_fingerprint
from engine_ext.server.maps import Piece, TensorMap, Unmappable, covered_elements
from engine_ext.format.delta import diff_tensor
from engine_ext.server.layout import probe_layout

BF16 = dtypes.BY_NAME["bfloat16"]
H, Q, KV, I, V, VPAD = 8, 8, 4, 12, 10, 16  # hidden, q rows, kv rows, intermediate, vocab, padded vocab


class ToyModel(torch.nn.Module):
    """Mimics vLLM's loaders: packed qkv / gate_up with shard ids, TP narrow on dim 0/1,
    padded vocab rows, tied lm_head, a transposed weight, and a quantised weight."""

    def __init__(self, tp_rank=0, tp_size=1, tied=True):
        super().__init__()
        self.r, self.n, self.tied = tp_rank, tp_size, tied
        g = torch.Generator().manual_seed(1 + tp_rank)
        mk = lambda *s: torch.nn.Parameter(torch.randn(*s, generator=g).to(torch.bfloat16), requires_grad=False)
        self.qkv = mk((Q + 2 * KV) // tp_size, H)
        self.gate_up = mk(2 * I // tp_size, H)
        self.down = mk(H, I // tp_size)  # row parallel: shards the input dim
        self.embed = mk(VPAD // tp_size, H)
        self.lm_head = self.embed if tied else mk(VPAD // tp_size, H)
        self.proj_t = mk(H, Q)  # stored transposed
        self.norm = mk(H)
        self.q8 = torch.nn.Parameter(torch.zeros(H, H, dtype=torch.int8), requires_grad=False)
        self.bias32 = torch.nn.Parameter(torch.zeros(H), requires_grad=False)  # fp32 param, bf16 checkpoint

    # vLLM QKVParallelLinear.weight_loader style
    def qkv_loader(self, param, w, shard_id):
        sizes = {"q": Q // self.n, "k": KV // self.n, "v": KV // self.n}
        offs = {"q": 0, "k": sizes["q"], "v": sizes["q"] + sizes["k"]}
        dst = param.data.narrow(0, offs[shard_id], sizes[shard_id])
        w = w.narrow(0, self.r * sizes[shard_id], sizes[shard_id])
        assert dst.shape == w.shape
        dst.copy_(w)

    def gate_up_loader(self, param, w, shard_id):
        size = I // self.n
        param.data[shard_id * size:(shard_id + 1) * size] = w.narrow(0, self.r * size, size)

    def load(self, name, w):
        if name in ("q", "k", "v"):
            self.qkv_loader(self.qkv, w, name)
        elif name in ("gate", "up"):
            self.gate_up_loader(self.gate_up, w, ["gate", "up"].index(name))
        elif name == "down":
            size = I // self.n
            self.down.data.copy_(w.narrow(1, self.r * size, size))
        elif name in ("embed", "lm_head"):
            if name == "lm_head" and self.tied:
                return  # vLLM skips lm_head for tied embeddings
            p = getattr(self, name)
            size = VPAD // self.n
            lo = self.r * size
            hi = min(V, lo + size)
            shard = w.narrow(0, lo, max(0, hi - lo))
            p[: shard.shape[0]].data.copy_(shard)
            p[shard.shape[0]:].data.fill_(0)
        elif name == "proj":
            self.proj_t.data.copy_(w.t())
        elif name == "norm":
            assert self.norm.shape == w.shape
            self.norm.data.copy_(w)
        elif name == "quant":
            self.q8.data.copy_((w.float() * 16).round().clamp(-128, 127).to(torch.int8))
        elif name == "bias":
            self.bias32.data.copy_(w)  # dtype conversion inside copy_
        elif name == "scaled":
            self.norm.data.copy_(w * 2)
        else:
            raise KeyError(name)


SHAPES = {"q": (Q, H), "k": (KV, H), "v": (KV, H), "gate": (I, H), "up": (I, H), "down": (H, I),
          "embed": (V, H), "lm_head": (V, H), "proj": (Q, H), "norm": (H,), "bias": (H,)}


def _nsd(names):
    return [(n, SHAPES.get(n, (H,)) if n != "quant" else (H, H), "bfloat16") for n in names]


def _all_fps(m):
    return {n: fpr.tensor_fingerprint(p) for n, p in m.named_parameters()}


def _same(a: Piece, b: Piece):
    return (a.dest is b.dest and a.start == b.start and a.stop == b.stop and a.offset == b.offset
            and a.strides == b.strides and a.count_fingerprint == b.count_fingerprint)


@pytest.mark.parametrize("rank,size", [(0, 1), (0, 2), (1, 2)])
def test_expected_pieces(rank, size):
    m = ToyModel(rank, size, tied=False)
    before = _all_fps(m)
    maps = probe_layout(m, m.load, _nsd(SHAPES))
    assert _all_fps(m) == before, "probing wrote into the model"
    qs, ks, gs, ds, vs = Q // size, KV // size, I // size, I // size, VPAD // size
    exp = {
        "q": [Piece(m.qkv, (rank * qs, 0), ((rank + 1) * qs, H), 0, (H, 1))],
        "k": [Piece(m.qkv, (rank * ks, 0), ((rank + 1) * ks, H), qs * H, (H, 1))],
        "v": [Piece(m.qkv, (rank * ks, 0), ((rank + 1) * ks, H), (qs + ks) * H, (H, 1))],
        "gate": [Piece(m.gate_up, (rank * gs, 0), ((rank + 1) * gs, H), 0, (H, 1))],
        "up": [Piece(m.gate_up, (rank * gs, 0), ((rank + 1) * gs, H), gs * H, (H, 1))],
        "down": [Piece(m.down, (0, rank * ds), (H, (rank + 1) * ds), 0, (ds, 1))],
        "embed": [Piece(m.embed, (rank * vs, 0), (min(V, (rank + 1) * vs), H), 0, (H, 1))],
        "lm_head": [Piece(m.lm_head, (rank * vs, 0), (min(V, (rank + 1) * vs), H), 0, (H, 1))],
        "proj": [Piece(m.proj_t, (0, 0), (Q, H), 0, (1, Q))],
        "norm": [Piece(m.norm, (0,), (H,), 0, (1,))],
        "bias": [Piece(m.bias32, (0,), (H,), 0, (1,))],  # converting: bf16 -> float32
    }
    for name, pieces in exp.items():
        got = maps[name]
        assert isinstance(got, TensorMap), (name, got)
        assert got.shape == SHAPES[name] and got.dtype is BF16
        assert len(got.pieces) == len(pieces) and all(_same(a, b) for a, b in zip(got.pieces, pieces)), (name, got.pieces)


def test_tied_and_unmappable():
    m = ToyModel(tied=True)
    before = _all_fps(m)
    maps = probe_layout(m, m.load, _nsd(["embed", "lm_head", "quant", "bias", "scaled"]) + [("nope", (3,), "bfloat16")])
    assert _all_fps(m) == before
    assert isinstance(maps["embed"], TensorMap) and maps["embed"].pieces[0].dest is m.embed
    assert isinstance(maps["lm_head"], TensorMap) and maps["lm_head"].pieces == []  # skipped: tied
    for name, why in [("quant", "not a view"), ("scaled", "not a view"), ("nope", "KeyError")]:
        assert isinstance(maps[name], Unmappable) and why in maps[name].reason, maps[name]
    # an exact widening (bf16 checkpoint into the float32 parameter) is a converting map
    assert isinstance(maps["bias"], TensorMap) and [_same(p, Piece(m.bias32, (0,), (H,), 0, (1,))) for p in maps["bias"].pieces] == [True]


class NarrowingLoader(torch.nn.Module):
    """A float32 checkpoint tensor loaded into a bf16 parameter: the old bits cannot be read back."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16), requires_grad=False)

    def load(self, name, t):
        self.w.data.copy_(t)


def test_narrowing_copy_is_unmappable():
    m = NarrowingLoader()
    maps = probe_layout(m, m.load, [("w", (4,), "float32")])
    assert isinstance(maps["w"], Unmappable) and "converts torch.float32 -> torch.bfloat16" in maps["w"].reason


class ExpertLoader(torch.nn.Module):
    """GPT-OSS's expert loader in vLLM: each expert's [H, 2I] slice is transposed, made contiguous (a
    copy) and written into the [E, 2I, H] parameter; a loader that then writes into its "copy" is not
    mappable (under the probe the copy is the probe itself)."""

    def __init__(self, scribble=False):
        super().__init__()
        self.w13 = torch.nn.Parameter(torch.zeros(3, 6, 4, dtype=torch.bfloat16), requires_grad=False)
        self.scribble = scribble

    def load(self, name, t):  # t: [E, H, 2I]
        for e in range(t.shape[0]):
            rows = t[e].t().contiguous()
            if self.scribble:
                rows.mul_(2)
            self.w13.data[e].copy_(rows.clone())


def test_a_transposed_contiguous_copy_maps_like_its_view():
    m = ExpertLoader()
    maps = probe_layout(m, m.load, [("experts", (3, 4, 6), "bfloat16")])
    assert isinstance(maps["experts"], TensorMap), maps["experts"]
    new = torch.randn(3, 4, 6).to(torch.bfloat16)
    old = torch.zeros(3, 4, 6, dtype=torch.bfloat16)
    apply_delta([diff_tensor("experts", old, new)], maps)
    assert torch.equal(m.w13.data.view(torch.int16), new.transpose(1, 2).contiguous().view(torch.int16))
    m = ExpertLoader(scribble=True)
    assert isinstance(probe_layout(m, m.load, [("experts", (3, 4, 6), "bfloat16")])["experts"], Unmappable)


class TiedLoader(torch.nn.Module):
    """Two checkpoint names copied into one parameter, and one name copied into two parameters."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 3).to(torch.bfloat16), requires_grad=False)
        self.a = torch.nn.Parameter(torch.randn(4, 3).to(torch.bfloat16), requires_grad=False)
        self.b = torch.nn.Parameter(self.a.detach().clone(), requires_grad=False)  # loaded from the same tensor

    def load(self, name, t):
        if name in ("x", "y"):
            self.w.data.copy_(t)
        else:
            self.a.data.copy_(t)
            self.b.data.copy_(t)
            self.b.data.copy_(t)  # repeated identical write: deduplicated


def test_two_names_one_param_and_one_name_two_params():
    m = TiedLoader()
    maps = probe_layout(m, m.load, [("x", (4, 3), "bfloat16"), ("y", (4, 3), torch.bfloat16), ("z", (4, 3), BF16)])
    assert maps["x"].pieces[0].dest is m.w and maps["y"].pieces[0].dest is m.w
    z = maps["z"].pieces
    assert [p.dest is m.a for p in z] == [True, False] and [p.count_fingerprint for p in z] == [True, False]
    assert covered_elements(maps["z"]) == 12
    assert local_fingerprint(maps["z"]) == fpr.tensor_fingerprint(m.a)
    # the same destination elements from two names in one apply is refused, nothing written
    new = torch.randn(4, 3).to(torch.bfloat16)
    dx = diff_tensor("x", m.w.detach().clone(), new)
    dy = diff_tensor("y", m.w.detach().clone(), new)
    before = m.w.detach().clone()
    with pytest.raises(ValueError, match="same destination"):
        apply_delta([dx, dy], maps)
    assert torch.equal(before.view(torch.int16), m.w.detach().view(torch.int16))
    # one name into two params: both written, fingerprint counted once
    dz = diff_tensor("z", m.a.detach().clone(), new)
    r = apply_delta([dz], maps)
    assert torch.equal(m.a.view(torch.int16), new.view(torch.int16)) and torch.equal(m.b.view(torch.int16), new.view(torch.int16))
    assert r.fingerprint_delta["z"] == (dz.fingerprint - dz.base_fingerprint) & fpr.MASK64


@pytest.mark.parametrize("rank,size", [(0, 1), (1, 2)])
def test_probe_then_apply_equals_loading_new_weights(rank, size):
    """Independent check: apply through the probed map == the loader writing the full new tensors."""
    m = ToyModel(rank, size, tied=True)
    names = [n for n in SHAPES if n != "lm_head"]
    g = torch.Generator().manual_seed(7)
    old = {n: torch.randn(*SHAPES[n], generator=g).to(torch.bfloat16) for n in names}
    new = {}
    for n in names:
        t = old[n].clone()
        mask = torch.rand(t.shape, generator=g) < 0.3
        t[mask] = (t[mask].float() * 1.01).to(torch.bfloat16)
        new[n] = t
    with torch.no_grad():
        for n in names:
            m.load(n, old[n])
    maps = probe_layout(m, m.load, _nsd(names))
    for n in names:
        if covered_elements(maps[n]) == old[n].numel():
            assert local_fingerprint(maps[n]) == fpr.tensor_fingerprint(old[n])
    deltas = [diff_tensor(n, old[n], new[n]) for n in names]
    res = apply_delta(deltas, maps)
    got = {k: v.detach().clone() for k, v in m.named_parameters()}
    ref = ToyModel(rank, size, tied=True)
    with torch.no_grad():
        for n in names:
            ref.load(n, new[n])
    for k, v in ref.named_parameters():
        if k == "q8":
            continue
        assert torch.equal(got[k].view(torch.uint8), v.detach().view(torch.uint8)), k
    for d in deltas:
        if covered_elements(maps[d.name]) == d.numel:
            assert res.fingerprint_delta[d.name] == (d.fingerprint - d.base_fingerprint) & fpr.MASK64
    res.undo.rollback()
    again = ToyModel(rank, size, tied=True)
    with torch.no_grad():
        for n in names:
            again.load(n, old[n])
    for k, v in again.named_parameters():
        if k != "q8":
            assert torch.equal(dict(m.named_parameters())[k].detach().view(torch.uint8), v.detach().view(torch.uint8)), k


def test_a_loader_that_writes_from_a_thread_pool_is_probed_in_the_probing_thread():
    """SGLang's DeepSeek loader hands its writes to a ThreadPoolExecutor, past the probe's mode (which
    sees one thread): while probing, the pool's tasks run in the probing thread, so the maps are
    learnt and nothing is written; a loader that starts a thread of its own is refused before the
    thread runs, and nothing is written either."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    class Pooled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.bfloat16), requires_grad=False)

        def load_pool(self, name, t):
            with ThreadPoolExecutor(2) as pool:
                for f in [pool.submit(self.w.data[i].copy_, t[i]) for i in range(4)]:
                    f.result()

        def load_thread(self, name, t):
            th = threading.Thread(target=self.w.data.copy_, args=(t,))
            th.start()
            th.join()

    m = Pooled()
    before = m.w.detach().clone()
    maps = probe_layout(m, m.load_pool, [("w", (4, 6), torch.bfloat16)])
    assert isinstance(maps["w"], TensorMap) and len(maps["w"].pieces) == 4, maps
    assert torch.equal(m.w.view(torch.int16), before.view(torch.int16))  # the probe's bytes never landed
    maps = probe_layout(m, m.load_thread, [("w", (4, 6), torch.bfloat16)])
    assert isinstance(maps["w"], Unmappable) and "starts a thread" in maps["w"].reason, maps
    assert torch.equal(m.w.view(torch.int16), before.view(torch.int16))
    with ThreadPoolExecutor(1) as pool:  # outside a probe, pools and threads are untouched
        assert pool.submit(threading.get_ident).result() != threading.get_ident()
