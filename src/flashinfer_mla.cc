// mla_attn_decode_paged / mla_attn_prefill_paged on FlashInfer's MLA module.
// Design, FlashInfer facts and workspace ownership: src/flashinfer_adapter.cc.
#include <type_traits>

#include "flashinfer_common.h"

namespace pagedkv {
namespace fi {
namespace {

// ---------------------------------------------------------------------------------------------------------
// mla_attn_decode_paged / mla_attn_prefill_paged on FlashInfer's MLA module (fa2).
//
// pages[P, 1, 1, ps, DL] hold [ckv | kpe] per token (DL = kv_lora_rank + rope); FlashInfer takes ckv and
// kpe as separate [P, ps, *] tensors and reads their strides (batch_mla_run.cu: ckv_stride_page,
// ckv_stride_n, ...), so they are two strided views of the same pages: ckv at element 0 and kpe at element
// kv_lora_rank of each row, both with strides (ps * DL, DL, 1). q[n, H, DL] is split the same way.
class MLAAdapter : public FlashInferAdapter {
 public:
  MLAAdapter(bool decode, ffi::Function e, ffi::Function plan, ffi::Function run)
      : FlashInferAdapter(decode ? ops::kMLAAttnDecodePaged : ops::kMLAAttnPrefillPaged, std::move(e),
                          std::move(plan), std::move(run)),
        decode_(decode) {}

  void BeginForward(const ForwardInfo& info) final {
    plans_.Clear();
    const KVConfig& c = *info.config;
    const ForwardPlan& fp = *info.plan;
    for (size_t i = 0; i < info.passes.size(); ++i) {
      const ForwardInfo::Pass& pass = info.passes[i];
      bool decode_pass = fp.is_decode && pass.host->one_query_per_entry;  // src/attention.cc RunPass
      if (decode_pass != decode_) continue;
      std::vector<int32_t> kv_lens = PagedKvLens(*pass.host, c.page_size);
      Planned p = EmptyFlags(kv_lens, i, false);
      if (!p.all_empty) {
        ws_.Attach(info);
        CheckWorkItems(pass.host->q_indptr, c.num_qo_heads);
        namespace a = abi::mla_plan;
        const Workspaces::Int& iws = ws_.Slot(i);
        HostInt32 qo(pass.host->q_indptr), kv(pass.host->page_indptr), lens(kv_lens);
        ArgPack<a::kNumArgs> args;
        args.Set(a::kFloatWorkspaceBuffer, ws_.float_ws());
        args.Set(a::kIntWorkspaceBuffer, iws.device);
        args.Set(a::kPageLockedIntWorkspaceBuffer, iws.pinned);
        args.Set(a::kQoIndptr, qo.get());
        args.Set(a::kKvIndptr, kv.get());  // page indptr (flashinfer's MLA wrapper checks pages = ceil(len / ps))
        args.Set(a::kKvLen, lens.get());
        args.Set(a::kNumHeads, c.num_qo_heads);
        args.Set(a::kHeadDimO, c.kv_lora_rank);
        args.Set(a::kCausal, false);
        auto result = args.Call(plan_, "MLA plan").cast<ffi::Array<ffi::Any>>();
        if (result.size() != 2) TVM_FFI_THROW(RuntimeError) << "pagedkv flashinfer: MLA plan returned " << result.size() << " values";
        p.info = result[0].cast<ffi::Array<int64_t>>();
        ws_.StageToDevice(iws, result[1].cast<int64_t>());
      }
      plans_.Put(ViewKey(pass.page_indptr), std::move(p));
    }
  }

  void Run(ffi::PackedArgs in) final {
    if (decode_) {
      RunAs<ops::MLAAttnDecodePaged>(in);
    } else {
      RunAs<ops::MLAAttnPrefillPaged>(in);
    }
  }

