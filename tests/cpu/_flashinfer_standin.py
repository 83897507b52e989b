"""Stand-ins for FlashInfer 0.7.4's plan/run functions, for driving the runtime's "flashinfer" adapters on the
CPU (src/flashinfer_adapter.cc).

Each stand-in checks its argument count and the "off" values against the pinned lists
(``pagedkv.flashinfer.abi``), records what it was given (host arrays read during the call), and -- for the
run functions -- computes attention from the tensors exactly as FlashInfer's kernels read them: through the
given pointers and strides, the plan's host arrays where FlashInfer's kernel takes them from the plan (fa3,
MLA), writing ``o`` and a base-2 ``lse`` that is ``-inf`` for rows without keys (FlashInfer's convention,
which the adapter must turn into pagedkv's ``-1e30``). So the scenario suite run through these checks the
adapters' argument plumbing (views, strides, offsets, masks, plans, workspaces) against the reference.
"""

from __future__ import annotations

import ctypes
import math

import ml_dtypes  # noqa: F401 (numpy's "bfloat16", for views of bf16 tensors; a dependency of apache-tvm)
import numpy as np

from pagedkv.flashinfer import abi

MASK_NONE, MASK_CAUSAL = 0, 1
LAYOUT_NHD, LAYOUT_HND = 0, 1


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
                ("lanes", ctypes.c_uint16), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("byte_offset", ctypes.c_uint64)]


def raw_dltensor(t) -> _DLTensor:
    """The ``DLTensor`` of a tensor argument as FlashInfer's C++ sees it: FlashInfer reads ``DLTensor::data``
    and ignores ``byte_offset`` (Python's ``data_ptr()`` adds it), and reads ``strides`` unchecked
    (Python's ``strides`` fills in compact ones). A borrowed ``DLTensor*`` argument has
    no DLPack export, so the ``DLTensor*`` the Python object wraps (tvm_ffi's Cython ``Tensor.cdltensor``,
    after ``CObject.chandle``) is found in the object's memory: the slot whose DLTensor has this tensor's
    ndim and ``data + byte_offset == data_ptr()``."""
    base = id(t)
    want_ptr, want_ndim = t.data_ptr(), len(t.shape)
    for slot in range(2, 8):
        p = ctypes.c_void_p.from_address(base + 8 * slot).value
        if not p:
            continue
        d = _DLTensor.from_address(p)
        if d.ndim == want_ndim and (d.data or 0) + d.byte_offset == want_ptr:
            return d
    raise AssertionError("could not find the DLTensor of a tensor argument")


def view(t) -> np.ndarray:
    """A writable numpy view of a CPU tensor argument through its pointer and strides (no copy)."""
    dtype = np.dtype(str(t.dtype))
    shape = tuple(int(s) for s in t.shape)
    strides = tuple(int(s) for s in t.strides)
    if 0 in shape:
        return np.empty(shape, dtype)
    span = 1 + sum((s - 1) * st for s, st in zip(shape, strides))
    buf = (ctypes.c_byte * (span * dtype.itemsize)).from_address(t.data_ptr())
    flat = np.frombuffer(buf, dtype=dtype, count=span)
    return np.lib.stride_tricks.as_strided(flat, shape, tuple(st * dtype.itemsize for st in strides))


