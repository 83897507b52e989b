// ForwardPlan: every host-side index array of one forward (docs/ARCHITECTURE.md, "One forward"), built
// from the BlockPool after the new tokens were reserved. Pure host logic; AuxBuilder uploads it.
#ifndef PAGEDKV_FORWARD_PLAN_H_
#define PAGEDKV_FORWARD_PLAN_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "block_pool.h"

namespace pagedkv {

// Shared-prefix depths that get a pass of their own; deeper shared blocks fold into the own entry.
inline constexpr int kMaxPrefixPasses = 4;
inline constexpr int kMaxPasses = kMaxPrefixPasses + 1;

// One attention pass over paged k/v: entries are runs of sequences (q rows q_indptr[e]..q_indptr[e+1]).
struct PassPlan {
  std::vector<int32_t> q_indptr;       // [E+1]
  std::vector<int32_t> page_indptr;    // [E+1]
  std::vector<int32_t> page_values;    // [nnz]
  std::vector<int32_t> last_page_len;  // [E]
  std::vector<int32_t> k_pos_offset;   // [E]: position of the entry's first key
  int64_t num_entries() const { return static_cast<int64_t>(last_page_len.size()); }
  bool all_empty = true;               // no entry has keys: the pass is skipped
  bool one_query_per_entry = true;     // attn_decode_paged can serve it
  // The entry's keys end with its queries' own tokens (a through pass of a windowed prefill): attended
  // causally, bottom-right aligned. Otherwise every key precedes every query and the pass is non-causal.
  bool causal = false;
};

// Keys entry `e` of a paged pass reads: 0 when empty, else (pages - 1) * page_size + last_page_len.
inline int32_t EntryKvLen(const PassPlan& p, int64_t e, int64_t page_size) {
  int32_t pages = p.page_indptr[e + 1] - p.page_indptr[e];
  return pages == 0 ? 0 : static_cast<int32_t>((pages - 1) * page_size + p.last_page_len[e]);
}

// Keys of each entry of a paged pass (EntryKvLen).
inline std::vector<int32_t> PagedKvLens(const PassPlan& p, int64_t page_size) {
  std::vector<int32_t> out(p.num_entries());
  for (int64_t e = 0; e < p.num_entries(); ++e) out[e] = EntryKvLen(p, e, page_size);
  return out;
}

// The most keys any entry of a paged pass reads (no vector: the max_kv_len adapter's per-forward work).
inline int32_t LongestKvLen(const PassPlan& p, int64_t page_size) {
  int32_t out = 0;
  for (int64_t e = 0; e < p.num_entries(); ++e) out = std::max(out, EntryKvLen(p, e, page_size));
  return out;
}

struct ForwardPlan {
  bool is_decode = false;              // every append length is 1
  // The passes read the new tokens too (appended before attention), so self_attention covers no key:
  // decode forwards, continuation forwards (PlanOptions::through_continuations) and every forward of a
  // windowed cache.
  bool through = false;
  int64_t num_tokens = 0;              // n
  std::vector<int32_t> q_indptr;       // [B+1], one entry per sequence
  std::vector<int32_t> q_pos;          // [n]
  std::vector<int32_t> append_slot;    // [n]
  std::vector<int32_t> prior_len;      // [B]: length before the forward (ragged k_pos_offset)
  std::vector<PassPlan> passes;        // shared-prefix depths first, the own pass last
};

// `pool` already holds the appended tokens. Decode passes see the cache including the new tokens;
// prefill passes see only the tokens cached before the forward. `flat`: one through pass per sequence over
// its whole chain, new tokens included, and no shared-prefix passes. A sliding-window cache plans flat (a
// window is relative to each query's position, which a library kernel (FlashInfer) derives from the entry's
// key count, so every entry must end at its queries), and so does a CUDA-graph decode (its kernel sequence
// may not depend on how sequences share prefixes).
//
// `through_continuations`: a prefill forward in which every sequence already holds tokens (a chunked
// prefill's later chunks, a chat's next turn) is planned through as well: its own pass is causal over the
// cached and the new tokens, one attention kernel instead of a ragged pass over the new tokens, a paged pass
// over the cached ones and a merge (benchmarks/HISTORY.md, the 512-over-4096 chunk). A forward with a fresh sequence
// keeps the split: the ragged kernel over contiguous new tokens is the faster one for a whole prompt.
//
// `sink_size` (StreamingLLM sink tokens, with `flat` and `window` >= sink_size): query p also sees the first
// sink_size tokens of its sequence. Its window (p - window, p] misses the sink keys [0, c(p)), c(p) = clamp(p -
// window + 1, 0, sink_size); those are read by passes before the own one, over each chain's first pages, whose
// every entry lies inside one window (so the window kernels see all of its keys). A decode's one query per
// sequence: one pass of c(p) keys per entry. A prefill's queries: c grows by one a row up to sink_size, so the rows
// with 0 < c < sink_size form one causal entry (bottom-right aligned on c(last row) keys: row p sees keys <= p -
// window), and those with c == sink_size one non-causal entry of sink_size keys, in a second pass.
//
// `skip_behind_window` (a window pool's plan, with `flat` and `window`): each sequence's entry starts at the page
// holding the first key its first query sees (position prior - window + 1), not at its first page: the pages before
// lie wholly behind every query's window, and a window pool may have given them back (window_pools.h). The window
// kernels place a query by its entry's key count (bottom-right), so the result is the same.
struct PlanOptions {
  bool flat = false;
  bool through_continuations = false;
  int64_t window = 0;
  int64_t sink_size = 0;
  bool skip_behind_window = false;
};
ForwardPlan BuildForwardPlan(const BlockPool& pool, const std::vector<int64_t>& ids,
                             const std::vector<int64_t>& lengths, PlanOptions options);

// Upper bound of the total page_values entries of a plan, from lengths before Append (for sizing); `sink_size`:
// the sink passes list each sequence's first pages again.
int64_t PageValuesBound(const BlockPool& pool, const std::vector<int64_t>& ids,
                        const std::vector<int64_t>& lengths, int64_t sink_size = 0);

// Entries a pass of a forward of `batch` sequences may have: one a sequence, or up to three with sink tokens
// (a causal sink pass: rows before, in and after its causal entry).
inline int64_t MaxEntriesPerPass(int64_t batch, int64_t sink_size) { return sink_size > 0 ? 3 * batch : batch; }

}  // namespace pagedkv

#endif  // PAGEDKV_FORWARD_PLAN_H_
