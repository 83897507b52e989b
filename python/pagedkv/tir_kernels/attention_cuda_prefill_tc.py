"""Tensor-core CUDA prefill (``attn_prefill_ragged`` / ``attn_prefill_paged``), fp16 / bf16, sm_80+: the
plain (``apply_rope == 0``) kernel on ``mma.sync.m16n8k16`` (``_mma_cuda``), in one of the tiles ``TC_TILES``,
picked by the path switch ``cuda_prefill_kernel`` (``pagedkv.kernel_spec.SWITCHES``); which tile auto takes per
op is the selection table's (``pagedkv.kernel_table``: the ragged op wg1t on Hopper at head dim 128, else tc3; the
paged op wg2t there, else tc2; tcq for both at head dim 256); ``tc_unserved`` says which specs a tile serves.

Same ABI and semantics as the SIMT kernel (``attention_cuda.py``): base-2 LSE, bottom-right causal, sliding
window and soft cap through ``CudaVariant``, empty rows ``o = 0`` / ``lse = -1e30``, sm_scale an argument.

The kernel is assembled here (``make_prefill_tc``) from stages, each a factory of one ``@T.macro`` that takes the
kernel's compile-time parameters, declared once (``_prefill_tc_params.TcParams``):

* ``_prefill_tc_load``: the entry and tile of a block (``locate``), Q into registers or shared memory, the rows'
  softmax state;
* ``_prefill_tc_copy`` (cp.async) / ``_prefill_tma`` (TMA): the K / V tiles into shared memory;
* ``_prefill_tc_gemm``: S = Q K^T and O += P V on ``mma.sync`` (the wgmma tiles: ``_wgmma_cuda.wg_attention_gemms``);
* ``_prefill_tc_softmax``: masks, soft cap and the online softmax;
* ``_prefill_tc_loops``: the key-tile loop of each kind of tile;
* ``_prefill_tc_store``: the epilogue, o and lse (empty rows: o = 0, lse = ``EMPTY_LSE``).

Design (FlashAttention-2 style), one block per (query tile, kv head):

* A query tile is ``TQ = rows // G`` tokens x the ``G`` q heads of the kv head = up to ``rows`` *rows* (row
  ``r`` = token ``r // G``, head ``h*G + r % G``, as in the SIMT kernel), so one K/V tile serves the GQA group.
  Warp ``w`` owns ``mtiles`` m16 tiles, rows ``16 (w mtiles + mt) ..``.
* Key tiles of ``tk``: K as ``Ks[key, d]`` and V as ``Vs[key, d]`` (both row-major) in shared memory, rows
  padded by 8 elements so that each 8-lane phase of an ``ldmatrix`` (8 rows of 16 bytes) hits 32 distinct
  banks; loaded with ``cp.async`` (16-byte copies, commit / wait groups), zeros past the visible keys.
  Ragged q / k / v are views that may start at any element: when k or v does not start at a 16-byte aligned
  address (a block-uniform run-time test) the same schedule loads elements through registers instead
  (slower, same results); pages always take the 16-byte path.
* Two stages ("tc2", "tc3"): two K and two V buffers in one ``shared.dyn`` buffer (over 48 KB at D 128; TVM's
  CUDA launcher raises the function's dynamic shared-memory limit when a launch asks for 48 KB or more); K and V
  of tile ``kt + 1`` load during all of tile ``kt``, one barrier a tile.
* S = Q K^T: ``D/16 x tk/8`` MMAs per m16 tile and key tile into C fragments (fp32). Q in registers ("tc2":
  the A fragments of the warp's one m16 tile), the B fragments of two k steps per ``ldmatrix.x4``; or
  Q in shared memory ("tc3", two m16 tiles a warp: their A fragments would take 64 more registers), re-read
  per k step with one ``ldmatrix.x4`` per m16 tile, and the B fragments of two n tiles per ``ldmatrix.x4``,
  each used by both m16 tiles. Scores scaled by ``sm_scale * log2(e)`` in fp32 (base-2 softmax), masked /
  capped by ``CudaVariant``; online softmax per row (a row's scores live in the 4 lanes of a quad: two
  ``shfl_xor``); P rounded to the storage dtype *is* the A fragment of P V (the C layout of two adjacent n8
  tiles equals the A layout of one k16 step).
* O += P V: ``tk/16 x DV/8`` MMAs per m16 tile and key tile, the B fragments of two n tiles per
  ``ldmatrix.x4.trans`` of ``Vs``, used by every m16 tile of the warp.
* "wg2t" (sm_90a; auto there for the paged op at head dim 128): 128 rows as two warpgroups sharing each K / V
  tile (a warp's m16 tile is its quarter of an m64 tile: the A and D register layouts of ``wgmma`` are
  ``mma.sync``'s per warp, so Q, the softmax, P and O carry over); S by ``D/16`` ``wgmma`` m64n64k16 (A = Q in
  registers, B = K, K-major) and O by 4 m64n{DV}k16 (A = P, B = V, trans-b), two groups in flight per
  warpgroup: at tile kt it issues S of kt, then P V of kt - 1 (P kept in ``pfo``), waits for S alone
  (``wait_group 1``), runs the softmax of kt while P V runs, then waits for P V and applies O's factor
  (``rescale_o``; ``_prefill_tc_loops.make_overlap_loop``). Four stages of 64-key K / V tiles load two tiles ahead by TMA
  (``_prefill_tma``: one thread's boxes a tile, ragged; warp 0's lanes, paged), 128-byte swizzled
  (``_wgmma_cuda.Sw128Layout``, stages from the buffer's first 1024-byte boundary); every thread waits on the
  stage's mbarrier, and the block barrier still tells that every warp is done with the stage refilled next. The
  PrimFunc's host code encodes the tensor maps at each call where TMA can read the operands (16-byte aligned;
  pages of a multiple of 8 keys) and runs the op's first non-TMA default tile
  (``attention_cuda_prefill.tma_fallback``) otherwise. ``tools/wgmma_probe.cu`` measured wgmma at 968 TFLOP/s
  on the H200 against 647 for mma.sync. Probe (H200, 32/8/128 fp16, 2026-12-05): 0.341 / 0.581 / 4.75 ms at
  1x4K / 16x1K / 1x16K against tc3's 0.571 / 0.654 / 7.14; ptxas 170 registers (ragged) / 175 (paged), no spills.
* "wg1t" (sm_90a; auto there for the ragged op at head dim 128): "wg2t"'s loop on one warpgroup (64 rows)
  with three stages loading one tile ahead: 97 KB of shared memory, so two blocks share an SM and one block's
  softmax, entry search, first copies and stores can run under the other's GEMMs (wg2t: one block an SM, whose
  fixed costs nothing hides). Each K / V tile serves half wg2t's rows. Run 21 (H100, ratio to fa3): 0.708 /
  0.564 / 0.709 at 1x4K / 16x1K / 1x16K against wg2t's 0.693 / 0.516 / 0.720.
* O leaves through the stage buffer: each lane's O / sum into row-major staged rows, then consecutive threads
  copy consecutive 16 bytes of a token's G rows (element copies where o is not 16-byte aligned); a partial-state
  kernel's float32 o from the fragments.
* Causal tiles past the tile's last row are skipped (and, with a window, those before its first window).
* Grid as the SIMT kernel (virtual tiles, idle blocks run zero-trip loops); each warp finds the entry in rounds
  of 32 probes, one a lane (``locate``: one round up to 32 entries, where a binary search waits for log2 B loads).

The tiles (ptxas, sm_90a, no spills; registers ragged / paged; blocks an SM from registers (64K) and shared
memory (228 KB), H200):

======  ====  =======  ======  ==  ==============  =============  =====================  =================
tile    rows  threads  stages  tk  m16 tiles/warp  shared (D 128)  registers D 128 / D 64  blocks/SM D 128/64
======  ====  =======  ======  ==  ==============  =============  =====================  =================
tc2     128   256      2       64  1 (Q in regs)   69,632 dyn.    210/180, 136/155       1 / 1
tc3     128   128      2       32  2 (Q in smem)   69,632 dyn.    230/230, 161/162       2 / 3
tcq     128   256      2       32  1 (Q in smem)   135,168 (256)  235/242 at D 256       1 (D 256)
======  ====  =======  ======  ==  ==============  =============  =====================  =================

Head dim 96 runs on tc2 / tc3 (ptxas: 170 paged on tc2, 196 ragged on tc3; windowed + capped bf16 174 / 209): its
rows of 12 16-byte chunks do not divide the threads, so 16 keys (tc2; tc3: 8) are copied a pass by 192 (96)
threads while the others idle in the copies (``_prefill_tc_copy._Chunks``). Head dim 256 has a tile of its own,
"tcq": O takes 128 registers a lane, so Q moves to shared memory (tc3's k-step-outer score) and the key tiles
shrink to 32 (S and P take 24 registers).

"wg2t" (sm_90a): 132,128 bytes of dynamic shared memory at D 128, one block an SM; "wg1t" 99,352 bytes, two. The
D 128 numbers are those of the copies of ``_prefill_tc_copy`` (2026-12-05); the D 64 ones (table and below) are
older (``test_prefill_tc_compile.py`` / ``test_prefill_wg_compile.py`` hold the spill limits). ptxas moves
register-only work below a wgmma wait that nothing it depends on needs: the wgmma tiles store the row sums (which
depend on every exp) to a shared scratch word before the P V wait (``store_before_wait``), which keeps the softmax
in the overlap window. (D 64: the 8 / 8 / 64 bf16 spec; the windowed + capped D 64 one takes 156/142 on tc2 and
206/203 on tc3.) Every tile runs 8 warps an SM at D 128. Expected effect, not measured (the GPU
run decides):

* "tc3" vs "tc2": the same 128 rows and two stages, and every K / V fragment read from shared memory feeds
  both m16 tiles of a warp: with Q re-read each key tile, 24 KB of ldmatrix traffic per 128 MMAs of a warp
  (192 bytes an MMA, vs 256 for "tc2"), the lever if the kernel is bound by shared-memory bandwidth;
  the price is 32-key tiles (twice the softmax rescales of O and the barriers per key) to fit 255 registers.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..kernel_spec import wg_prefill_limits
from ..ops import shape_values
from ._mma_cuda import cp_async_wait, keep_extent
from ._prefill_tc_copy import make_kv_copies
from ._prefill_tc_gemm import make_accumulate, make_score
from ._prefill_tc_load import make_init_rows, make_load_q, make_load_q_smem, make_locate
from ._prefill_tc_loops import (
    make_issue_kv,
    make_next_tile,
    make_overlap_loop,
    make_two_stage_loop,
)
from ._prefill_tc_params import TcParams
from ._prefill_tc_softmax import make_rescale_o, make_softmax
from ._prefill_tc_store import make_store, make_store_staged
from ._prefill_tc_tiles import (
    TC_DTYPES,
    TC_MAX_DIM,
    TC_MAX_GROUP,
    TC_MAX_SMEM,
    TC_PAD,
    TC_TILES,
    TC_TK,
    WG_ARCH,
    TcTile,
    k_ldsm_index,
    k_ldsm_index_nt2,
    k_store_index,
    q_ldsm_index,
    v_ldsm_index,
    v_store_index,
)
from ._prefill_tma import make_tma, tma_maps
from ._variant_cuda import CudaVariant
from ._wgmma_cuda import wg_attention_gemms


def tc_unserved(spec, dv: int, tile: str, *, paged: bool = False) -> str | None:
    """Why the tensor-core prefill tile ``tile`` (``TC_TILES``) does not serve ``spec`` (value head dim ``dv``)
    for the paged op (``paged``) or the ragged one, or None when it does. Inline RoPE is not a reason: the
    PrimFunc runs the SIMT RoPE kernel when ``apply_rope == 1``."""
    d, g, cfg = spec.head_dim, spec.group_size, TC_TILES[tile]
    if cfg.wgmma and spec.target_arch != WG_ARCH:
        return (f"target arch {spec.target_arch or 'unknown'!r} (tile {tile!r} runs wgmma, which needs "
                f"{WG_ARCH}: build for Target({{'kind': 'cuda', 'arch': '{WG_ARCH}'}}))")
    if spec.dtype not in TC_DTYPES:
        return f"dtype {spec.dtype} (the tensor-core prefill takes {', '.join(TC_DTYPES)})"
    if cfg.wgmma and (why := wg_prefill_limits(d, dv)):
        return "; ".join(why)
    if d not in cfg.dims or dv not in cfg.dims:
        return f"head dims {d}/{dv} (tile {tile!r} takes qk and v dims in {cfg.dims})"
    if g > TC_MAX_GROUP:
        return f"GQA group {g} (the tensor-core prefill takes groups up to {TC_MAX_GROUP})"
    smem = cfg.smem_bytes(d, dv)
    if smem > TC_MAX_SMEM:
        return f"head dims {d}/{dv} with tile {tile!r}: {smem} bytes of shared memory"
    return None


def _params(op: str, spec, paged: bool, tile: str) -> TcParams:
    """The kernel's ``TcParams``; raises where the tile does not serve the spec (``tc_unserved``)."""
    d = spec.head_dim
    dv = d if paged else shape_values(spec)["Dv"]
    reason = tc_unserved(spec, dv, tile, paged=paged)
    if reason:
        raise NotImplementedError(f"pagedkv.tir_kernels: the tensor-core CUDA {op!r} kernel does not serve {reason}")
    p = TcParams(TC_TILES[tile], d, dv, spec.group_size, spec.num_kv_heads, spec.dtype, paged,
                 CudaVariant.from_spec(spec))
    cfg = p.tile
    if (p.qs and cfg.stages != 2) or (p.wg and (p.qs or cfg.warps % 4 or cfg.stages not in (3, 4))):
        raise NotImplementedError(f"pagedkv.tir_kernels: tile {tile!r}: Q in shared memory needs the two-stage "
                                  f"buffer; wgmma whole warpgroups with Q in registers and three or four stages")
    return p


