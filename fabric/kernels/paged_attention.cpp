// Paged decode attention for the attention worker on the CPU: one query token per sequence against
// its K/V where they lie in the paged cache (attention_worker/kv_cache.py), GQA and sliding windows.
// torch's way (index_select every sequence's K and V into a padded [B, K, L, d] copy, then SDPA
// with a mask) reads the cache, writes the copy and reads it again, and builds the slot lists and
// masks per sequence in Python; this reads K and V straight from their blocks.
//
// Legend: B sequences, H query heads, K kv heads (H a multiple of K, G = H / K), d head dim (at most
// 128), S block size, T blocks per sequence's table. Position p of sequence b lives in slot
// tables[b, p / S] * S + p % S of the flat [blocks * S, K, d] cache. Per sequence and kv head, where
// each position's row lies is found once; then for each of its G query heads: the scores (the query
// in registers), an exact softmax (max subtracted; exp 16 lanes at a time, within 2e-7 of libm's),
// and the weighted sum of V (in registers, one pass). The head's rows stay in L1/L2 across its G
// query heads. fp32 throughout. Against the version before (a scalar exp, the sum in memory), a
// decode of 8 sequences of ~100 tokens took 0.71x the time, 32 of them 0.82x (docs/performance.md).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "simd.h"

namespace {

using simd::V16;

// exp(x) for x <= 0 (scores less their max): 2^n p(r), r = x - n ln 2 in [-ln 2 / 2, ln 2 / 2] (ln 2 in two
// parts), p the degree-7 Taylor polynomial (relative error under 2e-7 there); 0 below -87.3.
inline V16 exp_neg(V16 x) {
  x = simd::max(x, simd::set1(-87.33654f));
  const V16 n = simd::round_nearest(simd::mul(x, simd::set1(1.44269504088896341f)));
  V16 r = simd::fnmadd(n, simd::set1(0.693359375f), x);
  r = simd::fnmadd(n, simd::set1(-2.12194440e-4f), r);
  V16 p = simd::set1(1.0f / 5040.0f);
  for (const float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = simd::fmadd(p, r, simd::set1(c));
  return simd::times_pow2(p, n);
}

// Rows prefetched ahead. A kv head's rows lie a cache row apart (K d floats), which the hardware prefetcher follows
// poorly across pages. On the AVX2 EPYC, 8 rows ahead took 0.81x-0.92x the time at 16 and 64 sequences of 128
// tokens and 4 of 4000, and the same elsewhere (docs/performance.md). The AVX-512 build does not prefetch: not
// measured there, and the GEMM's software prefetches once slowed its stream on that VM.
#if defined(__AVX512F__)
constexpr int64_t kAhead = 0;
#else
constexpr int64_t kAhead = 8;
#endif

// Chunk c of a row of d floats. FULL: d is 16 NC, every chunk whole, a plain load. On AVX2 a masked load
// (vmaskmovps) of a whole chunk cost the kernel 1.2x-2.2x its time on the AMD EPYC; AVX-512's are the same speed.
template <bool FULL>
inline V16 chunk(const float* row, int c, int64_t d) {
  return FULL ? simd::load(row + 16 * c) : simd::load(row + 16 * c, simd::tail(d - 16 * c));
}

template <int NC>
inline void prefetch_row(const float* row) {
  for (int c = 0; c < NC; ++c) _mm_prefetch(reinterpret_cast<const char*>(row + 16 * c), _MM_HINT_T0);
}

// One query head against one kv head's n rows (krows, vrows: where each position's row of that head lies):
// s = q . k * scale, softmax, out [d] = sum of s_p v_p. NC chunks of 16 cover d (d <= 16 NC); q and the
// sum stay in registers. s is scratch of n + 16 floats.
template <int NC, bool FULL>
void one_head(const float* q, const float* const* krows, const float* const* vrows, int64_t n, int64_t d, float scale,
              float* s, float* out) {
  using simd::tail;
  V16 qv[NC], o[NC];
  for (int c = 0; c < NC; ++c) {
    qv[c] = simd::load(q + 16 * c, tail(d - 16 * c));
    o[c] = simd::zero();
  }
  for (int64_t i = 0; i < n; ++i) {
    if (kAhead && i + kAhead < n) prefetch_row<NC>(krows[i + kAhead]);
    V16 acc = simd::mul(qv[0], chunk<FULL>(krows[i], 0, d));
    for (int c = 1; c < NC; ++c) acc = simd::fmadd(qv[c], chunk<FULL>(krows[i], c, d), acc);
    s[i] = simd::reduce_add(acc) * scale;
  }
  const V16 neg_inf = simd::set1(-INFINITY);
  V16 mv = neg_inf;
  for (int64_t i = 0; i < n; i += 16) mv = simd::max(mv, simd::load(s + i, tail(n - i), neg_inf));
  const V16 m = simd::set1(simd::reduce_max(mv));
  V16 total = simd::zero();
  for (int64_t i = 0; i < n; i += 16) {  // (lanes past n: exp of 0 - m, masked out of the total and the store)
    const V16 e = exp_neg(simd::sub(simd::load(s + i, tail(n - i)), m));
    total = simd::add(tail(n - i), total, e);
    simd::store(s + i, tail(n - i), e);
  }
  for (int64_t i = 0; i < n; ++i) {
    if (kAhead && i + kAhead < n) prefetch_row<NC>(vrows[i + kAhead]);
    const V16 w = simd::set1(s[i]);
    for (int c = 0; c < NC; ++c) o[c] = simd::fmadd(w, chunk<FULL>(vrows[i], c, d), o[c]);
  }
  const V16 inv = simd::set1(1.0f / simd::reduce_add(total));
  for (int c = 0; c < NC; ++c) simd::store(out + 16 * c, tail(d - 16 * c), simd::mul(o[c], inv));
}

using HeadFn = void (*)(const float*, const float* const*, const float* const*, int64_t, int64_t, float, float*,
                        float*);
constexpr HeadFn kHeads[2][8] = {
    {one_head<1, false>, one_head<2, false>, one_head<3, false>, one_head<4, false>,
     one_head<5, false>, one_head<6, false>, one_head<7, false>, one_head<8, false>},
    {one_head<1, true>, one_head<2, true>, one_head<3, true>, one_head<4, true>,
     one_head<5, true>, one_head<6, true>, one_head<7, true>, one_head<8, true>}};

}  // namespace

// q [B, H, d]; k_cache, v_cache [blocks * S, K, d]; tables [B, T] int64; lens [B] int64 (tokens in
// the cache, the query's own included); window 0 for none -> [B, H, d]. All fp32.
torch::Tensor paged_decode(const torch::Tensor& q_in, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& tables_in, const torch::Tensor& lens_in, int64_t block_size,
                           double scale, int64_t window) {
  TORCH_CHECK(q_in.is_cpu() && k_cache.is_cpu() && v_cache.is_cpu() && tables_in.is_cpu() && lens_in.is_cpu(),
              "paged_decode: CPU tensors only");
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == torch::kFloat32, "paged_decode: q must be [B, H, d] float32");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.scalar_type() == torch::kFloat32 && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == torch::kFloat32 && v_cache.is_contiguous(),
              "paged_decode: the caches must be contiguous [blocks * S, K, d] float32 tensors of one shape");
  const torch::Tensor q = q_in.contiguous();
  const torch::Tensor tables = tables_in.to(torch::kInt64).contiguous();
  const torch::Tensor lens = lens_in.to(torch::kInt64).contiguous();
  const int64_t B = q.size(0), H = q.size(1), d = q.size(2), K = k_cache.size(1), slots = k_cache.size(0);
  TORCH_CHECK(k_cache.size(2) == d && K > 0 && H % K == 0, "paged_decode: q ", q.sizes(), " does not fit the cache ",
              k_cache.sizes());
  TORCH_CHECK(d >= 1 && d <= 128, "paged_decode: head dim ", d, " (this kernel takes 1 to 128)");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && lens.dim() == 1 && lens.size(0) == B && block_size > 0,
              "paged_decode: one block table and one length per sequence");
  const int64_t T = tables.size(1), G = H / K;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)  // (checked before any read: a bad slot would read out of bounds)
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= T * block_size, "paged_decode: sequence ", b, " has length ", lp[b],
                " for a table of ", T, " blocks");
  for (int64_t b = 0; b < B; ++b)  // (the blocks the window sees: those before it may be holes, -1)
    for (int64_t j = (window > 0 ? std::max<int64_t>(0, lp[b] - window) : 0) / block_size;
         j < (lp[b] + block_size - 1) / block_size; ++j)
      TORCH_CHECK(tp[b * T + j] >= 0 && (tp[b * T + j] + 1) * block_size <= slots, "paged_decode: sequence ", b,
                  " names block ", tp[b * T + j], " outside the cache");
  torch::Tensor out = torch::empty({B, H, d}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const HeadFn head = kHeads[d % 16 == 0][(d + 15) / 16 - 1];
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const float*> krows, vrows;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lp[b], lo = window > 0 ? std::max<int64_t>(0, len - window) : 0, n = len - lo;
      scores.resize(static_cast<size_t>(n + 16));
      krows.resize(static_cast<size_t>(n));
      vrows.resize(static_cast<size_t>(n));
      for (int64_t kh = 0; kh < K; ++kh) {
        for (int64_t p = lo; p < len; ++p) {
          const int64_t at = (tp[b * T + p / block_size] * block_size + p % block_size) * K * d + kh * d;
          krows[p - lo] = kp + at;
          vrows[p - lo] = vp + at;
        }
        for (int64_t h = kh * G; h < (kh + 1) * G; ++h)  // (the G query heads of kv head kh)
          head(qp + (b * H + h) * d, krows.data(), vrows.data(), n, d, sc, scores.data(), op + (b * H + h) * d);
      }
    }
  });
  return out;
}
