// Chrome trace ("JSON array format") writer that Perfetto and chrome://tracing open.
// Written by the core's background thread; span() also by other threads (a mutex orders the writes).
// open() and close() may come from any thread while the core runs (start_timeline/stop_timeline).
#pragma once

#include <atomic>
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
  // Opens `path` for rank `rank`, ending the file written so far (if any); an empty path does nothing.
  void open(const std::string& path, int rank);
  // Ends the file (a complete JSON array) and stops recording; a no-op when not recording.
  void close();
  ~Timeline();
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  // Callers on any thread may read it; an event begun just before close() is dropped, not torn.
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  // Whether each round of the core is marked (Horovod's mark_cycles), while recording.
  void set_mark_cycles(bool mark) { mark_cycles_.store(mark, std::memory_order_relaxed); }
  bool marks_cycles() const { return enabled() && mark_cycles_.load(std::memory_order_relaxed); }
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
  // Flushes when the last flush is 20 ms older than `now_us`, so a reader sees a running job's events
  // (Horovod's tests read the trace while the job runs); a no-op while not recording.
  void flush_if_due(uint64_t now_us);

  static std::string quote(const std::string& text);

 private:
  void emit(const std::string& event_json);
  void write_locked(const std::string& event_json);  // the caller holds mutex_
  void end_file_locked();
  std::mutex mutex_;  // uncontended unless a span() comes from another thread
  std::map<std::string, int> named_tracks_;
  std::ofstream out_;
  int rank_ = 0;
  bool first_ = true;
  uint64_t last_flush_us_ = 0;
  std::atomic<bool> enabled_{false};
  std::atomic<bool> mark_cycles_{false};
};

}  // namespace commsched
