// PagedKVCache: the tvm-ffi object behind the `pagedkv.*` globals (docs/ARCHITECTURE.md, "Runtime").
// It owns the device pages, the BlockPool bookkeeping and the op table, and orchestrates attention as a
// sequence of kernel-ABI calls. Every public method validates all of its arguments and the cache state
// before changing anything, so a failed call leaves the cache as it was.
//
// It is also a TVM AttentionKVCache (src/tvm_kv_state.h): the `vm.builtin.kv_state_*` and
// `vm.builtin.attention_kv_cache_*` globals reach the same methods through the protocol's vtable, so the
// methods the protocol declares have its signatures (TVM's argument order). What pagedkv does not implement
// (checkpoints, disaggregation, linear / shared-KV attention, token trees other than chains, attention sinks)
// raises NotImplementedError "not supported by pagedkv: ..." (kv_state_protocol.cc).
#ifndef PAGEDKV_PAGED_KV_CACHE_H_
#define PAGEDKV_PAGED_KV_CACHE_H_

// first: it provides tvm::runtime::Tensor before TVM's headers would include theirs
#include "tvm_kv_state.h"

#include <tvm/ffi/container/map.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/object.h>
#include <tvm/ffi/optional.h>
#include <tvm/ffi/string.h>

#include <array>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "aux_builder.h"
#include "backend.h"
#include "block_pool.h"
#include "config.h"
#include "forward_plan.h"
#include "tensor_util.h"
#include "window_pools.h"

namespace pagedkv {

class PagedKVCacheObj : public tvm::runtime::vm::AttentionKVCacheObj {
 public:
  // The protocol's tensor type (ffi::Tensor: tvm_kv_state.h).
  using Tensor = tvm::runtime::Tensor;

  PagedKVCacheObj(KVConfig config, OpTable ops, DLDevice device);

  // Sequences (rejected while a forward is open: its index arrays point at the current pages).
  void AddSequence(int64_t seq_id) final;
  void RemoveSequence(int64_t seq_id) final;
  // fork_pos -1: the parent's whole length.
  void ForkSequence(int64_t parent_id, int64_t child_id, int64_t fork_pos = -1) final;
  // pagedkv.popn's (n of any size, checked); the protocol's int32 overload forwards to it.
  void PopN(int64_t seq_id, int64_t n);
  void PopN(int64_t seq_id, int32_t n) final { PopN(seq_id, static_cast<int64_t>(n)); }
  void Clear() final;
  bool Empty() const final { return pool_.sequences().empty(); }
  // The protocol's counts are int32: lossless, since CheckCapacity bounds the cache's token slots (and so
  // its pages and any total length) by INT32_MAX.
  int32_t GetSequenceLength(int64_t seq_id) const final;
  // The new pages the next change can still take: the free pages of the main pool, or with layer_groups the fewest
  // free of any pool, since every page the block tree takes is also taken in each window pool (window_pools.h).
  // So a forward (or mid-page fork / popn) of k new pages succeeds iff k <= this, whether or not any layer is full;
  // an engine admitting by it never over-admits (window pools get pages back after end_forward and remove).
  int32_t GetNumAvailablePages() const final;
  // Config layer_groups (schema 7): per page pool, [pages in all, pages free]: the main pool (logical pages; full
  // layers) first, then each window pool (window_pools.h) in ascending window order.
  ffi::Shape PoolPages() const;
  int32_t GetTotalSequenceLength() const final;

  // Throws the error begin_forward would for these sequences and append lengths (ids known and distinct,
  // lengths >= 1, enough free pages), without the per-forward limits (batch size, prefill_chunk_size) and
  // without changing anything: a caller that appends a prompt in several forwards checks it all first.
  void CheckAppend(const ffi::Shape& seq_ids, const ffi::Shape& append_lengths) const;