def _make_tiles(p: TcParams, copies, tma):
    """``tiles(q, o, lse, fr, acc, rows, ti, kvb, h, tid, w, lane, causal, sm_scale)``: the tile's shared memory,
    its key-tile loop (``_prefill_tc_loops``) and the store of o and lse through it (storage-dtype o)."""
    D, DV, TK, QS, WG, cfg, dtype = p.d, p.dv, p.tk, p.qs, p.wg, p.tile, p.dtype
    softmax = make_softmax(p, defer=WG)
    score, accumulate = (None, None) if WG else (make_score(p), make_accumulate(p))
    load_q_smem = make_load_q_smem(p) if QS else None
    two_stage = overlap = None
    issue_kv = make_issue_kv(p, copies, tma)
    next_tile = make_next_tile(p, issue_kv, tma)
    store_staged = make_store_staged(p)
    if WG:  # S and O += P V on the warpgroup's m64 tile, K / V tiles as the TMA writes them (swizzled)
        wgg = wg_attention_gemms(dtype, s_steps=p.nks, tk=TK, k_lay=cfg.kv_layout(D), dv=DV,
                                 v_lay=cfg.kv_layout(DV))
        overlap = tma.tiles(make_overlap_loop(p, issue_kv, next_tile, softmax, make_rescale_o(p), wgg))
    else:
        two_stage = make_two_stage_loop(p, issue_kv, next_tile, score, softmax, accumulate)

    @T.macro
    def tiles(q, o, lse, fr, acc, rows, ti, kvb, h, tid, w, lane, causal, sm_scale):
        # One dynamic buffer (TVM 0.27 fails to merge several shared.dyn buffers here).
        smem = T.alloc_buffer((cfg.smem_bytes(D, DV) // 2,), dtype, scope="shared.dyn")
        keep_extent(smem, cfg.smem_bytes(D, DV) // 2)  # the launch's bytes (chunks: addresses)
        if QS:
            load_q_smem(smem, q, ti, h, tid)
        if WG:
            scratch = T.alloc_buffer((1,), "float32", scope="shared")
            overlap(smem, scratch, fr, acc, rows, ti, kvb, h, tid, causal, sm_scale)
        else:
            two_stage(smem, fr, acc, rows, ti, kvb, h, tid, w, lane, causal, sm_scale)
        if o.dtype == dtype:  # else (a float32 partial state) the blocks store from the fragments
            store_staged(smem, o, lse, acc[2], rows[0], rows[1], ti, h, tid, w, lane)

    return tiles


def _make_blocks(p: TcParams, copies, tiles):
    """``blocks(q, q_indptr, o, lse, kvb, B, n, causal, sm_scale)``: the grid, each thread's registers and the
    prologue, then ``tiles`` (``_make_tiles``) and, for a partial-state kernel's float32 o, the store of o and lse
    from the fragments."""
    MT, NKS, SN, ON, QS, TMA, dtype = p.mt, p.nks, p.sn, p.on, p.qs, p.wg, p.dtype
    locate, init_rows = make_locate(p, copies.kv_len), make_init_rows(p)
    load_q = None if QS else make_load_q(p)
    store = make_store(p)

    @T.macro
    def blocks(q, q_indptr, o, lse, kvb, B, n, causal, sm_scale):
        for vt in T.thread_binding(T.max(n // p.tq + B, 1), thread="blockIdx.x"):
            for h in T.thread_binding(p.hkv, thread="blockIdx.y"):
                for tid in T.thread_binding(p.nt, thread="threadIdx.x"):
                    ti = T.alloc_buffer((copies.ti_slots,), "int32", scope="local")
                    # A fragments: Q in registers (qf), or per k step from shared memory (afr, 32 bits).
                    qf = T.alloc_buffer((1 if QS else NKS * 8,), dtype, scope="local")
                    afr = T.alloc_buffer((MT * 4 if QS else 1,), "uint32", scope="local")
                    sacc = T.alloc_buffer((MT * SN,), "float32", scope="local")
                    pf = T.alloc_buffer((MT * SN,), dtype, scope="local")
                    # wgmma: P of the previous key tile (its P V in flight) and each row's deferred O factor
                    pfo = T.alloc_buffer((SN if p.wg else 1,), dtype, scope="local")
                    fac = T.alloc_buffer((2 if p.wg else 1,), "float32", scope="local")
                    # Two B fragments (ldmatrix.x4), 4 x 32 bits.
                    bfr = T.alloc_buffer((4,), "uint32", scope="local")
                    oacc = T.alloc_buffer((MT * ON,), "float32", scope="local")
                    m = T.alloc_buffer((MT * 2,), "float32", scope="local")
                    lsum = T.alloc_buffer((MT * 2,), "float32", scope="local")
                    lim = T.alloc_buffer((MT * 2,), "int32", scope="local")
                    st = T.alloc_buffer((3,), "float32", scope="local")
                    mx = T.alloc_buffer((MT * 2,), "float32", scope="local")
                    w: T.let[T.int32] = T.truncdiv(tid, 32)
                    lane: T.let[T.int32] = T.truncmod(tid, 32)
                    # No branch around the barriers: an idle block runs zero-trip loops, masked accesses.
                    # TVM sizes a local array by the elements it sees indexed, and ldmatrix / mma reach bfr
                    # (afr) through addresses only (bfr[0], bfr[2]): without these stores it would get 3 elements.
                    for e in T.unroll(4):
                        bfr[e] = T.uint32(0)
                    if QS:
                        for e in T.unroll(MT * 4):
                            afr[e] = T.uint32(0)
                    locate(ti, q_indptr, kvb, B, vt, causal, lane)
                    copies.prepare(ti, kvb, tid, not TMA)  # TMA tiles: no cp.async cursor
                    if not QS:
                        load_q(qf, q, ti, h, w, lane)
                    init_rows(lim, m, lsum, oacc, ti, w, lane, causal)
                    tiles(q, o, lse, (qf, afr, bfr), (sacc, pf, oacc, pfo), (m, lsum, lim, mx, st, fac), ti, kvb, h,
                          tid, w, lane, causal, sm_scale)
                    if o.dtype != dtype:
                        # A partial-state kernel's float32 o, which the storage-dtype stage buffer cannot hold:
                        # from the fragments, once this thread's copies are drained (as the staged store does).
                        T.evaluate(cp_async_wait(0))
                        store(o, lse, oacc, m, lsum, ti, h, w, lane)

    return blocks


def _make_host(p: TcParams, blocks, tma):
    """``kernel(q, q_indptr, o, lse, kvb, B, n, causal, sm_scale)``: ``blocks``, after the host code that encodes
    the TMA tiles' tensor maps at each call (the PrimFunc tested that TMA can read the operands: 16-byte aligned,
    paged: ``ps % 8 == 0``) and appends them to ``kvb``."""
    dtype, MAPS = p.dtype, tma.maps if p.wg else {}
    TMA_PAGED, TMA = p.wg and p.paged, p.wg

    @T.macro
    def kernel(q, q_indptr, o, lse, kvb, B, n, causal, sm_scale):
        if TMA_PAGED:
            pmap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
            T.call_packed("runtime.cuTensorMapEncodeTiled", pmap, dtype, 5, T.address_of(kvb[0][0, 0, 0, 0, 0]),
                          *MAPS["pmap"][1].encode_args(kvb[0].shape))
            blocks(q, q_indptr, o, lse, (kvb[0], kvb[1], kvb[2], kvb[3], kvb[4], pmap), B, n, causal, sm_scale)
        elif TMA:
            kmap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
            T.call_packed("runtime.cuTensorMapEncodeTiled", kmap, dtype, 3, T.address_of(kvb[0][0, 0, 0]),
                          *MAPS["kmap"][1].encode_args(kvb[0].shape))
            vmap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
            T.call_packed("runtime.cuTensorMapEncodeTiled", vmap, dtype, 3, T.address_of(kvb[1][0, 0, 0]),
                          *MAPS["vmap"][1].encode_args(kvb[1].shape))
            blocks(q, q_indptr, o, lse, (kvb[0], kvb[1], kvb[2], kmap, vmap), B, n, causal, sm_scale)
        else:
            blocks(q, q_indptr, o, lse, kvb, B, n, causal, sm_scale)

    return kernel


def make_prefill_tc(op: str, spec, paged: bool, tile: str):
    """The plain tensor-core kernel macro of a prefill PrimFunc (``paged`` selects the K/V source, ``tile`` the
    configuration of ``TC_TILES``), called as ``kernel(q, q_indptr, o, lse, kvb, B, n, causal, sm_scale)``: its
    stages (module docstring) made from one ``TcParams``."""
    p = _params(op, spec, paged, tile)
    tma = make_tma(p) if p.wg else None
    # TMA tiles take only the copies' tile info (entry, paged cursor slots), not their cp.async loads.
    copies = make_kv_copies(p)
    return _make_host(p, _make_blocks(p, copies, _make_tiles(p, copies, tma)), tma)


__all__ = ["tma_maps", "TC_DTYPES", "TC_MAX_DIM", "TC_MAX_GROUP", "TC_PAD", "TC_TILES", "TC_TK", "TcTile",
           "k_ldsm_index", "k_ldsm_index_nt2", "k_store_index", "make_prefill_tc", "q_ldsm_index", "tc_unserved",
           "v_ldsm_index", "v_store_index"]
