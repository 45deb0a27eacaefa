// Shared cache regions end to end with real processes (host backend here,
// cuda on a GPU host with LEASEHOLD_TEST_BACKEND=cuda): a second job on the
// same data attaches the region the first one filled and trains exactly
// like it; an idle region is evicted under memory pressure and refilled by
// the next job; a job started from published parameters begins with the
// publisher's final weights.
#include <gtest/gtest.h>

#include <fstream>
#include <regex>
#include <thread>

#include "agent/engine/ops.h"
#include "agent/region_tensors.h"
#include "lease_client/session.h"
#include "tests/support/cluster.h"
#include "tests/support/synthetic_data.h"

namespace leasehold::testing {
namespace {

using namespace std::chrono_literals;

class RegionsEndToEnd : public ::testing::Test {
 protected:
  void start(const std::string& pool) {
    write_synthetic_idx(cluster.dir(), "train", 600, 1);
    write_synthetic_idx(cluster.dir(), "test", 150, 2);
    coordinator = &cluster.start_coordinator({"--backend", test_backend(), "--pool-size", pool,
                                              "--alignment", "1MiB", "--heartbeat-interval",
                                              "200ms"});
  }
  // A job with a budget well below the pool: a region is placed only in
  // memory no running job is guaranteed (a job without a budget is
  // guaranteed the whole of a pool this small).
  std::string job_file(const std::string& name, const std::string& extra, int hidden = 16) {
    std::string path = cluster.dir() + "/" + name + ".json";
    std::ofstream(path) << synthetic_job_json(cluster.dir(), name,
                                              R"(, "memory_budget": "16MiB")" + extra, hidden);
    return path;
  }
  std::pair<int, std::string> client(std::vector<std::string> args) {
    args.insert(args.begin(), {"--endpoint", cluster.endpoint()});
    return cluster.run("leasehold", args);
  }
  // Submits and follows a job to its end; returns its record.
  nlohmann::json run(const std::string& file, int expect_rc = 0) {
    auto [rc, out] = client({"submit", file, "--follow", "-o", "json"});
    EXPECT_EQ(rc, expect_rc) << out << coordinator->log();
    auto [jrc, jout] = client({"jobs", "-o", "json"});
    return nlohmann::json::parse(jout).back();
  }
  nlohmann::json regions() {
    auto [rc, out] = client({"regions", "-o", "json"});
    EXPECT_EQ(rc, 0) << out;
    return nlohmann::json::parse(out);
  }
  static const nlohmann::json* find(const nlohmann::json& list, const std::string& prefix) {
    for (const auto& r : list["regions"]) {
      if (r["name"].get<std::string>().rfind(prefix, 0) == 0) return &r;
    }
    return nullptr;
  }
  static size_t count(const std::string& text, const std::string& what) {
    size_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  }
  // The digest an agent logged after `what` ("published parameters", ...).
  static std::string digest_after(const std::string& log, const std::string& what) {
    std::smatch m;
    std::regex re(what + "[^\n]*digest ([0-9a-f]{16})");
    return std::regex_search(log, m, re) ? m[1].str() : "";
  }

