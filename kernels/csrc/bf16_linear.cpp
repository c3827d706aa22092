// y = x W^T (+ b) in bf16 on AVX512-BF16 dot products, from W packed once into this kernel's layout.
//
// Why: oneDNN's bf16 linear streams weights at about half the memory's bandwidth at the few rows of a
// decode step (12-14 of ~26 GB/s, a whole SmolLM2 step on Zen 5), which is where a served batch and a
// single stream spend their steps. This kernel reads the weights once, in the order they lie, and reaches
// the bandwidth at one to eight rows; from nine rows up it tiles 8 rows x 48 columns from cache and keeps
// level with oneDNN (benchmarks/cpu_linear.py --dtype bfloat16).
//
// Layout: W [N, K] -> [ceil(N/16), K/2, 16, 2]: for each block of 16 output columns, each pair of K
// indices holds the 16 columns' two weights side by side, one zmm: vdpbf16ps multiplies it with the
// row's pair of x broadcast to every lane and adds both products into that column's fp32 accumulator.
// Columns past N are zero; sums are fp32 and rounded to bf16 once, to nearest even (as oneDNN's are).
//
// Without AVX512-BF16 at build time (the x86-64-v3 and -v4 levels) the module builds and says so:
// supported() is false and the caller keeps oneDNN.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "c_api.h"

#include <algorithm>
#include <cstdint>

#ifdef __AVX512BF16__
#include <immintrin.h>

namespace {

constexpr int64_t kBlock = 16;    // output columns a zmm accumulates
constexpr int64_t kChunk = 6;     // column blocks whose weights stay in cache for every row tile
constexpr int kTileRows = 8;      // rows x blocks of one tile: 24 accumulators of 32 zmm
constexpr int kTileBlocks = 3;
constexpr int64_t kFewRows = 8;   // up to here every row runs in one pass over the weights
constexpr int64_t kRowBlock = 256; // rows of x a thread keeps in L2 while the column chunks pass
constexpr int64_t kAheadRows = 64; // up to here a chunk's tiles fetch the next chunk's weights into L2
constexpr int kAheadLines = 2;     // cache lines of them fetched per pair of K (1 and 3-4 measured slower)

// Where the next column chunk's weights stand in being fetched. At 9-64 rows a chunk's first row tile
// waits on memory and its later ones on the dot products; fetching the next chunk meanwhile overlaps
// the two (a whole step's linears 1.1-1.3x at 9-32 rows). Into L2 (T1): into L1 (T0) they evict the
// tiles' own lines and run slower.
struct Ahead {
  const char* next = nullptr;
  const char* end = nullptr;
};

// R rows x B column blocks from nb0: acc[b][r] = sum over K of x[r] * W[column]
template <int R, int B>
inline void tile(const uint16_t* x, int64_t K, const uint16_t* wp, int64_t nb0, uint16_t* y, int64_t N,
                 const float* bias, Ahead* ahead = nullptr) {
  const char* q = ahead ? ahead->next : nullptr;
  const char* const q_end = ahead ? ahead->end : nullptr;
  __m512 acc[B][R];
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  const uint16_t* w[B];
  for (int b = 0; b < B; ++b) w[b] = wp + (nb0 + b) * pairs * 2 * kBlock;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i wv[B];
    for (int b = 0; b < B; ++b) {
      // 1 KB ahead of each stream: the few-rows pass reads the weights from memory
      _mm_prefetch(reinterpret_cast<const char*>(w[b] + (p + 16) * 2 * kBlock), _MM_HINT_T0);
      wv[b] = _mm512_loadu_si512(w[b] + p * 2 * kBlock);
    }
    if (q < q_end) {
      for (int l = 0; l < kAheadLines; ++l) _mm_prefetch(q + 64 * l, _MM_HINT_T1);
      q += 64 * kAheadLines;
    }
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * K + 2 * p));
      for (int b = 0; b < B; ++b) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], (__m512bh)wv[b], (__m512bh)xv);
    }
  }
  for (int b = 0; b < B; ++b) {
    const int64_t n0 = (nb0 + b) * kBlock, left = N - n0;
    const __mmask16 mask = left >= kBlock ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[b][r], bv));
      _mm256_mask_storeu_epi16(y + r * N + n0, mask, (__m256i)out);
    }
  }
  if (ahead) ahead->next = q;
}

// blocks [nb, nb_end) for R rows, B blocks at a time
template <int R, int B>
inline void row_tiles(const uint16_t* x, int64_t K, const uint16_t* wp, int64_t nb, int64_t nb_end, uint16_t* y,
                      int64_t N, const float* bias, Ahead* ahead = nullptr) {
  for (; nb + B <= nb_end; nb += B) tile<R, B>(x, K, wp, nb, y, N, bias, ahead);
  for (; nb < nb_end; ++nb) tile<R, 1>(x, K, wp, nb, y, N, bias, ahead);
}

// Few rows: every row in one pass over the weights, B blocks at a time for independent accumulators.
template <int R, int B>
void few_rows(const uint16_t* x, int64_t K, const uint16_t* wp, int64_t blocks, uint16_t* y, int64_t N,
              const float* bias) {
  at::parallel_for(0, (blocks + B - 1) / B, 8, [&](int64_t begin, int64_t end) {
    row_tiles<R, B>(x, K, wp, begin * B, std::min(blocks, end * B), y, N, bias);
  });
}

