#include "anvil/ops/rope.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <numbers>

#include "anvil/core/dry_run.h"
#include "anvil/core/op_timer.h"
#include "anvil/core/parallel_for.h"
#include "anvil/ops/gpu_kernels.h"
#include "anvil/ops/vec16.h"

namespace anvil {

namespace {

using namespace vec16;  // the 16-lane vector helpers (ops/vec16.h)

// One group of up to 16 pairs (x1 = first half, x2 = second half of a head).
// Forward rotates by +angle, the inverse by −angle (sin negated).
template <bool kInverse>
inline void rotate(V x1, V x2, V c, V s, V& y1, V& y2) {
  if constexpr (!kInverse) {
    y1 = mul_sub(x1, c, x2 * s);  // x1·cos − x2·sin
    y2 = mul_add(x2, c, x1 * s);  // x2·cos + x1·sin
  } else {
    y1 = mul_add(x1, c, x2 * s);  // x1·cos + x2·sin
    y2 = mul_sub(x2, c, x1 * s);  // x2·cos − x1·sin
  }
}

template <bool kInverse, class T>
void rope_kernel(const T* x, const float* cos_tab, const float* sin_tab, int64_t B, int64_t T_, int64_t H,
                 int64_t D, int64_t pos_offset, T* y) {
  const int64_t half = D / 2, row = H * D;
  // Parallel over tokens; one token's cos/sin row (D/2 floats each) serves all
  // H heads. Each element is read once and written once: a single pass.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, row));
  parallel_for(0, B * T_, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t bt = lo; bt < hi; ++bt) {
      const int64_t pos = pos_offset + bt % T_;
      const float* c = cos_tab + pos * half;
      const float* s = sin_tab + pos * half;
      for (int64_t h = 0; h < H; ++h) {
        const T* xh = x + bt * row + h * D;
        T* yh = y + bt * row + h * D;
        int64_t j = 0;
        V y1, y2;
        for (; j + kW <= half; j += kW) {
          // Both inputs are loaded before either output is stored, so y == x is safe.
          rotate<kInverse>(load(xh + j), load(xh + half + j), load(c + j), load(s + j), y1, y2);
          store(yh + j, y1);
          store(yh + half + j, y2);
        }
        if (j < half) {
          const int64_t n = half - j;
          rotate<kInverse>(load(xh + j, n), load(xh + half + j, n), load(c + j, n), load(s + j, n), y1, y2);
          store(yh + j, y1, n);
          store(yh + half + j, y2, n);
        }
      }
    }
  });
}

template <bool kInverse>
void rope_apply(const Tensor& x, const RopeTable& table, int64_t pos_offset, Tensor& y, const char* what) {
  ANVIL_ASSERT(x.ndim() == 4 && y.shape() == x.shape() && y.dtype() == x.dtype() && x.dtype() != DType::i32, what,
               ": x ", shape_str(x.shape()), " ", dtype_name(x.dtype()), ", y ", shape_str(y.shape()), " ",
               dtype_name(y.dtype()));
  ANVIL_ASSERT(table.cos.defined() && table.sin.defined() && table.cos.shape() == table.sin.shape(), what,
               ": the RoPE table is not built");
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3);
  ANVIL_ASSERT(D == table.head_dim(), what, ": head_dim ", D, " but the RoPE table was built for ", table.head_dim());
  ANVIL_CHECK(pos_offset >= 0 && pos_offset + T <= table.max_positions(), what, ": positions [", pos_offset, ", ",
              pos_offset + T, ") are outside the RoPE table, which covers [0, ", table.max_positions(),
              "); build the table for at least ", pos_offset + T, " positions (raise the maximum sequence length)");
  if (on_gpu(what, x, y, table.cos, table.sin)) {
    if (x.numel() == 0 || dry_run()) return;
    return gpu_kernels(what).rope(kInverse, x.dtype(), x.raw(), static_cast<const float*>(table.cos.raw()),
                                  static_cast<const float*>(table.sin.raw()), table.max_positions(), B, T, H, D,
                                  pos_offset, y.raw());
  }
  if (x.numel() == 0 || dry_run()) return;
  const float* c = table.cos.data<float>();
  const float* s = table.sin.data<float>();
  if (x.dtype() == DType::f32)
    rope_kernel<kInverse>(x.data<float>(), c, s, B, T, H, D, pos_offset, y.data<float>());
  else
    rope_kernel<kInverse>(x.data<bf16>(), c, s, B, T, H, D, pos_offset, y.data<bf16>());
}

}  // namespace

