// Peak resident memory of the 2048-token prefill (32 heads, head_dim 128,
// causal): the kernel must stay tiled. The measurement runs in a fresh
// process (this test binary re-executed with POSENC_ATTN_MEMORY_CHILD=1), so
// its VmHWM starts from the binary's own footprint and OpenMP threads of the
// parent do not matter; the child prints its figures and exits before
// GoogleTest starts.
#include <sys/types.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "posenc/attention.hpp"
#include "posenc/rope.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

namespace {

constexpr int64_t kTokens = 2048;
constexpr int kHeads = 32, kHeadDim = 128;

// VmRSS / VmHWM of this process in kB.
long status_kb(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string k = std::string(key) + ":";
  while (std::getline(in, line))
    if (line.rfind(k, 0) == 0) return std::atol(line.c_str() + k.size());
  return -1;
}

void touch(std::vector<float>& v, float x) {
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = x * static_cast<float>(i % 97) / 97.0f;
}

// The child: baseline, allocate q/k/v/out, run both entry points, report.
struct ChildMode {
  ChildMode() {
    if (!std::getenv("POSENC_ATTN_MEMORY_CHILD")) return;
    const long baseline = status_kb("VmRSS");
    const std::size_t n = static_cast<std::size_t>(kTokens) * kHeads * kHeadDim;
    std::vector<float> q(n), k(n), v(n), out(n);
    touch(q, 1.0f);
    touch(k, -1.0f);
    touch(v, 0.5f);
    touch(out, 0.0f);
    std::vector<int64_t> pos(static_cast<std::size_t>(kTokens));
    std::iota(pos.begin(), pos.end(), int64_t{0});
    posenc::AttentionSpec spec;
    spec.heads = kHeads;
    spec.kv_heads = kHeads;
    spec.head_dim = kHeadDim;
    spec.mask = posenc::MaskKind::causal;
    const std::vector<posenc::KvBlock> kv{{k.data(), v.data(), pos.data(), kTokens}};
    posenc::AttentionOptions opt;
    opt.num_threads = 2;
    posenc::attention_forward(spec, q.data(), pos, kv, out.data(), opt);
    const long hwm_forward = status_kb("VmHWM");
    const auto freqs = posenc::default_rope_frequencies(kHeadDim, kHeadDim, 10000.0);
    posenc::attention_with_rope(spec, freqs, posenc::RopeLayout::half,
                                posenc::AnglePrecision::float32, q.data(), pos, kv, out.data(), opt);
    const long hwm_rope = status_kb("VmHWM");
    std::printf("tensors_kb=%zu baseline_kb=%ld hwm_forward_kb=%ld hwm_rope_kb=%ld\n",
                4 * n * sizeof(float) / 1024, baseline, hwm_forward, hwm_rope);
    std::fflush(stdout);
    std::_Exit(0);
  }
} child_mode;

}  // namespace

TEST(AttentionMemory, PrefillPeakResidentStaysBelowTwiceTheTensors) {
  char exe[PATH_MAX];
  const ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
  ASSERT_GT(len, 0);
  exe[len] = '\0';
  const std::string cmd = "POSENC_ATTN_MEMORY_CHILD=1 '" + std::string(exe) + "'";
  FILE* pipe = popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  char buf[512] = {0};
  const bool got = std::fgets(buf, sizeof buf, pipe) != nullptr;
  ASSERT_EQ(pclose(pipe), 0);
  ASSERT_TRUE(got);
  long tensors = 0, baseline = 0, hwm_forward = 0, hwm_rope = 0;
  ASSERT_EQ(std::sscanf(buf, "tensors_kb=%ld baseline_kb=%ld hwm_forward_kb=%ld hwm_rope_kb=%ld",
                        &tensors, &baseline, &hwm_forward, &hwm_rope),
            4)
      << buf;
  // q, k, v, out: 4 x 32 MiB.
  EXPECT_EQ(tensors, 4L * kTokens * kHeads * kHeadDim * 4 / 1024);
  const double forward_ratio = static_cast<double>(hwm_forward - baseline) / tensors;
  const double rope_ratio = static_cast<double>(hwm_rope - baseline) / tensors;
  // The tensors themselves are resident: the ratio cannot be below 1.
  EXPECT_GE(forward_ratio, 0.99) << buf;
  EXPECT_LT(forward_ratio, 2.0) << buf;
  EXPECT_LT(rope_ratio, 2.0) << buf;
  RecordProperty("forward_peak_over_tensors", std::to_string(forward_ratio));
  RecordProperty("rope_peak_over_tensors", std::to_string(rope_ratio));
  std::printf("peak RSS above baseline / (q+k+v+out): attention_forward %.3f, "
              "attention_with_rope %.3f\n",
              forward_ratio, rope_ratio);
}

}  // namespace POSENC_UNITY_ID