  // One forward. `token_tree_parent_ptr` (the protocol's speculative token trees): accepted when every
  // sequence's tree is a chain, which is an ordinary forward whose tokens CommitAcceptedTokenTreeNodes later
  // trims; other trees are refused. end_forward rejects a forward in which a layer wrote no k/v (FinishForward).
  void BeginForward(const ffi::Shape& seq_ids, const ffi::Shape& append_lengths,
                    const ffi::Optional<ffi::Shape>& token_tree_parent_ptr = std::nullopt) final;
  void EndForward() final { FinishForward(/*allow_unwritten=*/false); }
  // debug_end_forward_unwritten: keeps the tokens even where layers wrote no k/v, for tests and benchmarks
  // that reserve tokens and write their k/v with debug_set_kv afterwards.
  void DebugEndForwardUnwritten() { FinishForward(/*allow_unwritten=*/true); }
  // Abandons the open forward (if any): the tokens begin_forward appended are taken back, so the cache is as
  // it was before it. A no-op without an open forward, so an error handler may always call it.
  void AbortForward();
  // Keeps, of each sequence's uncommitted chain, the nodes up to leaf_indices[i] (-1: none); pops the rest.
  void CommitAcceptedTokenTreeNodes(const ffi::Shape& seq_ids, const ffi::Shape& leaf_indices) final;
  // pagedkv's window is the config's sliding_window (with its sink_size sink tokens), on for every sequence: a call
  // asking for exactly it is accepted as a no-op, any other is refused (kv_state_protocol.cc says why).
  void EnableSlidingWindowForSeq(int64_t seq_id, int32_t sliding_window_size, int32_t attn_sink_size) final;

  // Attention, in the protocol's argument order. `mask` must be absent (the protocol's builtin passes none).
  void AttentionWithFusedQKV(int64_t layer, Tensor qkv, ffi::Optional<Tensor> mask, Tensor o,
                             double sm_scale) final;
  void SelfAttention(int64_t layer, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, double sm_scale) final;
  void CrossAttention(int64_t layer, Tensor q, Tensor o, Tensor lse, double sm_scale) final;
  // Merges (o_b, lse_b) into (o_a, lse_a) in place; returns {o_a, lse_a}.
  ffi::Array<Tensor> MergeAttnOutputInplace(Tensor o_a, Tensor lse_a, Tensor o_b, Tensor lse_b) final;
  // The same two with learnable sinks (config attention_sinks; the pagedkv.*_sinks globals): sinks float32
  // [num_qo_heads], one more softmax logit per query head whose value is 0, merged once into the call's final
  // state. A model that merges self_attention with cross_attention gives them to cross_attention only (every
  // forward runs it).
  void AttentionWithFusedQKVSinks(int64_t layer, Tensor qkv, Tensor sinks, Tensor o, double sm_scale);
  void CrossAttentionSinks(int64_t layer, Tensor q, Tensor sinks, Tensor o, Tensor lse, double sm_scale);
  // MLA: writes the forward's latents kv[n, latent_dim] to the pages of `layer`.
  void AppendMLAKV(int64_t layer, Tensor kv) final;
  Tensor GetQueryPositions() final;
  // Throws ValueError naming the first element of `values` (int32 / int64, any device) outside [0, bound),
  // e.g. a token id outside the vocabulary, before a model's gather reads out of bounds with it.
  void CheckIndices(const ffi::Tensor& values, const std::string& name, int64_t bound,
                    const std::string& bound_name) const;

  // Refused parts of the protocol (kv_state_protocol.cc): each throws "not supported by pagedkv: <what>".
  ffi::String GetCheckpointMetadata(int64_t seq_id) const final;
  ffi::String GetLayoutHash() const final;
  void ExportPageGroup(int64_t seq_id, int64_t group_id, Tensor dst) final;
  void PrepareImport(int64_t seq_id, ffi::String metadata_json) final;
  void ImportPageGroup(int64_t seq_id, int64_t group_id, Tensor src) final;
  void FinishImport(int64_t seq_id) final;
  ffi::Shape DisaggPrepareRecv(int64_t seq_id, int length) final;
  void DisaggMarkSend(int64_t seq_id, int64_t begin, const ffi::Shape& compressed_remote_position_map,
                      int32_t recver_pe_offset) final;
  void AttentionWithSharedKV(int64_t source_layer, Tensor q, Tensor current_k, Tensor current_v, Tensor o,
                             double sm_scale) final;
  void LinearAttention(int64_t layer, Tensor q, Tensor k, Tensor v, double sm_scale) final;

