// posenc tests: whether the build is under a sanitizer.
#pragma once

namespace posenc::test {

/// Whether this build runs under AddressSanitizer (POSENC_SANITIZE=ON): its
/// shadow memory reserves terabytes of address space, so tests that bound the
/// address space (RLIMIT_AS, `ulimit -v`) cannot run there and are skipped.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kAddressSanitizer = true;
#else
inline constexpr bool kAddressSanitizer = false;
#endif
#else
inline constexpr bool kAddressSanitizer = false;
#endif

}  // namespace posenc::test
