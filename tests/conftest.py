"""Shared fixtures of the pagedkv test suites.

Random inputs are fresh on every run; each test that draws them prints its seed, and
``PAGEDKV_TEST_SEED=<seed>`` replays a run.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parent.parent
try:  # the installed package (make test installs it); a bare source checkout falls back to python/
    import pagedkv  # noqa: F401
except ImportError:
    sys.path.insert(0, str(_REPO / "python"))

import torch  # noqa: E402

# Under pytest-xdist the workers share the cores: each takes its share of torch's threads.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // _WORKERS)))


#: Modules of the slow lane (``make test`` runs them, ``make test-fast`` does not): CUDA code compiled by nvcc or
#: emulated on the CPU by g++, whole models compiled, FlashInfer modules built, and the kernel-cache processes.
SLOW_MODULES = frozenset({
    "test_bundle", "test_cuda_compile", "test_cuda_decode_staged", "test_cuda_decode_tc", "test_cuda_graph_compile",
    "test_cuda_paths_compile", "test_decode_chunked_emulated", "test_decode_staged_emulated",
    "test_decode_tc_emulated", "test_deepseek_v3", "test_examples", "test_flashinfer_build", "test_kernel_cache",
    "test_mla_cuda_compile", "test_mla_prefill_tc_compile", "test_mla_tc_compile", "test_mla_tc_emulated", "test_model_families",
    "test_rope_cuda_emulated",
    "test_partial_compile",
    "test_prefill_tc_compile", "test_prefill_tc_emulated", "test_prefill_wg_compile", "test_relax_model",
    "test_smollm2", "test_bench_e2e", "test_tir_prelowering"})


#: The knob lane: tests marked ``knobs`` build a kernel with a tuning constant flipped (``_decode_tc_cuda.TCD_SLOTS``,
#: ``_decode_emu.TC_SWITCHES``), a kernel no library ships; they keep the constant's other value working for the
#: next tuning run and run with ``PAGEDKV_TEST_KNOBS=1`` (``make test-knobs``), not in ``make test``.
KNOBS = os.environ.get("PAGEDKV_TEST_KNOBS") == "1"


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    knob_skip = pytest.mark.skip(reason="a tuning knob's non-default build: PAGEDKV_TEST_KNOBS=1 (make test-knobs)")
    for item in items:
        if Path(str(item.fspath)).stem in SLOW_MODULES:
            item.add_marker(slow)
        if not KNOBS and item.get_closest_marker("knobs"):
            item.add_marker(knob_skip)
    # The slow modules first (stable otherwise): pytest-xdist hands out whole files in this order, so the long ones
    # start at once and the short ones fill the end instead of one long file running alone last.
    items.sort(key=lambda item: Path(str(item.fspath)).stem not in SLOW_MODULES)


def pytest_report_header(config):
    try:
        from pagedkv._lib import runtime_library_path

        lib = runtime_library_path()
    except Exception as err:  # noqa: BLE001 (a header must not fail the session)
        lib = f"not found ({err})"
    seed = os.environ.get("PAGEDKV_TEST_SEED")
    return [f"pagedkv runtime: {lib}", f"pagedkv seed: {seed or 'fresh per test'}"]


@pytest.fixture
def seed() -> int:
    """A fresh seed per test (or ``$PAGEDKV_TEST_SEED``); printed so a failure can be replayed."""
    env = os.environ.get("PAGEDKV_TEST_SEED")
    value = int(env) if env else random.SystemRandom().randrange(2**31)
    print(f"seed={value}  (replay: PAGEDKV_TEST_SEED={value})")
    return value


#: Modules that read TVM's generated CUDA source and nothing TVM compiles from it (the compile tests run nvcc
#: themselves, the emulators g++): ``source_only_cuda`` serves them. Not ``test_cuda_graph_compile`` (real libraries).
SOURCE_ONLY_CUDA = frozenset({
    "test_cuda_compile", "test_cuda_decode_staged", "test_cuda_decode_tc", "test_cuda_paths_compile",
    "test_decode_chunked_emulated", "test_decode_staged_emulated", "test_decode_tc_emulated", "test_mla_cuda_compile",
    "test_mla_prefill_tc_compile", "test_mla_tc_compile", "test_mla_tc_emulated", "test_partial_compile",
    "test_prefill_tc_compile", "test_prefill_tc_emulated", "test_prefill_wg_compile", "test_rope_cuda_emulated",
    "test_tir_prelowering"})


@pytest.fixture(autouse=True, scope="module")
def source_only_cuda(request):
    """In ``SOURCE_ONLY_CUDA``'s modules, TVM's CUDA compile step (``tvm_callback_cuda_compile``) returns a
    placeholder instead of running nvcc. A library build earlier in the same worker process turns TVM's CUDA
    codegen on for the process (``pagedkv.cuda_build.enable_cuda_codegen``); from then on every ``tvm.compile``
    of these modules would also run nvcc -O3 over every kernel it lowers (about half of a lowering's time),
    for device code nobody loads. The previous callback is restored after the module."""
    if Path(str(request.node.fspath)).stem not in SOURCE_ONLY_CUDA:
        yield
        return
    import tvm  # noqa: F401  (registers TVM's callback first)
    import tvm_ffi

    name = "tvm_callback_cuda_compile"
    previous = tvm_ffi.get_global_func(name, allow_missing=True)
    if previous is None:  # a placeholder left registered would give later real builds no device code
        yield
        return
    tvm_ffi.register_global_func(name, lambda *_args: bytearray(b"// source-only test build"), override=True)
    try:
        yield
    finally:
        tvm_ffi.register_global_func(name, previous, override=True)


@pytest.fixture
def gen(seed) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed``."""
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def cpu_backends(config, target: str = "llvm") -> list[str]:
    """Registered backends that accept ``config`` on ``target`` for at least one op, highest priority
    first (a backend serving only some ops is tested with ``tir`` filling in the rest)."""
    from pagedkv import backends, ops

    out = []
    for tag in backends.registered_backends():
        try:
            backend = backends.get_backend(tag)
        except Exception:  # noqa: BLE001 (an unimportable backend is not testable here)
            continue
        if any(not backend.validate_configuration(op, config, target) for op in ops.OPS):
            out.append(tag)
    return out


def backend_choice(tag: str) -> list[str]:
    """The priority list a test creates its cache with: ``tag`` first, ``tir`` for what it leaves."""
    return [tag] if tag == "tir" else [tag, "tir"]


@pytest.fixture(scope="session")
def make_cache():
    """``make_cache(config, backend)``: a fresh, NaN-poisoned cache on the CPU.

    Compiled kernel modules are reused across the session (``pagedkv.cache`` keeps them per config), so
    tests should share configs.
    """
    import pagedkv

    def make(config, backend="tir", **kwargs):
        kwargs.setdefault("poison", True)
        kwargs.setdefault("target", "llvm")
        return pagedkv.create(config, backend=backend_choice(backend) if isinstance(backend, str) else backend,
                              **kwargs)

    return make


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The 10 modules that took longest (setup, call and teardown of all their tests, summed): where a suite
    over its time budget has to be cut (``make test`` must fit CI's 15 minutes)."""
    per_module: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for rep in reports:
            if getattr(rep, "when", None) and hasattr(rep, "duration"):
                module = rep.nodeid.split("::")[0]
                per_module[module] = per_module.get(module, 0.0) + rep.duration
    if len(per_module) > 1:
        terminalreporter.write_sep("=", "slowest 10 modules (seconds, all phases)")
        for module, secs in sorted(per_module.items(), key=lambda kv: -kv[1])[:10]:
            terminalreporter.write_line(f"{secs:8.1f}  {module}")
