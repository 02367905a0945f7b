// Input opening rules (read_file, MappedFile) and the checked JSON reader.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <future>
#include <map>
#include <sstream>
#include <vector>

#include <gtest/gtest.h>

#include "posenc/error.hpp"
#include "posenc/io.hpp"
#include "posenc/json_file.hpp"
#include "test_support.hpp"

namespace POSENC_UNITY_ID {  // this file's own namespace in the tests' unity build (CMakeLists.txt)

namespace fs = std::filesystem;
using namespace posenc;

namespace {

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

struct Tmp {
  fs::path dir = fs::temp_directory_path() / ("posenc_io_test_" + std::to_string(::getpid()));
  Tmp() { fs::create_directories(dir); }
  ~Tmp() { fs::remove_all(dir); }
};

// A FIFO with no writer blocked open(2) forever; opened non-blocking it is
// refused at once, by name, for read_file, read_file_prefix and MappedFile.
TEST(Io, FifoIsRefusedWithoutHanging) {
  Tmp t;
  const fs::path fifo = t.dir / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto fut = std::async(std::launch::async, [&] {
    return std::array<std::string, 3>{error_of([&] { read_file(fifo); }), error_of([&] { read_file_prefix(fifo, 4); }),
                                      error_of([&] { MappedFile m(fifo); })};
  });
  ASSERT_EQ(fut.wait_for(std::chrono::seconds(10)), std::future_status::ready) << "open of a FIFO blocked";
  for (const auto& e : fut.get()) {
    EXPECT_NE(e.find("fifo: not a regular file (a FIFO)"), std::string::npos) << e;
  }
}

// write_file_atomic renamed its temporary over whatever the path named: as root,
// `--json /dev/null` replaced the device with a regular file, and a FIFO or a
// device node became a file too; a symbolic link was replaced by a file instead
// of written through. Now anything that is not a regular file is refused before
// anything is written, and links are followed.
TEST(Io, AtomicWriteRefusesNodesThatAreNotRegularFilesAndFollowsLinks) {
  Tmp t;
  const fs::path fifo = t.dir / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_NE(error_of([&] { write_file_atomic(fifo, "x"); }).find("fifo: exists and is a FIFO; refusing to replace it"),
            std::string::npos);
  EXPECT_TRUE(fs::is_fifo(fifo));
  const fs::path dev = t.dir / "null";
  if (::mknod(dev.c_str(), S_IFCHR | 0666, makedev(1, 3)) == 0) {  // root only: a /dev/null node of our own
    EXPECT_NE(error_of([&] { write_file_atomic(dev, "x"); }).find("exists and is a character device"),
              std::string::npos);
    EXPECT_TRUE(fs::is_character_file(dev));
  }
  fs::create_directory(t.dir / "sub");
  EXPECT_NE(error_of([&] { write_file_atomic(t.dir / "sub", "x"); }).find("exists and is a directory"),
            std::string::npos);
  // Through a relative link (and a link to the link): the links stay, the file they name gets the contents.
  const fs::path real = t.dir / "real.json";
  write_file_atomic(real, "old");
  fs::create_symlink("real.json", t.dir / "link.json");
  fs::create_symlink(t.dir / "link.json", t.dir / "link2.json");
  write_file_atomic(t.dir / "link2.json", "new");
  EXPECT_TRUE(fs::is_symlink(t.dir / "link.json"));
  EXPECT_TRUE(fs::is_symlink(t.dir / "link2.json"));
  EXPECT_EQ(read_file(real), "new");
  // A link to a FIFO is refused like the FIFO; a dangling link creates the file it names.
  fs::create_symlink(fifo, t.dir / "to_fifo");
  EXPECT_NE(error_of([&] { write_file_atomic(t.dir / "to_fifo", "x"); }).find("exists and is a FIFO"), std::string::npos);
  fs::create_symlink("made.json", t.dir / "dangling");
  write_file_atomic(t.dir / "dangling", "made");
  EXPECT_EQ(read_file(t.dir / "made.json"), "made");
  EXPECT_TRUE(fs::is_symlink(t.dir / "dangling"));
  // A loop is an error, not a hang.
  fs::create_symlink("loop_b", t.dir / "loop_a");
  fs::create_symlink("loop_a", t.dir / "loop_b");
  EXPECT_NE(error_of([&] { write_file_atomic(t.dir / "loop_a", "x"); }).find("too many levels of symbolic links"),
            std::string::npos);
}

// /dev/zero read to its end grew memory to several GB.
TEST(Io, DevicesAreRefused) {
  EXPECT_NE(error_of([] { read_file("/dev/zero"); }).find("/dev/zero: not a regular file (a character device)"),
            std::string::npos);
  EXPECT_NE(error_of([] { read_file("/dev/urandom"); }).find("not a regular file"), std::string::npos);
  EXPECT_NE(error_of([] { read_file("/"); }).find("is a directory"), std::string::npos);
  EXPECT_NE(error_of([] { read_file("/nonexistent/x"); }).find("/nonexistent/x: cannot open (No such file"),
            std::string::npos);
}

TEST(Io, SizeLimitIsCheckedBeforeReading) {
  Tmp t;
  write_file_atomic(t.dir / "f", std::string(1000, 'x'));
  EXPECT_EQ(read_file(t.dir / "f", 1000).size(), 1000u);
  EXPECT_NE(error_of([&] { read_file(t.dir / "f", 999); }).find("1000 bytes, more than the limit of 999 bytes"),
            std::string::npos);
  EXPECT_EQ(read_file_prefix(t.dir / "f", 4), "xxxx");
  EXPECT_EQ(read_file_prefix(t.dir / "f", 5000).size(), 1000u);
  // The real fixture reads back whole and equal to a mapping of it.
  const fs::path text = fs::path(POSENC_SHARED_DIR) / "data/tinystories_val.txt";
  const std::string s = read_file(text);
  const MappedFile m(text);
  ASSERT_EQ(s.size(), m.size());
  EXPECT_EQ(0, std::memcmp(s.data(), m.bytes().data(), s.size()));
}

/// The "Key: value" lines /proc/self/smaps gives for this process's mapping that starts at p (empty if none).
std::map<std::string, std::string> smaps_of(const void* p) {
  std::istringstream smaps(read_file("/proc/self/smaps"));
  std::map<std::string, std::string> out;
  bool in = false;
  for (std::string line; std::getline(smaps, line);) {
    const auto colon = line.find(':'), dash = line.find('-');
    if (colon > dash && dash < line.find(' '))  // "start-end perms offset dev inode path": a mapping begins
      in = std::stoull(line.substr(0, dash), nullptr, 16) == reinterpret_cast<uintptr_t>(p);
    else if (in && colon != std::string::npos)
      out[line.substr(0, colon)] = line.substr(colon + 1);
  }
  return out;
}

/// The VmFlags of the mapping that starts at p, with a space before and after each ("" if none).
std::string vm_flags_of(const void* p) {
  const auto m = smaps_of(p);
  const auto it = m.find("VmFlags");
  return it == m.end() ? "" : it->second + " ";
}

// Decode streams every weight once per token; MappedFile asks for 2 MiB pages for files of 2 MiB or more (fewer
// TLB walks; a hint, see io.hpp). The advice shows as "hg" in the mapping's VmFlags; a smaller file is not advised.
TEST(Io, LargeMappingsAreAdvisedToUseHugePages) {
  const std::string thp = read_file_prefix("/sys/kernel/mm/transparent_hugepage/enabled", 256);
  if (thp.empty() || thp.find("[never]") != std::string::npos)
    GTEST_SKIP() << "this kernel has no transparent huge pages (the advice is refused and ignored)";
  Tmp t;
  std::string big(std::size_t{4} << 20, '\0');
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 7 + (i >> 12));
  write_file_atomic(t.dir / "big", big);
  write_file_atomic(t.dir / "small", big.substr(0, (std::size_t{2} << 20) - 1));
  const MappedFile m(t.dir / "big"), s(t.dir / "small");
  ASSERT_EQ(m.size(), big.size());
  EXPECT_EQ(0, std::memcmp(m.bytes().data(), big.data(), big.size()));
  EXPECT_NE(vm_flags_of(m.bytes().data()).find(" hg "), std::string::npos) << vm_flags_of(m.bytes().data());
  const std::string small_flags = vm_flags_of(s.bytes().data());
  ASSERT_FALSE(small_flags.empty());
  EXPECT_EQ(small_flags.find(" hg "), std::string::npos) << small_flags;
}

/// The file, evicted from the page cache (fsync, then POSIX_FADV_DONTNEED: it is clean, so it goes).
void evict(const fs::path& f) {
  const int fd = ::open(f.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fsync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

/// The share of `m`'s resident bytes mapped by 2 MiB page-table entries (FilePmdMapped over Rss in /proc/self/smaps)
/// after every page of it has been read.
double huge_share_after_reading(const MappedFile& m) {
  volatile unsigned char sink = 0;
  for (std::size_t i = 0; i < m.size(); i += 4096) sink = sink + static_cast<unsigned char>(m.bytes()[i]);
  auto fields = smaps_of(m.bytes().data());
  const double rss = fields.count("Rss") ? std::stod(fields["Rss"]) : 0.0;
  return rss > 0 && fields.count("FilePmdMapped") ? std::stod(fields["FilePmdMapped"]) / rss : 0.0;
}

// The format sniffs read a few bytes of a model file before MappedFile maps it. With readahead, that read left a
// readahead mark in the page cache which the mapping's first faults then followed, in small folios that stay so when
// the mapping asks for 2 MiB pages (a cold 82 MB GGUF through the CLI: 58% of it in 2 MiB pages, a 500 MB one 93%;
// without readahead 93% and 99%; the 32 MiB file here 0% and 87.5%). read_file_prefix reads without readahead.
// The control, the same file mapped cold without a prefix read, says whether this kernel and file system give a
// file 2 MiB pages at all.
TEST(Io, PrefixReadsLeaveAColdFileTo2MiBPages) {
  Tmp t;
  const fs::path f = t.dir / "cold";
  write_file_atomic(f, std::string(std::size_t{32} << 20, 'x'));
  evict(f);
  {
    const MappedFile control(f);
    const double share = huge_share_after_reading(control);
    if (share < 0.9)
      GTEST_SKIP() << "a cold file mapped here gets " << share * 100 << "% of 2 MiB pages (no large folios for "
                   << t.dir << "'s file system, or no transparent huge pages): nothing to measure";
  }
  evict(f);
  EXPECT_EQ(read_file_prefix(f, 8), "xxxxxxxx");
  EXPECT_EQ(read_file_prefix(f, 16), std::string(16, 'x'));
  const MappedFile m(f);
  // Measured on ext4 (Linux 6.18): 87.5% (the first 2 MiB, which holds the page the prefix read, and one more stay
  // small); with readahead 0%.
  EXPECT_GE(huge_share_after_reading(m), 0.75);
}

// procfs files are regular but report size 0: read to their end (eval's
// run.json records the command line from /proc/self/cmdline).
TEST(Io, ProcFilesOfSizeZeroAreReadToTheirEnd) {
  const std::string cmdline = read_file("/proc/self/cmdline");
  ASSERT_FALSE(cmdline.empty());
  EXPECT_NE(cmdline.find("posenc_tests"), std::string::npos);
  EXPECT_NE(error_of([] { read_file("/proc/self/maps", 1); }).find("more than the limit of 1 bytes"), std::string::npos);
  // An empty regular file is still empty.
  Tmp t;
  write_file_atomic(t.dir / "empty", "");
  EXPECT_EQ(read_file(t.dir / "empty"), "");
}

TEST(JsonFile, EveryAccessIsCheckedAndNamesFileAndKey) {
  const JsonDocument d = parse_json_document(
      R"({"config": {"lengths": [64, "a", 1.5, 3.0, 1e300], "name": "x", "ok": true, "nan": null},
          "big": 18446744073709551615})",
      "runs/r/run.json");
  const JsonView r = d.root();
  EXPECT_EQ(r.at("config").at("lengths").at(std::size_t{0}).integer(), 64);
  EXPECT_EQ(r.at("config").at("lengths").at(std::size_t{3}).integer(), 3);
  EXPECT_EQ(r.at("config").at("name").string(), "x");
  EXPECT_TRUE(r.at("config").at("ok").boolean());
  EXPECT_EQ(r.at("config").integer_or("absent", 7), 7);
  EXPECT_FALSE(r.at("config").find("nan").has_value());
  auto err = [&](auto f) { return error_of(f); };
  EXPECT_EQ(err([&] { r.at("missing"); }), "runs/r/run.json: missing key 'missing'");
  EXPECT_EQ(err([&] { r.at("config").at("lengths").at(std::size_t{1}).integer(); }),
            "runs/r/run.json: config.lengths[1]: expected an integer, got a string \"a\"");
  EXPECT_EQ(err([&] { r.at("config").at("lengths").at(std::size_t{2}).integer(); }),
            "runs/r/run.json: config.lengths[2]: expected an integer, got 1.5");
  EXPECT_EQ(err([&] { r.at("config").at("lengths").at(std::size_t{9}); }),
            "runs/r/run.json: config.lengths: index 9 past the end of an array of 5");
  EXPECT_NE(err([&] { r.at("config").at("lengths").at(std::size_t{4}).integer(); }).find("expected an integer"),
            std::string::npos);
  EXPECT_NE(err([&] { r.at("big").integer(); }).find("out of range"), std::string::npos);
  EXPECT_EQ(err([&] { r.at("config").at("lengths").at(std::size_t{0}).integer(1, 32); }),
            "runs/r/run.json: config.lengths[0]: 64 is out of range [1, 32]");
  EXPECT_EQ(err([&] { r.at("config").at("name").at("x"); }),
            "runs/r/run.json: config.name: expected an object with key 'x', got a string");
  EXPECT_NE(err([] { parse_json_document("{\"a\": ", "c.json"); }).find("c.json: not valid JSON"), std::string::npos);
  EXPECT_TRUE(dynamic_cast<const DataError*>(&static_cast<const Error&>(DataError("x"))) != nullptr);
}

}  // namespace

