#include "anvil/train/parallel_dims.h"

#include <cstdlib>
#include <vector>

#include "anvil/core/dry_run.h"
#include "anvil/core/error.h"
#include "anvil/distributed/config_check.h"
#include "anvil/estimate/pipeline_split.h"
#include "anvil/pipeline/executor.h"

namespace anvil {

bool launched_by_mpi_launcher() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "SLURM_NTASKS"})
    if (std::getenv(v) != nullptr) return true;
  return false;
}

void ParallelDims::sum_over_dp(float* values, int n) const {
  if (!mesh || dp_size * cp_size == 1) return;
  Tensor t = Tensor::empty({n}, DType::f32, MemCategory::communication, "dp.sum");
  for (int i = 0; i < n; ++i) t.data<float>()[i] = values[i];
  mesh->group(cp_size > 1 ? MeshGroup::dp_cp : MeshGroup::dp).all_reduce(t);
  for (int i = 0; i < n; ++i) values[i] = t.data<float>()[i];
}

Communicator& ParallelDims::fsdp_shard_group() const {
  return mesh->group(cp_size > 1 ? MeshGroup::dp_shard_cp : MeshGroup::dp_shard);
}

int ParallelDims::max_over_world(int value) const {
  if (!mesh || world_size == 1) return value;
  Tensor t = Tensor::empty({1}, DType::f32, MemCategory::communication, "world.max");
  t.data<float>()[0] = static_cast<float>(value);
  mesh->world().all_reduce(t, ReduceOp::max);
  return static_cast<int>(t.data<float>()[0]);
}

std::vector<double> ParallelDims::gather_world(double value) const { return gather_world(std::vector<double>{value}); }

std::vector<double> ParallelDims::gather_world(const std::vector<double>& values) const {
  if (!mesh || world_size == 1) return values;
  const auto n = static_cast<int64_t>(values.size());
  Tensor mine = Tensor::empty({n}, DType::f32, MemCategory::communication, "world.gather");
  Tensor all = Tensor::empty({world_size * n}, DType::f32, MemCategory::communication, "world.gather");
  for (int64_t i = 0; i < n; ++i) mine.data<float>()[i] = static_cast<float>(values[static_cast<size_t>(i)]);
  mesh->world().all_gather(mine, all);
  if (dry_run()) return std::vector<double>(static_cast<size_t>(world_size * n), 0.0);  // gathered nothing
  return std::vector<double>(all.data<float>(), all.data<float>() + world_size * n);
}

