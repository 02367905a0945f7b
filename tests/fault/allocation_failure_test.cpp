// Allocation failures where they can be provoked only by making the allocator fail: this executable defines
// aligned_alloc (which the attention kernel's scratch and every std::aligned_alloc in the process then call) and the
// replaceable operator new / delete, passing through to posix_memalign / malloc unless a test arms them. Its own
// executable, so the other tests never run through them; left out under AddressSanitizer (whose allocator the
// definitions would bypass: the tests skip).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <omp.h>

#include "model/kernels.hpp"
#include "model/kernels_dense.hpp"
#include "model/raw_model.hpp"
#include "posenc/attention.hpp"
#include "posenc/config.hpp"
#include "posenc/convert.hpp"
#include "posenc/float16.hpp"
#include "posenc/kv_cache.hpp"
#include "posenc/model.hpp"
#include "posenc/precision.hpp"
#include "posenc/rope.hpp"
#include "posenc/tokenizer.hpp"
#include "serve/connection_threads.hpp"
#include "test_support.hpp"

namespace {
std::atomic<int> g_fail_next{0};          // aligned_alloc calls left to fail
std::atomic<std::size_t> g_fail_min{0};   // ... of at least this many bytes
// The sweeps' arming, over operator new and aligned_alloc alike: while g_countdown > 0 each allocation takes one
// from it, and the one that takes the last fails; g_in_region counts the failures made inside an active OpenMP
// parallel region (where an exception that escapes ends the process).
std::atomic<int64_t> g_countdown{0};
std::atomic<int64_t> g_counted{0};        // allocations while g_counting
std::atomic<bool> g_counting{false};
std::atomic<int64_t> g_in_region{0};

bool fail_this_allocation() {
  if (g_counting.load(std::memory_order_relaxed)) g_counted.fetch_add(1);
  if (g_countdown.load(std::memory_order_relaxed) > 0 && g_countdown.fetch_sub(1) == 1) {
    if (omp_in_parallel()) g_in_region.fetch_add(1);
    return true;
  }
  return false;
}

void* aligned_or_null(std::size_t alignment, std::size_t size) {
  void* p = nullptr;
  if (posix_memalign(&p, alignment < sizeof(void*) ? sizeof(void*) : alignment, size == 0 ? 1 : size) != 0)
    return nullptr;
  return p;
}
}  // namespace

#if !defined(__SANITIZE_ADDRESS__)
extern "C" void* aligned_alloc(std::size_t alignment, std::size_t size) {
  if (size >= g_fail_min.load() && g_fail_next.load() > 0 && g_fail_next.fetch_sub(1) > 0) return nullptr;
  if (fail_this_allocation()) return nullptr;
  return aligned_or_null(alignment, size);
}
// The array, nothrow and sized forms of libstdc++ call these two; the deletes free what either returned.
void* operator new(std::size_t size) {
  if (fail_this_allocation()) throw std::bad_alloc();
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t size, std::align_val_t alignment) {
  if (fail_this_allocation()) throw std::bad_alloc();
  if (void* p = aligned_or_null(static_cast<std::size_t>(alignment), size)) return p;
  throw std::bad_alloc();
}
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"  // free of what the operator new above got from malloc
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop
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

