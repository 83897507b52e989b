"""The Relax pipeline pagedkv compiles models with for the CPU (``llvm``): TVM's, plus scheduling.

TVM 0.27's CPU pipeline (``tvm.relax.backend.cpu_generic``) legalizes every operator into a plain loop nest
and stops: no threads, no vectors (SmolLM2-135M decoded at 1.5 tokens/s on two cores). After ``FuseTIR``
this pipeline goes over the model's PrimFuncs once:

* projections (``matmul`` over a ``[K, N]`` weight, maybe with a residual ``add``) are replaced by the
  hand-written kernels of ``pagedkv.cpu_kernels`` (streaming GEMV for a few rows, register-tiled GEMM). In a
  float16 / bfloat16 model a projection is a float32-accumulating ``matmul``, a ``cast`` back to the model's
  dtype and maybe the residual ``add`` in that dtype: the same kernels, storing half outputs (before they
  took these, dlight's ``Reduction`` rule got them: one output at a time, 7-50x slower than float32);
* normalizations and softmax-like functions (a reduction then elementwise blocks: RMSNorm) get dlight's
  CPU ``Reduction`` rule (rows in parallel, vectorized elementwise parts);
* elementwise functions (SiLU * mul, embedding gathers, casts) are inlined into one loop, vectorized, and
  cut into parallel chunks;
* anything else is left as TVM wrote it. The cache's kernels (``pagedkv_*``, scheduled already) and
  reshapes (which ``RewriteDataflowReshape`` turns into views) are never touched.

``SCHEDULE_VERSION`` names this set of schedules; model library keys include it (``pagedkv.apps.chat``).

float16 needs the CPU's conversion instructions (x86's F16C, in every AVX2 CPU): on an x86 target without them
LLVM converts every float16 value in a library call, and the projections run 4-20x slower than in float32
(measured with ``mcpu=x86-64``). The pass then warns at compile time (``SlowDtypeWarning``), naming bfloat16
(converted by a shift on any CPU) and float32. bfloat16 and float16 with F16C are as fast as float32 or faster.
"""

from __future__ import annotations

import warnings

import tvm
from tvm import s_tir, tirx

from . import cpu_kernels
from .cpu_kernels import MatmulShape

#: Bumped whenever a schedule here or a kernel of ``cpu_kernels`` changes what is compiled.
SCHEDULE_VERSION = "cpu-sched-4"
#: Elements of one parallel task of an elementwise function (small ones stay on one thread).
ELEMWISE_CHUNK = 4096


def _src(region_or_load):
    src = getattr(region_or_load, "source", None)  # TVM 0.27 names it `source` (regions and loads)
    return src if src is not None else region_or_load.buffer


def _blocks(func: tirx.PrimFunc):
    sch = s_tir.Schedule(func)
    return sch, [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))]


def _loads(expr) -> list:
    """The buffer loads of ``expr`` (through casts), or None if it holds anything but loads, casts, +, *."""
    if isinstance(expr, tirx.Cast):
        return _loads(expr.value)
    if isinstance(expr, (tirx.Add, tirx.Mul)):
        a, b = _loads(expr.a), _loads(expr.b)
        return None if a is None or b is None else a + b
    return [expr] if hasattr(expr, "indices") else None


def _same_vars(indices, vars_) -> bool:
    return len(indices) == len(vars_) and all(i.same_as(v) for i, v in zip(indices, vars_))


def _match_product(block, params) -> tuple | None:
    """(a, w, c) of a ``c[s..., n] += a[s..., k] * w[k, n]`` block whose ``w`` is a static 2-D parameter."""
    if block.init is None or len(block.reads) != 2 or len(block.writes) != 1:
        return None
    ivs = [iv.var for iv in block.iter_vars]
    kinds = [int(iv.iter_type) for iv in block.iter_vars]
    if kinds[-1] != 2 or any(k != 0 for k in kinds[:-1]):  # spatial..., reduction
        return None
    store, c = block.body, _src(block.writes[0])
    if not isinstance(store, tirx.BufferStore) or not isinstance(store.value, tirx.Add):
        return None
    acc, prod = store.value.a, store.value.b
    loads = _loads(prod) if isinstance(prod, (tirx.Mul, tirx.Cast)) else None
    if not hasattr(acc, "indices") or not _src(acc).same_as(c) or not loads or len(loads) != 2:
        return None
    a_load, w_load = loads
    a, w = _src(a_load), _src(w_load)
    if not any(w.same_as(p) for p in params) or len(w.shape) != 2:
        return None
    if not all(isinstance(d, tirx.IntImm) for d in w.shape):
        return None
    spatial, k = ivs[:-1], ivs[-1]
    if not (_same_vars(a_load.indices, [*spatial[:-1], k]) and _same_vars(w_load.indices, [k, spatial[-1]])
            and _same_vars(store.indices, spatial)):
        return None
    return a, w, c


