// The TCP control channel over loopback: ranks are threads of this process, each with its own
// channel, so reports, failures and refused frames are checked against what each rank sent.
#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "transport/control/control_wire.h"
#include "transport/control/tcp_control_channel.h"

using namespace commsched;
using namespace commsched::control;

namespace {

constexpr auto kConnectTimeout = std::chrono::seconds(20);

// Bytes rank `rank` sends in `round`: its size cycles through 0 B .. 1 MiB, different on every rank.
std::string report_of(int rank, int round) {
  static const size_t kSizes[] = {0, 1, 100, 4096, 65536, 1u << 20};
  const size_t bytes = kSizes[(round + rank) % (sizeof(kSizes) / sizeof(kSizes[0]))];
  std::string report(bytes, '\0');
  for (size_t i = 0; i < bytes; ++i) report[i] = static_cast<char>((i * 131 + rank * 17 + round * 7) & 0xff);
  return report;
}

// `size` channels on 127.0.0.1, connected as a job's ranks would be after the bootstrap.
std::vector<std::unique_ptr<TcpControlChannel>> connected_mesh(int size) {
  std::vector<std::unique_ptr<TcpControlChannel>> channels;
  std::vector<std::string> entries;
  for (int rank = 0; rank < size; ++rank) {
    channels.push_back(std::make_unique<TcpControlChannel>(rank, size, "127.0.0.1"));
    entries.push_back(channels.back()->bootstrap_entry());
  }
  std::vector<std::exception_ptr> errors(size);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        channels[rank]->connect(entries, kConnectTimeout);
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const std::exception_ptr& error : errors) {
    if (error) std::rethrow_exception(error);
  }
  return channels;
}

// What one rank's exchange threw: its message and the rank PeerLost named (-2: nothing thrown).
struct Outcome {
  std::string message;
  int blamed = -2;
};

Outcome exchange_outcome(TcpControlChannel& channel, const std::string& mine, double timeout_s) {
  try {
    channel.exchange(mine, timeout_s);
  } catch (const PeerLost& lost) {
    return {lost.what(), lost.rank()};
  } catch (const std::exception& error) {
    return {error.what(), -1};
  }
  return {};
}

// Rank 1 of a 2-rank job played by hand against a real rank 0, which is returned connected.
struct HandPlayedPeer {
  std::unique_ptr<TcpControlChannel> rank0;
  UniqueFd socket;  // rank 1's end of the connection
};

HandPlayedPeer hand_played_peer() {
  HandPlayedPeer job;
  job.rank0 = std::make_unique<TcpControlChannel>(0, 2, "127.0.0.1");
  const std::string entry = job.rank0->bootstrap_entry();
  std::exception_ptr error;
  std::thread accepting([&] {
    try {
      job.rank0->connect({entry, "1 1 127.0.0.1"}, kConnectTimeout);  // rank 0 dials nobody: rank 1's entry is unused
    } catch (...) {
      error = std::current_exception();
    }
  });
  const uint64_t token = std::stoull(entry.substr(0, entry.find(' ')));
  const auto port = static_cast<uint16_t>(std::stoul(entry.substr(entry.find(' ') + 1)));
  std::string why;
  job.socket = connect_with_timeout("127.0.0.1", port, std::chrono::seconds(5), why);
  const std::string hello = encode_hello({token, 1, 2});
  char ack[kAckBytes];
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  const bool answered = job.socket.valid() && write_all(job.socket.get(), hello.data(), hello.size(), deadline) &&
                        read_exact(job.socket.get(), ack, sizeof(ack), deadline);
  accepting.join();
  if (error) std::rethrow_exception(error);
  if (!answered || !ack_matches(ack, 0, token)) throw check::Failure{"rank 0 did not accept the hand-played rank 1: " + why};
  return job;
}

void send_raw(const UniqueFd& socket, const std::string& bytes) {
  if (!write_all(socket.get(), bytes.data(), bytes.size(), Clock::now() + std::chrono::seconds(10))) {
    throw check::Failure{"could not write to rank 0"};
  }
}

std::string frame_header(uint32_t round, uint32_t length) {
  std::string header(kFrameHeaderBytes, '\0');
  encode_frame_header(round, length, header.data());
  return header;
}

}  // namespace

TEST_CASE(control_channel_delivers_every_rank_s_report_of_0_bytes_to_1_mib) {
  for (int size : {2, 3, 4}) {
    auto channels = connected_mesh(size);
    constexpr int kRounds = 8;
    std::vector<std::string> failures(size);
    std::vector<std::thread> threads;
    for (int rank = 0; rank < size; ++rank) {
      threads.emplace_back([&, rank] {
        try {
          for (int round = 0; round < kRounds; ++round) {
            // Spinning and sleeping ranks mixed: a spin covers partial sends and receives too.
            const auto spin = std::chrono::microseconds((rank + round) % 2 == 0 ? 50 : 0);
            const std::vector<std::string> reports = channels[rank]->exchange(report_of(rank, round), 30.0, spin);
            if (static_cast<int>(reports.size()) != size) throw std::runtime_error("wrong number of reports");
            for (int peer = 0; peer < size; ++peer) {
              if (reports[peer] != report_of(peer, round)) {
                throw std::runtime_error("round " + std::to_string(round) + ": rank " + std::to_string(peer) +
                                         "'s report differs from what it sent");
              }
            }
          }
        } catch (const std::exception& error) {
          failures[rank] = error.what();
        }
      });
    }
    for (std::thread& thread : threads) thread.join();
    for (int rank = 0; rank < size; ++rank) EXPECT_EQ(failures[rank], std::string());
  }
}