namespace {

using namespace posenc;

/// The allocations f() makes.
int64_t allocations_of(const std::function<void()>& f) {
  g_counted = 0;
  g_counting = true;
  f();
  g_counting = false;
  return g_counted.load();
}

/// Runs f() with its n-th allocation (from 1) failing; true when f threw std::bad_alloc (any other exception is
/// the test's failure). *failed: whether f made an n-th allocation (so that one failed). Disarmed on return.
bool throws_when_allocation_fails(int64_t n, const std::function<void()>& f, bool* failed = nullptr) {
  g_countdown = n;
  bool thrown = false;
  try {
    f();
  } catch (const std::bad_alloc&) {
    thrown = true;
  }
  if (failed != nullptr) *failed = g_countdown.load() <= 0;  // (a thread racing the failing one can take it below 0)
  g_countdown = 0;
  return thrown;
}

/// allocations: of the counted run; failed: the runs in which an allocation failed; thrown: those that threw
/// std::bad_alloc (a sweep's invariant: thrown == failed).
struct Sweep {
  int64_t allocations = 0, failed = 0, thrown = 0, in_region = 0;
};

/// For every n from 1 to the allocations of one run of armed() (and a few past them, and on while the runs still make
/// an n-th allocation): armed() with its n-th allocation failing, after setup(); then check(thrown). setup() and
/// check() run unarmed. A run's allocations can differ from the counted run's (a thread of the team that first gets
/// work of a region grows its scratch then, which depends on the timing): the sweep counts the runs in which an
/// allocation did fail.
Sweep sweep_allocations(const std::function<void()>& setup, const std::function<void()>& armed,
                        const std::function<void(bool thrown, const std::string& label)>& check) {
  Sweep s;
  setup();
  armed();  // the first run grows what is kept between calls (per-thread scratch)
  setup();
  s.allocations = allocations_of(armed);
  const int64_t in_region_before = g_in_region.load();
  for (int64_t n = 1; n <= 4 * s.allocations + 16; ++n) {
    setup();
    bool failed = false;
    const bool thrown = throws_when_allocation_fails(n, armed, &failed);
    s.failed += failed ? 1 : 0;
    s.thrown += thrown ? 1 : 0;
    EXPECT_TRUE(thrown || !failed) << "allocation " << n << " failed and the call returned";
    check(thrown, fmt::format("allocation {} of {} failing", n, s.allocations));
    if (!failed && n >= s.allocations + 3) break;
  }
  s.in_region = g_in_region.load() - in_region_before;
  return s;
}

/// The first n tokens of the validation text in TinyStories-656K's tokenizer (its GGUF's own vocabulary has no
/// usable merge order: models/SOURCES.md).
std::vector<int32_t> story_tokens(std::size_t n) {
  const auto tok = Model::load_bundled_tokenizer(test::shared_dir() / "models/TinyStories-656K");
  std::vector<int32_t> ids = tok->encode(test::slurp(test::text_path()).substr(0, 4000), true, false);
  if (ids.size() > n) ids.resize(n);
  return ids;
}

struct ThreadsScope {
  int saved = omp_get_max_threads();
  explicit ThreadsScope(int n) { omp_set_num_threads(n); }
  ~ThreadsScope() { omp_set_num_threads(saved); }
};

}  // namespace

