// Skinny fp32 GEMM for expert FFNs: y [M, N] = x [M, K] @ W [K, N], for the few rows (M) an expert
// sees per decode step, and a prefill's many. Such a product is bound by reading W once; MKL (torch's
// BLAS here) runs it at well under the memory bandwidth on CPUs it does not tune for, and runs a
// prefill's 2.3x slower than this here. W is packed once, at load, into column blocks of 64
// ([ceil(N/64), K, 64], the last padded with zeros) so that each block streams contiguously; a product
// names its N, and a last block's padding is computed and not stored. Per block, rows go in groups of up to 6
// (24 AVX-512 accumulators, the block staying in L2 across the groups; on AVX2, strips of the block with at most 12,
// a panel's groups taking a chunk of the block at a time while it is in L1). Every output element is one FMA chain
// over k = 0..K-1, whatever M is and whichever build: a row's result does not depend on the rows batched with it
// (ATen's batched matmul, which took more than 48 rows until 2026-11-29, gave a row other floats). Unlike the
// attention and the glue, the register block is written per instruction set (the `#if` below), as the two have
// different registers to block for.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

#include "codec.h"
#include "second_core.h"

namespace {

constexpr int64_t kCols = 64;  // output columns per packed block (4 AVX-512 vectors, 8 AVX2 ones)
constexpr int64_t kRows = 6;   // rows per register block

torch::Tensor pack(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32, "pack: w must be a [K, N] float32 tensor");
  const int64_t K = w.size(0), N = w.size(1), NB = (N + kCols - 1) / kCols;
  TORCH_CHECK(N > 0, "pack: w has no columns");
  const torch::Tensor padded = N % kCols ? at::constant_pad_nd(w, {0, NB * kCols - N}) : w.contiguous();  // [K, NB*64]
  return padded.view({K, NB, kCols}).permute({1, 0, 2}).contiguous();
}

#if defined(__AVX512F__)
// y [MB, cols] = x [MB, K] @ one packed block [K, 64], its first `cols` columns stored: all 64, or with `kPart` (a
// last block part-full) fewer. (A separate instance: a runtime test of cols in the one for whole blocks made a
// 1 x 512 x 16384 product 1.4x slower here.)
template <int MB, bool kPart>
void block(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy, int64_t cols) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * kCols;  // (a contiguous stream: the hardware prefetcher keeps up; software
                                      // prefetches of half the lines 8 rows ahead made it 1.5x slower)
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
    const __m512 w2 = _mm512_loadu_ps(wk + 32), w3 = _mm512_loadu_ps(wk + 48);
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * ldx + k]);
      acc[m][0] = _mm512_fmadd_ps(xv, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xv, w1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(xv, w2, acc[m][2]);
      acc[m][3] = _mm512_fmadd_ps(xv, w3, acc[m][3]);
    }
  }
  if constexpr (!kPart) {
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + m * ldy + j * 16, acc[m][j]);
  } else {
    for (int j = 0; j < 4; ++j) {
      const int64_t lanes = std::clamp<int64_t>(cols - 16 * j, 0, 16);
      if (lanes == 0) break;
      const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1);
      for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + m * ldy + j * 16, mask, acc[m][j]);
    }
  }
}

