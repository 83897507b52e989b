"""The tiles of the tensor-core CUDA prefill (``attention_cuda_prefill_tc``): their configurations
(``TcTile``, ``TC_TILES``, by value of the path switch ``cuda_prefill_kernel``) and the shared-memory index
maps of the operands, plain functions of ints or TIR expressions alike (the kernel calls them inside its
``@T.macro`` s, ``tests/cpu/test_prefill_tc_layout.py`` with ints against a NumPy model of ``ldmatrix`` /
``mma``).
"""

from __future__ import annotations

import dataclasses

from ..kernel_spec import PATH_ARCHS, TC_PREFILL_HEAD_DIMS, TCQ_PREFILL_HEAD_DIMS, WG_PREFILL_HEAD_DIMS
from ._tma_cuda import MBAR_BYTES, SW128_ALIGN
from ._wgmma_cuda import Sw128Layout

#: Rows of an m16 tile, keys per tile (``TcTile.tk``'s default), shared-memory row padding (elements).
TC_WROWS, TC_TK, TC_PAD = 16, 64, 8
TC_DTYPES = ("float16", "bfloat16")
TC_MAX_DIM = 256
#: GQA groups served: the PrimFunc also holds the SIMT RoPE kernel, whose tile takes groups up to 32 rows
#: (``attention_cuda_prefill._prefill_plan``); the tensor-core tile itself would take 64.
TC_MAX_GROUP = 32
#: Shared memory a block may use (bytes): sm_90's 227 KB of dynamic shared memory per block (every tile holds its
#: stages in one dynamic buffer).
TC_MAX_SMEM = 227 * 1024


