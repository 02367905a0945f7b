#include "serve/connection_threads.hpp"

#include <utility>

namespace posenc::detail {

namespace {
thread_local bool t_serving_inline = false;  // enqueue's caller is running a job (ConnectionThreads::serving_inline)
}  // namespace

bool ConnectionThreads::serving_inline() { return t_serving_inline; }

bool ConnectionThreads::jobs_waiting() const {
  std::lock_guard lk(mu_);
  return jobs_.size() > idle_ + starting_;
}

ConnectionThreads::ConnectionThreads(std::size_t max_threads, std::chrono::milliseconds idle_exit,
                                     std::atomic<int64_t>& alive, std::function<bool()> close_idle)
    : max_(max_threads), idle_exit_(idle_exit), alive_(alive), close_idle_(std::move(close_idle)) {}

void ConnectionThreads::enqueue(std::function<void()> fn) {
  bool full = false, run_here = false;
  std::list<std::thread> ended;
  {
    std::lock_guard lk(mu_);
    ended.swap(ended_);
    try {
      jobs_.push_back(std::move(fn));
    } catch (...) {  // std::bad_alloc; fn is untouched (push_back's strong guarantee)
      run_here = true;
    }
    if (!run_here) {
      if (jobs_.size() <= idle_) {
        cv_.notify_one();
      } else if (threads_.size() < max_) {
        auto it = threads_.end();
        try {
          it = threads_.emplace(threads_.end());
          *it = std::thread([this, it] { work(it); });
          ++starting_;
        } catch (...) {  // std::bad_alloc (the list's node, the thread's state) or std::system_error (no thread)
          if (it != threads_.end()) threads_.erase(it);
          if (threads_.empty()) {  // no thread will take the job: take it back
            fn = std::move(jobs_.back());
            jobs_.pop_back();
            run_here = true;
          } else {  // the job waits for a running thread: free one as when every thread is taken
            full = true;
          }
        }
        alive_ = static_cast<int64_t>(threads_.size());
      } else {
        full = true;
      }
    }
  }
  for (auto& t : ended) t.join();
  if (run_here) {
    ran_inline_.fetch_add(1);
    t_serving_inline = true;
    try {
      fn();
    } catch (...) {
      t_serving_inline = false;
      throw;
    }
    t_serving_inline = false;
    return;
  }
  if (full) close_idle_();
}

void ConnectionThreads::shutdown() {
  {
    std::lock_guard lk(mu_);
    shutdown_ = true;
  }
  cv_.notify_all();
  // enqueue is not called after shutdown (httplib's accept loop has ended); each thread ends once its
  // connection has (HttpServer's loop sees the server stopping) and is joined here.
  std::unique_lock lk(mu_);
  for (;;) {
    ended_cv_.wait(lk, [&] { return !ended_.empty() || threads_.empty(); });
    if (ended_.empty()) break;
    std::list<std::thread> ended;
    ended.swap(ended_);
    lk.unlock();
    for (auto& t : ended) t.join();
    lk.lock();
  }
}

void ConnectionThreads::work(std::list<std::thread>::iterator self) {
  std::unique_lock lk(mu_);
  --starting_;
  for (;;) {
    ++idle_;
    cv_.wait_for(lk, idle_exit_, [&] { return !jobs_.empty() || shutdown_; });
    --idle_;
    if (jobs_.empty()) {  // stopping, or idle for idle_exit: end (joined by the next enqueue or by shutdown)
      ended_.splice(ended_.end(), threads_, self);
      alive_ = static_cast<int64_t>(threads_.size());
      ended_cv_.notify_all();
      return;
    }
    auto fn = std::move(jobs_.front());
    jobs_.pop_front();
    lk.unlock();
    fn();
    lk.lock();
  }
}

}  // namespace posenc::detail
