// WindowPools: the page pools of a cache's sliding layer groups (config layer_groups, schema 7;
// docs/ARCHITECTURE.md, "Layer groups").
//
// The block tree (BlockPool) hands out *logical* page ids, one tree for every group: fork, popn and remove apply to
// all layers at once. A logical page is a page of the main pool's tensors (full layers; a cache without groups has
// only that pool). Each window pool (one per distinct window W) maps a logical page to a page of its own, smaller
// tensors while some sequence's window may still read it, and gives that page back once it lies wholly behind the
// window of every sequence whose chain holds it (Trim, after each forward): a sliding group then holds at most
// ceil(W / ps) + 1 pages per sequence (its last W tokens), plus the pages of the forward in flight. Released pages
// of a block are always a prefix of its pages (a fork or popn that needs a released token is refused, naming the
// group: CheckResident), so Trim walks back from each threshold only over pages it has not released yet.
//
// Pure host bookkeeping, like BlockPool; every check throws before anything changes.
#ifndef PAGEDKV_WINDOW_POOLS_H_
#define PAGEDKV_WINDOW_POOLS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "block_pool.h"
#include "config.h"
#include "forward_plan.h"

namespace pagedkv {

class WindowPools {
 public:
  // Pools for cfg.group_windows (none without layer groups), of WindowPoolPages(cfg, W) pages each.
  explicit WindowPools(const KVConfig& cfg);

  int NumPools() const { return static_cast<int>(pools_.size()); }
  // Pool i (0-based; the cache's layer pool i + 1): its window, page count and free pages.
  int64_t Window(int i) const { return pools_[i].window; }
  int64_t Capacity(int i) const { return pools_[i].capacity; }
  int64_t NumFree(int i) const { return static_cast<int64_t>(pools_[i].free.size()); }
  // The pool's page of logical page `logical` (-1: not mapped, i.e. released or never taken).
  int32_t Phys(int i, int32_t logical) const { return pools_[i].phys[logical]; }

  void Clear();
  // Throws ValueError naming the groups of the first pool with fewer than `pages` free pages (`what`: the call).
  void CheckFree(int64_t pages, const std::string& what) const;
  // Throws ValueError naming the group unless tokens [max(0, pos - W), pos) of `chain_pages` (a sequence's
  // logical pages in token order) are resident in every pool: a sequence continued at `pos` (a fork's child, a
  // popn's new end) reads them.
  void CheckResident(const std::vector<int32_t>& chain_pages, int64_t pos, const std::string& what) const;
  // Maps newly taken logical pages in every pool (after CheckFree passed for their count).
  void Map(const std::vector<int32_t>& logical);
  // Frees the pool pages of logical pages the block tree freed.
  void Unmap(const std::vector<int32_t>& logical);
  // Gives back every pool page wholly behind the window of each sequence reading it. `pending`: tokens at the end of
  // a sequence that may still be popped (an uncommitted token chain): the window is kept behind them too.
  void Trim(const BlockPool& pool, const std::map<int64_t, int64_t>& pending);
  // Pool pages mapped since the last call (the cache poisons them in debug mode).
  std::vector<int32_t> TakeNewPages(int i);
  std::vector<int32_t> FreePages(int i) const { return pools_[i].free; }
  // Pool i's plan: `plan`'s logical page ids and append slots as the pool's (every page it lists is mapped).
  void Translate(int i, ForwardPlan* plan) const;

 private:
  struct Pool {
    int64_t window = 0;
    int64_t capacity = 0;
    std::string groups;             // "'a', 'b'": the layer groups of this window, for errors
    std::vector<int32_t> phys;      // logical page -> pool page, -1: none
    std::vector<int32_t> free;      // taken from the back
    std::vector<int32_t> fresh;     // mapped since TakeNewPages
  };
  void Release(Pool* p, int32_t logical);

  int64_t page_size_;
  int64_t num_logical_;
  std::vector<Pool> pools_;
};

// Pages of the pool of window W: enough for max_batch_size sequences each holding its last W tokens (ceil(W/ps) + 1
// pages) and a forward of prefill_chunk_size tokens in flight (ceil(chunk/ps) + one partial page a sequence), and
// never more than the main pool (num_pages).
int64_t WindowPoolPages(const KVConfig& cfg, int64_t window);

}  // namespace pagedkv

#endif  // PAGEDKV_WINDOW_POOLS_H_
