#include "anvil/distributed/ddp.h"

#include "anvil/core/profiler.h"

namespace anvil {

DdpGradSync::DdpGradSync(ParamStore& params, Communicator& dp) : params_(params), dp_(dp) {}

void DdpGradSync::progress() {
  // MPI moves data inside these calls: their time is communication the main
  // thread pays for, so it counts as blocked.
  const CommTracker::Blocked blocked(tracker_);
  for (Bucket& b : in_flight_)
    if (b.work.pending() && b.work.test()) tracker_.done(b.id);
}

void DdpGradSync::before_backward(int) {
  if (sync_) progress();
}

void DdpGradSync::after_backward(int group) {
  if (!sync_ || dp_.size() == 1) return;
  const ParamGroup& g = params_.groups()[static_cast<size_t>(group)];
  // The group's bucket: all of it, or its runs around a mixture of experts'
  // expert weights, whose gradients are already whole on the rank holding them.
  for (const auto& [offset, numel] : g.data_parallel_runs) {
    const Tensor bucket = params_.grad_flat().slice(offset, numel);
    const int id = tracker_.start("ddp.all_reduce", layer_of(group), CommOp::all_reduce, bucket.nbytes(), dp_.size());
    in_flight_.push_back({dp_.iall_reduce(bucket), id});
  }
  progress();
}

void DdpGradSync::finish() {
  const ScopedPhase phase(SpanCategory::communication, "ddp.all_reduce.wait");
  {
    const CommTracker::Blocked blocked(tracker_);
    for (Bucket& b : in_flight_) {
      b.work.wait();
      tracker_.done(b.id);
    }
  }
  in_flight_.clear();
}

}  // namespace anvil
