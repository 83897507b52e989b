"""Tensor-core CUDA prefill (``attn_prefill_ragged`` / ``attn_prefill_paged``), fp16 / bf16, sm_80+: the
plain (``apply_rope == 0``) kernel on ``mma.sync.m16n8k16`` (``_mma_cuda``), in one of the tiles ``TC_TILES``,
picked by the path switch ``cuda_prefill_kernel`` (``pagedkv.kernel_spec.SWITCHES``); which tile auto takes per
op is the selection table's (``pagedkv.kernel_table``: the ragged op wg1t on Hopper at head dim 128, else tc3; the
paged op wg2t there, else tc2; each falling back to tc); ``tc_unserved`` says which specs a tile serves.

Same ABI and semantics as the SIMT kernel (``attention_cuda.py``): base-2 LSE, bottom-right causal, sliding
window and soft cap through ``CudaVariant``, empty rows ``o = 0`` / ``lse = -1e30``, sm_scale an argument.

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
* One stage ("tc"): one K and one V buffer in static shared memory; K of tile ``kt + 1`` is in flight during
  the softmax and P V of ``kt``, V of ``kt + 1`` during the scores of ``kt + 1``; 4 barriers a tile. Two
  stages ("tc2", "tc3"): two of each in one ``shared.dyn`` buffer (over 48 KB at D 128; TVM's CUDA launcher
  raises the function's dynamic shared-memory limit when a launch asks for 48 KB or more); K and V of tile
  ``kt + 1`` load during all of tile ``kt``, one barrier a tile.
* S = Q K^T: ``D/16 x tk/8`` MMAs per m16 tile and key tile into C fragments (fp32). Q in registers ("tc",
  "tc2": the A fragments of the warp's one m16 tile), the B fragments of two k steps per ``ldmatrix.x4``; or
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
  (``rescale_o``; ``_prefill_wg_pipelines``). Four stages of 64-key K / V tiles load two tiles ahead by TMA
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
* O leaves through the stage buffer (multi-stage tiles): each lane's O / sum into row-major staged rows, then
  consecutive threads copy consecutive 16 bytes of a token's G rows (element copies where o is not 16-byte
  aligned); "tc" stores its fragments directly.
* Causal tiles past the tile's last row are skipped (and, with a window, those before its first window).
* Grid as the SIMT kernel (virtual tiles, idle blocks run zero-trip loops); each warp finds the entry in rounds
  of 32 probes, one a lane (``locate``: one round up to 32 entries, where a binary search waits for log2 B loads).

The tiles (ptxas, sm_90a, no spills; registers ragged / paged; blocks an SM from registers (64K) and shared
memory (228 KB), H200):

======  ====  =======  ======  ==  ==============  =============  =====================  =================
tile    rows  threads  stages  tk  m16 tiles/warp  shared (D 128)  registers D 128 / D 64  blocks/SM D 128/64
======  ====  =======  ======  ==  ==============  =============  =====================  =================
tc      64    128      1       64  1 (Q in regs)   34,816 static  176/208, 130/137       2 / 3
tc2     128   256      2       64  1 (Q in regs)   69,632 dyn.    210/180, 136/155       1 / 1
tc3     128   128      2       32  2 (Q in smem)   69,632 dyn.    230/230, 161/162       2 / 3
======  ====  =======  ======  ==  ==============  =============  =====================  =================

"wg2t" (sm_90a): 132,128 bytes of dynamic shared memory at D 128, one block an SM; "wg1t" 99,352 bytes, two. The
D 128 numbers are those of the copies of ``_prefill_tc_copy`` (2026-12-05); the D 64 ones (table and below) are
older (``test_prefill_tc_compile.py`` / ``test_prefill_wg_compile.py`` hold the spill limits). ptxas moves
register-only work below a wgmma wait that nothing it depends on needs: the wgmma tiles store the row sums (which
depend on every exp) to a shared scratch word before the P V wait (``store_before_wait``), which keeps the softmax
in the overlap window. (D 64: the 8 / 8 / 64 bf16 spec; the windowed + capped D 64 one takes 162/168 (20 bytes
spilled), 156/142 and 206/203.) Every tile runs 8 warps an SM at D 128. Expected effect, not measured (the GPU
run decides):

* "tc2" vs "tc": each K/V tile fetched from L2 serves 128 rows instead of 64 (half the L2 -> SM bytes and
  cp.async work per row), the next tile loads during a whole tile, and a tile has one barrier for 8 warps
  instead of 4 for 4. The shared-memory reads per MMA are unchanged (one ``ldmatrix.x4``, 512 bytes, per 2
  MMAs), and at D 64 it holds 8 warps an SM where "tc" holds 12.
* "tc3" vs "tc2": the same 128 rows and two stages, and every K / V fragment read from shared memory feeds
  both m16 tiles of a warp: with Q re-read each key tile, 24 KB of ldmatrix traffic per 128 MMAs of a warp
  (192 bytes an MMA, vs 256 for "tc" / "tc2"), the lever if the kernel is bound by shared-memory bandwidth;
  the price is 32-key tiles (twice the softmax rescales of O and the barriers per key) to fit 255 registers.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..kernel_spec import wg_prefill_limits
from ..ops import shape_values
from ._common import EMPTY_LSE, LOG2E
from ._common_cuda import ballot, popc, shfl_xor
from ._mma_cuda import (
    a_frag,
    aligned16,
    c_frag,
    cp_async16,
    cp_async_wait,
    keep_extent,
    ldmatrix_x4,
    mma_sync,
)
from ._prefill_tc_tiles import (
    TC_DTYPES,
    TC_HEAD_DIMS,
    TC_MAX_DIM,
    TC_MAX_GROUP,
    TC_MAX_SMEM,
    TC_PAD,
    TC_ROWS,
    TC_STATIC_SMEM,
    TC_TILES,
    TC_TK,
    TC_WROWS,
    WG_ARCH,
    TcTile,
    k_ldsm_index,
    k_ldsm_index_nt2,
    k_store_index,
    q_ldsm_index,
    v_ldsm_index,
    v_store_index,
)
from ._prefill_tc_copy import make_kv_copies
from ._prefill_tma import make_tma, tma_maps
from ._prefill_wg_pipelines import TileMacros, make_overlap
from ._variant_cuda import CudaVariant
from ._wgmma_cuda import wg_attention_gemms


def tc_unserved(spec, dv: int, tile: str = "tc", *, paged: bool = False) -> str | None:
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
    if d not in TC_HEAD_DIMS or dv not in TC_HEAD_DIMS:
        return (f"head dims {d}/{dv} (the tensor-core prefill takes qk and v dims in {TC_HEAD_DIMS}: the ones run "
                f"on the H200; 96 compiles but spills, others are untested)")
    if g > TC_MAX_GROUP:
        return f"GQA group {g} (the tensor-core prefill takes groups up to {TC_MAX_GROUP})"
    smem = cfg.smem_bytes(d, dv)
    if smem > (TC_STATIC_SMEM if cfg.stages == 1 else TC_MAX_SMEM):
        return f"head dims {d}/{dv} with tile {tile!r}: {smem} bytes of shared memory"
    return None


def make_prefill_tc(op: str, spec, paged: bool, tile: str = "tc"):
    """The plain tensor-core kernel macro of a prefill PrimFunc (``paged`` selects the K/V source, ``tile`` the
    configuration of ``TC_TILES``), called as ``kernel(q, q_indptr, o, lse, kvb, B, n, causal, sm_scale)``."""
    D, dtype, HKV = spec.head_dim, spec.dtype, spec.num_kv_heads
    DV = D if paged else shape_values(spec)["Dv"]
    reason = tc_unserved(spec, DV, tile, paged=paged)
    if reason:
        raise NotImplementedError(f"pagedkv.tir_kernels: the tensor-core CUDA {op!r} kernel does not serve {reason}")
    var = CudaVariant.from_spec(spec)
    WIN = var.has_window
    G = spec.group_size
    cfg = TC_TILES[tile]
    MT, QS = cfg.mtiles, cfg.q_in_smem  # m16 tiles a warp; Q in shared memory
    # wgmma: S and O by each warpgroup (Q in registers), P V of tile kt - 1 during the softmax of tile kt, K / V
    # tiles by TMA (128-byte swizzled, one mbarrier a stage).
    WG = TMA = cfg.wgmma
    TMA_PAGED = TMA and paged  # boxes of 8 keys of a page (a warp's lanes issue a tile's 32 boxes)
    if (QS and cfg.stages != 2) or (WG and (QS or cfg.warps % 4 or cfg.stages not in (3, 4))):
        raise NotImplementedError(f"pagedkv.tir_kernels: tile {tile!r}: Q in shared memory needs the two-stage "
                                  f"buffer; wgmma whole warpgroups with Q in registers and three or four stages")
    TQ = cfg.rows // G
    RV = TQ * G  # row slots holding a (token, head); the rest of the block's rows are padding
    TK, NT = cfg.tk, cfg.threads
    KS, VS = D + TC_PAD, DV + TC_PAD  # shared row strides (elements) of Ks and Vs
    NKS, NSN, NKK, NDN = D // 16, TK // 8, TK // 16, DV // 8
    SN, ON = NSN * 4, NDN * 4  # S and O accumulator elements of one m16 tile (a lane)

    def wrow(w, mt):
        """First row of m16 tile ``mt`` of warp ``w``."""
        return (w * MT + mt) * TC_WROWS

    KL, VL = cfg.kv_layout(D), cfg.kv_layout(DV)  # wgmma: K / V tiles as the TMA writes them (swizzled)
    tma = make_tma(cfg, spec, tile, d=D, dv=DV, dtype=dtype, paged=paged, vl=VL, threads=NT) if TMA else None

    def store_index(key, dim, c01):
        return k_store_index(key, dim, D) if c01 == 0 else v_store_index(key, dim, DV)

    # TMA tiles take only the copies' tile info (entry, paged cursor slots), not their cp.async loads.
    copies = make_kv_copies(tk=TK, threads=NT, dims=(D, DV), dtype=dtype, paged=paged, store_index=store_index)
    issue = copies.issue

    def row_ok(r, ti):
        """Row slot ``r`` holds a token of the tile (``ti[3]`` = tokens in the tile)."""
        return T.And(r < RV, T.truncdiv(r, G) < ti[3])

    @T.macro
    def locate(ti, q_indptr, kvb, B, vt, causal, lane):
        """Tile info ``ti``: 0 entry b, 1 qlen, 2 qt0 (first token of the tile in the entry), 3 tokens, 4 first
        token row of q, 5 kvlen, 6 keys any row sees, 7 first key tile (``copies.prepare`` sets the slots from
        ``_prefill_tc_copy.TI_KV0`` on). Entry b: the last one whose first virtual tile ``q_indptr[b] // TQ + b``
        is <= vt (the SIMT kernel's grid), found by each warp in rounds of 32 probes (``ti[2]`` apart), one lane
        each, all loads in flight at once: one round up to 32 entries, two up to 1024 (a binary search waits for
        one dependent load a halving)."""
        ti[0] = 0
        ti[1] = B  # the entry is in [ti[0], ti[1])
        while ti[1] - ti[0] > 1:
            ti[2] = T.truncdiv(ti[1] - ti[0] + 31, 32)
            # Probes at or below vt: a prefix of the lanes (the first virtual tiles grow with b), lane 0 always.
            ti[3] = popc(ballot(T.if_then_else(
                ti[0] + lane * ti[2] < ti[1],
                T.truncdiv(q_indptr[T.min(ti[0] + lane * ti[2], B)], TQ) + ti[0] + lane * ti[2] <= vt, False)))
            ti[0] = ti[0] + (ti[3] - 1) * ti[2]
            ti[1] = T.min(ti[0] + ti[2], ti[1])
        ti[1] = T.if_then_else(B > 0, q_indptr[T.min(ti[0] + 1, B)] - q_indptr[ti[0]], 0)
        ti[2] = vt - (T.truncdiv(q_indptr[ti[0]], TQ) + ti[0])  # tile of the entry (temporarily)
        ti[5] = T.if_then_else(T.And(ti[2] >= 0, ti[2] < T.truncdiv(ti[1] + TQ - 1, TQ)), 1, 0)  # active
        # Last query tile first (it sees the most keys under causal).
        ti[2] = (T.truncdiv(ti[1] + TQ - 1, TQ) - 1 - ti[2]) * TQ
        ti[3] = T.if_then_else(ti[5] > 0, T.min(TQ, ti[1] - ti[2]), 0)
        ti[4] = q_indptr[ti[0]] + ti[2]
        ti[5] = T.if_then_else(ti[5] > 0, copies.kv_len(kvb, ti[0]), 0)
        ti[6] = T.if_then_else(causal > 0, T.max(T.min(ti[5], ti[5] - ti[1] + ti[2] + ti[3]), 0), ti[5])
        ti[7] = var.first_tile(ti[5], ti[1], ti[2], ti[6], TK) if WIN else 0

    @T.macro
    def load_q(qf, q, ti, h, w, lane):
        """Q in registers (one m16 tile a warp): the warp's rows as A fragments, ``qf[ks*8 + i]`` = element
        ``a_frag(lane, i)`` of dims ``16 ks ..`` (storage dtype, unscaled: the scale is applied to the fp32
        scores); padding rows 0."""
        for ks in T.unroll(NKS):
            for i in T.unroll(8):
                if row_ok(wrow(w, 0) + a_frag(lane, i)[0], ti):
                    qf[ks * 8 + i] = q[ti[4] + T.truncdiv(wrow(w, 0) + a_frag(lane, i)[0], G),
                                       h * G + T.truncmod(wrow(w, 0) + a_frag(lane, i)[0], G),
                                       ks * 16 + a_frag(lane, i)[1]]
                else:
                    qf[ks * 8 + i] = T.Cast(dtype, T.float32(0))

    def q_row_loader(vec: bool):
        """The macro loading the block's Q rows into shared memory at ``q_base`` (row-major, stride D + TC_PAD;
        padding rows 0), once a block, consecutive threads on consecutive chunks of a row: ``vec``, 16-byte
        ``cp.async`` chunks, all in flight (they join the first key tile's group: its wait and barrier
        publish Q); else element loads through registers, 8 in flight a thread (q not 16-byte aligned)."""
        width = 8 if vec else 1
        per_row = D // width
        outer, inner = (1, cfg.rows * per_row // NT) if vec else (cfg.rows * per_row // NT // 8, 8)

        def at(it, tid):
            """(row, first dim) of chunk ``it`` of thread ``tid``."""
            return T.truncdiv(it * NT + tid, per_row), T.truncmod(it * NT + tid, per_row) * width

        @T.macro
        def load(smem, q, ti, h, tid):
            for it0 in T.serial(outer):
                for it1 in T.unroll(inner):
                    if row_ok(at(it0 * inner + it1, tid)[0], ti):
                        if vec:
                            T.evaluate(cp_async16(
                                T.address_of(smem[cfg.q_base(D, DV) + at(it0 * inner + it1, tid)[0] * KS
                                                  + at(it0 * inner + it1, tid)[1]]),
                                T.address_of(q[ti[4] + T.truncdiv(at(it0 * inner + it1, tid)[0], G),
                                               h * G + T.truncmod(at(it0 * inner + it1, tid)[0], G),
                                               at(it0 * inner + it1, tid)[1]])))
                        else:
                            smem[cfg.q_base(D, DV) + at(it0 * inner + it1, tid)[0] * KS + at(it0 * inner + it1, tid)[1]] = \
                                q[ti[4] + T.truncdiv(at(it0 * inner + it1, tid)[0], G),
                                  h * G + T.truncmod(at(it0 * inner + it1, tid)[0], G), at(it0 * inner + it1, tid)[1]]
                    else:
                        for e in T.vectorized(width):
                            smem[cfg.q_base(D, DV) + at(it0 * inner + it1, tid)[0] * KS
                                 + at(it0 * inner + it1, tid)[1] + e] = T.Cast(dtype, T.float32(0))

        return load

    q_rows_vec, q_rows_elem = q_row_loader(True), q_row_loader(False)

    @T.macro
    def load_q_smem(smem, q, ti, h, tid):
        """Q in shared memory (``q_row_loader``): 16-byte copies when q's first element is 16-byte aligned (rows
        of ``Hq * D`` elements keep it, as for k / v), else element loads."""
        if aligned16(T.address_of(q[0, 0, 0])) == 1:
            q_rows_vec(smem, q, ti, h, tid)
        else:
            q_rows_elem(smem, q, ti, h, tid)

    @T.macro
    def init_rows(lim, m, lsum, oacc, ti, w, lane, causal):
        """Row state of the lane's rows (``c_frag`` rows g and g + 8 of each m16 tile; index ``2 mt + rr``):
        bound, running max, sum, O."""
        for mt in T.unroll(MT):
            for rr in T.unroll(2):
                lim[mt * 2 + rr] = var.row_bound(row_ok(wrow(w, mt) + c_frag(lane, 2 * rr)[0], ti), ti[5], ti[1],
                                                 ti[2], T.truncdiv(wrow(w, mt) + c_frag(lane, 2 * rr)[0], G), causal)
                m[mt * 2 + rr] = T.float32(EMPTY_LSE)
                lsum[mt * 2 + rr] = T.float32(0)
        for e in T.unroll(MT * ON):
            oacc[e] = T.float32(0)

    @T.macro
    def issue_kv(smem, stage, kvb, ti, kt, h, tid):
        """Multi-stage: K and V of tile ``kt`` into stage ``stage``, one cp.async group; ``TMA``: its boxes
        (``_prefill_tma``)."""
        if TMA:
            tma.issue(smem, stage, kvb, ti, kt, h, tid)
        else:
            copies.issue_kv(smem, cfg.k_base(stage, D, DV), cfg.v_base(stage, D, DV), kvb, ti, kt, h, tid)

    # wgmma (``WG``): S and O += P V on the warpgroup's m64 tile, K / V tiles of D / DV-element rows.
    wgg = wg_attention_gemms(dtype, s_steps=NKS, tk=TK, k_lay=KL, dv=DV, v_lay=VL) if WG else None

    @T.macro
    def score(sacc, qf, afr, smem, kb, bfr, w, lane):
        """S (the warp's rows x 64 keys) = Q K^T on ``mma.sync``: C fragment ``mt * 8 + nt`` holds keys ``8 nt ..`` of
        m16 tile ``mt``. Q in registers (``qf``, one m16 tile): one ``ldmatrix.x4`` gives the B
        fragments of two k steps (``k_ldsm_index``). Q in shared memory: per k step one ``ldmatrix.x4`` of each m16 tile's A fragment
        into ``afr`` (``q_ldsm_index``), and one of the B fragments of two n tiles (``k_ldsm_index_nt2``) used
        by every m16 tile of the warp."""
        for e in T.unroll(MT * SN):
            sacc[e] = T.float32(0)
        if QS:
            # k step outer: the A fragments of one k step (4 registers a m16 tile) stay live across the keys.
            for ks in T.unroll(NKS):
                for mt in T.unroll(MT):
                    T.evaluate(ldmatrix_x4(T.address_of(afr[mt * 4]), T.address_of(
                        smem[cfg.q_base(D, DV) + q_ldsm_index(lane, wrow(w, mt), ks, D)]), False))
                for nt2 in T.unroll(NSN // 2):
                    T.evaluate(ldmatrix_x4(T.address_of(bfr[0]), T.address_of(
                        smem[kb + k_ldsm_index_nt2(lane, nt2, ks, D)]), False))
                    for mt in T.unroll(MT):
                        for u in T.unroll(2):
                            T.evaluate(mma_sync(dtype, T.address_of(sacc[mt * SN + (nt2 * 2 + u) * 4]),
                                                T.address_of(afr[mt * 4]), T.address_of(bfr[u * 2])))
        else:
            for ks2 in T.unroll(NKS // 2):
                for nt in T.unroll(NSN):
                    T.evaluate(ldmatrix_x4(T.address_of(bfr[0]), T.address_of(
                        smem[kb + k_ldsm_index(lane, nt, ks2, D)]), False))
                    for u in T.unroll(2):
                        T.evaluate(mma_sync(dtype, T.address_of(sacc[nt * 4]), T.address_of(qf[(ks2 * 2 + u) * 8]),
                                            T.address_of(bfr[u * 2])))

    def mask_scores(masked: bool):
        """The macro turning m16 tile ``mt``'s raw scores (of the lane) into log2-unit logits: scaled,
        soft-capped and (``masked``) masked by ``CudaVariant`` (``logits(s, True)`` is the cap alone)."""

        @T.macro
        def scores(sacc, mx, m, lim, ti, kt, lane, causal, sm_scale, mt):
            # mx: the lane's running max of each row (folded in as each score is made: fewer live values)
            for rr in T.unroll(2):
                mx[mt * 2 + rr] = m[mt * 2 + rr]
                for nt in T.unroll(NSN):
                    for c in T.unroll(2):
                        sacc[mt * SN + nt * 4 + rr * 2 + c] = var.logits(
                            sacc[mt * SN + nt * 4 + rr * 2 + c] * (sm_scale * T.float32(LOG2E)),
                            var.visible(kt * TK + nt * 8 + c_frag(lane, c)[1], lim[mt * 2 + rr], ti[5], causal)
                            if masked else True)
                        mx[mt * 2 + rr] = T.max(mx[mt * 2 + rr], sacc[mt * SN + nt * 4 + rr * 2 + c])

        return scores

    scores_masked, scores_visible = mask_scores(True), mask_scores(False)

    def online_softmax(defer: bool):
        """The online-softmax macro; ``defer``: each row's O rescale factor goes to ``fac`` (``rescale_o``
        applies it once a P V in flight is complete) instead of being applied to ``oacc`` at once."""

        @T.macro
        def softmax(sacc, pf, m, lsum, oacc, fac, lim, mx, st, ti, kt, lane, causal, sm_scale):
            """Online softmax of the lane's rows (m16 tile ``mt``, ``rr``: C elements 2rr, 2rr + 1 of its
            fragments); a row's scores are spread over the 4 lanes of a quad. ``pf`` = P in the storage dtype,
            already laid out as the A fragments of P V (``pf[mt * SN + 8 kk + i]`` = C element ``i % 4`` of
            fragment ``2 kk + i // 4``)."""
            for mt in T.unroll(MT):
                if WIN:
                    scores_masked(sacc, mx, m, lim, ti, kt, lane, causal, sm_scale, mt)
                else:
                    # Without a window a row sees keys < lim: a tile below both rows' bounds needs no mask (the
                    # branch is per lane, with no shuffle inside; padding rows have lim 0, so they take the mask).
                    if (kt + 1) * TK <= T.min(lim[mt * 2], lim[mt * 2 + 1]):
                        scores_visible(sacc, mx, m, lim, ti, kt, lane, causal, sm_scale, mt)
                    else:
                        scores_masked(sacc, mx, m, lim, ti, kt, lane, causal, sm_scale, mt)
                for rr in T.unroll(2):
                    st[0] = T.max(mx[mt * 2 + rr], shfl_xor(mx[mt * 2 + rr], 1))
                    st[0] = T.max(st[0], shfl_xor(st[0], 2))
                    st[1] = T.exp2(m[mt * 2 + rr] - st[0])
                    m[mt * 2 + rr] = st[0]
                    lsum[mt * 2 + rr] = lsum[mt * 2 + rr] * st[1]
                    if defer:
                        fac[mt * 2 + rr] = st[1]
                    elif st[1] != T.float32(1):  # the max moved (else O times 1: skipped, same bits)
                        for dn in T.unroll(NDN):
                            for c in T.unroll(2):
                                oacc[mt * ON + dn * 4 + rr * 2 + c] = oacc[mt * ON + dn * 4 + rr * 2 + c] * st[1]
                    for nt in T.unroll(NSN):
                        for c in T.unroll(2):
                            st[2] = T.exp2(sacc[mt * SN + nt * 4 + rr * 2 + c] - st[0])
                            lsum[mt * 2 + rr] = lsum[mt * 2 + rr] + st[2]
                            pf[mt * SN + nt * 4 + rr * 2 + c] = T.Cast(dtype, st[2])

        return softmax

    softmax_now, softmax_deferred = online_softmax(False), online_softmax(True)

    @T.macro
    def rescale_o(oacc, fac):
        """O of the lane's rows times their deferred factors (``online_softmax(True)``); a row whose max did not
        move (factor 1, most rows after the first key tiles) skips its multiplies."""
        for mt in T.unroll(MT):
            for rr in T.unroll(2):
                if fac[mt * 2 + rr] != T.float32(1):
                    for dn in T.unroll(NDN):
                        for c in T.unroll(2):
                            oacc[mt * ON + dn * 4 + rr * 2 + c] = oacc[mt * ON + dn * 4 + rr * 2 + c] * fac[mt * 2 + rr]

    @T.macro
    def accumulate(oacc, pf, Vs, vb, bfr, lane):
        """O += P V on ``mma.sync``: k step ``kk`` (keys ``16 kk ..``) x n tiles ``2 dn2``, ``2 dn2 + 1`` (dims
        ``16 dn2 ..``), their B fragments from one ``ldmatrix.x4.trans`` of the row-major ``Vs``
        (``v_ldsm_index``), used by every m16 tile of the warp."""
        for kk in T.unroll(NKK):
            for dn2 in T.unroll(NDN // 2):
                T.evaluate(ldmatrix_x4(T.address_of(bfr[0]),
                                       T.address_of(Vs[vb + v_ldsm_index(lane, kk, dn2, DV)]), True))
                for mt in T.unroll(MT):
                    for u in T.unroll(2):
                        T.evaluate(mma_sync(dtype, T.address_of(oacc[mt * ON + (dn2 * 2 + u) * 4]),
                                            T.address_of(pf[mt * SN + kk * 8]), T.address_of(bfr[u * 2])))

    # Multi-stage tiles (STAGE_O) stage O in the stage buffer (row-major, stride VS) and copy it out row by row:
    # consecutive threads write consecutive 16 bytes (or, o not 16-byte aligned, elements) of a token's G rows,
    # which lie together in o. From the fragments, a warp's store touched 8 rows x 8 bytes: 8 sectors for 64 bytes, and
    # 64 two-byte stores a thread (wg1t's SASS, 2026-12-06).
    STAGE_O = cfg.stages > 1
    if STAGE_O and cfg.rows * VS > (cfg.bar_base(D, DV) if TMA else cfg.smem_bytes(D, DV) // 2):
        raise ValueError(f"pagedkv.tir_kernels: tile {cfg.name!r}: O's {cfg.rows} x {VS} staging elements do not "
                         f"fit its stages")

    def o_row(r):
        """Token row in o and head of block row ``r``."""
        return T.truncdiv(r, G), T.truncmod(r, G)

    def o_value(oacc, lsum, mt, rr, dn, c):
        return T.Cast(dtype, T.if_then_else(lsum[mt * 2 + rr] > T.float32(0),
                                            oacc[mt * ON + dn * 4 + rr * 2 + c] / lsum[mt * 2 + rr], T.float32(0)))

    @T.macro
    def store_lse(lse, m, lsum, ti, h, w, lane):
        """Row sums over the quad, then lse = m + log2(sum) (base 2) from the quad's first lane; a row that saw
        no key (sum 0) writes the empty state."""
        for j in T.unroll(MT * 2):
            lsum[j] = lsum[j] + shfl_xor(lsum[j], 1)
            lsum[j] = lsum[j] + shfl_xor(lsum[j], 2)
        for mt in T.unroll(MT):
            for rr in T.unroll(2):
                if T.And(row_ok(wrow(w, mt) + c_frag(lane, 2 * rr)[0], ti), lane % 4 == 0):
                    lse[ti[4] + o_row(wrow(w, mt) + c_frag(lane, 2 * rr)[0])[0],
                        h * G + o_row(wrow(w, mt) + c_frag(lane, 2 * rr)[0])[1]] = T.if_then_else(
                            lsum[mt * 2 + rr] > T.float32(0), m[mt * 2 + rr] + T.log2(lsum[mt * 2 + rr]),
                            T.float32(EMPTY_LSE))

    def o_copier(width: int):
        """The macro copying the staged O rows out, ``width`` elements a copy (8: 16 bytes)."""
        per_row = DV // width

        @T.macro
        def copy_out(smem, o, ti, h, tid):
            for it in T.unroll(cfg.rows * per_row // NT):
                if row_ok(T.truncdiv(it * NT + tid, per_row), ti):
                    for e in T.vectorized(width):
                        o[ti[4] + o_row(T.truncdiv(it * NT + tid, per_row))[0],
                          h * G + o_row(T.truncdiv(it * NT + tid, per_row))[1],
                          T.truncmod(it * NT + tid, per_row) * width + e] = \
                            smem[T.truncdiv(it * NT + tid, per_row) * VS + T.truncmod(it * NT + tid, per_row) * width + e]
        return copy_out

    o_out_vec, o_out_elem = o_copier(8), o_copier(1)

    @T.macro
    def store_staged(smem, o, lse, oacc, m, lsum, ti, h, tid, w, lane):
        """``store`` through the stage buffer: after a barrier (every warp done with the stages), each lane's
        O / sum into the staged rows, a barrier, then the rows out (``o_copier``). The staged rows reach past the
        stages into Q's rows: this thread's copies are drained first, since a block without key tiles never
        waited for its Q copies (they join the first tile's group), which could land on the staged O (wrong o
        rows of an entry with no keys, GPU suite on the H100; the emulated entry (120, 0))."""
        store_lse(lse, m, lsum, ti, h, w, lane)
        T.evaluate(cp_async_wait(0))
        T.tvm_storage_sync("shared")
        for mt in T.unroll(MT):
            for rr in T.unroll(2):
                for dn in T.unroll(NDN):
                    for c in T.unroll(2):
                        smem[(wrow(w, mt) + c_frag(lane, 2 * rr)[0]) * VS + dn * 8 + c_frag(lane, c)[1]] = \
                            o_value(oacc, lsum, mt, rr, dn, c)
        T.tvm_storage_sync("shared")
        if aligned16(T.address_of(o[0, 0, 0])) == 1:
            o_out_vec(smem, o, ti, h, tid)
        else:
            o_out_elem(smem, o, ti, h, tid)

    @T.macro
    def store(o, lse, oacc, m, lsum, ti, h, w, lane):
        """The one-stage tile: o = O / sum from each lane's fragments (a row that saw no key: 0), and
        ``store_lse``."""
        store_lse(lse, m, lsum, ti, h, w, lane)
        for mt in T.unroll(MT):
            for rr in T.unroll(2):
                if row_ok(wrow(w, mt) + c_frag(lane, 2 * rr)[0], ti):
                    for dn in T.unroll(NDN):
                        for c in T.unroll(2):
                            o[ti[4] + o_row(wrow(w, mt) + c_frag(lane, 2 * rr)[0])[0],
                              h * G + o_row(wrow(w, mt) + c_frag(lane, 2 * rr)[0])[1],
                              dn * 8 + c_frag(lane, c)[1]] = o_value(oacc, lsum, mt, rr, dn, c)

    @T.macro
    def tiles_one_stage(Ks, Vs, fr, acc, rows, ti, kvb, h, tid, w, lane, causal, sm_scale):
        """One buffer per operand, software-pipelined: K of tile kt + 1 loads during the softmax and P V of tile
        kt, V of kt + 1 during the scores of kt + 1. In flight at each wait: {K kt, V kt} at the top, {V kt,
        K kt + 1} before P V (wait_group 1 = the older is done). ``fr`` = (qf, afr, bfr), ``acc`` = (sacc,
        pf, oacc, pfo), ``rows`` = (m, lsum, lim, mx, st, fac): the kernel's register arrays."""
        issue(Ks, 0, kvb, ti, ti[7], h, tid, 0)
        issue(Vs, 0, kvb, ti, ti[7], h, tid, 1)
        for kt in T.serial(ti[7], T.truncdiv(ti[6] + TK - 1, TK)):
            T.evaluate(cp_async_wait(1))
            T.tvm_storage_sync("shared")  # K kt visible to every warp
            score(acc[0], fr[0], fr[1], Ks, 0, fr[2], w, lane)
            T.tvm_storage_sync("shared")  # every warp is done with Ks
            issue(Ks, 0, kvb, ti, kt + 1, h, tid, 0)  # past the last tile: zeros, never read
            softmax_now(acc[0], acc[1], rows[0], rows[1], acc[2], rows[5], rows[2], rows[3], rows[4], ti, kt, lane,
                        causal, sm_scale)
            T.evaluate(cp_async_wait(1))
            T.tvm_storage_sync("shared")  # V kt visible
            accumulate(acc[2], acc[1], Vs, 0, fr[2], lane)
            T.tvm_storage_sync("shared")  # every warp is done with Vs
            issue(Vs, 0, kvb, ti, kt + 1, h, tid, 1)

    @T.macro
    def next_tile(smem, ti, kvb, h, tid, kt):
        """Multi-stage top of key tile ``kt`` (in stage ``kt % stages``): wait for its copies, one barrier that
        both publishes it (and Q) and tells that every warp is done with the stage of tile ``kt + ahead -
        stages``, which then takes tile kt + ``ahead`` (past the last tile: zeros, never read). ``TMA``: the
        wait is on the stage's mbarrier, for its fill number ``(kt - first tile) // stages`` (parity)."""
        if TMA:
            tma.wait(smem, ti, kt, tid)
        else:
            T.evaluate(cp_async_wait(0))
        T.tvm_storage_sync("shared")
        issue_kv(smem, T.truncmod(kt + cfg.ahead, cfg.stages), kvb, ti, kt + cfg.ahead, h, tid)

    if WG:  # wgmma groups in flight across the softmax (_prefill_wg_pipelines), on the swizzle-aligned view
        macros = TileMacros(issue_kv, next_tile, softmax_deferred, rescale_o, wgg)
        tiles_tma = tma.tiles(make_overlap(cfg, D, DV, SN, macros))

    @T.macro
    def tiles_two_stage(smem, fr, acc, rows, ti, kvb, h, tid, w, lane, causal, sm_scale):
        """Two stages (tile kt in stage kt % 2): after the wait for tile kt, one barrier both publishes it and
        tells that every warp is done with tile kt - 1, whose stage then takes tile kt + 1, loading during
        the whole of tile kt (scores, softmax, P V). Arguments as ``tiles_one_stage``."""
        issue_kv(smem, T.truncmod(ti[7], 2), kvb, ti, ti[7], h, tid)
        for kt in T.serial(ti[7], T.truncdiv(ti[6] + TK - 1, TK)):
            next_tile(smem, ti, kvb, h, tid, kt)
            score(acc[0], fr[0], fr[1], smem, cfg.k_base(T.truncmod(kt, 2), D, DV), fr[2], w, lane)
            softmax_now(acc[0], acc[1], rows[0], rows[1], acc[2], rows[5], rows[2], rows[3], rows[4], ti, kt, lane,
                        causal, sm_scale)
            accumulate(acc[2], acc[1], smem, cfg.v_base(T.truncmod(kt, 2), D, DV), fr[2], lane)

    @T.macro
    def blocks(q, q_indptr, o, lse, kvb, B, n, causal, sm_scale):
        for vt in T.thread_binding(T.max(n // TQ + B, 1), thread="blockIdx.x"):
            for h in T.thread_binding(HKV, thread="blockIdx.y"):
                for tid in T.thread_binding(NT, thread="threadIdx.x"):
                    ti = T.alloc_buffer((copies.ti_slots,), "int32", scope="local")
                    # A fragments: Q in registers (qf), or per k step from shared memory (afr, 32 bits).
                    qf = T.alloc_buffer((1 if QS else NKS * 8,), dtype, scope="local")
                    afr = T.alloc_buffer((MT * 4 if QS else 1,), "uint32", scope="local")
                    sacc = T.alloc_buffer((MT * SN,), "float32", scope="local")
                    pf = T.alloc_buffer((MT * SN,), dtype, scope="local")
                    # overlap: P of the previous key tile (its P V in flight) and each row's deferred O factor
                    pfo = T.alloc_buffer((SN if WG else 1,), dtype, scope="local")
                    fac = T.alloc_buffer((2 if WG else 1,), "float32", scope="local")
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
                    if cfg.stages == 1:
                        Ks = T.alloc_buffer((TK * KS,), dtype, scope="shared")
                        Vs = T.alloc_buffer((TK * VS,), dtype, scope="shared")
                        keep_extent(Ks, TK * KS)  # declared sizes: chunks are reached through addresses
                        keep_extent(Vs, TK * VS)
                        tiles_one_stage(Ks, Vs, (qf, afr, bfr), (sacc, pf, oacc, pfo), (m, lsum, lim, mx, st, fac), ti,
                                        kvb, h, tid, w, lane, causal, sm_scale)
                    else:
                        # One dynamic buffer (TVM 0.27 fails to merge several shared.dyn buffers here).
                        smem = T.alloc_buffer((cfg.smem_bytes(D, DV) // 2,), dtype, scope="shared.dyn")
                        keep_extent(smem, cfg.smem_bytes(D, DV) // 2)  # the launch's bytes (chunks: addresses)
                        if QS:
                            load_q_smem(smem, q, ti, h, tid)
                        if WG:
                            scratch = T.alloc_buffer((1,), "float32", scope="shared")
                            tiles_tma(smem, scratch, (qf, afr, bfr), (sacc, pf, oacc, pfo),
                                      (m, lsum, lim, mx, st, fac), ti, kvb, h, tid, causal, sm_scale)
                        else:
                            tiles_two_stage(smem, (qf, afr, bfr), (sacc, pf, oacc, pfo), (m, lsum, lim, mx, st, fac),
                                            ti, kvb, h, tid, w, lane, causal, sm_scale)
                        if STAGE_O:
                            store_staged(smem, o, lse, oacc, m, lsum, ti, h, tid, w, lane)
                    if not STAGE_O:
                        store(o, lse, oacc, m, lsum, ti, h, w, lane)

    MAPS = tma.maps if TMA else {}

    @T.macro
    def kernel(q, q_indptr, o, lse, kvb, B, n, causal, sm_scale):
        if TMA_PAGED:
            # Host code: the page pool's tensor map (aligned, ps % 8 == 0: the PrimFunc tested them), each call.
            pmap: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
            T.call_packed("runtime.cuTensorMapEncodeTiled", pmap, dtype, 5, T.address_of(kvb[0][0, 0, 0, 0, 0]),
                          *MAPS["pmap"][1].encode_args(kvb[0].shape))
            blocks(q, q_indptr, o, lse, (kvb[0], kvb[1], kvb[2], kvb[3], kvb[4], pmap), B, n, causal, sm_scale)
        elif TMA:
            # Host code: the tensor maps of k and v (16-byte aligned: the PrimFunc tested it), at each call.
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


__all__ = ["tma_maps", "TC_DTYPES", "TC_HEAD_DIMS", "TC_MAX_DIM", "TC_MAX_GROUP", "TC_PAD", "TC_ROWS", "TC_TILES", "TC_TK", "TcTile",
           "k_ldsm_index", "k_ldsm_index_nt2", "k_store_index", "make_prefill_tc", "q_ldsm_index", "tc_unserved",
           "v_ldsm_index", "v_store_index"]
