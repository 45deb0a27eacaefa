#include "client/regions.h"

#include <unistd.h>

#include <cstdio>
#include <functional>
#include <iostream>
#include <sstream>

#include "client/exit_codes.h"
#include "client/json_text.h"
#include "shared/connection.h"
#include "shared/units.h"

namespace leasehold::client {
namespace {

const char* state_text(proto::RegionState s) {
  switch (s) {
    case proto::RegionState::Filling: return "filling";
    case proto::RegionState::Ready: return "ready";
    case proto::RegionState::Evicted: return "evicted";
  }
  return "?";
}

Reply ask(const Context& ctx, const Connection::BodyBuilder& build) {
  zmq::context_t zctx(1);
  Connection conn(zctx, ctx.endpoint, "leasehold-cli-" + std::to_string(getpid()), ctx.curve);
  Reply r = conn.request(build, ctx.timeout);
  r.throw_if_error();
  return r;
}

int guarded(const std::function<int()>& f) {
  try {
    return f();
  } catch (const Error& e) {
    std::cerr << "leasehold: " << e.what() << "\n";
    bool bad_input = e.code() == ErrorCode::NoSuchRegion || e.code() == ErrorCode::RegionBusy ||
                     e.code() == ErrorCode::InvalidArgument;
    if (e.code() == ErrorCode::PermissionDenied) return kExitDenied;
    return bad_input ? kExitInvalid : kExitUnreachable;
  } catch (const std::exception& e) {
    std::cerr << "leasehold: " << e.what() << "\n";
    return kExitUnreachable;
  }
}

// "12 s ago" from a Unix ms time stamp.
std::string ago(uint64_t at_ms) {
  if (at_ms == 0) return "-";
  auto now = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                       std::chrono::system_clock::now().time_since_epoch())
                                       .count());
  uint64_t s = now > at_ms ? (now - at_ms) / 1000 : 0;
  if (s < 120) return std::to_string(s) + " s ago";
  if (s < 7200) return std::to_string(s / 60) + " min ago";
  return std::to_string(s / 3600) + " h ago";
}

}  // namespace

nlohmann::json regions_to_json(const proto::RegionList& list) {
  nlohmann::json out;
  out["regions"] = nlohmann::json::array();
  if (list.regions()) {
    for (const auto* r : *list.regions()) {
      nlohmann::json agents = nlohmann::json::array();
      if (r->agents()) {
        for (const auto* a : *r->agents()) agents.push_back(a->str());
      }
      out["regions"].push_back({{"name", std::string(str(r->name()))},
                                {"size_bytes", r->size()},
                                {"offset", r->offset()},
                                {"state", state_text(r->state())},
                                {"refcount", r->refcount()},
                                {"agents", agents},
                                {"filler", std::string(str(r->filler()))},
                                {"last_used_ms", r->last_used_ms()},
                                {"hits", r->hits()},
                                {"misses", r->misses()},
                                {"evictions", r->evictions()}});
    }
  }
  out["hits"] = list.hits();
  out["misses"] = list.misses();
  out["evictions"] = list.evictions();
  return out;
}

std::string regions_to_table(const proto::RegionList& list) {
  std::ostringstream os;
  char line[320];
  std::snprintf(line, sizeof line, "%-40s %10s %-8s %4s %12s %6s %6s %5s  %s\n", "NAME", "SIZE",
                "STATE", "REFS", "LAST USED", "HITS", "MISSES", "EVICT", "AGENTS");
  os << line;
  if (list.regions()) {
    for (const auto* r : *list.regions()) {
      std::string agents;
      if (r->agents()) {
        for (const auto* a : *r->agents()) agents += (agents.empty() ? "" : ",") + a->str();
      }
      if (r->state() == proto::RegionState::Filling) agents += " (filling: " + std::string(str(r->filler())) + ")";
      std::snprintf(line, sizeof line, "%-40s %10s %-8s %4u %12s %6llu %6llu %5u  %s\n",
                    std::string(str(r->name())).c_str(), format_bytes(r->size()).c_str(),
                    state_text(r->state()), r->refcount(), ago(r->last_used_ms()).c_str(),
                    static_cast<unsigned long long>(r->hits()),
                    static_cast<unsigned long long>(r->misses()), r->evictions(),
                    agents.empty() ? "-" : agents.c_str());
      os << line;
    }
  }
  std::snprintf(line, sizeof line, "%llu hits, %llu misses, %llu evictions since the coordinator started\n",
                static_cast<unsigned long long>(list.hits()),
                static_cast<unsigned long long>(list.misses()),
                static_cast<unsigned long long>(list.evictions()));
  os << line;
  return os.str();
}

int list_regions(const Context& ctx) {
  return guarded([&] {
    Reply r = ask(ctx, [](flatbuffers::FlatBufferBuilder& fbb) {
      return std::pair{proto::Body::ListRegions, proto::CreateListRegions(fbb).Union()};
    });
    const auto* list = r->body_as_RegionList();
    if (!list) throw std::runtime_error("coordinator answered ListRegions with something else");
    std::cout << (ctx.json ? json_text(regions_to_json(*list)) + "\n" : regions_to_table(*list));
    return 0;
  });
}

int drop_region(const Context& ctx, const std::string& name) {
  return guarded([&] {
    ask(ctx, [&](flatbuffers::FlatBufferBuilder& fbb) {
      return std::pair{proto::Body::DropRegion,
                       proto::CreateDropRegion(fbb, fbb.CreateString(name)).Union()};
    });
    std::cout << "region '" << name << "' dropped\n";
    return 0;
  });
}

}  // namespace leasehold::client