// A prefill's products, attention and RoPE run in OpenMP parallel regions, where an exception that escapes ends the
// process (std::terminate): a std::bad_alloc of a thread's panel or scratch buffer in one of them did, with a
// server's every request. Now each of those regions hands it to the caller. Every allocation of a 160-token prefill
// (after 32 tokens already cached) is made to fail in turn, on two threads, for the TinyStories-656K checkpoint as
// its Hugging Face directory (F32 weights) and as its Q8_0 GGUF (float32 and q8_activations products, F16 and BF16
// caches), and a random F16 model: each failure reaches forward's caller as std::bad_alloc, the cache keeps its 32
// tokens, and the same prefill taken again on it gives the logits of a run that never failed.
TEST(AllocationFailure, EveryAllocationOfAPrefillReachesTheCaller) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer's allocator: the operator new of this executable would bypass it";
#else
  if (omp_get_thread_limit() < 2) GTEST_SKIP() << "OMP_THREAD_LIMIT=" << omp_get_thread_limit() << ": no second thread";
  const ThreadsScope threads(2);
  test::TempDir dir;
  RandomGgufOptions random;
  random.config.dim = 256;
  random.config.hidden_dim = 512;
  random.config.n_layers = 2;
  random.config.n_heads = 4;
  random.config.n_kv_heads = 2;
  random.config.vocab_size = 512;
  random.type = GgmlType::f16;
  write_random_gguf(random, dir.path() / "f16.gguf");
  const auto gguf656k = test::shared_dir() / "models/TinyStories-656K-gguf/TinyStories-656K-Q8_0.gguf";
  struct Case {
    std::string name;
    std::filesystem::path path;
    LoadOptions options;
    KvCacheDtype cache;
    const std::vector<int32_t>& ids;
  };
  const std::vector<int32_t> story = story_tokens(192);
  std::vector<int32_t> random_ids;  // the random model's 512 ids (ids past them would be the story's)
  for (int i = 0; i < 192; ++i) random_ids.push_back((i * 37 + 5) % 500);
  LoadOptions q8act;
  q8act.quantized_matmul = QuantizedMatmul::q8_activations;
  const std::vector<Case> cases = {
      {"TinyStories-656K (F32), f32 cache", test::shared_dir() / "models/TinyStories-656K", {}, KvCacheDtype::f32,
       story},
      {"TinyStories-656K Q8_0 GGUF, f16 cache", gguf656k, {}, KvCacheDtype::f16, story},
      {"TinyStories-656K Q8_0 GGUF q8_activations, bf16 cache", gguf656k, q8act, KvCacheDtype::bf16, story},
      {"random F16 (dim 256), f32 cache", dir.path() / "f16.gguf", {}, KvCacheDtype::f32, random_ids},
  };
  for (const Case& c : cases) {
    Model m = Model::load(c.path, c.options);
    m.set_kv_cache_dtype(c.cache);
    const std::vector<int32_t>& ids = c.ids;
    ASSERT_EQ(ids.size(), 192u) << c.name;
    const std::span<const int32_t> head(ids.data(), 32), rest(ids.data() + 32, 160);
    std::optional<KvCache> cache;
    KvCache::SeqId seq = 0;
    std::vector<float> logits;
    const auto setup = [&] {
      cache.emplace(m.make_cache());
      seq = cache->create();
      Model::SequenceInput in{seq, head, {}};
      m.forward(*cache, std::span(&in, 1), Model::LogitsMode::last, logits);
    };
    const auto prefill = [&] {
      Model::SequenceInput in{seq, rest, {}};
      m.forward(*cache, std::span(&in, 1), Model::LogitsMode::all, logits);
    };
    setup();
    prefill();
    const std::vector<float> expected = logits;
    const Sweep s = sweep_allocations(setup, prefill, [&](bool thrown, const std::string& label) {
      if (thrown) {
        ASSERT_EQ(cache->size(seq), 32) << c.name << ", " << label;
        logits.clear();
        prefill();
      }
      ASSERT_EQ(logits.size(), expected.size()) << c.name << ", " << label;
      EXPECT_EQ(std::memcmp(logits.data(), expected.data(), logits.size() * sizeof(float)), 0) << c.name << ", " << label;
    });
    // Every allocation the prefill makes fails it (none is optional), and some of them inside parallel regions.
    EXPECT_EQ(s.thrown, s.failed) << c.name;
    EXPECT_GT(s.in_region, 0) << c.name;
    std::printf("%s: %lld allocations, %lld of them inside parallel regions\n", c.name.c_str(),
                static_cast<long long>(s.allocations), static_cast<long long>(s.in_region));
  }
#endif
}

namespace {

/// Sweeps run() (which writes *out) as EveryAllocationOfAPrefillReachesTheCaller does a prefill: every allocation
/// failing in turn throws std::bad_alloc to the caller, and the call taken again gives the bits of one that never
/// failed. Returns the sweep.
Sweep sweep_call(const std::string& name, const std::function<void()>& run, std::vector<float>* out) {
  run();
  const std::vector<float> expected = *out;
  const Sweep s = sweep_allocations([] {}, run, [&](bool thrown, const std::string& label) {
    if (thrown) {
      std::fill(out->begin(), out->end(), 0.0f);
      run();
    }
    ASSERT_EQ(out->size(), expected.size()) << name << ", " << label;
    EXPECT_EQ(std::memcmp(out->data(), expected.data(), out->size() * sizeof(float)), 0) << name << ", " << label;
  });
  EXPECT_EQ(s.thrown, s.failed) << name;
  EXPECT_GT(s.in_region, 0) << name << ": no allocation inside a parallel region (the sweep would not test one)";
  std::printf("%s: %lld allocations, %lld of them inside parallel regions\n", name.c_str(),
              static_cast<long long>(s.allocations), static_cast<long long>(s.in_region));
  return s;
}

std::vector<float> wave(std::size_t n, float f) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = 0.5f * std::sin(f * static_cast<float>(i) + 0.1f);
  return v;
}

