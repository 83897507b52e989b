"""The wgmma CUDA MLA decode (``mla_attn_decode_paged``) with its latent tiles brought by TMA, fp16 / bf16,
sm_90a: ``mla_cuda_wg``'s block (64 heads as two warpgroups; S split over the latent dims, partials exchanged
through shared memory; O split over the value dims), forced with the path switch
``cuda_mla_decode_kernel=wgt``; auto's choice where ``mla_cuda_wg``'s auto rule holds.

Why: in ``mla_cuda_wg`` every thread issues 9 ``cp.async`` a tile (its page looked up, its addresses formed) and
the block meets twice a tile (tile visible; partial scores). The wgmma prefill gained most where its copies left
the threads for TMA (wg2 -> wg2t, BENCHMARKS.md runs 15 -> 22); so did this one (run 23, H100, 128 heads: 0.55-0.59 of
fa3 against wg's 0.40-0.46; ncu at B64 x 8K: L2 throughput 89% -> 46%, issue slots busy 19% -> 37%). auto's choice
on sm_90a at 64+ heads (``WGT_BY_DEFAULT``) where ``mla_cuda_wgq`` (auto's first choice, from 16 heads) does not serve.

Design, where it differs from ``mla_cuda_wg``:

* A ring of ``NS = 5`` stages of ``TK = 32`` latent rows, 128-byte swizzled (``Sw128Layout``: ``DL / 64``
  column blocks of 32 rows x 128 bytes), unpadded; each stage's mbarrier after the ring.
* A tile is ``GROUPS`` = 4 key groups x ``DL / 64`` column blocks of TMA boxes (8 keys of one page x 64 dims:
  ``_tma_cuda.LatentPageMap``; 36 boxes at DeepSeek's 576). Lane 0 of warp ``w`` issues key group ``w % 4``'s
  boxes of its half of the column blocks (``w // 4``), the group's page looked up a tile ahead (off the warp's
  path to its GEMMs); none for groups at or past the split's keys. Thread 0 arms the stage's mbarrier with the
  bytes of the groups issued; every thread waits for the stage's fill (parity ``kt // NS``).
* One block barrier a tile, the partial-score exchange (``Ss`` double-buffered by tile parity, so the next tile's
  writes cannot overtake the partner's reads). Past it both warpgroups have waited for P V of tile ``kt - 1``
  (the score's wait completes it), so that tile's stage takes tile ``kt + NS - 1``: ``AHEAD = NS - 1`` tiles
  load while one computes.
* The score's B starts at the warpgroup's first k step ``wg * DL / 32``, inside a column block at 576 (4.5
  blocks a warpgroup): each k step's descriptor offset comes from its absolute index (``Sw128Layout.k_major``).
* A box brings whole 8-key groups, and a group past the split's keys is not issued (its rows hold an earlier
  tile's or never-written shared memory: NaN possible). So the V rows at or past the split's end of its last
  tile are zeroed after the wait (0 x NaN would poison O); K rows there are masked by the softmax's select.
* Where TMA cannot read the pool (pages not 16-byte aligned, or ``ps`` not a multiple of 8) the PrimFunc's host
  code runs ``mla_cuda_wg``'s kernel instead (``make_wg_body``).

Limits as data: ``wg_unserved``'s (the same block); ``wgt_unserved`` names this value.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..kernel_spec import forced as forced_path
from ..ops import MLA_ATTN_DECODE_PAGED, shape_values
from . import mla_cuda_wg as wgk
from ._abi import abi_prim_func
from ._common import LOG2E
from ._common_cuda import decode_splits
from ._mla_frame_cuda import make_split_frame
from ._mma_cuda import keep_extent
from ._tma_cuda import (MBAR_BYTES, SW128_ALIGN, LatentPageMap, mbar_expect_tx, mbar_init, mbar_wait,
                        sw128_pad, tma_load3)
from ._wgmma_cuda import (Sw128Layout, ld_shared_f32, proxy_fence, reg_fence, st_shared_f32, st_shared_zero16,
                          wg_attention_gemms, wg_commit, wg_fence, wg_wait0, wgmma)

_st_f32, _ld_f32, _zero16 = st_shared_f32, ld_shared_f32, st_shared_zero16


SWITCH, VALUE = "cuda_mla_decode_kernel", "wgt"
#: Heads a block, threads, keys a tile and ring stages; tiles loading while one computes.
ROWS, NT, TK, NS = wgk.ROWS, wgk.NT, 32, 5
AHEAD = NS - 1
#: 8-key box groups a tile (one box each per column block); the warps of a group split its column blocks.
GROUPS = TK // 8
WARPS_A_GROUP = NT // 32 // GROUPS
#: auto takes this kernel where ``mla_cuda_wg``'s auto rule takes that one (sm_90a, 64+ heads): at 128 heads it
#: ran 1.29-1.41x wg (H100, BENCHMARKS.md run 23: 0.55-0.59 of FlashInfer's fa3 against 0.40-0.46).
WGT_BY_DEFAULT = True


def wgt_unserved(spec) -> list[str]:
    """Why this kernel does not serve ``spec``: ``mla_cuda_wg.wg_unserved`` (the same block and limits)."""
    return wgk.wg_unserved(spec)


def use_wgt(spec) -> bool:
    """Whether ``mla_attn_decode_paged`` of ``spec`` runs this kernel: forced (raises with ``wgt_unserved``'s
    reasons where it does not serve), or auto (``WGT_BY_DEFAULT``) where ``mla_cuda_wg``'s auto rule holds."""
    choice = forced_path(spec.paths, SWITCH)
    return choice == VALUE or (WGT_BY_DEFAULT and choice == "auto" and wgk.use_wg(spec))