namespace {

// A pipeline micro-batch as the estimators see it.
TrainShape micro_batch_shape(const JobConfig& cfg) {
  return {cfg.parallelism.pipeline_parallel_microbatch_size, cfg.training.seq_len, compute_dtype(cfg),
          activation_checkpoint_policy(cfg)};
}

// Each stage's estimated F, I and W FLOPs per micro-batch: its modules' sums.
std::vector<PipeCosts> stage_costs(const ModelArgs& args, const PipelineSplit& split, const TrainShape& shape) {
  const std::vector<ModuleCost> modules = pipeline_module_costs(args, shape);
  std::vector<PipeCosts> out(static_cast<size_t>(split.stages), PipeCosts{0, 0, 0});
  for (int s = 0; s < split.stages; ++s) {
    const auto [first, end] = pipeline_stage_modules(args, split, s);
    PipeCosts& c = out[static_cast<size_t>(s)];
    for (int k = first; k < end; ++k) {
      const ModuleCost& module = modules[static_cast<size_t>(k)];
      c.forward += module.forward;
      c.backward_input += module.backward_input;
      c.backward_weight += module.backward_weight;
    }
  }
  return out;
}

// The pipeline's schedule and cut (par.pp_schedule, par.pp_split), read and
// checked on every rank with the same message before any work: the schedule
// fixes the stage count, the keys (or the automatic split) the cut.
void setup_pipeline(const JobConfig& cfg, const ModelArgs& args, int P, ParallelDims& par) {
  const auto& p = cfg.parallelism;
  const int m = static_cast<int>(par.pp_micro_batches);
  const int64_t units = args.n_layers + p.pipeline_parallel_first_stage_less_layers +
                        p.pipeline_parallel_last_stage_less_layers;
  const int64_t per_stage = p.pipeline_parallel_layers_per_stage;
  if (!p.pipeline_parallel_schedule_csv.empty()) {
    par.pp_schedule = read_pipeline_schedule_csv(p.pipeline_parallel_schedule_csv, P, m);
  } else {
    int V = schedule_stages_per_rank(p.pipeline_parallel_schedule, 0);
    if (per_stage > 0) {
      ANVIL_CHECK(units % per_stage == 0 && (units / per_stage) % P == 0,
                  "parallelism.pipeline_parallel_layers_per_stage ", per_stage, ": ", args.name, "/", args.flavor,
                  "'s ", args.n_layers, " blocks plus the embedding and head counted as ",
                  p.pipeline_parallel_first_stage_less_layers, " and ", p.pipeline_parallel_last_stage_less_layers,
                  " make ", units, " units, which must split into stages of exactly that many, a multiple of "
                  "pipeline_parallel_degree ", P, " of them");
      V = schedule_stages_per_rank(p.pipeline_parallel_schedule, static_cast<int>(units / per_stage / P));
    }
    par.pp_schedule = make_pipeline_schedule(p.pipeline_parallel_schedule, P, V, m);
  }
  const int S = par.pp_schedule.placement.stages();
  ANVIL_CHECK(per_stage <= 0 || units == per_stage * S, "parallelism.pipeline_parallel_layers_per_stage ", per_stage,
              " makes ", units / per_stage, " stages of ", args.name, "/", args.flavor, ", but the schedule in ",
              p.pipeline_parallel_schedule_csv, " runs ", S);
  par.pp_split = {S, static_cast<int>(p.pipeline_parallel_first_stage_less_layers),
                  static_cast<int>(p.pipeline_parallel_last_stage_less_layers)};
  if (p.pipeline_parallel_auto_split)
    par.pp_split.first_modules = balanced_pipeline_cut(pipeline_module_costs(args, micro_batch_shape(cfg)),
                                                       stage_in_flight(par.pp_schedule));
  for (int s = 0; s < S; ++s) pipeline_stage_modules(args, par.pp_split, s);  // every stage is valid
  // ZBVZeroBubble plans its order with the stages' estimated costs (the
  // head's stage's I carries the head's whole fused pass), so it is planned
  // again now that the cut is known.
  if (p.pipeline_parallel_schedule_csv.empty() && p.pipeline_parallel_schedule == "ZBVZeroBubble")
    par.pp_schedule = make_pipeline_schedule(p.pipeline_parallel_schedule, P, 2, m,
                                             stage_costs(args, par.pp_split, micro_batch_shape(cfg)));
}

}  // namespace

