// A CPU stand-in for the CUDA the tensor-core prefill kernel and the staged decode kernel use, so that TVM's
// generated kernel source runs on the build host (tests/cpu/test_prefill_tc_emulated.py,
// tests/cpu/test_decode_staged_emulated.py, tests/cpu/test_mla_tc_emulated.py): one fiber per CUDA thread of a
// block (3-D blocks and grids; all of a block's fibers on one OS thread, switched only where a thread waits),
// __syncthreads as a block barrier, dynamic shared memory as a static array (the test rewrites the kernel's extern
// declaration), and the warp-collective pieces (shfl_xor, ldmatrix, mma.sync) as exchanges through per-warp
// slots between warp barriers, computed from the PTX ISA's definitions; wgmma as a warpgroup collective (below);
// named barriers (bar.sync / bar.arrive) by phase counts. cp.async completes at the latest point its wait allows
// (below). A block whose threads all wait on barriers that can no longer complete (arrivals and waits out of
// balance) aborts naming them.
#undef _FORTIFY_SOURCE  // _longjmp between fiber stacks (glibc's checked longjmp refuses other stacks)
#include <chrono>
#include <csetjmp>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <functional>
#include <map>
#include <ucontext.h>
#include <utility>
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
// TVM's 2-lane vector stores (a thread's column pair of O): float2 and the 16-bit pairs, element-wise.
struct float2 { float x, y; };
inline float2 make_float2(float x, float y) { return float2{x, y}; }
struct half2 { half x, y; };
struct nv_bfloat162 { nv_bfloat16 x, y; };
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fmul_rn(float a, float b) { return a * b; }  // the tests compile without FMA contraction
// CUDA's max / min of two floats are fmaxf / fminf: a NaN argument gives the other one (what the kernels' running
// max does with a NaN score; issue 44's NaN tests depend on it), where a > b ? a : b would depend on the order.
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }

struct Dim3 { int x, y, z; };
// Threads of a block: the kernel's __launch_bounds__ (the test defines it before including this file).
#ifndef PAGEDKV_EMU_THREADS
#define PAGEDKV_EMU_THREADS 128
#endif
constexpr int kThreads = PAGEDKV_EMU_THREADS, kMaxWarps = 32;
constexpr int kMaxWgOps = 64;  // wgmma's in flight a thread (MLA wgq: 36 for S at latent 576 + P V's)
struct CpAsync { void* dst; const void* src; };

// A CUDA thread: its context, stack and per-thread state (what thread_local held with one OS thread each).
struct Fiber {
  jmp_buf jb;
  ucontext_t uc;
  std::vector<char> stack;
  Dim3 tidx;
  int linear = 0;
  bool started = false, done = false;
  std::vector<std::vector<CpAsync>> groups = std::vector<std::vector<CpAsync>>(1);  // cp.async groups
  int wg_ops = 0, wg_ends[kMaxWgOps] = {}, wg_groups = 0;  // wgmma's in flight, commit marks
};
static Fiber* g_cur;           // the fiber running
static jmp_buf g_sched;        // the scheduler (launch3)
static long g_moves;           // arrivals, passed waits and finished fibers: progress, for deadlock detection
static const char* g_wait_what = "";  // what the fibers last blocked on (the deadlock message)
static Dim3 blockIdx;
#define threadIdx (g_cur->tidx)
// Linear thread id in the block (x fastest, then y, z: how CUDA forms warps).
#define t_linear (g_cur->linear)
#define t_groups (g_cur->groups)
#define t_wg_ops (g_cur->wg_ops)
#define t_wg_ends (g_cur->wg_ends)
#define t_wg_groups (g_cur->wg_groups)
inline void emu_yield() {
  if (!_setjmp(g_cur->jb)) _longjmp(g_sched, 1);
}
template <class P>
inline void emu_wait(P done, const char* what) {
  while (!done()) { g_wait_what = what; emu_yield(); }
  ++g_moves;
}
// A barrier of n fibers (the interface of std::barrier's arrive_and_wait).
struct FBar {
  int n, count = 0;
  long phase = 0;
  const char* what;
  FBar(int n, const char* what) : n(n), what(what) {}
  void arrive_and_wait() {
    long ph = phase;
    ++g_moves;
    if (++count == n) { count = 0; ++phase; return; }
    emu_wait([&] { return phase != ph; }, what);
  }
};
static FBar* g_block_barrier;
struct WarpSlots {
  FBar* bar;
  float f[32];
  uint a[32][4], b[32][2];
  const void* p[32];
};
static WarpSlots g_warps[kMaxWarps];
inline int lane_id() { return t_linear % 32; }
inline WarpSlots& my_warp() { return g_warps[t_linear / 32]; }
inline void warp_sync() { my_warp().bar->arrive_and_wait(); }
inline void land_some_copies();  // below (cp.async)
inline void __syncthreads() {
  land_some_copies();
  g_block_barrier->arrive_and_wait();
}
inline void __syncwarp(unsigned = 0xFFFFFFFFu) { warp_sync(); }