// Every one of the M rows against one packed block, in register groups of up to kRows.
template <bool kPart>
void rows_of_block(const float* xp, int64_t M, int64_t K, const float* wb, float* yp, int64_t N, int64_t cols) {
  for (int64_t m0 = 0; m0 < M; m0 += kRows) {
    const float* xb = xp + m0 * K;
    float* yb = yp + m0 * N;
    switch (std::min<int64_t>(kRows, M - m0)) {
      case 1: block<1, kPart>(xb, K, wb, K, yb, N, cols); break;
      case 2: block<2, kPart>(xb, K, wb, K, yb, N, cols); break;
      case 3: block<3, kPart>(xb, K, wb, K, yb, N, cols); break;
      case 4: block<4, kPart>(xb, K, wb, K, yb, N, cols); break;
      case 5: block<5, kPart>(xb, K, wb, K, yb, N, cols); break;
      default: block<6, kPart>(xb, K, wb, K, yb, N, cols); break;
    }
  }
}
#else
// AVX2 has 16 registers of 8 lanes, not 32 of 16: a block goes in strips of NV vectors (8 NV of its 64 columns), at
// most 12 accumulators (a group of up to 6 rows), and over k in chunks of kChunk rows (16 KiB of the block, in L1). A
// panel of up to kPanel rows takes a chunk at a time, every strip of each of its row groups, before the next chunk: the
// chunk comes from memory once for the panel's groups, not once a group (each group over the whole of K read the block
// again from L2, and its first chunk's wait for memory was not overlapped with any compute). The rows are split into
// groups of near-equal size (16 rows: 6, 5, 5, not 6, 6, 4), so that no group is left with the few accumulators that
// wait on the FMA's latency. The first strip of a chunk prefetches the chunk's other lines into L1, and every strip of
// the panel prefetches an equal share of the next 16 KiB of the packed weight into L2 (the next chunk of this block or
// the first of the next), a line at each of its first k: memory streams the next chunk in while the panel computes this
// one (an expert's FFN at 12 to 64 rows in 0.71x-0.83x the time of groups that each took the whole block, and in 0.93x
// at 8; a panel of one to three rows, which streams at the bandwidth by itself, prefetches nothing ahead). The sums
// carry across chunks in memory, exactly: each output element is the same FMA chain over k as the AVX-512 build's, so
// the same floats.
constexpr int64_t kChunk = 64;  // k rows a chunk
constexpr int64_t kPanel = 48;  // rows a panel: its sums [48, 64] and x's chunk beside the weight's chunk in L1

constexpr int vectors(int64_t rows) { return rows == 1 ? 8 : rows <= 3 ? 4 : 2; }  // NV of a group of `rows`

// One strip of a chunk: the `fetch`-th to (`fetch` + `lines` - 1)-th lines of `ahead` prefetched into L2, one at each
// of its first k.
template <int MB, int NV, bool kFetch>
void strip(const float* x, int64_t ldx, const float* w, int64_t kn, float* sums, bool first, const float* ahead,
           int64_t fetch, int64_t lines) {
  __m256 acc[MB][NV];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NV; ++j) acc[m][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + m * kCols + 8 * j);
  const float* next = ahead + 16 * fetch;
  for (int64_t k = 0; k < kn; ++k) {
    const float* wk = w + k * kCols;
    if constexpr (kFetch)  // (the lines of this k's 64 columns past the strip's own)
      for (int line = NV / 2; line < 4; ++line) _mm_prefetch(reinterpret_cast<const char*>(wk + 16 * line), _MM_HINT_T0);
    if (k < lines) _mm_prefetch(reinterpret_cast<const char*>(next + 16 * k), _MM_HINT_T1);
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_set1_ps(x[m * ldx + k]);
      for (int j = 0; j < NV; ++j) acc[m][j] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(wk + 8 * j), acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(sums + m * kCols + 8 * j, acc[m][j]);
}

// One group of MB rows over a chunk: its strips up to `width` columns (a part-full last block's strips past it not
// computed). `fetch` counts the lines of `ahead` prefetched so far, `lines` a strip's share.
template <int MB>
void group(const float* x, int64_t ldx, const float* w, int64_t kn, float* sums, bool first, bool lead, int64_t width,
           const float* ahead, int64_t& fetch, int64_t lines) {
  constexpr int NV = vectors(MB);
  constexpr int64_t kStrip = 8 * NV;
  if (lead && NV < 8)
    strip<MB, NV, true>(x, ldx, w, kn, sums, first, ahead, fetch, lines);
  else
    strip<MB, NV, false>(x, ldx, w, kn, sums, first, ahead, fetch, lines);
  fetch += lines;
  for (int64_t c0 = kStrip; c0 < width; c0 += kStrip, fetch += lines)
    strip<MB, NV, false>(x, ldx, w + c0, kn, sums + c0, first, ahead, fetch, lines);
}

// The i-th of `groups` near-equal groups of `rows` rows: its size (the first rows % groups one larger).
inline int64_t share(int64_t rows, int64_t groups, int64_t i) { return rows / groups + (i < rows % groups); }

