// What a rank tells the others about where it is: the IPv4 addresses peers may reach it at, and
// which network stack it runs in (ranks sharing one talk faster through the transport's own path).
#pragma once

#include <string>
#include <vector>

namespace commsched::control {

// Where this rank's control listener is reachable. `override_text` (COMMSCHED_CONTROL_ADDRESS) is
// an IPv4 address or an interface name; empty: every non-loopback IPv4 address of the host that is
// up, in interface order, or 127.0.0.1 when there is none. Throws UsageError for an override that
// names no IPv4 address of this host.
std::vector<std::string> reachable_addresses(const std::string& override_text);

// hostname and the inode of this process's network namespace: equal on two ranks exactly when
// they share one network stack.
std::string network_identity();

}  // namespace commsched::control