// Named barriers (bar.sync / bar.arrive id, n; ids 1..15, id 0 is __syncthreads): a phase completes when n
// threads have arrived, counting those that wait (bar.sync) and those that only arrive (bar.arrive). A block that
// ends with a barrier partly arrived aborts (launch3), as does one whose waits can no longer complete.
struct NamedBar { int count = 0; long phase = 0; };
static NamedBar g_named[16];
inline long named_arrive(int id, int n) {
  NamedBar& b = g_named[id];
  long ph = b.phase;
  ++g_moves;
  if (++b.count == n) { b.count = 0; ++b.phase; }
  return ph;
}
inline void pagedkv_bar_arrive(int id, int n) { named_arrive(id, n); }
inline void pagedkv_bar_sync(int id, int n) {
  long ph = named_arrive(id, n);
  NamedBar& b = g_named[id];
  emu_wait([&] { return b.phase != ph; }, "a named barrier (bar.sync)");
}

inline float __shfl_xor_sync(uint, float v, int mask, int) {
  WarpSlots& w = my_warp();
  w.f[lane_id()] = v;
  warp_sync();
  float r = w.f[lane_id() ^ mask];
  warp_sync();
  return r;
}

// __shfl_sync: lane src of the caller's group of `width` lanes (the SIMT prefill's P broadcast).
inline float __shfl_sync(uint, float v, int src, int width) {
  WarpSlots& w = my_warp();
  w.f[lane_id()] = v;
  warp_sync();
  float r = w.f[(lane_id() & ~(width - 1)) + (src & (width - 1))];
  warp_sync();
  return r;
}

