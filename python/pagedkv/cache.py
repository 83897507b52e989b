"""``pagedkv.create``: a paged KV cache object from a config and a backend choice, usable from Python.

This is the direct (no Relax) path used by tests and tools. It compiles the chosen backends' functions for
the target, builds the named op table and calls the runtime's ``pagedkv.create``. Tensors in and out are
PyTorch tensors (exchanged through DLPack, no copies).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from . import backends as _backends
from . import kernel_cache as _kcache
from . import ops
from . import target as _target
from ._lib import get_global
from .config import FP8_FIELDS, KVCacheConfig, check_sm_scale
from .kernel_spec import KernelSpec
from .progress import QUIET_FOR, Progress

_FLOAT_DTYPES = {"float16", "float32", "bfloat16"}


def _to_ffi(tensor):
    import tvm_ffi

    return tvm_ffi.from_dlpack(tensor)


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


#: The canonical target dict (``pagedkv.target.canonical``), under its older name.
target_spec = _target.canonical


def kernel_shape(config: KVCacheConfig) -> KVCacheConfig:
    """``config`` reduced to its kernel spec (``pagedkv.kernel_spec.KernelSpec.from_config``: heads, head dims,
    dtype, attention options), as a config: configs differing only in capacity, page size or plain RoPE's
    parameters (kernel arguments) share kernels and compiled modules. A RoPE variant the kernels hold as a
    table (``KernelSpec.rope``) stays, with the RoPE fields it derives from."""
    spec = KernelSpec.from_config(config)
    rope = {} if spec.rope is None else {"rope_mode": config.rope_mode, "rope_theta": config.rope_theta,
                                         "rope_scale": config.rope_scale, "rope": config.rope}
    # FP8 pages: the kernels hold the scales (compiled in), so they key the kernels as the dtype does.
    fp8 = {name: getattr(config, name) for name in FP8_FIELDS} if config.fp8 else {}
    if spec.is_mla:
        return KVCacheConfig.mla(num_layers=1, num_heads=spec.num_qo_heads, kv_lora_rank=spec.kv_lora_rank,
                                 qk_nope_head_dim=spec.head_dim - spec.qk_rope_head_dim,
                                 qk_rope_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim,
                                 dtype=spec.dtype, attention_sinks=spec.attention_sinks, **fp8)
    return KVCacheConfig(num_layers=1, num_qo_heads=spec.num_qo_heads, num_kv_heads=spec.num_kv_heads,
                         head_dim=spec.head_dim, v_head_dim=spec.v_head_dim, dtype=spec.dtype,
                         attention_sinks=spec.attention_sinks, **{"rope_mode": "none", **rope}, **spec.options(),
                         **fp8)


#: Modules of the package besides ``tir_kernels/`` whose code decides which kernels are generated (the spec and
#: its limits, the op ABI, the targets, the backends' choices): part of the source digest.
KERNEL_SOURCE_MODULES = ("kernel_spec.py", "kernel_table.py", "ops.py", "target.py", "config.py", "rope_spec.py",
                         "config_schema.py", "kv_scales.py", "layer_groups.py", "backends/tir.py",
                         "backends/flashinfer.py", "backends/base.py")


@functools.lru_cache(maxsize=None)
def kernel_source_digest() -> str:
    """Digest of the sources that generate the kernels (``pagedkv.tir_kernels`` and
    ``KERNEL_SOURCE_MODULES``), read without importing them (a runtime-only process has no TVMScript): a
    prebuilt or cached library is only used with the sources that built it."""
    import importlib.util

    spec = importlib.util.find_spec("pagedkv.tir_kernels")
    h = hashlib.sha256()
    for root in (spec.submodule_search_locations or []) if spec else []:
        for f in sorted(Path(root).glob("*.py")):
            h.update(f.name.encode() + f.read_bytes())
    package = Path(__file__).resolve().parent
    for name in KERNEL_SOURCE_MODULES:
        h.update(name.encode() + (package / name).read_bytes())
    return h.hexdigest()[:16]


def kernel_library_key(config: KVCacheConfig, target: Any, choice: Sequence[tuple[str, str]]) -> str:
    """Content key of the kernels of ``config`` for ``target`` with the per-op backend ``choice``: the kernel
    shape, the canonical target, the kernel sources, the choice, and what each backend adds
    (``Backend.key_part``: FlashInfer module variants, forced TIR code paths)."""
    key = {"config": KernelSpec.from_config(config).to_dict(), "target": _target.canonical(target),
           "sources": kernel_source_digest(), "ops": [list(c) for c in choice], "versions": _kcache.versions()}
    parts = _backends.key_parts(config, target, choice)
    if parts:
        key["backend_parts"] = parts
    blob = json.dumps(key, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _compile_module(config: KVCacheConfig, spec: dict, choice, *, progress: Progress):
    """Compile every op's functions into one module, reporting the stages to ``progress``. Returns (module,
    entries, export options): an entry is ``(op, tag, symbols, head)`` with ``head`` the strings after op and
    tag in the op table (``OpBuild.op_table_head``)."""
    import tvm

    funcs: dict[str, Any] = {}
    entries: list[tuple[str, str, list[str], list[str]]] = []
    externs: dict[Any, Any] = {}  # object path -> built module (FlashInfer), each linked once
    options: list[str] = []
    progress.stage(f"generating the kernels of {len(choice)} ops")
    for i, (op, tag) in enumerate(choice, 1):
        progress.update(f"generating op {i}/{len(choice)}: {op} ({tag})")
        build = _backends.get_backend(tag).build(op, config, spec)
        funcs.update(build.prim_funcs)
        entries.append((op, tag, [name for name, _ in build.prim_funcs] + list(build.extern_symbols),
                        build.op_table_head()[2:]))
        externs.update({m.object_path: m for m in build.extern_modules})
        options += [o for o in build.export_options if o not in options]
    target = _target.to_tvm(spec)
    progress.stage(f"TVM compiles {len(funcs)} kernels for {_target.describe(spec)}"
                   + (f" and links {len(externs)} FlashInfer modules" if externs else ""))
    if spec["kind"] == "cuda":
        from .cuda_build import compile_for_cuda

        module = compile_for_cuda(tvm.IRModule(funcs), target)
    else:
        module = tvm.compile(tvm.IRModule(funcs), target=target)
    for built in externs.values():
        module.mod.import_module(built.static_library())  # linked in by export_library
    return module, entries, options


def _has_static_libs(module) -> bool:
    return any(m.kind == "static_library" for m in getattr(module, "mod", module).imports)


def _export_kwargs(options: list[str]) -> dict:
    return {"options": options} if options else {}


def kernel_dir() -> Path | None:
    env = os.environ.get("PAGEDKV_KERNEL_DIR")
    return Path(env) if env else None


def _library_path(config: KVCacheConfig, out_dir, target, backend) -> tuple[Path, tuple]:
    choice = tuple(_backends.resolve(config, _target.canonical(target), backend).choice.items())
    return Path(out_dir) / f"kernels-{kernel_library_key(config, target, choice)}.so", choice


def kernel_library_path(config: KVCacheConfig, out_dir: str | Path, *, target: Any = "llvm",
                        backend: str | Sequence[str] | None = None) -> Path:
    """Where ``build_kernel_library`` with the same arguments writes (or wrote) its library; the path is
    the content key, so a caller finds exactly the kernels of ``config`` (options included), never a
    library of another config. Does not build or check existence."""
    return _library_path(config, out_dir, target, backend)[0]


def build_kernel_library(config: KVCacheConfig, out_dir: str | Path, *, target: Any = "llvm",
                         backend: str | Sequence[str] | None = None) -> Path:
    """Compile the kernels of ``config`` for ``target`` and export them (``kernels-<key>.so`` + ``.json``
    with the op table) into ``out_dir``, for a process that has the TVM runtime only."""
    lib, choice = _library_path(config, out_dir, target, backend)
    for window in config.group_windows:  # layer groups: each window's library (the groups' backend choice per op),
        build_kernel_library(config.window_config(window), out_dir, target=target, backend=dict(choice))  # own key
    key = lib.name[len("kernels-"):-len(".so")]
    return _kcache.load_or_build(lib.parent, key, functools.partial(
        _export_kernels, config, _target.canonical(target), choice), what=_what(config, target, choice))


def _what(config: KVCacheConfig, target: Any, choice=()) -> str:
    """A kernel library's name in progress lines."""
    spec = KernelSpec.from_config(config)
    shape = (f"MLA {spec.num_qo_heads} heads, latent {spec.latent_dim}" if spec.is_mla else
             f"{spec.num_qo_heads}/{spec.num_kv_heads} heads x {spec.head_dim}")
    ops = f", {len(choice)} ops" if choice else ""
    return f"the kernels of {shape} {spec.dtype} for {_target.describe(target)}{ops}"