// Well-formed UTF-8 per Unicode Table 3-7, and the offset of the first sequence that is not (text inputs of the CLI
// are refused with it: the tokenizers take any bytes, each format as its reference does).
TEST(Utf8, FirstInvalidSequenceIsFoundByTheUnicodeTable) {
  using namespace std::string_literals;
  for (const std::string& ok : {""s, "plain ASCII\n\tand controls\x01"s, "caf\xc3\xa9"s, "\xe2\x82\xac 20"s,
                                "\xef\xbb\xbfwith a BOM"s, "\xf0\x9f\x98\x80"s, "\xf4\x8f\xbf\xbf"s /* U+10FFFF */,
                                "\xed\x9f\xbf"s /* U+D7FF */, "\xee\x80\x80"s /* U+E000 */, "nul\0inside"s})
    EXPECT_EQ(first_invalid_utf8(ok), std::nullopt) << ok;
  const std::pair<std::string, std::size_t> bad[] = {
      {"\x80"s, 0},                     // a continuation byte without a lead
      {"ab\xc0\x80"s, 2},               // overlong NUL
      {"ab\xc1\xbf"s, 2},               // overlong
      {"\xe0\x80\x80"s, 0},             // overlong 3-byte
      {"x\xed\xa0\x80"s, 1},            // a surrogate (U+D800)
      {"\xf0\x80\x80\x80"s, 0},         // overlong 4-byte
      {"\xf4\x90\x80\x80"s, 0},         // past U+10FFFF
      {"\xf5\x80\x80\x80"s, 0},         // a lead that never occurs
      {"abc\xff"s, 3},                  // a byte that never occurs
      {"caf\xe9 au lait"s, 3},          // Latin-1
      {"euro \xe2\x82"s, 5},            // truncated at the end
      {"\xe2\x28\xa1 x"s, 0},           // a continuation missing in the middle
      {"\xc3\xa9\xc3\xa9\xe2\x82\xac\x80"s, 7},  // after valid multi-byte characters
  };
  for (const auto& [text, at] : bad) EXPECT_EQ(first_invalid_utf8(text), std::optional<std::size_t>(at)) << text;
  EXPECT_EQ(error_of([] { require_utf8("caf\xc3\xa9\nline two \xff\xfe tail", "--text t.txt"); }),
            "--text t.txt: not valid UTF-8: the first invalid sequence is at byte offset 15 (line 2; bytes from "
            "there: 0xff 0xfe 0x20 0x74 ...); text inputs are read as UTF-8 (convert it, e.g. iconv -f latin1 -t "
            "utf-8)");
  EXPECT_EQ(error_of([] { require_utf8("ok \xe2\x82", "--prompt"); }).substr(0, 111),
            "--prompt: not valid UTF-8: the first invalid sequence is at byte offset 3 (line 1; bytes from there: "
            "0xe2 0x82)");
  EXPECT_EQ(error_of([] { require_utf8("all good \xe2\x82\xac", "x"); }), "");
}

}  // namespace POSENC_UNITY_ID