// __ballot_sync: bit l set where lane l's predicate is non-zero (every lane of the warp must call it).
inline uint __ballot_sync(uint, int pred) {
  WarpSlots& w = my_warp();
  w.a[lane_id()][0] = pred != 0;
  warp_sync();
  uint r = 0;
  for (int l = 0; l < 32; ++l) r |= (w.a[l][0] ? 1u : 0u) << l;
  warp_sync();
  return r;
}
inline int __popc(uint x) { return __builtin_popcount(x); }

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
  // The lane's outputs straight from the fragments: A (row, k) is element (k & 1) + 2 (row >= 8) + 4 (k >= 8) of
  // lane 4 (row % 8) + (k % 8) / 2; B (k, n) element (k & 1) + 2 (k >= 8) of lane 4 n + (k % 8) / 2.
  for (int i = 0; i < 4; ++i) {
    int row = l / 4 + (i >= 2 ? 8 : 0), col = 2 * (l % 4) + (i & 1);
    float acc = 0.f;
    for (int k = 0; k < 16; ++k) {
      int ia = (k & 1) + (row >= 8 ? 2 : 0) + (k >= 8 ? 4 : 0), ib = (k & 1) + (k >= 8 ? 2 : 0);
      acc += half_of<T16>(w.a[4 * (row % 8) + (k % 8) / 2][ia / 2], ia & 1) *
             half_of<T16>(w.b[4 * col + (k % 8) / 2][ib / 2], ib & 1);
    }
    d[i] += acc;
  }
  warp_sync();
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
// A committed group may also land earlier, at any point before its wait: at each block barrier a thread lands a
// random number of its oldest committed groups. So a copy never waited for (or waited too late) can land on
// memory the block has since reused, as on the GPU (the tc prefill tiles' Q rows of a block without key tiles,
// left unwaited and then overwritten by the staged O: found by the GPU suite on the H100).
inline uint32_t emu_rand();
inline void land_some_copies() {
  size_t closed = g_cur->groups.size() - 1;
  if (closed) cp_async_wait(closed - emu_rand() % (closed + 1));
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
// SS form (pagedkv_wgmma_ss_*): A too from shared memory, K-major through its own descriptor (a_sm not null).
struct WgOp { float* d[128]; uint a[128][4]; const char* b; uint64_t desc; int n, trans, bf16, scale_d, swz;
              const char* a_sm; uint64_t a_desc; int a_swz; };
struct WgSlots { FBar* bar; WgOp ops[kMaxWgOps]; };
static WgSlots g_wgs[kMaxWarps / 4];
// t_wg_ops (Fiber::wg_ops): wgmma's this thread issued and not yet performed; t_wg_ends: t_wg_ops at each commit
// not yet waited for.
inline WgSlots& my_wg() { return g_wgs[t_linear / 128]; }
inline uint64_t pagedkv_wg_desc_bits(unsigned lbo, unsigned sbo) {
  return (static_cast<uint64_t>((lbo >> 4) & 0x3FFFu) << 16) | (static_cast<uint64_t>((sbo >> 4) & 0x3FFFu) << 32);
}
inline void wgmma_emu(int n, int trans, int bf16, float* d, const void* a, const void* b, unsigned lbo,
                      unsigned sbo, int scale_d, int swz) {
  if (t_wg_ops == kMaxWgOps) std::abort();  // more wgmma's in flight than the emulator holds
  WgOp& op = my_wg().ops[t_wg_ops++];
  int t = t_linear % 128;
  op.d[t] = d;
  std::memcpy(op.a[t], a, 16);
  if (t == 0) { op.b = static_cast<const char*>(b); op.desc = pagedkv_wg_desc_bits(lbo, sbo); op.n = n;
                op.trans = trans; op.bf16 = bf16; op.scale_d = scale_d; op.swz = swz; op.a_sm = nullptr; }
}
inline void wgmma_ss_emu(int n, int trans, int bf16, float* d, const void* a, unsigned a_lbo, unsigned a_sbo,
                         int a_swz, const void* b, unsigned lbo, unsigned sbo, int swz, int scale_d) {
  wgmma_emu(n, trans, bf16, d, a, b, lbo, sbo, scale_d, swz);  // A's 16 bytes copied from shared: not used
  WgOp& op = my_wg().ops[t_wg_ops - 1];
  if (t_linear % 128 == 0) { op.a_sm = static_cast<const char*>(a); op.a_desc = pagedkv_wg_desc_bits(a_lbo, a_sbo);
                             op.a_swz = a_swz; }
}
// Element (row, k) of a K-major operand at `base` (B: row = n) through descriptor strides; swizzle as below.
inline const char* wg_kmajor(const char* base, uint64_t desc, int swz, int row, int k) {
  size_t lbo = ((desc >> 16) & 0x3FFFu) << 4, sbo = ((desc >> 32) & 0x3FFFu) << 4;
  if (swz == 1) {
    uintptr_t addr = reinterpret_cast<uintptr_t>(base) + (row / 8) * sbo + (row % 8) * 128 + k * 2;
    return reinterpret_cast<const char*>(addr ^ (((addr >> 7) & 7u) << 4));
  }
  if (swz != 0) std::abort();  // only no swizzle and 128-byte swizzle are emulated
  return base + (row % 8) * 16 + (k % 8) * 2 + (k / 8) * lbo + (row / 8) * sbo;
}
inline float wg_a(const WgOp& op, int row, int k) {  // A[row][k] from the fragment of the thread holding it
  if (op.a_sm) {  // SS: from shared memory at the wait (as late as the ISA allows)
    uint16_t bits;
    std::memcpy(&bits, wg_kmajor(op.a_sm, op.a_desc, op.a_swz, row, k), 2);
    return op.bf16 ? half_of<nv_bfloat16>(bits, 0) : half_of<half>(bits, 0);
  }
  int w = row / 16, r = row % 16;
  int t = 32 * w + 4 * (r % 8) + (k % 8) / 2, i = (r / 8) * 2 + (k % 2) + 4 * (k / 8);
  return op.bf16 ? half_of<nv_bfloat16>(op.a[t][i / 2], i % 2) : half_of<half>(op.a[t][i / 2], i % 2);
}
// 128-byte swizzle (layout type 1): the 16-byte chunk bits 4-6 of the address the wgmma forms XOR its bits 7-9
// (on absolute shared addresses: the emulator's are host addresses, which the kernels align the same way);
// K-major: (n, k) at (n/8)*SBO + (n%8)*128 + k*2, LBO unused; MN-major: (k, n) at (n/64)*LBO + (k/8)*SBO +
// (k%8)*128 + (n%64)*2.
inline float wg_b(const WgOp& op, int k, int n) {  // B[k][n] through the descriptor's strides
  size_t lbo = ((op.desc >> 16) & 0x3FFFu) << 4, sbo = ((op.desc >> 32) & 0x3FFFu) << 4;
  const char* p;
  if (op.swz == 1) {
    size_t at = op.trans ? (n / 64) * lbo + (k / 8) * sbo + (k % 8) * 128 + (n % 64) * 2
                         : (n / 8) * sbo + (n % 8) * 128 + k * 2;
    uintptr_t addr = reinterpret_cast<uintptr_t>(op.b) + at;
    p = reinterpret_cast<const char*>(addr ^ (((addr >> 7) & 7u) << 4));
  } else {
    if (op.swz != 0) std::abort();  // only no swizzle and 128-byte swizzle are emulated
    size_t at = op.trans ? (k % 8) * 16 + (n % 8) * 2 + (n / 8) * sbo + (k / 8) * lbo
                         : (n % 8) * 16 + (k % 8) * 2 + (k / 8) * lbo + (n / 8) * sbo;
    p = op.b + at;
  }
  uint16_t bits;
  std::memcpy(&bits, p, 2);
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
                  to.scale_d = from.scale_d; to.swz = from.swz; to.a_sm = from.a_sm; to.a_desc = from.a_desc;
                  to.a_swz = from.a_swz; }
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
                                               unsigned sbo, int scale_d, int swz) { \
    wgmma_emu(N, TR, BF, d, a, static_cast<const char*>(b) + off, lbo, sbo, scale_d, swz); }
