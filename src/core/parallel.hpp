// An exception thrown inside an OpenMP parallel region must not escape it
// (the runtime calls std::terminate). Loop bodies run through FirstException
// instead: the first exception is kept, the remaining iterations are skipped,
// and the caller rethrows it after the region.
#pragma once

#include <atomic>
#include <exception>
#include <mutex>

namespace posenc::detail {

class FirstException {
 public:
  /// Runs f() unless an earlier iteration failed; records its exception.
  template <class F>
  void run(F&& f) noexcept {
    if (failed_.load(std::memory_order_relaxed)) return;
    try {
      f();
    } catch (...) {
      std::lock_guard lock(mu_);
      if (!error_) error_ = std::current_exception();
      failed_.store(true, std::memory_order_relaxed);
    }
  }
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  /// Rethrows the recorded exception, if any (call after the parallel region).
  void rethrow() const {
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::atomic<bool> failed_{false};
  std::mutex mu_;
  std::exception_ptr error_;
};

}  // namespace posenc::detail