  // Debugging and introspection.
  // Layout [num_layers, end - start, num_kv_heads, head_dim] (MLA: [num_layers, end - start, latent_dim]).
  void DebugGetKV(int64_t seq_id, int64_t start, int64_t end, Tensor k_out, Tensor v_out) final;
  void DebugSetKV(int64_t seq_id, int64_t start, Tensor k, Tensor v) final;
  void DebugGetKVMLA(int64_t seq_id, int64_t start, int64_t end, Tensor kv_out) final;
  void DebugSetMLAKV(int64_t seq_id, int64_t start, const ffi::Tensor& kv);
  void DebugPoisonPages(bool on);
  // The open forward's device index arrays by name (q_pos, ..., "pass<i>.page_values"): the CUDA-graph tests
  // check that their addresses and shapes depend on the batch size only.
  ffi::Map<ffi::String, ffi::Tensor> DebugForwardArrays() const;
  // Attention entry-point calls since creation: a replayed CUDA graph runs the kernels without them.
  int64_t DebugAttentionCalls() const { return attention_calls_; }
  std::string ConfigJSON() const { return ConfigToJSON(cfg_); }
  ffi::Map<ffi::String, ffi::String> OpBackends() const;

  static constexpr bool _type_mutable = true;
  // The key the `pagedkv.*` globals check (libraries compiled before the protocol keep calling them); the
  // parent's key, relax.vm.AttentionKVCache, is what the `vm.builtin.*` globals check.
  TVM_FFI_DECLARE_OBJECT_INFO_FINAL("pagedkv.PagedKVCache", PagedKVCacheObj,
                                    tvm::runtime::vm::AttentionKVCacheObj);

 private:
  // Device views of one pass's index arrays.
  struct PassViews {
    ffi::Tensor q_indptr, page_indptr, page_values, last_page_len, k_pos_offset;
    bool all_empty = true;
    bool one_query_per_entry = true;
    bool causal = false;  // PassPlan::causal
  };
  // The plan of one page pool's layers in the open forward (the main pool's, or a window pool's: window_pools.h).
  struct PoolForward {
    bool through = false;  // ForwardPlan::through: the passes cover the new tokens
    ffi::Tensor append_slot;
    std::vector<PassViews> passes;
  };
  // State of the open forward (begin_forward .. end_forward).
  struct Forward {
    bool is_decode = false;
    bool graph = false;    // a CUDA-graph decode (GraphDecode): replays run the kernels without our calls
    bool chains = false;   // begun with a token tree (all chains): FinishForward adds the tokens to chains_
    int64_t num_tokens = 0;
    std::vector<int64_t> seq_ids, lengths;  // as given to begin_forward, to take the tokens back
    std::vector<bool> written;              // per layer: the new tokens' k/v were written
    ffi::Tensor q_indptr, q_pos, prior_len;
    ffi::Tensor no_keys_indptr;  // [B+1] zeros: a ragged kv_indptr with no keys
    std::vector<PoolForward> pools;  // per page pool (KVConfig::pool_of): [0] the main pool
    ffi::Tensor q, k, v, o_tmp, lse_tmp, lse_own;  // [n, ...] views of the work buffers (MLA: no q, k, v)
    ffi::Tensor o_acc;  // [n, Hq, paged v dim] float32: the running merged state (partial_states_ only)
    // apply_rope of the rotating kernels: 1, or 2 for LongRoPE's long factors (config rope_long_after).
    int rope_set = 1;
  };

