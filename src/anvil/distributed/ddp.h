// DDP: every data-parallel rank holds the whole model; gradients are summed
// over the ranks in buckets, one per parameter group, each bucket's all-reduce
// started as soon as its group's backward is done, so the communication of
// block l overlaps the backward of blocks l − 1 … 0. MPI progresses
// non-blocking collectives only inside MPI calls, so each hook also tests the
// buckets in flight.
//
// With gradient accumulation only the last micro-batch synchronises
// (set_sync): the earlier ones add into the local gradients, as PyTorch's
// no_sync(), so the bytes moved per step do not grow with the micro-batches.
#pragma once
#include <vector>

#include "anvil/distributed/comm.h"
#include "anvil/distributed/comm_tracker.h"
#include "anvil/model/llama.h"
#include "anvil/model/params.h"

namespace anvil {

class DdpGradSync : public ParamGroupHooks {
 public:
  DdpGradSync(ParamStore& params, Communicator& dp);

  // Whether this micro-batch's backward all-reduces its buckets.
  void set_sync(bool on) { sync_ = on; }
  void before_backward(int group) override;
  void after_backward(int group) override;
  // Waits for every bucket; the gradients are then the sum over the ranks.
  void finish();
  CommTracker& tracker() { return tracker_; }

 private:
  void progress();
  int layer_of(int group) const { return params_.groups()[static_cast<size_t>(group)].layer; }
  ParamStore& params_;
  Communicator& dp_;
  bool sync_ = true;
  struct Bucket {
    Work work;
    int id;  // in tracker_
  };
  std::vector<Bucket> in_flight_;
  CommTracker tracker_;
};

}  // namespace anvil