TEST_CASE(control_channel_names_a_peer_that_exits_instead_of_waiting_for_it) {
  auto channels = connected_mesh(3);
  channels[2].reset();  // rank 2 exits: its sockets close
  std::vector<Outcome> outcomes(2);
  std::vector<std::thread> threads;
  // A timeout far beyond the test's patience: only the closed connection can end the wait.
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] { outcomes[rank] = exchange_outcome(*channels[rank], "report", 600.0); });
  }
  for (std::thread& thread : threads) thread.join();
  for (const Outcome& outcome : outcomes) {
    EXPECT_EQ(outcome.blamed, 2);
    EXPECT(outcome.message.find("rank 2 closed its connection") != std::string::npos);
  }
  // The channel stays failed with the same reason.
  EXPECT_THROWS(channels[0]->exchange("again", 1.0), PeerLost, "rank 2 closed its connection");
}

TEST_CASE(control_channel_timeout_names_the_silent_rank) {
  auto channels = connected_mesh(3);
  std::vector<Outcome> outcomes(3);
  std::vector<std::thread> threads;
  for (int rank : {0, 2}) {  // rank 1 stays connected but never reports
    threads.emplace_back([&, rank] { outcomes[rank] = exchange_outcome(*channels[rank], "report", 0.5); });
  }
  for (std::thread& thread : threads) thread.join();
  for (int rank : {0, 2}) {
    EXPECT_EQ(outcomes[rank].blamed, 1);
    EXPECT(outcomes[rank].message.find("no report from rank 1 within 0.5s") != std::string::npos);
  }
}

TEST_CASE(control_channel_spin_longer_than_the_timeout_still_names_the_silent_rank_at_the_timeout) {
  auto channels = connected_mesh(2);
  const auto started = Clock::now();
  Outcome outcome;
  try {
    channels[0]->exchange("report", 0.3, std::chrono::seconds(30));
  } catch (const PeerLost& lost) {
    outcome = {lost.what(), lost.rank()};
  }
  const double waited_s = std::chrono::duration<double>(Clock::now() - started).count();
  EXPECT_EQ(outcome.blamed, 1);
  EXPECT(outcome.message.find("no report from rank 1 within 0.3s") != std::string::npos);
  EXPECT(waited_s < 10.0);  // the timeout, not the 30 s spin, ended the wait
}

TEST_CASE(control_channel_refuses_an_oversized_frame) {
  HandPlayedPeer job = hand_played_peer();
  send_raw(job.socket, frame_header(0, kMaxFrameBytes + 1));
  const Outcome outcome = exchange_outcome(*job.rank0, "report", 10.0);
  EXPECT_EQ(outcome.blamed, 1);
  EXPECT(outcome.message.find("rank 1 announced a report of " + std::to_string(kMaxFrameBytes + 1) + " bytes") !=
         std::string::npos);
  EXPECT(outcome.message.find("refused") != std::string::npos);
}

TEST_CASE(control_channel_refuses_a_malformed_or_out_of_step_frame) {
  {
    HandPlayedPeer job = hand_played_peer();
    send_raw(job.socket, std::string(kFrameHeaderBytes, 'x'));
    const Outcome outcome = exchange_outcome(*job.rank0, "report", 10.0);
    EXPECT_EQ(outcome.blamed, 1);
    EXPECT(outcome.message.find("malformed frame from rank 1") != std::string::npos);
  }
  {
    HandPlayedPeer job = hand_played_peer();
    send_raw(job.socket, frame_header(7, 2) + "hi");
    const Outcome outcome = exchange_outcome(*job.rank0, "report", 10.0);
    EXPECT_EQ(outcome.blamed, 1);
    EXPECT(outcome.message.find("round 7 during round 0") != std::string::npos);
  }
  {
    // A well-formed frame from the hand-played rank goes through: the refusals above are about the frames.
    HandPlayedPeer job = hand_played_peer();
    send_raw(job.socket, frame_header(0, 5) + "hello");
    const std::vector<std::string> reports = job.rank0->exchange("mine", 10.0);
    EXPECT_EQ(reports[0], std::string("mine"));
    EXPECT_EQ(reports[1], std::string("hello"));
  }
}

TEST_CASE(control_channel_ignores_a_dialler_without_the_job_s_token) {
  auto rank0 = std::make_unique<TcpControlChannel>(0, 2, "127.0.0.1");
  const std::string entry = rank0->bootstrap_entry();
  const uint64_t token = std::stoull(entry.substr(0, entry.find(' ')));
  const auto port = static_cast<uint16_t>(std::stoul(entry.substr(entry.find(' ') + 1)));
  std::string error;
  std::thread accepting([&] {
    try {
      rank0->connect({entry, "1 1 127.0.0.1"}, std::chrono::seconds(2));
    } catch (const std::exception& failure) {
      error = failure.what();
    }
  });
  std::string why;
  UniqueFd stranger = connect_with_timeout("127.0.0.1", port, std::chrono::seconds(5), why);
  EXPECT(stranger.valid());
  const std::string hello = encode_hello({token + 1, 1, 2});
  char ack[kAckBytes];
  bool acked = false;
  try {
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    acked = write_all(stranger.get(), hello.data(), hello.size(), deadline) &&
            read_exact(stranger.get(), ack, sizeof(ack), deadline);
  } catch (const CommError&) {  // dropped: the connection closes without an answer
  }
  accepting.join();
  EXPECT(!acked);
  EXPECT(error.find("rank 1 did not connect to rank 0") != std::string::npos);
}
