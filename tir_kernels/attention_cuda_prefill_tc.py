"""Tensor-core CUDA prefill (``attn_prefill_ragged`` / ``attn_prefill_paged``), fp16 / bf16, sm_80+: the
plain (``apply_rope == 0``) kernel on ``mma.sync.m16n8k16`` (``_mma_cuda``). Opt-in for now: path switch
``cuda_prefill_kernel`` (``pagedkv.kernel_spec.SWITCHES``); ``tc_unserved`` says which specs it serves.

Same ABI and semantics as the SIMT kernel (``attention_cuda.py``): base-2 LSE, bottom-right causal, sliding
window and soft cap through ``CudaVariant``, empty rows ``o = 0`` / ``lse = -1e30``, sm_scale an argument.

Design (FlashAttention-2 style), one block of 4 warps (128 threads) per (query tile, kv head):

* A query tile is ``TQ = 64 // G`` tokens x the ``G`` q heads of the kv head = up to 64 *rows* (row ``r`` =
  token ``r // G``, head ``h*G + r % G``, as in the SIMT kernel), so one K/V tile serves the GQA group.
  Warp ``w`` owns rows ``16w .. 16w+15``; its Q fragments (``D/16`` A fragments) stay in registers.
* Key tiles of 64: K as ``Ks[key, d]`` and V transposed as ``Vt[d, key]`` in static shared memory, rows
  padded by 8 elements so that the B-fragment reads (lanes ``4g + t`` at row ``g``, word ``t``) hit 32
  distinct banks; loaded through registers with element loads (q/k/v views may start at any element
  offset, so 16-byte ``cp.async`` is not safe for them), one stage: other resident blocks hide the latency.
* S = Q K^T: ``D/16 x 8`` MMAs per warp and tile into 8 C fragments (fp32); scores scaled by
  ``sm_scale * log2(e)`` in fp32 (base-2 softmax), masked / capped by ``CudaVariant``; online softmax per
  row (a row's 64 scores live in the 4 lanes of a quad: two ``shfl_xor``); P rounded to the storage dtype
  *is* the A fragment of P V (the C layout of two adjacent n8 tiles equals the A layout of one k16 step).
* O += P V: ``4 x DV/8`` MMAs per tile, B fragments from ``Vt`` (one 32-bit LDS per register).
* Causal tiles past the tile's last row are skipped (and, with a window, those before its first window).
* Grid and entry search as the SIMT kernel: virtual tiles, binary search, idle blocks run zero-trip loops.
"""

from __future__ import annotations

from tvm.script import tirx as T

from ..ops import shape_values
from ._common import EMPTY_LSE, LOG2E
from ._common_cuda import paged_kv_len, shfl_xor
from ._mma_cuda import a_frag, b_frag, c_frag, copy4, mma_sync
from ._variant_cuda import CudaVariant

#: Warps per block, rows per warp (one m16 tile), keys per tile, shared-memory row padding (elements).
TC_WARPS, TC_WROWS, TC_TK, TC_PAD = 4, 16, 64, 8
TC_ROWS = TC_WARPS * TC_WROWS
TC_NT = TC_WARPS * 32
TC_DTYPES = ("float16", "bfloat16")
TC_MAX_DIM = 128
#: GQA groups served: the PrimFunc also holds the SIMT RoPE kernel, whose tile takes groups up to 32 rows
#: (``attention_cuda_prefill._prefill_plan``); the tensor-core tile itself would take 64.
TC_MAX_GROUP = 32


def k_store_index(key, dim, d: int):
    """Where ``load_kv`` puts element ``dim`` of key ``key`` of the tile in ``Ks`` (key-major)."""
    return key * (d + TC_PAD) + dim


def v_store_index(key, dim):
    """Where ``load_kv`` puts element ``dim`` of value ``key`` of the tile in ``Vt`` (dim-major)."""
    return dim * (TC_TK + TC_PAD) + key


def k_smem_index(lane, nt, ks, u, d: int):
    """Index into ``Ks[key, dim]`` (row stride ``d + TC_PAD``) of the first of the two halves of register
    ``u`` of the lane's B fragment for key tile ``nt`` (keys ``8 nt ..``) and dims ``16 ks ..``."""
    k, n = b_frag(lane, 2 * u)
    return (nt * 8 + n) * (d + TC_PAD) + ks * 16 + k


