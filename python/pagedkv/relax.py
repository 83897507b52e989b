"""``pagedkv.relax.PagedKVCache``: the Relax-level constructor.

An ``nn.Object`` built from a ``KVCacheConfig``, a backend choice and a target. Constructing it inside an
``nn.Module`` export adds every op's kernels to the IRModule and emits one ``pagedkv.create`` call with the
config as versioned JSON and a named op table. Its attention methods have the names and signatures of
``tvm.relax.frontend.nn.llm.PagedKVCache``, so an existing nn model switches by changing its constructor.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Mapping, Sequence

import tvm
from tvm import relax as rx
from tvm import tirx
from tvm.relax.frontend.nn import Object, Tensor

from . import backends as _backends
from . import ops as _ops
from .config import RUNTIME_FIELDS, KVCacheConfig, check_sm_scale


_EXPORT_OPTIONS: contextvars.ContextVar[list | None] = contextvars.ContextVar("pagedkv_export_options",
                                                                              default=None)


@contextlib.contextmanager
def collect_export_options() -> Iterator[list[str]]:
    """Within this context, the ``export_library`` options that the caches' backends need (``OpBuild.
    export_options``, e.g. FlashInfer's ``-lcudart``) are appended to the yielded list
    (``pagedkv.compile.export_model`` wraps the model export in it)."""
    options: list[str] = []
    token = _EXPORT_OPTIONS.set(options)
    try:
        yield options
    finally:
        _EXPORT_OPTIONS.reset(token)


def _op_entry(op: str, tag: str, config: KVCacheConfig, target: Any, suffix: str = "") -> rx.Tuple:
    """Add ``op``'s functions (built for ``config``) to the module being built; return its op-table entry.
    ``suffix`` renames them (and their ``global_symbol``): a window's kernels beside the base ones."""
    bb = rx.BlockBuilder.current()
    collected = _EXPORT_OPTIONS.get()
    build = _backends.get_backend(tag).build(op, config, target)
    if collected is not None:
        collected += [o for o in build.export_options if o not in collected]
    funcs = [tvm.ir.StringImm(s) for s in build.op_table_head()[2:]]
    prim_funcs = [(name + suffix, func.with_attr("global_symbol", name + suffix) if suffix else func)
                  for name, func in build.prim_funcs]
    funcs += [bb.add_func(func, name) for name, func in prim_funcs]
    funcs += [rx.ExternFunc(symbol) for symbol in build.extern_symbols]
    for built in build.extern_modules:
        _add_extern_object(built.object_path, built.functions.values())
    return rx.Tuple([tvm.ir.StringImm(op), tvm.ir.StringImm(tag), *funcs])


def _op_table_expr(config: KVCacheConfig, target: Any, resolution) -> rx.Tuple:
    """Add each op's functions to the module being built; return the op table as a Relax tuple. Layer groups
    (schema 7): the window ops of each window again, built for ``config.window_config(W)``, in a sub-table
    ``("window=<W>", entry...)``."""
    entries = [_op_entry(op, tag, config, target) for op, tag in resolution.choice.items()]
    for window in config.group_windows:
        sub = [_op_entry(op, tag, config.window_config(window), target, f"_w{window}")
               for op, tag in resolution.choice.items() if op in _ops.WINDOW_OPS]
        entries.append(rx.Tuple([tvm.ir.StringImm(f"window={window}"), *sub]))
    return rx.Tuple(entries)


def _add_extern_object(path, symbols) -> None:
    """Register a prebuilt object (e.g. a FlashInfer module) with the nn exporter, once per file: the model
    is then exported with ``allow_extern=True`` (``pagedkv.compile.export_model``) and the object linked into
    its library."""
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn.exporter import Exporter

    try:
        exporter = Exporter.current()
    except AssertionError:
        raise RuntimeError("a PagedKVCache whose backends link prebuilt objects (FlashInfer) must be created "
                           "while an nn.Module is exported (export_tvm)") from None
    if any(getattr(m, "filepath", None) == path for m in exporter.extern_mods):
        return
    nn.add_extern(nn.ObjectModule({name: None for name in symbols}, path))


