// PagedKVCache as a TVM AttentionKVCache (src/tvm_kv_state.h): the parts of the protocol that have no
// `pagedkv.*` counterpart. Token chains (the speculative-decoding trees that are chains) and the config's
// sliding window map onto the cache; what does not map throws NotImplementedError "not supported by pagedkv:
// <what> (<method>)", before anything changes, so an engine learns which feature it asked for and the cache
// stays usable.
#include <tvm/ffi/error.h>

#include <set>
#include <string>

#include "paged_kv_cache.h"

namespace pagedkv {

namespace {

[[noreturn]] void Unsupported(const char* method, const std::string& what) {
  TVM_FFI_THROW(NotImplementedError) << "not supported by pagedkv: " << what << " (" << method << ")";
}

constexpr const char* kCheckpoints = "KV checkpoint export / import";
constexpr const char* kDisagg = "disaggregated prefill / decode (KV transfer between engines)";

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Token chains. TVM's BeginForward may take each sequence's token tree (parent of every appended node,
// indices into the sequence's uncommitted tree, -1 for a root). A chain (every node's parent is the node
// before it) is an ordinary forward: its positions are the tokens' positions and its attention is causal. The
// verified prefix is kept by CommitAcceptedTokenTreeNodes, which for a chain is a pop of the rest.

void PagedKVCacheObj::CheckNoChain(const char* what, int64_t seq_id) const {
  auto chain = chains_.find(seq_id);
  if (chain == chains_.end()) return;
  TVM_FFI_THROW(RuntimeError) << "pagedkv: " << what << ": sequence " << seq_id << " has an uncommitted token "
                              << "chain of " << chain->second << " tokens; call CommitAcceptedTokenTreeNodes "
                              << "(vm.builtin.attention_kv_cache_commit_accepted_token_tree_nodes) first";
}

void PagedKVCacheObj::CheckTokenTree(const std::vector<int64_t>& ids, const std::vector<int64_t>& lengths,
                                     const ffi::Optional<ffi::Shape>& tree) const {
  if (!tree.has_value()) {
    for (int64_t id : ids) CheckNoChain("begin_forward without a token tree", id);
    return;
  }
  const ffi::Shape& parents = *tree;
  int64_t total = 0;
  for (int64_t l : lengths) total += l;  // CheckAppend bounded each length
  if (static_cast<int64_t>(parents.size()) != total) {
    TVM_FFI_THROW(ValueError) << "pagedkv: begin_forward: token_tree_parent_ptr has " << parents.size()
                              << " entries; expected one per appended token (the sum of append_lengths, "
                              << total << ")";
  }
  int64_t offset = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    auto chain = chains_.find(ids[i]);
    int64_t before = chain == chains_.end() ? 0 : chain->second;  // nodes of the tree already appended
    for (int64_t j = 0; j < lengths[i]; ++j) {
      int64_t node = before + j, parent = parents[offset + j];
      if (parent < -1 || parent >= node) {
        TVM_FFI_THROW(ValueError) << "pagedkv: begin_forward: invalid token tree of sequence " << ids[i]
                                  << ": node " << node << " has parent " << parent << ", outside [-1, " << node
                                  << ")";
      }
      if (parent != node - 1) {
        Unsupported("BeginForward", "tree attention: the token tree of sequence " + std::to_string(ids[i]) +
                                        " is not a chain (node " + std::to_string(node) + "'s parent is " +
                                        std::to_string(parent) + ", not " + std::to_string(node - 1) +
                                        "); pagedkv takes token trees that are chains only");
      }
    }
    offset += lengths[i];
  }
}

void PagedKVCacheObj::CommitAcceptedTokenTreeNodes(const ffi::Shape& seq_ids, const ffi::Shape& leaf_indices) {
  CheckNoForward("commit_accepted_token_tree_nodes");
  if (seq_ids.size() != leaf_indices.size()) {
    TVM_FFI_THROW(ValueError) << "pagedkv: commit_accepted_token_tree_nodes: " << seq_ids.size()
                              << " sequence ids but " << leaf_indices.size() << " leaf indices";
  }
  std::set<int64_t> seen;
  for (size_t i = 0; i < seq_ids.size(); ++i) {
    int64_t id = seq_ids[i], leaf = leaf_indices[i];
    pool_.Get(id);  // throws naming an unknown id
    if (!seen.insert(id).second) {
      TVM_FFI_THROW(ValueError) << "pagedkv: commit_accepted_token_tree_nodes: sequence " << id << " is given twice";
    }
    auto chain = chains_.find(id);
    if (chain == chains_.end()) {
      TVM_FFI_THROW(ValueError) << "pagedkv: commit_accepted_token_tree_nodes: sequence " << id << " has no "
                                << "uncommitted token tree (begin_forward was not given one since its last commit)";
    }
    if (leaf < -1 || leaf >= chain->second) {
      TVM_FFI_THROW(ValueError) << "pagedkv: commit_accepted_token_tree_nodes: leaf index " << leaf << " of sequence "
                                << id << " is outside [-1, " << chain->second << ") (its uncommitted chain's nodes)";
    }
  }
  // The chains' tokens are in each sequence's own leaf block (forks of a sequence with a chain are refused),
  // so these pops cannot fail.
  for (size_t i = 0; i < seq_ids.size(); ++i) {
    int64_t id = seq_ids[i];
    PopN(id, chains_.at(id) - (leaf_indices[i] + 1));
    chains_.erase(id);
  }
  windows_.Trim(pool_, chains_);  // the committed tokens' windows no longer reach behind the chains
}

// ---------------------------------------------------------------------------------------------------
// Sliding window. TVM's is per sequence, enabled by the engine, and slides: once a sequence is longer than the
// window, its tokens past the attention sink are evicted from the cache. pagedkv's is the config's
// sliding_window, compiled into the kernels and on for every sequence: each query sees the sliding_window most
// recent positions (Mistral's and HF's definition) and no token is evicted. An engine asking for exactly that
// window without a sink gets the model's attention (the call is a no-op); anything else is refused.

void PagedKVCacheObj::EnableSlidingWindowForSeq(int64_t seq_id, int32_t sliding_window_size,
                                                int32_t attn_sink_size) {
  pool_.Get(seq_id);  // throws naming an unknown id
  std::string asked = "a sliding window of " + std::to_string(sliding_window_size) + " with an attention sink of " +
                      std::to_string(attn_sink_size);
  if (!cfg_.windowed()) {
    Unsupported("EnableSlidingWindowForSeq", "per-sequence sliding windows (" + asked + "): this cache has none " +
                                                 "(a pagedkv window is the config's sliding_window, compiled in)");
  }
  if (attn_sink_size != cfg_.sink_size) {  // the config's sink tokens (sink_size), like its window, are compiled in
    Unsupported("EnableSlidingWindowForSeq", "attention sinks (" + asked + "): pagedkv's window keeps " +
                                                 (cfg_.sink_size ? "the config's sink_size=" +
                                                  std::to_string(cfg_.sink_size) + " tokens" : "no sink"));
  }
  if (sliding_window_size != cfg_.sliding_window) {
    Unsupported("EnableSlidingWindowForSeq", "a sliding window of " + std::to_string(sliding_window_size) +
                                                 " on a cache compiled with sliding_window=" +
                                                 std::to_string(cfg_.sliding_window));
  }
}

// ---------------------------------------------------------------------------------------------------
// Refused: checkpoints, disaggregation, attention kinds pagedkv has no kernels for.

ffi::String PagedKVCacheObj::GetCheckpointMetadata(int64_t) const {
  Unsupported("GetCheckpointMetadata", kCheckpoints);
}

ffi::String PagedKVCacheObj::GetLayoutHash() const { Unsupported("GetLayoutHash", kCheckpoints); }

void PagedKVCacheObj::ExportPageGroup(int64_t, int64_t, Tensor) { Unsupported("ExportPageGroup", kCheckpoints); }

void PagedKVCacheObj::PrepareImport(int64_t, ffi::String) { Unsupported("PrepareImport", kCheckpoints); }

void PagedKVCacheObj::ImportPageGroup(int64_t, int64_t, Tensor) { Unsupported("ImportPageGroup", kCheckpoints); }

void PagedKVCacheObj::FinishImport(int64_t) { Unsupported("FinishImport", kCheckpoints); }

ffi::Shape PagedKVCacheObj::DisaggPrepareRecv(int64_t, int) { Unsupported("DisaggPrepareRecv", kDisagg); }

void PagedKVCacheObj::DisaggMarkSend(int64_t, int64_t, const ffi::Shape&, int32_t) {
  Unsupported("DisaggMarkSend", kDisagg);
}

void PagedKVCacheObj::AttentionWithSharedKV(int64_t, Tensor, Tensor, Tensor, Tensor, double) {
  Unsupported("AttentionWithSharedKV", "attention with K/V shared across layers");
}

void PagedKVCacheObj::LinearAttention(int64_t, Tensor, Tensor, Tensor, double) {
  Unsupported("LinearAttention", "linear attention");
}

}  // namespace pagedkv
