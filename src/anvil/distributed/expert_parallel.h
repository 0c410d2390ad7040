// Expert parallelism's exchange of routed rows over an MPI group (the model
// layer's ExpertExchange, model/moe_feed_forward.h): first the counts per
// (rank, local expert), one all-to-all of El values per rank, then the rows,
// an all-to-all-v. Byte counts land in the group's counters as all_to_all.
#pragma once
#include <vector>

#include "anvil/distributed/comm.h"
#include "anvil/model/moe_feed_forward.h"

namespace anvil {

class MpiExpertExchange : public ExpertExchange {
 public:
  // dry_load: in a dry run, the rows every rank's experts receive as a
  // multiple of what it sends (1: the balanced case).
  explicit MpiExpertExchange(Communicator& group, double dry_load = 1.0) : group_(group), dry_load_(dry_load) {}
  int size() const override { return group_.size(); }
  int rank() const override { return group_.rank(); }
  // In a dry run no other rank speaks: every source is taken to send this
  // rank's experts what this rank sends them, times dry_load (rounded up).
  // With 1 and forced-balanced routing that is exact, since every rank of
  // the group routes sequences of the same length by the same rule (expert
  // parallelism refuses context parallelism, whose chunks would differ).
  std::vector<int64_t> exchange_counts(const std::vector<int64_t>& counts) override;
  void exchange_rows(const Tensor& send, const std::vector<int64_t>& send_rows, const Tensor& recv,
                     const std::vector<int64_t>& recv_rows) override {
    group_.all_to_all_v(send, send_rows, recv, recv_rows);
  }

 private:
  Communicator& group_;
  double dry_load_;
};

}  // namespace anvil
