// The op vocabulary of pagedkv. These strings are the keys of the op table passed to `pagedkv.create`
// and must stay identical to python/pagedkv/ops.py (and docs/ARCHITECTURE.md, "Op vocabulary").
// An op's name and argument list are frozen once released: a changed ABI gets a new name.
#ifndef PAGEDKV_OPS_H_
#define PAGEDKV_OPS_H_

#include <array>
#include <string_view>

namespace pagedkv {
namespace ops {

inline constexpr const char* kSplitRotary = "split_rotary";
inline constexpr const char* kAppendKV = "append_kv";
inline constexpr const char* kGatherKV = "gather_kv";
inline constexpr const char* kAttnPrefillRagged = "attn_prefill_ragged";
inline constexpr const char* kAttnPrefillPaged = "attn_prefill_paged";
inline constexpr const char* kAttnDecodePaged = "attn_decode_paged";
inline constexpr const char* kMergeState = "merge_state";
inline constexpr const char* kCopyPage = "copy_page";
inline constexpr const char* kCompactCopy = "compact_copy";

// Every op, in the order of python/pagedkv/ops.py OPS.
inline constexpr std::array<const char*, 9> kAllOps = {
    kSplitRotary,     kAppendKV,        kGatherKV,   kAttnPrefillRagged, kAttnPrefillPaged,
    kAttnDecodePaged, kMergeState,      kCopyPage,   kCompactCopy};

// Ops the runtime calls in its normal forward / fork path: `pagedkv.create` fails naming the first one
// missing from the op table. gather_kv (debug_get_kv only) and compact_copy (no caller yet) are optional;
// a call that needs a missing optional op fails naming it.
inline constexpr std::array<const char*, 7> kRequiredOps = {
    kSplitRotary,     kAppendKV,   kAttnPrefillRagged, kAttnPrefillPaged,
    kAttnDecodePaged, kMergeState, kCopyPage};

inline bool IsKnownOp(std::string_view name) {
  for (const char* op : kAllOps) {
    if (name == op) return true;
  }
  return false;
}

}  // namespace ops
}  // namespace pagedkv

#endif  // PAGEDKV_OPS_H_
