// /metrics as rendered from a snapshot (coordinator/metrics.h), and the
// Grafana dashboard's queries checked against it: every Leasehold series a
// panel asks for exists.
#include "coordinator/metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

namespace leasehold::testing {
namespace {

MetricsSnapshot busy_snapshot() {
  MetricsSnapshot s;
  s.devices.reserve(2);
  DeviceSeries& d = s.devices.emplace_back();
  d.gpu = "0";
  d.uuid = "GPU-8d6cf2a1-1b2c-3d4e-5f60-718293a4b5c6";
  d.pool_bytes = 8ull << 30;
  d.used_bytes = 3ull << 30;
  d.free_bytes = 5ull << 30;
  d.largest_free_bytes = 4ull << 30;
  d.occupancy = 0.375;
  d.leases_held = 3;
  d.agents_by_state = {{"idle", 1}, {"running", 2}};
  d.lease_stats.granted(0);
  d.lease_stats.granted(0.004);
  d.lease_stats.granted(90);  // past every bound
  d.lease_stats.refusals = 2;
  // A second GPU, idle.
  DeviceSeries& idle = s.devices.emplace_back();
  idle.gpu = "1";
  idle.uuid = "GPU-00000000-1111-2222-3333-444444444444";
  idle.pool_bytes = idle.free_bytes = idle.largest_free_bytes = 8ull << 30;
  idle.agents_by_state = {{"idle", 1}};
  s.jobs_by_state = {{"queued", 4}, {"running", 2}};
  s.interruptions = {{"agent_died", 1}, {"coordinator_restart", 0}};
  JobSeries j;
  j.gpu = "0";
  j.uuid = s.devices[0].uuid;
  j.id = 7;
  j.name = "mlp \"quoted\"";
  j.agent = "a1";
  j.user = "ada";
  j.interruptions = 2;
  j.samples_per_second = 452142.5;
  j.loss = 0.3125;
  j.test_accuracy = 0.8916;
  j.leased_bytes = 1ull << 30;
  s.running.push_back(j);
  j.id = 8;
  j.name = "fresh";
  j.test_accuracy = -1;  // no epoch yet
  s.running.push_back(j);
  return s;
}

bool has_line(const std::string& text, const std::string& line) {
  return text.find(line + "\n") != std::string::npos;
}

// The value of `series` (name and labels), NaN when absent.
double value_of(const std::string& text, const std::string& series) {
  const auto at = text.find(series + " ");
  if (at == std::string::npos) return NAN;
  return std::stod(text.substr(at + series.size() + 1));
}

TEST(Metrics, SeriesCarryDcgmLabelsAndBaseUnits) {
  const std::string m = render_metrics(busy_snapshot());
  const std::string gpu = R"(gpu="0",UUID="GPU-8d6cf2a1-1b2c-3d4e-5f60-718293a4b5c6")";
  EXPECT_TRUE(has_line(m, "# TYPE leasehold_pool_used_bytes gauge")) << m;
  EXPECT_TRUE(has_line(m, "leasehold_pool_used_bytes{" + gpu + "} 3221225472")) << m;
  EXPECT_TRUE(has_line(m, "leasehold_pool_occupancy_ratio{" + gpu + "} 0.375")) << m;
  EXPECT_TRUE(has_line(m, "leasehold_agents{" + gpu + R"(,state="running"} 2)")) << m;
  EXPECT_TRUE(has_line(m, "# TYPE leasehold_lease_grants_total counter")) << m;
  EXPECT_TRUE(has_line(m, "leasehold_lease_grants_total{" + gpu + "} 3")) << m;
  EXPECT_TRUE(has_line(m, "leasehold_lease_refusals_total{" + gpu + "} 2")) << m;
  // Every device has its series, under the family's one TYPE line.
  const std::string gpu1 = R"(gpu="1",UUID="GPU-00000000-1111-2222-3333-444444444444")";
  EXPECT_TRUE(has_line(m, "leasehold_pool_used_bytes{" + gpu1 + "} 0")) << m;
  EXPECT_TRUE(has_line(m, "leasehold_pool_size_bytes{" + gpu1 + "} 8589934592")) << m;
  EXPECT_TRUE(has_line(m, "leasehold_agents{" + gpu1 + R"(,state="idle"} 1)")) << m;
  EXPECT_TRUE(has_line(m, "leasehold_lease_grants_total{" + gpu1 + "} 0")) << m;
  size_t types = 0;
  for (size_t at = m.find("# TYPE leasehold_pool_used_bytes "); at != std::string::npos;
       at = m.find("# TYPE leasehold_pool_used_bytes ", at + 1)) {
    ++types;
  }
  EXPECT_EQ(types, 1u) << m;
  // The coordinator's own series belong to no one device.
  EXPECT_TRUE(has_line(m, R"(leasehold_jobs{state="queued"} 4)")) << m;
  EXPECT_TRUE(has_line(m, "# TYPE leasehold_job_interruptions_total counter")) << m;
  EXPECT_TRUE(has_line(m, R"(leasehold_job_interruptions_total{cause="agent_died"} 1)")) << m;
  EXPECT_TRUE(has_line(m, R"(leasehold_job_interruptions_total{cause="coordinator_restart"} 0)"))
      << m;
}

TEST(Metrics, GrantLatencyIsACumulativeHistogram) {
  const std::string m = render_metrics(busy_snapshot());
  const std::string b =
      R"(leasehold_lease_grant_latency_seconds_bucket{gpu="0",UUID="GPU-8d6cf2a1-1b2c-3d4e-5f60-718293a4b5c6",le=)";
  EXPECT_TRUE(has_line(m, "# TYPE leasehold_lease_grant_latency_seconds histogram")) << m;
  EXPECT_TRUE(has_line(m, b + R"("0.001"} 1)")) << m;
  EXPECT_TRUE(has_line(m, b + R"("0.005"} 2)")) << m;
  EXPECT_TRUE(has_line(m, b + R"("30"} 2)")) << m;
  EXPECT_TRUE(has_line(m, b + R"("+Inf"} 3)")) << m;
  EXPECT_NE(m.find("leasehold_lease_grant_latency_seconds_sum{gpu=\"0\",UUID=\"GPU-8d6cf2a1-1b2c-"
                   "3d4e-5f60-718293a4b5c6\"} 90.004"),
            std::string::npos)
      << m;
}

TEST(Metrics, RunningJobsHaveLabelledSeriesWithNamesEscaped) {
  const std::string m = render_metrics(busy_snapshot());
  const std::string labels =
      R"({gpu="0",UUID="GPU-8d6cf2a1-1b2c-3d4e-5f60-718293a4b5c6",job_id="7",name="mlp \"quoted\"",agent="a1",user="ada"})";
  EXPECT_TRUE(has_line(m, "leasehold_job_samples_per_second" + labels + " 452142.5")) << m;
  EXPECT_TRUE(has_line(m, "leasehold_job_interrupted_attempts" + labels + " 2")) << m;
  EXPECT_TRUE(has_line(m, "leasehold_job_loss" + labels + " 0.3125")) << m;
  EXPECT_DOUBLE_EQ(value_of(m, "leasehold_job_test_accuracy_ratio" + labels), 0.8916) << m;
  EXPECT_TRUE(has_line(m, "leasehold_job_leased_bytes" + labels + " 1073741824")) << m;
  // Job 8 has no test accuracy yet: no series rather than a made-up value.
  EXPECT_NE(m.find("leasehold_job_loss{gpu=\"0\",UUID=\"GPU-8d6cf2a1-1b2c-3d4e-5f60-718293a4b5c6\","
                   "job_id=\"8\""),
            std::string::npos);
  EXPECT_EQ(m.find("leasehold_job_test_accuracy_ratio{gpu=\"0\",UUID=\"GPU-8d6cf2a1-1b2c-3d4e-5f60-"
                   "718293a4b5c6\",job_id=\"8\""),
            std::string::npos)
      << m;
  // Each family's series are together, under one TYPE line.
  size_t types = 0;
  for (size_t at = m.find("# TYPE leasehold_job_loss "); at != std::string::npos;
       at = m.find("# TYPE leasehold_job_loss ", at + 1)) {
    ++types;
  }
  EXPECT_EQ(types, 1u);
}

