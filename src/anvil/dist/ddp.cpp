#include "anvil/dist/ddp.h"

#include "anvil/core/profiler.h"

namespace anvil {

DdpGradSync::DdpGradSync(ParamStore& params, Communicator& dp) : params_(params), dp_(dp) {}

void DdpGradSync::progress() {
  for (Work& w : in_flight_)
    if (w.pending()) w.test();
}

void DdpGradSync::before_backward(int) {
  if (sync_) progress();
}

void DdpGradSync::after_backward(int group) {
  if (!sync_ || dp_.size() == 1) return;
  const ParamGroup& g = params_.groups()[static_cast<size_t>(group)];
  const ScopedPhase phase(SpanCategory::communication, "ddp.all_reduce.start", group - 1);
  in_flight_.push_back(dp_.iall_reduce(params_.grad_flat().slice(g.offset, g.numel)));
  progress();
}

void DdpGradSync::finish() {
  const ScopedPhase phase(SpanCategory::communication, "ddp.all_reduce.wait");
  for (Work& w : in_flight_) w.wait();
  in_flight_.clear();
}

}  // namespace anvil