// y [M, cols] = x [M, K] @ one packed block [K, 64] for a panel of M <= kPanel rows, its first `cols` columns stored.
template <bool kPart>
void panel(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t ldy, int64_t cols) {
  const int64_t width = kPart ? cols : kCols;
  const int64_t G = (M + kRows - 1) / kRows;
  int64_t strips = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t strip_cols = 8 * vectors(share(M, G, g));
    strips += (width + strip_cols - 1) / strip_cols;
  }
  float sums[kPanel * kCols];  // [M, 64]
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t kn = std::min(kChunk, K - k0);
    const float* ahead = w + (k0 + kn) * kCols;  // (past the weight's end a prefetch reads nothing: it never faults)
    const int64_t lines = M <= 3 ? 0 : (4 * kn + strips - 1) / strips;  // (a chunk is 4 kn lines)
    int64_t fetch = 0;
    for (int64_t g = 0, m0 = 0; g < G; ++g) {
      const int64_t mb = share(M, G, g);
      const float* xg = x + m0 * K + k0;
      float* sg = sums + m0 * kCols;
      const bool first = k0 == 0, lead = g == 0;
      const float* wc = w + k0 * kCols;
      switch (mb) {
        case 1: group<1>(xg, K, wc, kn, sg, first, lead, width, ahead, fetch, lines); break;
        case 2: group<2>(xg, K, wc, kn, sg, first, lead, width, ahead, fetch, lines); break;
        case 3: group<3>(xg, K, wc, kn, sg, first, lead, width, ahead, fetch, lines); break;
        case 4: group<4>(xg, K, wc, kn, sg, first, lead, width, ahead, fetch, lines); break;
        case 5: group<5>(xg, K, wc, kn, sg, first, lead, width, ahead, fetch, lines); break;
        default: group<6>(xg, K, wc, kn, sg, first, lead, width, ahead, fetch, lines); break;
      }
      m0 += mb;
    }
  }
  for (int64_t m = 0; m < M; ++m) std::copy(sums + m * kCols, sums + m * kCols + width, y + m * ldy);
}

// Every one of the M rows against one packed block, in near-equal panels of up to kPanel rows.
template <bool kPart>
void rows_of_block(const float* xp, int64_t M, int64_t K, const float* wb, float* yp, int64_t N, int64_t cols) {
  const int64_t P = (M + kPanel - 1) / kPanel;
  for (int64_t p = 0, m0 = 0; p < P; ++p) {
    const int64_t mp = share(M, P, p);
    panel<kPart>(xp + m0 * K, mp, K, wb, yp + m0 * N, N, cols);
    m0 += mp;
  }
}
#endif

// One product's operands, for its blocks on either thread (second_core.h).
struct Product {
  const float* xp;
  const float* wp;
  float* yp;
  int64_t M, K, N;
};

void product_block(const void* ctx, int64_t nb) {
  const Product& p = *static_cast<const Product*>(ctx);
  const float* wb = p.wp + nb * p.K * kCols;
  const int64_t cols = std::min(kCols, p.N - nb * kCols);
  if (cols == kCols) {
    rows_of_block<false>(p.xp, p.M, p.K, wb, p.yp + nb * kCols, p.N, cols);
  } else {
    rows_of_block<true>(p.xp, p.M, p.K, wb, p.yp + nb * kCols, p.N, cols);
  }
}

// A product goes to the second core (where it is on) at most this many rows, and at least this many blocks and bytes
// of W (512 KiB: ~50 µs at one core's ~10 GB/s, against the helper's wake-up of a few µs).
constexpr int64_t kShareRows = 4;
constexpr int64_t kShareBlocks = 4;
constexpr int64_t kShareBytes = 512 << 10;

// x [M, K] @ W [K, N] -> [M, N], W packed by pack() (N: its shape holds only the blocks).
torch::Tensor skinny(const torch::Tensor& x_in, const torch::Tensor& w, int64_t N) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32, "mm: x must be a [M, K] float32 tensor");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kFloat32 && w.size(2) == kCols && w.is_contiguous(),
              "mm: w must be packed by pack()");
  const torch::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), blocks = w.size(0);
  TORCH_CHECK(w.size(1) == K, "mm: x has ", K, " columns, the packed weight ", w.size(1), " rows");
  TORCH_CHECK(N > (blocks - 1) * kCols && N <= blocks * kCols, "mm: the packed weight's ", blocks,
              " blocks of 64 columns do not hold N = ", N);
  torch::Tensor y = torch::empty({M, N}, x.options());
  const Product p{x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), M, K, N};
  second_core::Helper& helper = second_core::Helper::get();
  if (helper.on() && M <= kShareRows && blocks >= kShareBlocks && blocks * K * kCols * 4 >= kShareBytes &&
      at::get_num_threads() == 1) {
    helper.run(blocks, &product_block, &p);
  } else {
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t nb = begin; nb < end; ++nb) product_block(&p, nb);
    });
  }
  return y;
}