def _export_kernels(config: KVCacheConfig, spec: dict, choice, path: Path, progress: Progress) -> None:
    """Compile the kernels of ``config`` and write the library to ``path``, its op table beside it."""
    module, entries, options = _compile_module(kernel_shape(config), spec, choice, progress=progress)
    progress.stage("writing the library")
    module.export_library(str(path), **_export_kwargs(options))
    path.with_suffix(".json").write_text(json.dumps(
        {"config": config.to_dict(), "target": spec, "entries": entries}, indent=1))


def _load_kernels(lib: Path, spec: dict):
    """(module, entries) of a kernel library written by ``_export_kernels`` for target ``spec``. A CPU
    library is loaded without importing ``tvm`` (its import is most of a cached ``create``'s time)."""
    from .runtime import load_library

    entries = json.loads(lib.with_suffix(".json").read_text())["entries"]
    return load_library(lib, host_only=spec["kind"] == "llvm"), entries


def _load_cached(disk: Path, key: str, spec: dict):
    """(module, entries) of the complete disk cache entry of ``key``, or None when there is none or it cannot
    be loaded (then it is removed, so the caller builds it again: an entry left broken by a crash of an
    older pagedkv or a damaged disk never sticks)."""
    lib = _kcache.lookup(disk, key)
    if lib is None:
        return None
    from .runtime import enable_cuda_runtime, load_tvm_runtime

    # the process's own setup (TVM's runtime library, its CUDA sidecar) fails outside the try: not the entry's
    # fault, and no reason to build it again
    if spec["kind"] == "llvm":
        load_tvm_runtime()
    else:
        enable_cuda_runtime()
    try:
        return _load_kernels(lib, spec)
    except (OSError, RuntimeError, ValueError, KeyError) as err:
        print(f"[pagedkv] the cached kernel library {lib} cannot be loaded ({type(err).__name__}: "
              f"{str(err).strip()[:200]}): compiling it again", file=sys.stderr, flush=True)
        _kcache.discard(disk, key)
        return None


