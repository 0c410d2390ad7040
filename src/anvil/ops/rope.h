// Rotary position embedding (Su et al. 2021) for q and k.
//
// Convention: HALVES, as Hugging Face's Llama (`rotate_half`): within each head
// of size D, element i is paired with element i + D/2 (i < D/2) and the pair is
// rotated by the angle pos · f_i:
//   y[i]       = x[i]·cos − x[i + D/2]·sin
//   y[i + D/2] = x[i + D/2]·cos + x[i]·sin
// Hugging Face checkpoints load as they are (their q/k projection rows were
// permuted at conversion to suit this layout). Meta's reference code and
// torchtitan rotate INTERLEAVED pairs (2i, 2i+1) instead; a checkpoint from
// there needs its wq/wk rows permuted before it matches this kernel.
#pragma once
#include <cstdint>
#include <vector>

#include "anvil/core/tensor.h"

namespace anvil {

// Llama 3.1 frequency scaling, for each inverse frequency f with wavelength
// λ = 2π/f (o = original_max_position):
//   λ < o / high_freq_factor : f          (high frequencies kept)
//   λ > o / low_freq_factor  : f / factor (low frequencies slowed down)
//   otherwise, with s = (o/λ − low_freq_factor) / (high_freq_factor − low_freq_factor):
//                              (1 − s)·f/factor + s·f
// The defaults are Llama 3.1's.
struct RopeScaling {
  bool enabled = false;
  float factor = 8;
  float low_freq_factor = 1;
  float high_freq_factor = 4;
  int64_t original_max_position = 8192;
};

// f_i = theta^(−2i/D) for i < D/2, then scaled; in double.
// theta: 10000 for Llama 2, 500000 for Llama 3.
std::vector<double> rope_inv_freq(int64_t head_dim, double theta, const RopeScaling& scaling = {});

// cos/sin of pos · f_i for pos = 0..max_positions-1, computed in double and
// stored in f32.
struct RopeTable {
  Tensor cos;  // (max_positions, D/2) f32
  Tensor sin;  // (max_positions, D/2) f32
  int64_t max_positions() const { return cos.size(0); }
  int64_t head_dim() const { return 2 * cos.size(1); }
};
RopeTable rope_table(int64_t max_positions, int64_t head_dim, double theta, const RopeScaling& scaling = {},
                     MemCategory category = MemCategory::workspace);

// x (B, T, H, D) f32 or bf16; y (B, T, H, D) same dtype, written (y may be x:
// in place). Token t of every sequence sits at position pos_offset + t, which
// must be inside the table.
void rope_forward(const Tensor& x, const RopeTable& table, int64_t pos_offset, Tensor& y);
// The inverse rotation (the rotation is orthogonal, so its transpose):
// dy (B, T, H, D) -> dx (B, T, H, D), written (dx may be dy).
void rope_backward(const Tensor& dy, const RopeTable& table, int64_t pos_offset, Tensor& dx);

}  // namespace anvil
