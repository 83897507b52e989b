// BlockPool implementation. Each public mutator checks everything it can fail on first, then mutates
// with operations that cannot fail, so a thrown error leaves the pool exactly as it was.
#include "block_pool.h"

#include <tvm/ffi/error.h>

#include <algorithm>
#include <set>

namespace pagedkv {

BlockPool::BlockPool(int64_t num_pages, int64_t page_size) : num_pages_(num_pages), page_size_(page_size) {
  Clear();
}

void BlockPool::Clear() {
  free_pages_.clear();
  // Taken from the back, so page 0 is used first (easier to read in dumps).
  for (int64_t p = num_pages_ - 1; p >= 0; --p) free_pages_.push_back(static_cast<int32_t>(p));
  blocks_.clear();
  free_blocks_.clear();
  seqs_.clear();
  new_pages_.clear();
  freed_pages_.clear();
}

const Sequence& BlockPool::Get(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  if (it == seqs_.end()) TVM_FFI_THROW(ValueError) << "pagedkv: unknown sequence id " << seq_id;
  return it->second;
}

void BlockPool::Add(int64_t seq_id) {
  if (Has(seq_id)) TVM_FFI_THROW(ValueError) << "pagedkv: sequence id " << seq_id << " already exists";
  seqs_[seq_id] = Sequence{NewBlock(-1, 0), 0};
}

void BlockPool::Remove(int64_t seq_id) {
  int32_t leaf = Get(seq_id).leaf;
  seqs_.erase(seq_id);
  ReleaseLeaf(leaf);
}

std::optional<PageCopy> BlockPool::Fork(int64_t parent_id, int64_t child_id, int64_t pos) {
  const Sequence& parent = Get(parent_id);
  if (Has(child_id)) TVM_FFI_THROW(ValueError) << "pagedkv: sequence id " << child_id << " already exists";
  if (pos == -1) pos = parent.length;
  if (pos < 0 || pos > parent.length) {
    TVM_FFI_THROW(ValueError) << "pagedkv: fork position " << pos << " is outside [0, " << parent.length
                              << "] (length of parent sequence " << parent_id << ")";
  }
  if (pos % page_size_ != 0 && free_pages_.empty()) {
    TVM_FFI_THROW(ValueError) << "pagedkv: out of pages: forking sequence " << parent_id << " at position "
                              << pos << " (mid-page) needs 1 free page, 0 available";
  }
  std::optional<PageCopy> copy;
  int32_t leaf = BranchAt(parent_id, pos, &copy);
  seqs_[child_id] = Sequence{leaf, pos};
  return copy;
}

std::optional<PageCopy> BlockPool::PopN(int64_t seq_id, int64_t n) {
  const Sequence& seq = Get(seq_id);
  if (n < 0 || n > seq.length) {
    TVM_FFI_THROW(ValueError) << "pagedkv: cannot pop " << n << " tokens from sequence " << seq_id
                              << " of length " << seq.length;
  }
  Block& leaf = blocks_[seq.leaf];
  if (n <= leaf.num_tokens) {  // only the sequence's own leaf shrinks
    leaf.num_tokens -= n;
    size_t keep = static_cast<size_t>((leaf.num_tokens + page_size_ - 1) / page_size_);
    while (leaf.pages.size() > keep) {
      free_pages_.push_back(leaf.pages.back());
      freed_pages_.push_back(leaf.pages.back());
      leaf.pages.pop_back();
    }
    seqs_[seq_id].length -= n;
    return std::nullopt;
  }
  // The cut reaches into shared blocks: re-root like a fork of itself, then drop the old leaf.
  int64_t new_length = seq.length - n;
  if (new_length % page_size_ != 0 && free_pages_.empty()) {
    TVM_FFI_THROW(ValueError) << "pagedkv: out of pages: popping " << n << " tokens of sequence " << seq_id
                              << " cuts a shared page and needs 1 free page, 0 available";
  }
  std::optional<PageCopy> copy;
  int32_t new_leaf = BranchAt(seq_id, new_length, &copy);
  int32_t old_leaf = seqs_[seq_id].leaf;
  seqs_[seq_id] = Sequence{new_leaf, new_length};
  ReleaseLeaf(old_leaf);  // the copy source page may be freed here; it is not reused before the copy runs
  return copy;
}

int64_t BlockPool::PagesNeeded(const Sequence& seq, int64_t append) const {
  const Block& leaf = blocks_[seq.leaf];
  int64_t pages = (leaf.num_tokens + append + page_size_ - 1) / page_size_;
  return pages - static_cast<int64_t>(leaf.pages.size());
}

void BlockPool::CheckAppend(const std::vector<int64_t>& ids, const std::vector<int64_t>& lengths) const {
  if (ids.size() != lengths.size()) {
    TVM_FFI_THROW(ValueError) << "pagedkv: " << ids.size() << " sequence ids but " << lengths.size()
                              << " append lengths";
  }
  // Whether any id repeats, by sorting a copy (one allocation); only then the set that names the first
  // repeat in order (a std::set allocates a node per id: every forward paid that).
  std::vector<int64_t> sorted(ids);
  std::sort(sorted.begin(), sorted.end());
  bool repeats = std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end();
  std::set<int64_t> seen;
  int64_t pages = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const Sequence& seq = Get(ids[i]);
    if (repeats && !seen.insert(ids[i]).second) {
      TVM_FFI_THROW(ValueError) << "pagedkv: sequence id " << ids[i] << " appears twice";
    }
    if (lengths[i] < 1) {
      TVM_FFI_THROW(ValueError) << "pagedkv: append length " << lengths[i] << " of sequence " << ids[i]
                                << " must be >= 1";
    }
    pages += PagesNeeded(seq, lengths[i]);
  }
  if (pages > NumFreePages()) {
    TVM_FFI_THROW(ValueError) << "pagedkv: out of pages: the forward needs " << pages << " new pages, "
                              << NumFreePages() << " available";
  }
}

