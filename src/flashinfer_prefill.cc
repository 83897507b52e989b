// attn_prefill_ragged / attn_prefill_paged on FlashInfer's batch prefill modules (fa2, fa3).
// Design, FlashInfer facts and workspace ownership: src/flashinfer_adapter.cc.
#include <type_traits>

#include "flashinfer_common.h"

namespace pagedkv {
namespace fi {
namespace {

// ---------------------------------------------------------------------------------------------------------
// attn_prefill_ragged / attn_prefill_paged on FlashInfer's batch prefill (fa2, or fa3 on Hopper).

// The fa2 and fa3 lists share their heads (python/pagedkv/flashinfer/abi.py: _PREFILL_PLAN_HEAD,
// _RAGGED_RUN_HEAD, _PAGED_RUN_HEAD); the head is filled through the fa2 names.
namespace p2 = abi::prefill_fa2_plan;
namespace p3 = abi::prefill_fa3_plan;
namespace r2 = abi::prefill_fa2_ragged_run;
namespace r3 = abi::prefill_fa3_ragged_run;
namespace g2 = abi::prefill_fa2_paged_run;
namespace g3 = abi::prefill_fa3_paged_run;
static_assert(p2::kWindowLeft == p3::kWindowLeft && p3::kNumArgs == p3::kWindowLeft + 1 &&
              p2::kCausal == p3::kCausal && p2::kKvLenArr == p3::kKvLenArr);
static_assert(r2::kEnablePdl == r3::kEnablePdl && r2::kMaybeLse == r3::kMaybeLse && r2::kK == r3::kK);
static_assert(g2::kEnablePdl == g3::kEnablePdl && g2::kPagedKvLastPageLen == g3::kPagedKvLastPageLen);

enum class PrefillKind { kFA2, kFA3 };

// What the adapter serves: attn_prefill_ragged, attn_prefill_paged, or attn_decode_paged run on the paged
// prefill kernel (FlashInfer's "tensor-core decode": one query row per entry, the GQA group's rows share
// each K/V tile in an MMA, where the CUDA-core decode kernel reads K/V once per group with scalar FMAs).
enum class PrefillOp { kRagged, kPaged, kDecode };

class PrefillAdapter : public FlashInferAdapter {
 public:
  PrefillAdapter(PrefillOp what, PrefillKind kind, ffi::Function e, ffi::Function plan, ffi::Function run)
      : FlashInferAdapter(OpName(what), std::move(e), std::move(plan), std::move(run)), what_(what), kind_(kind) {}

  void BeginForward(const ForwardInfo& info) final {
    plans_.Clear();
    ReadOptions(info);
    rope_rcp_scale_ = info.config->rope_scale;
    rope_rcp_theta_ = 1.0 / info.config->rope_theta;
    if (what_ == PrefillOp::kRagged) {
      PlanRagged(info);
    } else {
      PlanPaged(info);
    }
  }

  void Run(ffi::PackedArgs in) final {
    if (what_ == PrefillOp::kDecode) {
      Check<ops::AttnDecodePaged>(in);
      using K = ops::AttnDecodePaged;
      const Planned& p = plans_.Find(ViewKey(in[K::kPageIndptr]), op_);
      Dispatch<K>(p, in, in[K::kSmScale].cast<double>());
      return;
    }
    if (what_ == PrefillOp::kPaged) {
      Check<ops::AttnPrefillPaged>(in);
      using K = ops::AttnPrefillPaged;
      const Planned& p = plans_.Find(ViewKey(in[K::kPageIndptr]), op_);
      CheckCausal(p, in[K::kCausal].cast<int64_t>(), op_);
      Dispatch<K>(p, in, in[K::kSmScale].cast<double>());
      return;
    }
    Check<ops::AttnPrefillRagged>(in);
    using R = ops::AttnPrefillRagged;
    const Planned& p = plans_.Find(ViewKey(in[R::kKVIndptr]), op_);
    CheckCausal(p, in[R::kCausal].cast<int64_t>(), op_);
    if (!p.all_empty && ViewKey(in[R::kQIndptr]) != p.q_key) {
      TVM_FFI_THROW(RuntimeError) << "pagedkv flashinfer: attn_prefill_ragged called with a q_indptr that "
                                  << "begin_forward did not plan";
    }
    double sm_scale = in[R::kSmScale].cast<double>();
    if (kind_ == PrefillKind::kFA2) {
      RunRagged<r2::kNumArgs, r2Tail>(p, in, sm_scale);
    } else {
      RunRagged<r3::kNumArgs, r3Tail>(p, in, sm_scale);
    }
  }

