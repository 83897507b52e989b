// mla_attn_decode_paged / mla_attn_prefill_paged on FlashInfer's MLA module.
// Design, FlashInfer facts and workspace ownership: src/flashinfer_adapter.cc.
#include <algorithm>
#include <map>
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
//
// FlashInfer's MLA planner holds at most kMLAMaxWorks work items (a constant of its scheduler.cuh), about one
// per 64 packed (query, head) rows plus at most one KV split per cluster, so DeepSeek-V3's 128 heads would cap
// a pass at ~7.7K queries. A pass is therefore planned as consecutive sub-plans that each fit: entries are
// taken in order and an entry whose queries do not fit is split by queries (exact: MLA paged passes are
// non-causal, so every query of an entry sees the same keys). A sub-plan runs on views of q, o and lse
// starting at its first row; its own int workspace slot holds its metadata. kv_indptr stays absolute (into
// the pass's kv_indices, which every sub-plan gets whole).
class MLAAdapter : public FlashInferAdapter {
 public:
  MLAAdapter(bool decode, ffi::Function e, ffi::Function plan, ffi::Function run)
      : FlashInferAdapter(decode ? ops::kMLAAttnDecodePaged : ops::kMLAAttnPrefillPaged, std::move(e),
                          std::move(plan), std::move(run)),
        decode_(decode) {}

  // Query tiles one sub-plan may hold: FlashInfer's limit less the KV splits its planner may add.
  static constexpr int64_t kTileBudget = kMLAMaxWorks - kMLAMaxSplits;

  void BeginForward(const ForwardInfo& info) final {
    passes_.Clear();
    next_slot_ = 0;
    const KVConfig& c = *info.config;
    const ForwardPlan& fp = *info.plan;
    for (size_t i = 0; i < info.passes.size(); ++i) {
      const ForwardInfo::Pass& pass = info.passes[i];
      bool decode_pass = fp.is_decode && pass.host->one_query_per_entry;  // src/attention.cc RunPass
      if (decode_pass != decode_) continue;
      std::vector<int32_t> kv_lens = PagedKvLens(*pass.host, c.page_size);
      PassPlans pp;
      pp.flags = EmptyFlags(kv_lens, 0, false);
      if (!pp.flags.all_empty) {
        ws_.Attach(info);
        for (SubPlan& sub : Split(*pass.host, kv_lens, c.num_qo_heads)) {
          sub.slot = next_slot_++;
          if (!sub.all_empty) PlanSub(c, &sub);
          pp.subs.push_back(std::move(sub));
        }
      }
      passes_.Put(ViewKey(pass.page_indptr), std::move(pp));
    }
  }

  void Run(ffi::PackedArgs in) final {
    if (decode_) {
      RunAs<ops::MLAAttnDecodePaged>(in);
    } else {
      RunAs<ops::MLAAttnPrefillPaged>(in);
    }
  }

  void EndForward() final { passes_.Clear(); }

 private:
  // One plan/run pair: q rows [q_begin, q_end) of the pass, entries with relative q and absolute kv indptr.
  struct SubPlan {
    size_t slot = 0;
    int64_t q_begin = 0, q_end = 0;
    std::vector<int32_t> qo_indptr, kv_indptr, kv_lens;
    ffi::Array<int64_t> info;
    bool all_empty = true;
  };
  struct PassPlans {
    Planned flags;  // all_empty / has_empty over the whole pass
    std::vector<SubPlan> subs;
  };

  static std::vector<SubPlan> Split(const PassPlan& p, const std::vector<int32_t>& kv_lens, int64_t heads) {
    std::vector<SubPlan> out(1);
    int64_t used = 0;  // tiles in out.back()
    auto tiles = [heads](int64_t rows) { return (rows * heads + 63) / 64; };
    for (int64_t e = 0; e < p.num_entries(); ++e) {
      for (int64_t q = p.q_indptr[e]; q < p.q_indptr[e + 1];) {
        int64_t fit = (kTileBudget - used) * 64 / heads;  // rows whose tiles still fit
        if (fit <= 0) {
          out.emplace_back();
          used = 0;
          continue;
        }
        int64_t rows = std::min<int64_t>(fit, p.q_indptr[e + 1] - q);
        SubPlan& s = out.back();
        if (s.qo_indptr.empty()) {
          s.q_begin = q;
          s.qo_indptr.push_back(0);
          s.kv_indptr.push_back(p.page_indptr[e]);
        }
        s.qo_indptr.push_back(static_cast<int32_t>(q + rows - s.q_begin));
        s.kv_indptr.back() = p.page_indptr[e];  // this entry's first page (absolute)
        s.kv_indptr.push_back(p.page_indptr[e + 1]);
        s.kv_lens.push_back(kv_lens[e]);
        s.q_end = q + rows;
        s.all_empty = s.all_empty && kv_lens[e] == 0;
        used += tiles(rows);
        q += rows;
      }
    }
    if (out.back().qo_indptr.empty()) out.pop_back();
    return out;
  }