void validate_layout(const JobConfig& cfg, const ModelArgs& args, const MeshLayout& layout) {
  const auto& p = cfg.parallelism;
  ANVIL_CHECK(!p.fsdp_single_rank,
              "parallelism.fsdp_single_rank = true models FSDP2 over one GPU in the GPU planner (anvil estimate "
              "--hardware ...); Anvil's trainer does not shard over one rank: set it false (or remove it) to train");
  ANVIL_CHECK(cfg.training.seq_len <= args.max_seq_len, "training.seq_len ", cfg.training.seq_len, " exceeds ",
              args.name, "/", args.flavor, "'s max_seq_len ", args.max_seq_len);
  const int64_t ep = p.expert_parallel_degree;
  if (ep > 1) {
    ANVIL_CHECK(layout.cp() == 1, "parallelism.expert_parallel_degree ", ep, " with context_parallel_degree ",
                layout.cp(),
                ": expert parallelism over context-parallel ranks is not built yet; set one of them to 1 (context "
                "parallelism alone splits a mixture of experts' sequences, each rank holding every expert)");
    ANVIL_CHECK(args.moe(), "parallelism.expert_parallel_degree ", ep, " splits a mixture of experts' experts, but ",
                args.name, "/", args.flavor, " has none; set it to 1");
    ANVIL_CHECK(args.num_experts % ep == 0, "parallelism.expert_parallel_degree ", ep, " must divide ", args.name,
                "/", args.flavor, "'s ", args.num_experts, " experts");
    ANVIL_CHECK(layout.dp_shard() > 1 || layout.dp_replicate() == ep, "parallelism.expert_parallel_degree ", ep,
                " splits the experts over the data-parallel ranks; under DDP (data_parallel_shard_degree 1) it must "
                "equal data_parallel_replicate_degree (now ",
                layout.dp_replicate(),
                "): DDP replicas of the experts are not built; or shard the model with data_parallel_shard_degree, "
                "a multiple of ",
                ep);
    ANVIL_CHECK(layout.tp() == 1 || layout.dp_shard() == 1, "parallelism.expert_parallel_degree ", ep,
                " with tensor_parallel_degree ", layout.tp(),
                " runs over DDP only (data_parallel_shard_degree 1, data_parallel_replicate_degree ", ep,
                "): FSDP over experts split both ways is not built yet");
  }
  // The rows a micro-batch runs with: the local batch, or under pipeline
  // parallelism each of its pipeline micro-batches.
  int64_t rows = cfg.training.local_batch_size;
  if (layout.pp() > 1) {
    const int64_t mb = p.pipeline_parallel_microbatch_size, local = cfg.training.local_batch_size;
    ANVIL_CHECK(local % mb == 0, "parallelism.pipeline_parallel_microbatch_size ", mb,
                " must divide training.local_batch_size ", local, ": each local batch runs through the pipeline as ",
                "local_batch_size / pipeline_parallel_microbatch_size micro-batches");
    ANVIL_CHECK(!args.tie_embeddings, args.name, "/", args.flavor,
                " ties its embedding and output weights, which pipeline stages cannot split; pick an untied flavour");
    rows = mb;
  }
  if (layout.cp() > 1) {
    const int64_t chunks = 2 * layout.cp();
    ANVIL_CHECK(cfg.training.seq_len % chunks == 0,
                "context parallelism cuts every sequence into 2 x "
                "context_parallel_degree = ",
                chunks, " chunks, which must divide training.seq_len ", cfg.training.seq_len,
                "; use a seq_len that is a multiple of ", chunks);
    cp_load_balancer(p.context_parallel_load_balancer);  // names the key when it is wrong
  }
  if (layout.tp() > 1) {
    check_tensor_parallel_heads(args.n_heads, args.n_kv_heads, layout.tp());
    ANVIL_CHECK(args.ffn_hidden_dim() % layout.tp() == 0, "parallelism.tensor_parallel_degree ", layout.tp(),
                " must divide ", args.name, "/", args.flavor, "'s feed-forward width ", args.ffn_hidden_dim());
    // The model checks this too, in shapes; here it is said in the keys that set it.
    const int64_t tokens = rows * cfg.training.seq_len / layout.cp();  // this rank's chunks under CP
    ANVIL_CHECK(!p.enable_sequence_parallel || tokens % layout.tp() == 0, "sequence parallelism splits the ", tokens,
                " tokens of a micro-batch (",
                layout.pp() > 1 ? "parallelism.pipeline_parallel_microbatch_size" : "training.local_batch_size", " ",
                rows, " x training.seq_len ", cfg.training.seq_len,
                layout.cp() > 1 ? detail::concat(" / context_parallel_degree ", layout.cp()) : std::string(),
                ") over tensor_parallel_degree ", layout.tp(), ", which must divide them; change ",
                layout.pp() > 1 ? "the micro-batch size" : "training.local_batch_size",
                " or training.seq_len, or set "
                "parallelism.enable_sequence_parallel = false");
  }
  if (layout.dp_shard() * layout.cp() > 1)
    ANVIL_CHECK(!args.tie_embeddings, args.name, "/", args.flavor,
                " ties its embedding and output weights, which FSDP does not shard yet; use DDP "
                "(data_parallel_shard_degree = 1, data_parallel_replicate_degree = ", layout.dp(), ")");
}

