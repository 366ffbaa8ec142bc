// Fused float32 CPU kernels for a decoding pass of a few rows (eagle/kernels/fused.py says why).
//
// Every output is computed the same way whatever the number of rows beside it: a linear's output
// y[i, j] is one FMA chain over k = 0..in-1 in one SIMD lane, a row's attention reads its keys in
// slot order and skips the masked ones. So a token's logits do not depend on how many tokens a
// forward carries (1 in vanilla decoding, a tree's n in a verification): exactness by construction.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__AVX512F__)
typedef __m512 vec;
constexpr int VW = 16;  // floats per vector
// rows per block against a panel of C vectors: the block's R x C accumulators, C weight vectors and a
// broadcast fit the 32 registers
template <int C>
constexpr int block_rows() { return C > 2 ? 6 : 12; }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
// the 4 weight vectors of a k stay in registers for every row (the compiler would load them again
// from memory for each row, which makes the loads, not the FMAs, the bound)
#define KEEP_IN_REGISTERS(a, b, c, d) asm volatile("" : "+v"(a), "+v"(b), "+v"(c), "+v"(d))
static inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vset1(float x) { return _mm512_set1_ps(x); }
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec vmin(vec a, vec b) { return _mm512_min_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vround(vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec vpow2(vec p, vec n) { return _mm512_scalef_ps(p, n); }  // p * 2^n
static inline float vmax_lanes(vec v) { return _mm512_reduce_max_ps(v); }
static inline float vsum(vec v) {  // _mm512_reduce_add_ps's tree, spelled out (vsum_lanes follows it)
  __m256 h = _mm256_add_ps(_mm512_extractf32x8_ps(v, 1), _mm512_castps512_ps256(v));
  __m128 s = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// The horizontal sums of VW vectors at once: lane c of the result is the sum of a[KEY_SLOT[c]]'s
// lanes by vsum's tree (lanes i + 8, then i + 4, i + 2, i + 1 added), so the same float as its vsum
// (an addition of two floats is the same in either order; checked on millions of random sums).
// Each level adds the halves of two vectors side by side.
constexpr int KEY_SLOT[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};  // its own inverse
static inline vec vsum_lanes(const vec* a) {
  vec h[8], q[4], e[2];
  for (int p = 0; p < 8; ++p)  // [a_p | a_p+8]: lanes i and i + 8
    h[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[p], a[p + 8], 0xEE), _mm512_shuffle_f32x4(a[p], a[p + 8], 0x44));
  for (int p = 0; p < 4; ++p)  // i and i + 4
    q[p] = _mm512_add_ps(_mm512_shuffle_f32x4(h[p], h[p + 4], 0xDD), _mm512_shuffle_f32x4(h[p], h[p + 4], 0x88));
  for (int p = 0; p < 2; ++p)  // i and i + 2
    e[p] = _mm512_add_ps(_mm512_shuffle_ps(q[p], q[p + 2], 0xEE), _mm512_shuffle_ps(q[p], q[p + 2], 0x44));
  return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0xDD), _mm512_shuffle_ps(e[0], e[1], 0x88));  // i and i + 1
}
static inline bool vall_above(vec v, float s) { return _mm512_cmp_ps_mask(v, vset1(s), _CMP_GT_OQ) == 0xFFFF; }
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec;
constexpr int VW = 8;
// rows per block against a panel of C vectors (16 registers: 2 x 4 accumulators + 4 weight vectors + 1
// broadcast, or 4 x 2 + 2 + 1)
template <int C>
constexpr int block_rows() { return C > 2 ? 2 : 4; }
#define KEEP_IN_REGISTERS(a, b, c, d)
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vset1(float x) { return _mm256_set1_ps(x); }
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline float vsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// as AVX-512's (lanes i + 4, then i + 2, i + 1 added)
constexpr int KEY_SLOT[8] = {0, 2, 1, 3, 4, 6, 5, 7};  // its own inverse
static inline vec vsum_lanes(const vec* a) {
  vec h[4], q[2];
  for (int p = 0; p < 4; ++p)  // [a_p | a_p+4]: lanes i and i + 4
    h[p] = _mm256_add_ps(_mm256_permute2f128_ps(a[p], a[p + 4], 0x31), _mm256_permute2f128_ps(a[p], a[p + 4], 0x20));
  for (int p = 0; p < 2; ++p)  // i and i + 2
    q[p] = _mm256_add_ps(_mm256_shuffle_ps(h[p], h[p + 2], 0xEE), _mm256_shuffle_ps(h[p], h[p + 2], 0x44));
  return _mm256_add_ps(_mm256_shuffle_ps(q[0], q[1], 0xDD), _mm256_shuffle_ps(q[0], q[1], 0x88));  // i and i + 1
}
static inline float vmax_lanes(vec v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline bool vall_above(vec v, float s) { return _mm256_movemask_ps(_mm256_cmp_ps(v, vset1(s), _CMP_GT_OQ)) == 0xFF; }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline vec vmin(vec a, vec b) { return _mm256_min_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vround(vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec vpow2(vec p, vec n) {  // p * 2^n, n a whole number in [-126, 127]
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#else
#error "the fused kernels need AVX2 with FMA, or AVX-512"
#endif

// e^x of every lane (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, e^r by a degree-7 polynomial;
// within 2 ulp of std::exp; x below -87.3 gives ~1e-38, not 0; x at most 88): the attention's
// probabilities and the MLP's SiLU, a vector at a time instead of one std::exp per float
static inline vec vexp(vec x) {
  x = vmax(x, vset1(-87.3f));  // inputs: score - max <= 0, or -g capped at 88
  const vec n = vround(vmul(x, vset1(1.44269504088896341f)));
  vec r = vfma(n, vset1(-0.693359375f), x);  // x - n ln 2, ln 2 in two parts
  r = vfma(n, vset1(2.12194440e-4f), r);
  vec p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset1(1.f)));
  return vpow2(p, n);
}

constexpr int PW = 4 * VW;  // a panel's widest: the outputs one block of 4 accumulators covers

// f(std::integral_constant<int, n>()) for a run-time n in [1, MAX]: a block's rows, n, as a template
// argument (n outside [1, MAX]: nothing)
template <int MAX, class F>
static inline void with_rows(int64_t n, F&& f) {
  if constexpr (MAX >= 1) {
    if (n == MAX)
      f(std::integral_constant<int, MAX>());
    else
      with_rows<MAX - 1>(n, f);
  }
}

int64_t panel_width() { return PW; }

// The vectors of outputs in each panel of a weight with `out` outputs: 4, or 2 where the threads
// would share 4-vector panels unevenly and 2-vector ones less so (576 outputs are 9 panels of 64,
// which 2 threads share 5 to 4: the thread reading 5/9 of the weight sets the time; 18 of 32
// share 9 to 9). A panel is never split between threads: two threads reading parts of one panel's
// lines made the 576-output products slower (the prefetchers fetch the whole panel for each).
static int64_t panel_vectors(int64_t out) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  auto busiest = [&](int64_t c) {  // outputs of the most loaded thread
    const int64_t panels = (out + c * VW - 1) / (c * VW);
    return (panels + threads - 1) / threads * c * VW;
  };
  return busiest(2) < busiest(4) ? 2 : 4;
}

// A zero-filled float32 tensor in memory that Linux backs with 2 MB pages where it can (transparent
// huge pages, asked for with madvise: the "madvise" mode most kernels default to gives them to no
// one else). A stream of a 4 KB-paged weight crosses a page every 64 cache lines, with a TLB miss
// and the prefetchers stopped at each: products of packed weights and a streaming read both ran
// faster on 2 MB pages. The mapping starts on a 2 MB boundary and ends at the tensor's last 4 KB
// page, so a last part smaller than 2 MB stays in 4 KB pages: no memory is wasted. Elsewhere (or
// if the mapping fails) an ordinary tensor.
torch::Tensor huge_zeros(at::IntArrayRef sizes) {
  const auto options = torch::TensorOptions().dtype(torch::kFloat32);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr size_t HUGE = size_t(2) << 20, PAGE = 4096;
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const size_t bytes = (numel * sizeof(float) + PAGE - 1) / PAGE * PAGE;
  if (bytes >= HUGE) {
    void* map = mmap(nullptr, bytes + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map != MAP_FAILED) {
      char* start = static_cast<char*>(map);
      char* aligned = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(start) + HUGE - 1) / HUGE * HUGE);
      if (aligned > start) munmap(start, aligned - start);  // the slack before the boundary...
      char* end = aligned + bytes;
      if (start + bytes + HUGE > end) munmap(end, start + bytes + HUGE - end);  // ...and after the tensor
      madvise(aligned, bytes, MADV_HUGEPAGE);  // a hint: without it (THP off), 4 KB pages as usual
      return torch::from_blob(aligned, sizes, [bytes](void* p) { munmap(p, bytes); }, options);
    }
  }
