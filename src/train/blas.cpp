// Working around the loaded OpenBLAS's kernel choice (see train.hpp).
#include <dlfcn.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "posenc/train.hpp"
#include "train/torch_module.hpp"

namespace posenc {

bool set_openblas_threads(int n) {
  using SetThreads = void (*)(int);
  auto* f = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (!f) return false;
  f(n);
  return true;
}

const char* fast_openblas_coretype(const char* reported) {
  if (!reported) return nullptr;
  const bool slow = std::strcmp(reported, "Cooperlake") == 0 || std::strcmp(reported, "Prescott") == 0;
  if (!slow) return nullptr;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
  return nullptr;
}

bool reexec_for_fast_openblas() {
  if (std::getenv("OPENBLAS_CORETYPE")) return false;
  detail::torch_train_model();  // OpenBLAS comes with libtorch, in the module: load it to ask OpenBLAS
  using CoreName = char* (*)();
  auto* corename = reinterpret_cast<CoreName>(::dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  if (!corename) return false;
  const char* core = corename();
  const char* fast = fast_openblas_coretype(core);
  if (!fast) return false;
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  const std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  for (std::size_t pos = 0; pos < cmdline.size();) {
    const std::size_t end = cmdline.find('\0', pos);
    args.push_back(cmdline.substr(pos, end == std::string::npos ? std::string::npos : end - pos));
    if (end == std::string::npos) break;
    pos = end + 1;
  }
  if (args.empty()) return false;
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  ::setenv("OPENBLAS_CORETYPE", fast, 1);
  if (!std::getenv("OPENBLAS_NUM_THREADS")) ::setenv("OPENBLAS_NUM_THREADS", "1", 1);
  std::fflush(stdout);
  std::fflush(stderr);
  ::execv("/proc/self/exe", argv.data());
  ::unsetenv("OPENBLAS_CORETYPE");  // exec failed: carry on with the slow kernels
  return false;
}

}  // namespace posenc
