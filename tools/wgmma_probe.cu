// wgmma probe (sm_90a): checks, on the GPU, the operand layouts a TIR wgmma attention kernel would rely on,
// and measures the matrix rate of wgmma against mma.sync on the same chip.
//
// Build and run on the GPU host:  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
//                                   tools/wgmma_probe.cu -o /tmp/wgmma_probe && /tmp/wgmma_probe
//
// Layouts (no swizzle, "interleave" mode): shared memory holds 8 x 8 fp16 *core matrices* of 128 contiguous
// bytes (8 rows of 16 bytes). A descriptor gives the start address and two strides between core matrices:
// LBO ("leading") and SBO ("stride"). Which stride runs along K and which along M/N is what the probe
// settles, for a K-major B (S = Q K^T: K stored [key][dim], dim = the reduction) and an MN-major B with
// trans-b = 1 (O = P V: V stored [key][dim], key = the reduction). It also checks the register fragments
// assumed for A (as mma.m16n8k16's A, warp w of the warpgroup taking rows 16w..16w+15) and for D (per 8
// columns j: d[4j + i] = row lane/4 + 8(i/2), column 8j + 2(lane%4) + i%2).
#include <cuda_fp16.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
#include <ctime>
#include <string>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); exit(1); } } while (0)

__device__ __forceinline__ uint64_t make_desc(const void* smem, uint32_t lbo, uint32_t sbo) {
  uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  uint64_t d = 0;
  d |= (uint64_t)((addr >> 4) & 0x3FFF);
  d |= (uint64_t)((lbo >> 4) & 0x3FFF) << 16;
  d |= (uint64_t)((sbo >> 4) & 0x3FFF) << 32;
  return d;  // base offset 0, swizzle mode 0 (none)
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void proxy_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// D[64 x 64] (+)= A[64 x 16] (registers) * B[16 x 64] (shared memory, descriptor); TRANS_B: B is MN-major.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float* d, const uint32_t* a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(TRANS_B));
}

// D[64 x 128] (+)= A[64 x 16] (registers) * B[16 x 128] (shared memory, descriptor); TRANS_B: B is MN-major.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float* d, const uint32_t* a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(TRANS_B));
}

__device__ __forceinline__ uint32_t pack2(half lo, half hi) {
  return (uint32_t)__half_as_ushort(lo) | ((uint32_t)__half_as_ushort(hi) << 16);
}
// A fragment (16 x 16 slice kk of a row-major [64][lda] fp16 matrix in global memory) of this thread.
__device__ void load_a(uint32_t* a, const half* m, int lda, int kk) {
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int r0 = 16 * warp + lane / 4, c0 = 16 * kk + (lane % 4) * 2;
  auto at = [&](int r, int c) { return m[r * lda + c]; };
  a[0] = pack2(at(r0, c0), at(r0, c0 + 1));
  a[1] = pack2(at(r0 + 8, c0), at(r0 + 8, c0 + 1));
  a[2] = pack2(at(r0, c0 + 8), at(r0, c0 + 9));
  a[3] = pack2(at(r0 + 8, c0 + 8), at(r0 + 8, c0 + 9));
}
__device__ void store_d(float* out, int ldo, const float* d, int n) {
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int j = 0; j < n / 8; ++j)
    for (int i = 0; i < 4; ++i)
      out[(16 * warp + lane / 4 + 8 * (i / 2)) * ldo + 8 * j + 2 * (lane % 4) + i % 2] = d[4 * j + i];
}

// S[64][64] = Q[64][128] K[64][128]^T. K goes to shared memory as core matrices: element (key n, dim k) at
// byte (n%8)*16 + (k%8)*2 + (k/8)*kstride + (n/8)*nstride. lbo_is_k: LBO = kstride, SBO = nstride (else swapped).
__global__ void qk_probe(const half* q, const half* k, float* s, int lbo_is_k) {
  __shared__ __align__(128) half ks[64 * 128];
  const int kstride = 128, nstride = 128 * 16;  // 16 core matrices along K (128 dims), then the next 8 keys
  for (int c = threadIdx.x; c < 64 * 16; c += blockDim.x) {  // 16-byte chunks: key c/16, dims 8*(c%16)..
    int n = c / 16, kc = c % 16;
    char* dst = reinterpret_cast<char*>(ks) + (n % 8) * 16 + kc * kstride + (n / 8) * nstride;
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(k + n * 128 + 8 * kc);
  }
  __syncthreads();
  proxy_fence();
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  uint32_t a[8][4];
  for (int kk = 0; kk < 8; ++kk) load_a(a[kk], q, 128, kk);
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    // the 16 dims of step kk are core matrices 2kk and 2kk+1 along K: start at byte 2*kk*kstride
    uint64_t desc = lbo_is_k ? make_desc(reinterpret_cast<char*>(ks) + 2 * kk * kstride, kstride, nstride)
                             : make_desc(reinterpret_cast<char*>(ks) + 2 * kk * kstride, nstride, kstride);
    wgmma_m64n64k16_rs<0>(d, a[kk], desc, kk > 0);
  }
  wg_commit();
  wg_wait0();
  store_d(s, 64, d, 64);
}