#endif
  return torch::zeros(sizes, options);
}

// W (out, in) -> (panels, in, C * VW), zero-padded to whole panels of C vectors (`panel_vectors`):
// a panel is read front to back, its outputs' weights for one input k side by side.
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.is_cpu(), "pack: a (out, in) float32 weight on the CPU");
  const int64_t out = w.size(0), in = w.size(1), width = panel_vectors(out) * VW, panels = (out + width - 1) / width;
  auto packed = huge_zeros({panels, in, width});  // the padding's outputs stay zero
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t rows = std::min<int64_t>(width, out - p * width);
    packed[p].narrow(1, 0, rows).copy_(w.narrow(0, p * width, rows).t());
  }
  return packed;
}

// How far ahead (in k-steps of a panel) a product of one block of rows with software prefetch asks
// for its weights. On an Intel Xeon (AMX) the hardware prefetchers alone left a product of a few
// rows paying for its arithmetic on top of its reads; asking 16 k-steps ahead (a few KB of the
// panel) made a few-token forward faster. On an AMD EPYC the same prefetch made every product
// slower (docs/performance.md), so it is a kernel setting chosen by timing
// (`kernels=fused_prefetch`), not built in.
constexpr int64_t PREFETCH_K = 16;

// The bytes of a panel that a product of more rows than one block reads at a time: every block of
// rows goes through these k-steps (the first from L2 or memory, the others from L1) before the next
// ones are read. A block at a time through the whole panel left the memory idle while the second
// and later blocks re-read the panel from L2: 16 rows cost 1.77-1.85 one-row steps on the Xeon.
constexpr int64_t CHUNK_BYTES = 16384;

// R rows of x against k-steps [k0, k1) of one panel of C vectors of outputs:
// acc[r][c] += x[r, k] * W[k, c] for each k in turn. PF: prefetch `count` k-steps of the panel from
// `ahead` on (past the panel's end: the next one's or nowhere, a prefetch never faults), one k-step's
// C lines every `every` steps, into L1 or (TO_L2) into L2.
template <int R, int C, bool PF, bool TO_L2 = false>
static inline void panel_steps(const float* __restrict P, const float* __restrict x, int64_t in, int64_t k0,
                               int64_t k1, vec (&acc)[R][4], int64_t ahead, int64_t every = 1,
                               int64_t count = INT64_MAX) {
  const float* ask = P + ahead * C * VW;
  int64_t wait = every;
  for (int64_t k = k0; k < k1; ++k) {
    const float* p = P + k * C * VW;
    if (PF && count > 0 && --wait == 0) {
      for (int c = 0; c < C; ++c) {
        const char* line = reinterpret_cast<const char*>(ask + c * VW);
        if (TO_L2)
          _mm_prefetch(line, _MM_HINT_T1);
        else
          _mm_prefetch(line, _MM_HINT_T0);
      }
      ask += C * VW;
      wait = every;
      --count;
    }
    vec w0 = vload(p), w1 = C > 1 ? vload(p + VW) : w0, w2 = C > 2 ? vload(p + 2 * VW) : w0;
    vec w3 = C > 3 ? vload(p + 3 * VW) : w0;
    KEEP_IN_REGISTERS(w0, w1, w2, w3);
    for (int r = 0; r < R; ++r) {
      vec xv = vset1(x[r * in + k]);
      acc[r][0] = vfma(w0, xv, acc[r][0]);
      if (C > 1) acc[r][1] = vfma(w1, xv, acc[r][1]);
      if (C > 2) acc[r][2] = vfma(w2, xv, acc[r][2]);
      if (C > 3) acc[r][3] = vfma(w3, xv, acc[r][3]);
    }
  }
}

// One row's sums (`width` floats) out: y[j] (+)= sums[j] (+ bias[j])
static inline void store_row(const float* sums, float* y, int width, const float* bias, bool accumulate) {
  for (int j = 0; j < width; ++j) {
    float v = bias ? sums[j] + bias[j] : sums[j];
    y[j] = accumulate ? y[j] + v : v;
  }
}

