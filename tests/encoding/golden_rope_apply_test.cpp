// rope_apply.json: RoPE applied to q/k in every layout the reference uses --
// half (Llama), partial half (GPT-NeoX), interleaved (GPT-J with rotary_dim <
// head_dim, RoFormer), MRoPE (Qwen2-VL) and DeepSeek-V3's interleaved-in,
// half-out helper. Golden q/k are [batch, heads, seq, head_dim]; posenc
// kernels take [tokens, heads, head_dim], so each batch row is transposed in
// and out.
#include <algorithm>
#include <functional>
#include <iostream>

#include "encoding/golden.hpp"
#include "posenc/absolute.hpp"
#include "posenc/mrope.hpp"
#include "posenc/rope.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;
using namespace posenc::golden;

namespace {

struct Bhsd {
  std::size_t b, h, s, d;
};

Bhsd dims(const Tensor& t) {
  if (t.shape.size() != 4) throw std::runtime_error("expected a [batch, heads, seq, head_dim] tensor");
  return {t.shape[0], t.shape[1], t.shape[2], t.shape[3]};
}

// [B,H,S,D] -> batch row b as [S,H,D]
std::vector<float> to_shd(const Tensor& t, std::size_t b) {
  const Bhsd n = dims(t);
  std::vector<float> out(n.s * n.h * n.d);
  for (std::size_t h = 0; h < n.h; ++h)
    for (std::size_t s = 0; s < n.s; ++s)
      for (std::size_t d = 0; d < n.d; ++d)
        out[(s * n.h + h) * n.d + d] = static_cast<float>(t.values[((b * n.h + h) * n.s + s) * n.d + d]);
  return out;
}

// writes batch row b ([S,H,D]) into a [B,H,S,D] buffer
void from_shd(const std::vector<float>& x, const Bhsd& n, std::size_t b, std::vector<float>& out) {
  for (std::size_t h = 0; h < n.h; ++h)
    for (std::size_t s = 0; s < n.s; ++s)
      for (std::size_t d = 0; d < n.d; ++d)
        out[((b * n.h + h) * n.s + s) * n.d + d] = x[(s * n.h + h) * n.d + d];
}

// One position row of a golden [batch, seq] tensor.
std::vector<int64_t> row_of(const Tensor& pos, std::size_t b) {
  const std::size_t s = pos.shape.at(1);
  std::vector<int64_t> out(s);
  for (std::size_t i = 0; i < s; ++i) out[i] = static_cast<int64_t>(pos.values[b * s + i]);
  return out;
}

// Table values in HF's [.., rotary_dim] (cat(freqs, freqs)) order for a table.
std::vector<float> hf_cat(const RopeTable& t, bool cos) {
  const int n = t.n_pairs();
  std::vector<float> out(static_cast<std::size_t>(t.n_positions() * 2 * n));
  for (int64_t p = 0; p < t.n_positions(); ++p) {
    // A named row pointer, not `(c ? a : b)[i]`: GCC 12 with -O0
    // -fsanitize=undefined miscompiles that subscript (reads b[0] every time).
    const float* row = cos ? t.cos_row(p) : t.sin_row(p);
    for (int i = 0; i < 2 * n; ++i) out[static_cast<std::size_t>(p * 2 * n + i)] = row[i % n];
  }
  return out;
}

// Golden sub-tensor: batch row b of a [batch, ...] tensor.
Tensor slice0(const Tensor& t, std::size_t b) {
  Tensor out;
  out.shape.assign(t.shape.begin() + 1, t.shape.end());
  std::size_t inner = 1;
  for (auto d : out.shape) inner *= d;
  out.values.assign(t.values.begin() + static_cast<std::ptrdiff_t>(b * inner),
                    t.values.begin() + static_cast<std::ptrdiff_t>((b + 1) * inner));
  return out;
}

}  // namespace

