"""The context pass of a context-conditioned delta decoder: changed ranks -> element positions.

A leaf: this module imports torch and Triton only. :func:`context_positions` is the
entry point; ``backend="triton"`` runs the two kernels below, ``backend="torch"`` runs
:func:`reference_context_positions`, the same mapping in plain torch (any device, the
CPU included). ``tests/test_context_scan.py`` holds the two side by side with a numpy
model.

**Inputs.** One tensor part of ``n`` elements: ``bits``, its base weights' raw bits,
1-D int8 (fp8), int16 (bf16, fp16) or int32 (fp32), read as *unsigned* ``W``-bit integers. The class
of element ``i`` is ``cls[i] = lut[(bits[i] >> shift) & emask]`` (a logical shift; both
paths shift the sign-extended bits arithmetically and mask with
``emask & (2^(W - shift) - 1)``, which drops the sign copies),
``lut`` a uint8/int32 table of ``emask + 1`` entries in ``[0, K)``, ``K <= 16``. For
each class ``c``, ``ranks[starts[c]:starts[c+1]]`` (int64, ``starts`` int64 of length
``K + 1``) are the sorted unique *within-class ranks* of its changed elements; the
within-class rank of ``i`` is ``#{j < i : cls[j] == cls[i]}``.

**Math.** Let ``pop[c] = #{i : cls[i] == c}`` and ``off[c] = sum_{c' < c} pop[c']``.
The stable class-sorted order puts element ``i`` at *sorted index*
``s(i) = off[cls[i]] + rank(i)``, a bijection of ``[0, n)``. Rank ``r = ranks[j]`` of
class ``c`` names the element at sorted index ``off[c] + r`` (so ``r < pop[c]`` is
required: ValueError otherwise). The answer is ``pos`` = those elements, increasing,
and ``src[k] = j`` with ``ranks[j]`` the rank of ``pos[k]``.

**Triton path** (data-parallel, blocks of ``BLOCK`` elements, ``KP = 16`` padded classes):

1. :func:`_class_hist_kernel`: ``hist[b, c] = #{i in block b : cls[i] == c}``;
2. torch: ``base[b, c] = off[c] + sum_{b' < b} hist[b', c]`` (exclusive cumsums), the
   rank checks;
3. torch: ``slot = full(n, -1)``; ``slot[off[c] + ranks[j]] = j`` for each class ``c``
   and ``starts[c] <= j < starts[c+1]`` (slot is indexed by sorted index);
4. :func:`_context_gather_kernel`: per block, ``local(i) = #{i' in block, i' < i :
   cls[i'] == cls[i]}`` (an inclusive ``cumsum`` over the ``[BLOCK, KP]`` one-hot of
   the classes, less one), so ``s(i) = base[b, cls[i]] + local(i)`` and
   ``out[i] = slot[s(i)]``;
5. torch: ``pos = nonzero(out >= 0)``, ``src = out[pos]``.

**Torch path.** A stable sort of the (uint8) classes gives the class-sorted order
``order`` (``order[s(i)] = i``) and, by ``searchsorted`` on the sorted classes, ``off``
and ``pop``; then ``pos = order[off[c] + ranks[j]]`` for each ``j``, sorted with ``src``
alongside. Same bijection read the other way round (sorted index -> element), which
on a CPU avoids the random gathers over ``n`` of steps 3-5.

**Blocked pass** (:func:`block_positions`, what a rank's decode runs). A part is cut into
*blocks* (ranks restart in each); block ``b`` is ``run[b]``-element runs starting at
``read_rows[row_ptr[b] : row_ptr[b + 1]]`` in ``bits`` (its ``size[b]`` elements in
row-major order), and ``pos_rows`` gives the position reported for each run's first
element (the part-flat one; equal to ``read_rows`` when ``bits`` is the whole part). A
*group* ``g = b * K + c``; ``ranks[starts[b, c]:starts[b, c + 1]]`` are its ranks
(``starts`` ``[S, K + 1]``, block-major, so ``starts[b, K] == starts[b + 1, 0]``). With
``G[g]`` the exclusive cumsum of the groups' populations, element ``e`` of group ``g``
and within-group rank ``r`` has *sorted index* ``G[g] + r``, and the listed ones,
``sidx[j] = G[g(j)] + ranks[j]``, increase with ``j``. Tiles of ``BLOCK`` elements of one
block each:

1. :func:`_block_hist_kernel`: ``hist[t, c]``;
2. torch: ``base[t, c] = G[b(t), c] + sum of hist[t', c]`` over the block's earlier tiles
   (the sorted index of the tile's first element of class ``c``), the rank checks, and
   ``[jlo, jhi)[t, c]`` = the ``j`` whose ``sidx`` fall in ``[base, base + hist)``
   (``searchsorted``);
3. :func:`_block_find_kernel`: each element's sorted index ``s = base[t, c] + local``
   (as above), looked up by binary search in ``sidx[jlo:jhi]`` (at 1 % a few steps, in
   cache); where found at ``j``: ``out[j] = pos_rows[...] + offset in the run``;
4. torch: ``pos, src = sort(out)``.

No array over the part's elements is allocated besides the tile tables (``O(n / BLOCK)``):
a rank decoding beside a serving engine needs ``O(changes)`` device memory.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path needs no Triton (annotations are strings: ``from __future__``)
    triton = tl = None


def _jit(fn):
    """``triton.jit`` when Triton is installed (an interpreted function under ``TRITON_INTERPRET=1``)."""
    return triton.jit(fn) if triton is not None else fn


BLOCK = 1024
KP = 16  # classes, padded (K <= KP)
NUM_WARPS = 8

INT_OF_FLOAT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
WIDTH = {torch.int8: 8, torch.int16: 16, torch.int32: 32}


@_jit
def _classes(bits_ptr, lut_ptr, offs, m, shift, emask):
    """cls[offs] = lut[(bits >> shift) & emask], -1 where ~m; ``emask`` already cut to ``W - shift`` bits
    (:func:`effective_mask`), so the arithmetic shift acts as a logical one."""
    b = tl.load(bits_ptr + offs, mask=m, other=0).to(tl.int32)
    e = (b >> shift) & emask
    c = tl.load(lut_ptr + e, mask=m, other=0).to(tl.int32)
    return tl.where(m, c, -1)


@_jit
def _class_hist_kernel(bits_ptr, lut_ptr, hist_ptr, n, shift, emask, K, KP: tl.constexpr, BLOCK: tl.constexpr):
    """hist[b, c] = #{i in [b*BLOCK, (b+1)*BLOCK) and i < n : cls[i] == c}, int32 [nblocks, K]."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = offs < n
    c = _classes(bits_ptr, lut_ptr, offs, m, shift, emask)
    ks = tl.arange(0, KP)
    onehot = (c[:, None] == ks[None, :]).to(tl.int32)  # [BLOCK, KP]; all zero on masked lanes
    tl.store(hist_ptr + pid * K + ks, tl.sum(onehot, axis=0), mask=ks < K)