// R rows of x against one whole panel in one pass: y[r, 0..width) (+)= x[r] . W[j] (+ bias[j])
template <int R, int C, bool PF>
static inline void panel_rows(const float* __restrict P, const float* __restrict x, int64_t in,
                              float* __restrict y, int64_t ldy, int width, const float* bias, bool accumulate) {
  vec acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();
  panel_steps<R, C, PF>(P, x, in, 0, in, acc, PREFETCH_K);
  for (int r = 0; r < R; ++r) {
    alignas(64) float buf[PW];
    for (int c = 0; c < C; ++c) vstore(buf + c * VW, acc[r][c]);
    store_row(buf, y + r * ldy, width, bias, accumulate);
  }
}

// R rows of x against k-steps [k0, k1) of one panel, their accumulators kept between chunks in
// `sums` (R x C vectors; spilled and reloaded, each output's FMA chain is the same)
template <int R, int C, bool PF>
static inline void panel_chunk(const float* P, const float* x, int64_t in, int64_t k0, int64_t k1, float* sums,
                               int64_t ahead, int64_t every, int64_t count) {
  vec acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = k0 == 0 ? vzero() : vload(sums + (r * C + c) * VW);
  panel_steps<R, C, PF, true>(P, x, in, k0, k1, acc, ahead, every, count);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) vstore(sums + (r * C + c) * VW, acc[r][c]);
}

// All n rows against C vectors of one panel: up to one block (`block_rows`) in one pass; more in
// blocks a chunk of CHUNK_BYTES at a time, their sums in `sums` (n x C vectors). Each row's sums are
// the same whatever its block and however the steps are chunked.
template <int C, bool PF>
static void panel_all_rows(const float* P, const float* x, int64_t n, int64_t in, float* y, int64_t ldy, int width,
                           const float* bias, bool accumulate, float* sums) {
  constexpr int RB = block_rows<C>();
  if (n <= RB) {
    with_rows<RB>(n, [&](auto rows) { panel_rows<decltype(rows)::value, C, PF>(P, x, in, y, ldy, width, bias, accumulate); });
    return;
  }
  const int64_t steps = std::max<int64_t>(1, CHUNK_BYTES / (C * VW * (int64_t)sizeof(float)));
  // while the blocks go through one chunk, each asks for its share of the next one's k-steps, spread
  // over its own steps and into L2: the memory streams the next chunk for as long as the arithmetic
  // lasts. Chunks whose first block alone asked for the next one, into L1, were no faster than one
  // block at a time.
  const int64_t blocks = (n + RB - 1) / RB;
  for (int64_t k0 = 0; k0 < in; k0 += steps) {
    const int64_t k1 = std::min(in, k0 + steps);
    // the next chunk: this panel's, or after its last, the next panel's first (it follows in memory)
    const int64_t next = k1 < in ? std::min(steps, in - k1) : std::min(steps, in);
    const int64_t share = (next + blocks - 1) / blocks;
    for (int64_t i = 0, b = 0; i < n; i += RB, ++b) {
      const int64_t count = std::max<int64_t>(0, std::min(share, next - b * share));  // the steps block b asks for
      const int64_t every = std::max<int64_t>(1, (k1 - k0) / std::max<int64_t>(1, count));
      with_rows<RB>(std::min<int64_t>(RB, n - i), [&](auto rows) {
        panel_chunk<decltype(rows)::value, C, PF>(P, x + i * in, in, k0, k1, sums + i * C * VW, k1 + b * share,
                                                   every, count);
      });
    }
  }
  for (int64_t i = 0; i < n; ++i) store_row(sums + i * C * VW, y + i * ldy, width, bias, accumulate);
}

// y (n, ldy) (+)= x (n, in) @ W^T (+ bias), W packed by `pack` (panels, in, C * VW) with `out` real outputs;
// prefetch: ask for the weights ahead in software too (`PREFETCH_K`); the same floats either way
static void gemm(const torch::Tensor& packed, const float* x, int64_t n, int64_t in, int64_t out, float* y,
                 int64_t ldy, const float* bias, bool accumulate, bool prefetch) {
  const float* P = packed.data_ptr<float>();
  const int64_t panels = packed.size(0), pw = packed.size(2), vectors = pw / VW;
  TORCH_CHECK(packed.size(1) == in && pw % VW == 0 && vectors <= 4 && panels * pw >= out,
              "gemm: a weight packed by pack() for ", out, " outputs of ", in, " inputs");
  // every weight split over the threads, the smallest too: one thread reads a 2 MB weight at half
  // the memory's speed, and a parallel region costs a few microseconds
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    // the sums of more rows than a block (the smaller one), left uninitialized: a chunk from k = 0
    // starts them at zero
    std::unique_ptr<float[]> sums(n > block_rows<4>() ? new float[n * vectors * VW] : nullptr);
    float* s = sums.get();
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = P + p * in * pw;
      const int width = (int)std::min<int64_t>(pw, out - p * pw);
      const float* b = bias ? bias + p * pw : nullptr;
      float* yp = y + p * pw;
      switch (vectors * 2 + prefetch) {
        case 8: panel_all_rows<4, false>(panel, x, n, in, yp, ldy, width, b, accumulate, s); break;
        case 9: panel_all_rows<4, true>(panel, x, n, in, yp, ldy, width, b, accumulate, s); break;
        case 4: panel_all_rows<2, false>(panel, x, n, in, yp, ldy, width, b, accumulate, s); break;
        case 5: panel_all_rows<2, true>(panel, x, n, in, yp, ldy, width, b, accumulate, s); break;
        default: TORCH_CHECK(false, "gemm: panels of 2 or 4 vectors");
      }
    }
  });
}

// A bias or a norm's weight: n contiguous float32 values on the CPU (the loops read n floats from its
// first), or none (nullptr)
static const float* opt_ptr(const c10::optional<torch::Tensor>& t, int64_t n, const char* what) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_cpu() && t->is_contiguous() && t->numel() == n,
              what, ": a contiguous float32 vector of ", n, " on the CPU, not ", t->sizes(), " ", t->scalar_type());
  return t->data_ptr<float>();
}

// x (..., in) -> (..., out)
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t out, c10::optional<torch::Tensor> bias,
                     bool prefetch) {
  const int64_t in = x.size(-1);
  TORCH_CHECK(packed.size(1) == in, "linear: input width ", in, " != the weight's ", packed.size(1));
  auto xc = x.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = out;
  auto y = torch::empty(sizes, x.options());
  gemm(packed, xc.data_ptr<float>(), xc.numel() / in, in, out, y.data_ptr<float>(), out,
       opt_ptr(bias, out, "linear's bias"), false, prefetch);
  return y;
}

