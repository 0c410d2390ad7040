// A GPU that is the host, for tests of the device paths without one:
//   - HostBackedGpu: a DeviceRuntime whose "device memory" is host memory,
//     moving bytes with memcpy and converting with the CPU's conversions;
//   - HostGpuKernels: GpuKernels (ops/gpu_kernels.h) written plainly on the
//     host, each call from the contract its CUDA twin documents (the products
//     through the cuBLASLt replay of cublaslt_replay.h; the rest scalar, in
//     double where it sums), not from the CPU ops or the kernels' bodies, so
//     the ops' GPU sides — their checks, scratch, chunking, strides and
//     accumulation flags — run end to end and are held to the CPU ops.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "anvil/core/device.h"
#include "anvil/core/device_pool.h"
#include "anvil/core/dtype.h"
#include "anvil/core/op_timer.h"
#include "anvil/ops/gpu_kernels.h"
#include "anvil/ops/sdpa_layout.h"
#include "cublaslt_replay.h"

namespace anvil::testing {

// Host memory posing as a GPU's.
class HostMemory : public DeviceMemory {
 public:
  void* map(size_t bytes) override { return std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096); }
  void unmap(void* ptr, size_t) override { std::free(ptr); }
  std::string name() const override { return "host-backed stand-in"; }
};

// The stand-in's stamps: the host's clock when each is taken (its "stream"
// is the host, which has run everything before the stamp by then).
class HostClock : public DeviceClock {
 public:
  uint32_t stamp() override {
    stamps_.push_back(std::chrono::steady_clock::now());
    return static_cast<uint32_t>(stamps_.size() - 1);
  }
  double seconds_between(uint32_t from, uint32_t to) override {
    return std::chrono::duration<double>(stamps_.at(to) - stamps_.at(from)).count();
  }
  void clear() override { stamps_.clear(); }

 private:
  std::vector<std::chrono::steady_clock::time_point> stamps_;
};

class HostBackedGpu : public DeviceRuntime {
 public:
  void copy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) override {
    EXPECT_TRUE(!dst_device.is_cpu() || !src_device.is_cpu()) << "a host-to-host copy reached the runtime";
    std::memcpy(dst, src, bytes);
    ++copies;
  }
  void zero(void* dst, Device, size_t bytes) override {
    std::memset(dst, 0, bytes);
    ++zeros;
  }
  void convert(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t n, Device) override {
    if (src_dtype == DType::f32 && dst_dtype == DType::bf16)
      convert_f32_to_bf16(static_cast<const float*>(src), static_cast<bf16*>(dst), n);
    else if (src_dtype == DType::bf16 && dst_dtype == DType::f32)
      convert_bf16_to_f32(static_cast<const bf16*>(src), static_cast<float*>(dst), n);
    else
      ADD_FAILURE() << "no device conversion from " << dtype_name(src_dtype) << " to " << dtype_name(dst_dtype);
    ++converts;
  }
  std::unique_ptr<DeviceMemory> memory(int) override { return std::make_unique<HostMemory>(); }
  int device_count(std::string*) override { return 1; }
  DeviceProperties properties(int) override { return {"host-backed stand-in", memory_bytes}; }
  DeviceClock& clock() override { return clock_; }
  int copies = 0, zeros = 0, converts = 0;
  size_t memory_bytes = size_t{8} << 30;  // what the trainer holds a job against

 private:
  HostClock clock_;
};

namespace host_gpu {
inline float get(DType t, const void* p, int64_t i) {
  return t == DType::f32 ? static_cast<const float*>(p)[i] : bf16::to_float(static_cast<const bf16*>(p)[i].bits);
}
inline void put(DType t, void* p, int64_t i, double v) {
  if (t == DType::f32)
    static_cast<float*>(p)[i] = static_cast<float>(v);
  else
    static_cast<bf16*>(p)[i].bits = bf16::from_float(static_cast<float>(v));
}
}  // namespace host_gpu

class HostGpuKernels : public GpuKernels {
 public:
  void gemm(const LtMatmul& call, const void* A, const void* B, void* C, void* workspace,
            size_t workspace_bytes) override {
    EXPECT_NE(workspace, nullptr);
    EXPECT_EQ(workspace_bytes, kCublasLtWorkspaceBytes);
    cublaslt_replay::column_major_gemm(call, operand_pointer(call.a_operand, A, B),
                                       operand_pointer(call.b_operand, A, B), C);
    ++products;
  }

