// Loading libposenc_torch.so on first use (see torch_module.hpp).
#include "train/torch_module.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <string>
#include <system_error>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "posenc/error.hpp"

#ifndef POSENC_TORCH_MODULE
#define POSENC_TORCH_MODULE ""
#endif
#ifndef POSENC_TORCH_MODULE_FROM_BIN
#define POSENC_TORCH_MODULE_FROM_BIN ""
#endif
#ifndef POSENC_TORCH_MODULE_INSTALLED
#define POSENC_TORCH_MODULE_INSTALLED ""
#endif

namespace posenc::detail {

namespace {

TorchTrainModel load() {
  std::vector<std::string> tried;
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  std::vector<std::filesystem::path> candidates;
  // POSENC_TORCH_MODULE (environment) first: programs of other projects linking an installed posenc::train
  // anywhere but the configured prefix name it (posencConfig.cmake gives the path as posenc_TORCH_MODULE).
  if (const char* env = std::getenv("POSENC_TORCH_MODULE"); env != nullptr && *env != '\0') candidates.emplace_back(env);
  if (!ec) {
    const std::filesystem::path dir = exe.parent_path();
    candidates.push_back(dir / "libposenc_torch.so");     // a build tree: next to the program
    if (std::string(POSENC_TORCH_MODULE_FROM_BIN) != "")  // installed: bin/posenc, lib/posenc/
      candidates.push_back((dir / POSENC_TORCH_MODULE_FROM_BIN / "libposenc_torch.so").lexically_normal());
  }
  for (const char* path : {POSENC_TORCH_MODULE_INSTALLED, POSENC_TORCH_MODULE})
    if (std::string(path) != "" &&
        std::find(candidates.begin(), candidates.end(), std::filesystem::path(path)) == candidates.end())
      candidates.emplace_back(path);
  for (const auto& path : candidates) {
    if (!std::filesystem::exists(path, ec)) {
      tried.push_back(fmt::format("{} (absent)", path.string()));
      continue;
    }
    void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (!handle) {
      const char* why = ::dlerror();
      tried.push_back(fmt::format("{} ({})", path.string(), why ? why : "dlopen failed"));
      continue;
    }
    if (void* f = ::dlsym(handle, kTorchTrainModelSymbol)) return reinterpret_cast<TorchTrainModel>(f);
    tried.push_back(fmt::format("{} (no symbol {})", path.string(), kTorchTrainModelSymbol));
  }
  throw IoError(fmt::format("train: cannot load the libtorch module libposenc_torch.so (tried: {})",
                            tried.empty() ? std::string("no path") : fmt::format("{}", fmt::join(tried, "; "))));
}

}  // namespace

TorchTrainModel torch_train_model() {
  static std::mutex mutex;
  static TorchTrainModel loaded = nullptr;
  const std::lock_guard<std::mutex> lock(mutex);
  if (!loaded) loaded = load();  // a failure throws and is retried at the next call
  return loaded;
}

}  // namespace posenc::detail
