// Gradient checks of the autograd wrappers of posenc's positional kernels.
//
// Method: for f(X) with a float32 kernel, take L(X) = sum(W * f(X)) with a
// fixed random W (accumulated in double from the float32 outputs) and compare
// autograd's dL/dX (backward with grad_output = W) element by element with
// the central difference (L(X + h e_i) - L(X - h e_i)) / 2h. Every wrapped
// function is affine in its differentiable input, so the central difference
// has no truncation error and a large step (h = 0.25) keeps float32 rounding
// of f far below the 1e-3 relative tolerance: |fd - ag| <= 1e-3 * max(|ag|, 1e-2).
// The kernels are float32-only, hence no double-precision run.
#include <cmath>
#include <functional>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "posenc/error.hpp"
#include "train/autograd.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

using namespace posenc;

namespace {

double weighted_sum(const torch::Tensor& y, const torch::Tensor& w) {
  const torch::Tensor a = y.contiguous(), b = w.contiguous();
  const float* p = a.data_ptr<float>();
  const float* q = b.data_ptr<float>();
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += static_cast<double>(p[i]) * static_cast<double>(q[i]);
  return s;
}

/// Checks autograd's gradient of sum(W * f(X)) against central differences at
/// every element of X; returns the largest relative error seen.
double check_gradient(const std::function<torch::Tensor(const torch::Tensor&)>& f, torch::Tensor x0, double h = 0.25) {
  torch::manual_seed(123);
  torch::Tensor x = x0.clone().set_requires_grad(true);
  const torch::Tensor y = f(x);
  const torch::Tensor w = torch::randn(y.sizes());
  y.backward(w);
  const torch::Tensor g = x.grad().contiguous();
  EXPECT_TRUE(g.defined());
  double worst = 0;
  torch::NoGradGuard no_grad;
  for (int64_t i = 0; i < x0.numel(); ++i) {
    torch::Tensor xp = x0.clone(), xm = x0.clone();
    xp.view({-1})[i] += h;
    xm.view({-1})[i] -= h;
    const double fd = (weighted_sum(f(xp), w) - weighted_sum(f(xm), w)) / (2 * h);
    const double ag = g.view({-1})[i].item<double>();
    const double rel = std::abs(fd - ag) / std::max(std::abs(ag), 1e-2);
    worst = std::max(worst, rel);
    EXPECT_LE(rel, 1e-3) << "element " << i << ": finite difference " << fd << ", autograd " << ag;
  }
  return worst;
}

}  // namespace

TEST(TrainAutograd, RopeBackwardIsTheInverseRotationFullAndPartialBothLayouts) {
  torch::manual_seed(1);
  for (RopeLayout layout : {RopeLayout::interleaved, RopeLayout::half})
    for (int rotary_dim : {8, 2}) {  // full and partial (rope25 on head_dim 8)
      const torch::Tensor x = torch::randn({2, 7, 3, 8});
      const double worst = check_gradient(
          [&](const torch::Tensor& t) { return posenc::detail::rope_rotate(t, rotary_dim, 10000.0, layout); }, x);
      EXPECT_LT(worst, 1e-3);
    }
}

TEST(TrainAutograd, RopeRotatesOnlyTheRotaryChannelsAndPositionZeroIsIdentity) {
  torch::manual_seed(2);
  const torch::Tensor x = torch::randn({1, 5, 2, 8});
  const torch::Tensor y = posenc::detail::rope_rotate(x, 2, 10000.0, RopeLayout::interleaved);
  EXPECT_TRUE(torch::equal(y.index({0, 0}), x.index({0, 0})));  // angle 0
  EXPECT_TRUE(torch::equal(y.narrow(3, 2, 6), x.narrow(3, 2, 6)));  // pass-through channels
  EXPECT_FALSE(torch::equal(y.narrow(3, 0, 2), x.narrow(3, 0, 2)));
  // A rotation keeps each pair's norm.
  const auto n0 = x.narrow(3, 0, 2).pow(2).sum(-1), n1 = y.narrow(3, 0, 2).pow(2).sum(-1);
  EXPECT_TRUE(torch::allclose(n0, n1, 1e-5, 1e-6));
}

TEST(TrainAutograd, SinusoidalIsAConstantShift) {
  torch::manual_seed(3);
  const torch::Tensor x = torch::randn({2, 6, 10});
  check_gradient([](const torch::Tensor& t) { return posenc::detail::add_sinusoidal(t, 10000.0); }, x);
  const torch::Tensor y = posenc::detail::add_sinusoidal(torch::zeros({1, 3, 4}), 10000.0);
  // PE(pos 1, 2i=0) = sin(1), PE(1, 1) = cos(1) (Vaswani et al. §3.5).
  EXPECT_FLOAT_EQ(y[0][1][0].item<float>(), static_cast<float>(std::sin(1.0)));
  EXPECT_FLOAT_EQ(y[0][1][1].item<float>(), static_cast<float>(std::cos(1.0)));
}

TEST(TrainAutograd, LearnedTableGetsScatterAddedGradientsAndThrowsPastItsEnd) {
  torch::manual_seed(4);
  const torch::Tensor table = torch::randn({9, 5});
  check_gradient([](const torch::Tensor& t) { return posenc::detail::learned_positions(t, 6); }, table);
  // Rows past the read positions receive exactly zero gradient.
  torch::Tensor t = table.clone().set_requires_grad(true);
  posenc::detail::learned_positions(t, 6).sum().backward();
  EXPECT_EQ(t.grad().narrow(0, 6, 3).abs().sum().item<float>(), 0.0f);
  EXPECT_EQ(t.grad().narrow(0, 0, 6).sum().item<float>(), 30.0f);
  EXPECT_THROW(posenc::detail::learned_positions(table, 10), PositionError);
}

TEST(TrainAutograd, T5TableGetsGradientsSummedOverEachBucket) {
  torch::manual_seed(5);
  // 8 causal buckets, max_distance 16, 30 positions: exact and log buckets and the cap.
  const torch::Tensor table = torch::randn({8, 3});
  check_gradient([](const torch::Tensor& t) { return posenc::detail::t5_bias(t, 30, 8, 16); }, table);
  // d sum(bias) / d table[b, h] = number of (i, j) pairs in bucket b.
  torch::Tensor t = table.clone().set_requires_grad(true);
  posenc::detail::t5_bias(t, 30, 8, 16).sum().backward();
  EXPECT_EQ(t.grad()[0][0].item<float>(), 30.0f + 29 * 30 / 2);  // causal bucket 0: the diagonal and every j > i
  EXPECT_EQ(t.grad()[1][2].item<float>(), 29.0f);                 // offset -1
}

TEST(TrainAutograd, AlibiAddsAFixedBiasAndPassesTheGradientThrough) {
  torch::manual_seed(6);
  const torch::Tensor scores = torch::randn({2, 4, 5, 5});
  check_gradient([](const torch::Tensor& s) { return posenc::detail::add_alibi(s, 8.0); }, scores);
  const torch::Tensor b = posenc::detail::add_alibi(torch::zeros({1, 4, 3, 3}), 8.0);
  // Head 0 slope 2^-2 for 4 heads (Press et al.): bias(i=2, j=0) = -0.25 * 2.
  EXPECT_FLOAT_EQ(b[0][0][2][0].item<float>(), -0.5f);
  EXPECT_FLOAT_EQ(b[0][3][2][1].item<float>(), -1.0f / 256.0f);
}

}  // namespace POSENC_UNITY_ID