// O[64][64] = P[64][64] V[64][64] (V stored [key][dim]: MN-major B, trans-b = 1). V in shared memory: element
// (key k, dim n) at byte (k%8)*16 + (n%8)*2 + (n/8)*nstride + (k/8)*kstride. lbo_is_k as above.
__global__ void pv_probe(const half* p, const half* v, float* o, int lbo_is_k) {
  __shared__ __align__(128) half vs[64 * 64];
  const int nstride = 128, kstride = 128 * 8;  // 8 core matrices along N (64 dims), then the next 8 keys
  for (int c = threadIdx.x; c < 64 * 8; c += blockDim.x) {  // chunk: key c/8, dims 8*(c%8)..
    int kr = c / 8, nc = c % 8;
    char* dst = reinterpret_cast<char*>(vs) + (kr % 8) * 16 + nc * nstride + (kr / 8) * kstride;
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(v + kr * 64 + 8 * nc);
  }
  __syncthreads();
  proxy_fence();
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  uint32_t a[4][4];
  for (int kk = 0; kk < 4; ++kk) load_a(a[kk], p, 64, kk);
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    // keys 16kk..16kk+15 are two 8-key groups: start at byte 2*kk*kstride
    uint64_t desc = lbo_is_k ? make_desc(reinterpret_cast<char*>(vs) + 2 * kk * kstride, kstride, nstride)
                             : make_desc(reinterpret_cast<char*>(vs) + 2 * kk * kstride, nstride, kstride);
    wgmma_m64n64k16_rs<1>(d, a[kk], desc, kk > 0);
  }
  wg_commit();
  wg_wait0();
  store_d(o, 64, d, 64);
}

// Matrix rate: each warpgroup issues iters x 8 wgmma m64n128k16 (A in registers, B from shared memory).
__global__ void __launch_bounds__(256) rate_wgmma(float* sink, int iters, uint32_t lbo, uint32_t sbo) {
  __shared__ __align__(128) half bs[128 * 128];
  for (int i = threadIdx.x; i < 128 * 128; i += blockDim.x) bs[i] = __float2half(0.001f * (i % 17));
  __syncthreads();
  proxy_fence();
  float d[64];
  for (int i = 0; i < 64; ++i) d[i] = 0.f;
  uint32_t a[4];
  for (int i = 0; i < 4; ++i) a[i] = 0x3c003c00u ^ (threadIdx.x * 7 + i);
  for (int it = 0; it < iters; ++it) {
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
      wgmma_m64n128k16_rs<0>(d, a, make_desc(reinterpret_cast<char*>(bs) + 256 * kk, lbo, sbo), 1);
    wg_commit();
    wg_wait0();
  }
  float acc = 0.f;
  for (int i = 0; i < 64; ++i) acc += d[i];
  if (acc == 12345.f) sink[threadIdx.x] = acc;
}

__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// Matrix rate of mma.sync: each warp issues iters x 64 independent-ish m16n8k16 (16 accumulator tiles).
__global__ void __launch_bounds__(256) rate_mma(float* sink, int iters) {
  float c[16][4];
  for (int t = 0; t < 16; ++t) for (int i = 0; i < 4; ++i) c[t][i] = 0.f;
  uint32_t a[4], b[2];
  for (int i = 0; i < 4; ++i) a[i] = 0x3c003c00u ^ (threadIdx.x * 7 + i);
  b[0] = 0x3c003c00u ^ threadIdx.x; b[1] = 0x3c003c00u;
  for (int it = 0; it < iters; ++it)
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int t = 0; t < 16; ++t) mma16816(c[t], a, b);
  float acc = 0.f;
  for (int t = 0; t < 16; ++t) for (int i = 0; i < 4; ++i) acc += c[t][i];
  if (acc == 12345.f) sink[threadIdx.x] = acc;
}

static float rel_err(const std::vector<float>& out, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) { double e = out[i] - ref[i]; num += e * e; den += ref[i] * ref[i]; }
  return (float)std::sqrt(num / den);
}