#define PAGEDKV_WGMMA_SS_EMU(N, P, BF, TR) \
  inline void pagedkv_wgmma_ss_n##N##_##P##_t##TR(float* d, const void* a, unsigned a_off, unsigned a_lbo, \
                                                  unsigned a_sbo, int a_swz, const void* b, unsigned off, \
                                                  unsigned lbo, unsigned sbo, int swz, int scale_d) { \
    wgmma_ss_emu(N, TR, BF, d, static_cast<const char*>(a) + a_off, a_lbo, a_sbo, a_swz, \
                 static_cast<const char*>(b) + off, lbo, sbo, swz, scale_d); }
#define PAGEDKV_WGMMA_EMU_N(N) \
  PAGEDKV_WGMMA_EMU(N, f16, 0, 0) PAGEDKV_WGMMA_EMU(N, f16, 0, 1) PAGEDKV_WGMMA_EMU(N, bf16, 1, 0) \
  PAGEDKV_WGMMA_EMU(N, bf16, 1, 1) PAGEDKV_WGMMA_SS_EMU(N, f16, 0, 0) PAGEDKV_WGMMA_SS_EMU(N, f16, 0, 1) \
  PAGEDKV_WGMMA_SS_EMU(N, bf16, 1, 0) PAGEDKV_WGMMA_SS_EMU(N, bf16, 1, 1) \
  inline void pagedkv_wg_acc_fence_n##N(float*) {}
