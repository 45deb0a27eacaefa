#include "client/status_format.h"

#include <cstdio>
#include <sstream>

#include "shared/protocol.h"
#include "shared/units.h"

namespace leasehold {
namespace {

const char* backend_text(proto::Backend b) { return b == proto::Backend::Cuda ? "cuda" : "host"; }
const char* end_text(proto::LeaseEnd e) { return e == proto::LeaseEnd::High ? "high" : "low"; }
const char* holder_text(proto::LeaseHolder h) {
  switch (h) {
    case proto::LeaseHolder::Fenced:
      return "fenced";
    case proto::LeaseHolder::Region:
      return "region";
    case proto::LeaseHolder::Renewing:
      return "renewing";
    default:
      return "agent";
  }
}

}  // namespace

nlohmann::json status_to_json(const proto::StatusReply& s) {
  nlohmann::json j;
  j["devices"] = nlohmann::json::array();
  if (s.devices()) {
    for (const auto* d : *s.devices()) {
      const auto* usage = d->pool();
      const auto* info = usage ? usage->info() : nullptr;
      const uint64_t size = info ? info->size() : 0;
      nlohmann::json dj = {
          {"device", info ? info->device() : 0},
          {"uuid", info ? std::string(str(info->uuid())) : ""},
          {"backend", info ? backend_text(info->backend()) : "unknown"},
          {"device_name", info ? std::string(str(info->device_name())) : ""},
          {"size_bytes", size},
          {"alignment_bytes", info ? info->alignment() : 0},
          {"used_bytes", usage ? usage->used_bytes() : 0},
          {"free_bytes", usage ? usage->free_bytes() : 0},
          {"largest_free_bytes", usage ? usage->largest_free_bytes() : 0},
          {"free_blocks", usage ? usage->free_blocks() : 0},
          {"occupancy", size ? static_cast<double>(usage->used_bytes()) / size : 0.0},
          {"pending_requests", d->pending_requests()},
          {"agents", d->agents()},
          {"standby_agents", d->standby_agents()},
      };
      if (const auto* o = d->occupancy()) {
        dj["policy"] = {{"name", std::string(str(o->policy()))},
                        {"occupancy", o->occupancy()},
                        {"occupancy_future", o->occupancy_future()},
                        {"low_watermark", o->low_watermark()},
                        {"high_watermark", o->high_watermark()},
                        {"reserved_bytes", o->reserved_bytes()},
                        {"reclaimable_bytes", o->reclaimable_bytes()},
                        {"guaranteed_bytes", o->guaranteed_bytes()},
                        {"shrinks_pending", o->shrinks_pending()}};
      }
      j["devices"].push_back(std::move(dj));
    }
  }
  j["agents"] = nlohmann::json::array();
  if (s.agents()) {
    for (const auto* a : *s.agents()) {
      j["agents"].push_back({{"name", std::string(str(a->name()))},
                             {"pid", a->pid()},
                             {"device", a->device()},
                             {"state", agent_state_name(a->state())},
                             {"leased_bytes", a->leased_bytes()},
                             {"lease_count", a->lease_count()},
                             {"last_heartbeat_ms_ago", a->last_heartbeat_ms_ago()},
                             {"job_id", a->job_id()},
                             {"guaranteed_bytes", a->guaranteed_bytes()},
                             {"shrink_pending_bytes", a->shrink_pending_bytes()},
                             {"shrinks", a->shrinks()},
                             {"missed_shrinks", a->missed_shrinks()},
                             {"outside_pool_bytes", a->outside_pool_bytes()},
                             {"mps_thread_percentage", a->mps_thread_percentage()}});
    }
  }
  j["leases"] = nlohmann::json::array();
  if (s.leases()) {
    for (const auto* l : *s.leases()) {
      j["leases"].push_back({{"id", l->id()},
                             {"agent", std::string(str(l->agent()))},
                             {"holder", holder_text(l->holder())},
                             {"device", l->device()},
                             {"offset", l->offset()},
                             {"size", l->size()},
                             {"end", end_text(l->end())},
                             {"generation", l->generation()}});
    }
  }
  j["fences"] = nlohmann::json::array();
  if (s.fences()) {
    for (const auto* f : *s.fences()) {
      j["fences"].push_back({{"agent", std::string(str(f->agent()))},
                             {"pid", f->pid()},
                             {"device", f->device()},
                             {"lease_count", f->lease_count()},
                             {"bytes", f->bytes()},
                             {"since_ms_ago", f->since_ms_ago()},
                             {"state", std::string(str(f->state()))}});
    }
  }
  j["mps_pipe_directory"] = std::string(str(s.mps_pipe_directory()));
  j["uptime_seconds"] = static_cast<double>(s.uptime_ms()) / 1000.0;
  return j;
}

std::string status_to_table(const proto::StatusReply& s) {
  auto j = status_to_json(s);
  std::ostringstream os;
  char line[512];  // an agent row with a 128-character name fits
  std::snprintf(line, sizeof line, "Up %.0f s, %zu device(s)\n", j["uptime_seconds"].get<double>(),
                j["devices"].size());
  os << line;
  for (const auto& p : j["devices"]) {
    std::snprintf(line, sizeof line, "\nDevice %d  %s %s %s\n", p["device"].get<int>(),
                  p["backend"].get<std::string>().c_str(),
                  p["device_name"].get<std::string>().c_str(),
                  p["uuid"].get<std::string>().c_str());
    os << line;
    std::snprintf(line, sizeof line,
                  "  pool    size %s, used %s, free %s (largest block %s), occupancy %.1f%%\n",
                  format_bytes(p["size_bytes"]).c_str(), format_bytes(p["used_bytes"]).c_str(),
                  format_bytes(p["free_bytes"]).c_str(),
                  format_bytes(p["largest_free_bytes"]).c_str(),
                  100.0 * p["occupancy"].get<double>());
    os << line;
    if (p.contains("policy")) {
      const auto& o = p["policy"];
      std::snprintf(line, sizeof line,
                    "  policy  %s: occupancy %.1f%%, future %.1f%% (watermarks %.0f%% / %.0f%%)\n",
                    o["name"].get<std::string>().c_str(), 100 * o["occupancy"].get<double>(),
                    100 * o["occupancy_future"].get<double>(),
                    100 * o["low_watermark"].get<double>(),
                    100 * o["high_watermark"].get<double>());
      os << line;
      std::snprintf(
          line, sizeof line,
          "          guaranteed %s, reserved %s, reclaimable %s, %u shrink(s) pending\n",
          format_bytes(o["guaranteed_bytes"]).c_str(), format_bytes(o["reserved_bytes"]).c_str(),
          format_bytes(o["reclaimable_bytes"]).c_str(), o["shrinks_pending"].get<uint32_t>());
      os << line;
    }
    std::snprintf(line, sizeof line, "  agents  %u (%u standing by)", p["agents"].get<uint32_t>(),
                  p["standby_agents"].get<uint32_t>());
    os << line;
    if (p["pending_requests"].get<uint32_t>() > 0) {
      os << "; " << p["pending_requests"].get<uint32_t>() << " lease request(s) waiting for memory";
    }
    os << "\n";
  }
  const std::string mps = j["mps_pipe_directory"].get<std::string>();
  os << (mps.empty() ? std::string("\nMPS     off\n") : "\nMPS     on (pipe folder " + mps + ")\n");
  os << "\nAgents  (" << j["agents"].size() << ")\n";
  std::snprintf(line, sizeof line, "  %-24s %8s %3s %-8s %6s %12s %12s %7s %12s %12s %5s %14s\n",
                "NAME", "PID", "DEV", "STATE", "JOB", "GUARANTEED", "LEASED", "LEASES", "SHRINKING",
                "OUTSIDE POOL", "MPS", "HEARTBEAT");
  os << line;
  for (const auto& a : j["agents"]) {
    uint64_t job = a["job_id"].get<uint64_t>();
    uint64_t shrinking = a["shrink_pending_bytes"].get<uint64_t>();
    uint64_t outside = a["outside_pool_bytes"].get<uint64_t>();
    const int share = a["mps_thread_percentage"].get<int>();
    const std::string mps_share = mps.empty() ? "-" : share ? std::to_string(share) + "%" : "all";
    std::snprintf(line, sizeof line,
                  "  %-24s %8d %3d %-8s %6s %12s %12s %7u %12s %12s %5s %11llu ms ago\n",
                  a["name"].get<std::string>().c_str(), a["pid"].get<int>(), a["device"].get<int>(),
                  a["state"].get<std::string>().c_str(), job ? std::to_string(job).c_str() : "-",
                  job ? format_bytes(a["guaranteed_bytes"]).c_str() : "-",
                  format_bytes(a["leased_bytes"]).c_str(), a["lease_count"].get<uint32_t>(),
                  shrinking ? format_bytes(shrinking).c_str() : "-",
                  outside ? format_bytes(outside).c_str() : "-", mps_share.c_str(),
                  static_cast<unsigned long long>(a["last_heartbeat_ms_ago"].get<uint64_t>()));
    os << line;
  }
  os << "\nLeases  (" << j["leases"].size() << ")\n";
  std::snprintf(line, sizeof line, "  %8s %3s %-24s %-7s %16s %12s %-4s\n", "ID", "DEV", "HOLDER",
                "KIND", "OFFSET", "SIZE", "END");
  os << line;
  for (const auto& l : j["leases"]) {
    std::snprintf(line, sizeof line, "  %8llu %3d %-24s %-7s %16llu %12s %-4s\n",
                  static_cast<unsigned long long>(l["id"].get<uint64_t>()), l["device"].get<int>(),
                  l["agent"].get<std::string>().c_str(), l["holder"].get<std::string>().c_str(),
                  static_cast<unsigned long long>(l["offset"].get<uint64_t>()),
                  format_bytes(l["size"]).c_str(), l["end"].get<std::string>().c_str());
    os << line;
  }
  if (!j["fences"].empty()) {
    // Memory nobody gets while an agent's process may still write into it.
    os << "\nFenced  (" << j["fences"].size() << ")\n";
    for (const auto& f : j["fences"]) {
      std::snprintf(line, sizeof line, "  %-24s pid %d, device %d: %u lease(s), %s, for %llu ms; ",
                    f["agent"].get<std::string>().c_str(), f["pid"].get<int>(),
                    f["device"].get<int>(), f["lease_count"].get<uint32_t>(),
                    format_bytes(f["bytes"]).c_str(),
                    static_cast<unsigned long long>(f["since_ms_ago"].get<uint64_t>()));
      os << line << f["state"].get<std::string>() << "\n";
    }
  }
  return os.str();
}

}  // namespace leasehold
