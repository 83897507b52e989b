"""Warpgroup tensor-core CUDA MLA decode (``mla_attn_decode_paged``) and paged prefill, fp16 / bf16, sm_90a, on
``wgmma`` (``_wgmma_cuda``), with its latent tiles copied by ``cp.async``: the kernel that ``mla_cuda_wgq``'s
PrimFunc runs where TMA cannot read the page pool (not 16-byte aligned, or pages not a multiple of 8 keys;
``make_tma_body``), not a value of the path switch ``cuda_mla_decode_kernel`` of its own. Semantics are
``mla_cuda``'s (base-2 lse, float32 accumulation, ``o = 0`` / ``lse = -1e30`` for a row that sees no key, keys at
or past the length never read).

Why: at 128 heads the decode is compute-bound, and the ``mma.sync`` kernel (``mla_cuda_tc``) holds 32 heads a
block at its register limit, re-reading every latent tile from L2 once per 32 heads. A warpgroup's
``wgmma`` takes 64 heads as one m64 tile, its B operand straight from shared memory.

Design: one block of two warpgroups (256 threads) per (64-head group, entry, key split):

* Key tiles of ``TK = 32`` latent rows (all ``DL`` elements) in a ring of ``NS = 5`` stages of dynamic
  shared memory, stored as 8 x 8 core matrices with 16 bytes of padding after each (``tile_layout``), loaded
  with 16-byte ``cp.async``: thread ``t`` copies key ``t // 8`` (its page looked up when the previous tile was issued: the
  load's latency off the warp's path to its GEMMs), chunks ``t % 8 + 8 it``,
  so 8 consecutive threads read 128 contiguous bytes of a latent row (whole L2 sectors) and write them to 8
  different shared-memory bank groups.
* S = Q K^T split over the latent dims: warpgroup ``g`` holds Q's A fragments of dims ``DL / 2 * g ..`` in
  registers (72 at DeepSeek's 576) and computes the partial scores of all 64 rows x 32 keys with
  ``DL / 32`` wgmma m64n32k16 (B = the tile, K-major). The two partials meet in a static shared array
  ``Ss`` (thread ``t`` of each warpgroup holds the same fragment positions); each warpgroup adds the other's,
  so both hold the same full S (float addition commutes: bit-identical).
* Online softmax in registers on both warpgroups (a row's scores in the 4 lanes of a quad), identical on
  each: P in the storage dtype is the A fragment of P V (as in the prefill kernels).
* O += P V split over the value dims: warpgroup ``g`` owns dims ``DV / 2 * g ..`` (``DV / 4`` fp32
  accumulators a thread: 128 at 512), ``TK / 16`` wgmma m64n{DV/2}k16 (A = P, B = the tile's first ``DV``
  columns, MN-major), issued and left in flight: the next tile's score waits for it (the tile switch, its
  barrier and copies, and the next S's issue run meanwhile), so ``AHEAD = NS - 2`` tiles load ahead.
* Two barriers a tile: the top one (tile visible, after ``fence.proxy.async``; the stage that tile
  ``kt + AHEAD`` takes is free) and the one publishing the partial scores.
* Splits: as ``mla_cuda_tc`` (``wave_split_count``, one block an SM; the runtime's ``max_kv_len``);
  ``S > 1``: partial states in a float32 workspace and ``mla_cuda``'s merge kernel.

Resources (ptxas, sm_90a, DeepSeek 512 + 64, no spills, no stack): 254 registers (128 heads fp16; 255 at 16
heads bf16), 207,360 bytes
of dynamic + 16,384 of static shared memory; one block an SM. H200: runs 15-17 (BENCHMARKS.md, when it was forced
on its own), GPU suite (as ``mla_cuda_wgq``'s fallback).

Code: the block's compile-time parameters are one frozen ``WgShape``; each stage is a factory of it returning
``@T.macro`` s (``make_load``: page lookups and copies, ``make_load_q``, ``make_score``, ``make_softmax``,
``make_accumulate``), bundled by ``make_tile_ops`` as the named tuple ``WgTileOps``;
the store's lse and row scale are ``_epilogue_cuda``'s (``make_store``: this kernel's and wgq's).

Limits as data (``wg_unserved``): target arch sm_90a, fp16 / bf16, ``DL % 64 == 0`` and ``DL <= 576``,
``DV / 2`` a wgmma width (``WG_NS``: DV 128, 256 or 512).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from tvm.script import tirx as T

from ..kernel_spec import PATH_ARCHS
from ..ops import MLA_ATTN_DECODE_PAGED
from ._common import EMPTY_LSE, LOG2E, MASKED
from ._common_cuda import decode_splits, shfl_xor
from ._epilogue_cuda import make_put_lse, row_lse, row_scale
from ._mla_frame_cuda import make_frame
from ._mma_cuda import a_frag, c_frag, cp_async16, cp_async_commit, cp_async_wait, keep_extent
from ._wgmma_cuda import WG_CORE_PAD, WG_NS, CoreLayout, proxy_fence, wg_attention_gemms, wg_wait0

#: The arch its instructions need (that of ``mla_cuda_wgq``, whose PrimFunc holds it).
WG_ARCH = PATH_ARCHS[("cuda_mla_decode_kernel", "wgq")]
#: Heads a block (one m64 tile), threads (two warpgroups), keys a tile, ring stages.
ROWS, NT, TK, NS = 64, 256, 32, 5
#: Tiles loading while one computes: P V of tile kt is waited for in tile kt + 1, so its stage can be refilled
#: from tile kt + 2 on (by tile kt + NS).
AHEAD = NS - 2
WG_DTYPES = ("float16", "bfloat16")
WG_MAX_LATENT = 576


def wg_unserved(spec) -> list[str]:
    """Why this kernel does not serve ``spec`` (a ``KernelSpec``): [] when it does."""
    dl, dv, out = spec.latent_dim, spec.kv_lora_rank, []
    if spec.target_arch != WG_ARCH:
        out.append(f"target arch {spec.target_arch or 'unknown'!r} (wgmma needs {WG_ARCH}: build for "
                   f"Target({{'kind': 'cuda', 'arch': '{WG_ARCH}'}}))")
    if spec.dtype not in WG_DTYPES:
        out.append(f"dtype {spec.dtype} (it takes {', '.join(WG_DTYPES)})")
    if dl % 64 or dl > WG_MAX_LATENT:
        out.append(f"latent dim {dl} (it takes multiples of 64 up to {WG_MAX_LATENT}: 8 threads a key row of "
                   f"whole core matrices, two warpgroups of whole k steps, the ring in shared memory)")
    if dv % 16 or dv // 2 not in WG_NS or dv > dl:
        out.append(f"kv_lora_rank {dv} (it takes 2 x a wgmma width of {WG_NS}, up to the latent dim)")
    return out


def tile_layout(latent_dim: int) -> CoreLayout:
    """A ring stage's ``TK`` latent rows: core matrices padded by ``WG_CORE_PAD`` (row-major copies without
    bank conflicts)."""
    return CoreLayout(latent_dim, WG_CORE_PAD)


def smem_bytes(latent_dim: int) -> int:
    """Dynamic shared memory of a block (bytes): the ring's ``NS`` tiles of ``TK`` latent rows."""
    return 2 * NS * tile_layout(latent_dim).elems(TK)


