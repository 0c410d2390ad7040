// Muon (Jordan et al., "Muon: An optimizer for hidden layers in neural
// networks", 2024; Liu et al., "Muon is Scalable for LLM Training", 2025) with
// torch.optim.Muon's update (PyTorch 2.9), following its code where that
// differs from its docstring. For a weight matrix p (A rows, B columns) with
// gradient g and momentum buffer m (zero before the first step):
//   m ← lerp(m, g, 1 − μ)                    (buf.lerp_(grad, 1 − momentum))
//   u = lerp(g, m, μ) with Nesterov, else m  (grad.lerp(buf, momentum))
//   o = NS_k(u)                              (Newton–Schulz, below)
//   p ← p·(1 − lr·wd)                        (decoupled decay, at the unadjusted lr)
//   p ← p − lr'·o, lr' = lr·√max(1, A/B) ("original") or lr·0.2·√max(A, B) ("match_rms_adamw")
// NS_k: X = u, transposed when A > B so that X is wide; X ← X / max(‖X‖_F, eps);
// then k times: G = X·Xᵀ; H = b·G + c·G·G; X ← a·X + H·X; o = X (transposed back).
// It maps u's singular values towards 1 (to between about 0.7 and 1.2 with
// the default coefficients (3.4445, −4.775, 2.0315)), so every direction of
// the update moves alike.
//
// Newton–Schulz runs in `ns_dtype`: bf16 as PyTorch ships it (each product
// and each a·X + H·X rounded to bf16 once, as its addmm does, the norm too), or
// f32. The elementwise parts (momentum, decay, update) are f32 and work on any
// part of the matrix's elements, so a rank holding a shard of the matrix runs
// them on its shard and Newton–Schulz alone needs the whole matrix.
#pragma once
#include <cstdint>

#include "anvil/core/tensor.h"

namespace anvil {

enum class MuonLrAdjust : uint8_t { original, match_rms_adamw };
const char* muon_lr_adjust_name(MuonLrAdjust a);  // "original", "match_rms_adamw"

// torch.optim.Muon's defaults. Doubles, as PyTorch's Python floats are: the
// coefficients are rounded to f32 where PyTorch rounds them (see muon.cpp).
struct MuonConfig {
  double lr = 1e-3;
  double weight_decay = 0.1;
  double momentum = 0.95;
  bool nesterov = true;
  double ns_a = 3.4445, ns_b = -4.775, ns_c = 2.0315;
  int64_t ns_steps = 5;
  double eps = 1e-7;
  MuonLrAdjust adjust_lr = MuonLrAdjust::original;
  DType ns_dtype = DType::bf16;
};

// Throws anvil::Error for settings outside their valid ranges (lr, weight
// decay, momentum ≥ 0 and finite; 1 ≤ ns_steps < 100, as PyTorch allows;
// eps > 0; ns_dtype f32 or bf16), naming the setting and the rule.
void check_muon_config(const MuonConfig& cfg);

// The learning rate a matrix of `rows` × `cols` moves by (lr' above).
double muon_adjusted_lr(const MuonConfig& cfg, int64_t rows, int64_t cols);

// Multiply-adds of NS_k on a rows × cols matrix, counted as 2 FLOPs each:
// per step 2·r²·c (G) + 2·r³ (G·G) + 2·r²·c (H·X), r = min(rows, cols), c = max.
double newton_schulz_flops(const MuonConfig& cfg, int64_t rows, int64_t cols);

// The momentum of n elements (a whole matrix's or a shard's), all f32:
// m ← lerp(m, s·g, 1 − μ), and u ← lerp(s·g, m, μ) with Nesterov, else m;
// s (grad_scale) is the clip coefficient, applied as g is read.
void muon_momentum(const MuonConfig& cfg, const Tensor& g, float grad_scale, Tensor& m, Tensor& u);

// o ← NS_k(u) for u and o (rows, cols) f32, u whole. Its working matrices
// ("muon.ns.*", workspace) are allocated for the call and freed after it.
void newton_schulz(const MuonConfig& cfg, const Tensor& u, Tensor& o);

// p ← p·(1 − lr·wd) − adjusted_lr·o over n elements (a shard too), f32;
// p_bf16, when given, gets bf16(p) (the mixed-precision compute copy).
void muon_apply(const MuonConfig& cfg, double adjusted_lr, const Tensor& o, Tensor& p, Tensor* p_bf16 = nullptr);

// One step of a matrix p (rows, cols) held whole: the three above, u and o
// allocated for the call.
void muon_step(const MuonConfig& cfg, Tensor& p, const Tensor& g, Tensor& m, Tensor* p_bf16 = nullptr,
               float grad_scale = 1.0f);

}  // namespace anvil