  // y = x·r·w, r = 1/sqrt(mean(x²) + eps) per row.
  void rmsnorm_forward(DType t, const void* x, const void* w, float eps, void* y, float* rstd, int64_t M,
                       int64_t D) override {
    using host_gpu::get, host_gpu::put;
    for (int64_t m = 0; m < M; ++m) {
      double ss = 0;
      for (int64_t j = 0; j < D; ++j) ss += static_cast<double>(get(t, x, m * D + j)) * get(t, x, m * D + j);
      const double r = 1.0 / std::sqrt(ss / static_cast<double>(D) + eps);
      if (rstd) rstd[m] = static_cast<float>(r);
      for (int64_t j = 0; j < D; ++j) put(t, y, m * D + j, get(t, x, m * D + j) * r * get(t, w, j));
    }
  }
  // dx = r·dy·w − (r³/D)·(Σ dy·w·x)·x (or added to), dw += Σ_rows dy·x·r.
  void rmsnorm_backward(DType t, DType dw_type, const void* dy, const void* x, const void* w, const float* rstd,
                        void* dx, void* dw, float* scratch, int64_t M, int64_t D, bool accumulate_dx) override {
    using host_gpu::get, host_gpu::put;
    EXPECT_NE(scratch, nullptr);
    std::vector<double> dws(static_cast<size_t>(D), 0.0), row(static_cast<size_t>(D));
    for (int64_t m = 0; m < M; ++m) {
      const double r = rstd[m];
      double dot = 0;
      for (int64_t j = 0; j < D; ++j)
        dot += static_cast<double>(get(t, dy, m * D + j)) * get(t, w, j) * get(t, x, m * D + j);
      for (int64_t j = 0; j < D; ++j) {
        const double xj = get(t, x, m * D + j), dyj = get(t, dy, m * D + j);
        row[static_cast<size_t>(j)] = r * dyj * get(t, w, j) - r * r * r / static_cast<double>(D) * dot * xj;
        dws[static_cast<size_t>(j)] += dyj * xj * r;
      }
      for (int64_t j = 0; j < D; ++j)  // dx may be dy: written after the row's reads
        put(t, dx, m * D + j, row[static_cast<size_t>(j)] + (accumulate_dx ? get(t, dx, m * D + j) : 0.0));
    }
    for (int64_t j = 0; j < D; ++j) put(dw_type, dw, j, get(dw_type, dw, j) + dws[static_cast<size_t>(j)]);
  }