def _compile_in_process(config: KVCacheConfig, spec: dict, choice):
    """(module, entries) compiled in this process (no disk cache): quiet unless it takes a while or fails."""
    with Progress(f"compiling {_what(config, spec, choice)}", quiet_for=QUIET_FOR) as progress:
        module, entries, options = _compile_module(config, spec, choice, progress=progress)
        if _has_static_libs(module):  # objects run only once linked: export and load
            import tempfile

            from .runtime import load_library

            progress.stage("linking the library")
            lib = Path(tempfile.mkdtemp(prefix="pagedkv-")) / "kernels.so"
            module.export_library(str(lib), **_export_kwargs(options))
            module = load_library(lib)
    return module, entries


def _load_or_compile(config: KVCacheConfig, spec: dict, choice, key: str):
    """(module, entries) of the kernels of ``key``: a prebuilt library (``$PAGEDKV_KERNEL_DIR``), else the
    disk cache's entry, built first if missing, else (cache off) compiled in this process."""
    prebuilt = kernel_dir()
    if prebuilt is not None and (prebuilt / f"kernels-{key}.so").exists():
        return _load_kernels(prebuilt / f"kernels-{key}.so", spec)
    disk = _kcache.cache_dir()
    cached = None if disk is None else _load_cached(disk, key, spec)
    if cached is not None:  # checked before runtime_only(): it imports tvm, which a CPU entry's load skips
        return cached
    if _target.runtime_only():
        raise FileNotFoundError(
            f"no prebuilt kernel library kernels-{key}.so in PAGEDKV_KERNEL_DIR={prebuilt} for this config "
            f"and target {spec}, and this TVM has no compiler (runtime-only): build it on the build host "
            "with pagedkv.cache.build_kernel_library")
    if disk is None:
        return _compile_in_process(config, spec, choice)
    lib = _kcache.load_or_build(disk, key, functools.partial(_export_kernels, config, spec, choice),
                                what=_what(config, spec, choice))
    return _load_kernels(lib, spec)


