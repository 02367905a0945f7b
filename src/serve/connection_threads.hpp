// posenc serve's connection threads (internal): cpp-httplib's task queue, grown on demand.
#pragma once

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <mutex>
#include <thread>

namespace posenc::detail {

/// cpp-httplib's task queue for connections, grown on demand: each connection holds a pool thread while it is
/// open (HttpServer's loop), so a fixed pool lets slow or idle clients hold every thread while /health waits
/// behind them. A connection gets an idle thread or a new one, up to `max_threads`; past that the connection that
/// has waited longest for its next request is closed to free its thread (`close_idle`), and when none is waiting
/// the new connection waits for a thread. A thread idle for `idle_exit` ends.
///
/// enqueue never throws and never drops a job (httplib's accept loop calls it, and a job owns its connection's
/// socket): when the job cannot be queued (std::bad_alloc) or no thread can be started for it while none is running
/// (std::bad_alloc, std::system_error), it runs on the calling thread, which accepts no connection meanwhile (the
/// job can tell: serving_inline(); HttpServer then serves one request and closes); when a thread cannot be started
/// but others run, the job waits in the queue for one of them and `close_idle` is called, as when every thread is
/// taken.
class ConnectionThreads : public httplib::TaskQueue {
 public:
  ConnectionThreads(std::size_t max_threads, std::chrono::milliseconds idle_exit, std::atomic<int64_t>& alive,
                    std::function<bool()> close_idle);
  void enqueue(std::function<void()> fn) override;
  void shutdown() override;
  /// How many jobs ran on enqueue's caller because memory or a thread was lacking (the tests read it).
  int64_t ran_inline() const { return ran_inline_.load(); }
  /// Whether the calling thread is running a job inside enqueue (so that no connection is accepted until it ends).
  static bool serving_inline();
  /// Whether a job waits in the queue with no thread to take it, idle or starting (a connection waits for a
  /// thread; HttpServer's claim_room).
  bool jobs_waiting() const;

 private:
  void work(std::list<std::thread>::iterator self);
  std::size_t max_;
  std::chrono::milliseconds idle_exit_;
  std::atomic<int64_t>& alive_;
  std::function<bool()> close_idle_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable ended_cv_;
  std::deque<std::function<void()>> jobs_;
  std::list<std::thread> threads_;
  std::list<std::thread> ended_;  // threads that have ended, to join (spliced from threads_: no allocation)
  std::size_t idle_ = 0;
  std::size_t starting_ = 0;  // threads started by enqueue that have not yet looked for a job
  bool shutdown_ = false;
  std::atomic<int64_t> ran_inline_{0};
};

}  // namespace posenc::detail