def _elementwise_store(block):
    """(store, iter vars) of a block ``out[i...] = ...`` over spatial iterators only, else None."""
    store = block.body
    if block.init is not None or not isinstance(store, tirx.BufferStore) or len(block.writes) != 1:
        return None
    ivs = [iv.var for iv in block.iter_vars]
    if any(int(iv.iter_type) != 0 for iv in block.iter_vars) or not _same_vars(store.indices, ivs):
        return None
    return store, ivs


def _match_residual(block, c) -> tuple | None:
    """(res, out) of an ``out[i] = res[i] + c[i]`` (or ``c + res``) block."""
    found = _elementwise_store(block)
    if found is None or not isinstance(found[0].value, tirx.Add):
        return None
    store, ivs = found
    loads = [store.value.a, store.value.b]
    if not all(hasattr(x, "indices") and _same_vars(x.indices, ivs) for x in loads):
        return None
    others = [_src(x) for x in loads if not _src(x).same_as(c)]
    if len(others) != 1:
        return None
    return others[0], _src(block.writes[0])


def _match_cast(block, c):
    """``out`` of an ``out[i] = T.Cast(dtype, c[i])`` block (a float32 product back to a half model's dtype)."""
    found = _elementwise_store(block)
    if found is None or not isinstance(found[0].value, tirx.Cast):
        return None
    store, ivs = found
    src = store.value.value
    if not (hasattr(src, "indices") and _src(src).same_as(c) and _same_vars(src.indices, ivs)):
        return None
    return _src(block.writes[0])


def _match_epilogue(blocks, c) -> tuple | None:
    """(res or None, out) of the blocks after the product: none, a cast, a residual add, or a cast then an
    add (what a float16 / bfloat16 model's float32-accumulating projection becomes), else None."""
    res, cur = None, c
    for i, block in enumerate(blocks):
        cast_out = _match_cast(block, cur) if i == 0 else None
        if cast_out is not None:
            cur = cast_out
            continue
        found = _match_residual(block, cur) if res is None else None
        if found is None:
            return None
        res, cur = found
    if cur is not c and list(cur.shape) != list(c.shape):
        return None
    if res is not None and (res.dtype != cur.dtype or list(res.shape) != list(cur.shape)):
        return None
    return res, cur


def match_matmul(func: tirx.PrimFunc) -> MatmulShape | None:
    """The projection ``func`` computes, if it is one ``cpu_kernels.matmul_kernel`` replaces."""
    try:
        _, blocks = _blocks(func)
    except Exception:  # noqa: BLE001 (not a block-structured function: not ours to replace)
        return None
    params = list(func.params)
    if not 1 <= len(blocks) <= 3 or not blocks[0].name_hint.startswith("matmul"):
        return None
    found = _match_product(blocks[0], params)
    if found is None:
        return None
    a, w, c = found
    # The product accumulates in float32 (a float16 accumulator would change the sums' rounding).
    epilogue = _match_epilogue(blocks[1:], c) if c.dtype == "float32" else None
    if epilogue is None:
        return None
    res, out = epilogue
    roles = {"a": a, "w": w, "out": out, **({"res": res} if res is not None else {})}
    order = []
    for p in params:
        role = [r for r, buf in roles.items() if buf.same_as(p)]
        if len(role) != 1:
            return None
        order.append(role[0])
    if sorted(order) != sorted(roles):
        return None
    k, n = (int(d) for d in w.shape)
    if len(a.shape) != len(out.shape) or int(a.shape[-1]) != k or int(out.shape[-1]) != n:
        return None
    shape = MatmulShape(tuple(order), tuple(a.shape), tuple(out.shape), k, n, str(a.dtype), str(w.dtype),
                        str(out.dtype))
    return shape if cpu_kernels.supported(shape) else None


def _schedule_reduction(func: tirx.PrimFunc, target) -> tirx.PrimFunc | None:
    """dlight's CPU ``Reduction`` rule (RMSNorm, softmax-like functions), or None where it does not apply."""
    from tvm.s_tir.dlight.cpu import Reduction

    try:
        sch = Reduction().apply(func, target, False)
    except Exception:  # noqa: BLE001 (the rule refuses by raising for some shapes)
        return None
    return None if sch is None else sch.mod["main"]