 private:
  static const char* OpName(PrefillOp what) {
    switch (what) {
      case PrefillOp::kRagged: return ops::kAttnPrefillRagged;
      case PrefillOp::kPaged: return ops::kAttnPrefillPaged;
      default: return ops::kAttnDecodePaged;
    }
  }

  void PlanRagged(const ForwardInfo& info) {
    const ForwardPlan& fp = *info.plan;
    if (fp.through) {
      // The only ragged call of a through forward (decode, a continuation prefill, any forward of a
      // windowed cache) is self_attention over no keys (kv_indptr = zeros).
      Planned p = EmptyFlags(std::vector<int32_t>(fp.q_indptr.size() - 1, 0), 0, true);
      plans_.Put(ViewKey(info.no_keys_indptr), p);
      return;
    }
    // Prefill: the new tokens attend causally to the new tokens of their own sequence (q and kv indptr are
    // the same array), so no entry is empty and kv_len == q_len.
    ws_.Attach(info);
    std::vector<int32_t> kv_lens(fp.q_indptr.size() - 1);
    for (size_t b = 0; b + 1 < fp.q_indptr.size(); ++b) kv_lens[b] = fp.q_indptr[b + 1] - fp.q_indptr[b];
    Planned p = EmptyFlags(kv_lens, 0, true);
    p.q_key = ViewKey(info.q_indptr);
    if (!p.all_empty) p.info = Plan(info, 0, fp.q_indptr, fp.q_indptr, kv_lens, /*page_size=*/1, true);
    plans_.Put(ViewKey(info.q_indptr), std::move(p));
  }

  // attn_prefill_paged: every pass but attn_decode_paged's; the decode mode: exactly those (a decode
  // forward's passes with one query per entry, src/attention.cc RunPass).
  void PlanPaged(const ForwardInfo& info) {
    const KVConfig& c = *info.config;
    const ForwardPlan& fp = *info.plan;
    for (size_t i = 0; i < info.passes.size(); ++i) {
      const ForwardInfo::Pass& pass = info.passes[i];
      bool decode_pass = fp.is_decode && pass.host->one_query_per_entry;
      if (decode_pass != (what_ == PrefillOp::kDecode)) continue;
      std::vector<int32_t> kv_lens = PagedKvLens(*pass.host, c.page_size);
      // Paged passes are non-causal (every key of an entry precedes its queries), except the own pass of
      // a through prefill (src/attention.cc RunPass); a decode row's keys all precede or are it.
      bool causal = pass.host->causal;
      Planned p = EmptyFlags(kv_lens, i, causal);
      if (decode_pass) {
        // attn_decode_paged has no q_indptr: entry e is q row e. The pass's own device q_indptr is that
        // arange, and the prefill kernel reads it.
        const std::vector<int32_t>& qo = pass.host->q_indptr;
        for (size_t e = 0; e < qo.size(); ++e) {
          if (qo[e] != static_cast<int32_t>(e)) {
            TVM_FFI_THROW(InternalError) << "pagedkv flashinfer: decode pass entry " << e << " starts at q row "
                                         << qo[e];
          }
        }
        p.q_indptr = pass.q_indptr;
      }
      if (!p.all_empty) {
        ws_.Attach(info);
        p.info = Plan(info, i, pass.host->q_indptr, pass.host->page_indptr, kv_lens, c.page_size, causal);
        CheckGraphPlan(info, i, pass.host->num_entries(), p.info);
      }
      plans_.Put(ViewKey(pass.page_indptr), std::move(p));
    }
  }

  template <typename K>
  void Dispatch(const Planned& p, ffi::PackedArgs in, double sm_scale) {
    if (kind_ == PrefillKind::kFA2) {
      RunPaged<K, g2::kNumArgs, g2Tail>(p, in, sm_scale);
    } else {
      RunPaged<K, g3::kNumArgs, g3Tail>(p, in, sm_scale);
    }
  }