@_jit
def _context_gather_kernel(
    bits_ptr, lut_ptr, base_ptr, slot_ptr, out_ptr, n, shift, emask, K, KP: tl.constexpr, BLOCK: tl.constexpr
):
    """out[i] = slot[base[b, cls[i]] + #{i' in block b, i' < i : cls[i'] == cls[i]}] for i in block b, i < n."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    m = offs < n
    c = _classes(bits_ptr, lut_ptr, offs, m, shift, emask)
    ks = tl.arange(0, KP)
    onehot = (c[:, None] == ks[None, :]).to(tl.int32)  # [BLOCK, KP]
    incl = tl.cumsum(onehot, axis=0)  # incl[t, k] = #{t' <= t : cls == k}
    local = tl.sum(incl * onehot, axis=1) - 1  # exclusive count of the element's own class
    base = tl.load(base_ptr + pid * K + ks, mask=ks < K, other=0)  # [KP] int64
    sidx = tl.sum(tl.where(onehot != 0, base[None, :], 0), axis=1) + local
    v = tl.load(slot_ptr + sidx, mask=m, other=-1)
    tl.store(out_ptr + offs, v, mask=m)


@_jit
def _tile(read_ptr, blk_ptr, tiles_ptr, t, BLOCK: tl.constexpr):
    """Tile ``t``: (its block's run index of each lane, the lane's offset in its run, the lane mask, the
    lane's index in ``bits``). ``blk``: per block, [its first row in ``read``, its run, its size]."""
    b = tl.load(tiles_ptr + 2 * t)
    q = tl.load(tiles_ptr + 2 * t + 1) + tl.arange(0, BLOCK).to(tl.int64)
    m = q < tl.load(blk_ptr + 3 * b + 2)
    run = tl.load(blk_ptr + 3 * b + 1)
    k = q // run
    r = tl.load(blk_ptr + 3 * b) + k
    w = q - k * run
    idx = tl.load(read_ptr + r, mask=m, other=0) + w
    return r, w, m, idx


@_jit
def _block_hist_kernel(
    bits_ptr, read_ptr, blk_ptr, tiles_ptr, lut_ptr, hist_ptr, shift, emask, K, KP: tl.constexpr, BLOCK: tl.constexpr
):
    """hist[t, c] = #{elements of tile t of class c}, int32 [tiles, K]."""
    t = tl.program_id(0).to(tl.int64)
    _r, _w, m, idx = _tile(read_ptr, blk_ptr, tiles_ptr, t, BLOCK)
    c = _classes(bits_ptr, lut_ptr, idx, m, shift, emask)
    ks = tl.arange(0, KP)
    onehot = (c[:, None] == ks[None, :]).to(tl.int32)
    tl.store(hist_ptr + t * K + ks, tl.sum(onehot, axis=0), mask=ks < K)


@_jit
def _block_find_kernel(
    bits_ptr,
    read_ptr,
    pos_rows_ptr,
    blk_ptr,
    tiles_ptr,
    lut_ptr,
    base_ptr,
    jlo_ptr,
    jhi_ptr,
    sidx_ptr,
    out_ptr,
    shift,
    emask,
    K,
    nsteps,
    KP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[j] = the reported position of the element whose sorted index is sidx[j], for the j of tile t."""
    t = tl.program_id(0).to(tl.int64)
    r, w, m, idx = _tile(read_ptr, blk_ptr, tiles_ptr, t, BLOCK)
    c = _classes(bits_ptr, lut_ptr, idx, m, shift, emask)
    ks = tl.arange(0, KP)
    onehot = (c[:, None] == ks[None, :]).to(tl.int32)
    sel = onehot != 0
    local = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    kk = ks < K
    base = tl.load(base_ptr + t * K + ks, mask=kk, other=0)
    lo = tl.sum(tl.where(sel, tl.load(jlo_ptr + t * K + ks, mask=kk, other=0)[None, :], 0), axis=1)
    hi = tl.sum(tl.where(sel, tl.load(jhi_ptr + t * K + ks, mask=kk, other=0)[None, :], 0), axis=1)
    s = tl.sum(tl.where(sel, base[None, :], 0), axis=1) + local
    cnt = hi - lo  # zero on masked lanes (no class)
    for _ in range(nsteps):  # lower bound of s in sidx[lo:hi]
        half = cnt // 2
        mid = lo + half
        v = tl.load(sidx_ptr + mid, mask=cnt > 0, other=0)
        go = (cnt > 0) & (v < s)
        lo = tl.where(go, mid + 1, lo)
        cnt = tl.where(go, cnt - half - 1, half)
    inside = m & (lo < hi)
    found = inside & (tl.load(sidx_ptr + lo, mask=inside, other=-1) == s)
    pos = tl.load(pos_rows_ptr + r, mask=found, other=0) + w
    tl.store(out_ptr + lo, pos, mask=found)


# ----------------------------------------------------------------------------- shared torch steps


def effective_mask(width: int, shift: int, emask: int) -> int:
    """``emask`` cut to the ``width - shift`` bits a logical shift leaves: then ``(b >> shift) & mask`` on
    sign-extended bits ``b`` (an arithmetic shift) equals ``(zext(b) >> shift) & emask``."""
    return emask & ((1 << (width - shift)) - 1)


def _prepare(bits: torch.Tensor, shift: int, emask: int, lut: torch.Tensor, ranks: torch.Tensor, starts: torch.Tensor):
    """Validated inputs on ``bits``' device: (bits 1-D int, width, K, lut, ranks int64, starts int64)."""
    if bits.dtype in INT_OF_FLOAT:
        bits = bits.view(INT_OF_FLOAT[bits.dtype])
    if bits.dtype not in WIDTH:
        raise TypeError(f"bits must be int8, int16 or int32 raw bits (or bf16/fp16/fp32), got {bits.dtype}")
    if bits.dim() != 1:
        raise ValueError(f"bits must be 1-D, got shape {tuple(bits.shape)}")
    width = WIDTH[bits.dtype]
    shift, emask = int(shift), int(emask)
    if not 0 <= shift < width or emask < 0:
        raise ValueError(f"shift {shift} / emask {emask} out of range for {width}-bit elements")
    if lut.dim() != 1 or lut.numel() < emask + 1 or lut.dtype not in (torch.uint8, torch.int32, torch.int64):
        raise ValueError(f"lut must be 1-D uint8/int32 of at least emask + 1 = {emask + 1} entries")
    if starts.dim() != 1 or starts.numel() < 2 or starts.numel() - 1 > KP:
        raise ValueError(f"starts must be 1-D of length K + 1 with 1 <= K <= {KP}")
    K = starts.numel() - 1
    dev = bits.device
    st = starts.to(torch.int64).cpu()
    if int(st[0]) != 0 or int(st[-1]) != ranks.numel() or bool((st[1:] < st[:-1]).any()):
        raise ValueError("starts must be non-decreasing from 0 to ranks.numel()")
    lut = lut.to(dev).contiguous()
    if lut.numel() and (int(lut.min()) < 0 or int(lut.max()) >= K):
        raise ValueError(f"lut has a class outside [0, {K})")
    return bits.contiguous(), width, K, lut, ranks.to(dev, torch.int64).reshape(-1), st.to(dev)


def _rank_classes(ranks: torch.Tensor, starts: torch.Tensor, pop: torch.Tensor) -> torch.Tensor:
    """The class of each ``ranks[j]``; ValueError unless every class's ranks are strictly
    increasing in ``[0, pop[c])`` (one device sync)."""
    K = starts.numel() - 1
    R = ranks.numel()
    cls_j = torch.repeat_interleave(torch.arange(K, device=ranks.device), starts.diff(), output_size=R)
    if R == 0:
        return cls_j
    bad = (ranks < 0) | (ranks >= pop[cls_j])
    bad[1:] |= (cls_j[1:] == cls_j[:-1]) & (ranks[1:] <= ranks[:-1])
    if bool(bad.any()):
        j = int(bad.nonzero()[0, 0])
        c = int(cls_j[j])
        raise ValueError(
            f"rank {int(ranks[j])} (ranks[{j}]) of class {c}: not in [0, {int(pop[c])}) or not "
            "strictly increasing (wrong base or corrupt input)"
        )
    return cls_j


# ----------------------------------------------------------------------------- launchers


def class_hist(bits: torch.Tensor, shift: int, emask: int, lut: torch.Tensor, K: int) -> torch.Tensor:
    """Kernel A: int32 ``[nblocks, K]`` per-block class histogram of validated ``bits`` (1-D int8/int16/int32)."""
    n = bits.numel()
    nb = -(-n // BLOCK)
    hist = torch.empty(nb, K, dtype=torch.int32, device=bits.device)
    if nb:
        em = effective_mask(WIDTH[bits.dtype], shift, emask)
        _class_hist_kernel[(nb,)](bits, lut, hist, n, shift, em, K, KP=KP, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return hist


def _triton_positions(bits, width, K, shift, emask, lut, ranks, starts):
    n = bits.numel()
    dev = bits.device
    hist = class_hist(bits, shift, emask, lut, K).to(torch.int64)  # 1
    pop = hist.sum(0)  # 2
    off = torch.cumsum(pop, 0) - pop
    base = (torch.cumsum(hist, 0) - hist + off).contiguous()
    cls_j = _rank_classes(ranks, starts, pop)
    R = ranks.numel()
    if n == 0 or R == 0:
        return torch.empty(0, dtype=torch.int64, device=dev), torch.empty(0, dtype=torch.int64, device=dev)
    idt = torch.int32 if R < 2**31 else torch.int64
    slot = torch.full((n,), -1, dtype=idt, device=dev)  # 3
    slot[off[cls_j] + ranks] = torch.arange(R, dtype=idt, device=dev)
    out = torch.empty(n, dtype=idt, device=dev)  # 4
    _context_gather_kernel[(base.shape[0],)](
        bits,
        lut,
        base,
        slot,
        out,
        n,
        shift,
        effective_mask(width, shift, emask),
        K,
        KP=KP,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )
    pos = (out >= 0).nonzero().squeeze(1)  # 5
    return pos, out[pos].to(torch.int64)


# ----------------------------------------------------------------------------- torch reference


def reference_classes(bits: torch.Tensor, shift: int, emask: int, lut: torch.Tensor) -> torch.Tensor:
    """``cls`` (uint8) of validated 1-D int8/int16/int32 ``bits``: ``lut[(zext(bits) >> shift) & emask]``."""
    e = (bits.to(torch.int32) >> shift) & effective_mask(WIDTH[bits.dtype], shift, emask)
    return lut.to(torch.uint8).index_select(0, e)  # (index_select: ~4x faster than lut[e] on a CPU)


def reference_class_hist(bits: torch.Tensor, shift: int, emask: int, lut: torch.Tensor, K: int) -> torch.Tensor:
    """Kernel A's output in torch: int32 ``[nblocks, K]``."""
    n = bits.numel()
    nb = -(-n // BLOCK)
    cls = reference_classes(bits, shift, emask, lut).to(torch.int64)
    blk = torch.arange(n, device=bits.device) // BLOCK
    return torch.bincount(blk * K + cls, minlength=nb * K).view(nb, K).to(torch.int32)


def reference_context_positions(
    bits: torch.Tensor, shift: int, emask: int, lut: torch.Tensor, ranks: torch.Tensor, starts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`context_positions` in plain torch (any device): stable class sort, then ``order[off[c] + r]``."""
    bits, _width, K, lut, ranks, starts = _prepare(bits, shift, emask, lut, ranks, starts)
    return _torch_positions(bits, K, shift, emask, lut, ranks, starts)


def _torch_positions(bits, K, shift, emask, lut, ranks, starts):
    dev = bits.device
    cls = reference_classes(bits, shift, emask, lut)
    sorted_cls, order = torch.sort(cls, stable=True)  # order[s(i)] = i
    edges = torch.searchsorted(sorted_cls, torch.arange(K + 1, device=dev, dtype=torch.uint8))  # lut < K <= 16
    off = edges[:-1]
    pop = edges[1:] - off
    cls_j = _rank_classes(ranks, starts, pop)
    if ranks.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=dev), torch.empty(0, dtype=torch.int64, device=dev)
    pos, perm = torch.sort(order[off[cls_j] + ranks])
    return pos, perm


# ----------------------------------------------------------------------------- entry point


def context_positions(
    bits: torch.Tensor,
    shift: int,
    emask: int,
    lut: torch.Tensor,
    ranks: torch.Tensor,
    starts: torch.Tensor,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pos, src): pos int64 sorted increasing = the indices i of the changed elements (those whose
    within-class rank is listed for their class); src int64, same length: for each pos[k], the index j
    into `ranks` of its rank (so ranks[src[k]] is the rank of element pos[k] within class cls[pos[k]],
    and starts[cls[pos[k]]] <= src[k] < starts[cls[pos[k]]+1]). Raises ValueError if some rank of class
    c is >= the number of elements of class c (a wrong base or corrupt input), or if a class's ranks are
    negative or not strictly increasing.

    ``backend``: "triton" (the kernels; CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``),
    "torch" (:func:`reference_context_positions`), "auto" (triton when ``bits.is_cuda``, else torch).
    Results are on ``bits``' device.
    """
    if backend == "auto":
        backend = "triton" if bits.is_cuda else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    bits, width, K, lut, ranks, starts = _prepare(bits, shift, emask, lut, ranks, starts)
    if backend == "torch":
        return _torch_positions(bits, K, shift, emask, lut, ranks, starts)
    if triton is None:
        raise RuntimeError("backend 'triton' needs Triton installed")
    return _triton_positions(bits, width, K, shift, emask, lut, ranks, starts)


# ----------------------------------------------------------------------------- the blocked pass

INT_BITS = tuple(WIDTH)  # raw bits of fp8, 16- and 32-bit floats


def _host(a) -> torch.Tensor:
    if not isinstance(a, torch.Tensor):  # a cached block table is read-only: torch gets a copy of it (O(rows))
        a = torch.as_tensor(a if a.flags.writeable else a.copy())
    return a.to("cpu", torch.int64).reshape(-1)


def _prepare_blocks(bits, geo, shift, emask, lut, ranks, starts):
    if bits.dtype not in INT_BITS:
        bits = bits.view({1: torch.int8, 2: torch.int16, 4: torch.int32}.get(bits.element_size(), bits.dtype))
    if bits.dtype not in INT_BITS or bits.dim() != 1:
        raise TypeError(f"bits must be 1-D raw bits of 8, 16 or 32 bits, got {tuple(bits.shape)} {bits.dtype}")
    width = WIDTH[bits.dtype]
    shift, emask = int(shift), int(emask)
    if not 0 <= shift < width or emask < 0:
        raise ValueError(f"shift {shift} / emask {emask} out of range for {width}-bit elements")
    read, prow, row_ptr, run = (_host(a) for a in geo)
    S = run.numel()
    st = (
        starts.to("cpu", torch.int64)
        if isinstance(starts, torch.Tensor)
        else torch.as_tensor(starts, dtype=torch.int64)
    )
    if st.dim() != 2 or st.shape[0] != S or not 2 <= st.shape[1] <= KP + 1:
        raise ValueError(f"starts must be [blocks = {S}, K + 1] with 1 <= K <= {KP}")
    K = st.shape[1] - 1
    R = ranks.numel()
    flat = torch.cat([st[:, :K].reshape(-1), st[-1:, K]]) if S else torch.zeros(1, dtype=torch.int64)
    if (
        (S and (bool((st[1:, 0] != st[:-1, K]).any()) or int(flat[0]) != 0))
        or int(flat[-1]) != R
        or bool((flat[1:] < flat[:-1]).any())
    ):
        raise ValueError("starts must run block-major and non-decreasing from 0 to ranks.numel()")
    if (
        row_ptr.numel() != S + 1
        or read.numel() != prow.numel()
        or int(row_ptr[0]) != 0
        or int(row_ptr[-1]) != read.numel()
        or bool((row_ptr[1:] < row_ptr[:-1]).any())
        or bool((run < 1).any())
    ):
        raise ValueError("block geometry: row_ptr must index read_rows/pos_rows, every run at least one element")
    n = bits.numel()
    if read.numel() and (int(read.min()) < 0 or int((read + run.repeat_interleave(row_ptr.diff())).max()) > n):
        raise ValueError(f"block geometry: a run outside the {n} elements of bits")
    lut = lut.to(bits.device).contiguous()
    if lut.dim() != 1 or lut.numel() < emask + 1 or (lut.numel() and (int(lut.min()) < 0 or int(lut.max()) >= K)):
        raise ValueError(f"lut must be 1-D, at least emask + 1 = {emask + 1} entries, classes in [0, {K})")
    return (
        bits.contiguous(),
        width,
        K,
        lut,
        (read, prow, row_ptr, run),
        ranks.to(bits.device, torch.int64).reshape(-1),
        st,
    )


def block_positions(
    bits: torch.Tensor,
    geo,
    shift: int,
    emask: int,
    lut: torch.Tensor,
    ranks: torch.Tensor,
    starts,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocked pass (module docstring): ``(pos, src)``, ``pos`` the reported positions of the listed
    elements, increasing, and ``src[k]`` the index into ``ranks`` of ``pos[k]``'s rank; on ``bits``' device.
    ``geo`` = ``(read_rows, pos_rows, row_ptr, run)``, host int64 arrays (numpy or torch).
    ValueError for a rank beyond its (block, class) population, or ranks not strictly increasing within one.

    ``backend``: "triton" (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``), "torch"
    (:func:`reference_block_positions`, any device), "auto" (triton when ``bits.is_cuda``)."""
    if backend == "auto":
        backend = "triton" if bits.is_cuda else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    bits, width, K, lut, host, ranks, st = _prepare_blocks(bits, geo, shift, emask, lut, ranks, starts)
    if backend == "torch":
        return _torch_block_positions(bits, K, shift, emask, lut, host, ranks, st)
    if triton is None:
        raise RuntimeError("backend 'triton' needs Triton installed")
    return _triton_block_positions(bits, width, K, shift, emask, lut, host, ranks, st)


def _group_checks(ranks, st, pop):
    """(a device flag: some rank beyond its group or out of order, sidx) for ranks grouped by ``st``."""
    S, K = pop.shape
    dev = ranks.device
    counts = (st[:, 1:] - st[:, :-1]).reshape(-1)
    g = torch.repeat_interleave(torch.arange(S * K), counts).to(dev)
    pop_flat = pop.reshape(-1)
    G = torch.cumsum(pop_flat, 0) - pop_flat
    bad = (ranks < 0) | (ranks >= pop_flat[g])
    bad[1:] |= (g[1:] == g[:-1]) & (ranks[1:] <= ranks[:-1])
    return bad.any(), G[g] + ranks


def _triton_block_positions(bits, width, K, shift, emask, lut, host, ranks, st):
    read, prow, row_ptr, run = host
    dev = bits.device
    S = run.numel()
    R = ranks.numel()
    size = run * row_ptr.diff()
    ntile = (size + BLOCK - 1) // BLOCK
    tile_block = torch.repeat_interleave(torch.arange(S), ntile)
    first = torch.cumsum(ntile, 0) - ntile
    q0 = (torch.arange(tile_block.numel()) - first[tile_block]) * BLOCK
    T = tile_block.numel()
    empty = torch.empty(0, dtype=torch.int64, device=dev)
    if T == 0 or R == 0:
        if R:
            raise ValueError(f"{R} ranks listed for a part with no elements (wrong base or corrupt input)")
        return empty, empty
    tiles = torch.stack([tile_block, q0], 1).to(dev)
    read_d, prow_d = read.to(dev), prow.to(dev)
    blk = torch.stack([row_ptr[:-1], run, size], 1).to(dev)  # per block: first row, run, size (_tile)
    em = effective_mask(width, shift, emask)
    hist = torch.empty(T, K, dtype=torch.int32, device=dev)
    _block_hist_kernel[(T,)](bits, read_d, blk, tiles, lut, hist, shift, em, K, KP=KP, BLOCK=BLOCK, num_warps=NUM_WARPS)
    hist = hist.to(torch.int64)
    tb = tile_block.to(dev)
    pop = torch.zeros(S, K, dtype=torch.int64, device=dev).index_add_(0, tb, hist)
    bad, sidx = _group_checks(ranks, st, pop)
    G = (torch.cumsum(pop.reshape(-1), 0) - pop.reshape(-1)).view(S, K)
    excl = torch.cumsum(hist, 0) - hist
    base = (G[tb] + excl - excl[first.to(dev)[tb]]).contiguous()
    jlo = torch.searchsorted(sidx, base).contiguous()
    jhi = torch.searchsorted(sidx, base + hist).contiguous()
    is_bad, most = torch.stack([bad.to(torch.int64), (jhi - jlo).max()]).tolist()  # the one sync before the pass
    if is_bad:
        raise ValueError(
            "a rank beyond its (block, class) population, or ranks not strictly increasing "
            "(wrong base or corrupt input)"
        )
    out = torch.full((R,), -1, dtype=torch.int64, device=dev)
    _block_find_kernel[(T,)](
        bits,
        read_d,
        prow_d,
        blk,
        tiles,
        lut,
        base,
        jlo,
        jhi,
        sidx,
        out,
        shift,
        em,
        K,
        int(most).bit_length(),
        KP=KP,
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )
    pos, src = torch.sort(out)
    if bool(pos[0] < 0):  # every listed rank lies in a tile of its block: none is left unfound
        raise ValueError("a listed rank was not found in its block")
    return pos, src


def reference_block_positions(bits, geo, shift, emask, lut, ranks, starts):
    """:func:`block_positions` in plain torch, block by block through :func:`reference_context_positions`' path."""
    return block_positions(bits, geo, shift, emask, lut, ranks, starts, backend="torch")


def _torch_block_positions(bits, K, shift, emask, lut, host, ranks, st):
    read, prow, row_ptr, run = host
    dev = bits.device
    pos, src = [], []
    for b in range(run.numel()):
        rr = read[row_ptr[b] : row_ptr[b + 1]]
        idx = (rr[:, None] + torch.arange(int(run[b]))[None, :]).reshape(-1).to(dev)
        a, z = int(st[b, 0]), int(st[b, K])
        p, s = _torch_positions(bits[idx], K, shift, emask, lut, ranks[a:z], (st[b] - a).to(dev))
        pr = prow[row_ptr[b] : row_ptr[b + 1]]
        rep = (pr[:, None] + torch.arange(int(run[b]))[None, :]).reshape(-1).to(dev)
        pos.append(rep[p])
        src.append(s + a)
    if not pos:
        if ranks.numel():
            raise ValueError(f"{ranks.numel()} ranks listed for a part with no blocks")
        return torch.empty(0, dtype=torch.int64, device=dev), torch.empty(0, dtype=torch.int64, device=dev)
    pos, order = torch.sort(torch.cat(pos))
    return pos, torch.cat(src)[order]


__all__ = [
    "BLOCK",
    "KP",
    "block_positions",
    "class_hist",
    "context_positions",
    "effective_mask",
    "reference_block_positions",
    "reference_class_hist",
    "reference_classes",
    "reference_context_positions",
]