std::vector<double> rope_inv_freq(int64_t head_dim, double theta, const RopeScaling& scaling) {
  ANVIL_CHECK(head_dim > 0 && head_dim % 2 == 0, "RoPE: head_dim must be even and positive, got ", head_dim,
              "; check dim / n_heads in the model config");
  ANVIL_CHECK(theta > 1, "RoPE: theta must be > 1, got ", theta, " (Llama 2 uses 10000, Llama 3 500000)");
  const int64_t half = head_dim / 2;
  std::vector<double> f(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    f[static_cast<size_t>(i)] = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
  if (!scaling.enabled) return f;

  const double factor = scaling.factor, lo = scaling.low_freq_factor, hi = scaling.high_freq_factor;
  const double orig = static_cast<double>(scaling.original_max_position);
  ANVIL_CHECK(factor > 0 && lo > 0 && hi > lo && orig > 0,
              "RoPE scaling: need factor > 0, 0 < low_freq_factor < high_freq_factor and original_max_position > 0; "
              "got factor ",
              factor, ", low_freq_factor ", lo, ", high_freq_factor ", hi, ", original_max_position ", orig);
  const double short_wavelen = orig / hi, long_wavelen = orig / lo;
  for (double& fi : f) {
    const double wavelen = 2 * std::numbers::pi / fi;
    if (wavelen < short_wavelen) continue;  // high frequency: kept
    if (wavelen > long_wavelen) {
      fi /= factor;  // low frequency: slowed down by the factor
    } else {
      const double s = (orig / wavelen - lo) / (hi - lo);  // 0 at the long end, 1 at the short end
      fi = (1 - s) * fi / factor + s * fi;
    }
  }
  return f;
}

RopeTable rope_table(int64_t max_positions, int64_t head_dim, double theta, const RopeScaling& scaling,
                     MemCategory category) {
  ANVIL_CHECK(max_positions > 0, "RoPE: max_positions must be positive, got ", max_positions);
  const Device device = default_device();
  if (!device.is_cpu()) {  // made on the host, in double, and copied over once
    const ScopedDevice host(Device::cpu());
    const RopeTable made = rope_table(max_positions, head_dim, theta, scaling, MemCategory::workspace);
    return {made.cos.to(device, category, "rope.cos"), made.sin.to(device, category, "rope.sin")};
  }
  const std::vector<double> f = rope_inv_freq(head_dim, theta, scaling);
  const int64_t half = head_dim / 2;
  RopeTable t{Tensor::empty({max_positions, half}, DType::f32, category, "rope.cos"),
              Tensor::empty({max_positions, half}, DType::f32, category, "rope.sin")};
  if (dry_run()) return t;
  float* c = t.cos.data<float>();
  float* s = t.sin.data<float>();
  parallel_for(0, max_positions, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p)
      for (int64_t i = 0; i < half; ++i) {
        // The angle in double: at p ~ 10⁵ an f32 angle would be off by ~10⁻².
        const double a = static_cast<double>(p) * f[static_cast<size_t>(i)];
        c[p * half + i] = static_cast<float>(std::cos(a));
        s[p * half + i] = static_cast<float>(std::sin(a));
      }
  });
  return t;
}

void rope_forward(const Tensor& x, const RopeTable& table, int64_t pos_offset, Tensor& y) {
  const ScopedOpTime op("rope.forward");
  rope_apply<false>(x, table, pos_offset, y, "rope_forward");
}

void rope_backward(const Tensor& dy, const RopeTable& table, int64_t pos_offset, Tensor& dx) {
  const ScopedOpTime op("rope.backward");
  rope_apply<true>(dy, table, pos_offset, dx, "rope_backward");
}

}  // namespace anvil
