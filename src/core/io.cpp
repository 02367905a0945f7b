#include "posenc/io.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <csignal>
#include <cerrno>
#include <cstring>
#include <algorithm>
#include <limits>

#include <fmt/format.h>

#include "posenc/error.hpp"

namespace posenc {

namespace {
std::string errno_text() { return std::strerror(errno); }

const char* file_kind(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  return "not a regular file";
}

/// An fd owned for the scope.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

/// The one opening rule for inputs: O_NONBLOCK (opening a FIFO with no writer
/// would block forever), then fstat: only regular files are read. Returns the
/// size. The non-blocking flag is cleared again for the reads (regular files
/// ignore it anyway).
std::uint64_t open_regular(const std::filesystem::path& path, Fd& f) {
  f.fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (f.fd < 0) {
    if (errno == EISDIR) throw IoError(fmt::format("{}: is a directory, expected a file", path.string()));
    throw IoError(fmt::format("{}: cannot open ({})", path.string(), errno_text()));
  }
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) throw IoError(fmt::format("{}: cannot stat ({})", path.string(), errno_text()));
  if (S_ISDIR(st.st_mode)) throw IoError(fmt::format("{}: is a directory, expected a file", path.string()));
  if (!S_ISREG(st.st_mode))
    throw IoError(fmt::format("{}: not a regular file ({}); posenc reads inputs from regular files only",
                              path.string(), file_kind(st.st_mode)));
  const int flags = ::fcntl(f.fd, F_GETFL);
  if (flags >= 0) ::fcntl(f.fd, F_SETFL, flags & ~O_NONBLOCK);
  return static_cast<std::uint64_t>(st.st_size);
}

/// Reads up to `n` bytes from the start of f (stops early at end of file).
std::string read_up_to(const std::filesystem::path& path, const Fd& f, std::size_t n) {
  std::string out(n, '\0');
  std::size_t got = 0;
  while (got < n) {
    const ssize_t r = ::read(f.fd, out.data() + got, n - got);
    if (r < 0) {
      if (errno == EINTR) continue;
      throw IoError(fmt::format("{}: read error ({})", path.string(), errno_text()));
    }
    if (r == 0) break;
    got += static_cast<std::size_t>(r);
  }
  out.resize(got);
  return out;
}
}  // namespace

MappedFile::MappedFile(const std::filesystem::path& path) : path_(path) {
  Fd f;
  const std::uint64_t size = open_regular(path, f);
  if (size > std::numeric_limits<std::size_t>::max())
    throw IoError(fmt::format("{}: {} bytes cannot be mapped", path.string(), size));
  size_ = static_cast<std::size_t>(size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, f.fd, 0);
    if (p == MAP_FAILED) {
      size_ = 0;
      throw IoError(fmt::format("{}: cannot mmap ({})", path.string(), errno_text()));
    }
    data_ = static_cast<const std::byte*>(p);
    // Ask for 2 MiB pages. Where the file is not yet in the page cache, the kernel then reads it into 2 MiB folios
    // mapped by one page-table entry each (where it is, the folios it has stay as they are). Decode reads every
    // weight once per token: with 4 KiB pages each 4 KiB of a stream costs a TLB walk, and the software prefetches
    // that run ahead of a stream walk too. Measured on the 487M F16 model at one thread (Zen 5): 36.6-37.6 GB/s
    // mapped in 4 KiB pages, 38.8-39.5 in 2 MiB pages. A hint only: a kernel without transparent huge pages for
    // files ignores it or refuses it (EINVAL), and nothing changes.
    if (size_ >= (std::size_t{2} << 20)) (void)::madvise(p, size_, MADV_HUGEPAGE);
  }
}

MappedFile::~MappedFile() { reset(); }

