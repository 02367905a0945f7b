// llama_cpp_dump — every intermediate tensor of one llama.cpp prefill, for finding where an
// implementation first departs from llama.cpp (tests/model/data/llama_cpp/README.md).
//
//   llama_cpp_dump MODEL.gguf IDS OUT_DIR        IDS: comma-separated token ids, e.g. 1,403,407
//
// Runs the window as one llama_decode (n_ctx 768, n_batch = n_ubatch = 512, F32 KV cache, flash
// attention off, 1 thread, every position's logits) with an eval callback that writes each
// contiguous F32 graph node to OUT_DIR/NNN_OP_NAME_ne0xne1xne2xne3.f32 (raw little-endian float32,
// ggml order: ne0 fastest). With a callback the scheduler runs the graph node by node (no fusion);
// the final logits were checked identical to the normal run.
//
// Built against node-llama-cpp's prebuilt libraries (the binaries the reference data came from),
// headers from the same llama.cpp source (LLAMA_CPP_SRC):
//   P=tools/refs/node_modules/@node-llama-cpp/linux-x64/bins/linux-x64; S=/work/refs/llama.cpp-src
//   mkdir -p /tmp/lnk; ln -sf $PWD/$P/libllama.v0.5.0.so /tmp/lnk/libllama.so
//   ln -sf $PWD/$P/libggml.v0.5.0.so /tmp/lnk/libggml.so; ln -sf $PWD/$P/libggml-base.so /tmp/lnk/libggml-base.so
//   g++ -std=c++17 -O1 -I$S/include -I$S/ggml/include tools/refs/llama_cpp_dump.cpp -L/tmp/lnk
//       -lllama -lggml -lggml-base -Wl,-rpath,$PWD/$P -o /tmp/llama_cpp_dump
//   GGML_BACKEND_PATH=$PWD/$P/libggml-cpu-sapphirerapids.so /tmp/llama_cpp_dump MODEL IDS OUT_DIR
// (GGML_BACKEND_PATH: the CPU variant node-llama-cpp loads on this machine; see summary.json
// settings.ggml_cpu_variant.)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"

namespace {

std::string g_out;
int g_count = 0;

bool dump_node(struct ggml_tensor* t, bool ask, void*) {
  if (ask) return true;  // yes, show us every node
  if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t)) return true;
  std::vector<float> buf(ggml_nelements(t));
  ggml_backend_tensor_get(t, buf.data(), 0, ggml_nbytes(t));
  std::string name = std::string(ggml_op_desc(t)) + "_" + t->name;
  for (char& c : name) {
    if (c == ' ' || c == '(' || c == ')' || c == '/') c = '_';
  }
  char path[1024];
  std::snprintf(path, sizeof path, "%s/%03d_%s_%lldx%lldx%lldx%lld.f32", g_out.c_str(), g_count++, name.c_str(),
                static_cast<long long>(t->ne[0]), static_cast<long long>(t->ne[1]), static_cast<long long>(t->ne[2]),
                static_cast<long long>(t->ne[3]));
  std::FILE* f = std::fopen(path, "wb");
  if (!f || std::fwrite(buf.data(), sizeof(float), buf.size(), f) != buf.size() || std::fclose(f) != 0) {
    std::fprintf(stderr, "llama_cpp_dump: cannot write %s\n", path);
    std::exit(1);
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: llama_cpp_dump MODEL.gguf ID,ID,... OUT_DIR\n");
    return 2;
  }
  g_out = argv[3];
  std::vector<llama_token> ids;
  for (char* s = std::strtok(argv[2], ","); s; s = std::strtok(nullptr, ",")) ids.push_back(std::atoi(s));
  if (ids.empty() || ids.size() > 512) {
    std::fprintf(stderr, "llama_cpp_dump: need 1..512 ids, got %zu\n", ids.size());
    return 2;
  }
  ggml_backend_load_all();
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (!model) return 1;
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = 768;
  cp.n_batch = 512;
  cp.n_ubatch = 512;
  cp.n_threads = 1;
  cp.n_threads_batch = 1;
  cp.type_k = GGML_TYPE_F32;
  cp.type_v = GGML_TYPE_F32;
  cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
  cp.cb_eval = dump_node;
  cp.cb_eval_user_data = nullptr;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) return 1;
  llama_batch batch = llama_batch_init(static_cast<int32_t>(ids.size()), 0, 1);
  for (size_t i = 0; i < ids.size(); ++i) {
    batch.token[i] = ids[i];
    batch.pos[i] = static_cast<llama_pos>(i);
    batch.n_seq_id[i] = 1;
    batch.seq_id[i][0] = 0;
    batch.logits[i] = 1;
  }
  batch.n_tokens = static_cast<int32_t>(ids.size());
  if (llama_decode(ctx, batch) != 0) {
    std::fprintf(stderr, "llama_cpp_dump: llama_decode failed\n");
    return 1;
  }
  std::fprintf(stderr, "llama_cpp_dump: %d tensors in %s\n", g_count, g_out.c_str());
  llama_batch_free(batch);
  llama_free(ctx);
  llama_model_free(model);
  return 0;
}
