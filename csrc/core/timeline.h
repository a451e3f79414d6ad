// Chrome trace ("JSON array format") writer that Perfetto and chrome://tracing open.
// Written by the core's background thread; span() also by other threads (a mutex orders the writes).
#pragma once

#include <cstdint>
#include <fstream>
#include <map>
#include <mutex>
#include <string>

namespace commsched {

class Timeline {
 public:
  enum Track : int { kAgreementTrack = 0, kWireTrack = 1, kTensorTrack = 2 };

  Timeline() = default;
  // Opens `path` for rank `rank`; an empty path leaves the timeline disabled.
  void open(const std::string& path, int rank);
  ~Timeline();
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  // Set once by open(), before the core's thread starts: callers on other threads may read it.
  bool enabled() const { return enabled_; }
  static uint64_t now_us();
  // now_us() while tracing, else 0: a clock read costs ~20 ns, a tenth of the core's work on a small collective.
  uint64_t stamp_us() const { return enabled() ? now_us() : 0; }

  void instant(const std::string& name, Track track, uint64_t ts_us, const std::string& args_json = "");
  void async_begin(const std::string& name, const std::string& phase, uint64_t id, uint64_t ts_us);
  void async_end(const std::string& name, const std::string& phase, uint64_t id, uint64_t ts_us);
  void complete(const std::string& name, Track track, uint64_t ts_us, uint64_t dur_us,
                const std::string& args_json);
  void counter(const std::string& name, uint64_t ts_us, double value);
  // A span on a track of its own, named `track` (e.g. "checkpoint"); callable from any thread.
  void span(const std::string& track, const std::string& name, uint64_t ts_us, uint64_t dur_us,
            const std::string& args_json);
  void flush();

  static std::string quote(const std::string& text);

 private:
  void emit(const std::string& event_json);
  std::mutex mutex_;  // uncontended unless a span() comes from another thread
  std::map<std::string, int> named_tracks_;
  std::ofstream out_;
  int rank_ = 0;
  bool first_ = true;
  bool enabled_ = false;
};

}  // namespace commsched