void MappedFile::reset() noexcept {
  if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : data_(other.data_), size_(other.size_), path_(std::move(other.path_)) {
  other.data_ = nullptr;
  other.size_ = 0;
}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    reset();
    data_ = other.data_;
    size_ = other.size_;
    path_ = std::move(other.path_);
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

std::string read_file(const std::filesystem::path& path, std::uint64_t max_bytes) {
  Fd f;
  const std::uint64_t size = open_regular(path, f);
  if (size > max_bytes)
    throw IoError(fmt::format("{}: {} bytes, more than the limit of {} bytes for this input", path.string(), size,
                              max_bytes));
  if (size == 0) {
    // procfs and sysfs files (/proc/self/cmdline) are regular files that
    // report size 0: read them to their end, still within the limit.
    std::string out;
    for (;;) {
      const std::string chunk = read_up_to(path, f, 65536);
      out += chunk;
      if (out.size() > max_bytes)
        throw IoError(fmt::format("{}: more than the limit of {} bytes for this input", path.string(), max_bytes));
      if (chunk.size() < 65536) return out;
    }
  }
  // A file that grows while it is read is read up to its size at open (plus
  // nothing): the limit holds.
  return read_up_to(path, f, static_cast<std::size_t>(size));
}

std::optional<std::size_t> first_invalid_utf8(std::string_view text) {
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(text[i]); };
  for (std::size_t i = 0; i < text.size();) {
    const unsigned char c = byte(i);
    if (c < 0x80) {
      ++i;
      continue;
    }
    // Unicode Table 3-7: the lead byte fixes the length and the range of the second byte.
    std::size_t n = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) n = 2;
    else if (c == 0xE0) n = 3, lo = 0xA0;
    else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) n = 3;
    else if (c == 0xED) n = 3, hi = 0x9F;  // no surrogates
    else if (c == 0xF0) n = 4, lo = 0x90;
    else if (c >= 0xF1 && c <= 0xF3) n = 4;
    else if (c == 0xF4) n = 4, hi = 0x8F;  // nothing past U+10FFFF
    if (n == 0 || i + n > text.size()) return i;
    if (byte(i + 1) < lo || byte(i + 1) > hi) return i;
    for (std::size_t k = 2; k < n; ++k)
      if ((byte(i + k) & 0xC0) != 0x80) return i;
    i += n;
  }
  return std::nullopt;
}

void require_utf8(std::string_view text, std::string_view what) {
  const auto at = first_invalid_utf8(text);
  if (!at) return;
  const std::size_t line = 1 + static_cast<std::size_t>(std::count(text.begin(), text.begin() + *at, '\n'));
  std::string bytes;
  for (std::size_t k = *at; k < text.size() && k < *at + 4; ++k)
    bytes += fmt::format("{}0x{:02x}", bytes.empty() ? "" : " ", static_cast<unsigned char>(text[k]));
  throw InvalidArgument(fmt::format("{}: not valid UTF-8: the first invalid sequence is at byte offset {} (line {}; "
                                    "bytes from there: {}{}); text inputs are read as UTF-8 (convert it, e.g. iconv "
                                    "-f latin1 -t utf-8)",
                                    what, *at, line, bytes, text.size() > *at + 4 ? " ..." : ""));
}

std::string read_file_prefix(const std::filesystem::path& path, std::size_t n) {
  Fd f;
  const std::uint64_t size = open_regular(path, f);
  // No readahead: the format sniffs read a few bytes of a model file before it is mapped, and readahead left a mark
  // in the page cache that the mapping's first faults followed, reading on in small folios which stay so when
  // MappedFile's mapping asks for 2 MiB pages. Measured, cold files through the CLI: a 500 MB Q8_0 GGUF 93% in
  // 2 MiB pages with readahead, 99% without; an 82 MB F16 one 58% and 93%.
  (void)::posix_fadvise(f.fd, 0, 0, POSIX_FADV_RANDOM);
  return read_up_to(path, f, static_cast<std::size_t>(std::min<std::uint64_t>(size, n)));
}

void write_file_atomic(const std::filesystem::path& requested, std::string_view contents) {
  namespace fs = std::filesystem;
  std::error_code ec;
  // A symbolic link is written through (the link stays, the file it names is
  // replaced); anything that exists and is not a regular file - a device such
  // as /dev/null, a FIFO, a socket, a directory - is refused: renaming over it
  // would replace the node itself (as root, /dev/null would become a file).
  fs::path path = requested;
  for (int hops = 0; fs::is_symlink(fs::symlink_status(path, ec)); ++hops) {
    if (hops == 40) throw IoError(fmt::format("{}: too many levels of symbolic links", requested.string()));
    const fs::path link = fs::read_symlink(path, ec);
    if (ec) throw IoError(fmt::format("{}: cannot read the symbolic link ({})", path.string(), ec.message()));
    path = link.is_absolute() ? link : path.parent_path() / link;
  }
  if (const fs::file_status st = fs::status(path, ec); fs::exists(st) && !fs::is_regular_file(st)) {
    const char* kind = fs::is_directory(st)       ? "a directory"
                       : fs::is_character_file(st) ? "a character device"
                       : fs::is_block_file(st)     ? "a block device"
                       : fs::is_fifo(st)           ? "a FIFO"
                       : fs::is_socket(st)         ? "a socket"
                                                   : "not a regular file";
    throw IoError(fmt::format("{}: exists and is {}; refusing to replace it (give the path of a regular file)",
                              requested.string(), kind));
  }
  fs::path dir = path.parent_path();
  if (!dir.empty()) {
    fs::create_directories(dir, ec);
    if (ec) throw IoError(fmt::format("{}: cannot create directory ({})", dir.string(), ec.message()));
  }
  static std::atomic<unsigned> counter{0};
  fs::path tmp = path;
  tmp += fmt::format(".tmp.{}.{}", ::getpid(), counter++);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw IoError(fmt::format("{}: cannot create ({})", tmp.string(), errno_text()));
  const char* p = contents.data();
  std::size_t left = contents.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      std::string e = errno_text();
      ::close(fd);
      ::unlink(tmp.c_str());
      throw IoError(fmt::format("{}: write failed ({})", tmp.string(), e));
    }
    p += n;
    left -= static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    std::string e = errno_text();
    ::unlink(tmp.c_str());
    throw IoError(fmt::format("{}: flush failed ({})", tmp.string(), e));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string e = errno_text();
    ::unlink(tmp.c_str());
    throw IoError(fmt::format("{}: cannot rename into place ({})", path.string(), e));
  }
}

