// The process's resident memory as the kernel counts it: what the tracking
// allocator sees plus what it does not (the binary and its libraries, thread
// stacks, oneDNN's generated code, MPI's shared-memory buffers, the data
// loader's and tokenizer's own containers, heap pages freed but kept).
#pragma once
#include <cstddef>

namespace anvil {

// Resident set now (/proc/self/statm), in bytes; 0 when unreadable.
size_t resident_set_bytes();
// The largest resident set so far (getrusage's ru_maxrss), in bytes.
size_t peak_resident_set_bytes();

}  // namespace anvil
