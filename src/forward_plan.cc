// Pass construction. A chain block that a sequence shares with an adjacent sequence of the batch (same
// block at the same depth) is read once for all of their queries (one entry per run of sharers); the rest
// of each chain is the sequence's own entry in the last pass.
#include "forward_plan.h"

#include <algorithm>

namespace pagedkv {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Number of leading chain blocks of `a` and `b` that are the same block (leaves are never shared).
size_t CommonDepth(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t limit = std::min(a.size(), b.size()) - 1;
  size_t d = 0;
  while (d < limit && a[d] == b[d]) ++d;
  return d;
}

// Appends an entry of q rows [q_begin, q_end) over keys pages[0..) holding `tokens` tokens from `start`.
void AddEntry(PassPlan* pass, int32_t q_begin, int32_t q_end, const int32_t* pages, int64_t tokens,
              int64_t start, int64_t page_size) {
  if (pass->q_indptr.empty()) pass->q_indptr.push_back(q_begin);
  if (pass->page_indptr.empty()) pass->page_indptr.push_back(0);
  int64_t num_pages = CeilDiv(tokens, page_size);
  pass->page_values.insert(pass->page_values.end(), pages, pages + num_pages);
  pass->q_indptr.push_back(q_end);
  pass->page_indptr.push_back(static_cast<int32_t>(pass->page_values.size()));
  pass->last_page_len.push_back(tokens == 0 ? 0 : static_cast<int32_t>(tokens - (num_pages - 1) * page_size));
  pass->k_pos_offset.push_back(static_cast<int32_t>(start));
  if (tokens > 0) pass->all_empty = false;
  if (q_end - q_begin != 1) pass->one_query_per_entry = false;
}

struct SeqView {
  std::vector<int32_t> chain;
  // The chain's page ids in token order: the leaf block's own list when the chain is that one block (a
  // sequence that was never forked; no copy: a B=64 decode at 4K tokens would copy 16K ids per step),
  // otherwise `own_pages`, the chain's lists concatenated.
  const int32_t* pages = nullptr;
  std::vector<int32_t> own_pages;
  int64_t kv_len = 0;   // keys the passes see
  size_t shared = 0;    // leading blocks read in prefix passes
  int64_t first_key = 0;  // page-aligned: the own entry starts no earlier (PlanOptions::skip_behind_window)
};

void ViewPages(const BlockPool& pool, SeqView* s) {
  if (s->chain.size() == 1) {
    s->pages = pool.block(s->chain[0]).pages.data();
    return;
  }
  for (int32_t b : s->chain) {
    const std::vector<int32_t>& pages = pool.block(b).pages;
    s->own_pages.insert(s->own_pages.end(), pages.begin(), pages.end());
  }
  s->pages = s->own_pages.data();
}

// Reserves each array of a pass of `entries` entries listing at most `pages` page ids.
void ReservePass(PassPlan* pass, size_t entries, size_t pages) {
  pass->q_indptr.reserve(entries + 1);
  pass->page_indptr.reserve(entries + 1);
  pass->page_values.reserve(pages);
  pass->last_page_len.reserve(entries);
  pass->k_pos_offset.reserve(entries);
}

// Prefix pass at depth d: runs of sequences sharing their depth-d block form one entry.
PassPlan PrefixPass(const BlockPool& pool, const std::vector<SeqView>& seqs, const ForwardPlan& plan,
                    size_t d) {
  PassPlan pass;
  size_t n = seqs.size();
  for (size_t i = 0; i < n;) {
    if (d >= seqs[i].shared) {
      AddEntry(&pass, plan.q_indptr[i], plan.q_indptr[i + 1], nullptr, 0, 0, pool.PageSize());
      ++i;
      continue;
    }
    int32_t block_id = seqs[i].chain[d];
    size_t j = i + 1;
    while (j < n && d < seqs[j].shared && seqs[j].chain[d] == block_id) ++j;
    const Block& block = pool.block(block_id);
    AddEntry(&pass, plan.q_indptr[i], plan.q_indptr[j], block.pages.data(), block.num_tokens, block.start,
             pool.PageSize());
    i = j;
  }
  return pass;
}

PassPlan OwnPass(const BlockPool& pool, const std::vector<SeqView>& seqs, const ForwardPlan& plan) {
  PassPlan pass;
  int64_t ps = pool.PageSize();
  size_t pages = 0;
  for (const SeqView& s : seqs) pages += static_cast<size_t>((s.kv_len + ps - 1) / ps);
  ReservePass(&pass, seqs.size(), pages);
  for (size_t i = 0; i < seqs.size(); ++i) {
    const SeqView& s = seqs[i];
    int64_t start = std::max(pool.block(s.chain[s.shared]).start, s.first_key);
    int64_t tokens = std::max<int64_t>(s.kv_len - start, 0);
    AddEntry(&pass, plan.q_indptr[i], plan.q_indptr[i + 1], s.pages + start / ps, tokens, start, ps);
  }
  return pass;
}

// Entries of q rows [begin, end) of sequence `s` over its first `keys` tokens, skipped when empty.
void AddSinkEntry(PassPlan* pass, const SeqView& s, int32_t begin, int32_t end, int64_t keys, int64_t ps) {
  if (begin < end) AddEntry(pass, begin, end, s.pages, keys, 0, ps);
}

// The sink-token passes of a flat forward (PlanOptions::sink_size), before the own pass: a decode's one pass, or
// a prefill's causal and non-causal passes. Passes without keys are left out.
void AddSinkPasses(const std::vector<SeqView>& seqs, ForwardPlan* plan, int64_t window, int64_t sink, int64_t ps) {
  PassPlan causal, full;
  causal.causal = true;
  for (size_t i = 0; i < seqs.size(); ++i) {
    int64_t prior = plan->prior_len[i], length = seqs[i].kv_len;
    int32_t q0 = plan->q_indptr[i];
    auto row = [&](int64_t pos) { return static_cast<int32_t>(q0 + pos - prior); };
    if (plan->is_decode) {  // the query at length - 1 misses [0, length - window)
      AddSinkEntry(&full, seqs[i], row(prior), row(length), std::clamp<int64_t>(length - window, 0, sink), ps);
      continue;
    }
    // rows [prior, b1): c = 0; [b1, b2): 0 < c < sink; [b2, length): c = sink
    int64_t b1 = std::clamp<int64_t>(window, prior, length), b2 = std::clamp<int64_t>(window + sink - 1, prior, length);
    AddSinkEntry(&causal, seqs[i], row(prior), row(b1), 0, ps);
    AddSinkEntry(&causal, seqs[i], row(b1), row(b2), b2 - window, ps);
    AddSinkEntry(&causal, seqs[i], row(b2), row(length), 0, ps);
    AddSinkEntry(&full, seqs[i], row(prior), row(b2), 0, ps);
    AddSinkEntry(&full, seqs[i], row(b2), row(length), sink, ps);
  }
  for (PassPlan* p : {&causal, &full}) {
    if (!p->all_empty) plan->passes.push_back(std::move(*p));
  }
}

}  // namespace