@dataclasses.dataclass(frozen=True)
class WgShape:
    """The block's compile-time parameters, declared once for its stages: ``heads`` query heads, ``latent`` dims
    of Q and of a latent row, ``dv`` value dims (a latent row's first), the storage ``dtype``; and the per-thread
    counts derived from them."""

    heads: int
    latent: int
    dv: int
    dtype: str

    @property
    def kh(self) -> int:
        """Score dims of a warpgroup (its half of the latent)."""
        return self.latent // 2

    @property
    def dvh(self) -> int:
        """Value dims of a warpgroup (its half of O)."""
        return self.dv // 2

    @property
    def nks(self) -> int:
        """k16 steps of a warpgroup's score."""
        return self.kh // 16

    @property
    def nsn(self) -> int:
        """n8 key tiles of a tile's S."""
        return TK // 8

    @property
    def ndn(self) -> int:
        """n8 tiles of a warpgroup's O."""
        return self.dvh // 8

    @property
    def sn(self) -> int:
        """S accumulators a thread."""
        return self.nsn * 4

    @property
    def on(self) -> int:
        """O accumulators a thread."""
        return self.ndn * 4

    @property
    def lay(self) -> CoreLayout:
        return tile_layout(self.latent)

    def gemms(self):
        """S over a warpgroup's ``kh`` latent dims, O over its ``dvh`` value dims; a tile's rows are ``latent``
        elements (``_wgmma_cuda.wg_attention_gemms``)."""
        return wg_attention_gemms(self.dtype, s_steps=self.nks, tk=TK, k_lay=self.lay, dv=self.dvh, v_lay=self.lay)


