// Anvil's attention tensors (ops/attention.h) as cuDNN's scaled dot-product
// attention declares them (cudnn-frontend's graph sdpa and sdpa_backward).
// Plain C++, no cuDNN headers: the layout is proved on any host
// (tests/sdpa_layout_test.cpp reads the tensors through it alone) and the
// CUDA side only copies it into the graph's tensor attributes.
//
// cuDNN's SDPA takes every tensor as logical dims [B, H, S, D] with a stride
// per dim (in elements), whatever the memory order: Anvil's (B, T, H, D)
// row-major tensors are its "BSHD" layout, used in place, no transpose. Its
// softmax statistics are [B, H, S, 1] f32, max + ln Σ exp(score − max) per
// query row (natural log unless stats_use_log2 is asked for): exactly Anvil's
// lse (B, H, T). Grouped-query attention needs only H_kv < H_q on k and v;
// query head h reads kv head h / (H_q / H_kv), as Anvil's attention does.
//
// cuDNN runs SDPA on fp16, bf16 or fp8 q/k/v/o (not f32) with a head dim that
// is a multiple of 8 (16 for fp8); the GPU path stores them in bf16. Strides
// are in elements, so the layout is the same for any element type.
//
// Block-causal attention (documents packed into the sequences, ops/attention.h's
// AttentionWindow::documents) is cuDNN's variable-length ("ragged", THD)
// SDPA: each document is one entry of cuDNN's batch, of its own length
// (seq_len_q = seq_len_kv, the padding mask), causal within itself (the same
// top-left diagonal), its rows found through a ragged offset per entry, in
// elements from the tensor's pointer, in place of the batch stride. Anvil's
// (B, T, H, D) rows are packed in token order already, so document n's q
// rows start at token g_n = b·T + start, element g_n·Hq·D; k's and v's at
// g_n·Hkv·D. cuDNN's ragged statistics are token-major ([h·s, 1, h, 1]
// strides, offset g_n·Hq: TransformerEngine's form, and the one the
// frontend's backward sizes its softmax sum by), so under documents the GPU
// keeps them in a (B·T, Hq) buffer beside Anvil's (B, Hq, T) lse and
// transposes between the two.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace anvil {

// One tensor as a cuDNN graph declares it (Tensor_attributes' set_dim and
// set_stride): element [i0, i1, i2, i3] at Σ i·stride from its pointer.
struct CudnnTensorLayout {
  std::array<int64_t, 4> dim{}, stride{};
  int64_t offset(int64_t i0, int64_t i1, int64_t i2, int64_t i3) const {
    return i0 * stride[0] + i1 * stride[1] + i2 * stride[2] + i3 * stride[3];
  }
};

struct SdpaLayout {
  // Causal: b = B, s_q = s_kv = T. Ragged: b = the documents' entries and
  // s_q = s_kv their longest length bucket (SdpaDocuments), and each entry's
  // element [i1, i2, i3] is at its ragged offset + i1·stride[1] + i2·stride[2] +
  // i3·stride[3] (stride[0] unused).
  int64_t b = 0, h_q = 0, h_kv = 0, s_q = 0, s_kv = 0, d = 0;
  // q and o (and, backward, dO and dQ): [b, h_q, s_q, d]; k and v (dK, dV): [b, h_kv, s_kv, d].
  CudnnTensorLayout q, k, v, o;
  CudnnTensorLayout stats;  // [b, h_q, s_q, 1], f32: Anvil's lse
  float attn_scale = 0;     // Anvil's scale, 1/sqrt(d) when 0
  // Anvil's causal mask: query row i sees keys 0..i. cuDNN: diagonal
  // alignment TOP_LEFT with right bound 0 (masks columns beyond row + 0).
  bool causal_top_left = true;
  int64_t diagonal_right_bound = 0;
  bool stats_use_log2 = false;  // natural-log stats, as Anvil's lse and cuDNN's backward expect
  // Documents: ragged q, k, v, o (and dO, dQ, dK, dV) and stats, with the
  // padding mask; an entry's ragged offset is its first token times the
  // elements per token below. The backward is told the tokens in all
  // (max_total_seq_len), so it sizes its f32 dQ accumulator and softmax sum
  // by them rather than by b·s.
  bool ragged = false;
  int64_t q_token_elems = 0, kv_token_elems = 0, stats_token_elems = 0;  // Hq·D, Hkv·D, Hq
  int64_t max_total_seq = 0;                                             // B·T
};

// The layout of attention over q (B, T, Hq, D) and k, v (B, T, Hkv, D), with
// Anvil's `scale` (0 meaning 1/sqrt(D)). Throws anvil::Error, naming the
// shape, for what cuDNN's SDPA cannot take: Hq not a multiple of Hkv, or D not
// a multiple of 8. docs_batch > 0 lays out the documents of SdpaDocuments'
// batch and max_seq (ragged); 0 the causal attention over whole sequences.
SdpaLayout sdpa_layout_of(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, float scale, int64_t docs_batch = 0,
                          int64_t docs_max_seq = 0);

// The documents of B sequences of T tokens as cuDNN's ragged batch. cuDNN
// builds a graph per batch size and length, so both are rounded up to powers
// of two (the length to at least 64, and at most T): a run's micro-batches
// take a few graphs, not one per document count.
struct SdpaDocuments {
  int64_t batch = 0;    // the graph's b: the documents, rounded up
  int64_t max_seq = 0;  // the graph's s_q = s_kv: the longest document, rounded up
  // Per entry: its length (0 for the entries past the last document), and
  // its first token b·T + start (B·T for those past the last; one more entry,
  // B·T, after them).
  std::vector<int32_t> seq_len;
  std::vector<int64_t> first_token;
};
// From documents (B, 2, S) i32 as AttentionWindow::documents holds them (S
// ≥ T; ops/document_mask.h): [b, 0, p] the first position of the document
// holding p, [b, 1, p] the position after its last. Throws anvil::Error on
// bounds that do not cut each sequence's T tokens into documents.
SdpaDocuments sdpa_documents_of(const int32_t* documents, int64_t B, int64_t T, int64_t S);

// The most entries the documents of B sequences of T tokens can take (one
// per token, rounded up as above): the batch the device copy is sized for,
// so its bytes depend on the shape alone, as a dry run (which has no data)
// must see them.
int64_t sdpa_documents_capacity(int64_t B, int64_t T);

// The device copy of the documents, one buffer uploaded per call: the
// entries' lengths (i32, cuDNN's seq_len_q and seq_len_kv) and their ragged
// offsets (i64, in elements) for q/o, k/v and the stats, each array at a
// 256-byte boundary. Byte offsets within the buffer, for `capacity` entries.
struct SdpaDocumentsPack {
  size_t seq_len = 0, q_offset = 0, kv_offset = 0, stats_offset = 0, bytes = 0;
};
SdpaDocumentsPack sdpa_documents_pack_of(int64_t capacity);
// The buffer's bytes for `docs` under `layout` (a ragged one): docs.batch
// lengths and docs.batch + 1 offsets per array, the rest of the capacity zero.
std::vector<std::byte> sdpa_documents_packed(const SdpaDocuments& docs, const SdpaLayout& layout, int64_t capacity);

}  // namespace anvil