  // fns_.Alloc on the cache's device; an allocation failure is a MemoryError naming `what` and the sizes.
  ffi::Tensor AllocDevice(const std::vector<int64_t>& shape, DLDataType dtype, const char* what);
  void CheckNoForward(const char* what) const;
  // end_forward, or with `allow_unwritten` debug_end_forward_unwritten.
  void FinishForward(bool allow_unwritten);
  // begin_forward's token-tree rules (kv_state_protocol.cc): without a tree, no sequence may have an
  // uncommitted chain; with one, it has an entry per appended token and each sequence's is a chain.
  void CheckTokenTree(const std::vector<int64_t>& ids, const std::vector<int64_t>& lengths,
                      const ffi::Optional<ffi::Shape>& tree) const;
  // Throws naming `what` while `seq_id` has an uncommitted token chain.
  void CheckNoChain(const char* what, int64_t seq_id) const;
  const Forward& CheckForward(const char* what) const;
  void CheckLayer(int64_t layer) const;
  void CheckKind(const char* what, bool mla) const;
  std::vector<int64_t> QShape(int64_t n) const { return {n, cfg_.num_qo_heads, cfg_.head_dim}; }
  std::vector<int64_t> KVShape(int64_t n) const { return {n, cfg_.num_kv_heads, cfg_.head_dim}; }
  // One page of one layer: MHA [2 (K, V), Hkv, ps, D]; MLA [1, 1, ps, latent_dim] (V = the latent's
  // first kv_lora_rank elements).
  std::vector<int64_t> PageShape() const;
  // Query dim and output dim of the paged (cross) attention: MHA (D, D); MLA (latent_dim, kv_lora_rank).
  int64_t PagedQDim() const { return cfg_.is_mla() ? cfg_.latent_dim() : cfg_.head_dim; }
  int64_t PagedVDim() const { return cfg_.is_mla() ? cfg_.kv_lora_rank : cfg_.head_dim; }
  // Whether a forward of these append lengths is a CUDA-graph decode (config cuda_graph_batch, all 1).
  bool GraphDecode(const std::vector<int64_t>& lengths) const;
  // The plans of a forward: the main pool's, then each window pool's (flat, its pages).
  std::vector<ForwardPlan> BuildPlans(const std::vector<int64_t>& ids, const std::vector<int64_t>& lengths,
                                      bool graph) const;
  void UploadPlan(const std::vector<ForwardPlan>& plans);
  void UploadGraphPlan(const ForwardPlan& plan);
  // `handles[pool]`: the append_slot handle, then five per pass.
  void OpenForward(const std::vector<ForwardPlan>& plans, const AuxBuilder& aux,
                   const std::vector<std::vector<int>>& handles);
  void NotifyBeginForward(const std::vector<ForwardPlan>& plans);
  // The open forward's plan of `layer`'s page pool.
  const PoolForward& PlanOf(int64_t layer) const { return forward_->pools[cfg_.pool_of(layer)]; }
  // debug_forward_arrays' entries of one pool's passes ("<prefix>pass<i>.<array>").
  static void AddPassArrays(const std::vector<PassViews>& passes, const std::string& prefix,
                            ffi::Map<ffi::String, ffi::Tensor>* out);
  // The op table serving `layer`'s attention ops: its window's sub-table (layer groups), else the cache's.
  const OpTable& AttnOps(int64_t layer) const;
  // After every change to the block tree: maps its new pages in the window pools (and poisons them in debug mode),
  // runs `copy` in every layer, then frees the window pools' pages of the pages the tree freed.
  void AfterPoolChange(const std::optional<PageCopy>& copy);
  // Throws (naming the group) unless every window pool has the `pages` a change takes and keeps the tokens before
  // `pos` of `seq_id` that its window reads (a fork's child or a popn's new end continues there).
  void CheckWindows(int64_t seq_id, int64_t pos, int64_t pages, const std::string& what) const;
  // Pops the tokens a forward appended (they sit in each sequence's own leaf: no page is copied).
  void TakeBack(const std::vector<int64_t>& ids, const std::vector<int64_t>& lengths);
  // Layers whose k/v the open forward has not written.
  std::vector<int64_t> UnwrittenLayers() const;
  void RunCopy(const std::optional<PageCopy>& copy);
  // One pass (`partial`: its op's partial-state variant, o float32).
  void RunPass(int64_t layer, const PassViews& pass, const ffi::Tensor& q, const ffi::Tensor& o,
               const ffi::Tensor& lse, double sm_scale, bool partial);
  // One attention of the open forward into (o, lse): the ragged pass over the new tokens when `ragged` (a split
  // forward's attention_with_fused_qkv), then every paged pass; RunPartialStates or RunPasses merges them, and
  // the sinks (when given) are merged into the final state once.
  void RunAttention(int64_t layer, const ffi::Tensor& q, const ffi::Tensor& o, const ffi::Tensor& lse,
                    double sm_scale, bool ragged, const ffi::Tensor* sinks);
  void RunPartialStates(int64_t layer, const ffi::Tensor& q, const ffi::Tensor& o, const ffi::Tensor& lse,
                        double sm_scale, bool ragged, int states, const ffi::Tensor* sinks);
  // Throws naming `what` unless this cache takes sinks (config attention_sinks) and `sinks` is float32
  // [num_qo_heads] on its device.
  void CheckSinks(const char* what, const ffi::Tensor& sinks) const;
  // attention_with_fused_qkv and cross_attention, with or without sinks (nullptr).
  void FusedAttention(int64_t layer, const Tensor& qkv, const ffi::Optional<Tensor>& mask, const Tensor& o,
                      double sm_scale, const Tensor* sinks);
  void PagedAttention(int64_t layer, const Tensor& q, const Tensor& o, const Tensor& lse, double sm_scale,
                      const Tensor* sinks);
  void RunPasses(int64_t layer, const ffi::Tensor& q, const ffi::Tensor& o, const ffi::Tensor& lse,
                 double sm_scale, bool output_written);
  void RunRagged(int64_t layer, const ffi::Tensor& q, const ffi::Tensor& k, const ffi::Tensor& v, const ffi::Tensor& o,
                 const ffi::Tensor& lse, double sm_scale, bool partial);
  // Throws ValueError naming `what` unless [start, start + count) lies inside the sequence.
  void CheckDebugRange(const char* what, int64_t seq_id, int64_t start, int64_t count) const;
  // Slot maps of tokens [start, start + count) of `seq_id`, one per page pool (window pools: their pages; throws
  // naming `what` and the group when a token was given back).
  std::vector<ffi::Tensor> SlotsOnDevice(int64_t seq_id, int64_t start, int64_t count, const char* what);
  // Poisons page `page` of every layer of page pool `pool`.
  void PoisonPage(int pool, int32_t page);
  void PoisonTemps();
  // apply_rope of the attention kernels (the open forward's rope_set with inline RoPE, else 0).
  int apply_rope_inline() const { return cfg_.rope_mode == "inline" ? forward_->rope_set : 0; }