  // The tails' index constants, as types (namespaces cannot be template arguments).
  struct r2Tail {
    static constexpr bool kFA3 = false;
    static constexpr int kMaybeCustomMask = r2::kMaybeCustomMask, kMaybeMaskIndptr = r2::kMaybeMaskIndptr,
                         kMaybeAlibiSlopes = r2::kMaybeAlibiSlopes, kMaybePrefixLenPtr = r2::kMaybePrefixLenPtr,
                         kMaybeTokenPosInItemsPtr = r2::kMaybeTokenPosInItemsPtr,
                         kMaybeMaxItemLenPtr = r2::kMaybeMaxItemLenPtr, kMaybeKCacheSf = r2::kMaybeKCacheSf,
                         kMaybeVCacheSf = r2::kMaybeVCacheSf, kLogitsSoftCap = r2::kLogitsSoftCap,
                         kSmScale = r2::kSmScale, kRopeRcpScale = r2::kRopeRcpScale,
                         kRopeRcpTheta = r2::kRopeRcpTheta, kTokenPosInItemsLen = r2::kTokenPosInItemsLen;
  };
  struct g2Tail {
    static constexpr bool kFA3 = false;
    static constexpr int kMaybeCustomMask = g2::kMaybeCustomMask, kMaybeMaskIndptr = g2::kMaybeMaskIndptr,
                         kMaybeAlibiSlopes = g2::kMaybeAlibiSlopes, kMaybePrefixLenPtr = g2::kMaybePrefixLenPtr,
                         kMaybeTokenPosInItemsPtr = g2::kMaybeTokenPosInItemsPtr,
                         kMaybeMaxItemLenPtr = g2::kMaybeMaxItemLenPtr, kMaybeKCacheSf = g2::kMaybeKCacheSf,
                         kMaybeVCacheSf = g2::kMaybeVCacheSf, kLogitsSoftCap = g2::kLogitsSoftCap,
                         kSmScale = g2::kSmScale, kRopeRcpScale = g2::kRopeRcpScale,
                         kRopeRcpTheta = g2::kRopeRcpTheta, kTokenPosInItemsLen = g2::kTokenPosInItemsLen;
  };
  struct r3Tail {
    static constexpr bool kFA3 = true;
    static constexpr int kMaybePrefixLenPtr = r3::kMaybePrefixLenPtr,
                         kMaybeTokenPosInItemsPtr = r3::kMaybeTokenPosInItemsPtr,
                         kMaybeMaxItemLenPtr = r3::kMaybeMaxItemLenPtr, kMaybeScaleV = r3::kMaybeScaleV,
                         kLogitsSoftCap = r3::kLogitsSoftCap, kSmScale = r3::kSmScale,
                         kScaleVScalar = r3::kScaleVScalar, kTokenPosInItemsLen = r3::kTokenPosInItemsLen;
  };
  struct g3Tail {
    static constexpr bool kFA3 = true;
    static constexpr int kMaybePrefixLenPtr = g3::kMaybePrefixLenPtr,
                         kMaybeTokenPosInItemsPtr = g3::kMaybeTokenPosInItemsPtr,
                         kMaybeMaxItemLenPtr = g3::kMaybeMaxItemLenPtr, kMaybeScaleV = g3::kMaybeScaleV,
                         kLogitsSoftCap = g3::kLogitsSoftCap, kSmScale = g3::kSmScale,
                         kScaleVScalar = g3::kScaleVScalar, kTokenPosInItemsLen = g3::kTokenPosInItemsLen;
  };

  // The arguments after enable_pdl: flashinfer's "off" values, the scale, and (fa2) the RoPE constants.
  template <typename Tail, int N>
  void SetTail(ArgPack<N>& args, double sm_scale) const {
    args.SetNone(Tail::kMaybePrefixLenPtr);
    args.SetNone(Tail::kMaybeTokenPosInItemsPtr);
    args.SetNone(Tail::kMaybeMaxItemLenPtr);
    args.Set(Tail::kLogitsSoftCap, logits_soft_cap_);
    args.Set(Tail::kSmScale, sm_scale);
    args.Set(Tail::kTokenPosInItemsLen, int64_t{0});
    if constexpr (Tail::kFA3) {
      args.SetNone(Tail::kMaybeScaleV);
      args.Set(Tail::kScaleVScalar, 1.0);  // no fp8 V scale
    } else {
      args.SetNone(Tail::kMaybeCustomMask);
      args.SetNone(Tail::kMaybeMaskIndptr);
      args.SetNone(Tail::kMaybeAlibiSlopes);
      args.SetNone(Tail::kMaybeKCacheSf);
      args.SetNone(Tail::kMaybeVCacheSf);
      // unused while the module is built without in-kernel RoPE (pos_encoding_mode 0); see DecodeAdapter
      args.Set(Tail::kRopeRcpScale, rope_rcp_scale_);
      args.Set(Tail::kRopeRcpTheta, rope_rcp_theta_);
    }
  }

