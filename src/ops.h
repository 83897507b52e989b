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
// MLA layers: pages hold one latent vector per token (docs/ARCHITECTURE.md, "MLA").
inline constexpr const char* kMLAAppendKV = "mla_append_kv";
inline constexpr const char* kMLAGatherKV = "mla_gather_kv";
inline constexpr const char* kMLAAttnPrefillPaged = "mla_attn_prefill_paged";
inline constexpr const char* kMLAAttnDecodePaged = "mla_attn_decode_paged";

// Every op, in the order of python/pagedkv/ops.py OPS.
inline constexpr std::array<const char*, 13> kAllOps = {
    kSplitRotary,     kAppendKV,        kGatherKV,   kAttnPrefillRagged, kAttnPrefillPaged,
    kAttnDecodePaged, kMergeState,      kCopyPage,   kCompactCopy,       kMLAAppendKV,
    kMLAGatherKV,     kMLAAttnPrefillPaged, kMLAAttnDecodePaged};

// The ops of each layer kind (python/pagedkv/ops.py OPS_BY_KIND). An op table may hold only its cache's
// kind's ops.
inline constexpr std::array<const char*, 9> kMHAOps = {
    kSplitRotary,     kAppendKV,   kGatherKV, kAttnPrefillRagged, kAttnPrefillPaged,
    kAttnDecodePaged, kMergeState, kCopyPage, kCompactCopy};
inline constexpr std::array<const char*, 8> kMLAOps = {
    kMLAAppendKV,        kMLAGatherKV, kAttnPrefillRagged, kMLAAttnPrefillPaged,
    kMLAAttnDecodePaged, kMergeState,  kCopyPage,          kCompactCopy};

// Ops the runtime calls in its normal forward / fork path: `pagedkv.create` fails naming the first one
// missing from the op table. The gather ops (debug reads only) and compact_copy (no caller yet) are
// optional; a call that needs a missing optional op fails naming it.
inline constexpr std::array<const char*, 7> kRequiredMHAOps = {
    kSplitRotary,     kAppendKV,   kAttnPrefillRagged, kAttnPrefillPaged,
    kAttnDecodePaged, kMergeState, kCopyPage};
inline constexpr std::array<const char*, 6> kRequiredMLAOps = {
    kMLAAppendKV, kAttnPrefillRagged, kMLAAttnPrefillPaged, kMLAAttnDecodePaged, kMergeState, kCopyPage};

template <size_t N>
inline bool Contains(const std::array<const char*, N>& ops, std::string_view name) {
  for (const char* op : ops) {
    if (name == op) return true;
  }
  return false;
}

inline bool IsKnownOp(std::string_view name) { return Contains(kAllOps, name); }

}  // namespace ops
}  // namespace pagedkv

#endif  // PAGEDKV_OPS_H_