  KVConfig cfg_;
  OpTable ops_;
  DLDevice device_;
  DLDataType dtype_;
  TensorFns fns_;
  BlockPool pool_;
  WindowPools windows_;  // the sliding layer groups' page pools (none without layer_groups)
  std::vector<ffi::Tensor> pages_;  // per layer [P, ...PageShape()]; P of its page pool
  ffi::Tensor q_buf_, k_buf_, v_buf_, o_tmp_buf_, lse_tmp_buf_, lse_own_buf_;  // chunk-sized work buffers
  // An fp16 / bf16 cache whose op table holds the float32 partial-state ops of its kind (ops::kPartialMHAOps /
  // MLA): multi-pass attention keeps every pass's output and the running merge in float32 (o_tmp_buf_ is float32
  // then, and o_acc_buf_ holds the running state) and rounds to the storage dtype once. Else (libraries compiled
  // before those ops, float32 caches) passes write the storage dtype and merge_state merges in place.
  bool partial_states_ = false;
  ffi::Tensor o_acc_buf_;
  AuxBuilder aux_;
  std::unique_ptr<AuxBuilder> debug_aux_;  // slot maps of debug_get_kv / debug_set_kv
  std::unique_ptr<AuxBuilder> graph_aux_;  // CUDA-graph decode forwards (UploadGraphPlan), fixed at creation
  std::optional<Forward> forward_;
  std::map<std::string, ffi::Tensor> backend_scratch_;  // ForwardInfo::scratch: buffers adapters share
  bool poison_ = false;
  bool pdl_ = false;  // ForwardInfo::pdl, asked of the device once at creation
  int64_t attention_calls_ = 0;  // DebugAttentionCalls
  // Sequence id -> tokens of its uncommitted token chain: appended by forwards begun with a token tree, trimmed
  // by CommitAcceptedTokenTreeNodes (TVM's speculative-decoding protocol; pagedkv takes chains only).
  std::map<int64_t, int64_t> chains_;
};

class PagedKVCache : public ffi::ObjectRef {
 public:
  TVM_FFI_DEFINE_OBJECT_REF_METHODS_NULLABLE(PagedKVCache, ffi::ObjectRef, PagedKVCacheObj);
};

// page_values room of a CUDA-graph decode forward of `batch` sequences: every page of each (b * num_pages).
int64_t GraphPageValues(const KVConfig& c, int64_t batch);

// `pagedkv.create`: parses the config and op table, allocates pages on device_ref's device.
PagedKVCache CreatePagedKVCache(const std::string& config_json, const ffi::Shape& runtime_values,
                                const ffi::Array<ffi::Any>& op_table, const ffi::Tensor& device_ref);

}  // namespace pagedkv

#endif  // PAGEDKV_PAGED_KV_CACHE_H_