/// The product sweeps' operands: 64 rows of x by 384 x 256 weights (a parallel region on every path), the weights
/// as F16 and the weights and x as Q8_0.
struct Operands {
  static constexpr int64_t n = 64, in = 256, out = 384;
  std::vector<float> x = wave(static_cast<std::size_t>(n * in), 0.37f);
  std::vector<float> wf = wave(static_cast<std::size_t>(out * in), 0.11f);
  std::vector<float> y = std::vector<float>(static_cast<std::size_t>(n * out));
  std::vector<uint16_t> w16;
  detail::RawMatrix f16;
  std::vector<std::byte> xq = std::vector<std::byte>(static_cast<std::size_t>(n * in / 32 * 34));
  std::vector<std::byte> wq = std::vector<std::byte>(static_cast<std::size_t>(out * in / 32 * 34));
  Operands() {
    for (float v : wf) w16.push_back(f32_to_f16(v));
    f16.type = detail::WeightType::f16;
    f16.data = reinterpret_cast<const std::byte*>(w16.data());
    f16.rows = out;
    f16.cols = in;
    detail::quantize_rows_q8_0(x.data(), n, in, xq.data());
    detail::quantize_rows_q8_0(wf.data(), out, in, wq.data());
  }
};

}  // namespace

// The parallel regions the prefill sweep above does not reach on this CPU, swept the same way: the AVX2 products
// (the paths of CPUs without AVX-512) over F16 and Q8_0 weights, RoPE applied to a prompt, attention with RoPE, and
// the precision analysis's search for colliding rows.
TEST(AllocationFailure, EveryAllocationOfAParallelKernelReachesTheCaller) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer's allocator: the operator new of this executable would bypass it";
#else
  if (omp_get_thread_limit() < 2) GTEST_SKIP() << "OMP_THREAD_LIMIT=" << omp_get_thread_limit() << ": no second thread";
  const ThreadsScope threads(2);
  const RopeFrequencies freqs =
      compute_rope_frequencies(*load_positional_spec(test::shared_dir() / "configs/llama-3.1-8b.json").rope);
  // The products (a region: parallel_pays, q8 work over 2^20).
  Operands o;  // (on a CPU without AVX2 the sweeps below only)
  if (detail::dense_kernel_supported(detail::DenseKernel::avx2)) {
    sweep_call("F16 product, AVX2 panels", [&] {
      detail::matmul_w_with(detail::DenseKernel::avx2, o.x.data(), o.n, o.f16, o.y.data(), false);
    }, &o.y);
  }
  if (detail::q8_kernel_supported(detail::Q8Kernel::avx2)) {
    sweep_call("Q8_0 product, AVX2", [&] {
      detail::matmul_q8_with(detail::Q8Kernel::avx2, o.xq.data(), o.n, o.in, o.wq.data(), false, o.out, o.y.data(),
                             false);
    }, &o.y);
  }
  // RoPE over 512 tokens of 8 heads of 128 (a region: tokens x heads x head_dim over 2^16).
  const int64_t tokens = 512;
  std::vector<int64_t> pos(static_cast<std::size_t>(tokens));
  std::iota(pos.begin(), pos.end(), int64_t{1000});
  const std::vector<float> q0 = wave(static_cast<std::size_t>(tokens * 8 * 128), 0.07f);
  std::vector<float> q = q0;
  sweep_call("apply_rope", [&] {
    q = q0;
    apply_rope(q.data(), tokens, 8, freqs, pos, RopeLayout::half, AnglePrecision::float32);
  }, &q);
  // Attention with RoPE: 64 queries of 8 heads against the 512 keys (the keys rotated in a region, then the
  // attention kernel's own).
  AttentionSpec spec;
  spec.heads = 8;
  spec.kv_heads = 8;
  spec.head_dim = 128;
  spec.mask = MaskKind::causal;
  const std::vector<float> k = wave(q0.size(), 0.05f), v = wave(q0.size(), 0.03f);
  const std::vector<KvBlock> kv{{k.data(), v.data(), pos.data(), tokens}};
  const std::span<const int64_t> q_pos(pos.data() + tokens - 64, 64);
  std::vector<float> att(static_cast<std::size_t>(64 * 8 * 128));
  sweep_call("attention_with_rope", [&] {
    attention_with_rope(spec, freqs, RopeLayout::half, AnglePrecision::float32, q0.data(), q_pos, kv, att.data());
  }, &att);
  // Row collisions of 150,000 positions: three chunks of 2^16 taken by the threads in turn.
  std::vector<float> found;
  sweep_call("rope_row_collisions", [&] {
    int64_t count = 0;
    const std::vector<int64_t> first =
        rope_row_collisions(freqs, rope_numerics(AnglePrecision::float32), 0, 150000, 8, &count);
    found.assign(first.begin(), first.end());
    found.push_back(static_cast<float>(count));
  }, &found);