  Cluster cluster;
  Process* coordinator = nullptr;
};

TEST_F(RegionsEndToEnd, ASecondJobOnTheSameDataAttachesTheRegionAndTrainsAlike) {
  start("256MiB");
  Process& first = cluster.start_agent("first", {});
  auto a = run(job_file("a", R"(, "epochs": 2)"));
  ASSERT_EQ(a["state"], "succeeded") << a.dump(2);
  EXPECT_EQ(a["agent"], "first");
  EXPECT_EQ(count(first.log(), "decoded into region dataset/"), 1u) << first.log();

  // The region stays after the job, unattached, as a cache.
  auto list = regions();
  const auto* r = find(list, "dataset/");
  ASSERT_TRUE(r) << list.dump(2);
  EXPECT_EQ((*r)["state"], "ready");
  EXPECT_EQ((*r)["refcount"], 0);
  EXPECT_EQ((*r)["misses"], 1);
  EXPECT_EQ((*r)["hits"], 0);

  // The next job runs on another agent: it decodes nothing.
  first.signal(SIGTERM);
  ASSERT_TRUE(first.wait(10s).has_value());
  Process& second = cluster.start_agent("second", {});
  auto b = run(job_file("b", R"(, "epochs": 2)"));
  ASSERT_EQ(b["state"], "succeeded") << b.dump(2);
  EXPECT_EQ(b["agent"], "second");
  EXPECT_EQ(count(second.log(), "resident in region dataset/"), 1u) << second.log();
  EXPECT_EQ(count(second.log(), "decoded"), 0u) << second.log();
  list = regions();
  r = find(list, "dataset/");
  ASSERT_TRUE(r);
  EXPECT_EQ((*r)["hits"], 1);
  EXPECT_EQ((*r)["misses"], 1);
  EXPECT_EQ(list["hits"], 1);
  // Same data, same seed: the resident dataset trains exactly like the decoded one.
  EXPECT_EQ(a["test_accuracy"], b["test_accuracy"]);
  ASSERT_EQ(a["epochs"].size(), b["epochs"].size());
  for (size_t i = 0; i < a["epochs"].size(); ++i) {
    EXPECT_EQ(a["epochs"][i]["train_loss"], b["epochs"][i]["train_loss"]) << i;
  }
  // The job records when it started.
  EXPECT_GT(b["first_step_at_us"].get<uint64_t>(), b["assigned_at_us"].get<uint64_t>());
  EXPECT_GE(b["assigned_at_us"].get<uint64_t>() / 1000, b["submitted_ms"].get<uint64_t>());
}

TEST_F(RegionsEndToEnd, AnIdleRegionIsEvictedUnderMemoryPressureAndRefilledByTheNextJob) {
  start("64MiB");
  Process& worker = cluster.start_agent("worker", {});
  auto a = run(job_file("a", R"(, "epochs": 1)"));
  ASSERT_EQ(a["state"], "succeeded") << a.dump(2);
  ASSERT_TRUE(find(regions(), "dataset/"));

  // Another process needs the whole pool: the idle region gives way.
  auto [rc, out] = cluster.run("leasehold-agent", {"--endpoint", cluster.endpoint(), "--name",
                                                   "hog", "--exercise", "--leases", "1",
                                                   "--lease-size", "64MiB", "--rounds", "1",
                                                   "--interval", "10ms"});
  EXPECT_EQ(rc, 0) << out << coordinator->log();
  auto list = regions();
  const auto* r = find(list, "dataset/");
  ASSERT_TRUE(r) << list.dump(2);
  EXPECT_EQ((*r)["state"], "evicted");
  EXPECT_EQ((*r)["evictions"], 1);
  EXPECT_NE(coordinator->log().find("evicted region 'dataset/"), std::string::npos);

  // The next job on the data fills it again.
  auto b = run(job_file("b", R"(, "epochs": 1)"));
  ASSERT_EQ(b["state"], "succeeded") << b.dump(2);
  EXPECT_EQ(count(worker.log(), "decoded into region dataset/"), 2u) << worker.log();
  list = regions();
  r = find(list, "dataset/");
  ASSERT_TRUE(r);
  EXPECT_EQ((*r)["state"], "ready");
  EXPECT_EQ((*r)["misses"], 2);
  EXPECT_EQ(a["test_accuracy"], b["test_accuracy"]);
}

TEST_F(RegionsEndToEnd, AJobStartedFromPublishedParametersBeginsWithThePublishersWeights) {
  start("256MiB");
  Process& worker = cluster.start_agent("worker", {});
  auto a = run(job_file("publisher", R"(, "epochs": 2, "publish_parameters": "base")"));
  ASSERT_EQ(a["state"], "succeeded") << a.dump(2);
  const std::string published = digest_after(worker.log(), "published parameters to region 'params/base'");
  ASSERT_FALSE(published.empty()) << worker.log();
  auto list = regions();
  const auto* p = find(list, "params/base");
  ASSERT_TRUE(p) << list.dump(2);
  EXPECT_EQ((*p)["state"], "ready");

  // Without init_from its first weights would be a fresh initialisation.
  auto b = run(job_file("consumer", R"(, "epochs": 1, "init_from": "base")"));
  ASSERT_EQ(b["state"], "succeeded") << b.dump(2);
  EXPECT_EQ(digest_after(worker.log(), "parameters from region 'params/base'"), published)
      << worker.log();
  // Starting from trained weights, its first epoch is already good.
  EXPECT_GE(b["epochs"][0]["test_accuracy"].get<double>(), a["test_accuracy"].get<double>() - 0.05);

  // Publishing again replaces the (unattached) region.
  auto c = run(job_file("publisher2", R"(, "epochs": 1, "publish_parameters": "base")"));
  ASSERT_EQ(c["state"], "succeeded") << c.dump(2);

  // An absent region and a model of other shapes fail with the reason.
  auto d = run(job_file("absent", R"(, "epochs": 1, "init_from": "nothing")"), 1);
  EXPECT_EQ(d["state"], "failed");
  EXPECT_NE(d["reason"].get<std::string>().find("no region 'params/nothing'"), std::string::npos)
      << d.dump(2);
  auto e = run(job_file("wider", R"(, "epochs": 1, "init_from": "base")", 32), 1);
  EXPECT_EQ(e["state"], "failed");
  EXPECT_NE(e["reason"].get<std::string>().find("does not match the model"), std::string::npos)
      << e.dump(2);

  // Dropped on request once nobody is attached.
  auto [rc, out] = client({"regions", "drop", "params/base"});
  EXPECT_EQ(rc, 0) << out;
  EXPECT_FALSE(find(regions(), "params/base"));
  auto [rc2, out2] = client({"regions", "drop", "params/base"});
  EXPECT_EQ(rc2, 2) << out2;
  EXPECT_NE(out2.find("no region"), std::string::npos) << out2;
}

// Named tensors through a region: written by the filler, read in place by
// another attachment with the same values; a header that is not one is
// refused naming the region.
TEST(RegionTensors, RoundTripInPlaceAndACorruptHeaderIsRefused) {
  namespace E = engine;
  Cluster cluster;
  cluster.start_coordinator({"--backend", test_backend(), "--pool-size", "64MiB", "--alignment",
                             "1MiB", "--heartbeat-interval", "200ms"});
  AgentOptions o;
  o.endpoint = cluster.endpoint();
  o.name = "tensors";
  AgentSession session(o);
  E::manual_seed(4);
  E::nn::NamedTensors tensors{{"w", E::randn({33, 7})},
                              {"labels", E::arange(1000, {E::DType::Int64})},
                              {"scalar", E::full({}, 2.5, {E::DType::Float64})}};
  const uint64_t bytes = regions::packed_size(regions::specs_of(tensors));
  {
    RegionAttachment filler = session.attach_region("t", bytes, true);
    ASSERT_TRUE(filler.must_fill());
    regions::write_tensors(filler, tensors);
    filler.mark_ready();
    auto reader = std::make_shared<RegionAttachment>(session.attach_region("t", 0, false));
    EXPECT_FALSE(reader->must_fill());
    auto read = regions::read_tensors(reader);
    ASSERT_EQ(read.size(), 3u);
    EXPECT_EQ(read[0].first, "w");
    EXPECT_EQ(read[0].second.device(), regions::region_device(*reader));
    EXPECT_EQ(read[0].second.to_vector<float>(), tensors[0].second.to_vector<float>());
    EXPECT_EQ(read[1].second.to_vector<int64_t>(), tensors[1].second.to_vector<int64_t>());
    EXPECT_EQ(read[2].second.sizes(), E::Shape{});
    EXPECT_EQ(read[2].second.item(), 2.5);
    EXPECT_EQ(regions::tensors_digest(read), regions::tensors_digest(tensors));
    // Writing tensors of another size into it is refused.
    EXPECT_THROW(regions::write_tensors(*reader, {{"w", E::randn({3})}}), std::invalid_argument);
  }
  // A region whose header was overwritten.
  RegionAttachment junk = session.attach_region("junk", 1 << 20, true);
  E::from_blob(junk.data(), {1 << 17}, {E::DType::Int64, regions::region_device(junk)}, nullptr)
      .fill_(7);
  junk.mark_ready();
  auto again = std::make_shared<RegionAttachment>(session.attach_region("junk", 0, false));
  try {
    regions::read_tensors(again);
    ADD_FAILURE() << "a junk header was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("region 'junk'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace leasehold::testing
