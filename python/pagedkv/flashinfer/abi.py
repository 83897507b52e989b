"""The argument lists of the flashinfer-python 0.7.4 functions pagedkv calls, pinned in one table.

Each entry is the positional argument list of one exported tvm-ffi function of a module kind, with the
type as tvm-ffi prints it in a function signature (``DLTensor*`` for a ``TensorView``, ``int`` for
``int64_t``, ``float`` for ``double``, ``Optional<...>``, ``Array<int>``). The table is the single source:

- ``python -m pagedkv.flashinfer.abi > src/flashinfer_abi.h`` writes the C++ header the runtime adapter
  indexes its argument arrays with (a CPU test checks the committed header is current);
- ``tests/cpu/test_flashinfer_build.py`` builds modules and checks each function's signature, as the
  compiled module reports it, against this table (count and types).

The lists follow the 0.7.4 binding sources (``flashinfer/data/csrc/*_binding.cu``) with the
``ADDITIONAL_FUNC_PARAMS`` of the default variants that ``flashinfer.jit.attention.modules`` generates
(``gen_batch_decode_module``, ``gen_batch_prefill_module``, ``gen_batch_mla_module``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

T, OPT_T, OPT_FT = "DLTensor*", "Optional<DLTensor*>", "Optional<ffi.Tensor>"
I, F, B, ARR = "int", "float", "bool", "Array<int>"


@dataclass(frozen=True)
class FuncABI:
    """One exported function: ``args`` are ``(name, type)`` in call order."""

    kind: str
    func: str
    args: tuple[tuple[str, str], ...]
    ret: str

    @property
    def num_args(self) -> int:
        return len(self.args)

    def signature(self) -> str:
        """The signature as tvm-ffi prints it in its argument-count errors: ``f(0: DLTensor*, ...) -> R``."""
        return f"{self.func}(" + ", ".join(f"{i}: {t}" for i, (_, t) in enumerate(self.args)) + f") -> {self.ret}"


def _args(*pairs: str) -> tuple[tuple[str, str], ...]:
    it = iter(pairs)
    return tuple(zip(it, it))


_WORKSPACES = ("float_workspace_buffer", T, "int_workspace_buffer", T)

# -- decode (fa2) -------------------------------------------------------------------------------------------
DECODE_PLAN = FuncABI("decode", "plan", _args(
    *_WORKSPACES, "page_locked_int_workspace_buffer", T, "indptr", T, "batch_size", I, "num_qo_heads", I,
    "num_kv_heads", I, "page_size", I, "enable_cuda_graph", B, "window_left", I, "logits_soft_cap", F,
    "head_dim_qk", I, "head_dim_vo", I, "empty_q_data", T, "empty_kv_data", T), ARR)
DECODE_RUN = FuncABI("decode", "run", _args(
    *_WORKSPACES, "plan_info_vec", ARR, "q", T, "paged_k_cache", T, "paged_v_cache", T,
    "paged_kv_indptr", T, "paged_kv_indices", T, "paged_kv_last_page_len", T, "o", T, "maybe_lse", OPT_T,
    "kv_layout_code", I, "window_left", I, "enable_pdl", B,
    # ADDITIONAL_FUNC_PARAMS of gen_batch_decode_module
    "maybe_alibi_slopes", OPT_FT, "logits_soft_cap", F, "sm_scale", F, "rope_rcp_scale", F,
    "rope_rcp_theta", F), "void")

# -- batch prefill, fa2 ---------------------------------------------------------------------------------------
_FA2_EXTRA = (
    "maybe_custom_mask", OPT_FT, "maybe_mask_indptr", OPT_FT, "maybe_alibi_slopes", OPT_FT,
    "maybe_prefix_len_ptr", OPT_FT, "maybe_token_pos_in_items_ptr", OPT_FT, "maybe_max_item_len_ptr", OPT_FT,
    "maybe_k_cache_sf", OPT_FT, "maybe_v_cache_sf", OPT_FT,
    "logits_soft_cap", F, "sm_scale", F, "rope_rcp_scale", F, "rope_rcp_theta", F,
    "token_pos_in_items_len", I)
_PREFILL_PLAN_HEAD = (
    *_WORKSPACES, "page_locked_int_workspace_buffer", T, "qo_indptr", T, "kv_indptr", T, "kv_len_arr", T,
    "total_num_rows", I, "batch_size", I, "num_qo_heads", I, "num_kv_heads", I, "page_size", I,
    "enable_cuda_graph", B, "head_dim_qk", I, "head_dim_vo", I, "causal", B, "window_left", I)
_RAGGED_RUN_HEAD = (
    *_WORKSPACES, "plan_info_vec", ARR, "q", T, "k", T, "v", T, "qo_indptr", T, "kv_indptr", T, "o", T,
    "maybe_lse", OPT_T, "mask_mode_code", I, "layout", I, "window_left", I, "enable_pdl", B)
_PAGED_RUN_HEAD = (
    *_WORKSPACES, "plan_info_vec", ARR, "q", T, "paged_k_cache", T, "paged_v_cache", T, "qo_indptr", T,
    "paged_kv_indptr", T, "paged_kv_indices", T, "paged_kv_last_page_len", T, "o", T, "maybe_lse", OPT_T,
    "mask_mode_code", I, "layout", I, "window_left", I, "enable_pdl", B)

PREFILL_FA2_PLAN = FuncABI("prefill_fa2", "plan", _args(
    *_PREFILL_PLAN_HEAD, "fixed_split_size", I, "disable_split_kv", B, "num_colocated_ctas", I,
    "uniform_q_len", I, "fixed_uniform_q_len", B), ARR)
PREFILL_FA2_RAGGED_RUN = FuncABI("prefill_fa2", "ragged_run", _args(*_RAGGED_RUN_HEAD, *_FA2_EXTRA), "void")
PREFILL_FA2_PAGED_RUN = FuncABI("prefill_fa2", "paged_run", _args(*_PAGED_RUN_HEAD, *_FA2_EXTRA), "void")

# -- batch prefill, fa3 (Hopper) ---------------------------------------------------------------------------
_FA3_EXTRA = (
    "maybe_prefix_len_ptr", OPT_FT, "maybe_token_pos_in_items_ptr", OPT_FT, "maybe_max_item_len_ptr", OPT_FT,
    "maybe_scale_v", OPT_FT, "logits_soft_cap", F, "sm_scale", F, "scale_v_scalar", F,
    "token_pos_in_items_len", I)
PREFILL_FA3_PLAN = FuncABI("prefill_fa3", "plan", _args(*_PREFILL_PLAN_HEAD), ARR)
PREFILL_FA3_RAGGED_RUN = FuncABI("prefill_fa3", "ragged_run", _args(*_RAGGED_RUN_HEAD, *_FA3_EXTRA), "void")
PREFILL_FA3_PAGED_RUN = FuncABI("prefill_fa3", "paged_run", _args(*_PAGED_RUN_HEAD, *_FA3_EXTRA), "void")

# -- MLA (fa2) ----------------------------------------------------------------------------------------------
# plan returns (plan_info, staged_int_workspace_bytes): the caller copies that many bytes of the page-locked
# int workspace to the device int workspace itself (0.7.4's Python wrapper does it in _BatchMLAModuleProxy).
MLA_PLAN = FuncABI("mla", "plan", _args(
    *_WORKSPACES, "page_locked_int_workspace_buffer", T, "qo_indptr", T, "kv_indptr", T, "kv_len", T,
    "num_heads", I, "head_dim_o", I, "causal", B), "Tuple<Array<int>, int>")
MLA_RUN = FuncABI("mla", "run", _args(
    *_WORKSPACES, "plan_info_vec", ARR, "q_nope", T, "q_pe", T, "ckv_cache", T, "kpe_cache", T,
    "kv_indices", T, "o", T, "maybe_lse", OPT_T, "mask_mode_code", I, "num_heads", I, "page_size", I,
    "sm_scale", F, "return_lse_base_on_e", B, "ckv_scale", F, "kpe_scale", F,
    "maybe_ckv_scale_arr", OPT_T), "void")

#: kind -> the functions of that kind the runtime adapter calls, in a fixed order.
CALLED: dict[str, tuple[FuncABI, ...]] = {
    "decode": (DECODE_PLAN, DECODE_RUN),
    "prefill_fa2": (PREFILL_FA2_PLAN, PREFILL_FA2_RAGGED_RUN, PREFILL_FA2_PAGED_RUN),
    "prefill_fa3": (PREFILL_FA3_PLAN, PREFILL_FA3_RAGGED_RUN, PREFILL_FA3_PAGED_RUN),
    "mla": (MLA_PLAN, MLA_RUN),
}
# fa3 MLA (batch_mla_sm90_binding.cu) exports plan / run with the same argument lists as fa2's; the header
# names them once, under "mla".
SAME_AS = {"mla_fa3": "mla"}


def functions(kind: str) -> tuple[FuncABI, ...]:
    """The pinned functions of module kind ``kind`` (fa3 MLA: fa2 MLA's lists)."""
    return CALLED[SAME_AS.get(kind, kind)]


def _camel(s: str) -> str:
    return "".join(p.capitalize() for p in s.split("_"))


def cpp_header() -> str:
    """``src/flashinfer_abi.h``: per function a namespace with one index constant per argument and
    ``kNumArgs``; the adapter fills an ``AnyView[kNumArgs]`` by these indices."""
    lines = [
        "// Generated by `python -m pagedkv.flashinfer.abi > src/flashinfer_abi.h` from",
        "// python/pagedkv/flashinfer/abi.py (the pinned flashinfer-python 0.7.4 argument lists). Do not edit.",
        "#ifndef PAGEDKV_FLASHINFER_ABI_H_",
        "#define PAGEDKV_FLASHINFER_ABI_H_",
        "",
        "namespace pagedkv {",
        "namespace flashinfer_abi {",
        "",
        'inline constexpr const char* kFlashInferVersion = "0.7.4";',
        "",
    ]
    for kind, funcs in CALLED.items():
        for f in funcs:
            lines.append(f"// {f.kind}.{f.func} -> {f.ret}")
            lines.append(f"namespace {f.kind}_{f.func} {{")
            lines.append(f'inline constexpr const char* kName = "{f.func}";')
            for i, (name, typ) in enumerate(f.args):
                lines.append(f"inline constexpr int k{_camel(name)} = {i};  // {typ}")
            lines.append(f"inline constexpr int kNumArgs = {f.num_args};")
            lines.append(f"}}  // namespace {f.kind}_{f.func}")
            lines.append("")
    lines += ["}  // namespace flashinfer_abi", "}  // namespace pagedkv", "",
              "#endif  // PAGEDKV_FLASHINFER_ABI_H_", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(cpp_header())