  ffi::Array<int64_t> Plan(const ForwardInfo& info, size_t slot, const std::vector<int32_t>& qo_indptr,
                           const std::vector<int32_t>& kv_indptr, const std::vector<int32_t>& kv_lens,
                           int64_t page_size, bool causal) {
    const KVConfig& c = *info.config;
    if (causal) {
      for (size_t b = 0; b < kv_lens.size(); ++b) {
        if (kv_lens[b] > 0 && kv_lens[b] < qo_indptr[b + 1] - qo_indptr[b]) {
          TVM_FFI_THROW(InternalError) << "pagedkv flashinfer: causal " << op_ << " entry " << b
                                       << " has fewer keys than queries (the runtime never plans that)";
        }
      }
    }
    const Workspaces::Int& iws = ws_.Slot(slot);
    HostInt32 qo(qo_indptr), kv(kv_indptr), lens(kv_lens);
    auto head = [&](auto& args) {
      args.Set(p2::kFloatWorkspaceBuffer, ws_.float_ws());
      args.Set(p2::kIntWorkspaceBuffer, iws.device);
      args.Set(p2::kPageLockedIntWorkspaceBuffer, iws.pinned);
      args.Set(p2::kQoIndptr, qo.get());
      args.Set(p2::kKvIndptr, kv.get());  // ragged: token indptr; paged: page indptr (as flashinfer's wrappers)
      args.Set(p2::kKvLenArr, lens.get());
      args.Set(p2::kTotalNumRows, static_cast<int64_t>(qo_indptr.back()));
      args.Set(p2::kBatchSize, static_cast<int64_t>(kv_lens.size()));
      args.Set(p2::kNumQoHeads, c.num_qo_heads);
      args.Set(p2::kNumKvHeads, c.num_kv_heads);
      args.Set(p2::kPageSize, page_size);
      args.Set(p2::kEnableCudaGraph, info.cuda_graph);
      args.Set(p2::kHeadDimQk, c.head_dim);
      args.Set(p2::kHeadDimVo, c.v_head_dim);
      args.Set(p2::kCausal, causal);
      args.Set(p2::kWindowLeft, window_left_);
    };
    if (kind_ == PrefillKind::kFA2) {
      ArgPack<p2::kNumArgs> args;
      head(args);
      // the values 0.7.4's BatchPrefillWith{Paged,Ragged}KVCacheWrapper.plan (and, for decode, its
      // BatchDecodeWithPagedKVCacheWrapper with use_tensor_cores) passes without CUDA graphs
      args.Set(p2::kFixedSplitSize, int64_t{-1});
      args.Set(p2::kDisableSplitKv, false);
      args.Set(p2::kNumColocatedCtas, int64_t{0});
      // decode rows: one query each, as FlashInfer's tensor-core decode plans them (the planner then
      // sizes the query tile for one row per entry)
      bool decode = what_ == PrefillOp::kDecode;
      args.Set(p2::kUniformQLen, int64_t{decode ? 1 : 0});
      args.Set(p2::kFixedUniformQLen, decode);
      return args.Call(plan_, "prefill plan").cast<ffi::Array<int64_t>>();
    }
    ArgPack<p3::kNumArgs> args;
    head(args);
    return args.Call(plan_, "prefill plan").cast<ffi::Array<int64_t>>();
  }

  template <typename K>
  void Check(const ffi::PackedArgs& in) const {
    CheckArgCount(in, K::kNumArgs, op_);
    CheckNoInlineRope(in[K::kApplyRope].template cast<int64_t>(), op_);
  }

