// The attention worker's per-layer glue on the CPU, each op in one call: RMSNorm (with the residual add
// before it), rotary embedding, and the weighted sum of a MoE layer's expert results. In torch each is
// 4 to 8 ops on tensors of a few rows, ~5 µs of dispatch an op on this project's VMs: at 8 decode
// rows that glue took more of an AW's step than its attention (docs/performance.md).
//
// Numerics follow fabric/model/ops.py and attention_worker/layer_plan.py op for op: RoPE and the
// combine are bit for bit torch's (each product rounded, then each sum: no FMA contraction in this
// file); RMSNorm's mean of squares sums in another order than torch's reduction (a last-bit
// difference, as any other kernel's).
//
// Legend: T tokens (rows), D hidden, N heads (H query, K kv), d head dim, k experts a token, E experts,
// R expert rows (T * k).
#pragma GCC optimize("fp-contract=off")
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "simd.h"

namespace {

void check_rows(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1, what,
              ": x must be a [T, D] float32 CPU tensor, its rows contiguous");
}

// One row: y = w * (x * (1 / sqrt(mean(x^2) + eps))), as ops.rms_norm in fp32.
void norm_row(const float* x, const float* w, float* y, int64_t D, float eps) {
  simd::V16 acc = simd::zero();
  int64_t j = 0;
  for (; j + 16 <= D; j += 16) {
    const simd::V16 v = simd::load(x + j);
    acc = simd::add(acc, simd::mul(v, v));
  }
  float ss = simd::reduce_add(acc);
  for (; j < D; ++j) ss += x[j] * x[j];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
  const simd::V16 iv = simd::set1(inv);
  j = 0;
  for (; j + 16 <= D; j += 16) simd::store(y + j, simd::mul(simd::load(w + j), simd::mul(simd::load(x + j), iv)));
  for (; j < D; ++j) y[j] = w[j] * (x[j] * inv);
}

}  // namespace

// x [T, D], w [D] -> [T, D].
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_rows(x, "rms_norm");
  const int64_t T = x.size(0), D = x.size(1);
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kFloat32 && w.numel() == D, "rms_norm: w must be [D]");
  auto y = torch::empty({T, D}, x.options());
  for (int64_t t = 0; t < T; ++t)
    norm_row(x.data_ptr<float>() + t * x.stride(0), w.data_ptr<float>(), y.data_ptr<float>() + t * D, D,
             static_cast<float>(eps));
  return y;
}

// h [T, D] + delta [T, D] -> (the sum [T, D], its rms_norm with w [D]): a residual add and the norm after it.
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& h, const torch::Tensor& delta, const torch::Tensor& w,
                                        double eps) {
  check_rows(h, "add_rms_norm");
  check_rows(delta, "add_rms_norm");
  const int64_t T = h.size(0), D = h.size(1);
  TORCH_CHECK(delta.size(0) == T && delta.size(1) == D, "add_rms_norm: h and delta differ in shape");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kFloat32 && w.numel() == D, "add_rms_norm: w must be [D]");
  auto s = torch::empty({T, D}, h.options());
  auto y = torch::empty({T, D}, h.options());
  for (int64_t t = 0; t < T; ++t) {
    const float* a = h.data_ptr<float>() + t * h.stride(0);
    const float* b = delta.data_ptr<float>() + t * delta.stride(0);
    float* o = s.data_ptr<float>() + t * D;
    int64_t j = 0;
    for (; j + 16 <= D; j += 16) simd::store(o + j, simd::add(simd::load(a + j), simd::load(b + j)));
    for (; j < D; ++j) o[j] = a[j] + b[j];
    norm_row(o, w.data_ptr<float>(), y.data_ptr<float>() + t * D, D, static_cast<float>(eps));
  }
  return {s, y};
}

