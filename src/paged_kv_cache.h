// PagedKVCache: the tvm-ffi object behind the `pagedkv.*` globals (docs/ARCHITECTURE.md, "Runtime").
// It owns the device pages, the BlockPool bookkeeping and the op table, and orchestrates attention as a
// sequence of kernel-ABI calls. Every public method validates all of its arguments and the cache state
// before changing anything, so a failed call leaves the cache as it was.
#ifndef PAGEDKV_PAGED_KV_CACHE_H_
#define PAGEDKV_PAGED_KV_CACHE_H_

#include <tvm/ffi/container/map.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/object.h>
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

namespace pagedkv {

class PagedKVCacheObj : public ffi::Object {
 public:
  PagedKVCacheObj(KVConfig config, OpTable ops, DLDevice device);

  // Sequences (rejected while a forward is open: its index arrays point at the current pages).
  void AddSequence(int64_t seq_id);
  void RemoveSequence(int64_t seq_id);
  void ForkSequence(int64_t parent_id, int64_t child_id, int64_t fork_pos);
  void PopN(int64_t seq_id, int64_t n);
  void Clear();
  int64_t GetSequenceLength(int64_t seq_id) const { return pool_.Get(seq_id).length; }
  int64_t GetNumAvailablePages() const { return pool_.NumFreePages(); }
  int64_t GetTotalSequenceLength() const { return pool_.TotalLength(); }

  // Throws the error begin_forward would for these sequences and append lengths (ids known and distinct,
  // lengths >= 1, enough free pages), without the per-forward limits (batch size, prefill_chunk_size) and
  // without changing anything: a caller that appends a prompt in several forwards checks it all first.
  void CheckAppend(const ffi::Shape& seq_ids, const ffi::Shape& append_lengths) const;

  // One forward. end_forward rejects a forward in which a layer wrote no k/v (see EndForward).
  void BeginForward(const ffi::Shape& seq_ids, const ffi::Shape& append_lengths);
  // `allow_unwritten` (debug_end_forward_unwritten): keep the tokens even where layers wrote no k/v, for
  // tests and benchmarks that reserve tokens and write their k/v with debug_set_kv afterwards.
  void EndForward(bool allow_unwritten = false);
  // Abandons the open forward (if any): the tokens begin_forward appended are taken back, so the cache is as
  // it was before it. A no-op without an open forward, so an error handler may always call it.
  void AbortForward();
  // `sinks` (config attention_sinks): float32 [num_qo_heads], one more softmax logit per query head whose value
  // is 0, merged once into the call's final state (a model that merges self_attention with cross_attention
  // gives them to cross_attention only, which every forward runs).
  void AttentionWithFusedQKV(int64_t layer, double sm_scale, const ffi::Tensor& qkv, const ffi::Tensor& o,
                             const std::optional<ffi::Tensor>& sinks = std::nullopt);
  void SelfAttention(int64_t layer, double sm_scale, const ffi::Tensor& q, const ffi::Tensor& k,
                     const ffi::Tensor& v, const ffi::Tensor& o, const ffi::Tensor& lse);
  void CrossAttention(int64_t layer, double sm_scale, const ffi::Tensor& q, const ffi::Tensor& o,
                      const ffi::Tensor& lse, const std::optional<ffi::Tensor>& sinks = std::nullopt);
  void MergeAttnOutputInplace(const ffi::Tensor& o_a, const ffi::Tensor& lse_a, const ffi::Tensor& o_b,
                              const ffi::Tensor& lse_b);
  // MLA: writes the forward's latents kv[n, latent_dim] to the pages of `layer`.
  void AppendMLAKV(int64_t layer, const ffi::Tensor& kv);
  ffi::Tensor GetQueryPositions() const;
  // Throws ValueError naming the first element of `values` (int32 / int64, any device) outside [0, bound),
  // e.g. a token id outside the vocabulary, before a model's gather reads out of bounds with it.
  void CheckIndices(const ffi::Tensor& values, const std::string& name, int64_t bound,
                    const std::string& bound_name) const;

  // Debugging and introspection.
  void DebugGetKV(int64_t seq_id, int64_t start, int64_t end, const ffi::Tensor& k_out,
                  const ffi::Tensor& v_out);
  void DebugSetKV(int64_t seq_id, int64_t start, const ffi::Tensor& k, const ffi::Tensor& v);
  void DebugGetMLAKV(int64_t seq_id, int64_t start, int64_t end, const ffi::Tensor& kv_out);
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
  TVM_FFI_DECLARE_OBJECT_INFO_FINAL("pagedkv.PagedKVCache", PagedKVCacheObj, ffi::Object);

 private:
  // Device views of one pass's index arrays.
  struct PassViews {
    ffi::Tensor q_indptr, page_indptr, page_values, last_page_len, k_pos_offset;
    bool all_empty = true;
    bool one_query_per_entry = true;
    bool causal = false;  // PassPlan::causal
  };
  // State of the open forward (begin_forward .. end_forward).
  struct Forward {
    bool is_decode = false;
    bool through = false;  // ForwardPlan::through: the passes cover the new tokens
    bool graph = false;    // a CUDA-graph decode (GraphDecode): replays run the kernels without our calls
    int64_t num_tokens = 0;
    std::vector<int64_t> seq_ids, lengths;  // as given to begin_forward, to take the tokens back
    std::vector<bool> written;              // per layer: the new tokens' k/v were written
    ffi::Tensor q_indptr, q_pos, append_slot, prior_len;
    ffi::Tensor no_keys_indptr;  // [B+1] zeros: a ragged kv_indptr with no keys
    std::vector<PassViews> passes;
    ffi::Tensor q, k, v, o_tmp, lse_tmp, lse_own;  // [n, ...] views of the work buffers (MLA: no q, k, v)
    ffi::Tensor o_acc;  // [n, Hq, paged v dim] float32: the running merged state (partial_states_ only)
  };

  // fns_.Alloc on the cache's device; an allocation failure is a MemoryError naming `what` and the sizes.
  ffi::Tensor AllocDevice(const std::vector<int64_t>& shape, DLDataType dtype, const char* what);
  void CheckNoForward(const char* what) const;
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
  void UploadPlan(const ForwardPlan& plan);
  void UploadGraphPlan(const ForwardPlan& plan);
  void OpenForward(const ForwardPlan& plan, const AuxBuilder& aux,
                   const std::vector<std::array<int, 5>>& pass_handles);
  void NotifyBeginForward(const ForwardPlan& plan);
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
  void RunPasses(int64_t layer, const ffi::Tensor& q, const ffi::Tensor& o, const ffi::Tensor& lse,
                 double sm_scale, bool output_written);
  void RunRagged(const ffi::Tensor& q, const ffi::Tensor& k, const ffi::Tensor& v, const ffi::Tensor& o,
                 const ffi::Tensor& lse, double sm_scale, bool partial);
  // Throws ValueError naming `what` unless [start, start + count) lies inside the sequence.
  void CheckDebugRange(const char* what, int64_t seq_id, int64_t start, int64_t count) const;
  ffi::Tensor SlotsOnDevice(int64_t seq_id, int64_t start, int64_t count);
  void PoisonNewPages();
  void PoisonPage(int32_t page);
  void PoisonTemps();
  int apply_rope_inline() const { return cfg_.rope_mode == "inline" ? 1 : 0; }

  KVConfig cfg_;
  OpTable ops_;
  DLDevice device_;
  DLDataType dtype_;
  TensorFns fns_;
  BlockPool pool_;
  std::vector<ffi::Tensor> pages_;  // per layer [P, ...PageShape()]
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