@functools.lru_cache(maxsize=16)
def _op_table_cached(config: KVCacheConfig, spec_json: str, choice: tuple[tuple[str, str], ...],
                     parts_json: str = "{}"):
    # parts_json (the backends' key parts, e.g. forced TIR paths) only keys this cache: the build reads them
    spec = json.loads(spec_json)
    module, entries = _load_or_compile(config, spec, choice, kernel_library_key(config, spec, choice))
    # an entry is (op, tag, symbols[, head]): the runtime gets [op, tag, *head, *functions]
    return module, [[op, tag, *(rest[0] if rest else []), *[module[name] for name in names]]
                    for op, tag, names, *rest in entries]


def _compile_op_table(config: KVCacheConfig, target: Any, choice: tuple[tuple[str, str], ...]):
    """(module, op table entries ``[op, tag, func...]``) for ``config`` on ``target``: loaded from a prebuilt
    kernel library (``$PAGEDKV_KERNEL_DIR``) or the disk cache (``pagedkv.kernel_cache``), compiled into the
    cache first when missing, or compiled here when the cache is off. Layer groups (schema 7): the library of each
    window's config (``KVCacheConfig.window_config``: shared with plain windowed caches of that window) gives the
    window ops (``pagedkv.ops.WINDOW_OPS``) of a sub-table ``["window=<W>", entry...]``."""
    def table_of(cfg):
        return _op_table_cached(kernel_shape(cfg), _target.key(target), tuple(choice),
                                json.dumps(_backends.key_parts(cfg, target, choice), sort_keys=True))

    module, table = table_of(config)
    modules = [module]
    for window in config.group_windows:
        window_module, window_table = table_of(config.window_config(window))
        modules.append(window_module)
        table = [*table, [f"window={window}", *(e for e in window_table if e[0] in ops.WINDOW_OPS)]]
    return (module if len(modules) == 1 else tuple(modules)), table  # a tuple: the caller keeps every module alive


def create(config: KVCacheConfig, *, backend: str | Sequence[str] | None = None,
           target: str = "llvm", device: Any = None, poison: bool = False) -> "KVCache":
    """Create a paged KV cache for ``config``.

    Parameters
    ----------
    config :
        The cache configuration.
    backend :
        A backend tag, a priority list of tags, or ``None`` for automatic selection (registered backends by
        priority). Each op gets the first that can serve it; if none can, ``NoBackendError`` lists why.
    target :
        The compilation target (``"llvm"`` for the CPU).
    device :
        A ``torch.device`` for the pages; default: the CPU.
    poison :
        Fill fresh pages and temporaries with NaN (tests: unwritten or over-read memory fails loudly).
    """
    import torch

    resolution = _backends.resolve(config, _target.canonical(target), backend)
    module, table = _compile_op_table(config, target, tuple(resolution.choice.items()))
    device = torch.device("cpu") if device is None else torch.device(device)
    device_ref = torch.empty((1,), dtype=_torch_dtype(config.dtype), device=device)
    handle = get_global("pagedkv.create")(config.to_json(), (), table, _to_ffi(device_ref))
    cache = KVCache(handle, config, device, resolution, keepalive=module)
    if poison:
        get_global("pagedkv.debug_poison_pages")(handle, True)
    return cache


