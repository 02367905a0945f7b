// posenc serve: the runtime behind an OpenAI-compatible HTTP API (include/posenc/serve.hpp).
#include <pthread.h>
#include <signal.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include <fmt/format.h>

#include "commands.hpp"
#include "common.hpp"
#include "posenc/perplexity.hpp"
#include "posenc/scaling.hpp"
#include "posenc/serve.hpp"
#include "posenc/version.hpp"
#include "posenc_version.hpp"

namespace posenc::cli {

namespace {

struct ServeArgs {
  ModelArgs model;
  serve::ServeConfig config;
  std::string rope_scaling = "native";
  std::optional<double> rope_factor;
  CLI::Option* rope_scaling_option = nullptr;
  bool quiet = false;
  double read_timeout_s = 5;
};

void run_serve(ServeArgs& a) {
  check_rope_scaling_name(a.rope_scaling);
  // SIGTERM / SIGINT are taken by a watcher thread (blocked here, before any thread starts, so every thread
  // inherits the mask): the server stops accepting, finishes in-flight requests, and the command exits 0.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  ::signal(SIGPIPE, SIG_IGN);

  LoadedModel lm = load_model(a.model);
  Model& model = lm.model;
  check_rope_factor_applies(model, a.rope_factor);
  if (a.rope_factor && (a.rope_scaling == "native" || a.rope_scaling == "default"))
    throw UsageError(fmt::format("--rope-factor: applies to a --rope-scaling method (linear, ntk, yarn, ...), not "
                                 "--rope-scaling {}{} (got --rope-factor {})",
                                 a.rope_scaling, a.rope_scaling_option->count() > 0 ? "" : " (the default)",
                                 *a.rope_factor));
  if (model.family() != PositionFamily::rope && a.rope_scaling != "native" && a.rope_scaling != "default")
    throw ConfigError(fmt::format("--rope-scaling: {} uses {} positions; RoPE scalings do not apply (got {})",
                                  a.model.model_path, to_string(model.family()), a.rope_scaling));
  serve::ServeConfig cfg = a.config;
  cfg.read_timeout = std::chrono::milliseconds(static_cast<int64_t>(std::llround(a.read_timeout_s * 1000)));
  // TEST-ONLY: POSENC_SERVE_TEST_STEP_DELAY_MS=n pauses n ms after each scheduler step, so the kill/resume test can
  // kill a server in the middle of a sweep however fast the machine is. Unset in normal use.
  if (const char* e = std::getenv("POSENC_SERVE_TEST_STEP_DELAY_MS")) cfg.step_delay = std::chrono::milliseconds(std::strtol(e, nullptr, 10));
  const int64_t L = cfg.max_model_len > 0 ? cfg.max_model_len : model.trained_context();
  if (model.family() == PositionFamily::rope)
    model.set_rope(rope_setup_for_context(model.rope(), model.trained_context(), a.rope_scaling, L, a.rope_factor));
  if (cfg.served_model_name.empty()) {
    std::filesystem::path p(a.model.model_path);
    if (p.filename().empty()) p = p.parent_path();
    cfg.served_model_name = p.filename().string();
  }
  cfg.version = std::string(posenc::version());
  cfg.git_commit = POSENC_GIT_COMMIT;
  if (!a.quiet) {
    print_model_header(stderr, lm, a.model);
    if (model.family() == PositionFamily::rope && a.rope_scaling != "native")
      fmt::print(stderr, "  rope scaling: {}{} (set up for max_model_len {}, the same for every request)\n",
                 a.rope_scaling, a.rope_factor ? fmt::format(", factor {:g}", *a.rope_factor) : "", L);
  }
  // A flag value the model cannot take (a KV budget below one --max-model-len sequence, a length past a learned
  // position table): a usage error naming the flag, exit 2.
  try {
    cfg.validate(model);
  } catch (const ConfigError& e) {
    std::string msg = e.what();
    static const std::pair<const char*, const char*> kFlags[] = {
        {"kv_cache_tokens", "--kv-cache-tokens"}, {"max_model_len", "--max-model-len"},
        {"max_step_tokens", "--max-step-tokens"}, {"max_batch", "--max-batch"},
        {"max_queue", "--max-queue"},             {"prefix_cache_entries", "--prefix-cache"},
        {"http_threads", "--http-threads"},       {"max_request_bytes", "--max-request-bytes"},
        {"threads", "--threads"},                 {"port", "--port"},
        {"host", "--host"},                       {"read_timeout", "--read-timeout"}};
    for (const auto& [field, flag] : kFlags)
      if (msg.rfind(std::string(field) + ":", 0) == 0) {
        msg = flag + msg.substr(std::string(field).size());
        break;
      }
    throw UsageError(msg);
  }
  serve::Server server(std::move(model), std::move(lm.tokenizer), cfg);
  const int port = server.start();
  fmt::print(stderr, "posenc serve: listening on http://{}:{}/v1 (model {}, max_model_len {})\n", cfg.host, port,
             server.served_model_name(), server.max_model_len());
  std::fflush(stderr);
  int sig = 0;
  sigwait(&signals, &sig);
  fmt::print(stderr, "posenc serve: {}: draining (finishing in-flight requests)\n", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  std::fflush(stderr);
  server.stop();
  const auto st = server.stats();
  fmt::print(stderr, "posenc serve: stopped ({} completions, {} prompt + {} generated tokens)\n",
             st.requests_completed, st.prompt_tokens, st.generation_tokens);
}

}  // namespace

void add_serve_command(CLI::App& app) {
  auto args = std::make_shared<ServeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "serve",
      "Serve the model over an OpenAI-compatible HTTP API (/v1/completions, /v1/models, /tokenize, /detokenize, "
      "/health, /version, /metrics) with continuous batching; prints 'posenc serve: listening on "
      "http://HOST:PORT/v1 ...' on stderr once bound; SIGTERM drains and exits 0");
  args->model.add_to(*cmd);
  args->model.add_kv_dtype_to(*cmd);
  auto& c = args->config;
  cmd->add_option("--host", c.host, "address to bind (loopback by default)")->capture_default_str()->check(non_empty());
  cmd->add_option("--port", c.port, "TCP port; 0 = any free port (the listening line gives it)")
      ->check(int_in(0, 65535))
      ->capture_default_str();
  cmd->add_option("--served-model-name", c.served_model_name,
                  "the model's name in the API (default: the --model path's file or directory name)")
      ->check(non_empty());
  cmd->add_option("--max-model-len", c.max_model_len,
                  "allowed context, prompt + generated tokens (default: the model's trained context)")
      ->transform(length_in(2, int64_t{1} << 32));
  cmd->add_option("--max-batch", c.max_batch, "sequences per batched forward step")
      ->check(int_in(1, 4096))
      ->capture_default_str();
  cmd->add_option("--max-queue", c.max_queue, "requests waiting for a batch slot; one more is answered 503 + Retry-After")
      ->check(int_in(0, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--max-step-tokens", c.max_step_tokens, "tokens per forward step (prefill chunks share it)")
      ->transform(length_in(1, 1 << 24))
      ->capture_default_str();
  cmd->add_option("--kv-cache-tokens", c.kv_cache_tokens,
                  "KV cache budget in tokens (default: (max-batch + 4) x max-model-len)")
      ->transform(length_in(1, int64_t{1} << 40));
  cmd->add_option("--prefix-cache", c.prefix_cache_entries, "finished sequences kept for prefix reuse (0 = none)")
      ->check(int_in(0, 1 << 16))
      ->capture_default_str();
  cmd->add_option("--max-request-bytes", c.max_request_bytes, "largest request body accepted in bytes (a longer one is a 413)")
      ->check(int_in(1024, int64_t{1} << 32))
      ->capture_default_str();
  // Default 1, as `posenc train`'s: with OpenMP's default spin-waiting, 2 threads on this 2-core machine made every
  // request of stories260K take ~190 ms instead of 3-12 ms whenever another process used the cores (measured with
  // 128- and 512-token echo requests; OMP_WAIT_POLICY=passive or 1 thread: 3-12 ms).
  c.threads = 1;
  cmd->add_option("--threads", c.threads,
                  "OpenMP threads of the forward steps; more pay off for larger models, with OMP_WAIT_POLICY=passive "
                  "when other processes share the cores (spin-waiting threads then stall every step); at most 64 x the "
                  "hardware threads")
      ->check(int_in(1, max_threads()))
      ->capture_default_str();
  cmd->add_option("--http-threads", c.http_threads,
                  "most HTTP connection threads, started on demand (default: max(1024, max-batch + max-queue + 8); "
                  "each open connection holds one)")
      ->check(int_in(1, 1 << 16));
  cmd->add_option("--read-timeout", args->read_timeout_s,
                  "seconds a request read (head or body) may wait for the next bytes; a half-sent body is a 408, "
                  "a POST without Content-Length a 411")
      ->check(finite_in(0.01, 3600))
      ->capture_default_str();
  args->rope_scaling_option =
      cmd->add_option("--rope-scaling", args->rope_scaling,
                      "RoPE scaling (rope_type) applied as ppl applies it to a window of --max-model-len tokens, the "
                      "same for every request: native (the model's own parameters, or --config's), default, linear, "
                      "ntk, dynamic, yarn, llama3, longrope, ...")
          ->capture_default_str();
  cmd->add_option("--rope-factor", args->rope_factor,
                  "scaling factor s of --rope-scaling (default: max(1, max-model-len / trained context))")
      ->check(finite_in(kMinRopeFactorFlag, kMaxRopeFactorFlag));
  cmd->add_flag("--quiet", args->quiet, "do not print the model's provenance to stderr");
  cmd->callback([args] { run_serve(*args); });
}

}  // namespace posenc::cli