def attend(q, k, v, sm_scale, causal, window_left=-1, soft_cap=0.0):
    """Softmax attention of q[m, D] over k[L, D], v[L, Dv] (float64); bottom-right causal. Returns o, base-2
    lse, with FlashInfer's empty rows: o = 0, lse = -inf. FlashInfer's options: ``window_left >= 0`` keeps
    keys ``j >= L - m + i - window_left`` for query ``i`` (causal or not), ``soft_cap > 0`` maps scores to
    ``soft_cap * tanh(s / soft_cap)``."""
    m, L = q.shape[0], k.shape[0]
    o = np.zeros((m, v.shape[1]))
    lse = np.full(m, -np.inf)
    if L == 0:
        return o, lse
    s = (q @ k.T) * sm_scale
    if soft_cap > 0:
        s = soft_cap * np.tanh(s / soft_cap)
    j, pos = np.arange(L)[None, :], (L - m + np.arange(m))[:, None]
    if causal:
        s = np.where(j > pos, -np.inf, s)
    if window_left >= 0:
        s = np.where(j < pos - window_left, -np.inf, s)
    # rows with no visible key keep FlashInfer's empty state; the others get the softmax (vectorized: the
    # MLA split test attends thousands of rows)
    live = ~np.all(np.isneginf(s), axis=1)
    if live.any():
        sl = s[live]
        mx = sl.max(axis=1, keepdims=True)
        p = np.exp(sl - mx)
        tot = p.sum(axis=1, keepdims=True)
        o[live] = (p @ v) / tot
        lse[live] = (mx[:, 0] + np.log(tot[:, 0])) / math.log(2)
    return o, lse


def _named(func: abi.FuncABI, args) -> dict:
    assert len(args) == func.num_args, f"{func.kind}.{func.func}: {len(args)} arguments, pinned {func.num_args}"
    return dict(zip((n for n, _ in func.args), args))


def _host(t) -> list[int]:
    return [int(x) for x in view(t).reshape(-1)]