ForwardPlan BuildForwardPlan(const BlockPool& pool, const std::vector<int64_t>& ids,
                             const std::vector<int64_t>& lengths, PlanOptions options) {
  ForwardPlan plan;
  int64_t ps = pool.PageSize();
  bool flat = options.flat;
  plan.is_decode = std::all_of(lengths.begin(), lengths.end(), [](int64_t l) { return l == 1; });
  plan.through = plan.is_decode || flat;
  std::vector<SeqView> seqs(ids.size());
  int64_t tokens = 0;
  for (int64_t l : lengths) tokens += l;
  plan.q_indptr.reserve(ids.size() + 1);
  plan.prior_len.reserve(ids.size());
  plan.q_pos.reserve(static_cast<size_t>(tokens));
  plan.append_slot.reserve(static_cast<size_t>(tokens));
  plan.q_indptr.push_back(0);
  for (size_t i = 0; i < ids.size(); ++i) {
    SeqView& s = seqs[i];
    const Sequence& seq = pool.Get(ids[i]);
    s.chain = pool.Chain(seq);
    ViewPages(pool, &s);
    int64_t length = seq.length;
    int64_t prior = length - lengths[i];
    s.kv_len = length;  // through; split forwards see `prior` (below, once every prior is known)
    if (options.skip_behind_window) s.first_key = std::max<int64_t>(0, prior - options.window + 1) / ps * ps;
    plan.prior_len.push_back(static_cast<int32_t>(prior));
    for (int64_t pos = prior; pos < length; ++pos) {
      plan.q_pos.push_back(static_cast<int32_t>(pos));
      plan.append_slot.push_back(static_cast<int32_t>(s.pages[pos / ps] * ps + pos % ps));
    }
    plan.q_indptr.push_back(static_cast<int32_t>(plan.q_pos.size()));
  }
  plan.num_tokens = static_cast<int64_t>(plan.q_pos.size());
  // A continuation (every sequence held tokens before the forward) is planned through as well.
  plan.through = plan.through || (options.through_continuations &&
                                  std::all_of(plan.prior_len.begin(), plan.prior_len.end(),
                                              [](int32_t p) { return p > 0; }));
  if (!plan.through) {
    for (size_t i = 0; i < seqs.size(); ++i) seqs[i].kv_len = plan.prior_len[i];
  }
  size_t depth = 0;
  for (size_t i = 0; i < seqs.size() && !flat; ++i) {
    if (i > 0) seqs[i].shared = std::max(seqs[i].shared, CommonDepth(seqs[i].chain, seqs[i - 1].chain));
    if (i + 1 < seqs.size()) seqs[i].shared = std::max(seqs[i].shared, CommonDepth(seqs[i].chain, seqs[i + 1].chain));
    seqs[i].shared = std::min<size_t>(seqs[i].shared, kMaxPrefixPasses);
    depth = std::max(depth, seqs[i].shared);
  }
  for (size_t d = 0; d < depth; ++d) plan.passes.push_back(PrefixPass(pool, seqs, plan, d));
  if (flat && options.sink_size > 0) AddSinkPasses(seqs, &plan, options.window, options.sink_size, ps);
  plan.passes.push_back(OwnPass(pool, seqs, plan));
  plan.passes.back().causal = plan.through && !plan.is_decode;
  return plan;
}

int64_t PageValuesBound(const BlockPool& pool, const std::vector<int64_t>& ids,
                        const std::vector<int64_t>& lengths, int64_t sink_size) {
  // Each page of a chain is listed at most once per sequence over all passes, and the first ones once more in
  // each of the two sink passes.
  int64_t bound = 0, sink_pages = 2 * CeilDiv(sink_size, pool.PageSize());
  for (size_t i = 0; i < ids.size(); ++i) {
    bound += (pool.Get(ids[i]).length + lengths[i] + pool.PageSize() - 1) / pool.PageSize() + sink_pages;
  }
  return bound;
}

}  // namespace pagedkv
