// What the eval runner asks of a model served over HTTP (eval --endpoint):
// the seam between runner.cpp (cells, resume, shards, outputs) and the
// endpoint client. The in-process model is the other side of the seam
// (run_eval_impl with a Model and no EndpointLab).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "posenc/endpoint.hpp"
#include "posenc/eval.hpp"
#include "posenc/perplexity.hpp"

namespace posenc::detail {

/// `h` as 16 lowercase hex digits (the hashes in run.json and in the endpoint lab's prompt hashes).
std::string hex16(uint64_t h);

/// Prints "eval: warning: <message>" and a newline to stderr, flushed (the eval runner's and the endpoint lab's
/// warnings).
void eval_warn(const std::string& message);

/// A cell or perplexity result that is not computed, and why.
struct UnitStatus {
  std::string status;  ///< "does not fit" or "not supported by this endpoint"
  std::string note;
};

inline constexpr const char* kNotSupported = "not supported by this endpoint";

class EndpointLab {
 public:
  /// Probes every endpoint (probe_endpoint) and settles the trained context.
  EndpointLab(const EndpointEvalConfig& config, const Tokenizer& tokenizer);
  ~EndpointLab();

  int64_t trained_context() const { return trained_; }
  const std::string& trained_context_source() const { return trained_source_; }
  /// What of the endpoints changes results (hashed into the run id).
  nlohmann::json run_id_material() const;
  /// run.json "endpoints" (per endpoint) and "request_parameters".
  nlohmann::json endpoints_json() const;
  nlohmann::json request_parameters_json() const;
  /// run.json "model".
  nlohmann::json model_json() const;
  /// The vocabulary size the server reports (posenc serve), if any.
  std::optional<int64_t> vocab_size() const;

  /// nullopt: the unit runs; else why it is not computed.
  std::optional<UnitStatus> status(const std::string& label, int64_t length, bool likelihood) const;

  struct GroupResult {
    std::vector<std::vector<SampleOutcome>> outcomes;  ///< [sample][depth]
    int64_t computed = 0;                              ///< samples (x depths) sent now, not from the journal
  };
  /// Every sample of a group (samples[i] = sample index i at each depth)
  /// through the endpoint `label`, journaled in `journal` (see
  /// run_eval_endpoint). `on_sample(done)` is called (serialised) after each
  /// journaled sample with the count done so far.
  GroupResult run_group(const std::string& label, const std::filesystem::path& journal,
                        const std::vector<std::vector<TaskSample>>& samples,
                        const std::function<void(int64_t)>& on_sample);

  /// The perplexity protocol's windows scored through `label` (journaled per window).
  PplResult perplexity(const std::string& label, const std::filesystem::path& journal,
                       std::span<const int32_t> stream, const PplOptions& options);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int64_t trained_ = 0;
  std::string trained_source_;
};

/// The run: run_eval with exactly one of `model` and `endpoint`.
EvalRunResult run_eval_impl(const Model* model, EndpointLab* endpoint, const Tokenizer& tokenizer,
                            std::string_view haystack_text, EvalConfig config,
                            const std::function<void(const EvalProgress&)>& on_progress);

}  // namespace posenc::detail
