// The ops' GPU sides (ops/gpu_kernels.h: the device branches, attention_gpu,
// cross_entropy_gpu) run end to end without a GPU: the tensors live on a
// host-backed stand-in GPU and the launches go to HostGpuKernels, written from
// each CUDA twin's documented contract (tests/host_backed_gpu.h), the
// products through the cuBLASLt replay. Each op on the "device" is held to the
// CPU op on the same inputs, and a small Llama's forward and backward on it to
// the CPU model's loss and gradients: what this proves is everything above the
// kernels — checks, scratch, chunking, strides, accumulation flags, copies —
// while the kernels' own bodies are proved against the CPU ops elsewhere
// (tests/cuda/).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "anvil/core/device.h"
#include "anvil/core/error.h"
#include "anvil/core/safetensors.h"
#include "anvil/model/llama.h"
#include "anvil/ops/adamw.h"
#include "anvil/ops/attention.h"
#include "anvil/ops/cross_entropy.h"
#include "anvil/ops/embedding.h"
#include "anvil/ops/grad_norm.h"
#include "anvil/ops/matmul.h"
#include "anvil/ops/rmsnorm.h"
#include "anvil/ops/rope.h"
#include "anvil/ops/swiglu.h"
#include "host_backed_gpu.h"
#include "document_bounds.h"
#include "test_util.h"