ParallelDims resolve_parallel(const JobConfig& cfg, const ModelArgs& args, int world_size, int rank) {
  ParallelDims par;
  const auto& p = cfg.parallelism;
  const ParallelDegrees degrees{p.pipeline_parallel_degree,   p.data_parallel_replicate_degree,
                                p.data_parallel_shard_degree, p.tensor_parallel_degree,
                                p.context_parallel_degree,    p.expert_parallel_degree};
  const MeshLayout layout = MeshLayout::resolve(degrees, world_size);
  validate_layout(cfg, args, layout);
  if (layout.pp() > 1) {
    par.pp_micro_batches = cfg.training.local_batch_size / p.pipeline_parallel_microbatch_size;
    setup_pipeline(cfg, args, layout.pp(), par);
  }
  par.accum_steps = gradient_accumulation_steps(cfg.training.local_batch_size, cfg.training.global_batch_size, layout);
  if (world_size == 1) return par;

  par.layout = layout;
  par.rank = rank;
  par.world_size = world_size;
  par.dp_rank = layout.group_rank(par.rank, MeshGroup::dp);
  par.dp_size = layout.dp();
  par.tp_rank = layout.group_rank(par.rank, MeshGroup::tp);
  par.tp_size = layout.tp();
  par.pp_rank = layout.group_rank(par.rank, MeshGroup::pp);
  par.pp_size = layout.pp();
  par.cp_rank = layout.group_rank(par.rank, MeshGroup::cp);
  par.cp_size = layout.cp();
  par.ep_rank = layout.group_rank(par.rank, MeshGroup::ep);
  par.ep_size = layout.ep();
  par.cp_balancer = cp_load_balancer(p.context_parallel_load_balancer);
  par.cp_rotate = cp_rotate_method(p.context_parallel_rotate_method);
  if (layout.dp_shard() * layout.cp() > 1) {
    par.mode = DataParallelMode::fsdp;
    const int shards = layout.dp_shard() * layout.cp();
    par.description = layout.dp_replicate() > 1
                          ? detail::concat("HSDP: ", layout.dp_replicate(), " replicas x ", shards, " shards")
                          : detail::concat("FSDP over ", shards, " ranks");
  } else if (layout.dp_replicate() > 1) {
    par.mode = DataParallelMode::ddp;
    par.description = detail::concat("DDP over ", layout.dp_replicate(), " ranks");
  }
  if (par.ep_size > 1)
    par.description +=
        layout.dp_shard() > 1
            ? detail::concat(
                  " x EP ", par.ep_size, " (experts split over ", par.ep_size, " consecutive FSDP ranks",
                  layout.group_size(MeshGroup::expert_shard) > 1
                      ? detail::concat(", each expert sharded over ", layout.group_size(MeshGroup::expert_shard))
                      : std::string(),
                  ")")
            : detail::concat(" x EP ", par.ep_size, " (experts split over the DDP ranks)");
  if (layout.cp() > 1)
    par.description += detail::concat(" x CP ", layout.cp(), " (", p.context_parallel_load_balancer, ", ",
                                      p.context_parallel_rotate_method, ")");
  if (layout.tp() > 1) {
    const std::string tp = detail::concat("TP ", layout.tp(), p.enable_sequence_parallel ? " with" : " without",
                                          " sequence parallel, loss ",
                                          p.disable_loss_parallel ? "on gathered weights" : "parallel");
    par.description = par.mode == DataParallelMode::single ? tp : par.description + " x " + tp;
  }
  if (layout.pp() > 1) {
    const std::string pp = detail::concat(
        "PP ", layout.pp(), " ranks, ", par.pp_split.stages, " stages (", describe_pipeline_stages(args, par.pp_split,
                                                  par.pp_split.stages > layout.pp() ? &par.pp_schedule.placement
                                                                                    : nullptr),
        "), ", par.pp_schedule.name, ", ", par.pp_micro_batches, " micro-batches of ",
        p.pipeline_parallel_microbatch_size);
    par.description = par.description == "single process" ? pp : par.description + " x " + pp;
  }
  par.description += " (" + layout.str() + ")";
  return par;
}

ParallelDims setup_parallel(const JobConfig& cfg, const ModelArgs& args) {
  const bool mpi = MpiRuntime::active();
  Communicator world = mpi ? Communicator::world() : Communicator();
  const int world_size = mpi ? world.size() : 1;
  if (mpi && world_size > 1) check_same_config(world, config_to_toml(cfg));
  ParallelDims par = resolve_parallel(cfg, args, world_size, mpi ? world.rank() : 0);
  if (world_size > 1) par.mesh = std::make_unique<DeviceMesh>(world, par.layout);
  return par;
}

}  // namespace anvil