// y = w * x / sqrt(mean(x^2) + eps), row by row (w empty: no norm, y = x)
static void rmsnorm(const float* x, const float* w, float eps, float* y, int64_t n, int64_t d) {
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x + i * d;
    float* yi = y + i * d;
    if (!w) { std::memcpy(yi, xi, d * sizeof(float)); continue; }
    vec acc = vzero();  // the sum of squares a vector at a time, then across its lanes
    int64_t k = 0;
    for (; k + VW <= d; k += VW) {
      const vec v = vload(xi + k);
      acc = vfma(v, v, acc);
    }
    float ss = vsum(acc);
    for (; k < d; ++k) ss += xi[k] * xi[k];
    const float r = 1.f / std::sqrt(ss / d + eps);
    for (int64_t k = 0; k < d; ++k) yi[k] = w[k] * (xi[k] * r);
  }
}

// A model's final norm, x (..., d) -> (..., d), as `rmsnorm` runs the layers' norms (PyTorch's six
// operations on one row are slow after the weights have evicted their code and data from the
// caches)
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  const int64_t d = x.size(-1);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32 && w.numel() == d,
              "rms_norm: float32 x (..., d) and a weight of d floats");
  auto xc = x.contiguous(), wc = w.contiguous();
  auto y = torch::empty_like(xc);
  rmsnorm(xc.data_ptr<float>(), wc.data_ptr<float>(), (float)eps, y.data_ptr<float>(), xc.numel() / d, d);
  return y;
}

// rotary embedding of one head in place: Hugging Face's rotate_half pairs (k, k + hd/2)
static void rope(float* v, const float* cos, const float* sin, int64_t hd) {
  const int64_t h2 = hd / 2;
  for (int64_t k = 0; k < h2; ++k) {
    const float a = v[k], b = v[k + h2];
    v[k] = a * cos[k] - b * sin[k];
    v[k + h2] = b * cos[k + h2] + a * sin[k + h2];
  }
}

// The attention's inputs of n new tokens of B sequences: norm, q/k/v in one product, each head's
// q and k RMSNorm (Qwen3; q_norm and k_norm of hd floats, or none), rotary embedding.
// x (B, n, d); cos, sin (B or 1, n, hd) -> q (B, heads, n, hd), k and v (B, kv_heads, n, hd)
std::vector<torch::Tensor> attention_inputs(torch::Tensor x, c10::optional<torch::Tensor> norm_w, double eps,
                                            torch::Tensor packed_qkv, c10::optional<torch::Tensor> bias_qkv,
                                            torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t kv_heads,
                                            int64_t hd, c10::optional<torch::Tensor> q_norm,
                                            c10::optional<torch::Tensor> k_norm, double eps_qk, bool prefetch) {
  const int64_t B = x.size(0), n = x.size(1), d = x.size(2), rows = B * n;
  const int64_t qd = heads * hd, kd = kv_heads * hd, width = qd + 2 * kd;
  auto xc = x.contiguous();
  auto c = cos.contiguous(), s = sin.contiguous();
  const int64_t cos_batch = c.size(0) == 1 ? 0 : 1;  // one rotation for every sequence, or one each
  auto h = torch::empty({rows, d}, x.options());
  rmsnorm(xc.data_ptr<float>(), opt_ptr(norm_w, d, "attention_inputs' norm"), (float)eps, h.data_ptr<float>(), rows, d);
  auto qkv = torch::empty({rows, width}, x.options());
  gemm(packed_qkv, h.data_ptr<float>(), rows, d, width, qkv.data_ptr<float>(), width,
       opt_ptr(bias_qkv, width, "attention_inputs' q/k/v bias"), false, prefetch);
  auto q = torch::empty({B, heads, n, hd}, x.options());
  auto k = torch::empty({B, kv_heads, n, hd}, x.options());
  auto v = torch::empty({B, kv_heads, n, hd}, x.options());
  float *Q = q.data_ptr<float>(), *K = k.data_ptr<float>(), *V = v.data_ptr<float>(), *QKV = qkv.data_ptr<float>();
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value() &&
              (!q_norm || (q_norm->numel() == hd && k_norm->numel() == hd && q_norm->is_contiguous() &&
                           k_norm->is_contiguous() && q_norm->scalar_type() == torch::kFloat32 &&
                           k_norm->scalar_type() == torch::kFloat32)),
              "attention_inputs: both q/k norms of head_dim float32 weights, or neither");
  const float* qn = opt_ptr(q_norm, hd, "q_norm");
  const float* kn = opt_ptr(k_norm, hd, "k_norm");
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i) {
      const float* row = QKV + (b * n + i) * width;
      const float* ci = c.data_ptr<float>() + (cos_batch * b * n + i) * hd;
      const float* si = s.data_ptr<float>() + (cos_batch * b * n + i) * hd;
      for (int64_t g = 0; g < heads; ++g) {
        float* dst = Q + ((b * heads + g) * n + i) * hd;
        std::memcpy(dst, row + g * hd, hd * sizeof(float));
        if (qn) rmsnorm(dst, qn, (float)eps_qk, dst, 1, hd);  // in place: each float read before it is written
        rope(dst, ci, si, hd);
      }
      for (int64_t g = 0; g < kv_heads; ++g) {
        float* dk = K + ((b * kv_heads + g) * n + i) * hd;
        std::memcpy(dk, row + qd + g * hd, hd * sizeof(float));
        if (kn) rmsnorm(dk, kn, (float)eps_qk, dk, 1, hd);
        rope(dk, ci, si, hd);
        std::memcpy(V + ((b * kv_heads + g) * n + i) * hd, row + qd + kd + g * hd, hd * sizeof(float));
      }
    }
  return {q, k, v};
}

