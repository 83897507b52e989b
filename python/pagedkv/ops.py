"""The op vocabulary and kernel interface of pagedkv, written once.

``OP_SPECS`` is the single source of every op's name, the layer kinds that use it, whether a cache of a
kind requires it, and its argument list (name, tensor or scalar, dtype, shape symbols). From it come:

- the Python op lists (``OPS``, ``OPS_BY_KIND``, ``REQUIRED_BY_KIND``, ``ATTENTION_OPS``) and the op-name
  constants below;
- ``src/ops.h`` (``python -m pagedkv._ops_gen --header > src/ops.h``): op names, kind lists and, per op, the
  argument index constants and a typed argument struct that every C++ call site and adapter uses (a CPU
  test checks the committed header is current);
- the "Op vocabulary" table of ``docs/ARCHITECTURE.md`` (``python -m pagedkv._ops_gen --markdown``; checked too);
- the PrimFunc headers of the TIR kernels (``pagedkv.tir_kernels``), and a test that checks every PrimFunc's
  parameters and buffer shapes against it.

Names and argument lists are frozen once released (``docs/ARCHITECTURE.md``, versioning rule): a changed
ABI gets a new name.

Shape symbols: lower case are run-time sizes (``n`` new tokens, ``m`` ragged keys, ``b`` entries,
``p`` pages, ``ps`` page size, ``nnz`` page-table length, ``dv`` a merge's head dim); upper case are
compile-time sizes of the kernel shape: ``Hq``/``Hkv`` query/kv heads, ``D``/``Dv`` qk/v head dims,
``DL`` the MLA latent (kv_lora_rank + qk_rope_head_dim), ``R`` kv_lora_rank; ``PL`` page planes (2 for
MHA pages: K and V; 1 for MLA), ``PH`` page heads (``Hkv``; 1 for MLA), ``PD`` page row (``D``; ``DL``).
``b+1`` is one more than ``b``. Dtype ``"cache"`` is the cache's storage dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

MHA, MLA = "mha", "mla"
LAYER_KINDS: tuple[str, ...] = (MHA, MLA)


@dataclass(frozen=True)
class Arg:
    """One kernel argument: a tensor (``shape`` given) or a scalar (``shape`` is ``None``)."""

    name: str
    dtype: str
    shape: tuple[str, ...] | None = None

    @property
    def is_tensor(self) -> bool:
        return self.shape is not None


@dataclass(frozen=True)
class OpSpec:
    """One op: its name (TIR global symbol ``pagedkv_<name>``), the layer kinds whose caches use it, those
    that require it in their op table (others may leave it out; a call that needs it then fails naming
    it), the argument list in call order, and a one-line meaning."""

    name: str
    kinds: tuple[str, ...]
    required: tuple[str, ...]
    args: tuple[Arg, ...]
    doc: str

    @property
    def symbol(self) -> str:
        return f"pagedkv_{self.name}"

    def index(self, arg: str) -> int:
        """Position of argument ``arg``; raises ``KeyError`` naming the op."""
        for i, a in enumerate(self.args):
            if a.name == arg:
                return i
        raise KeyError(f"op {self.name!r} has no argument {arg!r}")


def _t(name: str, *shape: str, dtype: str = "cache") -> Arg:
    return Arg(name, dtype, tuple(shape))


def _i32(name: str, *shape: str) -> Arg:
    return Arg(name, "int32", tuple(shape))


_PAGES = _t("pages", "p", "PL", "PH", "ps", "PD")
_ROPE = (Arg("apply_rope", "int32"), Arg("rope_scale", "float32"), Arg("rope_theta", "float32"))
_SM = Arg("sm_scale", "float32")
_CAUSAL = Arg("causal", "int32")
_PAGE_TABLE = (_i32("page_indptr", "b+1"), _i32("page_values", "nnz"), _i32("last_page_len", "b"))
_LSE_N = _t("lse", "n", "Hq", dtype="float32")
_LSE_B = _t("lse", "b", "Hq", dtype="float32")

OP_SPECS: tuple[OpSpec, ...] = (
    OpSpec("split_rotary", (MHA,), (MHA,), (
        _t("qkv", "n", "Hq+2*Hkv", "D"), _i32("q_pos", "n"), _t("q", "n", "Hq", "D"), _t("k", "n", "Hkv", "D"),
        _t("v", "n", "Hkv", "D"), *_ROPE),
        "split fused qkv into q, k, v; optionally apply RoPE to q and k at the query positions"),
    OpSpec("append_kv", (MHA,), (MHA,), (
        _PAGES, _t("k", "n", "Hkv", "D"), _t("v", "n", "Hkv", "D"), _i32("slot", "n")),
        "write k, v of new tokens into pages at a position map (negative slot: skipped)"),
    OpSpec("gather_kv", (MHA,), (), (
        _PAGES, _i32("slot", "n"), _t("k", "n", "Hkv", "D"), _t("v", "n", "Hkv", "D")),
        "read k, v of tokens from pages at a position map (debug get)"),
    OpSpec("attn_prefill_ragged", (MHA, MLA), (MHA, MLA), (
        _t("q", "n", "Hq", "D"), _t("k", "m", "Hkv", "D"), _t("v", "m", "Hkv", "Dv"), _i32("q_indptr", "b+1"),
        _i32("kv_indptr", "b+1"), _i32("q_pos", "n"), _i32("k_pos_offset", "b"), _t("o", "n", "Hq", "Dv"),
        _LSE_N, _CAUSAL, *_ROPE, _SM),
        "attention of new queries over new k/v (no pages), causal or not"),
    OpSpec("attn_prefill_paged", (MHA,), (MHA,), (
        _t("q", "n", "Hq", "D"), _i32("q_indptr", "b+1"), _PAGES, *_PAGE_TABLE, _i32("k_pos_offset", "b"),
        _i32("q_pos", "n"), _t("o", "n", "Hq", "D"), _LSE_N, _CAUSAL, *_ROPE, _SM),
        "attention of multi-token queries over paged k/v, causal or not"),
    OpSpec("attn_decode_paged", (MHA,), (MHA,), (
        _t("q", "b", "Hq", "D"), _PAGES, *_PAGE_TABLE, _i32("k_pos_offset", "b"), _i32("q_pos", "b"),
        _t("o", "b", "Hq", "D"), _LSE_B, *_ROPE, _SM),
        "attention of one query token per sequence over paged k/v"),
    OpSpec("merge_state", (MHA, MLA), (MHA, MLA), (
        _t("o_a", "n", "Hq", "dv"), _t("lse_a", "n", "Hq", dtype="float32"), _t("o_b", "n", "Hq", "dv"),
        _t("lse_b", "n", "Hq", dtype="float32")),
        "merge two attention states (o, lse) in place into the first"),
    OpSpec("copy_page", (MHA, MLA), (MHA, MLA), (
        _PAGES, Arg("src_page", "int64"), Arg("dst_page", "int64"), Arg("num_tokens", "int64")),
        "copy the first n tokens of one page into another page"),
    OpSpec("compact_copy", (MHA, MLA), (), (
        _PAGES, _i32("src_slot", "n"), _i32("dst_slot", "n")),
        "move tokens between page slots (src slot -> dst slot)"),
    OpSpec("mla_append_kv", (MLA,), (MLA,), (
        _PAGES, _t("kv", "n", "DL"), _i32("slot", "n")),
        "MLA: write the latent of new tokens into pages at a position map (negative slot: skipped)"),
    OpSpec("mla_gather_kv", (MLA,), (), (
        _PAGES, _i32("slot", "n"), _t("kv", "n", "DL")),
        "MLA: read latents of tokens from pages (debug get)"),
    OpSpec("mla_attn_prefill_paged", (MLA,), (MLA,), (
        _t("q", "n", "Hq", "DL"), _i32("q_indptr", "b+1"), _PAGES, *_PAGE_TABLE, _t("o", "n", "Hq", "R"),
        _LSE_N, _CAUSAL, _SM),
        "MLA: absorbed attention of multi-token queries over paged latents"),
    OpSpec("mla_attn_decode_paged", (MLA,), (MLA,), (
        _t("q", "b", "Hq", "DL"), _PAGES, *_PAGE_TABLE, _t("o", "b", "Hq", "R"), _LSE_B, _SM),
        "MLA: absorbed attention of one query token per sequence over paged latents"),
)


def _partial(spec: OpSpec, kinds: tuple[str, ...]) -> OpSpec:
    """The partial-state variant of attention op ``spec``: its arguments with ``o`` in float32, optional."""
    args = tuple(Arg(a.name, "float32", a.shape) if a.name == "o" else a for a in spec.args)
    return OpSpec(f"{spec.name}_partial", kinds, (), args,
                  f"as {spec.name}, o in float32: one pass's state of a multi-pass forward (merge_state_partial)")


_BASE = {s.name: s for s in OP_SPECS}
# Multi-pass attention (shared-prefix passes, the own pass, a prefill's ragged pass) keeps every pass's partial
# output in float32 and rounds once, in the last merge: these ops are optional (a library without them, e.g.
# one compiled before they existed or of a float32 cache, merges in the storage dtype as before).
OP_SPECS += (
    _partial(_BASE["attn_prefill_ragged"], (MHA,)),
    _partial(_BASE["attn_prefill_paged"], (MHA,)),
    _partial(_BASE["attn_decode_paged"], (MHA,)),
    OpSpec("merge_state_partial", (MHA, MLA), (), (
        _t("o_a", "n", "Hq", "dv", dtype="float32"), _t("lse_a", "n", "Hq", dtype="float32"),
        _t("o_b", "n", "Hq", "dv", dtype="float32"), _t("lse_b", "n", "Hq", dtype="float32"),
        _t("o", "n", "Hq", "dv")),
        "merge two float32 states in place into the first (o_a, lse_a) and write the merged o, rounded to the "
        "cache dtype, into o"),
    _partial(_BASE["mla_attn_prefill_paged"], (MLA,)),
    _partial(_BASE["mla_attn_decode_paged"], (MLA,)),
)

# Learnable attention sinks (config ``attention_sinks``; gpt-oss): one more softmax logit per query head with a zero
# value, ``sinks[h]`` in natural log and compared with the scaled scores ``sm_scale * q.k`` (transformers' gpt-oss
# eager attention, FlashInfer's AttentionSink). In base-2 lse it is the state (o = 0, lse = sinks[h] * log2(e)),
# merged once into a forward's final state, whatever its passes: after the last pass (apply_sinks) or inside the
# last float32 merge (merge_state_partial_sinks, before the one rounding). Optional: only a sinks config's table
# holds them (``ops_for``).
_SINKS = _t("sinks", "Hq", dtype="float32")
OP_SPECS += (
    OpSpec("apply_sinks", (MHA, MLA), (), (
        _t("o", "n", "Hq", "dv"), _t("lse", "n", "Hq", dtype="float32"), _SINKS),
        "merge each row's state (o, lse) in place with its head's attention sink: a logit sinks[h] (natural log, "
        "beside the scaled scores) whose value is 0"),
    OpSpec("merge_state_partial_sinks", (MHA, MLA), (), (
        _t("o_a", "n", "Hq", "dv", dtype="float32"), _t("lse_a", "n", "Hq", dtype="float32"),
        _t("o_b", "n", "Hq", "dv", dtype="float32"), _t("lse_b", "n", "Hq", dtype="float32"), _SINKS,
        _t("o", "n", "Hq", "dv")),
        "as merge_state_partial, then the merged state with its head's attention sink (apply_sinks) before o "
        "is rounded: the last merge of a multi-pass forward with sinks"),
)

#: op name -> its spec.
SPECS: dict[str, OpSpec] = {s.name: s for s in OP_SPECS}

#: Runtime adapter kinds that call an op's one function with its ABI arguments followed by facts the runtime
#: knows on the host (``src/backend.cc``), by kind: the extra arguments, in call order. ``direct_max_kv_len``:
#: ``max_kv_len``, the most keys any entry of the call's pass reads from pages (``page_indptr`` names the
#: pass; 0 = not known, as in a CUDA-graph decode, whose replays reuse the captured value). A kernel may use
#: it only to choose its launch shape (e.g. a split-KV count), never for what it computes: any value gives
#: the same result. Kinds and their arguments are frozen like op ABIs; another fact is another kind.
ADAPTER_ARGS: dict[str, tuple[Arg, ...]] = {"direct": (), "direct_max_kv_len": (Arg("max_kv_len", "int32"),)}
#: Adapter kinds whose arguments describe the call's pass, which the runtime finds by the call's ``page_indptr``
#: view: they serve ``PASS_BOUND_OPS`` only.
PASS_BOUND_ADAPTERS: frozenset[str] = frozenset({"direct_max_kv_len"})
#: The ops a pass-bound adapter serves: those with a ``page_indptr`` argument.
PASS_BOUND_OPS: tuple[str, ...] = tuple(s.name for s in OP_SPECS if any(a.name == "page_indptr" for a in s.args))


def call_args(op: str, adapter: str = "direct") -> tuple[Arg, ...]:
    """The arguments a function of ``op`` served through runtime adapter kind ``adapter`` (a key of
    ``ADAPTER_ARGS``) is called with: the op's ABI arguments, then the adapter's."""
    if adapter not in ADAPTER_ARGS:
        raise ValueError(f"adapter kind {adapter!r} adds no known arguments; known: {', '.join(ADAPTER_ARGS)}")
    if adapter in PASS_BOUND_ADAPTERS and op not in PASS_BOUND_OPS:
        raise ValueError(f"adapter {adapter!r} serves ops with a page_indptr ({', '.join(PASS_BOUND_OPS)}), "
                         f"not {op!r}")
    return SPECS[op].args + ADAPTER_ARGS[adapter]

#: Every op, in the order the Relax constructor emits them.
OPS: tuple[str, ...] = tuple(s.name for s in OP_SPECS)

#: The ops a cache of each layer kind uses (an MLA cache's self_attention is the ragged MHA kernel with
#: head_dim != v_head_dim; its pages move with the same copy ops, built for one latent plane).
OPS_BY_KIND: dict[str, tuple[str, ...]] = {k: tuple(s.name for s in OP_SPECS if k in s.kinds) for k in LAYER_KINDS}

#: The ops a cache of each kind must have in its op table.
REQUIRED_BY_KIND: dict[str, tuple[str, ...]] = {
    k: tuple(s.name for s in OP_SPECS if k in s.required) for k in LAYER_KINDS}

#: Ops that compute attention (the ones a faster backend is most likely to take over).
ATTENTION_OPS: tuple[str, ...] = tuple(s.name for s in OP_SPECS if any(a.name == "sm_scale" for a in s.args))

# Op-name constants (``ATTN_DECODE_PAGED == "attn_decode_paged"``), for code that names one op.
SPLIT_ROTARY, APPEND_KV, GATHER_KV, ATTN_PREFILL_RAGGED, ATTN_PREFILL_PAGED, ATTN_DECODE_PAGED, MERGE_STATE, \
    COPY_PAGE, COMPACT_COPY, MLA_APPEND_KV, MLA_GATHER_KV, MLA_ATTN_PREFILL_PAGED, MLA_ATTN_DECODE_PAGED, \
    ATTN_PREFILL_RAGGED_PARTIAL, ATTN_PREFILL_PAGED_PARTIAL, ATTN_DECODE_PAGED_PARTIAL, MERGE_STATE_PARTIAL, \
    MLA_ATTN_PREFILL_PAGED_PARTIAL, MLA_ATTN_DECODE_PAGED_PARTIAL, APPLY_SINKS, MERGE_STATE_PARTIAL_SINKS = OPS

#: Attention op -> its partial-state variant (the same kernel writing a float32 ``o``).
PARTIAL_OF: dict[str, str] = {ATTN_PREFILL_RAGGED: ATTN_PREFILL_RAGGED_PARTIAL,
                              ATTN_PREFILL_PAGED: ATTN_PREFILL_PAGED_PARTIAL,
                              ATTN_DECODE_PAGED: ATTN_DECODE_PAGED_PARTIAL,
                              MLA_ATTN_PREFILL_PAGED: MLA_ATTN_PREFILL_PAGED_PARTIAL,
                              MLA_ATTN_DECODE_PAGED: MLA_ATTN_DECODE_PAGED_PARTIAL}
#: Partial-state variant -> its attention op.
BASE_OF: dict[str, str] = {v: k for k, v in PARTIAL_OF.items()}
#: The ops of float32 partial states (the variants and their merge). A float32 cache leaves them out
#: (``ops_for``): its own kernels already write float32.
PARTIAL_OPS: tuple[str, ...] = tuple(op for op in OPS if op in BASE_OF or op == MERGE_STATE_PARTIAL)


#: The attention-sink ops (``attention_sinks`` configs only). ``merge_state_partial_sinks`` is a float32-state op:
#: a float32 cache leaves it out as it leaves out ``PARTIAL_OPS``, and a table holding the partial-state ops of a
#: sinks config holds it too (the runtime checks, ``src/paged_kv_cache.cc``).
SINK_OPS: tuple[str, ...] = (APPLY_SINKS, MERGE_STATE_PARTIAL_SINKS)

#: The MHA attention ops whose kernels apply a sliding window (compile-time, ``KernelSpec.sliding_window``): a
#: config with layer groups (schema 7) gives each distinct window its own kernels of these ops, in a sub-table
#: of the op table (``["window=<W>", entry...]``); every other op serves all layers.
WINDOW_OPS: tuple[str, ...] = (ATTN_PREFILL_RAGGED, ATTN_PREFILL_PAGED, ATTN_DECODE_PAGED, ATTN_PREFILL_RAGGED_PARTIAL,
                               ATTN_PREFILL_PAGED_PARTIAL, ATTN_DECODE_PAGED_PARTIAL)


def ops_for(config) -> tuple[str, ...]:
    """The ops a cache with ``config`` (a ``KVCacheConfig`` or ``KernelSpec``) uses, in ``OPS`` order: its
    layer kind's, without the partial-state ops when its dtype is float32, and the sink ops (``SINK_OPS``) only
    when it has ``attention_sinks``."""
    drop = set(SINK_OPS) if not getattr(config, "attention_sinks", False) else set()
    if config.dtype == "float32":
        drop |= {*PARTIAL_OPS, MERGE_STATE_PARTIAL_SINKS}
    return tuple(op for op in OPS_BY_KIND[MLA if config.is_mla else MHA] if op not in drop)


def check_op(name: str) -> str:
    """Return ``name`` if it is a known op, else raise ``ValueError`` naming it."""
    if name not in SPECS:
        raise ValueError(f"unknown op {name!r}; known ops: {', '.join(OPS)}")
    return name


def shape_values(config) -> dict[str, int]:
    """Values of the compile-time shape symbols for a ``KVCacheConfig`` (or ``KernelSpec``)."""
    mla = bool(getattr(config, "kv_lora_rank", 0))
    dl = config.kv_lora_rank + config.qk_rope_head_dim if mla else 0
    dv = getattr(config, "v_dim", None) or config.v_head_dim or config.head_dim
    return {"Hq": config.num_qo_heads, "Hkv": config.num_kv_heads, "D": config.head_dim, "Dv": dv,
            "DL": dl, "R": config.kv_lora_rank if mla else 0, "PL": 1 if mla else 2,
            "PH": 1 if mla else config.num_kv_heads, "PD": dl if mla else config.head_dim}
