// posenc — file helpers: read-only memory maps, whole-file reads and atomic writes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>

namespace posenc {

/// A read-only memory map of a whole file. Move-only.
/// Throws IoError if the file cannot be opened or mapped. An empty file maps
/// to an empty span (no mapping is created).
class MappedFile {
 public:
  MappedFile() = default;
  explicit MappedFile(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::span<const std::byte> bytes() const { return {data_, size_}; }
  std::size_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  void reset() noexcept;
  const std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  std::filesystem::path path_;
};

/// Reads a whole file into a string. Throws IoError naming the path on failure.
std::string read_file(const std::filesystem::path& path);

/// Writes `contents` to `path` atomically: a temporary file in the same
/// directory is written, flushed (fsync) and renamed over `path`, so a reader
/// sees either the old file or the whole new one, never a partial write.
/// Creates missing parent directories. Throws IoError on failure (the
/// temporary file is removed).
void write_file_atomic(const std::filesystem::path& path, std::string_view contents);

}  // namespace posenc