def v_smem_index(lane, dn, kk, u):
    """Index into ``Vt[dim, key]`` (row stride ``TC_TK + TC_PAD``) of register ``u`` of the lane's B fragment
    for dims ``8 dn ..`` and keys ``16 kk ..``."""
    k, n = b_frag(lane, 2 * u)
    return (dn * 8 + n) * (TC_TK + TC_PAD) + kk * 16 + k


def tc_unserved(spec, dv: int) -> str | None:
    """Why the tensor-core prefill does not serve ``spec`` (value head dim ``dv``), or None when it does.
    Inline RoPE is not a reason: the PrimFunc runs the SIMT RoPE kernel when ``apply_rope == 1``."""
    d, g = spec.head_dim, spec.group_size
    if spec.dtype not in TC_DTYPES:
        return f"dtype {spec.dtype} (the tensor-core prefill takes {', '.join(TC_DTYPES)})"
    if d % 16 or dv % 16 or max(d, dv) > TC_MAX_DIM:
        return f"head dims {d}/{dv} (the tensor-core prefill takes multiples of 16 up to {TC_MAX_DIM})"
    if g > TC_MAX_GROUP:
        return f"GQA group {g} (the tensor-core prefill takes groups up to {TC_MAX_GROUP})"
    return None


def make_prefill_tc(op: str, spec, paged: bool):
    """The plain tensor-core kernel macro of a prefill PrimFunc (``paged`` selects the K/V source), called
    as ``kernel(q, q_indptr, o, lse, kvb, B, n, causal, sm_scale)``."""
    D, dtype, HKV = spec.head_dim, spec.dtype, spec.num_kv_heads
    DV = D if paged else shape_values(spec)["Dv"]
    reason = tc_unserved(spec, DV)
    if reason:
        raise NotImplementedError(f"pagedkv.tir_kernels: the tensor-core CUDA {op!r} kernel does not serve {reason}")
    var = CudaVariant.from_spec(spec)
    WIN = var.has_window
    G = spec.group_size
    TQ = TC_ROWS // G
    RV = TQ * G  # row slots holding a (token, head); the rest of the 64 are padding
    TK, NT = TC_TK, TC_NT
    KS, VS = D + TC_PAD, TK + TC_PAD  # shared row strides (elements) of Ks and Vt
    NKS, NSN, NKK, NDN = D // 16, TK // 8, TK // 16, DV // 8

    if paged:
        def kv_len_of(kvb, b):
            return paged_kv_len(kvb[2], kvb[4], b, kvb[3])

        def kv_elem(kvb, c01, b, key, h, d):
            pages, page_values, page_indptr, ps = kvb[0], kvb[1], kvb[2], kvb[3]
            return pages[page_values[page_indptr[b] + T.truncdiv(key, ps)], c01, h, T.truncmod(key, ps), d]
    else:
        def kv_len_of(kvb, b):
            return kvb[2][b + 1] - kvb[2][b]

        def kv_elem(kvb, c01, b, key, h, d):
            return (kvb[0] if c01 == 0 else kvb[1])[kvb[2][b] + key, h, d]

    def row_ok(r, ti):
        """Row slot ``r`` holds a token of the tile (``ti[3]`` = tokens in the tile)."""
        return T.And(r < RV, T.truncdiv(r, G) < ti[3])

    @T.macro
    def locate(ti, q_indptr, kvb, B, vt, causal):
        """Tile info ``ti``: 0 entry b, 1 qlen, 2 qt0 (first token of the tile in the entry), 3 tokens, 4 first
        token row of q, 5 kvlen, 6 keys any row sees, 7 first key tile. Entry b: the last one whose first
        virtual tile ``q_indptr[b] // TQ + b`` is <= vt (the SIMT kernel's grid)."""
        ti[0] = 0
        ti[1] = B
        while ti[1] - ti[0] > 1:
            if T.truncdiv(q_indptr[T.truncdiv(ti[0] + ti[1], 2)], TQ) + T.truncdiv(ti[0] + ti[1], 2) <= vt:
                ti[0] = T.truncdiv(ti[0] + ti[1], 2)
            else:
                ti[1] = T.truncdiv(ti[0] + ti[1], 2)
        ti[1] = T.if_then_else(B > 0, q_indptr[T.min(ti[0] + 1, B)] - q_indptr[ti[0]], 0)
        ti[2] = vt - (T.truncdiv(q_indptr[ti[0]], TQ) + ti[0])  # tile of the entry (temporarily)
        ti[5] = T.if_then_else(T.And(ti[2] >= 0, ti[2] < T.truncdiv(ti[1] + TQ - 1, TQ)), 1, 0)  # active
        # Last query tile first (it sees the most keys under causal).
        ti[2] = (T.truncdiv(ti[1] + TQ - 1, TQ) - 1 - ti[2]) * TQ
        ti[3] = T.if_then_else(ti[5] > 0, T.min(TQ, ti[1] - ti[2]), 0)
        ti[4] = q_indptr[ti[0]] + ti[2]
        ti[5] = T.if_then_else(ti[5] > 0, kv_len_of(kvb, ti[0]), 0)
        ti[6] = T.if_then_else(causal > 0, T.max(T.min(ti[5], ti[5] - ti[1] + ti[2] + ti[3]), 0), ti[5])
        ti[7] = var.first_tile(ti[5], ti[1], ti[2], ti[6], TK) if WIN else 0

    @T.macro
    def load_q(qf, q, ti, h, w, lane):
        """The warp's Q rows as A fragments: ``qf[ks*8 + i]`` = element ``a_frag(lane, i)`` of dims ``16 ks ..``
        (storage dtype, unscaled: the scale is applied to the fp32 scores); padding rows 0."""
        for ks in T.unroll(NKS):
            for i in T.unroll(8):
                if row_ok(w * TC_WROWS + a_frag(lane, i)[0], ti):
                    qf[ks * 8 + i] = q[ti[4] + T.truncdiv(w * TC_WROWS + a_frag(lane, i)[0], G),
                                       h * G + T.truncmod(w * TC_WROWS + a_frag(lane, i)[0], G),
                                       ks * 16 + a_frag(lane, i)[1]]
                else:
                    qf[ks * 8 + i] = T.Cast(dtype, T.float32(0))

    @T.macro
    def init_rows(lim, m, lsum, oacc, ti, w, lane, causal):
        """Row state of the lane's two rows (``c_frag`` rows g and g + 8): bound, running max, sum, O."""
        for rr in T.unroll(2):
            lim[rr] = var.row_bound(row_ok(w * TC_WROWS + c_frag(lane, 2 * rr)[0], ti), ti[5], ti[1], ti[2],
                                    T.truncdiv(w * TC_WROWS + c_frag(lane, 2 * rr)[0], G), causal)
            m[rr] = T.float32(EMPTY_LSE)
            lsum[rr] = T.float32(0)
        for e in T.unroll(NDN * 4):
            oacc[e] = T.float32(0)

    @T.macro
    def load_kv(Ks, Vt, kvb, ti, kt, h, tid):
        """Key tile ``kt``: ``Ks[j, d]`` and ``Vt[d, j]`` (zeros past the keys any row sees, so that a
        masked P = 0 never meets stale data). Consecutive threads read consecutive dims (coalesced); the
        inner unroll keeps 8 loads in flight per thread."""
        for it in T.serial(TK * D // (NT * 8)):
            for u in T.unroll(8):
                if kt * TK + T.truncdiv((it * 8 + u) * NT + tid, D) < ti[6]:
                    Ks[k_store_index(T.truncdiv((it * 8 + u) * NT + tid, D), T.truncmod((it * 8 + u) * NT + tid, D), D)] = \
                        kv_elem(kvb, 0, ti[0], kt * TK + T.truncdiv((it * 8 + u) * NT + tid, D), h,
                                T.truncmod((it * 8 + u) * NT + tid, D))
                else:
                    Ks[k_store_index(T.truncdiv((it * 8 + u) * NT + tid, D), T.truncmod((it * 8 + u) * NT + tid, D), D)] = \
                        T.Cast(dtype, T.float32(0))
        for it in T.serial(TK * DV // (NT * 8)):
            for u in T.unroll(8):
                if kt * TK + T.truncdiv((it * 8 + u) * NT + tid, DV) < ti[6]:
                    Vt[v_store_index(T.truncdiv((it * 8 + u) * NT + tid, DV), T.truncmod((it * 8 + u) * NT + tid, DV))] = \
                        kv_elem(kvb, 1, ti[0], kt * TK + T.truncdiv((it * 8 + u) * NT + tid, DV), h,
                                T.truncmod((it * 8 + u) * NT + tid, DV))
                else:
                    Vt[v_store_index(T.truncdiv((it * 8 + u) * NT + tid, DV), T.truncmod((it * 8 + u) * NT + tid, DV))] = \
                        T.Cast(dtype, T.float32(0))

    @T.macro
    def score(sacc, qf, Ks, bfr, lane):
        """S (16 rows x 64 keys of the warp) = Q K^T: C fragment ``nt`` holds keys ``8 nt ..``; the B
        fragment of (key tile ``nt``, dims ``16 ks ..``) is ``Ks[8 nt + n, 16 ks + k]``, two halves per
        32-bit read (elements 2u, 2u + 1 are adjacent in k)."""
        for e in T.unroll(NSN * 4):
            sacc[e] = T.float32(0)
        for ks in T.unroll(NKS):
            for nt in T.unroll(NSN):
                for u in T.unroll(2):
                    T.evaluate(copy4(T.address_of(bfr[u]), T.address_of(Ks[k_smem_index(lane, nt, ks, u, D)])))
                T.evaluate(mma_sync(dtype, T.address_of(sacc[nt * 4]), T.address_of(qf[ks * 8]),
                                    T.address_of(bfr[0])))

    @T.macro
    def softmax(sacc, pf, m, lsum, oacc, lim, st, ti, kt, lane, causal, sm_scale):
        """Online softmax of the lane's two rows (``rr``: C elements 2rr, 2rr + 1 of every fragment); a row's
        scores are spread over the 4 lanes of a quad. ``pf`` = P in the storage dtype, already laid out as
        the A fragments of P V (``pf[8 kk + i]`` = C element ``i % 4`` of fragment ``2 kk + i // 4``)."""
        for rr in T.unroll(2):
            st[0] = m[rr]
            for nt in T.unroll(NSN):
                for c in T.unroll(2):
                    sacc[nt * 4 + rr * 2 + c] = var.logits(
                        sacc[nt * 4 + rr * 2 + c] * (sm_scale * T.float32(LOG2E)),
                        var.visible(kt * TK + nt * 8 + c_frag(lane, c)[1], lim[rr], ti[5], causal))
                    st[0] = T.max(st[0], sacc[nt * 4 + rr * 2 + c])
            st[0] = T.max(st[0], shfl_xor(st[0], 1))
            st[0] = T.max(st[0], shfl_xor(st[0], 2))
            st[1] = T.exp2(m[rr] - st[0])
            m[rr] = st[0]
            lsum[rr] = lsum[rr] * st[1]
            for dn in T.unroll(NDN):
                for c in T.unroll(2):
                    oacc[dn * 4 + rr * 2 + c] = oacc[dn * 4 + rr * 2 + c] * st[1]
            for nt in T.unroll(NSN):
                for c in T.unroll(2):
                    st[2] = T.exp2(sacc[nt * 4 + rr * 2 + c] - st[0])
                    lsum[rr] = lsum[rr] + st[2]
                    pf[nt * 4 + rr * 2 + c] = T.Cast(dtype, st[2])

    @T.macro
    def accumulate(oacc, pf, Vt, bfr, lane):
        """O += P V: k-step ``kk`` (keys ``16 kk ..``) x n tile ``dn`` (dims ``8 dn ..``); the B fragment is
        ``V[16 kk + k, 8 dn + n] = Vt[8 dn + n, 16 kk + k]``."""
        for kk in T.unroll(NKK):
            for dn in T.unroll(NDN):
                for u in T.unroll(2):
                    T.evaluate(copy4(T.address_of(bfr[u]), T.address_of(Vt[v_smem_index(lane, dn, kk, u)])))
                T.evaluate(mma_sync(dtype, T.address_of(oacc[dn * 4]), T.address_of(pf[kk * 8]),
                                    T.address_of(bfr[0])))

    @T.macro
    def store(o, lse, oacc, m, lsum, ti, h, w, lane):
        """Row sums over the quad, then o = O / sum and lse = m + log2(sum) (base 2); a row that saw no key
        (sum 0) writes the empty state."""
        for rr in T.unroll(2):
            lsum[rr] = lsum[rr] + shfl_xor(lsum[rr], 1)
            lsum[rr] = lsum[rr] + shfl_xor(lsum[rr], 2)
        for rr in T.unroll(2):
            if row_ok(w * TC_WROWS + c_frag(lane, 2 * rr)[0], ti):
                for dn in T.unroll(NDN):
                    for c in T.unroll(2):
                        o[ti[4] + T.truncdiv(w * TC_WROWS + c_frag(lane, 2 * rr)[0], G),
                          h * G + T.truncmod(w * TC_WROWS + c_frag(lane, 2 * rr)[0], G),
                          dn * 8 + c_frag(lane, c)[1]] = T.Cast(dtype, T.if_then_else(
                              lsum[rr] > T.float32(0), oacc[dn * 4 + rr * 2 + c] / lsum[rr], T.float32(0)))
                if lane % 4 == 0:
                    lse[ti[4] + T.truncdiv(w * TC_WROWS + c_frag(lane, 2 * rr)[0], G),
                        h * G + T.truncmod(w * TC_WROWS + c_frag(lane, 2 * rr)[0], G)] = T.if_then_else(
                            lsum[rr] > T.float32(0), m[rr] + T.log2(lsum[rr]), T.float32(EMPTY_LSE))

    @T.macro
    def kernel(q, q_indptr, o, lse, kvb, B, n, causal, sm_scale):
        for vt in T.thread_binding(T.max(n // TQ + B, 1), thread="blockIdx.x"):
            for h in T.thread_binding(HKV, thread="blockIdx.y"):
                for tid in T.thread_binding(NT, thread="threadIdx.x"):
                    Ks = T.alloc_buffer((TK * KS,), dtype, scope="shared")
                    Vt = T.alloc_buffer((DV * VS,), dtype, scope="shared")
                    ti = T.alloc_buffer((8,), "int32", scope="local")
                    qf = T.alloc_buffer((NKS * 8,), dtype, scope="local")
                    sacc = T.alloc_buffer((NSN * 4,), "float32", scope="local")
                    pf = T.alloc_buffer((NSN * 4,), dtype, scope="local")
                    # The B fragment as 2 x 32 bits: TVM sizes a local array by the elements it sees indexed,
                    # and copy4 / mma index it only through addresses (a 4 x 16-bit array came out as 3).
                    bfr = T.alloc_buffer((2,), "uint32", scope="local")
                    oacc = T.alloc_buffer((NDN * 4,), "float32", scope="local")
                    m = T.alloc_buffer((2,), "float32", scope="local")
                    lsum = T.alloc_buffer((2,), "float32", scope="local")
                    lim = T.alloc_buffer((2,), "int32", scope="local")
                    st = T.alloc_buffer((3,), "float32", scope="local")
                    w: T.let[T.int32] = T.truncdiv(tid, 32)
                    lane: T.let[T.int32] = T.truncmod(tid, 32)
                    # No branch around the barriers: an idle block runs zero-trip loops, masked accesses.
                    locate(ti, q_indptr, kvb, B, vt, causal)
                    load_q(qf, q, ti, h, w, lane)
                    init_rows(lim, m, lsum, oacc, ti, w, lane, causal)
                    for kt in T.serial(ti[7], T.truncdiv(ti[6] + TK - 1, TK)):
                        T.tvm_storage_sync("shared")  # every warp is done with the previous tile
                        load_kv(Ks, Vt, kvb, ti, kt, h, tid)
                        T.tvm_storage_sync("shared")
                        score(sacc, qf, Ks, bfr, lane)
                        softmax(sacc, pf, m, lsum, oacc, lim, st, ti, kt, lane, causal, sm_scale)
                        accumulate(oacc, pf, Vt, bfr, lane)
                    store(o, lse, oacc, m, lsum, ti, h, w, lane)

    return kernel


__all__ = ["TC_DTYPES", "TC_MAX_DIM", "TC_MAX_GROUP", "TC_ROWS", "TC_TK", "k_smem_index", "k_store_index", "make_prefill_tc", "tc_unserved", "v_smem_index",
           "v_store_index"]