PAGEDKV_WGMMA_EMU_N(32) PAGEDKV_WGMMA_EMU_N(64) PAGEDKV_WGMMA_EMU_N(128) PAGEDKV_WGMMA_EMU_N(256)
inline void pagedkv_wg_reg_fence(void*, int) {}

// Shared-memory accesses kept opaque to TVM's barrier planner (tir_kernels/_wgmma_cuda.py): plain accesses here.
#define PAGEDKV_SHARED_OPAQUE
inline void pagedkv_st_shared_f32(void* p, float v) { std::memcpy(p, &v, 4); }
inline float pagedkv_ld_shared_f32(const void* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}
inline void pagedkv_st_shared_zero16(void* p) { std::memset(p, 0, 16); }
inline void pagedkv_st_shared_b32(void* p, const void* src) { std::memcpy(p, src, 4); }
inline int pagedkv_warp_uniform(int x) { return x; }

// TMA and mbarriers (tir_kernels/_tma_cuda.py). A tensor map is the struct the test's launcher fills from the
// kernel's encode arguments (on the GPU the host code encodes a CUtensorMap). A box copy is queued on its
// mbarrier and lands when a thread waits on the phase after its arrivals are in (as late as the ISA allows: a
// stage read before its wait shows stale data), the 128-byte swizzle applied to the shared addresses and zeros
// past the tensor's dims; its bytes then count down the expected transaction bytes, which must reach 0 exactly.
// A block may not end with copies queued or a phase partly arrived.
#define __grid_constant__
struct CUtensorMap { const char* base; int rank, elem_bytes, swizzle; uint64_t dims[5], strides[5]; uint32_t box[5]; };
struct TmaCopy { char* dst; const CUtensorMap* map; int c[5]; };
struct MBar { int count = 0, arrived = 0; long completed = 0, tx = 0; std::vector<TmaCopy> copies; };
static std::map<uintptr_t, MBar> g_mbars;  // by address, cleared at each block
#define PAGEDKV_TMA_HELPERS
inline unsigned pagedkv_smem_addr(const void* p) { return static_cast<unsigned>(reinterpret_cast<uintptr_t>(p)); }
inline int pagedkv_sw128_pad(const void* p, int elem_bytes) {
  return static_cast<int>((1024u - (reinterpret_cast<uintptr_t>(p) & 1023u)) & 1023u) / elem_bytes;
}
inline MBar& mbar_at(void* bar) {
  auto it = g_mbars.find(reinterpret_cast<uintptr_t>(bar));
  if (it == g_mbars.end()) { std::fprintf(stderr, "mbarrier used before its init\n"); std::abort(); }
  return it->second;
}
inline void pagedkv_mbar_init(void* bar, int count) { g_mbars[reinterpret_cast<uintptr_t>(bar)] = MBar{count}; }
inline void pagedkv_mbar_expect_tx(void* bar, int bytes) {
  MBar& b = mbar_at(bar);
  b.tx += bytes;
  if (++b.arrived > b.count) { std::fprintf(stderr, "mbarrier: more arrivals than its count\n"); std::abort(); }
  ++g_moves;
}
// A plain arrival (no transaction bytes): a phase without copies completes with its last arrival.
inline void pagedkv_mbar_arrive(void* bar) {
  MBar& b = mbar_at(bar);
  if (++b.arrived > b.count) { std::fprintf(stderr, "mbarrier: more arrivals than its count\n"); std::abort(); }
  if (b.arrived == b.count && b.copies.empty() && b.tx == 0) { b.arrived = 0; ++b.completed; }
  ++g_moves;
}
inline void tma_land(const TmaCopy& c) {
  const CUtensorMap& m = *c.map;
  uint32_t n = 1;
  for (int r = 0; r < m.rank; ++r) n *= m.box[r];
  for (uint32_t lin = 0; lin < n; ++lin) {
    uint32_t rest = lin;
    bool inside = true;
    const char* src = m.base;
    for (int r = 0; r < m.rank; ++r) {
      int64_t at = static_cast<int64_t>(c.c[r]) + rest % m.box[r];
      rest /= m.box[r];
      inside = inside && at >= 0 && static_cast<uint64_t>(at) < m.dims[r];
      src += at * static_cast<int64_t>(m.strides[r]);
    }
    uintptr_t addr = reinterpret_cast<uintptr_t>(c.dst) + static_cast<uintptr_t>(lin) * m.elem_bytes;
    if (m.swizzle == 3) addr ^= ((addr >> 7) & 7u) << 4;
    else if (m.swizzle != 0) std::abort();  // only no swizzle and 128-byte swizzle are emulated
    if (inside) std::memcpy(reinterpret_cast<void*>(addr), src, m.elem_bytes);
    else std::memset(reinterpret_cast<void*>(addr), 0, m.elem_bytes);
  }
}
inline void pagedkv_tma_load3(void* dst, void* bar, unsigned long long map, int c0, int c1, int c2) {
  const CUtensorMap* m = reinterpret_cast<const CUtensorMap*>(map);
  if (m->rank != 3) std::abort();
  mbar_at(bar).copies.push_back(TmaCopy{static_cast<char*>(dst), m, {c0, c1, c2, 0, 0}});
}
inline void pagedkv_tma_load5(void* dst, void* bar, unsigned long long map, int c0, int c1, int c2, int c3, int c4) {
  const CUtensorMap* m = reinterpret_cast<const CUtensorMap*>(map);
  if (m->rank != 5) std::abort();
  mbar_at(bar).copies.push_back(TmaCopy{static_cast<char*>(dst), m, {c0, c1, c2, c3, c4}});
}
inline void pagedkv_mbar_wait(void* bar, int parity) {
  MBar& b = mbar_at(bar);
  emu_wait([&] {
    if ((b.completed & 1) != parity) return true;  // the phase of this parity is complete
    if (b.arrived < b.count) return false;
    for (const TmaCopy& c : b.copies) {
      const CUtensorMap& m = *c.map;
      long bytes = m.elem_bytes;
      for (int r = 0; r < m.rank; ++r) bytes *= m.box[r];
      tma_land(c);
      b.tx -= bytes;
    }
    b.copies.clear();
    if (b.tx < 0) { std::fprintf(stderr, "mbarrier: copies landed more bytes than expected\n"); std::abort(); }
    if (b.tx > 0) return false;  // expected bytes that no copy brings: waits forever (a deadlock)
    b.arrived = 0;
    ++b.completed;
    return true;
  }, "an mbarrier (TMA copies)");
}
inline void mbars_end_of_block() {
  for (auto& [addr, b] : g_mbars)
    if (!b.copies.empty() || b.arrived) {
      std::fprintf(stderr, "block ended with an mbarrier phase armed (%d arrivals, %zu copies queued)\n",
                   b.arrived, b.copies.size());
      std::abort();
    }
  g_mbars.clear();
}

