#include "train/autograd.hpp"

#include <numeric>
#include <vector>

#include <fmt/format.h>

#include "posenc/absolute.hpp"
#include "posenc/bias.hpp"
#include "posenc/error.hpp"

namespace posenc::detail {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void check_float(const torch::Tensor& t, int64_t dims, const char* what) {
  if (t.scalar_type() != torch::kFloat32 || t.dim() != dims || t.device().type() != torch::kCPU)
    throw InvalidArgument(fmt::format("{}: expected a {}-d float32 CPU tensor (got {}-d {})", what, dims, t.dim(),
                                      std::string(c10::toString(t.scalar_type()))));
}

std::vector<int64_t> iota_positions(int64_t T) {
  std::vector<int64_t> p(static_cast<std::size_t>(T));
  std::iota(p.begin(), p.end(), int64_t{0});
  return p;
}

torch::Tensor rope_apply(const torch::Tensor& x, int rotary_dim, double theta, RopeLayout layout,
                         RopeDirection direction) {
  check_float(x, 4, "rope_rotate x [B, T, heads, head_dim]");
  const torch::Tensor in = x.contiguous();
  const int64_t B = in.size(0), T = in.size(1);
  const int H = static_cast<int>(in.size(2)), D = static_cast<int>(in.size(3));
  torch::Tensor out = torch::empty_like(in);
  if (in.numel() == 0) return out;
  const RopeFrequencies freqs = default_rope_frequencies(D, rotary_dim, theta);
  const auto pos = iota_positions(T);
  const RopeTable table(freqs, pos, AnglePrecision::float32);
  const float* src = in.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t row = T * H * D;
  for (int64_t b = 0; b < B; ++b) apply_rope(src + b * row, dst + b * row, T, H, D, table, layout, direction);
  return out;
}

struct RopeFunction : public torch::autograd::Function<RopeFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t rotary_dim, double theta,
                               int64_t layout) {
    ctx->saved_data["rotary_dim"] = rotary_dim;
    ctx->saved_data["theta"] = theta;
    ctx->saved_data["layout"] = layout;
    return rope_apply(x, static_cast<int>(rotary_dim), theta, static_cast<RopeLayout>(layout), RopeDirection::forward);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto rotary_dim = static_cast<int>(ctx->saved_data["rotary_dim"].toInt());
    const double theta = ctx->saved_data["theta"].toDouble();
    const auto layout = static_cast<RopeLayout>(ctx->saved_data["layout"].toInt());
    // y = R x with R orthogonal, so dL/dx = R^T dL/dy = the inverse rotation.
    return {rope_apply(grad[0], rotary_dim, theta, layout, RopeDirection::inverse), torch::Tensor(), torch::Tensor(),
            torch::Tensor()};
  }
};

struct SinusoidalFunction : public torch::autograd::Function<SinusoidalFunction> {
  static torch::Tensor forward(AutogradContext*, const torch::Tensor& x, double base) {
    check_float(x, 3, "add_sinusoidal x [B, T, d_model]");
    torch::Tensor out = x.contiguous().clone();
    const int64_t B = out.size(0), T = out.size(1);
    const int D = static_cast<int>(out.size(2));
    const auto pos = iota_positions(T);
    float* p = out.data_ptr<float>();
    const auto row = static_cast<std::size_t>(T * D);
    for (int64_t b = 0; b < B; ++b)
      add_sinusoidal_encoding(std::span<float>(p + b * T * D, row), D, pos, SinusoidalLayout::interleaved, base);
    return out;
  }
  static variable_list backward(AutogradContext*, variable_list grad) {
    return {grad[0], torch::Tensor()};  // x + constant
  }
};

struct LearnedFunction : public torch::autograd::Function<LearnedFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& table, int64_t T) {
    check_float(table, 2, "learned_positions table [max_position_embeddings, d_model]");
    const torch::Tensor tab = table.contiguous();
    const int64_t P = tab.size(0);
    const int D = static_cast<int>(tab.size(1));
    torch::Tensor out = torch::empty({T, D}, torch::kFloat32);
    const auto pos = iota_positions(T);
    learned_position_lookup(std::span<const float>(tab.data_ptr<float>(), static_cast<std::size_t>(P * D)), P, D, pos,
                            std::span<float>(out.data_ptr<float>(), static_cast<std::size_t>(T * D)));
    ctx->saved_data["rows"] = P;
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const int64_t P = ctx->saved_data["rows"].toInt();
    const torch::Tensor g = grad[0].contiguous();
    const int64_t T = g.size(0), D = g.size(1);
    torch::Tensor gt = torch::zeros({P, D}, torch::kFloat32);
    const float* gp = g.data_ptr<float>();
    float* tp = gt.data_ptr<float>();
    // Scatter-add: row t of the output came from table row position_ids[t] = t.
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d) tp[t * D + d] += gp[t * D + d];
    return {gt, torch::Tensor()};
  }
};

