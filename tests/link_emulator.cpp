// A network link in user space between two TAP devices, for the multi-host
// tests on kernels without tc's netem (which has no module here): each
// direction serialises frames at RATE bits/s, like a NIC, and hands each to
// the other side DELAY µs after it left, like a cable and a switch; frames
// that find more than 4 MiB queued ahead of them are dropped, like a switch's
// buffer (TCP then resends them).
//
//   link_emulator TAP_A TAP_B RATE_BITS_PER_S DELAY_US READY_FILE [STATS_FILE]
//
// The TAP devices must exist (ip tuntap add mode tap name ...); once attached
// to both it creates READY_FILE, after which they may be moved into network
// namespaces (the attachment moves with them). Runs until SIGTERM or SIGKILL.
// With STATS_FILE it keeps there, rewritten whole within 20 ms of any change,
// what it did to each direction's traffic: the frames and bytes it carried
// and dropped, how long it held each frame (serialisation wait + delay) and
// the wire time it charged for them, so a test can see that its traffic went
// through a slow link without timing anything itself.
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <fstream>
#include <string>
#include <vector>

namespace {

constexpr size_t kQueueBytes = size_t{4} << 20;

double now_us() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<double>(t.tv_sec) * 1e6 + static_cast<double>(t.tv_nsec) * 1e-3;
}

int open_tap(const char* name) {
  const int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK);
  if (fd < 0) {
    std::fprintf(stderr, "link_emulator: cannot open /dev/net/tun: %s\n", std::strerror(errno));
    std::exit(1);
  }
  ifreq ifr{};
  ifr.ifr_flags = IFF_TAP | IFF_NO_PI;
  std::strncpy(ifr.ifr_name, name, IFNAMSIZ - 1);
  if (ioctl(fd, TUNSETIFF, &ifr) != 0) {
    std::fprintf(stderr, "link_emulator: cannot attach to TAP device %s: %s\n", name, std::strerror(errno));
    std::exit(1);
  }
  return fd;
}

struct Frame {
  std::vector<unsigned char> bytes;
  double due_us;
};

struct Counters {
  unsigned long long frames = 0, bytes = 0, dropped_frames = 0, dropped_bytes = 0;
  double held_us_min = 0, held_us_sum = 0, wire_us = 0;  // over delivered frames
};

// One direction of the link.
struct Direction {
  int from, to;
  std::deque<Frame> queue;
  size_t queued = 0;
  double wire_free_us = 0;  // when the last frame taken has been serialised
  Counters counters;
};

// One line per direction, written to a temporary file and renamed over STATS_FILE.
void write_stats(const std::string& path, const Direction (&dirs)[2]) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    const char* names[2] = {"a_to_b", "b_to_a"};
    for (int i = 0; i < 2; ++i) {
      const Counters& c = dirs[i].counters;
      out << names[i] << " frames " << c.frames << " bytes " << c.bytes << " dropped_frames " << c.dropped_frames
          << " dropped_bytes " << c.dropped_bytes << " held_us_min " << c.held_us_min << " held_us_mean "
          << (c.frames > 0 ? c.held_us_sum / static_cast<double>(c.frames) : 0.0) << " wire_us " << c.wire_us << "\n";
    }
  }
  std::rename(tmp.c_str(), path.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6 && argc != 7) {
    std::fprintf(stderr, "usage: link_emulator TAP_A TAP_B RATE_BITS_PER_S DELAY_US READY_FILE [STATS_FILE]\n");
    return 2;
  }
  const double rate = std::strtod(argv[3], nullptr), delay_us = std::strtod(argv[4], nullptr);
  if (!(rate > 0) || !(delay_us >= 0)) {
    std::fprintf(stderr, "link_emulator: the rate must be positive and the delay not negative\n");
    return 2;
  }
  const int a = open_tap(argv[1]), b = open_tap(argv[2]);
  std::ofstream(argv[5]) << "ready\n";
  const std::string stats = argc == 7 ? argv[6] : "";
  Direction dirs[2] = {{a, b, {}, 0, 0, {}}, {b, a, {}, 0, 0, {}}};
  if (!stats.empty()) write_stats(stats, dirs);
  bool changed = false;
  double written_us = now_us();
  std::vector<unsigned char> buf(1 << 16);
  for (;;) {
    // Sleep until a frame is due or one arrives.
    double wait_us = 1e6;
    const double t = now_us();
    for (const Direction& d : dirs)
      if (!d.queue.empty()) wait_us = std::min(wait_us, std::max(0.0, d.queue.front().due_us - t));
    if (changed && !stats.empty()) wait_us = std::min(wait_us, std::max(0.0, written_us + 20e3 - t));
    pollfd fds[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
    timespec timeout{static_cast<time_t>(wait_us / 1e6), static_cast<long>(std::fmod(wait_us, 1e6) * 1e3)};
    if (ppoll(fds, 2, &timeout, nullptr) < 0 && errno != EINTR) {
      std::fprintf(stderr, "link_emulator: ppoll: %s\n", std::strerror(errno));
      return 1;
    }
    for (int i = 0; i < 2; ++i) {
      Direction& d = dirs[i];
      if (fds[i].revents & (POLLERR | POLLHUP | POLLNVAL)) return 0;  // a device went away
      if (!(fds[i].revents & POLLIN)) continue;
      for (;;) {
        const ssize_t n = read(d.from, buf.data(), buf.size());
        if (n <= 0) break;
        const double arrived = now_us();
        if (d.queued + static_cast<size_t>(n) > kQueueBytes) {  // tail drop
          ++d.counters.dropped_frames;
          d.counters.dropped_bytes += static_cast<unsigned long long>(n);
          changed = true;
          continue;
        }
        const double start = std::max(arrived, d.wire_free_us), wire = static_cast<double>(n) * 8.0 / rate * 1e6;
        d.wire_free_us = start + wire;
        d.queue.push_back({std::vector<unsigned char>(buf.begin(), buf.begin() + n), d.wire_free_us + delay_us});
        Counters& c = d.counters;
        const double held = d.wire_free_us + delay_us - arrived;
        c.held_us_min = c.frames == 0 ? held : std::min(c.held_us_min, held);
        c.held_us_sum += held;
        c.wire_us += wire;
        ++c.frames;
        c.bytes += static_cast<unsigned long long>(n);
        changed = true;
        d.queued += static_cast<size_t>(n);
      }
    }
    const double now = now_us();
    for (Direction& d : dirs)
      while (!d.queue.empty() && d.queue.front().due_us <= now) {
        const Frame& f = d.queue.front();
        (void)!write(d.to, f.bytes.data(), f.bytes.size());  // a full device queue drops it, as a NIC would
        d.queued -= f.bytes.size();
        d.queue.pop_front();
      }
    if (changed && !stats.empty() && now - written_us >= 20e3) {
      write_stats(stats, dirs);
      written_us = now;
      changed = false;
    }
  }
}