// Run `body` (the kernel call) for every block of a grid (gx, gy, gz), the block's bx * by * bz threads (a
// multiple of 32, at most 1024) as CPU threads in lock step, thread t being threadIdx (t % bx, t / bx % by,
// t / (bx * by)).
// The body of the fibers of the block running (a fiber starts in fiber_main through makecontext).
static std::function<void()> g_body;
static void fiber_main() {
  g_body();
  g_cur->done = true;
  ++g_moves;
  _longjmp(g_sched, 1);
}
constexpr size_t kFiberStack = 256 * 1024;

// Runs the fibers of one block until all are done; each runs until it waits (or ends). The order is random, and
// in a round a fiber is left waiting with probability 1/4 (a slow thread), so that a missing wait or barrier
// shows as stale data whatever the order the threads happen to reach it in; a round that moves nothing runs
// every fiber, and one that still moves nothing is a deadlock.
// The schedule's seed: $PAGEDKV_EMU_SEED, else the clock (printed at each launch: a failure shows it).
static uint64_t g_rng = 0;
inline void emu_seed() {
  const char* env = std::getenv("PAGEDKV_EMU_SEED");
  uint64_t seed = env ? std::strtoull(env, nullptr, 10)
                      : static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  std::fprintf(stderr, "emulator schedule seed %llu (PAGEDKV_EMU_SEED)\n", static_cast<unsigned long long>(seed));
  g_rng = seed * 0x9E3779B97F4A7C15ull | 1;
}
inline uint32_t emu_rand() {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return static_cast<uint32_t>(g_rng >> 11);
}
inline void run_block(std::vector<Fiber>& fibers) {
  const int n = static_cast<int>(fibers.size());
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  int live = n;
  bool stalled = false;
  while (live > 0) {
    long before = g_moves;
    for (int i = n - 1; i > 0; --i) std::swap(order[i], order[emu_rand() % (i + 1)]);
    for (int i : order) {
      Fiber& f = fibers[i];
      if (f.done || (!stalled && emu_rand() % 4 == 0)) continue;
      g_cur = &f;
      if (!_setjmp(g_sched)) {
        if (!f.started) { f.started = true; setcontext(&f.uc); }
        _longjmp(f.jb, 1);
      }
      if (f.done) --live;
    }
    if (live > 0 && g_moves == before) {
      if (stalled) {
        std::fprintf(stderr, "deadlock: every live thread waits on %s that cannot complete\n", g_wait_what);
        std::abort();
      }
      stalled = true;
    } else {
      stalled = false;
    }
  }
}