def _type_name(value) -> str:
    if value is None:
        return "None"
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


class _TensorArgs:
    """Checks the tensor arguments of one ``KVCache`` call before anything else runs, so a wrong argument is
    reported as itself (type, dtype, device, shape and what was expected) and not as whatever fails first
    on it. A shape is a list of ``(label, size)`` entries and symbols (``"n"``): a symbol takes its size
    from the first argument that has it and every later argument must agree. Sizes the Python side does
    not know (the forward's token count) are checked by the runtime, which names the tensor too."""

    def __init__(self, cache: "KVCache", method: str) -> None:
        self.cache, self.method, self.sizes = cache, method, {}

    def __call__(self, name: str, value, dims=None, *, dtype: str | None = None, why: str = "the cache's dtype"):
        import torch

        dtype = self.cache.config.dtype if dtype is None else dtype
        device = self.cache.device
        want = f"'{name}' must be a torch.Tensor of dtype {dtype} ({why}) on {device}"
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{self.method}: {want}, got {_type_name(value)}")
        got_dtype = str(value.dtype).removeprefix("torch.")
        same_device = value.device.type == device.type and device.index in (None, value.device.index)
        if got_dtype != dtype:
            where = "" if same_device else f" on {value.device}"
            raise TypeError(f"{self.method}: {want}, got {got_dtype}{where}")
        if not same_device:
            raise ValueError(f"{self.method}: {want}, got a tensor on {value.device}")
        if dims is None:
            return
        shape = list(value.shape)
        sizes = dict(self.sizes)
        ok = len(shape) == len(dims)
        for dim, size in zip(dims, shape) if ok else ():
            if isinstance(dim, str):
                ok = ok and sizes.setdefault(dim, size) == size
            else:
                ok = ok and dim[1] == size
        if not ok:
            spec = ", ".join((f"{d} = {self.sizes[d]}" if d in self.sizes else d) if isinstance(d, str)
                             else f"{d[0]} = {d[1]}" for d in dims)
            raise ValueError(f"{self.method}: '{name}' must have shape [{spec}], got {shape}")
        self.sizes = sizes


