// posenc check-cache: the position-consistency checker on a real checkpoint.
#include <random>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "common.hpp"
#include "posenc/consistency.hpp"
#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/perplexity.hpp"
#include "posenc/scaling.hpp"

namespace posenc::cli {

namespace {

struct CheckArgs {
  ModelArgs model;
  std::string text_path;  // "" = pseudo-random token ids
  ConsistencyOptions options;
  uint64_t seed = 1;
  std::string json;  // "" = none, "-" = stdout, else a file written atomically
  std::string rope_scaling = "native";
  std::optional<double> rope_factor;
  std::string rope_change_policy = "recompute";
};

/// `count` token ids uniform in [0, vocab) from std::mt19937_64(seed): the
/// scenarios compare paths over the same tokens, so any ids serve (a posenc
/// checkpoint's symbol vocabulary reads no prose).
std::vector<int32_t> random_stream(int vocab, int64_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> out(static_cast<std::size_t>(count));
  for (auto& t : out) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return out;
}

nlohmann::json plan_json(const ConsistencyPlan& p) {
  return {{"length", p.length},
          {"block_size", p.block_size},
          {"chunk_sizes", p.chunk_sizes},
          {"padded_first", p.padded_first},
          {"padded_second", p.padded_second},
          {"padded_decode_steps", p.padded_decode_steps},
          {"padded_offsets", p.padded_offsets},
          {"ragged_totals", p.ragged_totals},
          {"ragged_first", p.ragged_first},
          {"ragged_strides", p.ragged_strides},
          {"fork_prefix", p.fork_prefix},
          {"fork_suffix", p.fork_suffix},
          {"fork_suffix_offsets", p.fork_suffix_offsets},
          {"shift_offset", p.shift_offset},
          {"sliding_window", p.sliding_window},
          {"stream_tokens", p.stream_tokens}};
}

void run_check(const CheckArgs& a) {
  ModelArgs margs = a.model;
  margs.tokenizer_optional = a.text_path.empty();  // pseudo-random ids need no tokenizer
  check_rope_scaling_name(a.rope_scaling);
  LoadedModel lm = load_model(margs);
  Model& model = lm.model;
  const Tokenizer& tok = lm.tokenizer;
  ConsistencyOptions opt = a.options;
  opt.rope_change_policy = parse_rope_change_policy(a.rope_change_policy, "--rope-change-policy");
  check_rope_factor_applies(model, a.rope_factor);
  if (a.rope_scaling != "native") {
    if (model.family() != PositionFamily::rope)
      throw ConfigError(fmt::format("--rope-scaling: {} uses {} positions; RoPE scalings do not apply (got {})",
                                    a.model.model_path, to_string(model.family()), a.rope_scaling));
    // As ppl applies it to a window of the checked length (the length-dependent
    // methods recompute their frequencies in every forward anyway).
    const RopeSetup base = model.rope();
    const int64_t T = model.trained_context();
    model.set_rope(rope_setup_for_context(base, T, a.rope_scaling, opt.length > 0 ? opt.length : T, a.rope_factor));
    // The default length of a length-dependent method passes its switch point: the setup follows it.
    if (opt.length == 0 && default_consistency_length(model) != T)
      model.set_rope(rope_setup_for_context(base, T, a.rope_scaling, default_consistency_length(model), a.rope_factor));
  }
  const bool derived = opt.length == 0;
  if (derived) opt.length = default_consistency_length(model);
  const int64_t table = model.config().max_position_embeddings;
  if (model.family() == PositionFamily::learned_absolute && table > 0 && opt.length > table)
    throw UsageError(fmt::format("--length: {} positions are past the learned position table of {} ({} rows; "
                                 "the longest length for this model is {})",
                                 opt.length, a.model.model_path, table, table));
  const ConsistencyPlan plan = [&] {
    try {
      return consistency_plan(opt);
    } catch (const InvalidArgument& e) {
      throw UsageError(fmt::format("--length/--block-size: {}", e.what()));
    }
  }();
  if (a.json != "-") print_model_header(stderr, lm, a.model);
  std::vector<int32_t> stream;
  std::string tokens_from;
  if (a.text_path.empty()) {
    stream = random_stream(model.config().vocab_size, plan.stream_tokens, a.seed);
    tokens_from = fmt::format("{} pseudo-random token ids (mt19937_64 seed {})", stream.size(), a.seed);
  } else {
    stream = encode_stream(tok, read_text_input(a.text_path, "--text"));
    tokens_from = fmt::format("{} ({} tokens)", a.text_path, stream.size());
  }
  const ConsistencyReport r = check_cache_consistency(model, stream, opt);
  const int64_t T = model.trained_context();
  // Bytes of k/v storage per token in the checked caches and in a float32 one (no block is allocated here).
  const int64_t kv_bytes = model.make_cache(plan.block_size).kv_bytes_per_token();
  const int64_t kv_bytes_f32 = model.make_cache(plan.block_size, 0, KvCacheDtype::f32).kv_bytes_per_token();
  const std::string length_source =
      !derived                ? std::string("--length")
      : opt.length == T       ? fmt::format("the trained context, {}", model.trained_context_source())
      : !r.rope_type.empty() && opt.length > r.rope_switch_point && r.rope_switch_point >= kMinConsistencyLength
          ? fmt::format("past rope_type {}'s switch point {} (S + max(16, S/3))", r.rope_type, r.rope_switch_point)
      : opt.length > T        ? fmt::format("the trained context {} raised to the minimum", T)
      : opt.length == table   ? fmt::format("the trained context {} capped by the learned position table", T)
                              : fmt::format("the trained context {} capped at the maximum", T);
  if (!a.json.empty()) {
    nlohmann::json j;
    j["model"] = a.model.model_path;
    j["positional_family"] = std::string(to_string(r.family));
    j["trained_context"] = r.trained_context;
    j["length"] = r.plan.length;
    j["length_source"] = length_source;
    j["tokens_from"] = tokens_from;
    j["plan"] = plan_json(r.plan);
    j["scenarios"] = nlohmann::json::array();
    for (const auto& s : r.scenarios) {
      nlohmann::json js{{"name", s.name}, {"reference", s.reference}, {"skipped", !s.skipped.empty()}};
      if (s.skipped.empty()) {
        js["max_abs_logit_diff"] = s.max_abs_logit_diff;
        js["tokens"] = s.tokens;
        js["passed"] = s.ok(r.tolerance);
        if (r.kv_dtype != KvCacheDtype::f32) {
          js["kv_rounding"] = s.kv_rounding;
          js["kv_roundings"] = s.kv_roundings;
          js["tolerance"] = s.tolerance_for(r.tolerance);
        }
      } else {
        js["skip_reason"] = s.skipped;
      }
      if (!s.failure.empty()) js["failure"] = s.failure;
      if (!s.note.empty()) js["note"] = s.note;
      if (s.informational) js["informational"] = true;
      j["scenarios"].push_back(js);
    }
    if (!r.rope_type.empty()) {
      j["rope_type"] = r.rope_type;
      j["rope_switch_point"] = r.rope_switch_point;
      j["rope_change_policy"] = std::string(to_string(r.rope_change_policy));
    }
    j["tolerance"] = r.tolerance;
    j["kv_dtype"] = std::string(to_string(r.kv_dtype));
    j["kv_bytes_per_token"] = kv_bytes;
    j["kv_bytes_per_token_f32"] = kv_bytes_f32;
    if (r.kv_dtype != KvCacheDtype::f32) {
      double worst = 0.0;
      for (const auto& s : r.scenarios)
        if (s.skipped.empty() && !s.informational) worst = std::max(worst, s.max_abs_logit_diff);
      j["kv_error"] = worst;  // the largest max |dlogit| against the float32 full forward over the judged scenarios
      j["kv_rounding_margin"] = kKvRoundingMargin;
    }
    j["passed"] = r.passed;
    j["position_warning"] = position_warning_json();
    emit_json(a.json, j);
  }
  if (a.json != "-") {
    const auto& p = r.plan;
    fmt::print("length {} (from {}), positional family {}, KV block size {}, tokens: {}\n", p.length, length_source,
               to_string(r.family), p.block_size, tokens_from);
    fmt::print("sizes: chunks {}; padded prompts {}+{} then {} decode steps; ragged {} (first {}, strides {}); fork "
               "prefix {} + suffix {}; window {}\n",
               fmt::join(p.chunk_sizes, "/"), fmt::join(p.padded_first, "/"), fmt::join(p.padded_second, "/"),
               p.padded_decode_steps, fmt::join(p.ragged_totals, "/"), fmt::join(p.ragged_first, "/"),
               fmt::join(p.ragged_strides, "/"), p.fork_prefix, p.fork_suffix, p.sliding_window);
    if (!r.rope_type.empty())
      fmt::print("rope_type {} changes its frequencies past {} tokens: rope change policy {} is checked; the other "
                 "policies' drift is reported (informational, not judged)\n",
                 r.rope_type, r.rope_switch_point, to_string(r.rope_change_policy));
    const bool rounded = r.kv_dtype != KvCacheDtype::f32;
    if (rounded)
      fmt::print("KV cache dtype {} ({} bytes of k/v per token, {} in f32): each scenario's max |dlogit| is against "
                 "the float32 full forward; 'rounding' is what storing k/v in {} costs the full forward itself, and a "
                 "scenario passes within tolerance + {:g} x rounding x the times its path rounds a key (1; 2 for "
                 "context_shift; 1 + re-rotations for rerotate)\n",
                 to_string(r.kv_dtype), kv_bytes, kv_bytes_f32, to_string(r.kv_dtype), kKvRoundingMargin);
    if (rounded)
      fmt::print("{:<36} {:>14} {:>11} {:>8}  {}\n", "scenario", "max |dlogit|", "rounding", "tokens", "compared with");
    else
      fmt::print("{:<36} {:>14} {:>8}  {}\n", "scenario", "max |dlogit|", "tokens", "compared with");
    for (const auto& s : r.scenarios) {
      if (!s.skipped.empty()) {
        fmt::print("{:<36} {:>14} {}{:>8}  skipped: {}\n", s.name, "-", rounded ? fmt::format("{:>11} ", "-") : "",
                   "-", s.skipped);
        continue;
      }
      fmt::print("{:<36} {:>14.3e} {}{:>8}  {}{}{}{}{}\n", s.name, s.max_abs_logit_diff,
                 rounded ? fmt::format("{:>11.3e} ", s.kv_rounding) : "", s.tokens, s.reference,
                 s.note.empty() ? "" : "; " + s.note, s.informational ? " [drift, informational]" : "",
                 s.ok(r.tolerance) ? "" : "   <-- FAIL", s.failure.empty() ? "" : ": " + s.failure);
    }
    if (rounded)
      fmt::print("{} (tolerance {:g} + {:g} x rounding per rounding; KV cache {}, largest judged max |dlogit| {:.3e})\n",
                 r.passed ? "PASSED" : "FAILED", r.tolerance, kKvRoundingMargin, to_string(r.kv_dtype),
                 [&] {
                   double w = 0.0;
                   for (const auto& s : r.scenarios)
                     if (s.skipped.empty() && !s.informational) w = std::max(w, s.max_abs_logit_diff);
                   return w;
                 }());
    else
      fmt::print("{} (tolerance {:g})\n", r.passed ? "PASSED" : "FAILED", r.tolerance);
  }
  if (!r.passed) throw CacheError("position consistency check failed: see the scenarios above");
}

}  // namespace

void add_check_cache_command(CLI::App& app) {
  auto args = std::make_shared<CheckArgs>();
  CLI::App* cmd = app.add_subcommand(
      "check-cache", "Prove that the KV cache keeps position semantics: incremental, chunked, padded, ragged, forked, "
                     "shifted (RoPE) and windowed paths against one full forward, for every positional family");
  args->model.add_to(*cmd);
  args->model.add_kv_dtype_to(*cmd);
  cmd->add_option("--text", args->text_path,
                  "UTF-8 text supplying the tokens (default: pseudo-random token ids, --seed)");
  cmd->add_option("--length", args->options.length,
                  fmt::format("tokens per sequence (default: the trained context, capped by a learned position "
                              "table; at least {}); chunk sizes, prompt lengths, fork point and window follow it",
                              kMinConsistencyLength))
      ->transform(length_in(kMinConsistencyLength, kMaxConsistencyLength));
  cmd->add_option("--block-size", args->options.block_size, "KV cache block size (default: clamp(length/8, 2, 16))")
      ->check(int_in(1, 1 << 16));
  cmd->add_option("--seed", args->seed, "seed of the pseudo-random tokens used without --text")
      ->check(seed_value())
      ->capture_default_str();
  cmd->add_option("--tolerance", args->options.tolerance, "max |dlogit| allowed")
      ->check(finite_in(0, 1e6))
      ->capture_default_str();
  cmd->add_option("--rope-scaling", args->rope_scaling,
                  "RoPE scaling (rope_type) applied as ppl applies it to a window of --length tokens: native (the "
                  "model's own, or --config's), default, linear, ntk, dynamic, yarn, llama3, longrope, ...")
      ->capture_default_str();
  cmd->add_option("--rope-factor", args->rope_factor,
                  "scaling factor s of --rope-scaling (default: max(1, length / trained context))")
      ->check(finite_in(kMinRopeFactorFlag, kMaxRopeFactorFlag));
  cmd->add_option("--rope-change-policy", args->rope_change_policy,
                  "the policy the rope_change scenarios judge for a length-dependent rope_type (dynamic, longrope): "
                  "recompute, hf, refuse, rerotate; the others' drift is reported")
      ->check(CLI::IsMember({"recompute", "hf", "refuse", "rerotate"}))
      ->capture_default_str();
  add_json_option(cmd, args->json, "the scenarios and the verdict as JSON");
  cmd->callback([args] { run_check(*args); });
}

}  // namespace posenc::cli