// o[e] (hd floats each, e < H, side by side) = sum over the m seen slots, in slot order, of
// p[e][j] * V[seen[j]]: the values of H heads of one group, each vector loaded once for all H;
// every output lane is its own FMA chain in slot order (the same floats as one head at a time),
// and BV x H chains run side by side (one head's alone are bound by the FMA's latency)
template <int H, int BV>
static void weighted_values(const float* p, int64_t pstride, const int64_t* seen, int64_t m, const float* Vg,
                            int64_t vs2, int64_t hd, int64_t hv, float* o) {
  int64_t k = 0;
  for (; k + BV * VW <= hv; k += BV * VW) {
    vec acc[H][BV];
    for (int e = 0; e < H; ++e)
      for (int c = 0; c < BV; ++c) acc[e][c] = vzero();
    for (int64_t j = 0; j < m; ++j) {
      const float* vj = Vg + seen[j] * vs2 + k;
      vec v[BV];
      for (int c = 0; c < BV; ++c) v[c] = vload(vj + c * VW);
      for (int e = 0; e < H; ++e) {
        const vec pe = vset1(p[e * pstride + j]);
        for (int c = 0; c < BV; ++c) acc[e][c] = vfma(pe, v[c], acc[e][c]);
      }
    }
    for (int e = 0; e < H; ++e)
      for (int c = 0; c < BV; ++c) vstore(o + e * hd + k + c * VW, acc[e][c]);
  }
  for (; k < hv; k += VW) {
    vec acc[H];
    for (int e = 0; e < H; ++e) acc[e] = vzero();
    for (int64_t j = 0; j < m; ++j) {
      const vec v = vload(Vg + seen[j] * vs2 + k);
      for (int e = 0; e < H; ++e) acc[e] = vfma(vset1(p[e * pstride + j]), v, acc[e]);
    }
    for (int e = 0; e < H; ++e) vstore(o + e * hd + k, acc[e]);
  }
  for (k = hv; k < hd; ++k)
    for (int e = 0; e < H; ++e) {
      float acc = 0.f;
      for (int64_t j = 0; j < m; ++j) acc += p[e * pstride + j] * Vg[seen[j] * vs2 + k];
      o[e * hd + k] = acc;
    }
}

// the registers hold BV x H accumulators, BV value vectors and a broadcast: 4 x 4 + 5 of AVX-512's
// 32; AVX2's 16 take 4 x 1 + 5, or 2 x 3 + 3
template <int H>
static void weighted_values(const float* p, int64_t pstride, const int64_t* seen, int64_t m, const float* Vg,
                            int64_t vs2, int64_t hd, int64_t hv, float* o) {
  constexpr int BV = VW == 16 || H == 1 ? 4 : 2;
  weighted_values<H, BV>(p, pstride, seen, m, Vg, vs2, hd, hv, o);
}

// The slots a row sees, in slot order, into seen[], each one's additive mask into add[]; returns how
// many. Causal: slots 0..last. A mask row (stride `step` between slots): a bool mask's true slots, or
// a float mask's slots above -FLT_MAX/2. A run of VW seen slots (a committed prefix is one long run)
// is taken in one vector test; a slot at a time only where a run holds masked slots.
static int64_t causal_slots(int64_t last, float* add, int64_t* seen) {
  for (int64_t t = 0; t <= last; ++t) add[t] = 0.f, seen[t] = t;
  return last + 1;
}

static int64_t seen_slots(const float* mask, int64_t L, int64_t step, float* add, int64_t* seen) {
  const float skip = -FLT_MAX / 2;
  int64_t m = 0, t = 0;
  if (step == 1)
    for (; t + VW <= L; t += VW) {
      const vec a = vload(mask + t);
      if (vall_above(a, skip)) {
        vstore(add + m, a);
        for (int u = 0; u < VW; ++u) seen[m + u] = t + u;
        m += VW;
      } else {
        for (int u = 0; u < VW; ++u)
          if (!(mask[t + u] <= skip)) add[m] = mask[t + u], seen[m++] = t + u;
      }
    }
  for (; t < L; ++t)
    if (!(mask[t * step] <= skip)) add[m] = mask[t * step], seen[m++] = t;
  return m;
}

static int64_t seen_slots(const bool* mask, int64_t L, int64_t step, float* add, int64_t* seen) {
  int64_t m = 0, t = 0;
  if (step == 1)
    for (; t + 8 <= L; t += 8) {
      uint64_t run;
      std::memcpy(&run, mask + t, 8);
      if (run == 0x0101010101010101ull) {  // 8 true bools
        for (int u = 0; u < 8; ++u) add[m + u] = 0.f, seen[m + u] = t + u;
        m += 8;
      } else {
        for (int u = 0; u < 8; ++u)
          if (mask[t + u]) add[m] = 0.f, seen[m++] = t + u;
      }
    }
  for (; t < L; ++t)
    if (mask[t * step]) add[m] = 0.f, seen[m++] = t;
  return m;
}

// s[e][j] = fma(q[e] . K[seen[j]], sc, s[0][j]) for the H heads of a group (head e's query at q + e *
// qstride, its scores at s + e * sstride; s[0][j] holds slot seen[j]'s additive mask on entry). A dot
// product is one FMA chain over the head dim's whole vectors, the horizontal sum of its lanes (vsum's
// tree), then the rest of the head dim a float at a time. VW keys at a time, their VW horizontal sums
// come out of one transposing tree (`vsum_lanes`: ~3 instructions a key instead of ~9), the same
// floats as each key's vsum; the last m % VW keys one at a time. A key's score is thus the same
// whatever its job holds: it depends only on its place in its row's seen slots.
template <int H>
static void key_scores(const float* q, int64_t qstride, const float* Kg, int64_t ks2, const int64_t* seen,
                       int64_t m, int64_t hd, int64_t hv, float sc, float* s, int64_t sstride) {
  const vec vsc = vset1(sc);
  int64_t j = 0;
  for (; j + VW <= m; j += VW) {
    const float* kt[VW];  // chain c holds key j + KEY_SLOT[c], so that lane c of vsum_lanes is key j + c
    for (int c = 0; c < VW; ++c) kt[c] = Kg + seen[j + KEY_SLOT[c]] * ks2;
    const vec add = vload(s + j);
    for (int e = 0; e < H; ++e) {
      const float* qe = q + e * qstride;
      vec a[VW];
      for (int c = 0; c < VW; ++c) a[c] = vzero();
      for (int64_t k = 0; k < hv; k += VW) {
        const vec qk = vload(qe + k);
        for (int c = 0; c < VW; ++c) a[c] = vfma(qk, vload(kt[c] + k), a[c]);
      }
      vec d = vsum_lanes(a);
      if (hv < hd) {
        alignas(64) float dots[VW];
        vstore(dots, d);
        for (int c = 0; c < VW; ++c) {
          const float* key = kt[KEY_SLOT[c]];  // key j + c (KEY_SLOT is its own inverse)
          for (int64_t k = hv; k < hd; ++k) dots[c] = std::fma(qe[k], key[k], dots[c]);
        }
        d = vload(dots);
      }
      vstore(s + e * sstride + j, vfma(d, vsc, add));
    }
  }
  for (; j < m; ++j) {
    const float* kt = Kg + seen[j] * ks2;
    const float add = s[j];
    for (int e = 0; e < H; ++e) {
      const float* qe = q + e * qstride;
      vec a = vzero();
      for (int64_t k = 0; k < hv; k += VW) a = vfma(vload(qe + k), vload(kt + k), a);
      float d = vsum(a);
      for (int64_t k = hv; k < hd; ++k) d = std::fma(qe[k], kt[k], d);
      s[e * sstride + j] = std::fma(d, sc, add);
    }
  }
}