// x [T, N, d] (each head's d contiguous, rows strided), cos and sin [T, d] -> [T, N, d]:
// x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[d/2:], x[:d/2]).
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 3 && x.stride(2) == 1 &&
              x.stride(1) == x.size(2), "rope: x must be a [T, N, d] float32 CPU tensor, each row's heads contiguous");
  const int64_t T = x.size(0), N = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0, "rope: the head dim must be even");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32 &&
              sin.scalar_type() == torch::kFloat32 && cos.dim() == 2 && cos.size(0) == T && cos.size(1) == d &&
              sin.sizes() == cos.sizes(), "rope: cos and sin must be [T, d] float32");
  auto y = torch::empty({T, N, d}, x.options());
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos.data_ptr<float>() + t * d;
    const float* s = sin.data_ptr<float>() + t * d;
    for (int64_t n = 0; n < N; ++n) {
      const float* a = x.data_ptr<float>() + t * x.stride(0) + n * d;
      float* o = y.data_ptr<float>() + (t * N + n) * d;
      for (int64_t j = 0; j < half; ++j) {
        const float p = a[j] * c[j], q = -a[j + half] * s[j];
        o[j] = p + q;
      }
      for (int64_t j = half; j < d; ++j) {
        const float p = a[j] * c[j], q = a[j - half] * s[j];
        o[j] = p + q;
      }
    }
  }
  return y;
}

// h [T, D] + the weighted sum of each token's expert results: ys [R_i, D] in row order (their rows
// tile the layer's R rows), weights [R], token_of_row [R] -> [T, D]. As
// h + zeros.index_add_(0, token_of_row, cat(ys) * weights[:, None]): each token's sum starts at zero
// and adds its rows in row order, then goes onto h.
torch::Tensor combine_add(const torch::Tensor& h, const std::vector<torch::Tensor>& ys, const torch::Tensor& weights,
                          const torch::Tensor& token_of_row) {
  check_rows(h, "combine_add");
  const int64_t T = h.size(0), D = h.size(1), R = weights.numel();
  TORCH_CHECK(weights.is_contiguous() && weights.scalar_type() == torch::kFloat32, "combine_add: weights must be [R] float32");
  TORCH_CHECK(token_of_row.is_contiguous() && token_of_row.scalar_type() == torch::kInt64 && token_of_row.numel() == R,
              "combine_add: token_of_row must be [R] int64");
  const float* wp = weights.data_ptr<float>();
  const int64_t* tok = token_of_row.data_ptr<int64_t>();
  auto acc = torch::zeros({T, D}, h.options());
  float* ap = acc.data_ptr<float>();
  int64_t r = 0;
  for (const auto& y : ys) {
    check_rows(y, "combine_add");
    TORCH_CHECK(y.size(1) == D && r + y.size(0) <= R, "combine_add: the results do not fit the rows");
    for (int64_t i = 0; i < y.size(0); ++i, ++r) {
      TORCH_CHECK(tok[r] >= 0 && tok[r] < T, "combine_add: a row's token is out of range");
      const float* src = y.data_ptr<float>() + i * y.stride(0);
      float* dst = ap + tok[r] * D;
      const simd::V16 wv = simd::set1(wp[r]);
      int64_t j = 0;
      for (; j + 16 <= D; j += 16) simd::store(dst + j, simd::add(simd::load(dst + j), simd::mul(simd::load(src + j), wv)));
      for (; j < D; ++j) dst[j] = dst[j] + src[j] * wp[r];
    }
  }
  TORCH_CHECK(r == R, "combine_add: the results cover ", r, " of ", R, " rows");
  auto out = torch::empty({T, D}, h.options());
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* a = h.data_ptr<float>() + t * h.stride(0);
    const float* b = ap + t * D;
    int64_t j = 0;
    for (; j + 16 <= D; j += 16) simd::store(op + t * D + j, simd::add(simd::load(a + j), simd::load(b + j)));
    for (; j < D; ++j) op[t * D + j] = a[j] + b[j];
  }
  return out;
}

namespace {

// The checks of a fused projection qkv [T, (H + 2K) d] and the caches kc, vc [slots, K, d] it writes at slots [T].
void check_qkv_cache(const torch::Tensor& qkv, const torch::Tensor& kc, const torch::Tensor& vc, const torch::Tensor& slots,
                     int64_t H, const char* what) {
  TORCH_CHECK(qkv.is_cpu() && qkv.scalar_type() == torch::kFloat32 && qkv.dim() == 2 && qkv.stride(1) == 1, what,
              ": qkv must be a [T, (H + 2K) d] float32 CPU tensor, its rows contiguous");
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.dim() == 3 && kc.sizes() == vc.sizes() &&
              kc.scalar_type() == torch::kFloat32 && vc.scalar_type() == torch::kFloat32, what,
              ": the caches must be contiguous [slots, K, d] float32 tensors of one shape");
  const int64_t T = qkv.size(0), K = kc.size(1), d = kc.size(2), nslots = kc.size(0);
  TORCH_CHECK(qkv.size(1) == (H + 2 * K) * d, what, ": qkv ", qkv.sizes(), " does not fit ", H, " heads and the cache ",
              kc.sizes());
  TORCH_CHECK(slots.is_contiguous() && slots.scalar_type() == torch::kInt64 && slots.numel() == T, what,
              ": slots must be [T] int64");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < nslots, what, ": slot ", sp[t], " is outside the cache");
}

