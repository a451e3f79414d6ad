// Addresses and network-stack identity of this host, for the TCP control channel's bootstrap.
#include "transport/control/host_identity.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

#include "core/types.h"

namespace commsched::control {

namespace {

struct InterfaceAddress {
  std::string interface;
  std::string ip;
  bool loopback = false;
  bool up = false;
};

struct IfaddrsDeleter {
  void operator()(ifaddrs* list) const { freeifaddrs(list); }
};

std::vector<InterfaceAddress> ipv4_addresses() {
  ifaddrs* raw = nullptr;
  if (getifaddrs(&raw) != 0) throw CommError(std::string("control channel: getifaddrs failed: ") + std::strerror(errno));
  const std::unique_ptr<ifaddrs, IfaddrsDeleter> list(raw);
  std::vector<InterfaceAddress> found;
  for (const ifaddrs* entry = list.get(); entry != nullptr; entry = entry->ifa_next) {
    if (entry->ifa_addr == nullptr || entry->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {};
    const auto* address = reinterpret_cast<const sockaddr_in*>(entry->ifa_addr);
    if (inet_ntop(AF_INET, &address->sin_addr, text, sizeof(text)) == nullptr) continue;
    found.push_back({entry->ifa_name, text, (entry->ifa_flags & IFF_LOOPBACK) != 0, (entry->ifa_flags & IFF_UP) != 0});
  }
  return found;
}

}  // namespace

std::vector<std::string> reachable_addresses(const std::string& override_text) {
  const std::vector<InterfaceAddress> all = ipv4_addresses();
  if (!override_text.empty()) {
    in_addr parsed{};
    if (inet_pton(AF_INET, override_text.c_str(), &parsed) == 1) return {override_text};
    for (const InterfaceAddress& address : all) {
      if (address.interface == override_text) return {address.ip};
    }
    std::string known;
    for (const InterfaceAddress& address : all) known += (known.empty() ? "" : ", ") + address.interface;
    throw UsageError("COMMSCHED_CONTROL_ADDRESS=" + override_text +
                     " is neither an IPv4 address nor an interface with one on this host; interfaces with IPv4 "
                     "addresses here: " +
                     (known.empty() ? "none" : known));
  }
  std::vector<std::string> addresses;
  for (const InterfaceAddress& address : all) {
    if (address.up && !address.loopback &&
        std::find(addresses.begin(), addresses.end(), address.ip) == addresses.end()) {
      addresses.push_back(address.ip);
    }
  }
  if (addresses.empty()) addresses.push_back("127.0.0.1");  // a host with loopback only: its ranks share it
  return addresses;
}

std::string network_identity() {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "unknown-host");
  struct stat namespace_file {};
  const std::string stack = stat("/proc/self/ns/net", &namespace_file) == 0
                                ? std::to_string(namespace_file.st_dev) + ":" + std::to_string(namespace_file.st_ino)
                                : "unknown-namespace";
  return std::string(host) + "/" + stack;
}

}  // namespace commsched::control