// One expert's SwiGLU FFN: y [M, D] = (silu(x @ G) * (x @ U)) @ Down, with [G U] = gate_up packed
// ([ceil(2I/64), D, 64]) and Down packed ([ceil(D/64), I, 64]). The same ATen ops as fabric/model/ops.py's
// swiglu_ffn_t, in the same order (so the same floats).
torch::Tensor ffn(const torch::Tensor& x, const torch::Tensor& gate_up, const torch::Tensor& down) {
  const int64_t D = gate_up.size(1), I = down.size(1);  // (their K: a packed weight's N is not in its shape)
  const std::vector<torch::Tensor> gu = skinny(x, gate_up, 2 * I).chunk(2, -1);  // [M, I] each
  return skinny(at::silu(gu[0]) * gu[1], down, D);
}

// Experts of one x each, one call: ys[i] = ffn(xs[i], gate_ups[i], downs[i]). The GIL is released for all of it.
std::vector<torch::Tensor> ffn_batch(const std::vector<torch::Tensor>& xs, const std::vector<torch::Tensor>& gate_ups,
                                     const std::vector<torch::Tensor>& downs) {
  TORCH_CHECK(xs.size() == gate_ups.size() && xs.size() == downs.size(), "ffn_batch: one gate_up and down per x");
  std::vector<torch::Tensor> ys;
  ys.reserve(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) ys.push_back(ffn(xs[i], gate_ups[i], downs[i]));
  return ys;
}

// An EW's gathered batch, one call: the calls' rows xs[c] [R_c, D] in, their results [R_c, D] out, each
// expert (unit) run once over its rows from every call. Unit u's rows are the segments
// segs[3j : 3j + 3] = (call, first row, rows) for j from ends[u - 1] (0 for u = 0) to ends[u], in order;
// the segments of all units tile every call's rows. The rows, gathered and scattered in C++, with the
// GIL released throughout: no tensor op in the interpreter per expert or segment.
std::vector<torch::Tensor> ffn_calls(const std::vector<torch::Tensor>& xs, const std::vector<int64_t>& segs,
                                     const std::vector<int64_t>& ends, const std::vector<torch::Tensor>& gate_ups,
                                     const std::vector<torch::Tensor>& downs) {
  TORCH_CHECK(ends.size() == gate_ups.size() && ends.size() == downs.size(), "ffn_calls: one gate_up and down a unit");
  TORCH_CHECK(segs.size() % 3 == 0 && (ends.empty() || ends.back() * 3 == static_cast<int64_t>(segs.size())),
              "ffn_calls: the units' ends must cover the segments");
  std::vector<torch::Tensor> outs;
  outs.reserve(xs.size());
  for (const auto& x : xs) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "ffn_calls: each call's x must be [R, D] float32");
    outs.push_back(torch::empty_like(x));
  }
  std::vector<std::vector<bool>> covered;  // each call's rows written so far
  for (const auto& x : xs) covered.emplace_back(static_cast<size_t>(x.size(0)), false);
  int64_t j = 0;
  for (size_t u = 0; u < ends.size(); ++u) {
    TORCH_CHECK(ends[u] > j, "ffn_calls: unit ", u, " has no rows");
    std::vector<torch::Tensor> parts;
    for (int64_t k = j; k < ends[u]; ++k) {
      const int64_t c = segs[3 * k], start = segs[3 * k + 1], n = segs[3 * k + 2];
      TORCH_CHECK(c >= 0 && c < static_cast<int64_t>(xs.size()) && start >= 0 && n > 0 && start + n <= xs[c].size(0),
                  "ffn_calls: segment ", k, " lies outside its call's rows");
      for (int64_t r = start; r < start + n; ++r) {
        TORCH_CHECK(!covered[c][r], "ffn_calls: row ", r, " of call ", c, " lies in two segments");
        covered[c][r] = true;
      }
      parts.push_back(xs[c].narrow(0, start, n));
    }
    const torch::Tensor y = ffn(parts.size() == 1 ? parts[0] : at::cat(parts), gate_ups[u], downs[u]);  // [N, D]
    int64_t offset = 0;
    for (; j < ends[u]; ++j) {
      const int64_t c = segs[3 * j], start = segs[3 * j + 1], n = segs[3 * j + 2];
      outs[c].narrow(0, start, n).copy_(y.narrow(0, offset, n));
      offset += n;
    }
  }
  for (size_t c = 0; c < xs.size(); ++c)
    TORCH_CHECK(std::find(covered[c].begin(), covered[c].end(), false) == covered[c].end(), "ffn_calls: call ", c,
                " has rows in no segment");
  return outs;
}

}  // namespace