// qk [T, H + K, d] (q and k, rotated) and qkv's v: k and v written to the caches at slots -> (q, k, v) views.
std::vector<torch::Tensor> write_cache(const torch::Tensor& qk, const torch::Tensor& qkv, torch::Tensor kc, torch::Tensor vc,
                                       const torch::Tensor& slots, int64_t H) {
  const int64_t T = qkv.size(0), K = kc.size(1), d = kc.size(2), row = K * d;
  const int64_t* sp = slots.data_ptr<int64_t>();
  float* kp = kc.data_ptr<float>();
  float* vp = vc.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(kp + sp[t] * row, qk.data_ptr<float>() + (t * (H + K) + H) * d, sizeof(float) * row);
    std::memcpy(vp + sp[t] * row, qkv.data_ptr<float>() + t * qkv.stride(0) + (H + K) * d, sizeof(float) * row);
  }
  return {qk.narrow(1, 0, H), qk.narrow(1, H, K), qkv.narrow(1, (H + K) * d, K * d).view({T, K, d})};
}

}  // namespace

// The attention's inputs from a fused projection qkv [T, (H + 2K) d] (rows strided): q and k rotated (rope),
// k and v written to the cache at slots [T] (kc, vc [slots, K, d]) -> (q [T, H, d], k [T, K, d], v [T, K, d]),
// as the model runner's views, apply_rope and index_copy_ make them.
std::vector<torch::Tensor> rope_cache(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                                      torch::Tensor kc, torch::Tensor vc, const torch::Tensor& slots, int64_t H) {
  check_qkv_cache(qkv, kc, vc, slots, H, "rope_cache");
  const int64_t T = qkv.size(0), K = kc.size(1), d = kc.size(2);
  auto qk = rope(qkv.narrow(1, 0, (H + K) * d).view({T, H + K, d}), cos, sin);  // [T, H + K, d]
  return write_cache(qk, qkv, kc, vc, slots, H);
}

// The same with each head of q and of k RMSNorm'd first (q_norm, k_norm [d]: Qwen3's), as the runner's
// rms_norm of each head then rope make them, bit for bit: the same norm_row and rope.
std::vector<torch::Tensor> norm_rope_cache(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                                           torch::Tensor kc, torch::Tensor vc, const torch::Tensor& slots, int64_t H,
                                           const torch::Tensor& q_norm, const torch::Tensor& k_norm, double eps) {
  check_qkv_cache(qkv, kc, vc, slots, H, "norm_rope_cache");
  const int64_t T = qkv.size(0), K = kc.size(1), d = kc.size(2);
  for (const auto* w : {&q_norm, &k_norm})
    TORCH_CHECK(w->is_contiguous() && w->scalar_type() == torch::kFloat32 && w->numel() == d,
                "norm_rope_cache: q_norm and k_norm must be [d] float32");
  auto normed = torch::empty({T, H + K, d}, qkv.options());  // [T, H + K, d]
  float* out = normed.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t n = 0; n < H + K; ++n)
      norm_row(qkv.data_ptr<float>() + t * qkv.stride(0) + n * d, (n < H ? q_norm : k_norm).data_ptr<float>(),
               out + (t * (H + K) + n) * d, d, static_cast<float>(eps));
  return write_cache(rope(normed, cos, sin), qkv, kc, vc, slots, H);
}