struct T5Function : public torch::autograd::Function<T5Function> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& table, int64_t T, int64_t num_buckets,
                               int64_t max_distance) {
    check_float(table, 2, "t5_bias table [num_buckets, heads]");
    const torch::Tensor tab = table.contiguous();
    const int H = static_cast<int>(tab.size(1));
    if (tab.size(0) != num_buckets)
      throw InvalidArgument(fmt::format("t5_bias: table has {} rows for relative_attention_num_buckets {}",
                                        tab.size(0), num_buckets));
    const std::vector<float> bias = t5_relative_position_bias(
        std::span<const float>(tab.data_ptr<float>(), static_cast<std::size_t>(num_buckets * H)),
        static_cast<int>(num_buckets), H, T, T, 0, /*bidirectional=*/false, static_cast<int>(max_distance));
    ctx->saved_data["T"] = T;
    ctx->saved_data["num_buckets"] = num_buckets;
    ctx->saved_data["max_distance"] = max_distance;
    ctx->saved_data["heads"] = static_cast<int64_t>(H);
    torch::Tensor out = torch::empty({H, T, T}, torch::kFloat32);
    std::copy(bias.begin(), bias.end(), out.data_ptr<float>());
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const int64_t T = ctx->saved_data["T"].toInt();
    const int64_t NB = ctx->saved_data["num_buckets"].toInt();
    const int64_t H = ctx->saved_data["heads"].toInt();
    const std::vector<int> buckets = t5_relative_position_buckets(T, T, 0, false, static_cast<int>(NB),
                                                                  static_cast<int>(ctx->saved_data["max_distance"].toInt()));
    const torch::Tensor g = grad[0].contiguous();
    const float* gp = g.data_ptr<float>();
    torch::Tensor gt = torch::zeros({NB, H}, torch::kFloat32);
    float* tp = gt.data_ptr<float>();
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < T * T; ++i) tp[buckets[static_cast<std::size_t>(i)] * H + h] += gp[h * T * T + i];
    return {gt, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

struct AlibiFunction : public torch::autograd::Function<AlibiFunction> {
  static torch::Tensor forward(AutogradContext*, const torch::Tensor& scores, double max_bias) {
    check_float(scores, 4, "add_alibi scores [B, heads, T, q]");
    const int H = static_cast<int>(scores.size(1));
    const int64_t T = scores.size(2), K = scores.size(3);
    const std::vector<float> slopes = alibi_slopes(H, max_bias);
    const std::vector<float> bias = alibi_bias(slopes, T, K, 0, AlibiForm::causal);
    torch::Tensor b = torch::empty({H, T, K}, torch::kFloat32);
    std::copy(bias.begin(), bias.end(), b.data_ptr<float>());
    return scores + b;
  }
  static variable_list backward(AutogradContext*, variable_list grad) {
    return {grad[0], torch::Tensor()};  // no parameters: the bias is fixed
  }
};

}  // namespace

torch::Tensor rope_rotate(const torch::Tensor& x, int rotary_dim, double rope_theta, RopeLayout layout) {
  return RopeFunction::apply(x, static_cast<int64_t>(rotary_dim), rope_theta, static_cast<int64_t>(layout));
}

torch::Tensor add_sinusoidal(const torch::Tensor& x, double base) { return SinusoidalFunction::apply(x, base); }

torch::Tensor learned_positions(const torch::Tensor& table, int64_t T) { return LearnedFunction::apply(table, T); }

torch::Tensor t5_bias(const torch::Tensor& table, int64_t T, int num_buckets, int max_distance) {
  return T5Function::apply(table, T, static_cast<int64_t>(num_buckets), static_cast<int64_t>(max_distance));
}

torch::Tensor add_alibi(const torch::Tensor& scores, double max_bias) { return AlibiFunction::apply(scores, max_bias); }

}  // namespace posenc::detail