 private:
  // K: the op's argument struct (src/ops.h); decode and prefill share every argument but `causal`.
  template <typename K>
  void RunAs(ffi::PackedArgs in) {
    CheckArgCount(in, K::kNumArgs, op_);
    const Planned& p = plans_.Find(ViewKey(in[K::kPageIndptr]), op_);
    if constexpr (std::is_same_v<K, ops::MLAAttnPrefillPaged>) CheckCausal(p, in[K::kCausal].template cast<int64_t>(), op_);
    double sm_scale = in[K::kSmScale].template cast<double>();
    const DLTensor& pages = *in[K::kPages].template cast<DLTensor*>();
    const DLTensor& q = *in[K::kQ].template cast<DLTensor*>();
    int64_t np = pages.shape[0], ps = pages.shape[3], dl = pages.shape[4];
    int64_t r = in[K::kO].template cast<DLTensor*>()->shape[2], rope = dl - r;  // o[n, H, kv_lora_rank]
    int64_t n = q.shape[0], h = q.shape[1];
    StridedView q_nope(q, {n, h, r}, {h * dl, dl, 1}, 0), q_pe(q, {n, h, rope}, {h * dl, dl, 1}, r);
    StridedView ckv(pages, {np, ps, r}, {ps * dl, dl, 1}, 0), kpe(pages, {np, ps, rope}, {ps * dl, dl, 1}, r);
    Flat indices(in[K::kPageValues]), o(in[K::kO]), lse(in[K::kLse]);
    namespace a = abi::mla_run;
    ArgPack<a::kNumArgs> args;
    if (!p.all_empty) {
      args.Set(a::kFloatWorkspaceBuffer, ws_.float_ws());
      args.Set(a::kIntWorkspaceBuffer, ws_.Slot(p.slot).device);
      args.Set(a::kPlanInfoVec, p.info);
      args.Set(a::kQNope, q_nope.get());
      args.Set(a::kQPe, q_pe.get());
      args.Set(a::kCkvCache, ckv.get());
      args.Set(a::kKpeCache, kpe.get());
      args.Set(a::kKvIndices, indices.get());
      args.Set(a::kO, o.get());
      args.Set(a::kMaybeLse, lse.get());
      args.Set(a::kMaskModeCode, kMaskNone);
      args.Set(a::kNumHeads, h);
      args.Set(a::kPageSize, ps);
      args.Set(a::kSmScale, sm_scale);
      args.Set(a::kReturnLseBaseOnE, false);  // base 2, pagedkv's convention
      args.Set(a::kCkvScale, 1.0);
      args.Set(a::kKpeScale, 1.0);
      args.SetNone(a::kMaybeCkvScaleArr);
    }
    RunPlanned(p, &args, in[K::kO], in[K::kLse]);
  }

  // MLAPlan writes at most kMLAMaxWorks work items (its int workspace arrays have that many slots): a query
  // tile of 64 packed rows (or 128) per work item, plus at most one KV split per cluster.
  void CheckWorkItems(const std::vector<int32_t>& qo_indptr, int64_t heads) const {
    int64_t tiles = 0;
    for (size_t e = 0; e + 1 < qo_indptr.size(); ++e) tiles += ((qo_indptr[e + 1] - qo_indptr[e]) * heads + 63) / 64;
    if (tiles + kMLAMaxSplits > kMLAMaxWorks) {
      TVM_FFI_THROW(ValueError) << "pagedkv flashinfer: " << op_ << " pass needs up to " << tiles + kMLAMaxSplits
                                << " MLA work items, more than FlashInfer's " << kMLAMaxWorks
                                << " (fewer tokens per forward: lower prefill_chunk_size)";
    }
  }

  bool decode_;
};

}  // namespace

std::unique_ptr<OpAdapter> MakeMLAAdapter(bool decode, ffi::Function empty_rows, ffi::Function plan,
                                          ffi::Function run) {
  return std::make_unique<MLAAdapter>(decode, std::move(empty_rows), std::move(plan), std::move(run));
}

}  // namespace fi
}  // namespace pagedkv
