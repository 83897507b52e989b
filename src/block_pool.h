// BlockPool: pages, blocks and sequences of the paged KV cache. Pure host bookkeeping (no tensors), so
// it can be reasoned about and tested on its own; the cache runs the device work it asks for (page copies).
//
// Model (docs/ARCHITECTURE.md, "Sequences, blocks and pages"): a sequence is a chain of blocks from a
// root to its own leaf. A block owns pages and a token count; its tokens start at offset 0 of its first
// page and at position `start` of every chain through it. A block with children is immutable and
// page-aligned, so the pages of a chain concatenate: token t is at chain_pages[t / ps], offset t % ps.
// Leaves are never shared (each sequence has its own), so appending only ever touches a leaf.
//
// Every mutating call validates first and throws ValueError naming the bad value before changing anything.
#ifndef PAGEDKV_BLOCK_POOL_H_
#define PAGEDKV_BLOCK_POOL_H_

#include <cstdint>
#include <map>
#include <optional>
#include <vector>

namespace pagedkv {

struct Block {
  std::vector<int32_t> pages;
  int64_t start = 0;       // position of its first token (a multiple of page_size)
  int64_t num_tokens = 0;
  int32_t parent = -1;     // -1: a root
  int32_t num_children = 0;
  bool in_use = false;
};

struct Sequence {
  int32_t leaf = -1;
  int64_t length = 0;
};

// Device work a pool change needs: copy the first `num_tokens` tokens of page `src` into page `dst`.
struct PageCopy {
  int32_t src = 0;
  int32_t dst = 0;
  int64_t num_tokens = 0;
};

class BlockPool {
 public:
  BlockPool(int64_t num_pages, int64_t page_size);

  void Clear();
  void Add(int64_t seq_id);
  void Remove(int64_t seq_id);
  // Child shares the parent's first `pos` tokens (pos -1: all); returns the mid-page copy, if any.
  std::optional<PageCopy> Fork(int64_t parent_id, int64_t child_id, int64_t pos);
  std::optional<PageCopy> PopN(int64_t seq_id, int64_t n);
  // Throws unless Append(ids, lengths) can succeed (ids known and unique, lengths >= 1, pages enough).
  void CheckAppend(const std::vector<int64_t>& ids, const std::vector<int64_t>& lengths) const;
  // Only after CheckAppend(ids, lengths) passed with no change to the pool since (begin_forward checks,
  // reserves its index buffers, then appends): the check is a third of a decode step's host work at B=64.
  void Append(const std::vector<int64_t>& ids, const std::vector<int64_t>& lengths);

  const Sequence& Get(int64_t seq_id) const;  // throws naming an unknown id
  bool Has(int64_t seq_id) const { return seqs_.count(seq_id) != 0; }
  const std::map<int64_t, Sequence>& sequences() const { return seqs_; }
  const Block& block(int32_t id) const { return blocks_[id]; }
  std::vector<int32_t> Chain(int64_t seq_id) const;       // block ids, root first
  std::vector<int32_t> Chain(const Sequence& seq) const;
  std::vector<int32_t> ChainPages(int64_t seq_id) const;  // page ids of the chain, in token order
  int64_t NumFreePages() const { return static_cast<int64_t>(free_pages_.size()); }
  int64_t NumPages() const { return num_pages_; }
  int64_t PageSize() const { return page_size_; }
  int64_t TotalLength() const;
  // Pages taken from the free list since the last call (the cache poisons them in debug mode, and maps them in
  // the window pools: window_pools.h).
  std::vector<int32_t> TakeNewPages();
  // Pages given back to the free list since the last call (the window pools free their own pages of them).
  std::vector<int32_t> TakeFreedPages();
  // Pages Append(ids, lengths) takes (only after CheckAppend passed), Fork(parent, -, pos) takes and PopN(seq, n)
  // takes (0 or 1: a mid-page cut of a shared page), for the window pools' budget checks before either runs.
  int64_t AppendPages(const std::vector<int64_t>& ids, const std::vector<int64_t>& lengths) const;
  int64_t ForkPages(int64_t parent_id, int64_t pos) const;
  int64_t PopNPages(int64_t seq_id, int64_t n) const;
  std::vector<int32_t> FreePages() const { return free_pages_; }

 private:
  int32_t NewBlock(int32_t parent, int64_t start);
  int32_t TakePage();
  void ReleaseLeaf(int32_t leaf);
  int32_t SplitBlock(int32_t block, int64_t aligned);
  int32_t AttachPoint(int64_t owner, int64_t aligned);
  int32_t BranchAt(int64_t owner, int64_t pos, std::optional<PageCopy>* copy);
  int64_t PagesNeeded(const Sequence& seq, int64_t append) const;

  int64_t num_pages_;
  int64_t page_size_;
  std::vector<int32_t> free_pages_;  // taken from the back
  std::vector<Block> blocks_;
  std::vector<int32_t> free_blocks_;
  std::map<int64_t, Sequence> seqs_;
  std::vector<int32_t> new_pages_;
  std::vector<int32_t> freed_pages_;
};

}  // namespace pagedkv

#endif  // PAGEDKV_BLOCK_POOL_H_
