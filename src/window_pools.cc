// WindowPools implementation (window_pools.h).
#include "window_pools.h"

#include <tvm/ffi/error.h>

#include <algorithm>
#include <unordered_map>

namespace pagedkv {

namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

int64_t WindowPoolPages(const KVConfig& c, int64_t window) {
  // in 128 bits: called before pagedkv.create has bounded the sizes (ComputeDeviceBytes)
  __int128 ps = c.page_size, b = c.max_batch_size;
  __int128 pages = b * ((window + ps - 1) / ps + 2) + (c.prefill_chunk_size + ps - 1) / ps;
  return static_cast<int64_t>(std::min<__int128>(pages, c.num_pages()));
}

WindowPools::WindowPools(const KVConfig& cfg) : page_size_(cfg.page_size), num_logical_(cfg.num_pages()) {
  for (size_t i = 0; i < cfg.group_windows.size(); ++i) {
    Pool p;
    p.window = cfg.group_windows[i];
    p.capacity = WindowPoolPages(cfg, p.window);
    p.groups = cfg.PoolGroupNames(static_cast<int>(i) + 1);
    pools_.push_back(std::move(p));
  }
  Clear();
}

void WindowPools::Clear() {
  for (Pool& p : pools_) {
    p.phys.assign(static_cast<size_t>(num_logical_), -1);
    p.free.clear();
    for (int64_t q = p.capacity - 1; q >= 0; --q) p.free.push_back(static_cast<int32_t>(q));
    p.fresh.clear();
  }
}

void WindowPools::CheckFree(int64_t pages, const std::string& what) const {
  for (const Pool& p : pools_) {
    if (pages > static_cast<int64_t>(p.free.size())) {
      TVM_FFI_THROW(ValueError) << "pagedkv: out of pages in layer group " << p.groups << " (sliding_window "
                                << p.window << ", " << p.capacity << " pages: the last " << p.window
                                << " tokens of max_batch_size sequences and one forward): " << what << " needs "
                                << pages << " new pages, " << p.free.size() << " available";
    }
  }
}

void WindowPools::CheckResident(const std::vector<int32_t>& chain_pages, int64_t pos, const std::string& what) const {
  for (const Pool& p : pools_) {
    int64_t from = std::max<int64_t>(0, pos - p.window);
    for (int64_t page = from / page_size_; page < CeilDiv(pos, page_size_); ++page) {
      if (p.phys[chain_pages[page]] >= 0) continue;
      TVM_FFI_THROW(ValueError) << "pagedkv: " << what << " needs tokens [" << from << ", " << pos
                                << ") resident in layer group " << p.groups << " (sliding_window " << p.window
                                << "), but the group gave back the pages of tokens before " << (page + 1) * page_size_
                                << " (it keeps the last " << p.window << " tokens of each sequence)";
    }
  }
}

void WindowPools::Map(const std::vector<int32_t>& logical) {
  for (Pool& p : pools_) {
    for (int32_t page : logical) {
      TVM_FFI_ICHECK(!p.free.empty()) << "pagedkv: window pool budget was not checked";
      TVM_FFI_ICHECK_EQ(p.phys[page], -1) << "pagedkv: logical page " << page << " mapped twice";
      p.phys[page] = p.free.back();
      p.free.pop_back();
      p.fresh.push_back(p.phys[page]);
    }
  }
}

void WindowPools::Release(Pool* p, int32_t logical) {
  p->free.push_back(p->phys[logical]);
  p->phys[logical] = -1;
}

void WindowPools::Unmap(const std::vector<int32_t>& logical) {
  for (Pool& p : pools_) {
    for (int32_t page : logical) {
      if (p.phys[page] >= 0) Release(&p, page);
    }
  }
}

void WindowPools::Trim(const BlockPool& pool, const std::map<int64_t, int64_t>& pending) {
  for (Pool& p : pools_) {
    // block -> the first position some sequence through it may still read
    std::unordered_map<int32_t, int64_t> keep;
    for (const auto& [id, seq] : pool.sequences()) {
      auto it = pending.find(id);
      int64_t from = seq.length - (it == pending.end() ? 0 : it->second) - p.window;
      for (int32_t b : pool.Chain(seq)) {
        auto [slot, inserted] = keep.emplace(b, from);
        if (!inserted) slot->second = std::min(slot->second, from);
      }
    }
    for (const auto& [b, from] : keep) {
      const Block& block = pool.block(b);
      int64_t behind = std::clamp<int64_t>((from - block.start) / page_size_, 0,
                                           static_cast<int64_t>(block.pages.size()));
      // released pages are a prefix: walk back to the first one
      for (int64_t k = behind - 1; k >= 0 && p.phys[block.pages[k]] >= 0; --k) Release(&p, block.pages[k]);
    }
  }
}

std::vector<int32_t> WindowPools::TakeNewPages(int i) {
  std::vector<int32_t> out;
  out.swap(pools_[i].fresh);
  return out;
}

void WindowPools::Translate(int i, ForwardPlan* plan) const {
  const Pool& p = pools_[i];
  auto phys = [&p](int32_t logical) {
    int32_t page = p.phys[logical];
    TVM_FFI_ICHECK_GE(page, 0) << "pagedkv: the plan of window " << p.window << " reads released page " << logical;
    return page;
  };
  for (PassPlan& pass : plan->passes) {
    for (int32_t& page : pass.page_values) page = phys(page);
  }
  int32_t ps = static_cast<int32_t>(page_size_);
  for (int32_t& slot : plan->append_slot) slot = phys(slot / ps) * ps + slot % ps;
}

}  // namespace pagedkv
