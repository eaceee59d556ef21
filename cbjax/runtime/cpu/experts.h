// A mixture of experts' matmul: each (token, expert) pair's row times its expert's matrix, the
// experts read where they lie in the stacked `[experts, N, K]` weight (an XLA gather of an expert
// copies it first, and XLA:CPU's batched dot over gathered experts ran at a tenth of the memory's
// speed: docs/cpu_kernels.md). The pairs are grouped by expert, so an expert that several pairs
// chose is read once for all of them (a decode step's batch shares experts).
#pragma once

#include <vector>

#include "matmul.h"
#include "pool.h"

namespace {

struct ExpertMatmul {
  const float* xs;  // the pairs' rows grouped by expert, [P, K]
  const float* w;   // [E, N, K]
  float* ys;        // their outputs in the same order, [P, N]
  const int64_t* group_start;  // [groups + 1]: the groups' first rows in xs
  const int32_t* group_expert;  // [groups]
  int64_t N, K, rows_per_chunk, chunks_per_group;
};

void expert_matmul_chunk(const void* context, int64_t c) {
  const ExpertMatmul& m = *static_cast<const ExpertMatmul*>(context);
  const int64_t g = c / m.chunks_per_group, part = c % m.chunks_per_group;
  const int64_t start = m.group_start[g], rows = m.group_start[g + 1] - start;
  weight_rows(m.xs + start * m.K, nullptr, m.w + static_cast<int64_t>(m.group_expert[g]) * m.N * m.K, m.ys + start * m.N,
              rows, m.N, m.K, part * m.rows_per_chunk, chunk_end(part, m.rows_per_chunk, m.N));
}

ffi::Error ExpertMatmulNT(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> experts,
                          ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions();
  const auto xd = x.dimensions();
  if (wd.size() != 3 || xd.size() != 2 || xd[1] != wd[2] || static_cast<int64_t>(experts.element_count()) != xd[0]) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "cbjax_expert_matmul_nt: x [P, K], w [E, N, K] and experts [P] expected");
  }
  const int64_t P = xd[0], E = wd[0], N = wd[1], K = wd[2];
  if (P == 0 || N == 0) return ffi::Error::Success();
  const int32_t* ids = experts.typed_data();
  // Counting sort of the pairs by expert (an expert index out of range is clamped, as XLA's gather does).
  std::vector<int64_t> count(E + 1, 0), order(P);
  auto expert_of = [&](int64_t p) { return ids[p] < 0 ? 0 : ids[p] >= E ? E - 1 : ids[p]; };
  for (int64_t p = 0; p < P; ++p) ++count[expert_of(p) + 1];
  for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];
  std::vector<int64_t> next(count.begin(), count.end() - 1);
  for (int64_t p = 0; p < P; ++p) order[next[expert_of(p)]++] = p;
  std::vector<int64_t> group_start;
  std::vector<int32_t> group_expert;
  for (int64_t e = 0; e < E; ++e) {
    if (count[e + 1] > count[e]) {
      group_start.push_back(count[e]);
      group_expert.push_back(static_cast<int32_t>(e));
    }
  }
  group_start.push_back(P);
  std::vector<float> xs(P * K), ys(P * N);
  const float* xp = x.typed_data();
  for (int64_t i = 0; i < P; ++i) std::memcpy(&xs[i * K], xp + order[i] * K, K * sizeof(float));
  const int64_t rows = rows_per_chunk_for(K, 1), per_group = chunk_count(N, rows);
  const ExpertMatmul m{xs.data(), w.typed_data(), ys.data(), group_start.data(), group_expert.data(),
                       N, K, rows, per_group};
  pool().run(expert_matmul_chunk, &m, per_group * static_cast<int64_t>(group_expert.size()));
  float* yp = y->typed_data();
  for (int64_t i = 0; i < P; ++i) std::memcpy(yp + order[i] * N, &ys[i * N], N * sizeof(float));
  return ffi::Error::Success();
}

}  // namespace