  template <int N, typename Tail>
  void RunRagged(const Planned& p, ffi::PackedArgs in, double sm_scale) {
    using K = ops::AttnPrefillRagged;
    Flat q(in[K::kQ]), k(in[K::kK]), v(in[K::kV]), qo(in[K::kQIndptr]), kv(in[K::kKVIndptr]), o(in[K::kO]),
        lse(in[K::kLse]);
    ArgPack<N> args;
    if (!p.all_empty) {
      args.Set(r2::kFloatWorkspaceBuffer, ws_.float_ws());
      args.Set(r2::kIntWorkspaceBuffer, ws_.Slot(p.slot).device);
      args.Set(r2::kPlanInfoVec, p.info);
      args.Set(r2::kQ, q.get());
      args.Set(r2::kK, k.get());
      args.Set(r2::kV, v.get());
      args.Set(r2::kQoIndptr, qo.get());
      args.Set(r2::kKvIndptr, kv.get());
      args.Set(r2::kO, o.get());
      args.Set(r2::kMaybeLse, lse.get());
      args.Set(r2::kMaskModeCode, p.causal ? kMaskCausal : kMaskNone);
      args.Set(r2::kLayout, kLayoutNHD);
      args.Set(r2::kWindowLeft, window_left_);
      args.Set(r2::kEnablePdl, pdl_);
      SetTail<Tail>(args, sm_scale);
    }
    RunPlanned(p, &args, in[K::kO], in[K::kLse]);
  }

  // K: attn_prefill_paged's or attn_decode_paged's argument struct (the decode op has no q_indptr: the
  // plan holds the pass's device arange).
  template <typename K, int N, typename Tail>
  void RunPaged(const Planned& p, ffi::PackedArgs in, double sm_scale) {
    const DLTensor& pages = *in[K::kPages].template cast<DLTensor*>();
    int64_t np = pages.shape[0], h = pages.shape[2], s = pages.shape[3], d = pages.shape[4];
    StridedView k(pages, {np, h, s, d}, {2 * h * s * d, s * d, d, 1}, 0);
    StridedView v(pages, {np, h, s, d}, {2 * h * s * d, s * d, d, 1}, h * s * d);
    Flat q(in[K::kQ]), qo(QIndptr<K>(p, in)), indptr(in[K::kPageIndptr]), indices(in[K::kPageValues]),
        last(in[K::kLastPageLen]), o(in[K::kO]), lse(in[K::kLse]);
    ArgPack<N> args;
    if (!p.all_empty) {
      args.Set(g2::kFloatWorkspaceBuffer, ws_.float_ws());
      args.Set(g2::kIntWorkspaceBuffer, ws_.Slot(p.slot).device);
      args.Set(g2::kPlanInfoVec, p.info);
      args.Set(g2::kQ, q.get());
      args.Set(g2::kPagedKCache, k.get());
      args.Set(g2::kPagedVCache, v.get());
      args.Set(g2::kQoIndptr, qo.get());
      args.Set(g2::kPagedKvIndptr, indptr.get());
      args.Set(g2::kPagedKvIndices, indices.get());
      args.Set(g2::kPagedKvLastPageLen, last.get());
      args.Set(g2::kO, o.get());
      args.Set(g2::kMaybeLse, lse.get());
      args.Set(g2::kMaskModeCode, p.causal ? kMaskCausal : kMaskNone);
      args.Set(g2::kLayout, kLayoutHND);
      args.Set(g2::kWindowLeft, window_left_);
      args.Set(g2::kEnablePdl, pdl_);
      SetTail<Tail>(args, sm_scale);
    }
    RunPlanned(p, &args, in[K::kO], in[K::kLse]);
  }

  template <typename K>
  static const DLTensor& QIndptr(const Planned& p, const ffi::PackedArgs& in) {
    if constexpr (std::is_same_v<K, ops::AttnDecodePaged>) {
      return *p.q_indptr.GetDLTensorPtr();
    } else {
      return *in[K::kQIndptr].template cast<DLTensor*>();
    }
  }

  PrefillOp what_;
  PrefillKind kind_;
  double rope_rcp_scale_ = 1.0, rope_rcp_theta_ = 1e-4;
};

}  // namespace

std::unique_ptr<OpAdapter> MakePrefillAdapter(const std::string& op, bool fa3, ffi::Function empty_rows,
                                              ffi::Function plan, ffi::Function run) {
  PrefillOp what = op == ops::kAttnPrefillRagged ? PrefillOp::kRagged
                   : op == ops::kAttnPrefillPaged ? PrefillOp::kPaged
                                                  : PrefillOp::kDecode;
  return std::make_unique<PrefillAdapter>(what, fa3 ? PrefillKind::kFA3 : PrefillKind::kFA2, std::move(empty_rows),
                                          std::move(plan), std::move(run));
}

}  // namespace fi
}  // namespace pagedkv
