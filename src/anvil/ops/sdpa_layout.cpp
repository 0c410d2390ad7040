#include "anvil/ops/sdpa_layout.h"

#include <cmath>

#include "anvil/core/error.h"

namespace anvil {

namespace {

// A (B, T, H, D) row-major tensor as dims [B, H, T, D]: a step in T skips the
// H heads of a row, a step in H one head.
CudnnTensorLayout bshd(int64_t B, int64_t T, int64_t H, int64_t D) { return {{B, H, T, D}, {T * H * D, D, H * D, 1}}; }

}  // namespace

SdpaLayout sdpa_layout_of(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, float scale) {
  ANVIL_CHECK(B > 0 && T > 0 && Hq > 0 && Hkv > 0 && D > 0 && Hq % Hkv == 0,
              "cuDNN SDPA needs positive sizes and query heads a multiple of the kv heads: B=", B, " T=", T, " Hq=", Hq,
              " Hkv=", Hkv, " D=", D);
  ANVIL_CHECK(D % 8 == 0, "cuDNN SDPA needs a head dim that is a multiple of 8 (bf16): B=", B, " T=", T, " Hq=", Hq,
              " Hkv=", Hkv, " D=", D);
  SdpaLayout l;
  l.b = B;
  l.h_q = Hq;
  l.h_kv = Hkv;
  l.s_q = l.s_kv = T;
  l.d = D;
  l.q = l.o = bshd(B, T, Hq, D);
  l.k = l.v = bshd(B, T, Hkv, D);
  l.stats = {{B, Hq, T, 1}, {Hq * T, T, 1, 1}};  // lse (B, Hq, T), row-major
  l.attn_scale = scale != 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(D));
  return l;
}

}  // namespace anvil