// s[0..m) -> softmax(s), in whole vectors (s has room up to the next multiple of VW): the maximum is
// exact in any order; the sum is VW lanes' sums in slot order, then their horizontal sum, so it
// depends only on the row's seen scores, like everything else here
static void softmax(float* s, int64_t m) {
  const int64_t mv = (m + VW - 1) / VW * VW;
  for (int64_t j = m; j < mv; ++j) s[j] = -INFINITY;  // the padding loses every maximum
  vec top = vset1(-INFINITY);
  for (int64_t j = 0; j < mv; j += VW) top = vmax(top, vload(s + j));
  const vec neg_top = vset1(-vmax_lanes(top));  // score + (-top): the same float as score - top
  for (int64_t j = 0; j < mv; j += VW) vstore(s + j, vexp(vadd(vload(s + j), neg_top)));
  for (int64_t j = m; j < mv; ++j) s[j] = 0.f;  // and adds nothing to the sum
  vec z = vzero();
  for (int64_t j = 0; j < mv; j += VW) z = vadd(z, vload(s + j));
  const vec vz = vset1(vsum(z));  // IEEE division: a vector's quotients are the scalar ones
  for (int64_t j = 0; j < mv; j += VW) vstore(s + j, vdiv(vload(s + j), vz));
}

// One job's attention, H heads of a group (a compile-time count, so that their loops unroll): the
// scores of its m seen slots (s[0..m) holds their additive mask on entry; head e's row at s + e *
// sstride), their softmax, and the heads' outputs side by side at o
template <int H>
static void attend(const float* q, int64_t qstride, const float* Kg, int64_t ks2, const float* Vg, int64_t vs2,
                   const int64_t* seen, int64_t m, int64_t hd, int64_t hv, float sc, float* s, int64_t sstride, float* o) {
  key_scores<H>(q, qstride, Kg, ks2, seen, m, hd, hv, sc, s, sstride);
  for (int e = 0; e < H; ++e) softmax(s + e * sstride, m);  // the probabilities
  weighted_values<H>(s, sstride, seen, m, Vg, vs2, hd, hv, o);
}

// The rest of a decoder layer: attention over the cache, o_proj and the residual, norm, the gated
// MLP (SiLU) and its residual. x (B, n, d); q (B, heads, n, hd); keys, values (B, kv_heads, L, hd)
// (any strides but the last); mask: none (causal: row i sees slots 0..L-n+i), bool (B or 1, 1, n, L)
// (true: seen) or additive float (a slot at or below -FLT_MAX/2 is skipped). -> (B, n, d)
torch::Tensor attention_mlp(torch::Tensor x, torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                            c10::optional<torch::Tensor> mask, double scaling, torch::Tensor packed_o,
                            c10::optional<torch::Tensor> bias_o, torch::Tensor norm_w, double eps,
                            torch::Tensor packed_gate_up, int64_t inter, torch::Tensor packed_down,
                            c10::optional<torch::Tensor> bias_gate_up, c10::optional<torch::Tensor> bias_down,
                            bool prefetch) {
  const int64_t B = x.size(0), n = x.size(1), d = x.size(2), rows = B * n, heads = q.size(1), hd = q.size(3);
  const int64_t kv_heads = keys.size(1), L = keys.size(2), group = heads / kv_heads;
  TORCH_CHECK(keys.size(0) == B && values.size(0) == B, "attention_mlp: keys and values for ", B, " sequences");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "attention_mlp: keys and values need a unit last stride");
  const int64_t hv = hd / VW * VW;  // the head dim's whole vectors; the rest one float at a time
  auto out = x.contiguous().clone().view({rows, d});  // the residual stream, updated in place
  auto Qc = q.contiguous();
  const float *Q = Qc.data_ptr<float>(), *K = keys.data_ptr<float>(), *V = values.data_ptr<float>();
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), ks2 = keys.stride(2);
  const int64_t vs0 = values.stride(0), vs1 = values.stride(1), vs2 = values.stride(2);
  const bool has_mask = mask.has_value() && mask->defined();
  const bool bool_mask = has_mask && mask->scalar_type() == torch::kBool;
  TORCH_CHECK(!has_mask || bool_mask || mask->scalar_type() == torch::kFloat32, "attention_mlp: a bool or float32 mask");
  TORCH_CHECK(!has_mask || (mask->dim() == 4 && (mask->size(0) == B || mask->size(0) == 1) && mask->size(1) == 1 && mask->size(2) == n
                            && mask->size(3) >= L), "attention_mlp: a (B or 1, 1, n, L) mask");
  const int64_t ms0 = has_mask && mask->size(0) > 1 ? mask->stride(0) : 0;
  const int64_t ms2 = has_mask ? mask->stride(2) : 0, ms3 = has_mask ? mask->stride(3) : 0;
  const float* MF = has_mask && !bool_mask ? mask->data_ptr<float>() : nullptr;
  const bool* MB = bool_mask ? mask->data_ptr<bool>() : nullptr;
  const float sc = (float)scaling;
  auto att = torch::empty({rows, heads * hd}, x.options());
  float* A = att.data_ptr<float>();
  // Each job: one row and up to 4 heads of one key/value group (GQA: the group's heads read the same
  // keys and values under the same mask): the seen slots found once, each key and value vector read
  // once for all of them, with 4 x heads FMA chains side by side (one head's 4 are bound by the FMA's
  // latency). With a few new tokens the layers ran faster than with one head a job. A few jobs
  // (a 1-token step's: one per group) keep one head each, so that the threads share
  // them evenly. The jobs go group by group, so that each thread reads the keys and values of about
  // kv_heads / threads groups, not of every group (a layer's come from memory: the weights' stream has
  // evicted them), which made the attention of a few new tokens faster. The work is scheduled for
  // throughput without changing any float: a key's score is the same FMA chain and horizontal sum
  // whether it runs alone or beside others, a head's softmax depends only on its own scores, and each
  // output lane sums its values in slot order, so every head's result is bitwise the same whatever
  // its job holds (the exactness above does not depend on the schedule).
  const int64_t hc = rows * kv_heads >= 4 * at::get_num_threads() ? std::min<int64_t>(group, 4) : 1;
  const int64_t chunks = (group + hc - 1) / hc;  // jobs per row and group
  at::parallel_for(0, rows * kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(4 * (L + VW));  // whole vectors for the softmax
    std::vector<int64_t> seen(L);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t g = job / (rows * chunks), r = job / chunks % rows, c = job % chunks;
      const int64_t b = r / n, i = r % n, h0 = g * group + c * hc, H = std::min<int64_t>(hc, group - c * hc);
      const float* Kg = K + b * ks0 + g * ks1;
      const float* Vg = V + b * vs0 + g * vs1;
      const int64_t mrow = b * ms0 + i * ms2;
      const int64_t m = !has_mask ? causal_slots(L - n + i, scores.data(), seen.data())
                        : bool_mask ? seen_slots(MB + mrow, L, ms3, scores.data(), seen.data())
                                    : seen_slots(MF + mrow, L, ms3, scores.data(), seen.data());
      const float* q0 = Q + ((b * heads + h0) * n + i) * hd;  // head h0 + e's query at q0 + e * n * hd
      float* o = A + (b * n + i) * heads * hd + h0 * hd;  // the H heads' outputs, side by side
      switch (H) {
        case 4: attend<4>(q0, n * hd, Kg, ks2, Vg, vs2, seen.data(), m, hd, hv, sc, scores.data(), L + VW, o); break;
        case 3: attend<3>(q0, n * hd, Kg, ks2, Vg, vs2, seen.data(), m, hd, hv, sc, scores.data(), L + VW, o); break;
        case 2: attend<2>(q0, n * hd, Kg, ks2, Vg, vs2, seen.data(), m, hd, hv, sc, scores.data(), L + VW, o); break;
        default: attend<1>(q0, n * hd, Kg, ks2, Vg, vs2, seen.data(), m, hd, hv, sc, scores.data(), L + VW, o); break;
      }
    }
  });
  float* X = out.data_ptr<float>();
  gemm(packed_o, A, rows, heads * hd, d, X, d, opt_ptr(bias_o, d, "o_proj's bias"), true, prefetch);
  auto h = torch::empty({rows, d}, x.options());
  rmsnorm(X, opt_ptr(norm_w, d, "attention_mlp's norm"), (float)eps, h.data_ptr<float>(), rows, d);
  auto gu = torch::empty({rows, 2 * inter}, x.options());
  gemm(packed_gate_up, h.data_ptr<float>(), rows, d, 2 * inter, gu.data_ptr<float>(), 2 * inter,
       opt_ptr(bias_gate_up, 2 * inter, "gate/up bias"), false, prefetch);
  auto act = torch::empty({rows, inter}, x.options());
  float *GU = gu.data_ptr<float>(), *ACT = act.data_ptr<float>();
  // SiLU(gate) * up, a vector at a time (vexp: with the norms' sums of squares, also vectors now,
  // std::exp one float at a time cost a visible share of a step); e^-g is capped at e^88, where
  // g / (1 + e^-g) is within 1e-36 of 0
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / inter), [&](int64_t begin, int64_t end) {
    const vec one = vset1(1.f), cap = vset1(88.f);
    for (int64_t i = begin; i < end; ++i) {
      const float *G = GU + i * 2 * inter, *U = G + inter;
      float* act = ACT + i * inter;
      int64_t k = 0;
      for (; k + VW <= inter; k += VW) {
        const vec g = vload(G + k);
        vstore(act + k, vmul(vdiv(g, vadd(one, vexp(vmin(vsub(vzero(), g), cap)))), vload(U + k)));
      }
      for (; k < inter; ++k) act[k] = G[k] / (1.f + std::exp(-G[k])) * U[k];
    }
  });
  gemm(packed_down, ACT, rows, inter, d, X, d, opt_ptr(bias_down, d, "down_proj's bias"), true, prefetch);
  return out.view({B, n, d});
}

