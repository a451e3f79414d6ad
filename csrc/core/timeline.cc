#include "timeline.h"

#include <chrono>
#include <cstdio>
#include <stdexcept>

namespace commsched {

uint64_t Timeline::now_us() {
  // Wall-clock microseconds, so traces of ranks on one host line up side by side.
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
}

std::string Timeline::quote(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

void Timeline::open(const std::string& path, int rank) {
  if (path.empty()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  end_file_locked();
  rank_ = rank;
  out_.open(path, std::ios::out | std::ios::trunc);
  if (!out_) {
    throw std::runtime_error("cannot open the timeline file '" + path +
                             "' for writing; give a writable path (COMMSCHED_TIMELINE or start_timeline)");
  }
  first_ = true;
  named_tracks_.clear();
  out_ << "[\n";
  const std::string pid = std::to_string(rank_);
  write_locked("{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" + pid + ",\"args\":{\"name\":\"rank " + pid +
               "\",\"start_time_since_epoch_in_micros\":" + std::to_string(now_us()) + "}}");
  const char* tracks[] = {"agreement", "wire", "tensors"};
  for (int tid = 0; tid < 3; ++tid) {
    write_locked("{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" + pid + ",\"tid\":" + std::to_string(tid) +
                 ",\"args\":{\"name\":\"" + tracks[tid] + "\"}}");
  }
  enabled_.store(true);
}

void Timeline::close() {
  std::lock_guard<std::mutex> lock(mutex_);
  end_file_locked();
}

void Timeline::end_file_locked() {
  enabled_.store(false);
  if (!out_.is_open()) return;
  out_ << "\n]\n";
  out_.close();
}

Timeline::~Timeline() { close(); }

void Timeline::emit(const std::string& event_json) {
  std::lock_guard<std::mutex> lock(mutex_);
  write_locked(event_json);
}

void Timeline::write_locked(const std::string& event_json) {
  if (!out_.is_open()) return;  // closed between the caller's enabled() and here
  if (!first_) out_ << ",\n";
  first_ = false;
  out_ << event_json;
}

void Timeline::instant(const std::string& name, Track track, uint64_t ts_us, const std::string& args_json) {
  if (!enabled()) return;
  emit("{\"name\":" + quote(name) + ",\"ph\":\"i\",\"s\":\"t\",\"pid\":" + std::to_string(rank_) +
       ",\"tid\":" + std::to_string(track) + ",\"ts\":" + std::to_string(ts_us) +
       (args_json.empty() ? "" : ",\"args\":" + args_json) + "}");
}

void Timeline::async_begin(const std::string& name, const std::string& phase, uint64_t id, uint64_t ts_us) {
  if (!enabled()) return;
  emit("{\"name\":" + quote(phase) + ",\"cat\":\"tensor\",\"ph\":\"b\",\"id\":" + std::to_string(id) +
       ",\"pid\":" + std::to_string(rank_) + ",\"tid\":2,\"ts\":" + std::to_string(ts_us) +
       ",\"args\":{\"tensor\":" + quote(name) + "}}");
}

void Timeline::async_end(const std::string& name, const std::string& phase, uint64_t id, uint64_t ts_us) {
  if (!enabled()) return;
  emit("{\"name\":" + quote(phase) + ",\"cat\":\"tensor\",\"ph\":\"e\",\"id\":" + std::to_string(id) +
       ",\"pid\":" + std::to_string(rank_) + ",\"tid\":2,\"ts\":" + std::to_string(ts_us) +
       ",\"args\":{\"tensor\":" + quote(name) + "}}");
}

void Timeline::complete(const std::string& name, Track track, uint64_t ts_us, uint64_t dur_us,
                        const std::string& args_json) {
  if (!enabled()) return;
  emit("{\"name\":" + quote(name) + ",\"ph\":\"X\",\"pid\":" + std::to_string(rank_) + ",\"tid\":" +
       std::to_string(track) + ",\"ts\":" + std::to_string(ts_us) + ",\"dur\":" + std::to_string(dur_us) +
       ",\"args\":" + args_json + "}");
}

void Timeline::counter(const std::string& name, uint64_t ts_us, double value) {
  if (!enabled()) return;
  emit("{\"name\":" + quote(name) + ",\"ph\":\"C\",\"pid\":" + std::to_string(rank_) +
       ",\"ts\":" + std::to_string(ts_us) + ",\"args\":{\"bytes\":" + std::to_string(value) + "}}");
}

void Timeline::span(const std::string& track, const std::string& name, uint64_t ts_us, uint64_t dur_us,
                    const std::string& args_json) {
  if (!enabled()) return;
  const std::string pid = std::to_string(rank_);
  int tid = 0;
  bool first_use = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto [it, inserted] = named_tracks_.emplace(track, kTensorTrack + 1 + static_cast<int>(named_tracks_.size()));
    tid = it->second;
    first_use = inserted;
  }
  if (first_use) {
    emit("{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" + pid + ",\"tid\":" + std::to_string(tid) +
         ",\"args\":{\"name\":" + quote(track) + "}}");
  }
  emit("{\"name\":" + quote(name) + ",\"ph\":\"X\",\"pid\":" + pid + ",\"tid\":" + std::to_string(tid) +
       ",\"ts\":" + std::to_string(ts_us) + ",\"dur\":" + std::to_string(dur_us) +
       ",\"args\":" + (args_json.empty() ? std::string("{}") : args_json) + "}");
}

void Timeline::flush() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (out_.is_open()) out_.flush();
}

void Timeline::flush_if_due(uint64_t now_us) {
  constexpr uint64_t kFlushInterval_us = 20000;
  if (!enabled() || now_us < last_flush_us_ + kFlushInterval_us) return;
  std::lock_guard<std::mutex> lock(mutex_);
  last_flush_us_ = now_us;
  if (out_.is_open()) out_.flush();
}

}  // namespace commsched