void BlockPool::Append(const std::vector<int64_t>& ids, const std::vector<int64_t>& lengths) {
  TVM_FFI_ICHECK_EQ(ids.size(), lengths.size()) << "pagedkv: Append without CheckAppend";
  for (size_t i = 0; i < ids.size(); ++i) {
    auto it = seqs_.find(ids[i]);
    TVM_FFI_ICHECK(it != seqs_.end()) << "pagedkv: Append without CheckAppend";
    Sequence& seq = it->second;
    for (int64_t k = PagesNeeded(seq, lengths[i]); k > 0; --k) blocks_[seq.leaf].pages.push_back(TakePage());
    blocks_[seq.leaf].num_tokens += lengths[i];
    seq.length += lengths[i];
  }
}

std::vector<int32_t> BlockPool::Chain(int64_t seq_id) const { return Chain(Get(seq_id)); }

std::vector<int32_t> BlockPool::Chain(const Sequence& seq) const {
  std::vector<int32_t> chain;
  for (int32_t b = seq.leaf; b != -1; b = blocks_[b].parent) chain.push_back(b);
  std::reverse(chain.begin(), chain.end());
  return chain;
}

std::vector<int32_t> BlockPool::ChainPages(int64_t seq_id) const {
  std::vector<int32_t> pages;
  for (int32_t b : Chain(seq_id)) pages.insert(pages.end(), blocks_[b].pages.begin(), blocks_[b].pages.end());
  return pages;
}

int64_t BlockPool::TotalLength() const {
  int64_t total = 0;
  for (const auto& kv : seqs_) total += kv.second.length;
  return total;
}

std::vector<int32_t> BlockPool::TakeNewPages() {
  std::vector<int32_t> out;
  out.swap(new_pages_);
  return out;
}

std::vector<int32_t> BlockPool::TakeFreedPages() {
  std::vector<int32_t> out;
  out.swap(freed_pages_);
  return out;
}

int64_t BlockPool::AppendPages(const std::vector<int64_t>& ids, const std::vector<int64_t>& lengths) const {
  int64_t pages = 0;
  for (size_t i = 0; i < ids.size() && i < lengths.size(); ++i) pages += PagesNeeded(Get(ids[i]), lengths[i]);
  return pages;
}

int64_t BlockPool::ForkPages(int64_t parent_id, int64_t pos) const {
  if (pos == -1) pos = Get(parent_id).length;
  return pos % page_size_ != 0 ? 1 : 0;
}