// Whether every parameter is still what it was when its layer was packed: `owners[i][names[i]]` (a
// module's parameter dict) is the object `tensors[i]` (None stays None), with the storage and the
// version (0 for an inference tensor, which keeps none) recorded in `keys` (2 int64 per entry). One
// call checks every layer of a model before a forward: the same check in Python costs tens of
// microseconds a layer inside a forward, whose weights have just evicted everything else from the
// caches.
bool unchanged(py::list owners, py::list names, py::list tensors, torch::Tensor keys) {
  const size_t n = owners.size();
  TORCH_CHECK(names.size() == n && tensors.size() == n && keys.scalar_type() == torch::kInt64 &&
              keys.is_contiguous() && (size_t)keys.numel() == 2 * n, "unchanged: one name, tensor and 2 keys per owner");
  const int64_t* key = keys.data_ptr<int64_t>();
  for (size_t i = 0; i < n; ++i) {
    PyObject* now = PyDict_GetItem(owners[i].ptr(), names[i].ptr());  // borrowed; NULL: no longer there
    if (now != tensors[i].ptr()) return false;
    if (now == Py_None) continue;
    const torch::Tensor t = py::cast<torch::Tensor>(py::handle(now));
    const int64_t version = t.is_inference() ? 0 : (int64_t)t._version();
    if (version != key[2 * i] || reinterpret_cast<int64_t>(t.data_ptr()) != key[2 * i + 1]) return false;
  }
  return true;
}

// The entries at slots `src` (increasing, src[i] >= dst + i) of each tensor (B, H, T, D), any dtype,
// D contiguous, moved to slots dst, dst + 1, ...: a tree verification's accepted path next to the
// committed prefix in every layer's keys and values (kv_cache.keep_path, through the fused
// backend's move_slots), one call instead of a gather and a write per tensor. In slot order, so a
// move never overwrites an entry still to be moved.
void move_slots(std::vector<torch::Tensor> tensors, std::vector<int64_t> src, int64_t dst) {
  for (size_t i = 0; i < src.size(); ++i)
    TORCH_CHECK(src[i] >= dst + (int64_t)i && (i == 0 || src[i] > src[i - 1]), "move_slots: increasing slots from ", dst, " on");
  for (const auto& t : tensors) {
    TORCH_CHECK(t.dim() == 4 && t.stride(3) == 1 && t.device().is_cpu(), "move_slots: CPU tensors (B, H, T, D), D contiguous");
    TORCH_CHECK(src.empty() || src.back() < t.size(2), "move_slots: slot ", src.back(), " outside ", t.size(2));
    const int64_t es = t.element_size(), bytes = t.size(3) * es;
    char* base = static_cast<char*>(t.data_ptr());
    for (size_t i = 0; i < src.size(); ++i) {
      if (src[i] == dst + (int64_t)i) continue;
      for (int64_t b = 0; b < t.size(0); ++b)
        for (int64_t h = 0; h < t.size(1); ++h) {
          const int64_t row = b * t.stride(0) + h * t.stride(1);
          std::memcpy(base + (row + (dst + i) * t.stride(2)) * es, base + (row + src[i] * t.stride(2)) * es, bytes);
        }
    }
  }
}