int main(int argc, char** argv) {
  // one probe per process (a wrong layout guess can fault): qk0 qk1 pv0 pv1 rate
  std::string what = argc > 1 ? argv[1] : "rate";
  srand(12345u ^ (unsigned)time(nullptr));
  auto rnd = [] { return (float)rand() / RAND_MAX * 2.f - 1.f; };
  std::vector<half> hq(64 * 128), hk(64 * 128), hp(64 * 64), hv(64 * 64);
  std::vector<float> fq(hq.size()), fk(hk.size()), fp(hp.size()), fv(hv.size());
  for (size_t i = 0; i < hq.size(); ++i) { hq[i] = __float2half(rnd()); fq[i] = __half2float(hq[i]); }
  for (size_t i = 0; i < hk.size(); ++i) { hk[i] = __float2half(rnd()); fk[i] = __half2float(hk[i]); }
  for (size_t i = 0; i < hp.size(); ++i) { hp[i] = __float2half(rnd()); fp[i] = __half2float(hp[i]); }
  for (size_t i = 0; i < hv.size(); ++i) { hv[i] = __float2half(rnd()); fv[i] = __half2float(hv[i]); }
  std::vector<double> sref(64 * 64), oref(64 * 64);
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < 64; ++n) {
      double s = 0, o = 0;
      for (int k = 0; k < 128; ++k) s += (double)fq[m * 128 + k] * fk[n * 128 + k];
      for (int k = 0; k < 64; ++k) o += (double)fp[m * 64 + k] * fv[k * 64 + n];
      sref[m * 64 + n] = s; oref[m * 64 + n] = o;
    }
  half *dq, *dk, *dp, *dv; float *ds, *dout, *sink;
  CK(cudaMalloc(&dq, 2 * hq.size())); CK(cudaMalloc(&dk, 2 * hk.size()));
  CK(cudaMalloc(&dp, 2 * hp.size())); CK(cudaMalloc(&dv, 2 * hv.size()));
  CK(cudaMalloc(&ds, 4 * 64 * 64)); CK(cudaMalloc(&dout, 4 * 64 * 64)); CK(cudaMalloc(&sink, 4 * 1024));
  CK(cudaMemcpy(dq, hq.data(), 2 * hq.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dk, hk.data(), 2 * hk.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dp, hp.data(), 2 * hp.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dv, hv.data(), 2 * hv.size(), cudaMemcpyHostToDevice));
  std::vector<float> out(64 * 64);
  for (int lbo_is_k = 0; lbo_is_k < 2; ++lbo_is_k) {
    if (what == "qk" + std::to_string(lbo_is_k)) {
    CK(cudaMemset(ds, 0xff, 4 * 64 * 64));  // NaN: an element the fragment map misses stays NaN
    qk_probe<<<1, 128>>>(dq, dk, ds, lbo_is_k);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(out.data(), ds, 4 * out.size(), cudaMemcpyDeviceToHost));
    printf("[wgmma] S = Q K^T  K-major B, LBO along %s: rel err %.3e\n", lbo_is_k ? "K" : "N", rel_err(out, sref));
    }
    if (what != "pv" + std::to_string(lbo_is_k)) continue;
    CK(cudaMemset(dout, 0xff, 4 * 64 * 64));
    pv_probe<<<1, 128>>>(dp, dv, dout, lbo_is_k);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(out.data(), dout, 4 * out.size(), cudaMemcpyDeviceToHost));
    printf("[wgmma] O = P V    MN-major B (trans-b), LBO along %s: rel err %.3e\n", lbo_is_k ? "K" : "N",
           rel_err(out, oref));
  }
  if (what != "rate") return 0;
  int sms = 0; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  const int iters = 4096;
  for (int wgs = 1; wgs <= 2; ++wgs) {
    for (int blocks_per_sm = 1; blocks_per_sm <= 2; ++blocks_per_sm) {
      int grid = sms * blocks_per_sm;
      rate_wgmma<<<grid, 128 * wgs>>>(sink, 16, 128, 2048);
      CK(cudaEventRecord(e0));
      rate_wgmma<<<grid, 128 * wgs>>>(sink, iters, 128, 2048);
      CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
      float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
      double flop = 2.0 * 64 * 128 * 16 * 8 * (double)iters * grid * wgs;
      printf("[rate] wgmma m64n128k16 RS, %d warpgroup(s)/block, %d block(s)/SM: %.0f TFLOP/s\n", wgs,
             blocks_per_sm, flop / ms / 1e9);
    }
  }
  for (int warps = 4; warps <= 8; warps += 4) {
    int grid = sms * 2;
    rate_mma<<<grid, 32 * warps>>>(sink, 16);
    CK(cudaEventRecord(e0));
    rate_mma<<<grid, 32 * warps>>>(sink, iters);
    CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
    double flop = 2.0 * 16 * 8 * 16 * 64 * (double)iters * grid * warps;
    printf("[rate] mma.sync m16n8k16, %d warps/block, 2 blocks/SM: %.0f TFLOP/s\n", warps, flop / ms / 1e9);
  }
  return 0;
}