DirectoryLock::DirectoryLock(const std::filesystem::path& dir, std::string_view name, bool shared) : path_(dir / name) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw IoError(fmt::format("{}: cannot create directory ({})", dir.string(), ec.message()));
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd_ < 0) throw IoError(fmt::format("{}: cannot open lock file ({})", path_.string(), errno_text()));
  int rc;
  do rc = ::flock(fd_, (shared ? LOCK_SH : LOCK_EX) | LOCK_NB);
  while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int err = errno;
    char buf[24] = {};
    const ssize_t got = ::pread(fd_, buf, sizeof buf - 1, 0);
    std::string pid(buf, got > 0 ? static_cast<std::size_t>(got) : 0);
    while (!pid.empty() && !std::isdigit(static_cast<unsigned char>(pid.back()))) pid.pop_back();
    const bool numeric = !pid.empty() && std::all_of(pid.begin(), pid.end(), [](char c) { return c >= '0' && c <= '9'; });
    ::close(fd_);
    fd_ = -1;
    if (err == EWOULDBLOCK)
      throw IoError(fmt::format("{}: is in use by another posenc process ({}lock {} is held); wait for it to finish "
                                "or use another directory",
                                dir.string(), numeric ? fmt::format("pid {}; ", pid) : std::string(), path_.string()));
    throw IoError(fmt::format("{}: cannot lock ({})", path_.string(), std::strerror(err)));
  }
  if (!shared) {  // the holder's pid, for the message of the next one (shared holders would overwrite each other)
    const std::string me = fmt::format("{}\n", ::getpid());
    if (::ftruncate(fd_, 0) == 0) (void)!::pwrite(fd_, me.data(), me.size(), 0);
  }
}

DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

DirectoryLock::DirectoryLock(DirectoryLock&& other) noexcept : fd_(other.fd_), path_(std::move(other.path_)) {
  other.fd_ = -1;
}

DirectoryLock& DirectoryLock::operator=(DirectoryLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    path_ = std::move(other.path_);
    other.fd_ = -1;
  }
  return *this;
}

bool is_atomic_write_temporary(std::string_view name, long& pid) {
  // <file>.tmp.<pid>.<n>, as write_file_atomic names it
  const std::size_t at = name.rfind(".tmp.");
  if (at == std::string_view::npos || at == 0) return false;
  const std::string_view rest = name.substr(at + 5);
  const std::size_t dot = rest.find('.');
  if (dot == std::string_view::npos || dot == 0 || dot + 1 == rest.size() || dot > 18) return false;
  auto digits = [](std::string_view x) { return std::all_of(x.begin(), x.end(), [](char c) { return c >= '0' && c <= '9'; }); };
  if (!digits(rest.substr(0, dot)) || !digits(rest.substr(dot + 1))) return false;
  pid = std::stol(std::string(rest.substr(0, dot)));
  return true;
}

std::vector<std::filesystem::path> remove_stale_temporaries(const std::filesystem::path& dir, bool all) {
  namespace fs = std::filesystem;
  std::vector<fs::path> removed;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return removed;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    long pid = 0;
    if (!entry.is_regular_file(ec) || !is_atomic_write_temporary(entry.path().filename().string(), pid)) continue;
    const bool dead = pid <= 0 || (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH);
    if (!all && !dead && pid != static_cast<long>(::getpid())) continue;
    if (fs::remove(entry.path(), ec)) removed.push_back(entry.path());
  }
  return removed;
}

}  // namespace posenc