// paged_attention.cpp (the same module)
torch::Tensor paged_decode(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& tables, const torch::Tensor& lens, int64_t block_size, double scale,
                           int64_t window);

// layer_ops.cpp (the same module)
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& h, const torch::Tensor& delta, const torch::Tensor& w,
                                        double eps);
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor combine_add(const torch::Tensor& h, const std::vector<torch::Tensor>& ys, const torch::Tensor& weights,
                          const torch::Tensor& token_of_row);
std::vector<torch::Tensor> rope_cache(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                                      torch::Tensor kc, torch::Tensor vc, const torch::Tensor& slots, int64_t H);
std::vector<torch::Tensor> norm_rope_cache(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                                           torch::Tensor kc, torch::Tensor vc, const torch::Tensor& slots, int64_t H,
                                           const torch::Tensor& q_norm, const torch::Tensor& k_norm, double eps);
std::vector<torch::Tensor> plan_rows(const torch::Tensor& x, const torch::Tensor& experts, const torch::Tensor& weights,
                                     int64_t E);
std::vector<torch::Tensor> route(const torch::Tensor& logits, int64_t k, bool normalize);
torch::Tensor router_logits(const torch::Tensor& x, const torch::Tensor& w);


PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  codec::register_codec(m);  // calls and results to and from the wire (codec.h)
  m.def("pack", &pack, "W [K, N] float32 -> packed [ceil(N/64), K, 64]");
  m.def("mm", &skinny, "x [M, K] @ packed W -> [M, N], any M", py::arg("x"), py::arg("w"), py::arg("n"),
        py::call_guard<py::gil_scoped_release>());
  m.def("second_core", [] { return second_core::Helper::get().start(); },
        "a helper thread takes a share of few-row products' blocks from now on (second_core.h); whether it runs");
  m.def("second_core_stats", [] {
    const second_core::Helper& h = second_core::Helper::get();
    return std::make_pair(h.products(), h.helped());
  }, "products shared with the helper so far, and the blocks it computed of them");
  m.def("ffn_batch", &ffn_batch, "SwiGLU FFNs of a batch of experts over packed weights",
        py::call_guard<py::gil_scoped_release>());
  m.def("ffn_calls", &ffn_calls, "an EW's gathered batch: the calls' rows, each expert's segments of them, its packed "
        "weights -> each call's results", py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode", &paged_decode,
        "decode attention over the paged KV cache: q [B, H, d], caches [blocks * S, K, d], tables [B, T], lens [B], "
        "block size, scale, sliding window (0: none) -> [B, H, d]",
        py::call_guard<py::gil_scoped_release>());
  // A few µs each: they keep the GIL.
  m.def("rms_norm", &rms_norm, "RMSNorm: x [T, D], w [D], eps -> [T, D]");
  m.def("add_rms_norm", &add_rms_norm, "h + delta [T, D], then its RMSNorm with w [D] -> (sum, normed)");
  m.def("rope", &rope, "rotary embedding (rotate-half): x [T, N, d], cos and sin [T, d] -> [T, N, d]");
  m.def("combine_add", &combine_add, "h [T, D] + the weighted sum of each token's expert results (ys in row order, "
        "weights [R], token_of_row [R]) -> [T, D]");
  m.def("rope_cache", &rope_cache, "q, k rotated and k, v written to the cache at slots, from a fused qkv [T, (H + 2K) d] "
        "-> (q [T, H, d], k [T, K, d], v [T, K, d])");
  m.def("norm_rope_cache", &norm_rope_cache, "rope_cache with each head of q and k RMSNorm'd first (q_norm, k_norm [d], "
        "eps)");
  m.def("plan_rows", &plan_rows, "a MoE layer's rows sorted by expert: x [T, D], experts [T, k], weights [T, k], E -> "
        "(rows [R, D], token of each row [R], weights [R], rows per expert [E])");
  m.def("router_logits", &router_logits, "the router's logits, a token's whatever rows come with it: x [T, D], w [E, D] "
        "-> [T, E]");
  m.def("route", &route, "the router's top-k: logits [T, E], k, normalize -> (weights [T, k], experts [T, k])");
}
