// A CPU stand-in for the CUDA the tensor-core prefill kernel and the staged decode kernel use, so that TVM's
// generated kernel source runs on the build host (tests/cpu/test_prefill_tc_emulated.py,
// tests/cpu/test_decode_staged_emulated.py): one std::thread per CUDA thread of a block (3-D blocks and grids), __syncthreads as a block barrier, dynamic shared memory as a static array (the test rewrites the
// kernel's extern declaration), and the warp-collective pieces (shfl_xor, ldmatrix, mma.sync)
// as exchanges through per-warp slots between warp barriers, computed from the PTX ISA's definitions;
// wgmma as a warpgroup collective (below); named barriers (bar.sync / bar.arrive) by phase counts.
// cp.async completes at the latest point its wait allows (below).
#include <barrier>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <mutex>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static

typedef unsigned int uint;
typedef _Float16 half;
struct nv_bfloat16 {
  uint16_t bits;
  nv_bfloat16() = default;
  explicit nv_bfloat16(float f) {  // round to nearest even
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    bits = static_cast<uint16_t>(u >> 16);
  }
  explicit operator float() const {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
inline half __float2half_rn(float x) { return static_cast<half>(x); }
inline nv_bfloat16 __float2bfloat16_rn(float x) { return nv_bfloat16(x); }
inline nv_bfloat16 __float2bfloat16(float x) { return nv_bfloat16(x); }
inline float __half2float(half x) { return static_cast<float>(x); }
inline float __bfloat162float(nv_bfloat16 x) { return static_cast<float>(x); }
template <class T16>
inline uint pack2(T16 a, T16 b) {
  uint16_t lo, hi;
  std::memcpy(&lo, &a, 2);
  std::memcpy(&hi, &b, 2);
  return static_cast<uint>(lo) | (static_cast<uint>(hi) << 16);
}
inline uint __pack_half2(half a, half b) { return pack2(a, b); }
inline uint __pack_nv_bfloat162(nv_bfloat16 a, nv_bfloat16 b) { return pack2(a, b); }
struct uint4 { uint x, y, z, w; };
struct float4 { float x, y, z, w; };
inline uint4 make_uint4(uint x, uint y, uint z, uint w) { return uint4{x, y, z, w}; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fmul_rn(float a, float b) { return a * b; }  // the tests compile without FMA contraction
inline float max(float a, float b) { return a > b ? a : b; }
inline float min(float a, float b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }

struct Dim3 { int x, y, z; };
thread_local Dim3 threadIdx, blockIdx;
// Linear thread id in the block (x fastest, then y, z: how CUDA forms warps).
thread_local int t_linear;
// Threads of a block: the kernel's __launch_bounds__ (the test defines it before including this file).
#ifndef PAGEDKV_EMU_THREADS
#define PAGEDKV_EMU_THREADS 128
#endif
constexpr int kThreads = PAGEDKV_EMU_THREADS, kMaxWarps = 32;
static std::barrier<>* g_block_barrier;
struct WarpSlots {
  std::barrier<>* bar;
  float f[32];
  uint a[32][4], b[32][2];
  const void* p[32];
};
static WarpSlots g_warps[kMaxWarps];
inline int lane_id() { return t_linear % 32; }
inline WarpSlots& my_warp() { return g_warps[t_linear / 32]; }
inline void warp_sync() { my_warp().bar->arrive_and_wait(); }
inline void __syncthreads() { g_block_barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xFFFFFFFFu) { warp_sync(); }

// Named barriers (bar.sync / bar.arrive id, n; ids 1..15, id 0 is __syncthreads): a phase completes when n
// threads have arrived, counting those that wait (bar.sync) and those that only arrive (bar.arrive). A wait
// that outlasts 120 s (a count that never fills: arrivals and waits out of balance) aborts; a block that ends
// with a barrier partly arrived aborts too (launch3).
struct NamedBar { std::mutex mu; std::condition_variable cv; int count = 0; long phase = 0; };
static NamedBar g_named[16];
inline long named_arrive(int id, int n) {
  NamedBar& b = g_named[id];
  std::unique_lock<std::mutex> lk(b.mu);
  long ph = b.phase;
  if (++b.count == n) { b.count = 0; ++b.phase; b.cv.notify_all(); }
  return ph;
}
inline void pagedkv_bar_arrive(int id, int n) { named_arrive(id, n); }
inline void pagedkv_bar_sync(int id, int n) {
  long ph = named_arrive(id, n);
  NamedBar& b = g_named[id];
  std::unique_lock<std::mutex> lk(b.mu);
  if (!b.cv.wait_for(lk, std::chrono::seconds(120), [&] { return b.phase != ph; })) {
    std::fprintf(stderr, "named barrier %d (count %d of %d) never completed\n", id, b.count, n);
    std::abort();
  }
}

inline float __shfl_xor_sync(uint, float v, int mask, int) {
  WarpSlots& w = my_warp();
  w.f[lane_id()] = v;
  warp_sync();
  float r = w.f[lane_id() ^ mask];
  warp_sync();
  return r;
}

// 16-bit element h (0: low) of a register, as float.
template <class T16>
inline float half_of(uint r, int h) {
  uint16_t bits = static_cast<uint16_t>(h ? r >> 16 : r & 0xFFFFu);
  T16 x;
  std::memcpy(&x, &bits, 2);
  return static_cast<float>(x);
}

// mma.m16n8k16.row.col: A a0..a7 (row g for a0, a1, a4, a5, else g + 8; col 2 t + (i & 1), + 8 for
// a4..a7), B b0..b3 (k 2 t + (i & 1), + 8 for b2, b3; n g), C c0..c3 (row g, + 8 for c2, c3; col 2 t + (i & 1)).
template <class T16>
inline void mma_emu(float* d, const void* a, const void* b) {
  WarpSlots& w = my_warp();
  int l = lane_id();
  std::memcpy(w.a[l], a, 16);
  std::memcpy(w.b[l], b, 8);
  warp_sync();
  float A[16][16], B[16][8];
  for (int t = 0; t < 32; ++t) {
    int g = t / 4, q = t % 4;
    for (int i = 0; i < 8; ++i) {
      int row = (i == 0 || i == 1 || i == 4 || i == 5) ? g : g + 8;
      A[row][2 * q + (i & 1) + (i >= 4 ? 8 : 0)] = half_of<T16>(w.a[t][i / 2], i & 1);
    }
    for (int i = 0; i < 4; ++i) B[2 * q + (i & 1) + (i >= 2 ? 8 : 0)][g] = half_of<T16>(w.b[t][i / 2], i & 1);
  }
  warp_sync();
  for (int i = 0; i < 4; ++i) {
    int row = l / 4 + (i >= 2 ? 8 : 0), col = 2 * (l % 4) + (i & 1);
    float acc = 0.f;
    for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
    d[i] += acc;
  }
}

// ldmatrix.m8n8.x4[.trans].b16: lane 8 i + r addresses row r of matrix i; register i of lane l = elements
// (l / 4, 2 (l % 4) + h) of matrix i, transposed: (2 (l % 4) + h, l / 4).
inline void ldsm_emu(void* dst, const void* smem, bool trans) {
  WarpSlots& w = my_warp();
  int l = lane_id();
  w.p[l] = smem;
  warp_sync();
  uint* d = static_cast<uint*>(dst);
  for (int i = 0; i < 4; ++i) {
    uint16_t e[2];
    for (int h = 0; h < 2; ++h) {
      int row = trans ? 2 * (l % 4) + h : l / 4, col = trans ? l / 4 : 2 * (l % 4) + h;
      std::memcpy(&e[h], static_cast<const uint16_t*>(w.p[8 * i + row]) + col, 2);
    }
    d[i] = static_cast<uint>(e[0]) | (static_cast<uint>(e[1]) << 16);
  }
  warp_sync();
}

#define PAGEDKV_MMA_HELPERS
inline void pagedkv_mma_f16(float* d, const void* a, const void* b) { mma_emu<half>(d, a, b); }
inline void pagedkv_mma_bf16(float* d, const void* a, const void* b) { mma_emu<nv_bfloat16>(d, a, b); }
inline void pagedkv_ldsm_x4(void* dst, const void* smem) { ldsm_emu(dst, smem, false); }
inline void pagedkv_ldsm_x4_trans(void* dst, const void* smem) { ldsm_emu(dst, smem, true); }
// cp.async completes as late as the ISA allows: a copy is queued in its thread's open group, commit closes
// the group, wait_group N performs every group but the newest N (so a wait placed too late, or a buffer
// read before its wait, reads stale data); copies still queued when a block ends are dropped.
struct CpAsync { void* dst; const void* src; };
thread_local std::vector<std::vector<CpAsync>> t_groups(1);
inline void pagedkv_cp_async16(void* smem, const void* gmem) { t_groups.back().push_back({smem, gmem}); }
// The L2 prefetch hint changes nothing a thread can observe.
inline void pagedkv_cp_async16_pf128(void* smem, const void* gmem) { pagedkv_cp_async16(smem, gmem); }
inline void pagedkv_cp_async_commit() { t_groups.emplace_back(); }
inline void cp_async_wait(size_t newest_left) {
  size_t closed = t_groups.size() - 1;  // the last entry is the open (uncommitted) group
  while (closed > newest_left) {
    for (const CpAsync& c : t_groups.front()) std::memcpy(c.dst, c.src, 16);
    t_groups.erase(t_groups.begin());
    --closed;
  }
}
inline void pagedkv_cp_async_wait1() { cp_async_wait(1); }
inline void pagedkv_cp_async_wait0() { cp_async_wait(0); }
inline void pagedkv_cp_async_wait2() { cp_async_wait(2); }
inline int pagedkv_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0 ? 1 : 0; }

// wgmma.mma_async m64nNk16 (A from registers, B from shared memory through a no-swizzle descriptor), a
// warpgroup (4 warps, 128 threads) collective. As late as the ISA allows: a wgmma only records the thread's A
// fragment and D address; wait_group N performs every group committed before the newest N, reading B from
// shared memory then (a buffer refilled before the wait, or D read before it, shows). The descriptor is built as on the GPU (LBO
// bits 16-29, SBO bits 32-45, in 16-byte units) and decoded back; its address field cannot hold a host
// pointer, so the start address travels beside it. B element (n, k) (trans 0, K-major) at byte
// (n%8)*16 + (k%8)*2 + (k/8)*LBO + (n/8)*SBO; (k, n) (trans 1, MN-major) at (k%8)*16 + (n%8)*2 + (n/8)*SBO +
// (k/8)*LBO. A: warp w's rows 16w.. as mma.m16n8k16's A fragment; D: d[4j + i] = C fragment of columns 8j...
constexpr int kMaxWgOps = 32;  // wgmma's in flight a thread (MLA: 18 for S at latent 576)
struct WgOp { float* d[128]; uint a[128][4]; const char* b; uint64_t desc; int n, trans, bf16, scale_d; };
struct WgSlots { std::barrier<>* bar; WgOp ops[kMaxWgOps]; };
static WgSlots g_wgs[kMaxWarps / 4];
thread_local int t_wg_ops = 0;  // wgmma's this thread issued and not yet performed
thread_local int t_wg_ends[kMaxWgOps], t_wg_groups = 0;  // t_wg_ops at each commit not yet waited for
inline WgSlots& my_wg() { return g_wgs[t_linear / 128]; }
inline uint64_t pagedkv_wg_desc_bits(unsigned lbo, unsigned sbo) {
  return (static_cast<uint64_t>((lbo >> 4) & 0x3FFFu) << 16) | (static_cast<uint64_t>((sbo >> 4) & 0x3FFFu) << 32);
}
inline void wgmma_emu(int n, int trans, int bf16, float* d, const void* a, const void* b, unsigned lbo,
                      unsigned sbo, int scale_d) {
  if (t_wg_ops == kMaxWgOps) std::abort();  // more wgmma's in flight than the emulator holds
  WgOp& op = my_wg().ops[t_wg_ops++];
  int t = t_linear % 128;
  op.d[t] = d;
  std::memcpy(op.a[t], a, 16);
  if (t == 0) { op.b = static_cast<const char*>(b); op.desc = pagedkv_wg_desc_bits(lbo, sbo); op.n = n;
                op.trans = trans; op.bf16 = bf16; op.scale_d = scale_d; }
}
inline float wg_a(const WgOp& op, int row, int k) {  // A[row][k] from the fragment of the thread holding it
  int w = row / 16, r = row % 16;
  int t = 32 * w + 4 * (r % 8) + (k % 8) / 2, i = (r / 8) * 2 + (k % 2) + 4 * (k / 8);
  return op.bf16 ? half_of<nv_bfloat16>(op.a[t][i / 2], i % 2) : half_of<half>(op.a[t][i / 2], i % 2);
}
inline float wg_b(const WgOp& op, int k, int n) {  // B[k][n] through the descriptor's strides
  size_t lbo = ((op.desc >> 16) & 0x3FFFu) << 4, sbo = ((op.desc >> 32) & 0x3FFFu) << 4;
  size_t at = op.trans ? (k % 8) * 16 + (n % 8) * 2 + (n / 8) * sbo + (k / 8) * lbo
                       : (n % 8) * 16 + (k % 8) * 2 + (k / 8) * lbo + (n / 8) * sbo;
  uint16_t bits;
  std::memcpy(&bits, op.b + at, 2);
  return op.bf16 ? half_of<nv_bfloat16>(bits, 0) : half_of<half>(bits, 0);
}
inline void pagedkv_wg_fence() {}
inline void pagedkv_wg_commit() { t_wg_ends[t_wg_groups++] = t_wg_ops; }
inline void pagedkv_proxy_fence() {}
inline void pagedkv_store_before_wait(void* p, float v) { *static_cast<float*>(p) = v; }
// wait_group `pending`: perform the wgmma's of every committed group but the newest `pending` (in issue order),
// then move the rest to the front of the slots.
inline void wg_wait(int pending) {
  WgSlots& wg = my_wg();
  wg.bar->arrive_and_wait();  // every thread's A recorded
  int t = t_linear % 128, w = t / 32, l = t % 32;
  int done = t_wg_groups > pending ? t_wg_ends[t_wg_groups - pending - 1] : 0;
  for (int o = 0; o < done; ++o) {
    const WgOp& op = wg.ops[o];
    for (int j = 0; j < op.n / 8; ++j)
      for (int i = 0; i < 4; ++i) {
        int row = 16 * w + l / 4 + 8 * (i / 2), col = 8 * j + 2 * (l % 4) + i % 2;
        float acc = 0.f;
        for (int k = 0; k < 16; ++k) acc += wg_a(op, row, k) * wg_b(op, k, col);
        op.d[t][4 * j + i] = (op.scale_d ? op.d[t][4 * j + i] : 0.f) + acc;  // scale-d 0: D = A B
      }
  }
  wg.bar->arrive_and_wait();  // every thread done reading the performed slots
  for (int o = done; o < t_wg_ops; ++o) {
    WgOp& to = wg.ops[o - done];
    const WgOp& from = wg.ops[o];
    to.d[t] = from.d[t];
    std::memcpy(to.a[t], from.a[t], 16);
    if (t == 0) { to.b = from.b; to.desc = from.desc; to.n = from.n; to.trans = from.trans; to.bf16 = from.bf16;
                  to.scale_d = from.scale_d; }
  }
  int left = t_wg_groups > pending ? pending : t_wg_groups;
  for (int g = 0; g < left; ++g) t_wg_ends[g] = t_wg_ends[t_wg_groups - left + g] - done;
  t_wg_groups = left;
  t_wg_ops -= done;
  wg.bar->arrive_and_wait();  // slots settled for the next issue
}
inline void pagedkv_wg_wait0() { wg_wait(0); }
inline void pagedkv_wg_wait1() { wg_wait(1); }
#define PAGEDKV_WGMMA_HELPERS
#define PAGEDKV_WGMMA_EMU(N, P, BF, TR) \
  inline void pagedkv_wgmma_n##N##_##P##_t##TR(float* d, const void* a, const void* b, unsigned off, unsigned lbo, \
                                               unsigned sbo, int scale_d) { \
    wgmma_emu(N, TR, BF, d, a, static_cast<const char*>(b) + off, lbo, sbo, scale_d); }
#define PAGEDKV_WGMMA_EMU_N(N) \
  PAGEDKV_WGMMA_EMU(N, f16, 0, 0) PAGEDKV_WGMMA_EMU(N, f16, 0, 1) PAGEDKV_WGMMA_EMU(N, bf16, 1, 0) \
  PAGEDKV_WGMMA_EMU(N, bf16, 1, 1) inline void pagedkv_wg_acc_fence_n##N(float*) {}
PAGEDKV_WGMMA_EMU_N(32) PAGEDKV_WGMMA_EMU_N(64) PAGEDKV_WGMMA_EMU_N(128) PAGEDKV_WGMMA_EMU_N(256)
inline void pagedkv_wg_reg_fence(void*, int) {}

// Run `body` (the kernel call) for every block of a grid (gx, gy, gz), the block's bx * by * bz threads (a
// multiple of 32, at most 1024) as CPU threads in lock step, thread t being threadIdx (t % bx, t / bx % by,
// t / (bx * by)).
template <class F>
void launch3(int grid_x, int grid_y, int grid_z, int bx, int by, int bz, F body) {
  const int nthreads = bx * by * bz, nwarps = nthreads / 32;
  std::barrier<> block_bar(nthreads);
  for (int w = 0; w < nwarps; ++w) g_warps[w].bar = new std::barrier<>(32);
  for (int g = 0; g < nthreads / 128; ++g) g_wgs[g].bar = new std::barrier<>(128);
  g_block_barrier = &block_bar;
  std::vector<std::thread> threads;
  for (int t = 0; t < nthreads; ++t) {
    threads.emplace_back([=, &block_bar]() {
      t_linear = t;
      threadIdx = Dim3{t % bx, t / bx % by, t / (bx * by)};
      for (int bz = 0; bz < grid_z; ++bz) {
        for (int byi = 0; byi < grid_y; ++byi) {
          for (int bxi = 0; bxi < grid_x; ++bxi) {
            blockIdx = Dim3{bxi, byi, bz};
            body();
            t_groups.assign(1, {});
            block_bar.arrive_and_wait();  // the block's statics (shared memory) are reused by the next one
            if (t == 0)  // every thread of the block is past its body: no named barrier may be partly arrived
              for (int id = 1; id < 16; ++id)
                if (g_named[id].count) { std::fprintf(stderr, "named barrier %d left with %d arrivals\n", id, g_named[id].count); std::abort(); }
            block_bar.arrive_and_wait();
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int w = 0; w < nwarps; ++w) delete g_warps[w].bar;
  for (int g = 0; g < nthreads / 128; ++g) delete g_wgs[g].bar;
}

// A 2-D grid of 1-D blocks (the prefill kernels).
template <class F>
void launch(int grid_x, int grid_y, F body) { launch3(grid_x, grid_y, 1, kThreads, 1, 1, body); }
