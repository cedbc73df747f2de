// Paged decode attention for the attention worker on the CPU: one query token per sequence against
// its K/V where they lie in the paged cache (attention_worker/kv_cache.py), GQA and sliding windows.
// torch's way (index_select every sequence's K and V into a padded [B, K, L, d] copy, then SDPA
// with a mask) reads the cache, writes the copy and reads it again, and builds the slot lists and
// masks per sequence in Python; this reads each K and V row once, straight from its block.
//
// Legend: B sequences, H query heads, K kv heads (H a multiple of K, G = H / K), d head dim, S block
// size, T blocks per sequence's table. Position p of sequence b lives in slot
// tables[b, p / S] * S + p % S of the flat [blocks * S, K, d] cache. Per sequence: the scores of
// every query head over the positions it may see (one pass over K, each position's row of all kv
// heads contiguous), an exact softmax (max subtracted), then the weighted sum of V (one pass): fp32
// throughout.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < d) {
    const __mmask16 m = static_cast<__mmask16>((1u << (d - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

inline void axpy(float a, const float* x, float* y, int64_t d) {  // y += a * x
  const __m512 av = _mm512_set1_ps(a);
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  if (i < d) {
    const __mmask16 m = static_cast<__mmask16>((1u << (d - i)) - 1);
    _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
  }
}

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
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, total(static_cast<size_t>(H));
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lp[b], lo = window > 0 ? std::max<int64_t>(0, len - window) : 0, n = len - lo;
      scores.assign(static_cast<size_t>(H * n), 0.0f);
      const float* qb = qp + b * H * d;
      // K: a position's row holds every kv head ([K, d], contiguous): one pass over the positions
      for (int64_t p = lo; p < len; ++p) {
        const float* kr = kp + (tp[b * T + p / block_size] * block_size + p % block_size) * K * d;
        for (int64_t h = 0; h < H; ++h) scores[h * n + (p - lo)] = dot(qb + h * d, kr + (h / G) * d, d) * sc;
      }
      for (int64_t h = 0; h < H; ++h) {
        float* s = scores.data() + h * n;
        const float m = *std::max_element(s, s + n);
        total[h] = 0.0f;
        for (int64_t i = 0; i < n; ++i) {
          s[i] = std::exp(s[i] - m);
          total[h] += s[i];
        }
      }
      float* ob = op + b * H * d;
      std::fill(ob, ob + H * d, 0.0f);
      for (int64_t p = lo; p < len; ++p) {  // V: the same pass
        const float* vr = vp + (tp[b * T + p / block_size] * block_size + p % block_size) * K * d;
        for (int64_t h = 0; h < H; ++h) axpy(scores[h * n + (p - lo)], vr + (h / G) * d, ob + h * d, d);
      }
      for (int64_t h = 0; h < H; ++h) {
        const float inv = 1.0f / total[h];
        for (int64_t i = 0; i < d; ++i) ob[h * d + i] *= inv;
      }
    }
  });
  return out;
}
