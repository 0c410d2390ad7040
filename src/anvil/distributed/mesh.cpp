#include "anvil/distributed/mesh.h"

#include <limits>
#include <numeric>

namespace anvil {

namespace {

constexpr std::array<const char*, kNumMeshDims> kDegreeKeys = {
    "pipeline_parallel_degree", "data_parallel_replicate_degree", "data_parallel_shard_degree",
    "context_parallel_degree", "tensor_parallel_degree"};

// The dimensions a group spans (pp, dp_replicate, dp_shard, cp, tp); the
// others are fixed within it.
std::array<bool, kNumMeshDims> spans(MeshGroup g) {
  switch (g) {
    case MeshGroup::pp:
      return {true, false, false, false, false};
    case MeshGroup::dp_replicate:
      return {false, true, false, false, false};
    case MeshGroup::dp_shard:
      return {false, false, true, false, false};
    case MeshGroup::cp:
      return {false, false, false, true, false};
    case MeshGroup::tp:
      return {false, false, false, false, true};
    case MeshGroup::dp:
      return {false, true, true, false, false};
    case MeshGroup::dp_shard_cp:
      return {false, false, true, true, false};
    case MeshGroup::dp_cp:
      return {false, true, true, true, false};
    case MeshGroup::ep:
    case MeshGroup::expert_shard:
      break;  // parts of dp: MeshLayout's group functions place them
  }
  return {};
}

// a·b, stopping at int64's maximum: degrees come from a file and may be absurd.
int64_t saturating_mul(int64_t a, int64_t b) {
  if (a != 0 && b > std::numeric_limits<int64_t>::max() / a) return std::numeric_limits<int64_t>::max();
  return a * b;
}

std::string join_divisors(int64_t n) {
  std::string out;
  for (int64_t d = 1; d <= n; ++d)
    if (n % d == 0) {
      if (!out.empty()) out += ", ";
      out += std::to_string(d);
    }
  return out;
}

}  // namespace

const char* mesh_group_name(MeshGroup g) {
  switch (g) {
    case MeshGroup::pp: return "pp";
    case MeshGroup::dp_replicate: return "dp_replicate";
    case MeshGroup::dp_shard: return "dp_shard";
    case MeshGroup::cp:
      return "cp";
    case MeshGroup::tp: return "tp";
    case MeshGroup::dp: return "dp";
    case MeshGroup::dp_shard_cp:
      return "dp_shard_cp";
    case MeshGroup::dp_cp:
      return "dp_cp";
    case MeshGroup::ep:
      return "ep";
    case MeshGroup::expert_shard:
      return "expert_shard";
  }
  return "?";
}

MeshLayout::MeshLayout(int pp, int dp_replicate, int dp_shard, int cp, int tp, int ep)
    : degrees_{pp, dp_replicate, dp_shard, cp, tp}, ep_(ep) {
  for (int d = 0; d < kNumMeshDims; ++d)
    ANVIL_CHECK(degrees_[d] >= 1, "[parallelism] ", kDegreeKeys[d], " is ", degrees_[d], "; it must be at least 1");
  ANVIL_CHECK(ep >= 1, "[parallelism] expert_parallel_degree is ", ep, "; it must be at least 1");
  ANVIL_CHECK(dp_shard % ep == 0 || (dp_shard == 1 && dp_replicate % ep == 0), "[parallelism] expert_parallel_degree ",
              ep, " splits the experts over data-parallel ranks: it must divide data_parallel_shard_degree ", dp_shard,
              dp_shard == 1 ? detail::concat(" or, with that 1, data_parallel_replicate_degree ", dp_replicate)
                            : std::string());
}

MeshLayout MeshLayout::resolve(const ParallelDegrees& degrees, int world_size) {
  ANVIL_ASSERT(world_size >= 1, "world size ", world_size);
  const std::array<int64_t, kNumMeshDims> want = {degrees.pipeline_parallel, degrees.data_parallel_replicate,
                                                  degrees.data_parallel_shard, degrees.context_parallel,
                                                  degrees.tensor_parallel};
  for (int d = 0; d < kNumMeshDims; ++d) {
    if (d == static_cast<int>(MeshDim::dp_shard) && want[d] == -1) continue;
    ANVIL_CHECK(want[d] >= 1, "[parallelism] ", kDegreeKeys[d], " is ", want[d], "; it must be at least 1",
                d == static_cast<int>(MeshDim::dp_shard) ? ", or -1 for the ranks the other degrees leave over" : "");
  }
  const auto deg = [&](MeshDim d) { return want[static_cast<size_t>(d)]; };
  const int64_t others = saturating_mul(
      saturating_mul(saturating_mul(deg(MeshDim::pp), deg(MeshDim::dp_replicate)), deg(MeshDim::cp)), deg(MeshDim::tp));
  const std::string cp_str =
      deg(MeshDim::cp) > 1 ? detail::concat(" x context_parallel_degree ", deg(MeshDim::cp)) : std::string();
  const std::string others_str =
      detail::concat("pipeline_parallel_degree ", deg(MeshDim::pp), " x data_parallel_replicate_degree ",
                     deg(MeshDim::dp_replicate), cp_str, " x tensor_parallel_degree ", deg(MeshDim::tp));

  int64_t shard = deg(MeshDim::dp_shard);
  if (shard == -1) {
    ANVIL_CHECK(world_size % others == 0, "[parallelism] ", others_str, " = ", others,
                " does not divide the world size ", world_size,
                ", so data_parallel_shard_degree = -1 cannot take the ranks left over; change those degrees so "
                "that their product divides ",
                world_size, ", or start a multiple of ", others, " ranks");
    shard = world_size / others;
  } else {
    const int64_t product = saturating_mul(others, shard);
    if (product != world_size) {
      // Suggest every single key that could be changed to make the product right.
      std::string fixes;
      const std::array<MeshDim, kNumMeshDims> order = {MeshDim::dp_shard, MeshDim::tp, MeshDim::pp,
                                                       MeshDim::dp_replicate, MeshDim::cp};
      for (MeshDim d : order) {
        if (d == MeshDim::cp && deg(MeshDim::cp) == 1) continue;  // context parallelism only when asked for
        int64_t rest = 1;
        for (int e = 0; e < kNumMeshDims; ++e)
          if (e != static_cast<int>(d)) rest = saturating_mul(rest, want[e]);
        if (world_size % rest != 0) continue;
        fixes += detail::concat(fixes.empty() ? "change " : ", or ", kDegreeKeys[static_cast<size_t>(d)], " to ",
                                world_size / rest,
                                d == MeshDim::dp_shard ? " (or -1 for the ranks the other degrees leave over)" : "");
      }
      if (fixes.empty())
        fixes = detail::concat("no single degree can be changed to make the product ", world_size,
                               ": change several so that they multiply to ", world_size);
      ANVIL_CHECK(false, "[parallelism] degrees multiply to ", product, " (", "pipeline_parallel_degree ",
                  deg(MeshDim::pp), " x data_parallel_replicate_degree ", deg(MeshDim::dp_replicate),
                  " x data_parallel_shard_degree ", shard, cp_str, " x tensor_parallel_degree ", deg(MeshDim::tp),
                  ") but the world size is ", world_size, " (the ranks mpirun started); ", fixes,
                  product < std::numeric_limits<int64_t>::max() ? detail::concat(", or start ", product, " ranks")
                                                                : std::string());
    }
  }
  ANVIL_CHECK(degrees.expert_parallel >= 1 && degrees.expert_parallel <= world_size,
              "[parallelism] expert_parallel_degree is ", degrees.expert_parallel, "; it must be between 1 and the ",
              world_size, " ranks");
  return MeshLayout(static_cast<int>(deg(MeshDim::pp)), static_cast<int>(deg(MeshDim::dp_replicate)),
                    static_cast<int>(shard), static_cast<int>(deg(MeshDim::cp)), static_cast<int>(deg(MeshDim::tp)),
                    static_cast<int>(degrees.expert_parallel));
}

MeshCoord MeshLayout::coord_of(int rank) const {
  ANVIL_ASSERT(rank >= 0 && rank < world_size(), "rank ", rank, " outside a mesh of ", world_size());
  MeshCoord c;
  for (int d = kNumMeshDims - 1; d >= 0; --d) {
    c.index[d] = rank % degrees_[d];
    rank /= degrees_[d];
  }
  return c;
}

int MeshLayout::rank_of(const MeshCoord& c) const {
  int rank = 0;
  for (int d = 0; d < kNumMeshDims; ++d) {
    ANVIL_ASSERT(c.index[d] >= 0 && c.index[d] < degrees_[d], "coordinate ", c.index[d], " outside degree ",
                 degrees_[d]);
    rank = rank * degrees_[d] + c.index[d];
  }
  return rank;
}

int MeshLayout::group_size(MeshGroup g) const {
  if (g == MeshGroup::ep) return ep_;
  if (g == MeshGroup::expert_shard) return dp_shard() % ep_ == 0 ? dp_shard() / ep_ : 1;
  const auto in = spans(g);
  int n = 1;
  for (int d = 0; d < kNumMeshDims; ++d)
    if (in[d]) n *= degrees_[d];
  return n;
}

int MeshLayout::group_rank(int rank, MeshGroup g) const {
  if (g == MeshGroup::ep) return group_rank(rank, MeshGroup::dp) % ep_;
  if (g == MeshGroup::expert_shard) return group_size(g) == 1 ? 0 : coord_of(rank)[MeshDim::dp_shard] / ep_;
  const MeshCoord c = coord_of(rank);
  const auto in = spans(g);
  int r = 0;
  for (int d = 0; d < kNumMeshDims; ++d)
    if (in[d]) r = r * degrees_[d] + c.index[d];
  return r;
}

int MeshLayout::group_index(int rank, MeshGroup g) const {
  if (g == MeshGroup::ep)  // ep consecutive dp ranks
    return group_index(rank, MeshGroup::dp) * (dp() / ep_) + group_rank(rank, MeshGroup::dp) / ep_;
  if (g == MeshGroup::expert_shard) {  // the dp_shard ranks of one ep rank
    if (group_size(g) == 1) return rank;
    const MeshCoord c = coord_of(rank);
    return group_index(rank, MeshGroup::dp_shard) * ep_ + c[MeshDim::dp_shard] % ep_;
  }
  const MeshCoord c = coord_of(rank);
  const auto in = spans(g);
  int i = 0;
  for (int d = 0; d < kNumMeshDims; ++d)
    if (!in[d]) i = i * degrees_[d] + c.index[d];
  return i;
}

std::vector<int> MeshLayout::group_ranks(int rank, MeshGroup g) const {
  const int index = group_index(rank, g);
  std::vector<int> ranks(static_cast<size_t>(group_size(g)), -1);
  for (int r = 0; r < world_size(); ++r)
    if (group_index(r, g) == index) ranks[static_cast<size_t>(group_rank(r, g))] = r;
  return ranks;
}

std::string MeshLayout::str() const {
  return detail::concat("pp ", pp(), " x dp_replicate ", dp_replicate(), " x dp_shard ", dp_shard(),
                        cp() > 1 ? detail::concat(" x cp ", cp()) : std::string(), " x tp ", tp(),
                        ep_ > 1 ? detail::concat(" x ep ", ep_) : std::string());
}

void check_tensor_parallel_heads(int64_t n_heads, int64_t n_kv_heads, int tp) {
  ANVIL_ASSERT(tp >= 1 && n_heads >= 1 && n_kv_heads >= 1, "tp ", tp, ", heads ", n_heads, "/", n_kv_heads);
  const int64_t both = std::gcd(n_heads, n_kv_heads);
  ANVIL_CHECK(n_heads % tp == 0, "[parallelism] tensor_parallel_degree ", tp, " does not divide the model's n_heads ",
              n_heads, ": tensor parallelism gives each rank whole attention heads; degrees that divide both n_heads ",
              n_heads, " and n_kv_heads ", n_kv_heads, ": ", join_divisors(both));
  ANVIL_CHECK(n_kv_heads % tp == 0, "[parallelism] tensor_parallel_degree ", tp,
              " does not divide the model's n_kv_heads ", n_kv_heads,
              ": tensor parallelism gives each rank whole key/value heads; degrees that divide both n_heads ", n_heads,
              " and n_kv_heads ", n_kv_heads, ": ", join_divisors(both));
}

int64_t gradient_accumulation_steps(int64_t local_batch_size, int64_t global_batch_size, const MeshLayout& mesh) {
  ANVIL_CHECK(local_batch_size >= 1, "training.local_batch_size is ", local_batch_size, "; it must be at least 1");
  if (global_batch_size == -1) return 1;
  ANVIL_CHECK(global_batch_size >= 1, "training.global_batch_size is ", global_batch_size,
              "; it must be at least 1, or -1 for one local batch per data-parallel rank");
  const int64_t step = local_batch_size * mesh.dp();
  if (global_batch_size % step != 0) {
    const int64_t below = global_batch_size / step * step;
    const int64_t above = below + step;
    ANVIL_CHECK(false, "training.global_batch_size ", global_batch_size, " is not a multiple of ",
                "training.local_batch_size ", local_batch_size, " x the data-parallel degree ", mesh.dp(),
                " (data_parallel_replicate_degree ", mesh.dp_replicate(), " x data_parallel_shard_degree ",
                mesh.dp_shard(), ") = ", step,
                ": every data-parallel rank runs whole local batches, as many as the quotient (the "
                "gradient-accumulation steps); use ",
                below > 0 ? detail::concat(below, " or ") : std::string(), above, ", or -1 for ", step);
  }
  return global_batch_size / step;
}

DeviceMesh::DeviceMesh(const Communicator& world, const MeshLayout& layout)
    : layout_(layout), rank_(world.rank()), coord_() {
  ANVIL_CHECK(world.size() == layout.world_size(), "a mesh of ", layout.str(), " = ", layout.world_size(),
              " ranks cannot be laid over a world of ", world.size());
  coord_ = layout_.coord_of(rank_);
  world_ = world.split(0, rank_);
  world_.set_name("world");
  for (int g = 0; g < kNumMeshGroups; ++g) {
    const auto kind = static_cast<MeshGroup>(g);
    // The key is the group rank, so a sub-communicator's ranks follow the mesh
    // coordinates rather than whatever order MPI would pick.
    groups_[g] = world.split(layout_.group_index(rank_, kind), layout_.group_rank(rank_, kind));
    groups_[g].set_name(mesh_group_name(kind));
    ANVIL_ASSERT(groups_[g].size() == layout_.group_size(kind) &&
                     groups_[g].rank() == layout_.group_rank(rank_, kind),
                 mesh_group_name(kind), " group: MPI gave rank ", groups_[g].rank(), " of ", groups_[g].size());
  }
}

DeviceMesh::DeviceMesh(const MeshLayout& layout, int rank)
    : layout_(layout), rank_(rank), coord_(layout.coord_of(rank)), world_(Communicator::dry(rank, layout.world_size())) {
  for (int g = 0; g < kNumMeshGroups; ++g) {
    const auto kind = static_cast<MeshGroup>(g);
    groups_[g] = Communicator::dry(layout_.group_rank(rank_, kind), layout_.group_size(kind));
  }
}

std::unique_ptr<DeviceMesh> DeviceMesh::dry(const MeshLayout& layout, int rank) {
  return std::unique_ptr<DeviceMesh>(new DeviceMesh(layout, rank));
}

}  // namespace anvil