#endif
}

// The AMX products' regions (Sapphire Rapids and later), swept as above: Q8_0 with int8 activations, F16 split into
// bf16 terms.
TEST(AllocationFailure, EveryAllocationOfAnAmxProductReachesTheCaller) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer's allocator: the operator new of this executable would bypass it";
#else
  const bool q8 = detail::q8_kernel_supported(detail::Q8Kernel::amx), bf16 = detail::amx_bf16_supported();
  if (!q8 && !bf16) GTEST_SKIP() << "this CPU has no AMX (AMX-INT8, AMX-BF16)";
  if (omp_get_thread_limit() < 2) GTEST_SKIP() << "OMP_THREAD_LIMIT=" << omp_get_thread_limit() << ": no second thread";
  const ThreadsScope threads(2);
  Operands o;
  if (q8)
    sweep_call("Q8_0 product, AMX", [&] {
      detail::matmul_q8_with(detail::Q8Kernel::amx, o.xq.data(), o.n, o.in, o.wq.data(), false, o.out, o.y.data(),
                             false);
    }, &o.y);
  if (bf16)
    sweep_call("F16 product, AMX bf16x3", [&] {
      detail::matmul_bf16_split(detail::Bf16Split::x3, o.x.data(), o.n, o.f16, o.y.data(), false);
    }, &o.y);
#endif
}