class WgTileOps(NamedTuple):
    """``make_tile_ops``' per-tile macros and the per-thread counts: ``sn`` S and ``on`` O accumulators, ``nks``
    k steps of a warpgroup's score."""

    look_up: object
    issue: object
    load_q: object
    score: object
    softmax: object
    accumulate: object
    finish: object
    sn: int
    on: int
    nks: int


def make_load(sh: WgShape):
    """The load stage: ``(look_up, issue)``, a tile's page lookups and its ``cp.async`` copies into a ring stage."""
    CPR, LAY, dtype = sh.latent // 8, sh.lay, sh.dtype  # CPR: 16-byte chunks a latent row

    @T.macro
    def look_up(pg, page_values, pbase, ps, kbase, kend, tid):
        """The page of this thread's key (``tid // 8``) of the tile at ``kbase`` into ``pg[0]`` (none at or past
        ``kend``: the entry's page slots end there). ``issue`` looks up the next tile's after its copies: the
        load's latency then passes during a tile, not on the warp's path to its GEMMs."""
        if kbase + T.truncdiv(tid, 8) < kend:
            pg[0] = page_values[pbase + T.truncdiv(kbase + T.truncdiv(tid, 8), ps)]

    @T.macro
    def issue(smem, stage, pages, page_values, pbase, ps, kbase, kend, pg, tid):
        """Start copying keys ``kbase ..`` into stage ``stage`` (zeros at or past ``kend``), the key's page in
        ``pg[0]`` (``look_up``: tiles are issued in order, the first looked up by the caller); the caller
        commits."""
        # 8 consecutive threads on 128 contiguous bytes of one key row: whole L2 sectors, and (padded core
        # matrices) 8 different bank groups of shared memory.
        key: T.let[T.int32] = T.truncdiv(tid, 8)
        if kbase + key < kend:
            off: T.let[T.int32] = T.truncmod(kbase + key, ps)
            for it in T.unroll(CPR // 8):
                T.evaluate(cp_async16(
                    T.address_of(smem[stage * LAY.elems(TK) + LAY.index(key, (T.truncmod(tid, 8) + 8 * it) * 8)]),
                    T.address_of(pages[pg[0], 0, 0, off, (T.truncmod(tid, 8) + 8 * it) * 8])))
        else:
            for it in T.unroll(CPR // 8):
                for e in T.vectorized(8):
                    smem[stage * LAY.elems(TK) + LAY.index(key, (T.truncmod(tid, 8) + 8 * it) * 8) + e] = \
                        T.Cast(dtype, T.float32(0))
        look_up(pg, page_values, pbase, ps, kbase + TK, kend, tid)

    return look_up, issue


def make_load_q(sh: WgShape):
    """``load_q(qf, q, b, h0, wg, w, lane)``: Q's A fragments of a warpgroup's score dims in registers."""
    H, KH, NKS, dtype = sh.heads, sh.kh, sh.nks, sh.dtype

    @T.macro
    def load_q(qf, q, b, h0, wg, w, lane):
        """Q's A fragments of the warpgroup's dims, rows ``16 (w % 4) ..`` of the m64 tile; 0 past ``H``."""
        for ks in T.unroll(NKS):
            for i in T.unroll(8):
                qf[ks * 8 + i] = T.if_then_else(
                    h0 + T.truncmod(w, 4) * 16 + a_frag(lane, i)[0] < H,
                    q[b, T.min(h0 + T.truncmod(w, 4) * 16 + a_frag(lane, i)[0], H - 1),
                      wg * KH + ks * 16 + a_frag(lane, i)[1]], T.Cast(dtype, T.float32(0)))

    return load_q


def make_score(sh: WgShape):
    """``score(smem, Ss, kb, qf, sacc, oacc, pf, wg, t)``: a tile's full S, the warpgroups' halves exchanged."""
    KH, SN, LAY, wgg = sh.kh, sh.sn, sh.lay, sh.gemms()

    @T.macro
    def score(smem, Ss, kb, qf, sacc, oacc, pf, wg, t):
        """Full S of the tile at ``kb`` in ``sacc``: this warpgroup's partial by wgmma (its dims start ``KH / 8``
        core matrices in), the other's through ``Ss[e, g, t]`` (consecutive threads on consecutive words).
        Ends after a barrier both passed."""
        wgg.score(sacc, qf, smem, kb + LAY.index(0, wg * KH))
        wgg.pv_done(oacc, pf)  # the wait also completed the previous tile's P V
        for e in T.unroll(SN):
            Ss[(e * 2 + wg) * 128 + t] = sacc[e]
        T.tvm_storage_sync("shared")
        for e in T.unroll(SN):
            sacc[e] = sacc[e] + Ss[(e * 2 + 1 - wg) * 128 + t]

    return score


def make_softmax(sh: WgShape):
    """``softmax(sacc, pf, m, lsum, oacc, st, kbase, kend, scale2, lane)``: the online softmax of a thread's rows."""
    NSN, NDN, dtype = sh.nsn, sh.ndn, sh.dtype

    @T.macro
    def softmax(sacc, pf, m, lsum, oacc, st, kbase, kend, scale2, lane):
        """Online softmax of the thread's rows (C rows ``lane / 4`` and + 8): scaled to log2 units, keys at or
        past ``kend`` masked; O rescaled where the row's max moved; P in the storage dtype as the A fragments of
        P V."""
        for rr in T.unroll(2):
            st[0] = m[rr]
            for nt in T.unroll(NSN):
                for c in T.unroll(2):
                    sacc[nt * 4 + rr * 2 + c] = T.if_then_else(
                        kbase + nt * 8 + c_frag(lane, c)[1] < kend, sacc[nt * 4 + rr * 2 + c] * scale2,
                        T.float32(MASKED))
                    st[0] = T.max(st[0], sacc[nt * 4 + rr * 2 + c])
            st[0] = T.max(st[0], shfl_xor(st[0], 1))
            st[0] = T.max(st[0], shfl_xor(st[0], 2))
            st[1] = T.exp2(m[rr] - st[0])
            m[rr] = st[0]
            lsum[rr] = lsum[rr] * st[1]
            # The row's max unchanged (alpha exactly 1, most tiles once it settles): skip DV / 4 multiplies.
            if st[1] < T.float32(1):
                for dn in T.unroll(NDN):
                    for c in T.unroll(2):
                        oacc[dn * 4 + rr * 2 + c] = oacc[dn * 4 + rr * 2 + c] * st[1]
            for nt in T.unroll(NSN):
                for c in T.unroll(2):
                    st[2] = T.exp2(sacc[nt * 4 + rr * 2 + c] - st[0])
                    lsum[rr] = lsum[rr] + st[2]
                    pf[nt * 4 + rr * 2 + c] = T.Cast(dtype, st[2])

    return softmax


def make_accumulate(sh: WgShape):
    """The accumulate stage: ``(accumulate, finish)``, O += P V issued a tile and the last one completed."""
    DVH, LAY, wgg = sh.dvh, sh.lay, sh.gemms()

    @T.macro
    def accumulate(smem, kb, oacc, pf, wg):
        """Issue O (the warpgroup's value dims) += P V, V the first DV columns of the tile at ``kb`` (MN-major);
        waited for by the next tile's score (it runs during the tile switch) or by ``finish``."""
        wgg.pv_issue(oacc, pf, smem, kb + LAY.index(0, wg * DVH))

    @T.macro
    def finish(oacc, pf):
        """The last P V complete before O is stored."""
        T.evaluate(wg_wait0())
        wgg.pv_done(oacc, pf)

    return accumulate, finish


def make_tile_ops(H: int, DL: int, DV: int, dtype: str) -> WgTileOps:
    """The per-tile stages (load, Q, score, softmax, accumulate) of ``WgShape(H, DL, DV, dtype)``."""
    sh = WgShape(H, DL, DV, dtype)
    (look_up, issue), (accumulate, finish) = make_load(sh), make_accumulate(sh)
    return WgTileOps(look_up, issue, make_load_q(sh), make_score(sh), make_softmax(sh), accumulate, finish, sh.sn,
                     sh.on, sh.nks)


def make_init(ON: int):
    """The ``init`` macro of a block's running state: O's ``ON`` accumulators zero, the rows' max at
    ``EMPTY_LSE`` and their sums zero (this kernel's and ``mla_cuda_wgq``'s)."""

    @T.macro
    def init(oacc, m, lsum):
        for e in T.unroll(ON):
            oacc[e] = T.float32(0)
        for rr in T.unroll(2):
            m[rr] = T.float32(EMPTY_LSE)
            lsum[rr] = T.float32(0)

    return init


def make_store(H: int, DV: int, dtype: str):
    """The ``store`` macro: o / lse (``S == 1``) or the split's partial state in the workspace (``_epilogue_cuda``);
    warpgroup ``wg`` stores value dims ``wg * DV / 2 ..``, warpgroup 0 the lse (this kernel's and
    ``mla_cuda_wgq``'s)."""
    DVH = DV // 2
    NDN = DVH // 8
    put_lse = make_put_lse(H)

    @T.macro
    def store(oacc, m, lsum, o, lse, ws_o, ws_l, b, live, h0, S, sp, wg, w, lane):
        for rr in T.unroll(2):
            lsum[rr] = lsum[rr] + shfl_xor(lsum[rr], 1)
            lsum[rr] = lsum[rr] + shfl_xor(lsum[rr], 2)
        for rr in T.unroll(2):
            r: T.let[T.int32] = T.truncmod(w, 4) * 16 + c_frag(lane, rr * 2)[0]
            rl: T.let[T.float32] = row_scale(lsum[rr])
            lv: T.let[T.float32] = row_lse(m[rr], lsum[rr])
            if live and h0 + r < H:
                if wg == 0 and T.truncmod(lane, 4) == 0:
                    put_lse(lse, ws_l, lv, b, h0, r, S, sp)
                # One branch on S for the row, and the thread's two adjacent columns as one vector store: the
                # per-element branches and 2-byte stores made the block's epilogue an instruction-cache-missing
                # stretch of ~2000 instructions, 8% of wgq's time at 8K keys a block and most of it at 1K (run 25).
                if S == 1:
                    for dn in T.unroll(NDN):
                        for c in T.vectorized(2):
                            o[b, h0 + r, wg * DVH + dn * 8 + c_frag(lane, 0)[1] + c] = T.Cast(
                                o.dtype, oacc[dn * 4 + rr * 2 + c] * rl)
                else:
                    for dn in T.unroll(NDN):
                        for c in T.vectorized(2):
                            ws_o[(b * H + h0 + r) * S + sp, wg * DVH + dn * 8 + c_frag(lane, 0)[1] + c] = \
                                oacc[dn * 4 + rr * 2 + c] * rl

    return store


def make_tma_body(spec, frame, latent_map, op: str = MLA_ATTN_DECODE_PAGED):
    """The PrimFunc body macro of a TMA kernel (``mla_cuda_wgq``) for MLA attention
    op ``op``: host code that encodes the pool's tensor map at each call (its address and page count may change;
    ``latent_map(ps)``: the ``_tma_cuda.LatentPageMap`` of pages of ``ps`` keys) and runs ``frame`` (the variant's
    frame of ``op``, ``pages`` = (pool, its map)); where TMA cannot read the pool (not 16-byte aligned, or pages not
    a multiple of 8 keys), this kernel's body instead."""
    from ._tma_cuda import host_aligned16  # pylint: disable=import-outside-toplevel

    fallback, dtype = make_wg_body(spec, op), spec.dtype
    lead = 1 if op == MLA_ATTN_DECODE_PAGED else 2  # the op's arguments before the pages: q (and q_indptr)

    @T.macro
    def body(*args):  # the op's arguments, then dims (its page size second to last)
        if T.And(T.truncmod(args[-1][-2], 8) == 0, host_aligned16(T.address_of(args[lead][0, 0, 0, 0, 0]))):
            pmap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
            T.call_packed("runtime.cuTensorMapEncodeTiled", pmap, dtype, 3, T.address_of(args[lead][0, 0, 0, 0, 0]),
                          *latent_map(args[-1][-2]).encode_args(args[lead].shape))
            frame(*args[:lead], (args[lead], pmap), *args[lead + 1:])
        else:
            fallback(*args)

    return body


def make_wg_body(spec, op: str = MLA_ATTN_DECODE_PAGED):
    """The body macro of this kernel for MLA attention op ``op`` (``_mla_frame_cuda.make_frame``'s, arguments as
    ``abi_prim_func`` passes them), for a spec ``wg_unserved`` accepts: the fallback of the TMA kernel."""
    H = spec.num_qo_heads
    return make_frame(op, spec, make_wg_block(spec), groups=(H + ROWS - 1) // ROWS, threads=NT, tk=TK,
                      splits=decode_splits(spec))


def make_wg_block(spec):
    """The per-thread block macro of this kernel (``_mla_frame_cuda.make_split_frame``'s ``block``)."""
    H, DV, DL, dtype = spec.num_qo_heads, spec.kv_lora_rank, spec.latent_dim, spec.dtype
    look_up, issue, load_q, score, softmax, accumulate, finish, SN, ON, NKS = make_tile_ops(H, DL, DV, dtype)
    store, init = make_store(H, DV, dtype), make_init(ON)
    TILE = tile_layout(DL).elems(TK)  # elements a ring stage

    @T.macro
    def block(q, pages, page_values, o, lse, ws, sm_scale, ps, at, n, keys):
        """A block's work (``_mla_frame_cuda.make_split_frame``): keys ``[k0, k1)`` of entry ``bx`` for head
        group ``g``, as split ``sp`` of ``S``."""
        bx, g, sp, tid = at
        B, S = n
        k0, k1, pbase = keys
        smem = T.alloc_buffer((smem_bytes(DL) // 2,), dtype, scope="shared.dyn")
        keep_extent(smem, smem_bytes(DL) // 2)  # its launch bytes: every cp.async / wgmma chunk whole
        Ss = T.alloc_buffer((SN * 2 * 128,), "float32", scope="shared")
        qf = T.alloc_buffer((NKS * 8,), dtype, scope="local")
        sacc = T.alloc_buffer((SN,), "float32", scope="local")
        pf = T.alloc_buffer((SN,), dtype, scope="local")
        oacc = T.alloc_buffer((ON,), "float32", scope="local")
        m = T.alloc_buffer((2,), "float32", scope="local")
        lsum = T.alloc_buffer((2,), "float32", scope="local")
        st = T.alloc_buffer((3,), "float32", scope="local")
        pg = T.alloc_buffer((1,), "int32", scope="local")  # the page of the thread's key of the next tile issued
        wg: T.let[T.int32] = T.truncdiv(tid, 128)
        w: T.let[T.int32] = T.truncdiv(tid, 32)
        lane: T.let[T.int32] = T.truncmod(tid, 32)
        init(oacc, m, lsum)
        look_up(pg, page_values, pbase, ps, k0, k1, tid)
        load_q(qf, q, T.min(bx, T.max(B - 1, 0)), g * ROWS, wg, w, lane)
        # One copy group a tile (empty past the split's keys): waiting for all but the newest AHEAD - 1 groups
        # always means tile kt.
        for s in T.unroll(AHEAD):
            if k0 + s * TK < k1:
                issue(smem, s, pages, page_values, pbase, ps, k0 + s * TK, k1, pg, tid)
            T.evaluate(cp_async_commit())
        for kt in T.serial(T.truncdiv(k1 - k0 + TK - 1, TK)):
            T.evaluate(cp_async_wait(AHEAD - 1))
            T.evaluate(proxy_fence())  # this thread's copies and zero stores visible to wgmma
            # Tile kt visible; every warp done with Ss and, P V of tile kt - 2 waited for, with that tile's stage,
            # which tile kt + AHEAD takes.
            T.tvm_storage_sync("shared")
            if k0 + (kt + AHEAD) * TK < k1:
                issue(smem, T.truncmod(kt + AHEAD, NS), pages, page_values, pbase, ps, k0 + (kt + AHEAD) * TK, k1,
                      pg, tid)
            T.evaluate(cp_async_commit())
            score(smem, Ss, T.truncmod(kt, NS) * TILE, qf, sacc, oacc, pf, wg, T.truncmod(tid, 128))
            softmax(sacc, pf, m, lsum, oacc, st, k0 + kt * TK, k1, sm_scale * T.float32(LOG2E), lane)
            accumulate(smem, T.truncmod(kt, NS) * TILE, oacc, pf, wg)
        finish(oacc, pf)
        store(oacc, m, lsum, o, lse, ws[0], ws[1], bx, bx < B, g * ROWS, S, sp, wg, w, lane)

    return block


__all__ = ["AHEAD", "NS", "NT", "ROWS", "TK", "WG_DTYPES", "WG_MAX_LATENT", "make_init", "make_wg_body",
           "make_store", "make_tile_ops", "make_tma_body",
           "make_wg_block", "smem_bytes", "wg_unserved", "WgTileOps"]
#: The kernel's stages, each importable: factories of its block shape (and their named tuple).
__all__ += ["WgShape", "make_accumulate", "make_load", "make_load_q", "make_score", "make_softmax"]
