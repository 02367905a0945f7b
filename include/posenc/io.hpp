// posenc — file helpers: read-only memory maps, whole-file reads and atomic writes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace posenc {

/// A read-only memory map of a whole file. Move-only.
/// Throws IoError if the file cannot be opened or mapped. An empty file maps
/// to an empty span (no mapping is created). A file of 2 MiB or more is
/// advised to be mapped in 2 MiB pages (madvise MADV_HUGEPAGE, a hint the
/// kernel may ignore; it takes effect for the parts not yet in the page cache).
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

/// Default cap of read_file: 4 GiB. Inputs read whole (text, config.json,
/// tokenizer.json, run files) are far smaller; weights are memory-mapped.
inline constexpr std::uint64_t kMaxReadBytes = std::uint64_t{4} << 30;

/// Reads a whole regular file into a string, at most `max_bytes` bytes.
/// The file is opened non-blocking and checked with fstat before anything is
/// read: a FIFO, socket or device (`/dev/zero`, `/dev/stdin` on a pipe) is
/// refused instead of hanging the open or growing memory without bound, and a
/// file larger than `max_bytes` is refused before allocation.
/// Every input posenc reads whole goes through this function (MappedFile uses
/// the same opening rule).
/// Throws IoError naming the path: "cannot open (<errno text>)",
/// "is a directory, expected a file", "not a regular file (a FIFO)",
/// "<size> bytes, more than the limit of <max_bytes>", "read error".
std::string read_file(const std::filesystem::path& path, std::uint64_t max_bytes = kMaxReadBytes);

/// The byte offset of the first sequence in `text` that is not well-formed
/// UTF-8 (Unicode Table 3-7: no overlong forms, no surrogates, nothing past
/// U+10FFFF, no truncated sequence), or nullopt when all of it is.
std::optional<std::size_t> first_invalid_utf8(std::string_view text);

/// Throws InvalidArgument when `text` is not well-formed UTF-8: "<what>: not
/// valid UTF-8: the first invalid sequence is at byte offset N (line L;
/// bytes from there: 0x.. ..) ...". `what` names the input (a flag and its file). The
/// tokenizers themselves take any bytes, each as its reference does (run.c's
/// byte fallback, llama.cpp's lead-byte lengths, U+FFFD for tokenizer.json),
/// so text inputs documented as UTF-8 are checked by the caller with this.
void require_utf8(std::string_view text, std::string_view what);

/// The first `n` bytes of a regular file (fewer if the file is shorter), with
/// read_file's opening rule. Used to sniff formats (magic numbers).
/// Throws IoError as read_file does.
std::string read_file_prefix(const std::filesystem::path& path, std::size_t n);

/// Writes `contents` to `path` atomically: a temporary file in the same
/// directory is written, flushed (fsync) and renamed over `path`, so a reader
/// sees either the old file or the whole new one, never a partial write.
/// Creates missing parent directories. A symbolic link is written through
/// (the link stays; the file it names is replaced). Throws IoError, before
/// writing anything, when `path` exists and is not a regular file (a device
/// such as /dev/null, a FIFO, a socket, a directory: renaming over it would
/// replace the node), and on any failure (the temporary file is removed).
void write_file_atomic(const std::filesystem::path& path, std::string_view contents);

/// An advisory lock on a directory posenc writes a run into (a study, an eval
/// run): flock(LOCK_NB) on the lock file `<dir>/<name>` (created, and `dir`
/// with it, if missing; the file is left in place). Held until destruction;
/// the kernel releases it when the process dies, so a SIGKILL leaves no stale
/// lock. Exclusive by default: a second process taking the same lock fails at
/// once instead of duplicating the work. `shared`: any number of shared
/// holders, but none while an exclusive holder exists (and the reverse).
/// Advisory only: it binds processes that take it, and flock does not work
/// across every network file system. Move-only.
/// An exclusive holder writes its pid into the lock file, for the message.
/// Throws IoError naming the directory: "<dir>: is in use by another posenc
/// process (pid N; lock <file> is held)" when taken, or the open/flock failure.
class DirectoryLock {
 public:
  explicit DirectoryLock(const std::filesystem::path& dir, std::string_view name = ".posenc.lock", bool shared = false);
  ~DirectoryLock();
  DirectoryLock(DirectoryLock&& other) noexcept;
  DirectoryLock& operator=(DirectoryLock&& other) noexcept;
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  int fd_ = -1;
  std::filesystem::path path_;
};

/// Whether `name` is a temporary file of write_file_atomic
/// ("<file>.tmp.<pid>.<n>"); sets `pid`.
bool is_atomic_write_temporary(std::string_view name, long& pid);

/// Removes the temporaries write_file_atomic leaves when killed inside it, in
/// `dir` (not recursively). `all`: every one (the caller holds the directory
/// exclusively); otherwise only those of processes that no longer exist, or
/// of this process's pid (a reused pid: this process has written nothing yet).
/// Returns the paths removed. Errors are ignored (a file that cannot be
/// removed stays; nothing reads temporaries).
std::vector<std::filesystem::path> remove_stale_temporaries(const std::filesystem::path& dir, bool all);

}  // namespace posenc