  void PlanSub(const KVConfig& c, SubPlan* sub) {
    namespace a = abi::mla_plan;
    const Workspaces::Int& iws = ws_.Slot(sub->slot);
    HostInt32 qo(sub->qo_indptr), kv(sub->kv_indptr), lens(sub->kv_lens);
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
    if (result.size() != 2) {
      TVM_FFI_THROW(RuntimeError) << "pagedkv flashinfer: MLA plan returned " << result.size() << " values";
    }
    sub->info = result[0].cast<ffi::Array<int64_t>>();
    ws_.StageToDevice(iws, result[1].cast<int64_t>());
  }

  // K: the op's argument struct (src/ops.h); decode and prefill share every argument but `causal`.
  template <typename K>
  void RunAs(ffi::PackedArgs in) {
    CheckArgCount(in, K::kNumArgs, op_);
    const PassPlans& pp = passes_.Find(ViewKey(in[K::kPageIndptr]), op_);
    if constexpr (std::is_same_v<K, ops::MLAAttnPrefillPaged>) {
      CheckCausal(pp.flags, in[K::kCausal].template cast<int64_t>(), op_);
    }
    if (pp.flags.all_empty) {
      EmptyRows(in[K::kO], in[K::kLse], true);
      return;
    }
    // Rows of a sub-plan without keys, next to sub-plans with keys: fill everything first, then the runs
    // overwrite their rows.
    bool fill_first = std::any_of(pp.subs.begin(), pp.subs.end(), [](const SubPlan& s) { return s.all_empty; });
    if (fill_first) EmptyRows(in[K::kO], in[K::kLse], true);
    for (const SubPlan& sub : pp.subs) {
      if (!sub.all_empty) RunSub<K>(sub, in);
    }
    if (pp.flags.has_empty) EmptyRows(in[K::kO], in[K::kLse], false);
  }

  // q[n, H, DL] -> q_nope / q_pe of rows [q_begin, q_end), o[n, H, r] and lse[n, H] the same rows.
  template <typename K>
  void RunSub(const SubPlan& sub, const ffi::PackedArgs& in) {
    double sm_scale = in[K::kSmScale].template cast<double>();
    const DLTensor& pages = *in[K::kPages].template cast<DLTensor*>();
    const DLTensor& q = *in[K::kQ].template cast<DLTensor*>();
    const DLTensor& o_full = *in[K::kO].template cast<DLTensor*>();
    const DLTensor& lse_full = *in[K::kLse].template cast<DLTensor*>();
    int64_t np = pages.shape[0], ps = pages.shape[3], dl = pages.shape[4];
    int64_t r = o_full.shape[2], rope = dl - r;
    int64_t h = q.shape[1], n = sub.q_end - sub.q_begin, q0 = sub.q_begin;
    for (const DLTensor* t : {&q, &o_full, &lse_full}) {
      if (!IsCompact(*t)) TVM_FFI_THROW(InternalError) << "pagedkv flashinfer: " << op_ << " needs compact q, o, lse";
    }
    StridedView q_nope(q, {n, h, r}, {h * dl, dl, 1}, q0 * h * dl);
    StridedView q_pe(q, {n, h, rope}, {h * dl, dl, 1}, q0 * h * dl + r);
    StridedView ckv(pages, {np, ps, r}, {ps * dl, dl, 1}, 0), kpe(pages, {np, ps, rope}, {ps * dl, dl, 1}, r);
    StridedView o(o_full, {n, h, r}, {h * r, r, 1}, q0 * h * r);
    StridedView lse(lse_full, {n, h}, {h, 1}, q0 * h);
    Flat indices(in[K::kPageValues]);
    namespace a = abi::mla_run;
    ArgPack<a::kNumArgs> args;
    args.Set(a::kFloatWorkspaceBuffer, ws_.float_ws());
    args.Set(a::kIntWorkspaceBuffer, ws_.Slot(sub.slot).device);
    args.Set(a::kPlanInfoVec, sub.info);
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
    args.Call(run_, op_);
  }

  bool decode_;
  size_t next_slot_ = 0;
  PlanMap<PassPlans> passes_;
};

}  // namespace

std::unique_ptr<OpAdapter> MakeMLAAdapter(bool decode, ffi::Function empty_rows, ffi::Function plan,
                                          ffi::Function run) {
  return std::make_unique<MLAAdapter>(decode, std::move(empty_rows), std::move(plan), std::move(run));
}

}  // namespace fi
}  // namespace pagedkv