namespace anvil {
namespace {

using testing::random_tensor;
using testing::rel_error;
using testing::to_double;

const Device kGpu = Device::cuda(0);

class GpuOpsOnHost : public ::testing::Test {
 protected:
  void SetUp() override {
    set_device_runtime(DeviceKind::cuda, &runtime);
    set_gpu_kernels(&kernels);
  }
  void TearDown() override {
    set_gpu_kernels(nullptr);
    set_device_runtime(DeviceKind::cuda, nullptr);
  }
  testing::HostBackedGpu runtime;
  testing::HostGpuKernels kernels;
};

Tensor on_gpu(const Tensor& t) { return t.to(kGpu, MemCategory::workspace, "on_gpu"); }
std::vector<double> back(const Tensor& t) { return to_double(t.to(Device::cpu(), MemCategory::workspace, "back")); }
double tol(DType t) { return t == DType::f32 ? 2e-6 : 1e-2; }

TEST_F(GpuOpsOnHost, LinearProductsMatchTheCpu) {
  for (const DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    const int64_t M = 13, K = 24, N = 17;
    const Tensor x = random_tensor({M, K}, dt, "x"), w = random_tensor({N, K}, dt, "w"),
                 dy = random_tensor({M, N}, dt, "dy");
    Tensor y = Tensor::zeros({M, N}, dt, MemCategory::workspace, "y"), dx = random_tensor({M, K}, dt, "dx0"),
           dw = random_tensor({N, K}, DType::f32, "dw0");
    Tensor gy = on_gpu(y), gdx = on_gpu(dx), gdw = on_gpu(dw);
    linear_forward(x, w, y);
    linear_forward(on_gpu(x), on_gpu(w), gy);
    EXPECT_LT(rel_error(back(gy), to_double(y)), tol(dt));
    linear_backward_input(dy, w, dx, /*accumulate_dx=*/true);
    linear_backward_input(on_gpu(dy), on_gpu(w), gdx, true);
    EXPECT_LT(rel_error(back(gdx), to_double(dx)), tol(dt));
    linear_backward_weight(dy, x, dw);
    linear_backward_weight(on_gpu(dy), on_gpu(x), gdw);
    EXPECT_LT(rel_error(back(gdw), to_double(dw)), tol(dt));
  }
}

TEST_F(GpuOpsOnHost, NormsRopeSwigluAndEmbeddingMatchTheCpu) {
  for (const DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    const int64_t B = 2, T = 5, H = 3, D = 10, M = B * T * H;
    const Tensor x = random_tensor({M, D}, dt, "x"), w = random_tensor({D}, dt, "w"), dy = random_tensor({M, D}, dt, "dy");
    Tensor y = Tensor::empty({M, D}, dt, MemCategory::workspace, "y"), rstd = Tensor::empty({M}, DType::f32, MemCategory::workspace, "r");
    Tensor gy = on_gpu(y), grstd = on_gpu(rstd);
    rmsnorm_forward(x, w, 1e-5f, y, rstd);
    rmsnorm_forward(on_gpu(x), on_gpu(w), 1e-5f, gy, grstd);
    EXPECT_LT(rel_error(back(gy), to_double(y)), tol(dt));
    Tensor dx = random_tensor({M, D}, dt, "dx0"), dw = random_tensor({D}, DType::f32, "dw0");
    Tensor gdx = on_gpu(dx), gdw = on_gpu(dw);
    rmsnorm_backward(dy, x, w, rstd, 1e-5f, dx, dw, /*accumulate_dx=*/true);
    rmsnorm_backward(on_gpu(dy), on_gpu(x), on_gpu(w), grstd, 1e-5f, gdx, gdw, true);
    EXPECT_LT(rel_error(back(gdx), to_double(dx)), tol(dt));
    EXPECT_LT(rel_error(back(gdw), to_double(dw)), tol(dt));

    const RopeTable table = rope_table(16, D, 10000.0);
    RopeTable gtable;
    {
      const ScopedDevice on(kGpu);  // made on the host and copied over
      gtable = rope_table(16, D, 10000.0);
    }
    EXPECT_EQ(gtable.cos.device(), kGpu);
    EXPECT_EQ(back(gtable.sin), to_double(table.sin));
    const Tensor q = random_tensor({B, T, H, D}, dt, "q");
    Tensor rq = Tensor::empty(q.shape(), dt, MemCategory::workspace, "rq"), grq = on_gpu(rq);
    for (const bool inverse : {false, true}) {
      if (inverse) {
        rope_backward(q, table, 3, rq);
        rope_backward(on_gpu(q), gtable, 3, grq);
      } else {
        rope_forward(q, table, 3, rq);
        rope_forward(on_gpu(q), gtable, 3, grq);
      }
      EXPECT_LT(rel_error(back(grq), to_double(rq)), tol(dt)) << (inverse ? "backward" : "forward");
    }

    const Tensor g = random_tensor({M, D}, dt, "g", 3.0f), u = random_tensor({M, D}, dt, "u");
    Tensor h = Tensor::empty({M, D}, dt, MemCategory::workspace, "h"), gh = on_gpu(h);
    swiglu_forward(g, u, h);
    swiglu_forward(on_gpu(g), on_gpu(u), gh);
    EXPECT_LT(rel_error(back(gh), to_double(h)), tol(dt));
    Tensor dg = Tensor::empty({M, D}, dt, MemCategory::workspace, "dg"), du = Tensor::empty({M, D}, dt, MemCategory::workspace, "du");
    Tensor gdg = on_gpu(dg), gdu = on_gpu(du);
    swiglu_backward(dy, g, u, dg, du);
    swiglu_backward(on_gpu(dy), on_gpu(g), on_gpu(u), gdg, gdu);
    EXPECT_LT(rel_error(back(gdg), to_double(dg)), tol(dt));
    EXPECT_LT(rel_error(back(gdu), to_double(du)), tol(dt));

    Tensor tokens, targets;
    testing::make_batch(B, T, 11, tokens, targets);
    const Tensor emb = random_tensor({11, D}, DType::f32, "emb");
    Tensor out = Tensor::empty({B * T, D}, dt, MemCategory::workspace, "out"), gout = on_gpu(out);
    embedding_forward(tokens, emb, out);
    embedding_forward(on_gpu(tokens), on_gpu(emb), gout);
    EXPECT_EQ(back(gout), to_double(out));
    Tensor demb = random_tensor({11, D}, DType::f32, "demb0"), gdemb = on_gpu(demb);
    const Tensor dout = random_tensor({B * T, D}, dt, "dout");
    embedding_backward(dout, tokens, demb);
    embedding_backward(on_gpu(dout), on_gpu(tokens), gdemb);
    EXPECT_LT(rel_error(back(gdemb), to_double(demb)), 1e-6);
  }
}

// bf16 goes through the SDPA calls, f32 through the plain attention's
// per-head products and row softmax; GQA (4 query heads on 2 kv heads);
// causal, and block-causal over documents of 5, 1 and 7 tokens beside a
// whole sequence (bf16: cuDNN's ragged SDPA over the documents' pack).
TEST_F(GpuOpsOnHost, AttentionMatchesTheCpu) {
  const int64_t B = 2, T = 13, Hq = 4, Hkv = 2, D = 8;
  const Tensor blocks = testing::document_bounds({{5, 1, 7}, {13}}, T);
  for (const bool block_causal : {false, true})
    for (const DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << (block_causal ? " block-causal" : " causal"));
      AttentionWindow window;
      if (block_causal) window.documents = blocks;
      const Tensor q = random_tensor({B, T, Hq, D}, dt, "q"), k = random_tensor({B, T, Hkv, D}, dt, "k"),
                   v = random_tensor({B, T, Hkv, D}, dt, "v"), dout = random_tensor({B, T, Hq, D}, dt, "dout");
      Tensor out = Tensor::empty(q.shape(), dt, MemCategory::workspace, "out"),
             lse = Tensor::empty({B, Hq, T}, DType::f32, MemCategory::workspace, "lse");
      Tensor gout = on_gpu(out), glse = on_gpu(lse);
      const int ragged_before = kernels.ragged_calls;
      attention_forward(q, k, v, out, lse, 0, {}, window);
      attention_forward(on_gpu(q), on_gpu(k), on_gpu(v), gout, glse, 0, {}, window);
      EXPECT_LT(rel_error(back(gout), to_double(out)), tol(dt));
      EXPECT_LT(rel_error(back(glse), to_double(lse)), 1e-5);
      Tensor dq = Tensor::empty(q.shape(), dt, MemCategory::workspace, "dq"),
             dk = Tensor::empty(k.shape(), dt, MemCategory::workspace, "dk"),
             dv = Tensor::empty(v.shape(), dt, MemCategory::workspace, "dv");
      Tensor gdq = on_gpu(dq), gdk = on_gpu(dk), gdv = on_gpu(dv);
      attention_backward(dout, q, k, v, out, lse, dq, dk, dv, 0, {}, window);
      attention_backward(on_gpu(dout), on_gpu(q), on_gpu(k), on_gpu(v), gout, glse, gdq, gdk, gdv, 0, {}, window);
      EXPECT_LT(rel_error(back(gdq), to_double(dq)), tol(dt));
      EXPECT_LT(rel_error(back(gdk), to_double(dk)), tol(dt));
      EXPECT_LT(rel_error(back(gdv), to_double(dv)), tol(dt));
      EXPECT_EQ(kernels.ragged_calls - ragged_before, block_causal && dt == DType::bf16 ? 2 : 0);
    }
  // The documents do change the result: causal attention differs from it.
  const Tensor q = random_tensor({B, T, Hq, D}, DType::f32, "q"), k = random_tensor({B, T, Hkv, D}, DType::f32, "k");
  Tensor out = Tensor::empty(q.shape(), DType::f32, MemCategory::workspace, "out"),
         lse = Tensor::empty({B, Hq, T}, DType::f32, MemCategory::workspace, "lse");
  Tensor gout = on_gpu(out), glse = on_gpu(lse);
  attention_forward(q, k, k, out, lse);
  attention_forward(on_gpu(q), on_gpu(k), on_gpu(k), gout, glse, 0, {}, AttentionWindow{0, 0, blocks});
  EXPECT_GT(rel_error(back(gout), to_double(out)), 1e-2);
  // What a GPU does not attend yet is refused, naming what it cannot do.
  const std::string e = testing::error_of([&] {
    attention_forward(on_gpu(q), on_gpu(k), on_gpu(k), gout, glse, 0, {}, AttentionWindow{2, 0, {}});
  });
  EXPECT_NE(e.find("no context parallelism on a GPU"), std::string::npos) << e;
}

// A checkpoint's writer on a GPU's tensors: each comes over in pieces of the
// staging buffer's size (here 12 bytes: pieces that end mid-tensor and a
// short last one), and the file holds exactly the host tensors' bytes.
TEST_F(GpuOpsOnHost, SafetensorsWritesAGpusTensorsPieceByPiece) {
  const Tensor a = random_tensor({5, 7}, DType::f32, "a"), b = random_tensor({3, 3}, DType::bf16, "b");
  const std::string path = (testing::scratch_root() / "gpu_pieces.safetensors").string();
  const Tensor staging = Tensor::empty({3}, DType::i32, MemCategory::workspace, "staging", Device::cpu());
  const int copies_before = runtime.copies;
  save_safetensors(path, {{"a", on_gpu(a)}, {"b", on_gpu(b)}}, {}, {}, staging);
  EXPECT_EQ(runtime.copies - copies_before, 2 + (35 * 4 + 11) / 12 + (9 * 2 + 11) / 12)
      << "two uploads, then the pieces";
  const SafetensorsFile f = load_safetensors(path);
  EXPECT_EQ(to_double(f.tensors.at("a")), to_double(a));
  EXPECT_EQ(to_double(f.tensors.at("b")), to_double(b));
  EXPECT_THROW(save_safetensors(path, {{"a", on_gpu(a)}}), Error) << "a GPU's tensor needs a staging buffer";
}

// The fused head over several vocabulary chunks, the last one short, and
// ignored targets; dx written, dw accumulated.
TEST_F(GpuOpsOnHost, TheFusedHeadMatchesTheCpuOverVocabularyChunks) {
  for (const DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    const int64_t B = 3, T = 5, D = 12, V = 37;
    Tensor tokens, targets;
    testing::make_batch(B, T, V, tokens, targets);
    const Tensor t = targets.view({B * T});
    const Tensor x = random_tensor({B * T, D}, dt, "x"), w = random_tensor({V, D}, dt, "w");
    CrossEntropyOptions opt;
    opt.vocab_chunk = 16;
    Tensor dx = Tensor::empty({B * T, D}, dt, MemCategory::workspace, "dx"), dw = random_tensor({V, D}, DType::f32, "dw0");
    Tensor gdx = on_gpu(dx), gdw = on_gpu(dw);
    const CrossEntropyResult cpu = cross_entropy_forward_backward(x, w, t, 0.25f, dx, dw, opt);
    const int products = kernels.products;
    const CrossEntropyResult gpu = cross_entropy_forward_backward(on_gpu(x), on_gpu(w), on_gpu(t), 0.25f, gdx, gdw, opt);
    // Three chunks (16, 16, 5): the forward's logits, then the backward's logits, dx and dw, per chunk.
    EXPECT_EQ(kernels.products - products, 3 + 3 * 3);
    EXPECT_EQ(gpu.num_tokens, cpu.num_tokens);
    EXPECT_NEAR(gpu.loss_sum, cpu.loss_sum, 1e-5 * std::abs(cpu.loss_sum));
    EXPECT_LT(rel_error(back(gdx), to_double(dx)), tol(dt));
    EXPECT_LT(rel_error(back(gdw), to_double(dw)), tol(dt));
    const CrossEntropyResult eval = cross_entropy_forward(on_gpu(x), on_gpu(w), on_gpu(t), opt);
    EXPECT_NEAR(eval.loss_sum, cpu.loss_sum, 1e-5 * std::abs(cpu.loss_sum));
  }
}

TEST_F(GpuOpsOnHost, AdamwAndTheGradientNormMatchTheCpu) {
  const int64_t n = 1001;
  Tensor p = random_tensor({n}, DType::f32, "p"), g = random_tensor({n}, DType::f32, "g"),
         m = random_tensor({n}, DType::f32, "m", 0.1f), v = random_tensor({n}, DType::f32, "v", 0.1f);
  for (int64_t i = 0; i < n; ++i) v.data<float>()[i] = std::abs(v.data<float>()[i]);
  Tensor pb = Tensor::empty({n}, DType::bf16, MemCategory::workspace, "pb");
  Tensor gp = on_gpu(p), gg = on_gpu(g), gm = on_gpu(m), gv = on_gpu(v), gpb = on_gpu(pb);
  AdamWConfig cfg;
  adamw_step(cfg, 3, p, g, m, v, &pb, 0.5f);
  adamw_step(cfg, 3, gp, gg, gm, gv, &gpb, 0.5f);
  EXPECT_LT(rel_error(back(gp), to_double(p)), 1e-6);
  EXPECT_LT(rel_error(back(gm), to_double(m)), 1e-6);
  EXPECT_LT(rel_error(back(gv), to_double(v)), 1e-6);
  EXPECT_LT(rel_error(back(gpb), to_double(pb)), 4e-3);
  const Tensor parts[] = {g, Tensor::empty({0}, DType::f32, MemCategory::workspace, "empty"), p};
  const Tensor gparts[] = {gg, on_gpu(parts[1]), gp};
  const double norm = grad_sum_of_squares(parts), gnorm = grad_sum_of_squares(gparts);
  EXPECT_NEAR(gnorm, norm, 1e-6 * norm);  // p after the two AdamW steps differs in its last bits
  scale_grads_(parts, 0.5f);
  scale_grads_(gparts, 0.5f);
  EXPECT_EQ(back(gg), to_double(g));
}

// A small Llama (GQA, untied head) trained one micro-batch on the device:
// the model, its parameters' init, its checkpointing policies and the cast
// of each block's weights run as they are under ScopedDevice.
TEST_F(GpuOpsOnHost, ASmallLlamasForwardAndBackwardMatchTheCpu) {
  ModelArgs args = model_flavor("llama3", "debugmodel");
  args.dim = 32, args.n_heads = 4, args.n_kv_heads = 2, args.n_layers = 2, args.vocab_size = 50;
  const int64_t B = 2, T = 12;
  Tensor tokens, targets;
  testing::make_batch(B, T, args.vocab_size, tokens, targets);
  const Tensor gtokens = on_gpu(tokens), gtargets = on_gpu(targets);
  const struct {
    DType dt;
    ComputeCopy copy;
    double loss_tol, grad_tol;
  } cases[] = {{DType::f32, ComputeCopy::whole, 1e-6, 1e-5}, {DType::bf16, ComputeCopy::per_group, 1e-2, 5e-2}};
  for (const auto& c : cases)
    for (const AcPolicy policy : {AcPolicy{AcMode::none, 1}, AcPolicy{AcMode::full, 1}}) {
      SCOPED_TRACE(std::string(dtype_name(c.dt)) + ", AC " + ac_mode_name(policy.mode));
      Llama cpu(args, c.dt, T, LlamaOptions{.compute_copy = c.copy});
      cpu.params().init(7);
      cpu.params().zero_grad();
      const CrossEntropyResult want = cpu.forward_backward(tokens, targets, 1.0f / (B * T), policy);
      const ScopedDevice on(kGpu);
      Llama gpu(args, c.dt, T, LlamaOptions{.compute_copy = c.copy});
      gpu.params().init(7);
      EXPECT_EQ(gpu.params().master_flat().device(), kGpu);
      EXPECT_EQ(back(gpu.params().master_flat()), to_double(cpu.params().master_flat())) << "init differs";
      gpu.params().zero_grad();
      const CrossEntropyResult got = gpu.forward_backward(gtokens, gtargets, 1.0f / (B * T), policy);
      EXPECT_EQ(got.num_tokens, want.num_tokens);
      EXPECT_NEAR(got.loss_sum, want.loss_sum, c.loss_tol * want.loss_sum);
      EXPECT_LT(rel_error(back(gpu.params().grad_flat()), to_double(cpu.params().grad_flat())), c.grad_tol);
    }
}

}  // namespace
}  // namespace anvil