def _schedule_elementwise(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """Inline every block into the last, fuse its loops, vectorize and cut into parallel chunks."""
    try:
        sch, blocks = _blocks(func)
    except Exception:  # noqa: BLE001
        return None
    if not blocks or any(b.init is not None for b in blocks):
        return None
    try:
        for b in blocks[:-1]:
            sch.compute_inline(sch.get_sblock(b.name_hint))
        last = sch.get_sblock(blocks[-1].name_hint)
        loops = sch.get_loops(last)
        if not loops:
            return None
        fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
        # Vector lanes first: the extents are multiples of 16 here (hidden sizes), so the vector loop carries
        # no bounds check; the chunk split's check then only involves the loops above it.
        rest, vec = sch.split(fused, [None, cpu_kernels.LANES])
        outer, _ = sch.split(rest, [None, ELEMWISE_CHUNK // cpu_kernels.LANES])
        sch.parallel(outer)
        sch.vectorize(vec)
    except Exception:  # noqa: BLE001 (a block that cannot be inlined: leave the function as it is)
        return None
    return sch.mod["main"]


def schedule_func(func: tirx.PrimFunc, target) -> tuple[str, tirx.PrimFunc]:
    """(what was done, the function) for one model PrimFunc: ``"matmul"``, ``"reduction"``,
    ``"elementwise"`` or ``"kept"``."""
    if "global_symbol" in func.attrs or func.attrs.get("tirx.is_scheduled", False):
        return "kept", func
    if tvm.relax.analysis.has_reshape_pattern(func):
        return "kept", func
    shape = match_matmul(func)
    if shape is not None:
        return "matmul", cpu_kernels.matmul_kernel(shape).with_attrs(
            {k: v for k, v in func.attrs.items() if k != "tirx.is_scheduled"})
    for kind, rule in (("reduction", lambda f: _schedule_reduction(f, target)),
                       ("elementwise", _schedule_elementwise)):
        new = rule(func)
        if new is not None:
            return kind, new.with_attr("tirx.is_scheduled", True)
    return "kept", func


class SlowDtypeWarning(UserWarning):
    """A model compiled for the CPU in a dtype this CPU target runs far slower than another (see the module)."""


def slow_dtype_message(dtypes, target) -> str | None:
    """Why a model whose functions hold ``dtypes`` is slow on the llvm ``target`` (naming the faster dtypes),
    or None: float16 on an x86 CPU without F16C."""
    from tvm.target import codegen

    if "float16" not in dtypes:
        return None
    features = codegen.llvm_get_cpu_features(target)
    if "sse2" not in features or "f16c" in features:  # not x86 (AArch64 converts in NEON), or F16C there
        return None
    mcpu = target.attrs["mcpu"] if "mcpu" in target.attrs else "generic"
    return (f"pagedkv: a float16 model compiled for a CPU without F16C (llvm mcpu={mcpu}): every float16 value "
            "is converted in software, and its projections run 4-20x slower than in float32. bfloat16 (the same "
            "size, converted by a shift) or float32 is faster here.")


def _param_dtypes(mod: tvm.IRModule) -> set[str]:
    """Dtypes of the PrimFuncs' buffer parameters (the model's weights and activations; the cache's kernels
    take handles, which have none)."""
    return {str(getattr(p, "dtype", "handle")) for func in mod.functions.values()
            if isinstance(func, tirx.PrimFunc) for p in func.params}


def schedule_pass(target, report: dict | None = None):
    """Module pass scheduling every model PrimFunc (``schedule_func``); ``report`` collects name -> kind.
    Warns (``SlowDtypeWarning``) where the model's dtype is far slower on ``target`` than another."""

    @tvm.transform.module_pass(opt_level=0, name="pagedkv.ScheduleCPU")
    def _pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        slow = slow_dtype_message(_param_dtypes(mod), target)
        if slow is not None:
            warnings.warn(slow, SlowDtypeWarning, stacklevel=2)
        updates = {}
        for gv, func in mod.functions.items():
            if isinstance(func, tirx.PrimFunc):
                kind, new = schedule_func(func, target)
                if report is not None:
                    report[gv.name_hint] = kind
                if kind != "kept":
                    updates[gv] = new
        for gv, func in updates.items():
            mod[gv] = func
        return mod

    return _pass


def cpu_pipeline(target, report: dict | None = None):
    """TVM's CPU Relax pipeline with ``schedule_pass`` after operator fusion."""
    from tvm.relax.backend.cpu_generic import pipeline as cp

    @tvm.transform.module_pass(opt_level=0, name="pagedkv.CPUPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            seq = tvm.transform.Sequential(cp.library_dispatch_passes(target) + cp.legalize_passes(target)
                                           + [schedule_pass(target, report)] + cp.dataflow_lower_passes(target)
                                           + cp.finalize_passes(target))
            return seq(mod)

    return _pipeline