TEST(GoldenRopeApply, EveryCaseMatchesHuggingFace) {
  const json doc = load("rope_apply.json");
  const auto& cases = doc.at("cases");
  ASSERT_FALSE(cases.empty());
  std::size_t checked = 0, values = 0, bit_exact = 0;
  for (const auto& c : cases) {
    const std::string name = c.at("name");
    const std::string layout = c.at("layout");
    const std::string variant = c.at("variant");
    const json& in = c.at("inputs");
    const json& out = c.at("outputs");
    const int head_dim = in.at("head_dim");
    const double theta = in.at("rope_theta");
    const Tensor q = tensor(in.at("q")), k = tensor(in.at("k"));
    const Bhsd n = dims(q);
    ASSERT_EQ(static_cast<int>(n.d), head_dim) << name;
    const bool noncontig = name.find("noncontig") != std::string::npos;

    // The rotation of one batch row, per case family; returns q/k rotated.
    std::function<void(std::vector<float>&, std::size_t)> rotate;
    if (variant == "mrope") {
      const std::vector<int> section = in.at("mrope_section").get<std::vector<int>>();
      const RopeFrequencies f = default_rope_frequencies(head_dim, head_dim, theta);
      EXPECT_TRUE(compare(name, "inv_freq", tensor(in.at("inv_freq")), f.inv_freq, Tol::rel, 1e-6));
      const Tensor thw = tensor(in.at("position_ids_thw"));  // [3, batch, seq]
      const Tensor cos_rows = tensor(in.at("cos")), sin_rows = tensor(in.at("sin"));  // [3, batch, seq, hd]
      for (std::size_t r = 0; r < 3; ++r) {  // each row's table, before the section split
        const Tensor pos_r = slice0(thw, r);
        for (std::size_t b = 0; b < n.b; ++b) {
          const RopeTable t(f, row_of(pos_r, b), AnglePrecision::float32);
          EXPECT_TRUE(compare(name, fmt::format("cos row {} batch {}", r, b), slice0(slice0(cos_rows, r), b), hf_cat(t, true), Tol::abs, 2e-6));
          EXPECT_TRUE(compare(name, fmt::format("sin row {} batch {}", r, b), slice0(slice0(sin_rows, r), b), hf_cat(t, false), Tol::abs, 2e-6));
        }
      }
      rotate = [=](std::vector<float>& x, std::size_t b) {
        std::vector<int64_t> pos3;  // [3, seq]
        for (std::size_t r = 0; r < 3; ++r) {
          const auto row = row_of(slice0(thw, r), b);
          pos3.insert(pos3.end(), row.begin(), row.end());
        }
        apply_mrope(x.data(), static_cast<int64_t>(n.s), static_cast<int>(n.h), f, section, pos3,
                    AnglePrecision::float32);
      };
    } else if (name.rfind("gptj", 0) == 0) {
      // GPT-J: create_sinusoidal_positions over rotary_dim, float32 angles;
      // rotate_every_two = interleaved pairs on the first rotary_dim channels.
      const int rotary_dim = in.at("rotary_dim");
      const RopeFrequencies f = default_rope_frequencies(head_dim, rotary_dim, theta);
      const Tensor pos = tensor(in.at("position_ids"));
      const Tensor sin_pairs = tensor(in.at("sin_pairs")), cos_pairs = tensor(in.at("cos_pairs"));
      for (std::size_t b = 0; b < n.b; ++b) {
        const RopeTable t(f, row_of(pos, b), AnglePrecision::float32);
        EXPECT_TRUE(compare(name, "cos_pairs", slice0(cos_pairs, b), std::vector<float>(t.cos().begin(), t.cos().end()), Tol::abs, 2e-6));
        EXPECT_TRUE(compare(name, "sin_pairs", slice0(sin_pairs, b), std::vector<float>(t.sin().begin(), t.sin().end()), Tol::abs, 2e-6));
      }
      rotate = [=](std::vector<float>& x, std::size_t b) {
        const RopeTable t(f, row_of(pos, b), AnglePrecision::float32);
        apply_rope(x.data(), static_cast<int64_t>(n.s), static_cast<int>(n.h), head_dim, t,
                   RopeLayout::interleaved);
      };
    } else if (name.rfind("roformer", 0) == 0) {
      // RoFormer: the Marian-style [sin | cos] table (float64 -> float32),
      // pairs interleaved.
      const Tensor sp = tensor(in.at("sinusoidal_pos"));  // [1, 1, seq, head_dim]
      const Tensor pos = tensor(in.at("position_ids"));
      const int half = head_dim / 2;
      auto table_for = [=](std::size_t b) {
        const std::vector<int64_t> p = row_of(pos, b);
        const std::vector<float> enc = sinusoidal_encoding(p, head_dim, SinusoidalLayout::halves);
        std::vector<float> s(p.size() * static_cast<std::size_t>(half)), co(s.size());
        for (std::size_t t = 0; t < p.size(); ++t)
          for (int i = 0; i < half; ++i) {
            s[t * static_cast<std::size_t>(half) + static_cast<std::size_t>(i)] = enc[t * static_cast<std::size_t>(head_dim) + static_cast<std::size_t>(i)];
            co[t * static_cast<std::size_t>(half) + static_cast<std::size_t>(i)] = enc[t * static_cast<std::size_t>(head_dim) + static_cast<std::size_t>(half + i)];
          }
        return std::pair{enc, RopeTable::from_cos_sin(static_cast<int64_t>(p.size()), half, co, s, AnglePrecision::exact)};
      };
      EXPECT_TRUE(compare(name, "sinusoidal_pos", sp, table_for(0).first, Tol::abs, 2e-6));
      rotate = [=](std::vector<float>& x, std::size_t b) {
        apply_rope(x.data(), static_cast<int64_t>(n.s), static_cast<int>(n.h), head_dim,
                   table_for(b).second, RopeLayout::interleaved);
      };
    } else {
      // Llama / GPT-NeoX half layout, and DeepSeek-V3's interleaved-in half-out.
      const int rotary_dim = in.contains("rotary_dim") ? in.at("rotary_dim").get<int>() : head_dim;
      const RopeFrequencies f = default_rope_frequencies(head_dim, rotary_dim, theta);
      EXPECT_TRUE(compare(name, "inv_freq", tensor(in.at("inv_freq")), f.inv_freq, Tol::rel, 1e-6));
      const Tensor pos = tensor(in.at("position_ids"));
      const Tensor cos = tensor(in.at("cos")), sin = tensor(in.at("sin"));  // [batch, seq, rotary_dim]
      for (std::size_t b = 0; b < n.b; ++b) {
        const RopeTable t(f, row_of(pos, b), AnglePrecision::float32);
        EXPECT_TRUE(compare(name, "cos", slice0(cos, b), hf_cat(t, true), Tol::abs, 2e-6));
        EXPECT_TRUE(compare(name, "sin", slice0(sin, b), hf_cat(t, false), Tol::abs, 2e-6));
      }
      if (layout == "interleaved_in_half_out") {
        rotate = [=](std::vector<float>& x, std::size_t b) {
          const RopeTable t(f, row_of(pos, b), AnglePrecision::float32);
          apply_rope_interleaved_in_half_out(x.data(), static_cast<int64_t>(n.s), static_cast<int>(n.h), head_dim, t);
        };
      } else {
        ASSERT_EQ(layout, "half") << name;
        rotate = [=](std::vector<float>& x, std::size_t b) {
          const RopeTable t(f, row_of(pos, b), AnglePrecision::float32);
          const int64_t tokens = static_cast<int64_t>(n.s);
          const int heads = static_cast<int>(n.h);
          if (!noncontig) {
            apply_rope(x.data(), tokens, heads, head_dim, t, RopeLayout::half);
            return;
          }
          // Strided rows (token_stride > heads*head_dim), as a fused qkv buffer would give.
          const int64_t stride = static_cast<int64_t>(3 * heads * head_dim);
          std::vector<float> buf(static_cast<std::size_t>(tokens * stride), -7.0f);
          for (int64_t s = 0; s < tokens; ++s)
            std::copy_n(x.data() + s * heads * head_dim, heads * head_dim, buf.data() + s * stride);
          apply_rope(buf.data(), tokens, heads, head_dim, t, RopeLayout::half, RopeDirection::forward, stride);
          for (int64_t s = 0; s < tokens; ++s) {
            std::copy_n(buf.data() + s * stride, heads * head_dim, x.data() + s * heads * head_dim);
            for (int64_t g = heads * head_dim; g < stride; ++g)
              ASSERT_EQ(buf[static_cast<std::size_t>(s * stride + g)], -7.0f) << name << ": wrote outside the rows";
          }
        };
      }
    }

    for (const char* which : {"q", "k"}) {
      const Tensor& src = std::string(which) == "q" ? q : k;
      const Tensor want = tensor(out.at(std::string(which) + "_embed"));
      std::vector<float> got(src.size());
      for (std::size_t b = 0; b < n.b; ++b) {
        std::vector<float> x = to_shd(src, b);
        rotate(x, b);
        from_shd(x, n, b, got);
      }
      EXPECT_TRUE(compare(name, std::string(which) + "_embed", want, got, Tol::abs, 2e-6));
      for (std::size_t i = 0; i < got.size() && i < want.size(); ++i) {
        ++values;
        bit_exact += static_cast<float>(want.values[i]) == got[i];
      }
    }
    ++checked;
  }
  EXPECT_EQ(checked, cases.size()) << "every case of rope_apply.json must be checked";
  std::cout << "[rope_apply] " << checked << " cases, q/k_embed bit-exact " << bit_exact << "/"
            << values << "\n";
}

}  // namespace POSENC_UNITY_ID
