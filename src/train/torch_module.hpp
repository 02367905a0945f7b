// The libtorch half of the trainer lives in a module, libposenc_torch.so, which only
// the processes that train load (posenc train / study, the training tests): linking
// libtorch into every posenc process cost 0.4 s of CPU at each start (its operator
// registry and 280 shared libraries), 1 s under ASan, for every CLI call of the tests.
#pragma once

#include <functional>

#include "posenc/train.hpp"

namespace posenc::detail {

/// The module's entry point (C linkage for dlsym; C++ types and exceptions cross it,
/// both sides being this source tree built by one compiler).
using TorchTrainModel = void (*)(const TrainConfig& config, const std::function<void(const TrainProgress&)>& on_progress,
                                 int report_every, TrainResult& result);
inline constexpr const char* kTorchTrainModelSymbol = "posenc_torch_train_model";

/// Loads libposenc_torch.so (the first that exists of: next to the running executable
/// (/proc/self/exe; a build tree), <exe dir>/../lib/posenc/ (an installed bin/posenc),
/// the configured install prefix's lib/posenc/, the build tree's path POSENC_TORCH_MODULE)
/// with RTLD_GLOBAL, once per process, so that the
/// libtorch and OpenBLAS under it are visible to dlsym(RTLD_DEFAULT, ...) afterwards.
/// Returns its train_model. Throws IoError naming the paths tried and dlerror().
TorchTrainModel torch_train_model();

}  // namespace posenc::detail
