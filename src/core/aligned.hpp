// Internal: storage aligned to cache lines for the SIMD kernels' operands. A 64-byte (zmm) load from malloc's
// 16-byte alignment straddles two cache lines; the matrix kernels' loads of activations that way cost about 10%
// of a prefill (measured on a Sapphire Rapids core).
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

namespace posenc::detail {

/// std::allocator with every allocation aligned to kAlign bytes.
template <class T, std::size_t kAlign = 64>
struct AlignedAllocator {
  using value_type = T;
  AlignedAllocator() = default;
  template <class U>
  AlignedAllocator(const AlignedAllocator<U, kAlign>&) noexcept {}
  template <class U>
  struct rebind {
    using other = AlignedAllocator<U, kAlign>;
  };
  T* allocate(std::size_t n) {
    if (n > static_cast<std::size_t>(-1) / sizeof(T) - kAlign) throw std::bad_array_new_length();
    void* p = std::aligned_alloc(kAlign, (n * sizeof(T) + kAlign - 1) / kAlign * kAlign);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) noexcept { std::free(p); }
  template <class U>
  bool operator==(const AlignedAllocator<U, kAlign>&) const noexcept {
    return true;
  }
};

/// A float vector whose data() is 64-byte aligned.
using AlignedFloatVector = std::vector<float, AlignedAllocator<float>>;

struct FreeDeleter {
  void operator()(void* p) const noexcept { std::free(p); }
};

/// n elements of a trivial type, 64-byte aligned and left uninitialized (for a buffer the caller writes in full:
/// a std::vector would zero it first). Throws std::bad_alloc.
template <class T>
std::unique_ptr<T[], FreeDeleter> aligned_uninitialized(std::size_t n) {
  static_assert(std::is_trivial_v<T>);
  return std::unique_ptr<T[], FreeDeleter>(AlignedAllocator<T>().allocate(n));
}

}  // namespace posenc::detail