// posenc serve's connection threads (httplib's task queue): enqueue is called by httplib's accept loop with a job that
// owns a connection's socket. A failed allocation in it (the queue's slot, the thread list's node, a new thread's
// state) escaped into httplib's accept loop and ended the server (found by an adversary's allocation sweep of
// `posenc serve`). Now no job is lost: each allocation of an enqueue is failed in turn, on a queue with no thread
// (the job then runs on the caller, and serving_inline() tells it so), on one whose only thread is busy (the job
// waits for it, and close_idle is called to free it), and on one whose every thread is taken with jobs queued (a slot
// for the next: it runs on the caller), and every job runs exactly once.
TEST(AllocationFailure, AConnectionIsServedWhicheverAllocationOfItsEnqueueFails) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer's allocator: the operator new of this executable would bypass it";
#else
  using namespace std::chrono_literals;
  std::atomic<int64_t> alive{0};
  const auto wait_for = [](const std::atomic<int>& count, int want) {
    for (int i = 0; i < 5000 && count.load() < want; ++i) std::this_thread::sleep_for(1ms);
    return count.load();
  };
  // The allocations of an enqueue that starts a thread, counted unarmed.
  int64_t allocations = 0;
  {
    std::atomic<int> ran{0};
    detail::ConnectionThreads q(4, 50ms, alive, [] { return false; });
    std::function<void()> job = [&ran] { ran.fetch_add(1); };
    g_counted = 0;
    g_counting = true;
    q.enqueue(std::move(job));
    g_counting = false;
    allocations = g_counted.load();
    EXPECT_EQ(wait_for(ran, 1), 1);
    q.shutdown();
  }
  ASSERT_GE(allocations, 2) << "the thread list's node and the thread's state";
  int64_t inline_runs = 0;
  for (int64_t k = 1; k <= allocations; ++k) {
    SCOPED_TRACE(fmt::format("allocation {} of {} fails", k, allocations));
    {  // no thread yet: the job runs on the caller (and knows it), or on the thread that did start
      std::atomic<int> ran{0}, saw_inline{-1};
      detail::ConnectionThreads q(4, 50ms, alive, [] { return false; });
      std::function<void()> job = [&] {
        saw_inline = detail::ConnectionThreads::serving_inline() ? 1 : 0;
        ran.fetch_add(1);
      };
      g_countdown = k;
      EXPECT_NO_THROW(q.enqueue(std::move(job)));
      g_countdown = 0;
      EXPECT_EQ(wait_for(ran, 1), 1);
      EXPECT_EQ(saw_inline.load(), q.ran_inline() == 1 ? 1 : 0);
      EXPECT_FALSE(detail::ConnectionThreads::serving_inline()) << "the caller's flag is cleared after the job";
      inline_runs += q.ran_inline();
      // and the queue still serves
      q.enqueue([&ran] { ran.fetch_add(1); });
      EXPECT_EQ(wait_for(ran, 2), 2);
      q.shutdown();
      EXPECT_EQ(ran.load(), 2);
    }
    {  // its one thread busy: a thread that cannot start leaves the job queued for it, and an idle connection is
       // asked to close (as when every thread is taken) so that the busy thread may come free
      std::atomic<int> ran{0}, close_idle_calls{0};
      std::atomic<bool> release{false};
      detail::ConnectionThreads q(4, 50ms, alive, [&] {
        close_idle_calls.fetch_add(1);
        return false;
      });
      q.enqueue([&] {
        while (!release.load()) std::this_thread::sleep_for(1ms);
        ran.fetch_add(1);
      });
      std::function<void()> job = [&ran] { ran.fetch_add(10); };
      g_countdown = k;
      EXPECT_NO_THROW(q.enqueue(std::move(job)));
      EXPECT_LE(g_countdown.load(), 0) << "the allocation did fail";
      g_countdown = 0;
      EXPECT_EQ(q.ran_inline(), 0) << "a thread runs: the job waits for it";
      EXPECT_EQ(close_idle_calls.load(), 1);
      release = true;
      EXPECT_EQ(wait_for(ran, 11), 11);
      q.shutdown();
      EXPECT_EQ(ran.load(), 11);
    }
  }
  EXPECT_GE(inline_runs, 1) << "some failure left the queue without a thread";
  {  // every thread taken (max_threads 1), the jobs queued until the queue needs memory for the next one's slot
    std::atomic<int> ran{0};
    std::atomic<bool> release{false};
    detail::ConnectionThreads q(1, 50ms, alive, [] { return false; });
    q.enqueue([&] {
      while (!release.load()) std::this_thread::sleep_for(1ms);
      ran.fetch_add(1);
    });
    int jobs = 1;
    while (q.ran_inline() == 0 && jobs < 200) {
      g_countdown = 1;  // the enqueue's first allocation, if it makes one
      EXPECT_NO_THROW(q.enqueue([&ran] { ran.fetch_add(1); }));
      g_countdown = 0;
      ++jobs;
    }
    EXPECT_EQ(q.ran_inline(), 1) << "the queue's slot could not be had: the job ran on the caller";
    release = true;
    EXPECT_EQ(wait_for(ran, jobs), jobs);
    q.shutdown();
    EXPECT_EQ(ran.load(), jobs);
  }
#endif
}