class FakeFlashInfer:
    """Stand-in modules. ``calls`` records (kind.func, named arguments summary) in call order; ``plans`` maps
    a plan id to the host arrays it was planned with."""

    #: FlashInfer 0.7.4's MLA planner: at most this many work items (scheduler.cuh MLAPlan), about one per 64
    #: packed (query, head) rows; the adapter must split larger passes.
    MLA_MAX_WORKS = 16384

    def __init__(self, *, window_left: int = -1, soft_cap: float = 0.0, cuda_graph: bool = False):
        # the attention options every plan and run must be given (the config's, in FlashInfer's terms)
        self.window_left, self.soft_cap = window_left, soft_cap
        # a CUDA-graph cache: decode plans come with enable_cuda_graph and, as FlashInfer's do, return the same
        # plan info for every plan of a batch size (a plan id per (function, batch size))
        self.cuda_graph = cuda_graph
        self.graph_plan_ids: dict[tuple[str, int], int] = {}
        self.perturb_next_graph_plan = False  # the next graph plan returns another plan info
        self.calls: list[tuple[str, dict]] = []
        self.plans: dict[int, dict] = {}
        # (function, argument, problem): a byte_offset != 0, or NULL strides
        self.offsets: list[tuple[str, str, object]] = []
        self.fail_next_plan = False  # the next plan raises (a device failure in begin_forward)

    # -- helpers --------------------------------------------------------------------------------------
    def _check_offsets(self, where, named):
        for name, value in named.items():
            if hasattr(value, "data_ptr") and hasattr(value, "strides"):
                d = raw_dltensor(value)
                if d.byte_offset:
                    self.offsets.append((where, name, int(d.byte_offset)))
                if d.ndim and not d.strides:
                    self.offsets.append((where, name, "strides NULL"))

    def _plan(self, func, args, where=None):
        if self.fail_next_plan:
            self.fail_next_plan = False
            raise RuntimeError("stand-in plan failure")
        named = _named(func, args)
        where = where or f"{func.kind}.{func.func}"
        self._check_offsets(where, named)
        rec = {k: (_host(v) if k in ("indptr", "qo_indptr", "kv_indptr", "kv_len_arr", "kv_len") else v)
               for k, v in named.items()}
        pid = 1000 + len(self.plans)
        if named.get("enable_cuda_graph"):
            key = (where, int(named["batch_size"]))
            if self.perturb_next_graph_plan:
                self.perturb_next_graph_plan = False
            else:
                pid = self.graph_plan_ids.setdefault(key, pid)
        self.plans[pid] = rec
        self.calls.append((where, rec))
        return pid, named

    def _run_common(self, func, args, where=None):
        named = _named(func, args)
        where = where or f"{func.kind}.{func.func}"
        self._check_offsets(where, named)
        info = list(named["plan_info_vec"])
        assert len(info) == 1 and info[0] in self.plans, f"{where}: unknown plan info {info}"
        summary = {k: v for k, v in named.items() if not hasattr(v, "data_ptr")}
        summary["plan_info_vec"] = info
        for name in ("paged_k_cache", "paged_v_cache", "ckv_cache", "kpe_cache", "q_nope", "q_pe"):
            if name in named:
                t = named[name]
                summary[name] = (tuple(t.shape), tuple(t.strides), t.data_ptr())
        self.calls.append((where, summary))
        return named, self.plans[info[0]]

    # -- decode ---------------------------------------------------------------------------------------
    def decode_plan(self, *args):
        pid, named = self._plan(abi.DECODE_PLAN, args)
        assert named["enable_cuda_graph"] is self.cuda_graph and named["window_left"] == self.window_left
        assert named["logits_soft_cap"] == self.soft_cap
        return [pid]

    def decode_run(self, *args):
        a, plan = self._run_common(abi.DECODE_RUN, args)
        assert a["kv_layout_code"] == LAYOUT_HND and a["window_left"] == self.window_left
        assert a["enable_pdl"] is False
        assert a["maybe_alibi_slopes"] is None and a["logits_soft_cap"] == self.soft_cap
        q, o, lse = view(a["q"]), view(a["o"]), view(a["maybe_lse"])
        kc, vc = view(a["paged_k_cache"]), view(a["paged_v_cache"])
        indptr, indices, last = (view(a[n]) for n in ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"))
        assert list(indptr) == plan["indptr"], "decode run: indptr differs from the planned one"
        self._paged(q, kc, vc, [0, *range(1, len(indptr))], indptr, indices, last, o, lse, a["sm_scale"], False,
                    layout=LAYOUT_HND)

    # -- prefill ----------------------------------------------------------------------------------------
    def prefill_plan(self, kind, *, decode: bool = False):
        """``decode``: the plan of attn_decode_paged on the prefill kernel (FlashInfer's tensor-core decode),
        one query per entry, planned as FlashInfer's decode wrapper does (uniform_q_len 1)."""
        func = abi.PREFILL_FA2_PLAN if kind == "prefill_fa2" else abi.PREFILL_FA3_PLAN

        def plan(*args):
            pid, named = self._plan(func, args)
            assert named["enable_cuda_graph"] is (self.cuda_graph and decode)
            assert named["window_left"] == self.window_left
            if kind == "prefill_fa2":
                uniform = (1, True) if decode else (0, False)
                assert (named["fixed_split_size"], named["disable_split_kv"], named["num_colocated_ctas"],
                        named["uniform_q_len"], named["fixed_uniform_q_len"]) == (-1, False, 0, *uniform)
            if decode:
                qo = self.plans[pid]["qo_indptr"]
                assert qo == list(range(len(qo))) and named["causal"] is False
            return [pid]

        return plan

    def _tail(self, kind, a):
        assert a["window_left"] == self.window_left and a["enable_pdl"] is False
        assert a["logits_soft_cap"] == self.soft_cap
        assert a["token_pos_in_items_len"] == 0
        opts = [n for n, t in (abi.PREFILL_FA2_RAGGED_RUN if kind == "prefill_fa2" else abi.PREFILL_FA3_RAGGED_RUN).args
                if t == abi.OPT_FT]
        assert all(a[n] is None for n in opts), {n: a[n] for n in opts}
        if kind == "prefill_fa3":
            assert a["scale_v_scalar"] == 1.0

    def ragged_run(self, kind):
        func = abi.PREFILL_FA2_RAGGED_RUN if kind == "prefill_fa2" else abi.PREFILL_FA3_RAGGED_RUN

        def run(*args):
            a, plan = self._run_common(func, args)
            self._tail(kind, a)
            assert a["layout"] == LAYOUT_NHD
            causal = a["mask_mode_code"] == MASK_CAUSAL
            q, k, v, o, lse = (view(a[n]) for n in ("q", "k", "v", "o", "maybe_lse"))
            if kind == "prefill_fa3":  # the kernel's indptr and lengths come from the plan
                qo, kv = plan["qo_indptr"], plan["kv_indptr"]
                assert [kv[i + 1] - kv[i] for i in range(len(kv) - 1)] == plan["kv_len_arr"]
            else:
                qo, kv = list(view(a["qo_indptr"])), list(view(a["kv_indptr"]))
                assert qo == plan["qo_indptr"] and kv == plan["kv_indptr"]
            gs = q.shape[1] // k.shape[1]
            for b in range(len(qo) - 1):
                for h in range(q.shape[1]):
                    ob, lb = attend(q[qo[b]:qo[b + 1], h].astype(np.float64), k[kv[b]:kv[b + 1], h // gs].astype(np.float64),
                                    v[kv[b]:kv[b + 1], h // gs].astype(np.float64), a["sm_scale"], causal,
                                    self.window_left, self.soft_cap)
                    o[qo[b]:qo[b + 1], h] = ob
                    lse[qo[b]:qo[b + 1], h] = lb

        return run

    def paged_run(self, kind):
        func = abi.PREFILL_FA2_PAGED_RUN if kind == "prefill_fa2" else abi.PREFILL_FA3_PAGED_RUN

        def run(*args):
            a, plan = self._run_common(func, args)
            self._tail(kind, a)
            assert a["layout"] == LAYOUT_HND
            causal = a["mask_mode_code"] == MASK_CAUSAL
            q, o, lse = view(a["q"]), view(a["o"]), view(a["maybe_lse"])
            kc, vc = view(a["paged_k_cache"]), view(a["paged_v_cache"])
            indices, last = view(a["paged_kv_indices"]), view(a["paged_kv_last_page_len"])
            if kind == "prefill_fa3":  # qo/kv indptr and kv lengths from the plan (batch_prefill_sm90.cu)
                qo, indptr = plan["qo_indptr"], plan["kv_indptr"]
                lens = plan["kv_len_arr"]
            else:
                qo, indptr = list(view(a["qo_indptr"])), list(view(a["paged_kv_indptr"]))
                assert qo == plan["qo_indptr"] and indptr == plan["kv_indptr"]
                lens = None
            self._paged(q, kc, vc, qo, indptr, indices, last, o, lse, a["sm_scale"], causal, layout=LAYOUT_HND,
                        lens=lens)

        return run

    def _paged(self, q, kc, vc, qo, indptr, indices, last, o, lse, sm_scale, causal, layout, lens=None):
        ps = kc.shape[2]
        hkv = kc.shape[1]
        gs = q.shape[1] // hkv
        for b in range(len(indptr) - 1):
            pages = [int(p) for p in indices[indptr[b]:indptr[b + 1]]]
            n = 0 if not pages else (len(pages) - 1) * ps + int(last[b])
            if lens is not None:
                assert lens[b] == n, f"planned kv_len {lens[b]} != {n}"
            keys = [(pages[j // ps], j % ps) for j in range(n)]
            for h in range(q.shape[1]):
                kk = np.array([kc[p, h // gs, s] for p, s in keys], np.float64).reshape(n, kc.shape[3])
                vv = np.array([vc[p, h // gs, s] for p, s in keys], np.float64).reshape(n, vc.shape[3])
                ob, lb = attend(q[qo[b]:qo[b + 1], h].astype(np.float64), kk, vv, sm_scale, causal,
                                self.window_left, self.soft_cap)
                o[qo[b]:qo[b + 1], h] = ob
                lse[qo[b]:qo[b + 1], h] = lb

    # -- MLA ----------------------------------------------------------------------------------------------
    def mla_plan(self, *args, kind="mla"):
        pid, named = self._plan(abi.MLA_PLAN, args, f"{kind}.plan")
        qo, heads = self.plans[pid]["qo_indptr"], named["num_heads"]
        tiles = sum(-(-(qo[i + 1] - qo[i]) * heads // 64) for i in range(len(qo) - 1))
        assert qo[0] == 0 and tiles + 132 <= self.MLA_MAX_WORKS, \
            f"MLA plan: {tiles} query tiles, more than FlashInfer's planner holds"
        # the planner leaves metadata in the page-locked buffer; the caller stages it to the device
        pinned = view(named["page_locked_int_workspace_buffer"])
        pattern = (np.arange(64) * 7 + pid) % 251
        pinned[:64] = pattern
        self.plans[pid]["pattern"] = pattern.copy()
        return ([pid], 64)

    def mla_run(self, *args, kind="mla"):
        a, plan = self._run_common(abi.MLA_RUN, args, f"{kind}.run")
        assert np.array_equal(view(a["int_workspace_buffer"])[:64], plan["pattern"]), \
            "MLA run: the staged plan metadata did not reach the int workspace"
        assert a["mask_mode_code"] == MASK_NONE and a["return_lse_base_on_e"] is False
        assert (a["ckv_scale"], a["kpe_scale"], a["maybe_ckv_scale_arr"]) == (1.0, 1.0, None)
        qn, qp, ckv, kpe, o, lse = (view(a[n]) for n in ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "o", "maybe_lse"))
        indices = view(a["kv_indices"])
        ps = a["page_size"]
        qo, indptr, lens = plan["qo_indptr"], plan["kv_indptr"], plan["kv_len"]
        assert a["num_heads"] == qn.shape[1]
        for b in range(len(indptr) - 1):
            pages = [int(p) for p in indices[indptr[b]:indptr[b + 1]]]
            n = lens[b]
            keys = [(pages[j // ps], j % ps) for j in range(n)]
            kn = np.array([ckv[p, s] for p, s in keys], np.float64).reshape(n, ckv.shape[2])
            kp = np.array([kpe[p, s] for p, s in keys], np.float64).reshape(n, kpe.shape[2])
            for h in range(qn.shape[1]):
                qq = np.concatenate([qn[qo[b]:qo[b + 1], h], qp[qo[b]:qo[b + 1], h]], axis=1).astype(np.float64)
                ob, lb = attend(qq, np.concatenate([kn, kp], axis=1), kn, a["sm_scale"], False)
                o[qo[b]:qo[b + 1], h] = ob
                lse[qo[b]:qo[b + 1], h] = lb

    # -- op-table entries ------------------------------------------------------------------------------------
    def entry(self, op: str, kind: str, empty_rows):
        import tvm_ffi

        if op == "attn_decode_paged" and kind == "decode|prefill_fa2":  # both, chosen per forward
            return [op, "flashinfer", kind, empty_rows, *map(tvm_ffi.convert, (
                self.decode_plan, self.decode_run, self.prefill_plan("prefill_fa2", decode=True),
                self.paged_run("prefill_fa2")))]
        if op == "attn_decode_paged" and kind == "decode":
            plan, run = self.decode_plan, self.decode_run
        elif op == "attn_decode_paged":
            plan, run = self.prefill_plan(kind, decode=True), self.paged_run(kind)
        elif op == "attn_prefill_ragged":
            plan, run = self.prefill_plan(kind), self.ragged_run(kind)
        elif op == "attn_prefill_paged":
            plan, run = self.prefill_plan(kind), self.paged_run(kind)
        else:  # fa2 and fa3 MLA share their argument lists
            def plan(*args):
                return self.mla_plan(*args, kind=kind)

            def run(*args):
                return self.mla_run(*args, kind=kind)
        return [op, "flashinfer", kind, empty_rows, tvm_ffi.convert(plan), tvm_ffi.convert(run)]

    def count(self, name: str) -> int:
        return sum(1 for n, _ in self.calls if n == name)