// One decoder layer's packed weights and sizes (fused.py's `FusedLayer.packed()`)
struct LayerWeights {
  torch::Tensor qkv, o, gate_up, down, norm2;
  c10::optional<torch::Tensor> norm1, qkv_bias, o_bias, gate_up_bias, down_bias, q_norm, k_norm;
  double eps1, eps2, scaling, eps_qk;
  int64_t heads, kv_heads, hd, inter;
};

static c10::optional<torch::Tensor> opt_tensor(const py::dict& d, const char* key) {
  py::object v = d[key];
  if (v.is_none()) return c10::nullopt;
  return py::cast<torch::Tensor>(v);
}

// The new keys or values k (B, H, n, hd) written into a cache buffer (B, H, capacity, hd) at slots
// (n,) for every sequence or (B, n) one row each: what `cache.update` does, without a call out
static void write_slots(torch::Tensor& buf, const torch::Tensor& k, const torch::Tensor& slots) {
  const int64_t B = k.size(0), H = k.size(1), n = k.size(2), hd = k.size(3), capacity = buf.size(2);
  TORCH_CHECK(buf.scalar_type() == torch::kFloat32 && buf.dim() == 4 && buf.size(0) == B && buf.size(1) == H &&
              buf.size(3) == hd && buf.stride(3) == 1, "layers: a float32 cache buffer of (", B, ", ", H, ", *, ", hd, ")");
  const bool per_row = slots.dim() == 2;
  const int64_t* S = slots.data_ptr<int64_t>();
  const float* src = k.data_ptr<float>();  // contiguous: made by attention_inputs
  float* dst = buf.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < n; ++j) {
      const int64_t slot = per_row ? S[b * n + j] : S[j];
      TORCH_CHECK(slot >= 0 && slot < capacity, "layers: slot ", slot, " outside a cache of ", capacity);
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(dst + b * buf.stride(0) + h * buf.stride(1) + slot * buf.stride(2), src + ((b * H + h) * n + j) * hd,
                    hd * sizeof(float));
    }
}

// A model's decoder layers in one call: the loop over `attention_inputs`, the cache's write and
// `attention_mlp` of each layer, for caches whose buffers the kernels may write themselves (the
// static cache's, the growing cache's). Built once from each layer's packed weights; Python's loop
// over the layers, with a call into the cache each, cost a visible share more of a small model's
// step.
class Layers {
 public:
  // prefetch: every product with software prefetch (kernels=fused_prefetch)
  Layers(py::list packed, bool prefetch) : prefetch_(prefetch) {
    for (py::handle item : packed) {
      const py::dict d = py::reinterpret_borrow<py::dict>(item);
      const py::tuple heads = d["heads"];
      layers_.push_back({py::cast<torch::Tensor>(d["qkv"]), py::cast<torch::Tensor>(d["o"]),
                         py::cast<torch::Tensor>(d["gate_up"]), py::cast<torch::Tensor>(d["down"]),
                         py::cast<torch::Tensor>(d["norm2"]), opt_tensor(d, "norm1"), opt_tensor(d, "qkv_bias"),
                         opt_tensor(d, "o_bias"), opt_tensor(d, "gate_up_bias"), opt_tensor(d, "down_bias"),
                         opt_tensor(d, "q_norm"), opt_tensor(d, "k_norm"),
                         py::cast<double>(d["eps1"]), py::cast<double>(d["eps2"]), py::cast<double>(d["scaling"]),
                         py::cast<double>(d["eps_qk"]),
                         py::cast<int64_t>(heads[0]), py::cast<int64_t>(heads[1]), py::cast<int64_t>(heads[2]),
                         py::cast<int64_t>(d["inter"])});
    }
  }

  // x (B, n, d) through every layer; keys[i], values[i] (B, kv_heads, capacity, hd): layer i's
  // cache, the new entries written at `slots` ((n,) or (B, n)), then attention over its first
  // `visible` slots under `mask` (as attention_mlp). -> (B, n, d)
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, c10::optional<torch::Tensor> mask,
                        std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values, torch::Tensor slots,
                        int64_t visible) {
    TORCH_CHECK(keys.size() == layers_.size() && values.size() == layers_.size(), "layers: one cache layer per layer");
    TORCH_CHECK(slots.size(-1) == x.size(1) && (slots.dim() == 1 || (slots.dim() == 2 && slots.size(0) == x.size(0))),
                "layers: slots (n,) or (B, n) for the n new tokens");
    slots = slots.to(torch::kInt64).contiguous();  // (a no-op for the caches' own)
    auto c = cos.to(torch::kFloat32), s = sin.to(torch::kFloat32);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const LayerWeights& w = layers_[i];
      auto qkv = attention_inputs(x, w.norm1, w.eps1, w.qkv, w.qkv_bias, c, s, w.heads, w.kv_heads, w.hd,
                                  w.q_norm, w.k_norm, w.eps_qk, prefetch_);
      write_slots(keys[i], qkv[1], slots);
      write_slots(values[i], qkv[2], slots);
      TORCH_CHECK(visible > 0 && visible <= keys[i].size(2), "layers: ", visible, " visible slots of ", keys[i].size(2));
      x = attention_mlp(x, qkv[0], keys[i].narrow(2, 0, visible), values[i].narrow(2, 0, visible), mask, w.scaling,
                        w.o, w.o_bias, w.norm2, w.eps2, w.gate_up, w.inter, w.down, w.gate_up_bias, w.down_bias,
                        prefetch_);
    }
    return x;
  }

 private:
  std::vector<LayerWeights> layers_;
  bool prefetch_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("panel_width", &panel_width);
  m.def("pack", &pack);
  m.def("huge_zeros", &huge_zeros);
  m.def("linear", &linear);
  m.def("attention_inputs", &attention_inputs);
  m.def("attention_mlp", &attention_mlp);
  m.def("rms_norm", &rms_norm);
  m.def("move_slots", &move_slots);
  m.def("unchanged", &unchanged);
  // module_local: two builds in one process (the source edited under a live session, whose next
  // load builds it again under a new name) would otherwise both register "Layers" and the second fail
  py::class_<Layers>(m, "Layers", py::module_local()).def(py::init<py::list, bool>()).def("forward", &Layers::forward);
}
