// The ceiling every bf16 GEMM figure on this CPU is judged against: how many AVX512-BF16 dot products
// (vdpbf16ps zmm: 16 lanes x 2 products x 2 flops = 64 flops) and fp32 FMAs (vfmadd zmm: 32 flops) a core
// retires per second from registers, with enough independent accumulators to hide their latency, on one
// thread and on every thread at once (a VM's vCPUs can share a physical core's pipes).
//
//     g++ -O2 -march=native -pthread benchmarks/dpbf16_peak.cpp -o /tmp/dpbf16_peak && /tmp/dpbf16_peak [threads]
//
// kernels/csrc/bf16_linear.cpp's inner loop is this loop with loads and broadcasts added (24 accumulators,
// 8 rows x 3 column blocks), so benchmarks/cpu_linear.py's GFLOP/s divided by this is its efficiency.
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

constexpr int kAcc = 24;
constexpr long kInstructions = 400'000'000;

// GFLOP/s of one thread running `kInstructions` of `op` over kAcc accumulators
template <typename Op>
double run(Op op, int flops_per_instruction) {
  __m512 acc[kAcc];
  for (auto& a : acc) a = _mm512_setzero_ps();
  __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.999f);
  const auto t0 = std::chrono::steady_clock::now();
  for (long it = 0; it < kInstructions / kAcc; ++it) {
#pragma GCC unroll 24
    for (int i = 0; i < kAcc; ++i) acc[i] = op(acc[i], a, b);
    __asm__ volatile("" : "+v"(a));  // the inputs may change: the loop cannot be folded
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float sink = 0.f;
  for (auto& x : acc) sink += _mm512_reduce_add_ps(x);
  if (sink == 42.f) std::puts("");  // keeps the sums alive
  return static_cast<double>(kInstructions) * flops_per_instruction / s / 1e9;
}

double dot(int) {
  return run([](__m512 c, __m512 a, __m512 b) { return _mm512_dpbf16_ps(c, (__m512bh)a, (__m512bh)b); }, 64);
}
double fma(int) {
  return run([](__m512 c, __m512 a, __m512 b) { return _mm512_fmadd_ps(a, b, c); }, 32);
}

void report(const char* what, double (*f)(int), int threads) {
  std::vector<double> each(threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { each[t] = f(t); });
  for (auto& th : pool) th.join();
  double sum = 0.f;
  for (double g : each) sum += g;
  std::printf("%-22s %d thread(s): %7.1f GFLOP/s in all, %6.1f a thread\n", what, threads, sum, sum / threads);
}

}  // namespace

int main(int argc, char** argv) {
  const int all = argc > 1 ? std::atoi(argv[1]) : static_cast<int>(std::thread::hardware_concurrency());
  for (int threads : {1, all}) {
    report("vdpbf16ps (bf16 dot)", dot, threads);
    report("vfmadd231ps (fp32)", fma, threads);
  }
}