def _sm_scale(sm_scale: Any, method: str) -> Any:
    """``sm_scale`` of a ``PagedKVCache`` attention method, checked when the model is built if it is a constant
    (finite and > 0, ``check_sm_scale``); a symbolic one is checked by the runtime at every call."""
    if isinstance(sm_scale, (tirx.FloatImm, tirx.IntImm)):
        check_sm_scale(sm_scale.value, f"PagedKVCache.{method}")
        return sm_scale
    if isinstance(sm_scale, tirx.Expr):
        return sm_scale
    return check_sm_scale(sm_scale, f"PagedKVCache.{method}")


class PagedKVCache(Object):  # pylint: disable=too-few-public-methods
    """A paged KV cache created inside a compiled model.

    The runtime object is also a TVM ``AttentionKVCache`` (``relax.vm.AttentionKVCache``): functions that take
    it as a ``tvm.relax.frontend.nn.llm.PagedKVCache`` (their spec's ``object_type``) and call that class's
    methods (``vm.builtin.attention_kv_cache_*``) run on it too, as do engines that drive it through
    ``vm.builtin.kv_state_*`` (README, "Drop-in for TVM's KV-state protocol").

    Parameters
    ----------
    config :
        The cache configuration. Its capacity fields may be overridden by ``runtime_values``.
    target :
        The compilation target of the model (``"llvm"``, a ``Target``, or a CUDA target dict).
    backend :
        A backend tag, a priority list, or ``None`` for automatic per-op selection.
    runtime_values :
        Capacity fields known only at run time, by name (e.g. ``{"max_batch_size": tirx.Var(...)}``):
        any of ``max_batch_size``, ``max_total_seq_len``, ``prefill_chunk_size``, ``page_size``.
    """

    def __init__(self, config: KVCacheConfig | None = None, *, target: Any = None,
                 backend: str | Sequence[str] | None = None, runtime_values: Mapping[str, Any] | None = None,
                 name: str = "paged_kv_cache", _expr: rx.Expr | None = None, _name: str | None = None) -> None:
        if _expr is not None:
            # The nn exporter wraps function parameters of this type: no construction, just the handle.
            super().__init__(_expr=_expr, _name=_name or name)
            return
        if config is None or target is None:
            raise TypeError("PagedKVCache needs a KVCacheConfig and a target")
        runtime_values = dict(runtime_values or {})
        unknown = sorted(set(runtime_values) - set(RUNTIME_FIELDS))
        if unknown:
            raise ValueError(f"runtime_values has unknown fields {unknown}; allowed: {RUNTIME_FIELDS}")
        self.config = config
        self.resolution = _backends.resolve(config, target, backend)
        names = tuple(runtime_values)
        args = [
            tvm.ir.StringImm(config.to_json(runtime_fields=names)),
            rx.ShapeExpr([runtime_values[n] for n in names]),
            _op_table_expr(config, target, self.resolution),
            rx.op.zeros((1,), config.dtype),  # tells the runtime which device the pages live on
        ]
        super().__init__(
            _expr=rx.call_pure_packed("pagedkv.create", *args, ty_args=rx.AnyType()), _name=name)

    @staticmethod
    def _sinks(sinks: Tensor, num_qo_heads: Any, method: str) -> rx.Expr:
        """The ``sinks`` argument of an attention method, checked while the model is built: float32
        ``[num_qo_heads]``. (Whether the cache's config has ``attention_sinks`` is checked by the runtime at the
        call: a model's methods get the cache as a parameter, which carries no config.)"""
        ty = sinks._expr.ty  # pylint: disable=protected-access
        shape = [int(x) if isinstance(x, tirx.IntImm) else x for x in ty.shape]
        if ty.dtype != "float32" or len(shape) != 1 or (isinstance(shape[0], int) and shape[0] != int(num_qo_heads)):
            raise ValueError(f"PagedKVCache.{method}: sinks must be float32 [{num_qo_heads}] (one logit per query "
                             f"head), got {ty.dtype} {shape}")
        return sinks._expr  # pylint: disable=protected-access

    #: As ``tvm.relax.frontend.nn.llm.PagedKVCache.extern_mods`` (model code that collects the cache's external
    #: modules reads it): pagedkv links its prebuilt objects through the exporter instead (``_add_extern_object``).
    extern_mods: list = []

    # The methods below keep the names and signatures of tvm.relax.frontend.nn.llm.PagedKVCache; ``sinks`` is
    # pagedkv's own keyword (learnable attention sinks, config ``attention_sinks``).
    # pylint: disable=protected-access
    def attention_with_fused_qkv(self, layer_id: int, qkv: Tensor, num_qo_heads: int,
                                 sm_scale: float, *, sinks: Tensor | None = None) -> Tensor:
        """``qkv[b, s, Hq + 2 Hkv, D]`` -> ``o[b, s, Hq, D]``; appends the new k/v to the cache.

        ``sinks``: ``float32[Hq]`` learnable attention sinks (one more softmax logit per query head whose value is
        0, natural log, beside the scaled scores; gpt-oss), on a config with ``attention_sinks``."""
        sm_scale = _sm_scale(sm_scale, "attention_with_fused_qkv")
        b, s, _, d = qkv._expr.ty.shape
        qkv = qkv.reshape(b * s, qkv.shape[2], d)
        args = [self._expr, rx.prim_value(layer_id), rx.prim_value(sm_scale), qkv._expr]
        if sinks is not None:
            args.append(self._sinks(sinks, num_qo_heads, "attention_with_fused_qkv"))
        out = rx.call_dps_packed(
            "pagedkv.attention_with_fused_qkv" + ("_sinks" if sinks is not None else ""), args,
            out_ty=rx.TensorType((b * s, num_qo_heads, d), qkv.dtype))
        return Tensor(_expr=rx.BlockBuilder.current().emit(out)).reshape(b, s, num_qo_heads, d)

    def self_attention(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor,
                       sm_scale: float) -> tuple[Tensor, Tensor]:
        """Ragged causal attention over the new tokens: ``(o[b, s, Hq, Dv], lse[b, s, Hq])``."""
        sm_scale = _sm_scale(sm_scale, "self_attention")
        b, s, h_qo, d_qk = q._expr.ty.shape
        _, _, h_kv, d_v = v._expr.ty.shape
        args = [self._expr, rx.prim_value(layer_id), rx.prim_value(sm_scale),
                q.reshape(b * s, h_qo, d_qk)._expr, k.reshape(b * s, h_kv, d_qk)._expr,
                v.reshape(b * s, h_kv, d_v)._expr]
        return self._o_lse("pagedkv.self_attention", args, b, s, h_qo, d_v, q.dtype)

    def cross_attention(self, layer_id: int, q: Tensor, v_head_dim: int,
                        sm_scale: float, *, sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Attention of ``q`` over the cached k/v: ``(o[b, s, Hq, v_head_dim], lse[b, s, Hq])``.

        ``sinks``: as in ``attention_with_fused_qkv``, merged into the returned state; a model that merges this
        with ``self_attention`` gives them here only (each query counts its sink once)."""
        sm_scale = _sm_scale(sm_scale, "cross_attention")
        b, s, h_qo, d_qk = q._expr.ty.shape
        args = [self._expr, rx.prim_value(layer_id), rx.prim_value(sm_scale),
                q.reshape(b * s, h_qo, d_qk)._expr]
        if sinks is not None:
            args.append(self._sinks(sinks, h_qo, "cross_attention"))
        name = "pagedkv.cross_attention" + ("_sinks" if sinks is not None else "")
        return self._o_lse(name, args, b, s, h_qo, v_head_dim, q.dtype)

    def attention_with_shared_kv(self, source_layer_id: int, q: Tensor, current_k: Tensor, current_v: Tensor,
                                 sm_scale: float) -> Tensor:
        """TVM's attention over another layer's K/V; pagedkv has no kernels for it.

        Raises
        ------
        NotImplementedError
            Always, when the model is built (not when it runs).
        """
        raise NotImplementedError(
            "not supported by pagedkv: attention with K/V shared across layers (PagedKVCache."
            "attention_with_shared_kv); give each layer its own attention_with_fused_qkv")

    def append_mla_kv(self, layer_id: int, kv: Tensor) -> "PagedKVCache":
        """MLA: write the latents ``kv[b, s, kv_lora_rank + qk_rope_head_dim]`` of the forward's tokens (TVM's
        layout ``kv[b, s, 1, ...]``, one latent "head", is taken too).

        Returns the cache; use the returned object for the layer's attention calls so that they follow
        the append in the dataflow (a decode ``cross_attention`` reads the appended token).
        """
        if len(kv._expr.ty.shape) == 4:
            b, s, h, d = kv._expr.ty.shape
            if not (isinstance(h, tirx.IntImm) and h.value == 1):
                raise ValueError(f"PagedKVCache.append_mla_kv: kv[b, s, heads, d] must have one head, got {h}")
            kv = kv.reshape(b, s, d)
        b, s, d = kv._expr.ty.shape
        res = rx.call_pure_packed("pagedkv.append_mla_kv", self._expr, rx.prim_value(layer_id),
                                  kv.reshape(b * s, d)._expr, ty_args=rx.AnyType())
        return PagedKVCache(_expr=rx.BlockBuilder.current().emit(res), _name="paged_kv_cache")

    def _o_lse(self, func: str, args, b, s, h_qo, d_v, dtype) -> tuple[Tensor, Tensor]:
        bb = rx.BlockBuilder.current()
        res = bb.emit(rx.call_dps_packed(func, args, out_ty=[
            rx.TensorType((b * s, h_qo, d_v), dtype), rx.TensorType((b * s, h_qo), "float32")]))
        o = Tensor(_expr=bb.emit(rx.TupleGetItem(res, 0))).reshape(b, s, h_qo, d_v)
        lse = Tensor(_expr=bb.emit(rx.TupleGetItem(res, 1))).reshape(b, s, h_qo)
        return o, lse

    def merge_attn_output_inplace(self, o_self_attn: Tensor, lse_self_attn: Tensor,
                                  o_cross_attn: Tensor, lse_cross_attn: Tensor) -> tuple[Tensor, Tensor]:
        """Merge two attention states; the first two tensors are updated in place and returned."""
        b, s, h_qo, d_v = o_self_attn._expr.ty.shape
        flat = [o_self_attn.reshape(b * s, h_qo, d_v), lse_self_attn.reshape(b * s, h_qo),
                o_cross_attn.reshape(b * s, h_qo, d_v), lse_cross_attn.reshape(b * s, h_qo)]
        bb = rx.BlockBuilder.current()
        res = bb.emit(rx.call_pure_packed(
            "pagedkv.merge_attn_output_inplace", self._expr, *[t._expr for t in flat],
            ty_args=rx.TupleType([flat[0]._expr.ty, flat[1]._expr.ty])))
        o = Tensor(_expr=bb.emit(rx.TupleGetItem(res, 0))).reshape(b, s, h_qo, d_v)
        lse = Tensor(_expr=bb.emit(rx.TupleGetItem(res, 1))).reshape(b, s, h_qo)
        return o, lse

    def check_indices(self, values: Tensor, name: str, bound: Any, bound_name: str) -> Tensor:
        """``values`` (int32 / int64), after the runtime checked that each lies in ``[0, bound)``; a value
        outside raises ``ValueError`` naming it, its position and the range.

        Gather the returned tensor, not ``values``: the gather then runs after the check by data flow, and TVM's
        ``take`` (unchecked: an index past the end crashes the process, a negative one reads another row) never
        sees an index the check did not pass. The check copies ``values`` to the host (a wait on a GPU).

        Parameters
        ----------
        values :
            Indices, e.g. a model's input token ids.
        name, bound_name :
            What ``values`` and ``bound`` are called in the error (``"input_ids"``, ``"vocab_size"``).
        bound :
            The exclusive upper bound: an int or a symbolic ``tirx`` expression (e.g. a dim of the input).
        """
        bb = rx.BlockBuilder.current()
        return Tensor(_expr=bb.emit(rx.call_pure_packed(
            "pagedkv.check_indices", self._expr, values._expr, tvm.ir.StringImm(name), rx.prim_value(bound),
            tvm.ir.StringImm(bound_name), ty_args=values._expr.ty)))

    def get_query_positions(self, total_length: tirx.Expr) -> Tensor:
        """In-sequence positions of the queries of this forward, ``int32[total_length]``."""
        return Tensor(_expr=rx.BlockBuilder.current().emit(rx.call_pure_packed(
            "pagedkv.get_query_positions", self._expr,
            ty_args=rx.TensorType((total_length,), "int32"))))
    # pylint: enable=protected-access


__all__ = ["PagedKVCache"]
