// Who holds a lease in the coordinator's lease table: an agent, an agent's
// leases fenced after it fell silent or lost its session (held back from
// everyone until its process has exited), a shared cache region's memory,
// or memory a program job's session gave back, held back until its chunks
// have new memory (renewing: that process may have kept the old). A kind
// and a name, never one string parsed apart again.
#pragma once

#include <compare>
#include <string>

namespace leasehold {

struct LeaseOwner {
  enum class Kind : uint8_t { Agent, Fenced, Region, Renewing };
  Kind kind = Kind::Agent;
  std::string name;  // the agent's or the region's

  static LeaseOwner agent(std::string name) { return {Kind::Agent, std::move(name)}; }
  static LeaseOwner fenced(std::string name) { return {Kind::Fenced, std::move(name)}; }
  static LeaseOwner region(std::string name) { return {Kind::Region, std::move(name)}; }
  static LeaseOwner renewing(std::string name) { return {Kind::Renewing, std::move(name)}; }

  bool is_agent() const { return kind == Kind::Agent; }
  auto operator<=>(const LeaseOwner&) const = default;
  bool operator==(const LeaseOwner&) const = default;
  // "agent 'a'", "agent 'a' (fenced)", "region 'data/mnist'": for messages.
  std::string describe() const {
    switch (kind) {
      case Kind::Fenced:
        return "agent '" + name + "' (fenced)";
      case Kind::Region:
        return "region '" + name + "'";
      case Kind::Renewing:
        return "memory of '" + name + "' (renewing)";
      case Kind::Agent:
        break;
    }
    return "agent '" + name + "'";
  }
};

}  // namespace leasehold
