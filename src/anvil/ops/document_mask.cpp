#include "anvil/ops/document_mask.h"

#include "anvil/core/error.h"

namespace anvil {

namespace {

void check_bounds(const Tensor& bounds, int64_t B, int64_t T) {
  ANVIL_ASSERT(bounds.dtype() == DType::i32 && bounds.ndim() == 3 && bounds.size(0) == B && bounds.size(1) == 2 &&
                   bounds.size(2) == T,
               "document bounds ", shape_str(bounds.shape()), " ", dtype_name(bounds.dtype()), " must be i32 (", B,
               ", 2, ", T, ")");
}

}  // namespace

void fill_document_bounds(const Tensor& tokens, int32_t eos_id, Tensor& bounds) {
  ANVIL_ASSERT(tokens.dtype() == DType::i32 && tokens.ndim() == 2, "document bounds from tokens ",
               shape_str(tokens.shape()), " ", dtype_name(tokens.dtype()), ": need (B, T) i32");
  const int64_t B = tokens.size(0), T = tokens.size(1);
  check_bounds(bounds, B, T);
  ANVIL_ASSERT(T < (int64_t{1} << 31), "sequences of ", T, " tokens: positions must fit in i32");
  const int32_t* tok = tokens.data<int32_t>();
  int32_t* out = bounds.data<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* x = tok + b * T;
    int32_t* start = out + b * 2 * T;
    int32_t* end = start + T;
    int32_t s = 0;
    for (int64_t p = 0; p < T; ++p) {
      start[p] = s;
      if (x[p] == eos_id) s = static_cast<int32_t>(p + 1);  // the next token starts a document
    }
    int32_t e = static_cast<int32_t>(T);
    for (int64_t p = T - 1; p >= 0; --p) {
      end[p] = e;
      if (start[p] == p) e = static_cast<int32_t>(p);  // p starts its document: the one before ends here
    }
  }
}

void fill_single_document_bounds(Tensor& bounds) {
  ANVIL_ASSERT(bounds.ndim() == 3, "document bounds ", shape_str(bounds.shape()), " must be (B, 2, T)");
  const int64_t B = bounds.size(0), T = bounds.size(2);
  check_bounds(bounds, B, T);
  int32_t* out = bounds.data<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t p = 0; p < T; ++p) {
      out[b * 2 * T + p] = 0;
      out[(b * 2 + 1) * T + p] = static_cast<int32_t>(T);
    }
}

int64_t document_attention_pairs(const Tensor& bounds, int64_t b, int64_t first, int64_t n) {
  ANVIL_ASSERT(bounds.ndim() == 3 && b >= 0 && b < bounds.size(0) && first >= 0 && first + n <= bounds.size(2),
               "positions ", first, "..", first + n, " of sequence ", b, " outside document bounds ",
               shape_str(bounds.shape()));
  const int32_t* start = bounds.data<int32_t>() + b * 2 * bounds.size(2);
  int64_t pairs = 0;
  for (int64_t p = first; p < first + n; ++p) pairs += p - start[p] + 1;
  return pairs;
}

int64_t documents_in(const Tensor& bounds, int64_t b) {
  const int64_t T = bounds.size(2);
  const int32_t* start = bounds.data<int32_t>() + b * 2 * T;
  int64_t n = 0;
  for (int64_t p = 0; p < T; ++p) n += start[p] == p;
  return n;
}

}  // namespace anvil