class KVCache:
    """Python view of a runtime ``PagedKVCache`` (see ``docs/ARCHITECTURE.md`` for the semantics)."""

    def __init__(self, handle, config: KVCacheConfig, device, resolution, *, keepalive=None) -> None:
        self.handle = handle
        self.config = config
        self.device = device
        self.resolution = resolution
        self._keepalive = keepalive  # the compiled kernel module must outlive the cache

    def _call(self, name: str, *args):
        return get_global(f"pagedkv.{name}")(self.handle, *args)

    # -- sequences ----------------------------------------------------------------------------------
    def add_sequence(self, seq_id: int) -> None:
        self._call("add_sequence", seq_id)

    def remove_sequence(self, seq_id: int) -> None:
        self._call("remove_sequence", seq_id)

    def fork_sequence(self, parent_id: int, child_id: int, fork_pos: int = -1) -> None:
        self._call("fork_sequence", parent_id, child_id, fork_pos)

    def popn(self, seq_id: int, n: int) -> None:
        self._call("popn", seq_id, n)

    def clear(self) -> None:
        self._call("clear")

    def get_sequence_length(self, seq_id: int) -> int:
        return int(self._call("get_sequence_length", seq_id))

    @property
    def num_available_pages(self) -> int:
        """The new pages the next forward (or mid-page fork / popn) can still take: a forward needing ``k`` new
        pages (``ceil`` of each sequence's tokens past its last page) succeeds iff ``k <= num_available_pages``.

        Without ``layer_groups`` the main pool's free pages. With them the fewest free of any page pool
        (``pool_pages``): every page the block tree takes is also taken in each sliding window's pool, which is
        smaller, so an engine admitting by this count never over-admits, full layers or none. Window pools get
        their pages back after ``end_forward`` (those behind every window) and ``remove_sequence``, so the count
        can grow without a removal."""
        return int(self._call("get_num_available_pages"))

    def pool_pages(self) -> dict[str, tuple[int, int]]:
        """Pages in all and pages free per page pool: ``"main"`` (the block tree's pages, held by full layers; it
        bounds the tokens), and with ``layer_groups`` each sliding window's pool, by its groups' names
        (``"sliding128"``, or ``"a+b"`` for groups of one window), whose pages behind every window go back to it.
        ``num_available_pages`` is the fewest free of them."""
        flat = [int(x) for x in self._call("pool_pages")]
        names = ["main"] + ["+".join(g.name for g in self.config.layer_groups or () if g.sliding_window == w)
                            for w in self.config.group_windows]
        return {name: (flat[2 * i], flat[2 * i + 1]) for i, name in enumerate(names)}

    @property
    def total_sequence_length(self) -> int:
        return int(self._call("get_total_sequence_length"))

    @property
    def op_backends(self) -> dict[str, str]:
        return {str(k): str(v) for k, v in self._call("op_backends").items()}

    # -- forward ------------------------------------------------------------------------------------
    def begin_forward(self, seq_ids: Sequence[int], append_lengths: Sequence[int]) -> None:
        self._call("begin_forward", tuple(map(int, seq_ids)), tuple(map(int, append_lengths)))

    def end_forward(self, *, debug_unwritten: bool = False) -> None:
        """Close the forward. Raises ``RuntimeError`` (and rolls the forward back, as ``abort_forward``) when a
        layer wrote no k/v in it: its slots would keep stale k/v for every later forward to read.

        ``debug_unwritten`` (tests, benchmarks): keep the tokens anyway, to write their k/v with
        ``debug_set_kv`` afterwards (reserving long sequences without running attention)."""
        self._call("debug_end_forward_unwritten" if debug_unwritten else "end_forward")

    def abort_forward(self) -> None:
        """Abandon the open forward: the tokens ``begin_forward`` appended are taken back, the cache is as
        before it. Does nothing without an open forward (safe in an error handler)."""
        self._call("abort_forward")

    def check_append(self, seq_ids: Sequence[int], append_lengths: Sequence[int]) -> None:
        """Raise what ``begin_forward`` would for these appends (unknown or repeated ids, lengths < 1, not
        enough free pages), without its per-forward limits and without changing anything: check a prompt
        that will be appended over several forwards before the first."""
        self._call("check_append", tuple(map(int, seq_ids)), tuple(map(int, append_lengths)))

    def _empty(self, shape, dtype=None):
        import torch

        dtype = _torch_dtype(self.config.dtype) if dtype is None else dtype
        return torch.full(shape, math.nan, dtype=dtype, device=self.device)

    def _check_sinks(self, method: str, sinks) -> None:
        """``sinks`` of an attention call: only on an ``attention_sinks`` cache, float32 ``[num_qo_heads]``."""
        if not self.config.attention_sinks:
            raise ValueError(f"{method}: sinks given, but the cache's config has attention_sinks=False (its op "
                             "table holds no sink ops): create the cache with attention_sinks=True")
        _TensorArgs(self, method)("sinks", sinks, [("num_qo_heads", self.config.num_qo_heads)], dtype="float32",
                                  why="one softmax logit per query head")

    def attention_with_fused_qkv(self, layer: int, qkv, sm_scale: float, *, sinks=None):
        """``qkv[n, Hq + 2 Hkv, D]`` -> ``o[n, Hq, D]``; appends k/v of the new tokens.

        ``sinks`` (``attention_sinks`` caches): ``float32[Hq]``, one more softmax logit per query head whose value
        is 0 (natural log, beside the scaled scores ``sm_scale * q.k``; gpt-oss), counted once per query."""
        c = self.config
        sm_scale = check_sm_scale(sm_scale, "attention_with_fused_qkv")
        # an MLA cache has no fused qkv: the runtime names the cache's layer kind
        _TensorArgs(self, "attention_with_fused_qkv")("qkv", qkv, None if c.is_mla else [
            "n", ("num_qo_heads + 2 * num_kv_heads", c.num_qo_heads + 2 * c.num_kv_heads), ("head_dim", c.head_dim)])
        if sinks is not None:
            self._check_sinks("attention_with_fused_qkv", sinks)
        o = self._empty((qkv.shape[0], self.config.num_qo_heads, self.config.v_dim), qkv.dtype)
        if sinks is None:
            self._call("attention_with_fused_qkv", layer, sm_scale, _to_ffi(qkv), _to_ffi(o))
        else:
            self._call("attention_with_fused_qkv_sinks", layer, sm_scale, *map(_to_ffi, (qkv, sinks, o)))
        return o

    def self_attention(self, layer: int, q, k, v, sm_scale: float):
        """Ragged causal attention over the new tokens: ``q[n, Hq, D]`` -> ``(o[n, Hq, Dv], lse[n, Hq])``."""
        import torch

        c = self.config
        sm_scale = check_sm_scale(sm_scale, "self_attention")
        check = _TensorArgs(self, "self_attention")
        check("q", q, ["n", ("num_qo_heads", c.num_qo_heads), ("head_dim", c.head_dim)])
        check("k", k, ["n", ("num_kv_heads", c.num_kv_heads), ("head_dim", c.head_dim)])
        check("v", v, ["n", ("num_kv_heads", c.num_kv_heads), ("v_head_dim", c.v_dim)])
        o = self._empty((q.shape[0], q.shape[1], v.shape[2]), q.dtype)
        lse = self._empty((q.shape[0], q.shape[1]), torch.float32)
        self._call("self_attention", layer, sm_scale, *map(_to_ffi, (q, k, v, o, lse)))
        return o, lse

    def append_mla_kv(self, layer: int, kv) -> None:
        """MLA: write the forward's latents ``kv[n, kv_lora_rank + qk_rope_head_dim]`` into the pages."""
        # an MHA cache has no latents: the runtime names the cache's layer kind
        _TensorArgs(self, "append_mla_kv")("kv", kv, [
            "n", ("kv_lora_rank + qk_rope_head_dim", self.config.latent_dim)] if self.config.is_mla else None)
        self._call("append_mla_kv", layer, _to_ffi(kv))

    def cross_attention(self, layer: int, q, sm_scale: float, v_head_dim: int | None = None, *, sinks=None):
        """Attention of ``q[n, Hq, D]`` over the cached k/v -> ``(o[n, Hq, Dv], lse[n, Hq])``.

        MLA: ``q[n, Hq, kv_lora_rank + qk_rope_head_dim]`` (absorbed) -> ``o[n, Hq, kv_lora_rank]``.
        ``sinks`` (``attention_sinks`` caches): as in ``attention_with_fused_qkv``, merged into the returned state
        (``lse`` includes them); a model merging this with ``self_attention`` gives them here only.
        """
        import torch

        c = self.config
        sm_scale = check_sm_scale(sm_scale, "cross_attention")
        _TensorArgs(self, "cross_attention")("q", q, ["n", ("num_qo_heads", c.num_qo_heads),
                                                      ("kv_lora_rank + qk_rope_head_dim", c.latent_dim)
                                                      if c.is_mla else ("head_dim", c.head_dim)])
        default = self.config.kv_lora_rank if self.config.is_mla else self.config.v_dim
        dv = default if v_head_dim is None else v_head_dim
        if sinks is not None:
            self._check_sinks("cross_attention", sinks)
        o = self._empty((q.shape[0], q.shape[1], dv), q.dtype)
        lse = self._empty((q.shape[0], q.shape[1]), torch.float32)
        if sinks is None:
            self._call("cross_attention", layer, sm_scale, *map(_to_ffi, (q, o, lse)))
        else:
            self._call("cross_attention_sinks", layer, sm_scale, *map(_to_ffi, (q, sinks, o, lse)))
        return o, lse

    def merge_attn_output_inplace(self, o_a, lse_a, o_b, lse_b):
        """``(o_a, lse_a) <- merge((o_a, lse_a), (o_b, lse_b))``: ``o[n, Hq, Dv]``, ``lse[n, Hq]`` (float32)."""
        heads = ("num_qo_heads", self.config.num_qo_heads)
        check = _TensorArgs(self, "merge_attn_output_inplace")
        lse = dict(dtype="float32", why="lse is always float32")
        check("o_a", o_a, ["n", heads, "Dv"])
        check("lse_a", lse_a, ["n", heads], **lse)
        check("o_b", o_b, ["n", heads, "Dv"])
        check("lse_b", lse_b, ["n", heads], **lse)
        self._call("merge_attn_output_inplace", *map(_to_ffi, (o_a, lse_a, o_b, lse_b)))
        return o_a, lse_a

    def get_query_positions(self):
        import torch

        return torch.from_dlpack(self._call("get_query_positions")).clone()

    # -- debugging ----------------------------------------------------------------------------------
    def debug_get_kv(self, seq_id: int, start: int = 0, end: int | None = None):
        """K and V of tokens ``[start, end)`` of a sequence: two ``[L, end - start, Hkv, D]`` tensors."""
        end = self.get_sequence_length(seq_id) if end is None else end
        shape = (self.config.num_layers, max(end - start, 0), self.config.num_kv_heads, self.config.head_dim)
        k, v = self._empty(shape), self._empty(shape)
        self._call("debug_get_kv", seq_id, start, end, _to_ffi(k), _to_ffi(v))
        return k, v

    def debug_set_kv(self, seq_id: int, start: int, k, v) -> None:
        """Overwrite K and V of tokens ``[start, start + m)`` of a sequence: ``k, v[L, m, Hkv, D]``."""
        c = self.config
        dims = None if c.is_mla else [("num_layers", c.num_layers), "m", ("num_kv_heads", c.num_kv_heads),
                                      ("head_dim", c.head_dim)]
        check = _TensorArgs(self, "debug_set_kv")
        check("k", k, dims)
        check("v", v, dims)
        self._call("debug_set_kv", seq_id, start, _to_ffi(k), _to_ffi(v))

    def debug_get_mla_kv(self, seq_id: int, start: int = 0, end: int | None = None):
        """MLA: the latents of tokens ``[start, end)`` of a sequence, ``[L, end - start, latent_dim]``."""
        end = self.get_sequence_length(seq_id) if end is None else end
        kv = self._empty((self.config.num_layers, max(end - start, 0), self.config.latent_dim))
        self._call("debug_get_mla_kv", seq_id, start, end, _to_ffi(kv))
        return kv

    def debug_set_mla_kv(self, seq_id: int, start: int, kv) -> None:
        """MLA: overwrite the latents of tokens ``[start, start + m)`` of a sequence: ``kv[L, m, latent_dim]``."""
        c = self.config
        _TensorArgs(self, "debug_set_mla_kv")("kv", kv, [("num_layers", c.num_layers), "m", (
            "kv_lora_rank + qk_rope_head_dim", c.latent_dim)] if c.is_mla else None)
        self._call("debug_set_mla_kv", seq_id, start, _to_ffi(kv))


__all__ = ["create", "KVCache", "build_kernel_library", "kernel_library_path"]
