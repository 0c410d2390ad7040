#include "anvil/ops/sdpa_layout.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "anvil/core/error.h"

namespace anvil {

namespace {

// A (B, T, H, D) row-major tensor as dims [B, H, T, D]: a step in T skips the
// H heads of a row, a step in H one head.
CudnnTensorLayout bshd(int64_t B, int64_t T, int64_t H, int64_t D) { return {{B, H, T, D}, {T * H * D, D, H * D, 1}}; }

int64_t power_of_two_at_least(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

int64_t rounded_length(int64_t longest, int64_t T) {
  return std::min(T, std::max<int64_t>(64, power_of_two_at_least(longest)));
}

size_t at_256(size_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace

SdpaLayout sdpa_layout_of(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, float scale, int64_t docs_batch,
                          int64_t docs_max_seq) {
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
  if (docs_batch == 0) return l;
  ANVIL_CHECK(docs_batch > 0 && docs_max_seq > 0 && docs_max_seq <= T, "cuDNN ragged SDPA: a batch of ", docs_batch,
              " documents of at most ", docs_max_seq, " tokens does not fit sequences of ", T);
  const int64_t S = docs_max_seq;
  l.b = docs_batch;
  l.s_q = l.s_kv = S;
  l.q = l.o = bshd(docs_batch, S, Hq, D);
  l.k = l.v = bshd(docs_batch, S, Hkv, D);
  l.stats = {{docs_batch, Hq, S, 1}, {Hq * S, 1, Hq, 1}};  // token-major (see the header)
  l.ragged = true;
  l.q_token_elems = Hq * D;
  l.kv_token_elems = Hkv * D;
  l.stats_token_elems = Hq;
  l.max_total_seq = B * T;
  return l;
}

SdpaDocuments sdpa_documents_of(const int32_t* documents, int64_t B, int64_t T, int64_t S) {
  ANVIL_CHECK(B > 0 && T > 0 && S >= T, "documents (", B, ", 2, ", S, ") for sequences of ", T, " tokens");
  SdpaDocuments d;
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* start = documents + b * 2 * S;
    const int32_t* end = start + S;
    for (int64_t p = 0; p < T;) {
      ANVIL_CHECK(start[p] == p && end[p] > p, "documents of sequence ", b, ": position ", p,
                  " starts no document where the one before ended (start ", start[p], ", end ", end[p], ")");
      const int64_t stop = std::min<int64_t>(end[p], T);
      d.seq_len.push_back(static_cast<int32_t>(stop - p));
      d.first_token.push_back(b * T + p);
      longest = std::max(longest, stop - p);
      p = stop;
    }
  }
  const int64_t n = static_cast<int64_t>(d.seq_len.size());
  d.batch = power_of_two_at_least(n);
  d.max_seq = rounded_length(longest, T);
  d.seq_len.resize(static_cast<size_t>(d.batch), 0);
  d.first_token.resize(static_cast<size_t>(d.batch) + 1, B * T);
  return d;
}

int64_t sdpa_documents_capacity(int64_t B, int64_t T) { return power_of_two_at_least(B * T); }

SdpaDocumentsPack sdpa_documents_pack_of(int64_t capacity) {
  const auto n = static_cast<size_t>(capacity);
  SdpaDocumentsPack p;
  p.seq_len = 0;
  p.q_offset = at_256(n * sizeof(int32_t));
  p.kv_offset = p.q_offset + at_256((n + 1) * sizeof(int64_t));
  p.stats_offset = p.kv_offset + at_256((n + 1) * sizeof(int64_t));
  p.bytes = p.stats_offset + at_256((n + 1) * sizeof(int64_t));
  return p;
}

std::vector<std::byte> sdpa_documents_packed(const SdpaDocuments& docs, const SdpaLayout& layout, int64_t capacity) {
  ANVIL_ASSERT(layout.ragged && docs.batch <= capacity && docs.seq_len.size() == size_t(docs.batch) &&
                   docs.first_token.size() == size_t(docs.batch) + 1,
               "documents' pack: ", docs.batch, " entries, capacity ", capacity);
  const SdpaDocumentsPack at = sdpa_documents_pack_of(capacity);
  std::vector<std::byte> bytes(at.bytes);
  std::memcpy(bytes.data() + at.seq_len, docs.seq_len.data(), docs.seq_len.size() * sizeof(int32_t));
  const auto offsets = [&](size_t where, int64_t elems_per_token) {
    for (size_t i = 0; i < docs.first_token.size(); ++i) {
      const int64_t offset = docs.first_token[i] * elems_per_token;
      std::memcpy(bytes.data() + where + i * sizeof(int64_t), &offset, sizeof offset);
    }
  };
  offsets(at.q_offset, layout.q_token_elems);
  offsets(at.kv_offset, layout.kv_token_elems);
  offsets(at.stats_offset, layout.stats_token_elems);
  return bytes;
}

}  // namespace anvil
