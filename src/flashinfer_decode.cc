// attn_decode_paged on FlashInfer's batch decode module.
// Design, FlashInfer facts and workspace ownership: src/flashinfer_adapter.cc.
#include "flashinfer_common.h"

namespace pagedkv {
namespace fi {
namespace {

// ---------------------------------------------------------------------------------------------------------
// attn_decode_paged on FlashInfer's batch decode.
class DecodeAdapter : public FlashInferAdapter {
 public:
  DecodeAdapter(ffi::Function e, ffi::Function plan, ffi::Function run)
      : FlashInferAdapter(ops::kAttnDecodePaged, std::move(e), std::move(plan), std::move(run)) {}

  void BeginForward(const ForwardInfo& info) final {
    plans_.Clear();
    if (!info.plan->is_decode) return;
    ReadOptions(info);
    const KVConfig& c = *info.config;
    ws_.Attach(info);
    // pagedkv: angle = p * rope_scale / theta^(2i/D); flashinfer: p * rope_rcp_scale * rope_rcp_theta^(2i/D).
    // (flashinfer's own names a divisor "rope_scale"; pagedkv's rope_scale multiplies.)
    rope_rcp_scale_ = c.rope_scale;
    rope_rcp_theta_ = 1.0 / c.rope_theta;
    // dtype carriers (flashinfer dispatches on their dtype only)
    int64_t zero = 0, one = 1;
    DLTensor empty{};
    empty.device = info.device;
    empty.ndim = 1;
    empty.shape = &zero;
    empty.strides = &one;
    empty.dtype = c.dl_dtype();
    for (size_t i = 0; i < info.passes.size(); ++i) {
      const ForwardInfo::Pass& p = info.passes[i];
      if (!p.host->one_query_per_entry) continue;  // the runtime sends those to attn_prefill_paged
      Planned planned = EmptyFlags(PagedKvLens(*p.host, c.page_size), i, false);
      if (!planned.all_empty) {
        namespace a = abi::decode_plan;
        HostInt32 indptr(p.host->page_indptr);
        const Workspaces::Int& iws = ws_.Slot(i);
        ArgPack<a::kNumArgs> args;
        args.Set(a::kFloatWorkspaceBuffer, ws_.float_ws());
        args.Set(a::kIntWorkspaceBuffer, iws.device);
        args.Set(a::kPageLockedIntWorkspaceBuffer, iws.pinned);
        args.Set(a::kIndptr, indptr.get());
        args.Set(a::kBatchSize, p.host->num_entries());
        args.Set(a::kNumQoHeads, c.num_qo_heads);
        args.Set(a::kNumKvHeads, c.num_kv_heads);
        args.Set(a::kPageSize, c.page_size);
        args.Set(a::kEnableCudaGraph, info.cuda_graph);
        args.Set(a::kWindowLeft, window_left_);
        args.Set(a::kLogitsSoftCap, logits_soft_cap_);
        args.Set(a::kHeadDimQk, c.head_dim);
        args.Set(a::kHeadDimVo, c.v_head_dim);
        args.Set(a::kEmptyQData, &empty);
        args.Set(a::kEmptyKvData, &empty);
        planned.info = args.Call(plan_, "decode plan").cast<ffi::Array<int64_t>>();
        CheckGraphPlan(info, i, p.host->num_entries(), planned.info);
      }
      plans_.Put(ViewKey(p.page_indptr), std::move(planned));
    }
  }

  void Run(ffi::PackedArgs in) final {
    using K = ops::AttnDecodePaged;  // the kernel ABI's argument positions
    CheckArgCount(in, K::kNumArgs, op_);
    CheckNoInlineRope(in[K::kApplyRope].cast<int64_t>(), op_);
    const Planned& p = plans_.Find(ViewKey(in[K::kPageIndptr]), op_);
    const DLTensor& pages = *in[K::kPages].cast<DLTensor*>();
    int64_t np = pages.shape[0], h = pages.shape[2], s = pages.shape[3], d = pages.shape[4];
    // K and V of pages[P, 2, Hkv, ps, D] as strided [P, Hkv, ps, D] (HND) views, without a copy.
    StridedView k(pages, {np, h, s, d}, {2 * h * s * d, s * d, d, 1}, 0);
    StridedView v(pages, {np, h, s, d}, {2 * h * s * d, s * d, d, 1}, h * s * d);
    Flat q(in[K::kQ]), indptr(in[K::kPageIndptr]), indices(in[K::kPageValues]), last(in[K::kLastPageLen]),
        o(in[K::kO]), lse(in[K::kLse]);
    namespace a = abi::decode_run;
    ArgPack<a::kNumArgs> args;
    if (!p.all_empty) {
      args.Set(a::kFloatWorkspaceBuffer, ws_.float_ws());
      args.Set(a::kIntWorkspaceBuffer, ws_.Slot(p.slot).device);
      args.Set(a::kPlanInfoVec, p.info);
      args.Set(a::kQ, q.get());
      args.Set(a::kPagedKCache, k.get());
      args.Set(a::kPagedVCache, v.get());
      args.Set(a::kPagedKvIndptr, indptr.get());
      args.Set(a::kPagedKvIndices, indices.get());
      args.Set(a::kPagedKvLastPageLen, last.get());
      args.Set(a::kO, o.get());
      args.Set(a::kMaybeLse, lse.get());
      args.Set(a::kKvLayoutCode, kLayoutHND);
      args.Set(a::kWindowLeft, window_left_);
      args.Set(a::kEnablePdl, pdl_);
      args.SetNone(a::kMaybeAlibiSlopes);
      args.Set(a::kLogitsSoftCap, logits_soft_cap_);
      args.Set(a::kSmScale, in[K::kSmScale].cast<double>());
      args.Set(a::kRopeRcpScale, rope_rcp_scale_);
      args.Set(a::kRopeRcpTheta, rope_rcp_theta_);
    }
    RunPlanned(p, &args, in[K::kO], in[K::kLse]);
  }

 private:
  double rope_rcp_scale_ = 1.0, rope_rcp_theta_ = 1e-4;
};

}  // namespace

std::unique_ptr<OpAdapter> MakeDecodeAdapter(ffi::Function empty_rows, ffi::Function plan, ffi::Function run) {
  return std::make_unique<DecodeAdapter>(std::move(empty_rows), std::move(plan), std::move(run));
}

}  // namespace fi
}  // namespace pagedkv