// Blocks of bx x by x bz threads (a multiple of 32, at most 1024), one after another, each thread a fiber: thread
// t is threadIdx (t % bx, t / bx % by, t / (bx * by)).
template <class F>
void launch3(int grid_x, int grid_y, int grid_z, int bx, int by, int bz, F body) {
  const int nthreads = bx * by * bz, nwarps = nthreads / 32;
  FBar block_bar(nthreads, "__syncthreads");
  for (int w = 0; w < nwarps; ++w) g_warps[w].bar = new FBar(32, "a warp collective");
  for (int g = 0; g < nthreads / 128; ++g) g_wgs[g].bar = new FBar(128, "a warpgroup collective (wgmma wait)");
  g_block_barrier = &block_bar;
  g_body = body;
  emu_seed();
  std::vector<Fiber> fibers(nthreads);
  for (int t = 0; t < nthreads; ++t) {
    fibers[t].stack.resize(kFiberStack);
    fibers[t].linear = t;
    fibers[t].tidx = Dim3{t % bx, t / bx % by, t / (bx * by)};
  }
  for (int bzi = 0; bzi < grid_z; ++bzi) {
    for (int byi = 0; byi < grid_y; ++byi) {
      for (int bxi = 0; bxi < grid_x; ++bxi) {
        blockIdx = Dim3{bxi, byi, bzi};
        for (Fiber& f : fibers) {  // copies still queued when a block ends are dropped
          f.started = f.done = false;
          f.groups.assign(1, {});
          f.wg_ops = f.wg_groups = 0;
          getcontext(&f.uc);
          f.uc.uc_stack.ss_sp = f.stack.data();
          f.uc.uc_stack.ss_size = f.stack.size();
          f.uc.uc_link = nullptr;
          makecontext(&f.uc, fiber_main, 0);
        }
        run_block(fibers);
        mbars_end_of_block();
        for (int id = 1; id < 16; ++id)  // every thread is past its body: no named barrier may be partly arrived
          if (g_named[id].count) {
            std::fprintf(stderr, "named barrier %d left with %d arrivals\n", id, g_named[id].count);
            std::abort();
          }
      }
    }
  }
  for (int w = 0; w < nwarps; ++w) delete g_warps[w].bar;
  for (int g = 0; g < nthreads / 128; ++g) delete g_wgs[g].bar;
}

// A 2-D grid of 1-D blocks (the prefill kernels).
template <class F>
void launch(int grid_x, int grid_y, F body) { launch3(grid_x, grid_y, 1, kThreads, 1, 1, body); }
