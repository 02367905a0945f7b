// Allocation failures where they can be provoked only by making the allocator fail: this executable defines
// aligned_alloc (which the attention kernel's scratch and every std::aligned_alloc in the process then call), passing
// through to posix_memalign unless a test arms it. Its own executable, so the other tests never run through it; left
// out under AddressSanitizer (whose allocator the definition would bypass for aligned_alloc alone: the tests skip).
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include "posenc/attention.hpp"

namespace {
std::atomic<int> g_fail_next{0};          // aligned_alloc calls left to fail
std::atomic<std::size_t> g_fail_min{0};   // ... of at least this many bytes
}  // namespace

#if !defined(__SANITIZE_ADDRESS__)
extern "C" void* aligned_alloc(std::size_t alignment, std::size_t size) {
  if (size >= g_fail_min.load() && g_fail_next.load() > 0 && g_fail_next.fetch_sub(1) > 0) return nullptr;
  void* p = nullptr;
  if (posix_memalign(&p, alignment < sizeof(void*) ? sizeof(void*) : alignment, size) != 0) return nullptr;
  return p;
}
#endif

namespace {

struct Shape {
  int tokens, head_dim;
  std::vector<float> q, k, v, out;
  std::vector<int64_t> pos;
  Shape(int n, int d) : tokens(n), head_dim(d), pos(static_cast<std::size_t>(n)) {
    const std::size_t e = static_cast<std::size_t>(n) * 4 * d;  // [tokens, 4 heads, head_dim]
    q.resize(e);
    k.resize(e);
    v.resize(e);
    out.assign(e, 0.0f);
    for (std::size_t i = 0; i < e; ++i) {
      q[i] = static_cast<float>((i * 37) % 101) / 101.0f - 0.5f;
      k[i] = static_cast<float>((i * 53) % 97) / 97.0f - 0.5f;
      v[i] = static_cast<float>((i * 71) % 89) / 89.0f - 0.5f;
    }
    std::iota(pos.begin(), pos.end(), int64_t{0});
  }
  void run() {
    posenc::AttentionSpec spec;
    spec.heads = 4;
    spec.kv_heads = 4;
    spec.head_dim = head_dim;
    spec.mask = posenc::MaskKind::causal;
    const std::vector<posenc::KvBlock> kv{{k.data(), v.data(), pos.data(), tokens}};
    posenc::AttentionOptions opt;
    opt.num_threads = 1;  // the calling thread's scratch
    posenc::attention_forward(spec, q.data(), pos, kv, out.data(), opt);
  }
};

}  // namespace

// The attention kernel's per-thread scratch grows on demand. A growth that failed freed the old buffer and kept its
// capacity: the next call that fitted the old capacity got a null buffer and crashed (found by an adversary after the
// decode team started handing std::bad_alloc back to the caller). Now a failed growth keeps the old buffer: the
// failing call throws std::bad_alloc, and a later call of the old size gives the bits it gave before.
TEST(AllocationFailure, AttentionScratchSurvivesAFailedGrowth) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer's allocator: the aligned_alloc of this executable would bypass it";
#else
  // The scratch's sizes follow head_dim (the same tokens: the same key tiles).
  Shape small(40, 32), large(40, 256);
  small.run();
  const std::vector<float> expected = small.out;
  g_fail_next = 1;  // the large call's first aligned allocation
  EXPECT_THROW(large.run(), std::bad_alloc);
  EXPECT_EQ(g_fail_next.load(), 0) << "no allocation failed: the large call did not grow the scratch";
  g_fail_next = 0;
  std::fill(small.out.begin(), small.out.end(), 0.0f);
  small.run();
  EXPECT_EQ(small.out, expected);
  large.run();  // and growing works again
#endif
}
