// The continuous-batching scheduler of posenc serve (internal).
//
// One thread owns the KV cache. A Job enters through submit() (bounded queue),
// is admitted between steps when a batch slot and KV room are free, and leaves
// when it stops (EOS, a stop token or string, max_tokens, the allowed context),
// is cancelled (its client left) or fails. The HTTP side waits on the Job.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "eval/rng.hpp"
#include "posenc/kv_cache.hpp"
#include "posenc/model.hpp"
#include "posenc/serve.hpp"
#include "serve/metrics.hpp"

namespace posenc::serve::detail {

/// One entry of a completion's logprobs lists.
struct TokenLogprob {
  int32_t id = 0;
  std::optional<double> logprob;                  ///< nullopt: the first prompt token (nothing predicts it)
  std::vector<std::pair<int32_t, double>> top;    ///< alternatives, most likely first (ties: lowest id)
};

struct Job {
  // ---- the request (set before submit, then read-only) ----
  std::vector<int32_t> prompt;
  int64_t max_tokens = 16;
  double temperature = 1.0;
  double top_p = 1.0;
  uint64_t seed = 0;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;  ///< + the tokenizer's EOS
  std::optional<int> logprobs;
  bool echo = false;
  bool prompt_rows() const { return echo && logprobs.has_value(); }  ///< prompt logprobs are needed
  std::chrono::steady_clock::time_point enqueued;

  // ---- scheduler state (scheduler thread only) ----
  KvCache::SeqId seq = -1;
  std::vector<int32_t> kv_tokens;  ///< the tokens in the cache for seq, in position order
  int64_t fed = 0;                 ///< prompt tokens in the cache
  int64_t reused = 0;              ///< of which came from the prefix cache
  int32_t pending = -1;            ///< sampled, not yet fed
  int32_t text_prev = -1;          ///< the token the next piece is decoded after
  int64_t reserved_blocks = 0;
  ::posenc::detail::Rng rng{0};

  // ---- the result (written by the scheduler before `done`) ----
  std::vector<int32_t> generated;
  std::vector<TokenLogprob> prompt_lp;  ///< [prompt.size()] when prompt_rows()
  std::vector<TokenLogprob> gen_lp;     ///< [generated.size()] when logprobs
  std::string text;                     ///< generated text (cut before a stop string)
  std::string finish_reason;            ///< "stop" | "length"
  int error_status = 0;                 ///< != 0: failed with this HTTP status
  std::string error_type;               ///< the error body's "type": "server_error" or serve::numeric_error_type
  std::string error_message;
  std::optional<double> first_token_seconds;

  // ---- synchronisation ----
  std::atomic<bool> cancelled{false};
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  bool wait_for(std::chrono::milliseconds d) {
    std::unique_lock lk(m);
    return cv.wait_for(lk, d, [&] { return done; });
  }
};

class Scheduler {
 public:
  Scheduler(const Model& model, const Tokenizer& tokenizer, const ServeConfig& config, int64_t max_model_len,
            Metrics& metrics);
  ~Scheduler();
  /// Enqueues; throws RequestError 503 (queue full, Retry-After) or 503 draining.
  void submit(const std::shared_ptr<Job>& job);
  /// Refuses new jobs, finishes queued and running ones, joins the thread.
  void drain();
  /// Worst-case KV blocks a request of this size holds.
  int64_t blocks_needed(int64_t tokens) const { return (tokens + block_size_ - 1) / block_size_ + 2; }
  int64_t block_budget() const { return max_blocks_; }
  void fill_stats(ServerStats& s) const;

 private:
  struct CachedPrefix {
    KvCache::SeqId seq;
    std::vector<int32_t> tokens;
    uint64_t last_used;
    /// The prompt log-probabilities computed for tokens[1 .. lp.size() - 1] (lp[t] scores tokens[t] given the
    /// tokens before; lp[0] unused), with lp_top alternatives each; empty when the sequence had no prompt rows.
    /// A request that needs prompt rows reuses this prefix only as far as these rows reach.
    std::vector<TokenLogprob> lp;
    int lp_top = -1;
  };
  void run();
  bool admit_one(const std::shared_ptr<Job>& job);  // false: no room now
  void step();
  void consume_row(Job& job, const float* row, bool prompt_row, int64_t target_index);
  void sample_next(Job& job, const float* row);
  void finish(const std::shared_ptr<Job>& job, bool donate);
  void fail(const std::shared_ptr<Job>& job, int status, const std::string& message,
            std::string_view type = "server_error");
  void publish(Job& job);
  int64_t cache_blocks() const;
  void drop_prefix(std::list<CachedPrefix>::iterator it);
  void donate(Job& job);
  void update_gauges();

  const Model& model_;
  const Tokenizer& tok_;
  ServeConfig cfg_;
  int64_t max_model_len_;
  int block_size_;
  int64_t max_blocks_;
  Metrics& metrics_;
  std::optional<int32_t> eos_;
  int V_;

  KvCache cache_;
  std::list<CachedPrefix> prefixes_;  // most recently used first
  uint64_t clock_ = 0;
  std::vector<std::shared_ptr<Job>> running_;
  std::vector<float> logits_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool draining_ = false;
  std::atomic<int64_t> running_count_{0};
  std::atomic<int64_t> kv_blocks_in_use_{0};
  std::atomic<int64_t> prefix_count_{0};
  std::thread thread_;
};

/// Samples from softmax(row / temperature) restricted to the top_p nucleus (tokens sorted by probability,
/// highest first, ties by lowest id; the smallest prefix whose mass reaches top_p of the total), with one
/// uniform draw of `rng` (splitmix64, detail::Rng::uniform01). Probabilities in double.
int32_t sample_token(const float* row, int V, double temperature, double top_p, ::posenc::detail::Rng& rng);

/// The `k` most likely tokens of a logits row with their log-probabilities (detail::log_prob's arithmetic),
/// most likely first, ties by lowest id.
std::vector<std::pair<int32_t, double>> top_logprobs(const float* row, int V, int k);

}  // namespace posenc::serve::detail