def smem_bytes(latent_dim: int) -> int:
    """Dynamic shared memory of a block (bytes): the ring, its mbarriers and the slack to a 1024-byte boundary."""
    return NS * TK * latent_dim * 2 + NS * MBAR_BYTES + SW128_ALIGN


def _make_tma_ops(H: int, DL: int, DV: int, dtype: str):
    """This kernel's own tile macros (boxes, tail, score with the exchange); ``mla_cuda_wg`` gives the rest."""
    NKS, DVH, SN = DL // 32, DV // 2, TK // 8 * 4
    NCB = DL // 64  # column blocks of a latent row
    HALF = (NCB + WARPS_A_GROUP - 1) // WARPS_A_GROUP  # column blocks a warp issues of its group
    TILE, LAY = TK * DL, Sw128Layout(DL, TK)
    wgg = wg_attention_gemms(dtype, s_steps=NKS, tk=TK, k_lay=LAY, dv=DVH, v_lay=LAY)

    def bar(smem, stage):
        return T.address_of(smem[NS * TILE + stage * (MBAR_BYTES // 2)])

    def group(tid):
        return T.truncmod(T.truncdiv(tid, 32), GROUPS)

    @T.macro
    def look_up(pg, page_values, pbase, ps, kbase, kend, tid):
        """An issuing lane: the page of its key group of the tile at ``kbase`` into ``pg[0]`` (none at or past
        ``kend``: the entry's page slots end there)."""
        if kbase + group(tid) * 8 < kend:
            pg[0] = page_values[pbase + T.truncdiv(kbase + group(tid) * 8, ps)]

    @T.macro
    def issue(smem, stage, pmap, page_values, pbase, ps, kbase, kend, pg, tid):
        """The boxes of the tile at ``kbase`` into ``stage`` (its mbarrier armed by thread 0 first), then the
        issuing lanes' pages of the next tile. Every thread calls it (tiles before ``kend`` only)."""
        if tid == 0:
            T.evaluate(mbar_expect_tx(bar(smem, stage), T.min(T.truncdiv(kend - kbase + 7, 8), GROUPS) * 8 * DL * 2))
        if T.truncmod(tid, 32) == 0:
            if kbase + group(tid) * 8 < kend:
                for i in T.unroll(HALF):
                    if T.truncdiv(tid, 32 * GROUPS) * HALF + i < NCB:
                        T.evaluate(tma_load3(
                            T.address_of(smem[stage * TILE + ((T.truncdiv(tid, 32 * GROUPS) * HALF + i) * TK
                                                              + group(tid) * 8) * 64]),
                            bar(smem, stage), pmap, (T.truncdiv(tid, 32 * GROUPS) * HALF + i) * 64,
                            T.truncmod(kbase + group(tid) * 8, ps), pg[0]))
            look_up(pg, page_values, pbase, ps, kbase + TK, kend, tid)

    @T.macro
    def zero_tail(smem, stage, kbase, kend, tid):
        """V rows (the first ``DV`` dims) of the tile at ``kbase`` at or past ``kend`` zeroed, made visible to
        wgmma (the exchange barrier publishes them before any P V)."""
        for it in T.unroll(TK * DV // 8 // NT):
            if kbase + T.truncdiv(it * NT + tid, DV // 8) >= kend:
                T.evaluate(_zero16(T.address_of(smem[stage * TILE + LAY.index(
                    T.truncdiv(it * NT + tid, DV // 8), T.truncmod(it * NT + tid, DV // 8) * 8)])))
        T.evaluate(proxy_fence())

    @T.macro
    def score(smem, Ss, kb, qf, sacc, oacc, pf, wg, t, buf):
        """This warpgroup's partial S of the tile at ``kb`` (k steps ``wg * NKS ..``), P V of the previous tile
        completed by the same wait, the partial published in ``Ss`` half ``buf``; ends after the block barrier."""
        T.evaluate(reg_fence(NKS * 4, T.address_of(qf[0])))
        T.evaluate(wg_fence())
        for ks in T.unroll(NKS):
            T.evaluate(wgmma(dtype, TK, 0, T.address_of(sacc[0]), T.address_of(qf[ks * 8]), T.address_of(smem[kb]),
                             *LAY.k_major(wg * NKS + ks), accumulate=ks > 0, swizzle=LAY.swizzle))
        T.evaluate(wg_commit())
        T.evaluate(wg_wait0())
        wgg.score_done(sacc, qf)
        wgg.pv_done(oacc, pf)
        for e in T.unroll(SN):
            T.evaluate(_st_f32(T.address_of(Ss[((buf * SN + e) * 2 + wg) * 128 + t]), sacc[e]))
        T.tvm_storage_sync("shared")

    @T.macro
    def add_partner(Ss, sacc, wg, t, buf):
        """The other warpgroup's partial S (float addition commutes: both hold the same S)."""
        for e in T.unroll(SN):
            sacc[e] = sacc[e] + _ld_f32(T.address_of(Ss[((buf * SN + e) * 2 + 1 - wg) * 128 + t]))

    @T.macro
    def accumulate(smem, kb, oacc, pf, wg):
        """Issue O (the warpgroup's value dims: column blocks ``wg * DVH / 64 ..``) += P V; left in flight."""
        wgg.pv_issue(oacc, pf, smem, kb + wg * (DVH // 64) * TK * 64)

    return bar, look_up, issue, zero_tail, score, add_partner, accumulate


def _make_block(H: int, DL: int, DV: int, dtype: str):
    """The per-thread block macro of ``make_split_frame`` (``pages`` = (pool, its tensor map))."""
    ops = wgk.make_tile_ops(H, DL, DV, dtype)
    load_q, softmax, finish, SN, ON, NKS = ops.load_q, ops.softmax, ops.finish, ops.sn, ops.on, ops.nks
    store, init = wgk.make_store(H, DV, dtype), wgk.make_init(ON)
    bar, look_up, issue, zero_tail, score, add_partner, accumulate = _make_tma_ops(H, DL, DV, dtype)
    TILE, SMEM = TK * DL, smem_bytes(DL) // 2

    @T.macro
    def block(q, pages, page_values, o, lse, ws, sm_scale, ps, at, n, keys):
        bx, g, sp, tid = at
        B, S = n
        k0, k1, pbase = keys
        smem_all = T.alloc_buffer((SMEM,), dtype, scope="shared.dyn")
        keep_extent(smem_all, SMEM)
        # The ring from the first 1024-byte boundary (the swizzle's period; SMEM has the slack).
        smem = T.decl_buffer((SMEM,), dtype, data=smem_all.data, elem_offset=sw128_pad(T.address_of(smem_all[0]), 2),
                             scope="shared.dyn")
        Ss = T.alloc_buffer((2 * SN * 2 * 128,), "float32", scope="shared")
        keep_extent(Ss, 2 * SN * 2 * 128)  # reached through addresses only
        qf = T.alloc_buffer((NKS * 8,), dtype, scope="local")
        sacc = T.alloc_buffer((SN,), "float32", scope="local")
        pf = T.alloc_buffer((SN,), dtype, scope="local")
        oacc = T.alloc_buffer((ON,), "float32", scope="local")
        m = T.alloc_buffer((2,), "float32", scope="local")
        lsum = T.alloc_buffer((2,), "float32", scope="local")
        st = T.alloc_buffer((3,), "float32", scope="local")
        pg = T.alloc_buffer((1,), "int32", scope="local")  # an issuing lane's page of the next tile issued
        wg: T.let[T.int32] = T.truncdiv(tid, 128)
        w: T.let[T.int32] = T.truncdiv(tid, 32)
        lane: T.let[T.int32] = T.truncmod(tid, 32)
        init(oacc, m, lsum)
        if lane == 0:
            look_up(pg, page_values, pbase, ps, k0, k1, tid)
        if tid == 0:
            for s in T.unroll(NS):
                T.evaluate(mbar_init(bar(smem, s), 1))
        load_q(qf, q, T.min(bx, T.max(B - 1, 0)), g * ROWS, wg, w, lane)
        T.tvm_storage_sync("shared")  # the mbarriers initialized before any box counts on one
        for s in T.unroll(AHEAD):
            if k0 + s * TK < k1:
                issue(smem, s, pages[1], page_values, pbase, ps, k0 + s * TK, k1, pg, tid)
        for kt in T.serial(T.truncdiv(k1 - k0 + TK - 1, TK)):
            T.evaluate(mbar_wait(bar(smem, T.truncmod(kt, NS)), T.truncmod(T.truncdiv(kt, NS), 2)))
            if k0 + (kt + 1) * TK > k1:
                zero_tail(smem, T.truncmod(kt, NS), k0 + kt * TK, k1, tid)
            score(smem, Ss, T.truncmod(kt, NS) * TILE, qf, sacc, oacc, pf, wg, T.truncmod(tid, 128), T.truncmod(kt, 2))
            # Past the barrier: tile kt - 1's stage is free (both warpgroups waited for its P V).
            if k0 + (kt + AHEAD) * TK < k1:
                issue(smem, T.truncmod(kt + AHEAD, NS), pages[1], page_values, pbase, ps, k0 + (kt + AHEAD) * TK, k1,
                      pg, tid)
            add_partner(Ss, sacc, wg, T.truncmod(tid, 128), T.truncmod(kt, 2))
            softmax(sacc, pf, m, lsum, oacc, st, k0 + kt * TK, k1, sm_scale * T.float32(LOG2E), lane)
            accumulate(smem, T.truncmod(kt, NS) * TILE, oacc, pf, wg)
        finish(oacc, pf)
        store(oacc, m, lsum, o, lse, ws[0], ws[1], bx, bx < B, g * ROWS, S, sp, wg, w, lane)

    return block


def mla_attn_decode_paged_wgt(spec):
    """``pagedkv_mla_attn_decode_paged`` on warpgroup tensor cores with TMA latent tiles (arguments:
    ``pagedkv.ops.OP_SPECS``), for a ``KernelSpec`` that ``wgt_unserved`` accepts (module docstring); the host code
    runs ``mla_cuda_wg``'s kernel where TMA cannot read the pool."""
    reasons = wgt_unserved(spec)
    if reasons:
        raise NotImplementedError(f"pagedkv.tir_kernels: {SWITCH}={VALUE}: the TMA wgmma CUDA MLA decode does not "
                                  f"serve {'; '.join(reasons)}")
    H, DV, DL, dtype = spec.num_qo_heads, spec.kv_lora_rank, spec.latent_dim, spec.dtype
    frame = make_split_frame(heads=H, dv=DV, groups=(H + ROWS - 1) // ROWS, threads=NT, tk=TK, dtype=dtype,
                             splits=decode_splits(spec), block=_make_block(H, DL, DV, dtype))
    body = wgk.make_tma_body(spec, frame, lambda _ps: LatentPageMap(DL))
    return abi_prim_func(MLA_ATTN_DECODE_PAGED, shape_values(spec), dtype, body, scheduled=True,
                         adapter="direct_max_kv_len", any_align=("pages",))


__all__ = ["AHEAD", "NS", "NT", "ROWS", "SWITCH", "TK", "VALUE", "WGT_BY_DEFAULT", "mla_attn_decode_paged_wgt",
           "smem_bytes", "use_wgt", "wgt_unserved"]
