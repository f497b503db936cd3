// The routed experts of a few tokens as one CPU kernel: see grouped_experts.py (why, what, the plain twin).
// x [T, D], experts int64 [T, k], weights [T, k], gate_up [E, 2I, D], down [E, D, I] (fp32 or bf16) -> [T, D] fp32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cstring>
#include <vector>

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef unsigned short v8h __attribute__((vector_size(16)));
typedef unsigned int v8u __attribute__((vector_size(32)));

inline v8 load(const float* p) { v8 v; std::memcpy(&v, p, sizeof v); return v; }
inline v8 load(const at::BFloat16* p) {
  v8h h; std::memcpy(&h, p, sizeof h);
  v8u u = __builtin_convertvector(h, v8u) << 16;
  v8 v; std::memcpy(&v, &u, sizeof v); return v;
}
inline float scalar(float v) { return v; }
inline float scalar(at::BFloat16 v) { return static_cast<float>(v); }
inline float hsum(v8 v) {  // fixed order: pairs, then pairs of pairs
  float a = (v[0] + v[4]) + (v[1] + v[5]);
  float b = (v[2] + v[6]) + (v[3] + v[7]);
  return a + b;
}

// Pairwise sums within 128-bit halves: [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7].
inline v8 hadd(v8 a, v8 b) {
  typedef int v8i __attribute__((vector_size(32)));
  const v8 even = __builtin_shuffle(a, b, v8i{0, 2, 8, 10, 4, 6, 12, 14});
  return even + __builtin_shuffle(a, b, v8i{1, 3, 9, 11, 5, 7, 13, 15});
}

// The lane sums of 8 accumulators at once: out[i] = sum of acc[i]'s lanes (a transposing add tree).
inline v8 hsum8(const v8* acc) {
  typedef int v8i __attribute__((vector_size(32)));
  const v8 u0 = hadd(hadd(acc[0], acc[1]), hadd(acc[2], acc[3]));
  const v8 u1 = hadd(hadd(acc[4], acc[5]), hadd(acc[6], acc[7]));
  const v8 low = __builtin_shuffle(u0, u1, v8i{0, 1, 2, 3, 8, 9, 10, 11});
  return low + __builtin_shuffle(u0, u1, v8i{4, 5, 6, 7, 12, 13, 14, 15});
}

constexpr int R = 4;  // rows of one expert per register block
constexpr int J = 2;  // weight rows per register block
constexpr int PREFETCH_ROWS = 16;  // weight rows ahead to prefetch (the next blocks of the same thread)

// out[r][j] = sum_k W[j][k] * X[rows[r]][k] for r < NR, j < NJ: NR x NJ 8-lane accumulators held in registers
// (every loop bound a constant, so the compiler unrolls them), each weight vector loaded once for the NR rows.
template <int NR, int NJ, typename W>
inline void block(const W* w, int64_t ldw, const float* x, const int64_t* rows, int64_t K, float* out) {
  v8 acc[NR][NJ] = {};
  const float* xr[NR];
  for (int r = 0; r < NR; ++r) xr[r] = x + rows[r] * K;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    v8 wv[NJ];
    for (int j = 0; j < NJ; ++j) {
      wv[j] = load(w + j * ldw + k);
      __builtin_prefetch(w + (j + PREFETCH_ROWS) * ldw + k);  // the rows a few blocks on, from memory meanwhile
    }
    for (int r = 0; r < NR; ++r) {
      v8 xv = load(xr[r] + k);
      asm("" : "+x"(xv));  // held in a register: not reloaded as each FMA's memory operand (NR + NJ loads, not NR x NJ)
      for (int j = 0; j < NJ; ++j) acc[r][j] += wv[j] * xv;
    }
  }
  float sums[R * J];
  if constexpr (NR * NJ == 8) {  // a full block: its 8 sums by one add tree
    const v8 s = hsum8(&acc[0][0]);
    for (int i = 0; i < 8; ++i) sums[i] = s[i];
  } else {
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < NJ; ++j) sums[r * NJ + j] = hsum(acc[r][j]);
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NJ; ++j) {
      float s = sums[r * NJ + j];
      for (int64_t t = k; t < K; ++t) s += scalar(w[j * ldw + t]) * xr[r][t];
      out[r * J + j] = s;
    }
}

template <int NJ, typename W>
inline void rows_block(int nr, const W* w, int64_t ldw, const float* x, const int64_t* rows, int64_t K, float* out) {
  switch (nr) {
    case 1: block<1, NJ>(w, ldw, x, rows, K, out); break;
    case 2: block<2, NJ>(w, ldw, x, rows, K, out); break;
    case 3: block<3, NJ>(w, ldw, x, rows, K, out); break;
    default: block<4, NJ>(w, ldw, x, rows, K, out); break;
  }
}

