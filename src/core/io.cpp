#include "posenc/io.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "posenc/error.hpp"

namespace posenc {

namespace {
std::string errno_text() { return std::strerror(errno); }
}  // namespace

MappedFile::MappedFile(const std::filesystem::path& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError(fmt::format("{}: cannot open ({})", path.string(), errno_text()));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    std::string e = errno_text();
    ::close(fd);
    throw IoError(fmt::format("{}: cannot stat ({})", path.string(), e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw IoError(fmt::format("{}: not a regular file", path.string()));
  }
  size_ = static_cast<std::size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      std::string e = errno_text();
      ::close(fd);
      throw IoError(fmt::format("{}: cannot mmap ({})", path.string(), e));
    }
    data_ = static_cast<const std::byte*>(p);
  }
  ::close(fd);
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

std::string read_file(const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw IoError(fmt::format("{}: is a directory, expected a file", path.string()));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(fmt::format("{}: cannot open ({})", path.string(), errno_text()));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw IoError(fmt::format("{}: read error", path.string()));
  return std::move(ss).str();
}

void write_file_atomic(const std::filesystem::path& path, std::string_view contents) {
  namespace fs = std::filesystem;
  fs::path dir = path.parent_path();
  std::error_code ec;
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

}  // namespace posenc