TEST(Metrics, LabelValuesAreValidUtf8) {
  auto s = busy_snapshot();
  s.running[0].name =
      "bad\xff\xc0\xafname \xe2\x9c\x93";  // stray byte, overlong '/', then a check mark
  const std::string m = render_metrics(s);
  // Escaped as \xNN (the serializer then doubles the backslash).
  EXPECT_NE(m.find("name=\"bad\\\\xff\\\\xc0\\\\xafname \xe2\x9c\x93\""), std::string::npos) << m;
}

// Every leasehold_* name in a panel's query is a family /metrics serves
// (histogram queries name its _bucket series).
TEST(GrafanaDashboard, QueriesNameSeriesTheCoordinatorServes) {
  std::ifstream in(std::filesystem::path(LEASEHOLD_SOURCE_DIR) / "deploy/grafana/leasehold.json");
  ASSERT_TRUE(in) << "deploy/grafana/leasehold.json";
  const auto dash = nlohmann::json::parse(in);
  const std::string metrics = render_metrics(busy_snapshot());
  std::set<std::string> families;
  std::istringstream lines(metrics);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("# TYPE ", 0) == 0) families.insert(line.substr(7, line.find(' ', 7) - 7));
  }
  const std::regex name(R"(leasehold_[a-z_]+)");
  std::set<std::string> titles;
  size_t queries = 0;
  for (const auto& panel : dash.at("panels")) {
    titles.insert(panel.at("title").get<std::string>());
    for (const auto& target : panel.at("targets")) {
      const std::string expr = target.at("expr");
      ++queries;
      for (std::sregex_iterator it(expr.begin(), expr.end(), name), end; it != end; ++it) {
        std::string n = it->str();
        if (n.size() > 7 && n.compare(n.size() - 7, 7, "_bucket") == 0) n.resize(n.size() - 7);
        EXPECT_TRUE(families.count(n)) << n << " in \"" << expr << "\" is not served";
      }
    }
  }
  EXPECT_GE(queries, 12u);
  // Legends name labels the series have ("job" is Prometheus' own: the
  // coordinator's is job_id).
  const std::set<std::string> labels{"instance", "gpu", "UUID", "job_id", "name", "agent", "state"};
  const std::regex legend_label(R"(\{\{([A-Za-z_]+)\}\})");
  for (const auto& panel : dash.at("panels")) {
    for (const auto& target : panel.at("targets")) {
      const std::string legend = target.value("legendFormat", "");
      for (std::sregex_iterator it(legend.begin(), legend.end(), legend_label), end; it != end;
           ++it) {
        EXPECT_TRUE(labels.count((*it)[1].str())) << (*it)[1].str() << " in \"" << legend << "\"";
      }
    }
  }
  for (const char* t : {"Pool occupancy", "Pool bytes per GPU", "Lease requests per second",
                        "Lease grant latency", "Jobs by state", "Samples/s per job"}) {
    EXPECT_TRUE(titles.count(t)) << "panel " << t;
  }
}

}  // namespace
}  // namespace leasehold::testing
