"""CUDA attention kernels: paged decode, paged prefill and ragged prefill.

Same ABI and semantics as ``attention_cpu.py`` (``docs/ARCHITECTURE.md``, "Kernel ABI"; the PrimFunc
headers come from the op table, ``_abi.abi_prim_func``; the factories take a ``KernelSpec``): base-2 LSE,
bottom-right causal, an empty row writes ``o = 0`` and ``lse = -1e30``, inline RoPE rotates q at its
position and key ``j`` of entry ``b`` at ``k_pos_offset[b] + j``, float32 accumulation. Scores are kept in
log2 units: ``sm_scale * log2(e)`` is folded into q when it is loaded. Each PrimFunc holds two kernels,
launched by a host-side branch on ``apply_rope``: the inline-RoPE one and a plain one that does not pay
the RoPE registers. All shared memory is static (< 48 KB; TVM 0.27 fails to merge our ``shared.dyn``
buffers), and no ``if`` around a barrier depends on the thread.

Decode (``attn_decode_paged``), plain and inline RoPE: the staged kernel
------------------------------------------------------------------------
``_decode_staged_cuda`` (the path switch ``cuda_decode_kernel``: auto = staged wherever ``staged_limits``
allows, and for inline RoPE ``staged_rope_limits``, else and with "lanes" the lane-group kernel below): one
block per (entry, kv head, key split) for the whole GQA group (``G / R`` row threads of ``R`` rows x ``L``
lanes x ``NZ`` key groups); key tiles of 16 KB of K + V go through shared memory with 16-byte loads, the next
tile's loads in flight while the current one is scored, so each K/V byte is read from DRAM once per kv head.
Split policy: whole waves
(``_common_cuda.wave_split_count``, ``attention_cuda_decode.STAGED_RESIDENT_BLOCKS``). Inline RoPE
(``_decode_staged_rope_cuda``): each key rotated once per block, by its offset in the tile from a per-block cos /
sin table, as its tile is staged into shared memory; q rotated once per tile into a shared table; the key loop's
score is the plain kernel's.

Decode where the staged limits refuse (and both variants with ``cuda_decode_kernel=lanes``): the lane-group
kernel, one block per (entry, kv head, row chunk, key split), 128 threads
-------------------------------------------------------------------------------------------------
* A *lane group* of ``L`` threads splits the head dim: lane ``tx`` owns ``VEC`` dims (8 fp16 / 4 fp32:
  one 16-byte page load per K or V row); ``L = next_pow2(D / VEC)``, padding lanes hold zeros. Inline
  RoPE uses another lane layout for q and K: dims ``tx*VEC/2 + e`` and ``D/2 + tx*VEC/2 + e``, so a lane
  holds both elements of its rotation pairs (no shuffle to rotate; dot products do not depend on the order
  of the dims; V keeps the plain layout). The block has ``NW = 128 / L`` lane groups.
* Inline RoPE without sin / cos in the key loop (``_decode_rope_cuda``): a key at position ``P + o`` (``P``
  its block step's first key, ``o = w*KPT + kk`` fixed per thread and ``kk``) scores
  ``<R(q_pos - P) q, R(o) k>``. ``R(o)`` is a per-thread constant (cos / sin computed once), so a key costs
  4 float ops per pair; ``R(q_pos - P) q`` is shared by all lane groups: per batch of ``NW`` steps each lane
  group rotates the ``GC`` q rows for one step into a shared table (two barriers per batch), read with
  float4 loads. One sin / cos per (position, pair) per block; none per kv head of a key or per GQA row.
  Angles are exact (``_sincos_cuda``), not rounded to float32.
* Every thread keeps ``GC`` query rows of its kv head in registers (``GC`` = the GQA group, or a divisor
  of it up to ``DECODE_MAX_ROWS``, the rest over ``blockIdx.z``), so a K/V row is loaded once per block
  and used for all its rows. Lane group ``w`` walks keys ``k0 + it*NW*KPT + w*KPT + kk`` (``KPT``
  consecutive keys, all loads issued before use); a score is a per-lane partial dot product folded
  with ``__shfl_xor_sync`` over the ``L`` lanes; keys past the range are clamped (valid memory) and
  masked.
* Each lane group runs its own online softmax (``m``, ``l``, ``O`` in registers; no barrier in the plain
  kernel's key loop, the inline-RoPE one's two per batch of steps); at the end the ``NW`` states are merged through shared memory (``red_o[NW, GC, D]``) and
  written coalesced.
* Split-KV: ``S`` key ranges per (entry, kv head) when ``B * Hkv`` blocks cannot fill the GPU and the
  entries are long (``_split_count``, on the host from the shapes). With ``S > 1`` the blocks write
  normalized partial (o, lse) to a float32 workspace and a second kernel merges them. Each entry splits its
  own key range (its window's with a sliding window), so ``S`` only sets the work split, never which keys
  an entry sees; the path switch ``cuda_decode_splits`` (``KernelSpec.paths``) forces ``S`` for tests.

Prefill (``attn_prefill_ragged`` / ``attn_prefill_paged``): one block per (query tile, kv head)
----------------------------------------------------------------------------------------------
* 128 threads as 8 x 16 (``ty``, ``tx``). A query tile is ``TQ = R // G`` tokens x ``G`` heads = up to
  ``R`` *rows* (row ``r`` = token ``r // G``, head ``h*G + r % G``; ``R`` = 32, 16 for ``D > 128``), so
  a K/V tile is loaded once for the whole GQA group. Key tiles of ``TK`` = 32 (16 for ``D > 128``).
* Shared memory (float32): ``Qt[D, R]`` (q transposed, rotated, scaled) and one ``KV`` tile that holds
  the keys transposed (``Kt[d, j]``, rotated) for the scores, then the values (``Vs[j, d]``) for P@V.
* Scores: thread (ty, tx) computes rows ``RI*ty ..`` x keys ``KJ*tx ..`` (vector reads of ``Qt`` and
  ``Kt``); row max / sum over the 16 ``tx`` lanes of a half warp with shuffles; online softmax per row
  in registers; P@V: the thread owns rows ``RI*ty ..`` x dims ``tx, tx+16, ...`` and takes
  ``P[row, key]`` from the lane that computed it (``__shfl_sync``), so P never goes to memory.
* Per key tile: barrier, K tile, barrier, scores + softmax, barrier, V tile, barrier, P@V (the stages of
  ``_prefill_simt_stages``, one macro factory each over the kernel's ``PrefillPlan``).
* Tiles past the tile's causal limit are skipped; partial tiles load zeros past the entry's keys and
  masks hide them (``T.if_then_else`` on ``key < limit(row)``).
* Grid: ``blockIdx.x`` = virtual tile ``v`` in ``[0, n // TQ + B)``; entry ``b`` owns virtual tiles
  ``[q_indptr[b] // TQ + b, q_indptr[b+1] // TQ + b + 1)`` (always at least ``ceil(qlen / TQ)`` of
  them); a block finds its entry by binary search and idles (zero-trip loops, masked accesses) when its
  tile is past the entry's queries. Within an entry the last query tile (most keys when causal) runs
  first.

The attention variant (causal, ``sliding_window``, ``logits_soft_cap``; compile-time, ``KernelSpec``)
-----------------------------------------------------------------------------------------------
* Defined once, in ``_variant_cuda.CudaVariant`` (built from the spec; decode, paged and ragged prefill call
  its helpers for the key range they read, which keys a row sees and the logits transform); a new option is
  added there only.
* Options are applied by static Python ``if`` s: with 0 the generated TIR is the one from before the options
  (same ``script()``), so the tuned kernels keep their code and registers.
* Window ``W``: query row ``t`` of an entry sits at key position ``p = kvlen - qlen + t`` and also needs
  ``key >= p + 1 - W``. Decode reads only the window: its split ranges cover ``[max(kvlen - W, 0), kvlen)``
  (and the host-side split count assumes at most ``W`` keys per entry). Prefill starts the key-tile loop at
  the tile holding the query tile's first window start (a per-block value, so the barriers stay uniform)
  and keeps one bound per row in registers: ``lim[i]`` becomes the row's first key, the upper bound follows
  from it (``key - first < W`` when causal) and ``kvlen``; padding rows get a first key past every key.
* Soft cap ``c``: ``x -> C tanh(x / C)`` on the log2-unit scores (``C = c log2 e``), before the mask, written
  with ``exp2f`` and an IEEE reciprocal (``_variant_cuda.soft_cap``) because ``--use_fast_math`` turns
  ``tanhf`` into the 2^-11-accurate ``tanh.approx.f32``.
"""

from __future__ import annotations

from .attention_cuda_decode import attn_decode_paged_cuda
from .attention_cuda_prefill import attn_prefill_paged_cuda, attn_prefill_ragged_cuda

__all__ = ["attn_decode_paged_cuda", "attn_prefill_paged_cuda", "attn_prefill_ragged_cuda"]