// Many rows: (row block, column chunk) pairs split over the threads, row block by row block. A chunk's
// weights, read once per row block, serve each of its 8-row tiles from cache, and the row block's x (256
// rows x K) stays in L2 while the chunks pass: a prefill's thousands of rows neither re-read the weights
// per tile nor stream x from memory per chunk.
void many_rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* wp, int64_t blocks, uint16_t* y,
               int64_t N, const float* bias) {
  // Row blocks of equal size (whole tiles): the threads take the items in contiguous runs, so a short
  // last block would leave a thread idle (300 rows as 256 + 44 ran 1.5x slower than oneDNN).
  const int64_t chunks = (blocks + kChunk - 1) / kChunk, even = (M + kRowBlock - 1) / kRowBlock;
  const int64_t block_rows = ((M + even - 1) / even + kTileRows - 1) / kTileRows * kTileRows;
  const int64_t row_blocks = (M + block_rows - 1) / block_rows;
  at::parallel_for(0, row_blocks * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item % chunks, m_end = std::min(M, (item / chunks + 1) * block_rows);
      const int64_t nb0 = c * kChunk, nb_end = std::min(blocks, nb0 + kChunk);
      int64_t m = (item / chunks) * block_rows;
      // the next item of this thread's run is the next chunk when all rows form one block
      Ahead ahead, *a = nullptr;
      if (M <= kAheadRows && item + 1 < end && c + 1 < chunks) {
        const char* w = reinterpret_cast<const char*>(wp);
        const int64_t block_bytes = K * kBlock * 2;  // (K / 2) pairs x 16 columns x 2 bf16
        ahead.next = w + nb_end * block_bytes;
        ahead.end = w + std::min(blocks, nb_end + kChunk) * block_bytes;
        a = &ahead;
      }
      for (; m + kTileRows <= m_end; m += kTileRows)
        row_tiles<kTileRows, kTileBlocks>(x + m * K, K, wp, nb0, nb_end, y + m * N, N, bias, a);
      if (m_end - m >= 4) { row_tiles<4, kTileBlocks>(x + m * K, K, wp, nb0, nb_end, y + m * N, N, bias, a); m += 4; }
      if (m_end - m >= 2) { row_tiles<2, kTileBlocks>(x + m * K, K, wp, nb0, nb_end, y + m * N, N, bias, a); m += 2; }
      if (m_end - m >= 1) row_tiles<1, kTileBlocks>(x + m * K, K, wp, nb0, nb_end, y + m * N, N, bias, a);
    }
  });
}

}  // namespace

bool supported() { return true; }

torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_cpu(),
              "bf16_linear.pack: a 2-D CPU bfloat16 weight");
  TORCH_CHECK(weight.size(1) % 2 == 0, "bf16_linear.pack: in_features must be even");
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + kBlock - 1) / kBlock;
  auto packed = torch::zeros({blocks, K / 2, kBlock, 2}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t k = 0; k < K; ++k)
        dst[(((n / kBlock) * (K / 2) + k / 2) * kBlock + n % kBlock) * 2 + k % 2] = src[n * K + k];
  });
  return packed;
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                     const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_cpu(), "bf16_linear: a 2-D CPU bf16 x");
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) * 2 == x.size(1) && packed.size(2) == kBlock
              && (out_features + kBlock - 1) / kBlock == packed.size(0), "bf16_linear: x does not fit the weight");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous()
                        && bias->numel() == out_features), "bf16_linear: the bias must be fp32 [out_features]");
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = out_features, blocks = packed.size(0);
  auto y = torch::empty({M, N}, xc.options());
  if (M == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  switch (M) {
    // one or two rows have few accumulators: four blocks at a time keep the dot products' pipes full
    case 1: few_rows<1, 4>(xp, K, wp, blocks, yp, N, b); break;
    case 2: few_rows<2, 4>(xp, K, wp, blocks, yp, N, b); break;
    case 3: few_rows<3, 4>(xp, K, wp, blocks, yp, N, b); break;
    case 4: few_rows<4, 4>(xp, K, wp, blocks, yp, N, b); break;
    case 5: few_rows<5, 3>(xp, K, wp, blocks, yp, N, b); break;
    case 6: few_rows<6, 3>(xp, K, wp, blocks, yp, N, b); break;
    case 7: few_rows<7, 3>(xp, K, wp, blocks, yp, N, b); break;
    case 8: few_rows<8, 3>(xp, K, wp, blocks, yp, N, b); break;
    default: many_rows(xp, M, K, wp, blocks, yp, N, b);
  }
  static_assert(kFewRows == 8, "the cases above serve up to kFewRows rows");
  return y;
}

#else  // no AVX512-BF16 at build time

bool supported() { return false; }
torch::Tensor pack(const torch::Tensor&) { TORCH_CHECK(false, "bf16_linear: built without AVX512-BF16"); }
torch::Tensor linear(const torch::Tensor&, const torch::Tensor&, int64_t, const c10::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "bf16_linear: built without AVX512-BF16");
}

#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  static const iterserve::c_api::Linear api{iterserve::c_api::kVersion, &linear};
  m.attr("c_api") = iterserve::c_api::capsule_of(api);
  m.def("supported", &supported, "whether this build has the AVX512-BF16 kernel");
  m.def("pack", &pack, "W [N, K] bf16 -> the kernel's packed layout");
  m.def("linear", &linear, "y = x W^T (+ bias) from the packed W", py::arg("x"), py::arg("packed"),
        py::arg("out_features"), py::arg("bias") = py::none());
}
