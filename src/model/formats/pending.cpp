#include "model/raw_model.hpp"
#include "posenc/error.hpp"
namespace posenc::detail {
RawModel read_hf_directory(const std::filesystem::path&) { throw CheckpointError("pending"); }
RawModel read_gguf_model(const std::filesystem::path&) { throw CheckpointError("pending"); }
}