@dataclasses.dataclass(frozen=True)
class TcTile:
    """A configuration of the kernel, named by its value of the path switch ``cuda_prefill_kernel``.

    ``warps`` warps of ``mtiles`` m16 tiles each (rows per block = 16 warps mtiles; with two, or ``q_smem``, Q
    lives in shared memory: ``q_in_smem``); key tiles of ``tk``; qk and v head dims ``dims``; ``stages`` K/V buffers in one dynamic shared-memory buffer: with
    2 (mma.sync), tile kt + 1 loads during all of tile kt (one barrier a key tile; over 48 KB at D 128, which TVM's
    CUDA launcher allows by raising the function's ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` when a
    launch asks for 48 KB or more).
    ``wgmma``: each warpgroup (4 warps, 64 rows, Q in registers) computes S and O with ``wgmma`` (sm_90a,
    ``_wgmma_cuda``) instead of ``mma.sync``; its K and V tiles arrive by TMA (``tma``), 128-byte swizzled
    (``kv_layout``), in a multi-stage buffer; with 8 warps two warpgroups share each K / V tile (128 rows: half
    the K / V bytes a row). A warpgroup issues S of tile kt and P V of tile kt - 1 as two groups and runs the
    softmax of kt while P V runs (the O rescale waits for it); V of tile kt - 1 is still read during tile kt, so
    ``ahead`` is ``stages - 2``.
    """

    name: str
    warps: int
    stages: int
    mtiles: int = 1
    tk: int = TC_TK
    wgmma: bool = False
    q_smem: bool = False
    dims: tuple = TC_PREFILL_HEAD_DIMS  # (kernel_spec: the selection table reads the same)

    @property
    def tma(self) -> bool:
        """K / V tiles by TMA (one thread or warp lane issues a tile's boxes; one mbarrier a stage): the wgmma
        tiles'."""
        return self.wgmma

    def kv_layout(self, d: int) -> Sw128Layout:
        """The layout of a ``wgmma`` tile's K / V rows of ``d`` elements: the 128-byte swizzle that the TMA
        writes."""
        return Sw128Layout(d, self.tk)

    def row_elems(self, d: int) -> int:
        """Shared-memory elements a K / V row of ``d`` elements takes: ``d + TC_PAD`` (row-major), the
        layout's share of a row (``wgmma``)."""
        return self.kv_layout(d).elems(8) // 8 if self.wgmma else d + TC_PAD

    @property
    def rows(self) -> int:
        return self.warps * self.mtiles * TC_WROWS

    @property
    def q_in_smem(self) -> bool:
        """Q staged in shared memory (re-read as A fragments each key tile) rather than held in registers:
        with two m16 tiles a warp, or O of head dim 256, the registers go to the accumulators."""
        return self.q_smem or self.mtiles > 1

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def ahead(self) -> int:
        """Key tiles loading ahead of the one computed: all other stages (``wgmma``: but the tile before's, whose
        P V runs during this one)."""
        return self.stages - (2 if self.wgmma else 1)

    def smem_bytes(self, d: int, dv: int, dtype: str = "float16") -> int:
        """Shared memory of a block: ``stages`` x (K tile + V tile) (+ the Q rows), rows of ``row_elems``."""
        q = self.rows * (d + TC_PAD) if self.q_in_smem else 0
        # tma: the stages start at the buffer's first 1024-byte boundary; one mbarrier a stage after them.
        tma = SW128_ALIGN + self.stages * MBAR_BYTES if self.tma else 0
        return (self.stages * self.tk * (self.row_elems(d) + self.row_elems(dv)) + q) * (4 if dtype == "float32" else 2) + tma

    def k_base(self, stage, d: int, dv: int):
        """First element of stage ``stage``'s K tile in the stage buffer (int or TIR expression): stages
        of ``tk`` K rows then ``tk`` V rows, each a multiple of 8 elements (16-byte cp.async / ldmatrix
        rows stay aligned) and, for D 64 / 128, of 64 (128 bytes: the bank pattern of a stage is that of
        element 0, as ``tests/cpu/test_prefill_tc_layout.py`` checks)."""
        return stage * (self.tk * (self.row_elems(d) + self.row_elems(dv)))

    def v_base(self, stage, d: int, dv: int):
        """First element of stage ``stage``'s V tile in the stage buffer (after its K tile)."""
        return self.k_base(stage, d, dv) + self.tk * self.row_elems(d)

    def q_base(self, d: int, dv: int) -> int:
        """First element of the Q rows (``q_in_smem``: row-major, stride ``d + TC_PAD``), after the stages."""
        return self.k_base(self.stages, d, dv)

    def bar_base(self, d: int, dv: int, stage=0):
        """``tma``: element (2-byte) of stage ``stage``'s mbarrier, after the stages (8-byte aligned)."""
        return self.k_base(self.stages, d, dv) + stage * (MBAR_BYTES // 2)


#: The tiles, by switch value (``attention_cuda_prefill_tc``'s docstring: registers, shared memory, occupancy).
TC_TILES = {"tc2": TcTile("tc2", 8, 2), "tc3": TcTile("tc3", 4, 2, mtiles=2, tk=32),
            # Head dim 256: tc2's 8 warps of one m16 tile with tc3's Q in shared memory and 32-key tiles (O takes
            # 128 registers a lane; Q's fragments would take 64 more).
            "tcq": TcTile("tcq", 8, 2, tk=32, q_smem=True, dims=TCQ_PREFILL_HEAD_DIMS),
            # Two warpgroups, four stages (two tiles loading ahead); TMA copies (one thread a block issues them,
            # ragged; a lane of each warp, paged).
            "wg2t": TcTile("wg2t", 8, 4, wgmma=True, dims=WG_PREFILL_HEAD_DIMS),
            # wg2t's loop on one warpgroup, three stages (1 tile ahead): 97 KB, so two blocks share an SM and
            # one's softmax, prologue and stores run under the other's GEMMs.
            "wg1t": TcTile("wg1t", 4, 3, wgmma=True, dims=WG_PREFILL_HEAD_DIMS)}
#: The PTX target a ``wgmma`` tile needs (its instructions exist on sm_90a only; libraries forcing it are built
#: for it: ``kernel_spec.PATH_ARCHS``).
WG_ARCH = PATH_ARCHS[("cuda_prefill_kernel", "wg1t")]


def k_store_index(key, dim, d: int):
    """Where ``load_kv`` puts element ``dim`` of key ``key`` of the tile in ``Ks`` (row stride ``d + TC_PAD``)."""
    return key * (d + TC_PAD) + dim


def v_store_index(key, dim, dv: int):
    """Where ``load_kv`` puts element ``dim`` of value ``key`` of the tile in ``Vs`` (row stride ``dv + TC_PAD``)."""
    return key * (dv + TC_PAD) + dim


def k_ldsm_index(lane, nt, ks2, d: int):
    """The ``Ks`` row this lane addresses in the ``ldmatrix.x4`` of keys ``8 nt ..`` x dims ``32 ks2 ..``:
    matrix ``lane // 8`` = dims ``32 ks2 + 8 (lane // 8) ..``, row ``lane % 8``. Registers 0, 1 are then the B
    fragment of k step ``2 ks2``, registers 2, 3 that of ``2 ks2 + 1`` (no transpose: a B fragment's n is
    the key, its k the dim, and ldmatrix gives lane t row t / 4, columns 2 (t % 4), + 1)."""
    return (nt * 8 + lane % 8) * (d + TC_PAD) + ks2 * 32 + (lane // 8) * 8


def k_ldsm_index_nt2(lane, nt2, ks, d: int):
    """The ``Ks`` row this lane addresses in the ``ldmatrix.x4`` of keys ``16 nt2 ..`` x dims ``16 ks ..`` (the
    k-step-outer order of Q in shared memory): matrix ``i = lane // 8`` = keys ``16 nt2 + 8 (i // 2) ..`` x dims
    ``16 ks + 8 (i % 2) ..``, row ``lane % 8``. Registers 0, 1 are then the B fragment of n tile ``2 nt2`` at k
    step ``ks``, registers 2, 3 that of ``2 nt2 + 1``."""
    return (nt2 * 16 + (lane // 16) * 8 + lane % 8) * (d + TC_PAD) + ks * 16 + ((lane // 8) % 2) * 8


def q_ldsm_index(lane, row0, ks, d: int):
    """The Q row (in the ``q_in_smem`` layout) this lane addresses in the ``ldmatrix.x4`` of the A fragment of
    rows ``row0 ..`` x dims ``16 ks ..``: matrix ``i = lane // 8`` = rows ``row0 + 8 (i % 2) ..`` x dims
    ``16 ks + 8 (i // 2) ..``, so registers 0..3 are A elements (0, 1), (2, 3), (4, 5), (6, 7) (``a_frag``)."""
    return (row0 + ((lane // 8) % 2) * 8 + lane % 8) * (d + TC_PAD) + ks * 16 + (lane // 16) * 8


def v_ldsm_index(lane, kk, dn2, dv: int):
    """The ``Vs`` row this lane addresses in the ``ldmatrix.x4.trans`` of keys ``16 kk ..`` x dims
    ``16 dn2 ..``: matrix ``i = lane // 8`` = keys ``16 kk + 8 (i % 2) ..`` x dims ``16 dn2 + 8 (i // 2) ..``,
    row ``lane % 8``. Registers 0, 1 are the B fragment of n tile ``2 dn2``, registers 2, 3 that of
    ``2 dn2 + 1`` (transposed: lane t gets rows = keys 2 (t % 4), + 1 of column = dim t / 4)."""
    return (kk * 16 + ((lane // 8) % 2) * 8 + lane % 8) * (dv + TC_PAD) + dn2 * 16 + (lane // 16) * 8


__all__ = ["WG_ARCH", "TC_DTYPES", "TC_MAX_DIM", "TC_MAX_GROUP", "TC_MAX_SMEM", "TC_PAD",
           "TC_TILES", "TC_TK", "TC_WROWS", "TcTile", "k_ldsm_index", "k_ldsm_index_nt2",
           "k_store_index", "q_ldsm_index", "v_ldsm_index", "v_store_index"]