// A MoE layer's rows sorted by expert (stable: tokens ascending within an expert), as layer_plan.plan_layer
// makes them: x [T, D], experts [T, k] int64, weights [T, k] float32 -> (rows [R, D], token of each row [R],
// each row's weight [R], rows per expert [E]).
std::vector<torch::Tensor> plan_rows(const torch::Tensor& x, const torch::Tensor& experts, const torch::Tensor& weights,
                                     int64_t E) {
  check_rows(x, "plan_rows");
  const int64_t T = x.size(0), D = x.size(1);
  TORCH_CHECK(experts.is_contiguous() && experts.scalar_type() == torch::kInt64 && experts.dim() == 2 &&
              experts.size(0) == T, "plan_rows: experts must be [T, k] int64");
  const int64_t k = experts.size(1), R = T * k;
  TORCH_CHECK(weights.is_contiguous() && weights.scalar_type() == torch::kFloat32 && weights.sizes() == experts.sizes(),
              "plan_rows: weights must be [T, k] float32");
  const int64_t* ep = experts.data_ptr<int64_t>();
  auto counts = torch::zeros({E}, experts.options());
  int64_t* cp = counts.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(ep[r] >= 0 && ep[r] < E, "plan_rows: expert ", ep[r], " is not one of ", E);
    ++cp[ep[r]];
  }
  std::vector<int64_t> next(static_cast<size_t>(E));
  for (int64_t e = 0, at = 0; e < E; ++e) {
    next[e] = at;
    at += cp[e];
  }
  auto xs = torch::empty({R, D}, x.options());
  auto tok = torch::empty({R}, experts.options());
  auto w = torch::empty({R}, weights.options());
  int64_t* tp = tok.data_ptr<int64_t>();
  float* wp = w.data_ptr<float>();
  const float* wi = weights.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {  // flat order is token-major: a stable counting sort
    const int64_t at = next[ep[r]]++;
    tp[at] = r / k;
    wp[at] = wi[r];
    std::memcpy(xs.data_ptr<float>() + at * D, x.data_ptr<float>() + (r / k) * x.stride(0), sizeof(float) * D);
  }
  return {xs, tok, w, counts};
}

// The router's logits, as F.linear makes them: x [T, D], w [E, D] -> x w^T [T, E]. Each is one dot product over D in
// one order (16 lanes of fused multiply-adds, then a fixed tree, then the tail), whatever T is: a token's logits do
// not depend on the rows beside it, where torch's matmul sums in an order that changes with the rows (from 2 on here).
torch::Tensor router_logits(const torch::Tensor& x, const torch::Tensor& w) {
  check_rows(x, "router_logits");
  TORCH_CHECK(w.is_cpu() && w.scalar_type() == torch::kFloat32 && w.dim() == 2 && w.is_contiguous() &&
              w.size(1) == x.size(1), "router_logits: w must be a contiguous [E, D] float32 CPU tensor");
  const int64_t T = x.size(0), D = x.size(1), E = w.size(0);
  auto y = torch::empty({T, E}, x.options());
  float* yp = y.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x.data_ptr<float>() + t * x.stride(0);
    for (int64_t e = 0; e < E; ++e) {
      const float* wr = wp + e * D;
      simd::V16 acc = simd::zero();
      int64_t j = 0;
      for (; j + 16 <= D; j += 16) acc = simd::fmadd(simd::load(xr + j), simd::load(wr + j), acc);
      float sum = simd::reduce_add(acc);
      for (; j < D; ++j) sum += xr[j] * wr[j];
      yp[t * E + e] = sum;
    }
  }
  return y;
}

// The router's choice, as ops.route makes it: logits [T, E] -> (weights [T, k] float32, experts [T, k] int64).
// Each row's softmax (max subtracted; each exp times 1 / the sum), its k largest probabilities (the lower expert
// first where two are equal), those divided by their sum where `normalize`. exp is the C library's, not torch's
// vectorised one: the weights may differ from torch's in their last bit, as RMSNorm's.
std::vector<torch::Tensor> route(const torch::Tensor& logits, int64_t k, bool normalize) {
  check_rows(logits, "route");
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= E, "route: top-k ", k, " of ", E, " experts");
  auto weights = torch::empty({T, k}, logits.options());
  auto experts = torch::empty({T, k}, logits.options().dtype(torch::kInt64));
  std::vector<float> p(static_cast<size_t>(E));
  std::vector<char> taken(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits.data_ptr<float>() + t * logits.stride(0);
    float m = l[0];
    for (int64_t e = 1; e < E; ++e) m = std::max(m, l[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) {
      p[e] = std::exp(l[e] - m);
      sum += p[e];
    }
    const float inv = 1.0f / sum;
    for (int64_t e = 0; e < E; ++e) p[e] = p[e] * inv;
    std::fill(taken.begin(), taken.end(), 0);
    float* w = weights.data_ptr<float>() + t * k;
    int64_t* x = experts.data_ptr<int64_t>() + t * k;
    float chosen = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
      taken[best] = 1;
      x[j] = best;
      w[j] = p[best];
      chosen += p[best];
    }
    if (normalize)
      for (int64_t j = 0; j < k; ++j) w[j] = w[j] / chosen;
  }
  return {weights, experts};
}
