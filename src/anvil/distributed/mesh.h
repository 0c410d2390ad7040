// The device mesh: the world's ranks laid out as a 5-D grid, outermost first
//   pp × dp_replicate × dp_shard × cp × tp
// (as torchtitan), so tensor-parallel ranks — the chattiest group — are
// neighbours (rank r and r+1 differ in tp first), then the context-parallel
// ranks that share their keys and values every layer, and pipeline stages,
// which exchange only activations, are farthest apart. Each rank gets its
// coordinates and one communicator per group: pp, dp_replicate, dp_shard, cp,
// tp; dp = dp_replicate × dp_shard (the ranks that take different sequences);
// dp_shard_cp = dp_shard × cp (FSDP's shards: context-parallel ranks hold
// different tokens of the same sequences, so their gradients add up as those
// of different sequences do) and dp_cp = dp_replicate × dp_shard × cp (every
// rank whose gradients sum, and whose losses and tokens count together).
//
// Expert parallelism borrows its ranks from the data-parallel ones, as
// torchtitan's does: the ep group is ep consecutive dp ranks (inside dp_shard
// when ep divides it, else — dp_shard 1 — consecutive replicas), which split a
// mixture of experts' experts; expert_shard is the dp_shard ranks holding the
// same experts (dp_shard / ep of them, or the rank alone), over which FSDP
// shards those experts.
//
// The layout maths and the checks of a configuration against the world and the
// model are pure functions, testable without MPI; only DeviceMesh talks to MPI.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "anvil/distributed/comm.h"

namespace anvil {

// The [parallelism] degrees as configured. data_parallel_shard may be -1: the
// ranks the other degrees leave over.
struct ParallelDegrees {
  int64_t pipeline_parallel = 1;
  int64_t data_parallel_replicate = 1;
  int64_t data_parallel_shard = -1;
  int64_t tensor_parallel = 1;
  int64_t context_parallel = 1;
  int64_t expert_parallel = 1;
};

// The mesh's dimensions, outermost first.
enum class MeshDim : uint8_t { pp, dp_replicate, dp_shard, cp, tp };
inline constexpr int kNumMeshDims = 5;

// The groups ranks communicate in: one per dimension, and the combinations
// above.
enum class MeshGroup : uint8_t { pp, dp_replicate, dp_shard, cp, tp, dp, dp_shard_cp, dp_cp, ep, expert_shard };
inline constexpr int kNumMeshGroups = 10;
const char* mesh_group_name(MeshGroup g);

// A rank's position in the mesh, one index per MeshDim.
struct MeshCoord {
  std::array<int, kNumMeshDims> index{};
  int operator[](MeshDim d) const { return index[static_cast<size_t>(d)]; }
  int& operator[](MeshDim d) { return index[static_cast<size_t>(d)]; }
  bool operator==(const MeshCoord&) const = default;
};

class MeshLayout {
 public:
  // Every degree at least 1, and ep dividing dp_shard or (dp_shard 1)
  // dp_replicate (anvil::Error otherwise).
  MeshLayout(int pp, int dp_replicate, int dp_shard, int cp, int tp, int ep = 1);

  // The layout for `world_size` ranks: resolves data_parallel_shard = -1 and
  // checks that the degrees multiply to the world size. The message names the
  // product, the world size and which key to change to what.
  static MeshLayout resolve(const ParallelDegrees& degrees, int world_size);

  int degree(MeshDim d) const { return degrees_[static_cast<size_t>(d)]; }
  int pp() const { return degree(MeshDim::pp); }
  int dp_replicate() const { return degree(MeshDim::dp_replicate); }
  int dp_shard() const { return degree(MeshDim::dp_shard); }
  int cp() const { return degree(MeshDim::cp); }
  int tp() const { return degree(MeshDim::tp); }
  int dp() const { return dp_replicate() * dp_shard(); }
  int ep() const { return ep_; }
  int world_size() const { return pp() * dp() * cp() * tp(); }

  // rank = (((pp·R + dp_replicate)·S + dp_shard)·C + cp)·T + tp
  MeshCoord coord_of(int rank) const;
  int rank_of(const MeshCoord& c) const;

  int group_size(MeshGroup g) const;
  // The rank's index inside its group of kind g: its coordinate along that
  // dimension; for dp, dp_replicate·S + dp_shard (the data-parallel rank).
  int group_rank(int rank, MeshGroup g) const;
  // Which of the world_size / group_size groups of kind g holds the rank.
  int group_index(int rank, MeshGroup g) const;
  // The world ranks of the rank's group of kind g, in group-rank order.
  std::vector<int> group_ranks(int rank, MeshGroup g) const;

  // "pp 1 x dp_replicate 2 x dp_shard 2 x tp 1", with "x cp C" before tp when C > 1
  // and "x ep E" after it when E > 1
  std::string str() const;

 private:
  std::array<int, kNumMeshDims> degrees_;
  int ep_ = 1;
};

// Tensor parallelism splits attention by heads, so tp must divide both the
// query heads and the key/value heads (GQA groups). The message lists the
// degrees that would work.
void check_tensor_parallel_heads(int64_t n_heads, int64_t n_kv_heads, int tp);

// The gradient-accumulation steps of training.global_batch_size (-1: one
// local batch per data-parallel rank), which must be a multiple of
// local_batch_size × the mesh's dp degree; the message says which multiples fit.
int64_t gradient_accumulation_steps(int64_t local_batch_size, int64_t global_batch_size, const MeshLayout& mesh);

// The mesh on the running job: this rank's coordinates and its communicator
// for every group. Construction is collective over `world` (one
// MPI_Comm_split per group); world.size() must be layout.world_size().
class DeviceMesh {
 public:
  DeviceMesh(const Communicator& world, const MeshLayout& layout);
  // World rank `rank`'s mesh for a dry run (core/dry_run.h): every group a
  // dry communicator of the layout's size, with this rank's place in it.
  static std::unique_ptr<DeviceMesh> dry(const MeshLayout& layout, int rank);

  const MeshLayout& layout() const { return layout_; }
  int rank() const { return rank_; }  // in the world
  const MeshCoord& coord() const { return coord_; }

  Communicator& group(MeshGroup g) { return groups_[static_cast<size_t>(g)]; }
  Communicator& world() { return world_; }  // every rank of the job
  Communicator& pp() { return group(MeshGroup::pp); }
  Communicator& dp_replicate() { return group(MeshGroup::dp_replicate); }
  Communicator& dp_shard() { return group(MeshGroup::dp_shard); }
  Communicator& cp() { return group(MeshGroup::cp); }
  Communicator& tp() { return group(MeshGroup::tp); }
  Communicator& dp() { return group(MeshGroup::dp); }

 private:
  DeviceMesh(const MeshLayout& layout, int rank);
  MeshLayout layout_;
  int rank_;
  MeshCoord coord_;
  std::array<Communicator, kNumMeshGroups> groups_;
  Communicator world_;
};

}  // namespace anvil