// For every expert e and its assignments rows(e): Y[a][n] = sum_k W[e][n][k] * X[a][k], n < N.
template <typename W>
void grouped(const W* w, int64_t N, int64_t K, const float* x, float* y, const std::vector<int64_t>& order,
             const std::vector<int64_t>& start, int64_t E) {
  const int64_t nblocks = (N + J - 1) / J;
  at::parallel_for(0, E * nblocks, 16, [&](int64_t lo, int64_t hi) {
    float out[R * J];
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t e = item / nblocks, n0 = (item % nblocks) * J;
      if (start[e] == start[e + 1]) continue;  // an expert no assignment chose: its weights are not read
      const int nj = static_cast<int>(std::min<int64_t>(J, N - n0));
      const W* we = w + (e * N + n0) * K;
      for (int64_t s = start[e]; s < start[e + 1]; s += R) {
        const int nr = static_cast<int>(std::min<int64_t>(R, start[e + 1] - s));
        if (nj == J)
          rows_block<J>(nr, we, K, x, order.data() + s, K, out);
        else
          rows_block<1>(nr, we, K, x, order.data() + s, K, out);
        for (int r = 0; r < nr; ++r)
          for (int j = 0; j < nj; ++j) y[order[s + r] * N + n0 + j] = out[r * J + j];
      }
    }
  });
}

template <typename W>
at::Tensor run(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights, const at::Tensor& gate_up,
               const at::Tensor& down) {
  const int64_t T = x.size(0), D = x.size(1), k = experts.size(1), A = T * k;
  const int64_t E = gate_up.size(0), I2 = gate_up.size(1), I = I2 / 2;
  auto xf = x.to(at::kFloat).contiguous();
  auto ex = experts.contiguous();
  const int64_t* e_ptr = ex.data_ptr<int64_t>();
  std::vector<int64_t> start(E + 1, 0), order(A);
  for (int64_t a = 0; a < A; ++a) {
    TORCH_CHECK(e_ptr[a] >= 0 && e_ptr[a] < E, "grouped_experts: expert id ", e_ptr[a], " outside [0, ", E, ")");
    ++start[e_ptr[a] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t a = 0; a < A; ++a) order[fill[e_ptr[a]]++] = a;  // stable: routing order within an expert
  }
  // the inputs of the assignments, one row each (a token's row repeated for its k experts)
  auto xa = at::empty({A, D}, xf.options());
  float* xa_ptr = xa.data_ptr<float>();
  const float* x_ptr = xf.data_ptr<float>();
  for (int64_t a = 0; a < A; ++a) std::memcpy(xa_ptr + a * D, x_ptr + (a / k) * D, D * sizeof(float));
  auto gu = at::empty({A, I2}, xf.options());
  grouped(gate_up.data_ptr<W>(), I2, D, xa_ptr, gu.data_ptr<float>(), order, start, E);
  auto h = (at::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I)).contiguous();  // [A, I]
  const float* h_ptr = h.data_ptr<float>();
  auto ya = at::empty({A, D}, xf.options());
  grouped(down.data_ptr<W>(), D, I, h_ptr, ya.data_ptr<float>(), order, start, E);
  auto wf = weights.to(at::kFloat).reshape({A, 1});
  auto out = (ya * wf).view({T, k, D}).sum(1);  // each token's k outputs weighted, summed in routing order
  return out;
}

at::Tensor grouped_experts(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
                           const at::Tensor& gate_up, const at::Tensor& down) {
  TORCH_CHECK(x.dim() == 2 && experts.dim() == 2 && weights.sizes() == experts.sizes(), "grouped_experts: shapes");
  TORCH_CHECK(experts.scalar_type() == at::kLong, "grouped_experts: int64 expert ids, got ", experts.scalar_type());
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(1) % 2 == 0, "grouped_experts: weight shapes");
  const int64_t E = gate_up.size(0), D = x.size(1), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(2) == D && down.size(0) == E && down.size(1) == D && down.size(2) == I,
              "grouped_experts: gate_up ", gate_up.sizes(), " and down ", down.sizes(), " do not fit x ", x.sizes());
  TORCH_CHECK(gate_up.is_contiguous() && down.is_contiguous(), "grouped_experts: contiguous expert weights");
  TORCH_CHECK(gate_up.scalar_type() == down.scalar_type(), "grouped_experts: one weight dtype");
  if (gate_up.scalar_type() == at::kBFloat16) return run<at::BFloat16>(x, experts, weights, gate_up, down);
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat, "grouped_experts: fp32 or bf16 weights, got ",
              gate_up.scalar_type());
  return run<float>(x, experts, weights, gate_up, down);
}

}  // namespace

TORCH_LIBRARY(flashnext_ext, m) {
  m.def("grouped_experts(Tensor x, Tensor experts, Tensor weights, Tensor gate_up, Tensor down) -> Tensor");
}
TORCH_LIBRARY_IMPL(flashnext_ext, CPU, m) { m.impl("grouped_experts", &grouped_experts); }