int64_t BlockPool::PopNPages(int64_t seq_id, int64_t n) const {
  const Sequence& seq = Get(seq_id);
  bool reroot = n > blocks_[seq.leaf].num_tokens && n <= seq.length;
  return reroot && (seq.length - n) % page_size_ != 0 ? 1 : 0;
}

int32_t BlockPool::NewBlock(int32_t parent, int64_t start) {
  int32_t id;
  if (!free_blocks_.empty()) {
    id = free_blocks_.back();
    free_blocks_.pop_back();
  } else {
    id = static_cast<int32_t>(blocks_.size());
    blocks_.emplace_back();
  }
  blocks_[id] = Block();
  blocks_[id].in_use = true;
  blocks_[id].parent = parent;
  blocks_[id].start = start;
  if (parent != -1) blocks_[parent].num_children += 1;
  return id;
}

int32_t BlockPool::TakePage() {
  // Callers check the budget first; this is an internal invariant.
  TVM_FFI_ICHECK(!free_pages_.empty()) << "pagedkv: page budget was not checked";
  int32_t page = free_pages_.back();
  free_pages_.pop_back();
  new_pages_.push_back(page);
  return page;
}

// Frees `leaf` and every ancestor that loses its last child.
void BlockPool::ReleaseLeaf(int32_t leaf) {
  int32_t b = leaf;
  while (b != -1) {
    Block& block = blocks_[b];
    free_pages_.insert(free_pages_.end(), block.pages.rbegin(), block.pages.rend());
    freed_pages_.insert(freed_pages_.end(), block.pages.begin(), block.pages.end());
    int32_t parent = block.parent;
    block = Block();
    free_blocks_.push_back(b);
    if (parent == -1) break;
    if (--blocks_[parent].num_children > 0) break;
    b = parent;
  }
}

// Splits `block` at the page-aligned position `aligned` (strictly inside it); returns the new top part,
// which takes the block's place under its parent and becomes its parent.
int32_t BlockPool::SplitBlock(int32_t block, int64_t aligned) {
  int32_t top = NewBlock(-1, blocks_[block].start);
  Block& b = blocks_[block];
  Block& t = blocks_[top];
  size_t top_pages = static_cast<size_t>((aligned - b.start) / page_size_);
  t.parent = b.parent;  // replaces `block` as a child: the parent's child count is unchanged
  t.pages.assign(b.pages.begin(), b.pages.begin() + top_pages);
  t.num_tokens = aligned - b.start;
  t.num_children = 1;
  b.pages.erase(b.pages.begin(), b.pages.begin() + top_pages);
  b.num_tokens -= t.num_tokens;
  b.start = aligned;
  b.parent = top;
  return top;
}

// The block of `owner`'s chain that ends exactly at `aligned` (splitting one if needed); -1 for position 0.
// When that block is `owner`'s own leaf, the leaf becomes shared, so `owner` moves to a new empty leaf.
int32_t BlockPool::AttachPoint(int64_t owner, int64_t aligned) {
  if (aligned == 0) return -1;
  int32_t leaf = seqs_.at(owner).leaf;
  for (int32_t b : Chain(owner)) {
    const Block& block = blocks_[b];
    int64_t end = block.start + block.num_tokens;
    if (block.num_tokens > 0 && end == aligned) {
      if (b == leaf) seqs_[owner].leaf = NewBlock(b, aligned);
      return b;
    }
    if (block.start < aligned && aligned < end) return SplitBlock(b, aligned);
  }
  TVM_FFI_ICHECK(false) << "pagedkv: position " << aligned << " not found in the chain of " << owner;
  return -1;
}

// A new leaf holding tokens [0, pos) of `owner`'s chain: full pages shared, the partial page copied.
int32_t BlockPool::BranchAt(int64_t owner, int64_t pos, std::optional<PageCopy>* copy) {
  int64_t aligned = pos - pos % page_size_;
  int64_t rem = pos - aligned;
  int32_t src_page = -1;
  if (rem > 0) src_page = ChainPages(owner)[aligned / page_size_];
  int32_t attach = AttachPoint(owner, aligned);
  int32_t leaf = NewBlock(attach, aligned);
  if (rem > 0) {
    int32_t dst = TakePage();
    blocks_[leaf].pages.push_back(dst);
    blocks_[leaf].num_tokens = rem;
    *copy = PageCopy{src_page, dst, rem};
  }
  return leaf;
}

}  // namespace pagedkv
