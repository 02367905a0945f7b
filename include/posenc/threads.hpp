// posenc — the OpenMP thread counts posenc runs with.
#pragma once

namespace posenc {

/// The most OpenMP threads posenc runs with: 64 x std::thread::hardware_concurrency() (at least 1 hardware
/// thread). Far more than ever pays off, and far below what breaks libgomp: OMP_NUM_THREADS=100000 made every
/// parallel region die of SIGSEGV inside GOMP_parallel, without a message. Never throws.
int max_omp_threads() noexcept;

/// Checks the OMP_NUM_THREADS environment variable before any parallel region runs (the CLI once its command line
/// is parsed, the Python module at import): unset, empty or all blanks passes; otherwise every comma-separated item
/// (one count per nesting level) must be a positive decimal integer, a leading + allowed as libgomp allows it, of
/// at most max_omp_threads(). Throws InvalidArgument naming OMP_NUM_THREADS, its value, the offending item and, for
/// a count past it, the bound ("abc", "0", "-1", "4,,2": libgomp only warned and ran with its default, so a typo
/// went unnoticed).
void check_omp_num_threads();

/// check_omp_num_threads(), then that OpenMP's own thread count (omp_get_max_threads(): libgomp reads
/// OMP_NUM_THREADS once, when the process starts) is at most max_omp_threads(): the Python module's import
/// check, which a second `import posenc` after fixing os.environ reached with libgomp still set to the first value
/// (a crash in the first parallel region). Throws InvalidArgument as check_omp_num_threads, or naming the count
/// OpenMP runs with and saying to start the process again.
void check_omp_threads_in_use();

/// The threads a parallel region started outside any other gets: omp_get_max_threads() (OMP_NUM_THREADS, or
/// omp_set_num_threads) capped by omp_get_thread_limit() (OMP_THREAD_LIMIT), at least 1; 1 when no region may be
/// active (OMP_MAX_ACTIVE_LEVELS=0). What posenc reports as its thread count (KernelInfo::threads, an evaluation
/// run's run.json): with OMP_NUM_THREADS=2 OMP_THREAD_LIMIT=1 the regions run on one thread and this says 1, where
/// omp_get_max_threads() says 2. Under OMP_DYNAMIC=true the runtime may give a region fewer threads than this,
/// region by region, which no count given beforehand can say. Never throws.
int region_thread_count() noexcept;

}  // namespace posenc