  // Rotate-half RoPE: (x_i, x_{i+D/2}) by the position's angle (−angle inverse).
  void rope(bool inverse, DType t, const void* x, const float* cos, const float* sin, int64_t max_positions,
            int64_t B, int64_t T, int64_t H, int64_t D, int64_t pos_offset, void* y) override {
    using host_gpu::get, host_gpu::put;
    const int64_t half = D / 2;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < T; ++s) {
        const int64_t pos = pos_offset + s;
        EXPECT_LT(pos, max_positions);
        for (int64_t h = 0; h < H; ++h)
          for (int64_t i = 0; i < half; ++i) {
            const int64_t at = ((b * T + s) * H + h) * D + i;
            const double c = cos[pos * half + i], sn = inverse ? -sin[pos * half + i] : sin[pos * half + i];
            const double x1 = get(t, x, at), x2 = get(t, x, at + half);
            put(t, y, at, x1 * c - x2 * sn);
            put(t, y, at + half, x2 * c + x1 * sn);
          }
      }
  }

  void swiglu_forward(DType t, const void* g, const void* u, void* h, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) {
      const double gi = host_gpu::get(t, g, i);
      host_gpu::put(t, h, i, gi / (1 + std::exp(-gi)) * host_gpu::get(t, u, i));
    }
  }
  void swiglu_backward(DType t, const void* dh, const void* g, const void* u, void* dg, void* du,
                       int64_t n) override {
    for (int64_t i = 0; i < n; ++i) {
      const double gi = host_gpu::get(t, g, i), ui = host_gpu::get(t, u, i), dhi = host_gpu::get(t, dh, i);
      const double sig = 1 / (1 + std::exp(-gi));
      host_gpu::put(t, dg, i, dhi * ui * sig * (1 + gi * (1 - sig)));
      host_gpu::put(t, du, i, dhi * gi * sig);
    }
  }

  void embedding_forward(const int32_t* tokens, int64_t M, DType table_type, const void* table, int64_t V,
                         int64_t D, DType out_type, void* out) override {
    for (int64_t m = 0; m < M; ++m) {
      EXPECT_TRUE(tokens[m] >= 0 && tokens[m] < V);
      for (int64_t j = 0; j < D; ++j) host_gpu::put(out_type, out, m * D + j, host_gpu::get(table_type, table, tokens[m] * D + j));
    }
  }
  void embedding_backward(DType dout_type, const void* dout, const int32_t* tokens, int64_t M, int64_t V, int64_t D,
                          DType grad_type, void* dtable) override {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < D; ++j) {
        const int64_t at = tokens[m] * D + j;
        host_gpu::put(grad_type, dtable, at,
                      static_cast<double>(host_gpu::get(grad_type, dtable, at)) + host_gpu::get(dout_type, dout, m * D + j));
      }
    (void)V;
  }

  size_t sdpa_workspace_bytes(bool, const SdpaShape&) override { return 0; }
  // GQA attention, bf16 storage, in double: causal with out and lse (B, Hq,
  // T), or over the documents' pack with token-major stats (ops/sdpa_layout.h).
  void sdpa_forward(const SdpaShape& s, const void* q, const void* k, const void* v, void* out, float* stats,
                    const void* documents, void*, size_t) override {
    ++sdpa_calls, ragged_calls += s.docs_batch > 0;
    attend(s, q, k, v, out, stats, nullptr, nullptr, nullptr, nullptr, nullptr, documents);
  }
  void sdpa_backward(const SdpaShape& s, const void* dout, const void* q, const void* k, const void* v, const void*,
                     const float* stats, const void* documents, void* dq, void* dk, void* dv, void*, size_t) override {
    ++sdpa_calls, ragged_calls += s.docs_batch > 0;
    attend(s, q, k, v, nullptr, nullptr, dout, dq, dk, dv, stats, documents);
  }
  void lse_transpose(const float* src, float* dst, int64_t B, int64_t H, int64_t T, bool to_token_major) override {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < T; ++t) {
          const int64_t bht = (b * H + h) * T + t, bth = (b * T + t) * H + h;
          if (to_token_major) dst[bth] = src[bht];
          else dst[bht] = src[bth];
        }
  }

  void attention_softmax_forward(const float* scores, float* probs, float* lse, int64_t rows, int64_t T,
                                 float scale, const int32_t* first_key) override {
    std::vector<double> z(static_cast<size_t>(T));
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = r % T, first = first_key ? first_key[r] : 0;
      double mx = -std::numeric_limits<double>::infinity(), sum = 0;
      for (int64_t j = first; j <= t; ++j)
        mx = std::max(mx, z[static_cast<size_t>(j)] = double(scale) * scores[r * T + j]);
      for (int64_t j = first; j <= t; ++j) sum += std::exp(z[static_cast<size_t>(j)] - mx);
      const double l = mx + std::log(sum);
      lse[r] = static_cast<float>(l);
      for (int64_t j = 0; j < T; ++j)
        probs[r * T + j] = j >= first && j <= t ? static_cast<float>(std::exp(z[static_cast<size_t>(j)] - l)) : 0.0f;
    }
  }
  void attention_softmax_backward(const float* probs, const float* dprobs, float* dscores, int64_t rows, int64_t T,
                                  float scale, const int32_t* first_key) override {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = r % T, first = first_key ? first_key[r] : 0;
      double dot = 0;
      for (int64_t j = first; j <= t; ++j) dot += static_cast<double>(dprobs[r * T + j]) * probs[r * T + j];
      for (int64_t j = 0; j < T; ++j)
        dscores[r * T + j] =
            j >= first && j <= t ? static_cast<float>(scale * probs[r * T + j] * (dprobs[r * T + j] - dot)) : 0.0f;
    }
  }

  void cross_entropy_lse_update(const float* logits, int64_t rows, int64_t cols, int64_t v0, const int32_t* targets,
                                int32_t ignore_index, bool first_chunk, float* row_max, float* row_sum,
                                float* row_target) override {
    const float inf = std::numeric_limits<float>::infinity();
    for (int64_t m = 0; m < rows; ++m) {
      if (first_chunk) row_max[m] = -inf, row_sum[m] = 0, row_target[m] = 0;
      if (targets[m] == ignore_index) continue;
      float cmax = -inf;
      for (int64_t j = 0; j < cols; ++j) cmax = std::max(cmax, logits[m * cols + j]);
      const float nmax = std::max(row_max[m], cmax);
      double sum = row_max[m] == -inf ? 0.0 : row_sum[m] * std::exp(double(row_max[m]) - nmax);
      for (int64_t j = 0; j < cols; ++j) sum += std::exp(double(logits[m * cols + j]) - nmax);
      row_max[m] = nmax, row_sum[m] = static_cast<float>(sum);
      if (targets[m] >= v0 && targets[m] < v0 + cols) row_target[m] = logits[m * cols + targets[m] - v0];
    }
  }
  void cross_entropy_loss(const float* row_max, const float* row_sum, const float* row_target, const int32_t* targets,
                          int32_t ignore_index, int64_t M, float* lse, double* loss_sum, int64_t* num_tokens) override {
    double loss = 0;
    int64_t n = 0;
    for (int64_t m = 0; m < M; ++m) {
      if (targets[m] == ignore_index) {
        lse[m] = 0;
        continue;
      }
      const double l = double(row_max[m]) + std::log(double(row_sum[m]));
      lse[m] = static_cast<float>(l);
      loss += l - row_target[m];
      ++n;
    }
    *loss_sum = loss, *num_tokens = n;
  }
  void cross_entropy_dlogits(DType t, const float* logits, void* dlogits, int64_t rows, int64_t cols, int64_t v0,
                             const int32_t* targets, int32_t ignore_index, const float* lse, float scale) override {
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t j = 0; j < cols; ++j) {
        const bool ignored = targets[m] == ignore_index;
        const double p = ignored ? 0.0 : std::exp(double(logits[m * cols + j]) - lse[m]);
        const double onehot = !ignored && targets[m] == v0 + j ? 1.0 : 0.0;
        host_gpu::put(t, dlogits, m * cols + j, (p - onehot) * scale);
      }
  }

  void adamw_step(const AdamWConfig& cfg, int64_t step, float* p, const float* g, float* m, float* v,
                  uint16_t* p_bf16, int64_t n, float grad_scale) override {
    const double b1 = cfg.beta1, b2 = cfg.beta2;
    const double bc1 = 1 - std::pow(b1, double(step)), bc2 = 1 - std::pow(b2, double(step));
    for (int64_t i = 0; i < n; ++i) {
      const double gi = double(g[i]) * grad_scale;
      const double mi = b1 * m[i] + (1 - b1) * gi, vi = b2 * v[i] + (1 - b2) * gi * gi;
      const double pi = p[i] * (1 - double(cfg.lr) * cfg.weight_decay) -
                        double(cfg.lr) / bc1 * mi / (std::sqrt(vi) / std::sqrt(bc2) + cfg.eps);
      m[i] = static_cast<float>(mi), v[i] = static_cast<float>(vi), p[i] = static_cast<float>(pi);
      if (p_bf16) p_bf16[i] = bf16::from_float(p[i]);
    }
  }

  void grad_sum_of_squares(DType t, const void* x, int64_t n, double* workspace, double* out) override {
    EXPECT_NE(workspace, nullptr);
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += double(host_gpu::get(t, x, i)) * host_gpu::get(t, x, i);
    *out = s;
  }
  void scale_grads(DType t, void* x, int64_t n, float scale) override {
    for (int64_t i = 0; i < n; ++i) host_gpu::put(t, x, i, double(host_gpu::get(t, x, i)) * scale);
  }

  int products = 0;
  int sdpa_calls = 0, ragged_calls = 0;  // cuDNN SDPA calls, and those over documents

 private:
  // One sequence of attention as cuDNN lays it out: its q rows from element
  // q_base (row stride Hq·D, head stride D), its k and v rows from kv_base
  // (Hkv·D, D), its stats from stats_base (row and head strides as given).
  struct Sequence {
    int64_t q_base, kv_base, stats_base, length, stats_row, stats_head;
  };
  // Causal: the B sequences of T; lse (B, Hq, T). Block-causal: the entries
  // of the documents' pack (ops/sdpa_layout.h) read as cuDNN reads them,
  // their lengths and ragged offsets, stats token-major.
  static std::vector<Sequence> sequences_of(const SdpaShape& s, const void* documents) {
    std::vector<Sequence> seqs;
    if (s.docs_batch == 0) {
      for (int64_t b = 0; b < s.B; ++b)
        seqs.push_back({b * s.T * s.Hq * s.D, b * s.T * s.Hkv * s.D, b * s.Hq * s.T, s.T, 1, s.T});
      return seqs;
    }
    EXPECT_NE(documents, nullptr);
    const SdpaDocumentsPack at = sdpa_documents_pack_of(sdpa_documents_capacity(s.B, s.T));
    const auto* base = static_cast<const std::byte*>(documents);
    const auto* seq_len = reinterpret_cast<const int32_t*>(base + at.seq_len);
    const auto* q_off = reinterpret_cast<const int64_t*>(base + at.q_offset);
    const auto* kv_off = reinterpret_cast<const int64_t*>(base + at.kv_offset);
    const auto* st_off = reinterpret_cast<const int64_t*>(base + at.stats_offset);
    for (int64_t n = 0; n < s.docs_batch; ++n) {
      EXPECT_LE(seq_len[n], s.docs_max_seq) << "entry " << n;
      seqs.push_back({q_off[n], kv_off[n], st_off[n], seq_len[n], s.Hq, 1});
    }
    return seqs;
  }

  // Forward (out, stats written) or, with dout, backward (dq, dk, dv written
  // from the forward's stats): causal within each sequence.
  static void attend(const SdpaShape& s, const void* q, const void* k, const void* v, void* out, float* stats_out,
                     const void* dout, void* dq, void* dk, void* dv, const float* stats_in, const void* documents) {
    const DType t = DType::bf16;
    const int64_t group = s.Hq / s.Hkv, qrow = s.Hq * s.D, kvrow = s.Hkv * s.D;
    const double scale = s.scale;
    std::vector<double> gq(static_cast<size_t>(s.B * s.T * qrow), 0.0), gk(static_cast<size_t>(s.B * s.T * kvrow), 0.0),
        gv(gk.size(), 0.0), p(static_cast<size_t>(s.T));
    for (const Sequence& seq : sequences_of(s, documents)) {
      const auto at_q = [&](int64_t i, int64_t h) { return seq.q_base + i * qrow + h * s.D; };
      const auto at_kv = [&](int64_t j, int64_t g) { return seq.kv_base + j * kvrow + g * s.D; };
      for (int64_t h = 0; h < s.Hq; ++h)
        for (int64_t i = 0; i < seq.length; ++i) {
          const int64_t g = h / group;
          double mx = -std::numeric_limits<double>::infinity();
          for (int64_t j = 0; j <= i; ++j) {
            double d = 0;
            for (int64_t c = 0; c < s.D; ++c)
              d += double(host_gpu::get(t, q, at_q(i, h) + c)) * host_gpu::get(t, k, at_kv(j, g) + c);
            mx = std::max(mx, p[static_cast<size_t>(j)] = scale * d);
          }
          const int64_t row = seq.stats_base + i * seq.stats_row + h * seq.stats_head;
          double l;
          if (!dout) {
            double sum = 0;
            for (int64_t j = 0; j <= i; ++j) sum += std::exp(p[static_cast<size_t>(j)] - mx);
            l = mx + std::log(sum);
            stats_out[row] = static_cast<float>(l);
          } else {
            l = stats_in[row];
          }
          for (int64_t j = 0; j <= i; ++j) p[static_cast<size_t>(j)] = std::exp(p[static_cast<size_t>(j)] - l);
          if (!dout) {
            for (int64_t c = 0; c < s.D; ++c) {
              double o = 0;
              for (int64_t j = 0; j <= i; ++j) o += p[static_cast<size_t>(j)] * host_gpu::get(t, v, at_kv(j, g) + c);
              host_gpu::put(t, out, at_q(i, h) + c, o);
            }
            continue;
          }
          std::vector<double> dp(static_cast<size_t>(i + 1));
          double dot = 0;
          for (int64_t j = 0; j <= i; ++j) {
            double d = 0;
            for (int64_t c = 0; c < s.D; ++c)
              d += double(host_gpu::get(t, dout, at_q(i, h) + c)) * host_gpu::get(t, v, at_kv(j, g) + c);
            dp[static_cast<size_t>(j)] = d;
            dot += d * p[static_cast<size_t>(j)];
          }
          for (int64_t j = 0; j <= i; ++j) {
            const double ds = p[static_cast<size_t>(j)] * (dp[static_cast<size_t>(j)] - dot) * scale;
            for (int64_t c = 0; c < s.D; ++c) {
              gq[static_cast<size_t>(at_q(i, h) + c)] += ds * host_gpu::get(t, k, at_kv(j, g) + c);
              gk[static_cast<size_t>(at_kv(j, g) + c)] += ds * host_gpu::get(t, q, at_q(i, h) + c);
              gv[static_cast<size_t>(at_kv(j, g) + c)] += p[static_cast<size_t>(j)] * host_gpu::get(t, dout, at_q(i, h) + c);
            }
          }
        }
    }
    if (!dout) return;
    for (size_t i = 0; i < gq.size(); ++i) host_gpu::put(t, dq, static_cast<int64_t>(i), gq[i]);
    for (size_t i = 0; i < gk.size(); ++i) host_gpu::put(t, dk, static_cast<int64_t>(i), gk[i]), host_gpu::put(t, dv, static_cast<int64_t>(i), gv[i]);
  }
};

}  // namespace anvil::testing
