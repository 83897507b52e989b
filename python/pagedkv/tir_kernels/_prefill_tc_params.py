"""The compile-time parameters of one tensor-core CUDA prefill kernel (``attention_cuda_prefill_tc``), declared
once: ``TcParams``, which every stage factory of the kernel takes (``_prefill_tc_load``, ``_prefill_tc_gemm``,
``_prefill_tc_softmax``, ``_prefill_tc_store``, ``_prefill_tc_loops``, ``_prefill_tc_copy``, ``_prefill_tma``), as
ThunderKittens' kernels take one struct of their arguments. The stages then agree on every size and index map by
construction instead of each restating them.
"""

from __future__ import annotations

import dataclasses

from tvm.script import tirx as T

from ._prefill_tc_tiles import TC_PAD, TC_WROWS, TcTile, k_store_index, v_store_index
from ._variant_cuda import CudaVariant


@dataclasses.dataclass(frozen=True)
class TcParams:
    """A kernel's tile (``TcTile``), head dims ``d`` (qk) and ``dv`` (v), GQA group ``g``, kv heads ``hkv``,
    storage ``dtype``, K / V source (``paged``) and attention variant (``var``: window, soft cap); the rest is
    derived from them.

    Block rows: a query tile is ``tq`` tokens x the ``g`` q heads of a kv head; row slot ``r`` is token
    ``r // g``, head ``r % g`` (``o_row``); ``rv`` slots hold a (token, head), the rest are padding. Warp ``w``
    owns ``mt`` m16 tiles from row ``wrow(w, 0)``. A lane's accumulators: ``sn`` S and ``on`` O elements an m16
    tile.
    """

    tile: TcTile
    d: int
    dv: int
    g: int
    hkv: int
    dtype: str
    paged: bool
    var: CudaVariant

    @property
    def mt(self) -> int:
        """m16 tiles a warp."""
        return self.tile.mtiles

    @property
    def qs(self) -> bool:
        """Q in shared memory (``TcTile.q_in_smem``)."""
        return self.tile.q_in_smem

    @property
    def wg(self) -> bool:
        """wgmma: S and O by each warpgroup (Q in registers), P V of tile kt - 1 during the softmax of tile kt,
        K / V tiles by TMA (128-byte swizzled, one mbarrier a stage)."""
        return self.tile.wgmma

    @property
    def win(self) -> bool:
        return self.var.has_window

    @property
    def tq(self) -> int:
        return self.tile.rows // self.g

    @property
    def rv(self) -> int:
        return self.tq * self.g

    @property
    def tk(self) -> int:
        return self.tile.tk

    @property
    def nt(self) -> int:
        return self.tile.threads

    @property
    def ks(self) -> int:
        """Shared row stride (elements) of the row-major K tiles and of Q in shared memory."""
        return self.d + TC_PAD

    @property
    def vs(self) -> int:
        """Shared row stride (elements) of the row-major V tiles and of the staged O rows."""
        return self.dv + TC_PAD

    @property
    def nks(self) -> int:
        """k16 steps of S (over the qk dims)."""
        return self.d // 16

    @property
    def nsn(self) -> int:
        """n8 tiles of S (keys of a tile)."""
        return self.tk // 8

    @property
    def nkk(self) -> int:
        """k16 steps of P V (keys of a tile)."""
        return self.tk // 16

    @property
    def ndn(self) -> int:
        """n8 tiles of O (value dims)."""
        return self.dv // 8

    @property
    def sn(self) -> int:
        return self.nsn * 4

    @property
    def on(self) -> int:
        return self.ndn * 4

    def wrow(self, w, mt):
        """First row of m16 tile ``mt`` of warp ``w``."""
        return (w * self.mt + mt) * TC_WROWS

    def row_ok(self, r, ti):
        """Row slot ``r`` holds a token of the tile (``ti[3]`` = tokens in the tile)."""
        return T.And(r < self.rv, T.truncdiv(r, self.g) < ti[3])

    def o_row(self, r):
        """Token row in o and head of block row ``r``."""
        return T.truncdiv(r, self.g), T.truncmod(r, self.g)

    def store_index(self, key, dim, c01):
        """Element of (``key``, ``dim``) in a stage's row-major K (``c01`` 0) or V (1) tile."""
        return k_store_index(key, dim, self.d) if c01 == 0 else v_store_index(key, dim, self.dv)


__all__ = ["TcParams"]
