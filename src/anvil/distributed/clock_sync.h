// One timeline for the traces of every host. Processes on one host share its
// steady clock; another host's runs from another origin. At start-up rank 0
// measures each other host's offset with MPI ping-pongs (the round trip with
// the shortest time bounds it: the reply was stamped somewhere inside that
// round trip, so the offset is known to ± half of it), and every trace gives
// its times on rank 0's clock.
#pragma once
#include <string>

namespace anvil {

// Collective over MPI_COMM_WORLD, once, after the hosts are known
// (set_world_hosts). Ranks on rank 0's host need no measurement: offset 0.
void synchronize_clocks();
// This rank's steady clock minus rank 0's, in µs (0 without MPI).
double clock_offset_us();
// Half the shortest round trip that measured it, µs (0 on rank 0's host).
double clock_offset_uncertainty_us();
// "b +5000.012 ms ± 0.041 ms" for every host but rank 0's, "; "-separated;
// empty when every rank runs on rank 0's host.
std::string clock_offsets_summary();

}  // namespace anvil
