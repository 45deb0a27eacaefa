// Job specifications (JSON against the schema, validation naming fields) and
// the job runner on a small synthetic IDX dataset.
#include <gtest/gtest.h>
#include <zlib.h>

#include <cmath>
#include <filesystem>
#include <sstream>
#include <fstream>

#include "agent/job_runner.h"
#include "agent/job_spec.h"

namespace leasehold {
namespace {

namespace fs = std::filesystem;

std::string idx(std::vector<uint32_t> dims, const std::vector<uint8_t>& body) {
  std::string s = {0, 0, 8, static_cast<char>(dims.size())};
  for (uint32_t d : dims) {
    for (int shift : {24, 16, 8, 0}) s += static_cast<char>((d >> shift) & 0xff);
  }
  s.append(body.begin(), body.end());
  return s;
}

// Images of 8x8: class 0 bright on the left half, class 1 on the right half,
// class 2 on the top half, with noise. Learnable in a few epochs.
void write_synthetic(const std::string& dir, const std::string& prefix, int n, uint32_t seed) {
  std::vector<uint8_t> px(n * 64), labels(n);
  uint32_t state = seed;
  auto rnd = [&] { return (state = state * 1664525u + 1013904223u) >> 24; };
  for (int i = 0; i < n; ++i) {
    int c = i % 3;
    labels[i] = static_cast<uint8_t>(c);
    for (int y = 0; y < 8; ++y) {
      for (int x = 0; x < 8; ++x) {
        bool on = c == 0 ? x < 4 : c == 1 ? x >= 4 : y < 4;
        px[i * 64 + y * 8 + x] = static_cast<uint8_t>((on ? 150 : 20) + rnd() % 100);
      }
    }
  }
  std::ofstream(dir + "/" + prefix + "-images", std::ios::binary) << idx({uint32_t(n), 8, 8}, px);
  std::ofstream(dir + "/" + prefix + "-labels", std::ios::binary) << idx({uint32_t(n)}, labels);
}

class JobTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/leasehold-job-XXXXXX";
    ASSERT_TRUE(mkdtemp(tmpl));
    dir = tmpl;
    write_synthetic(dir, "train", 600, 1);
    write_synthetic(dir, "test", 150, 2);
  }
  void TearDown() override { fs::remove_all(dir); }

  // `extra` adds fields; the training defaults are in kTrain.
  static constexpr const char* kTrain = R"(, "batch_size": 32, "optimizer": {"type": "Adam", "lr": 0.01})";
  std::string job_json(const std::string& extra = "", const std::string& model = "") const {
    std::string layers = model.empty() ? R"([{"type": "Flatten"}, {"type": "Linear", "in": 64, "out": 16},
                  {"type": "ReLU"}, {"type": "Linear", "in": 16, "out": 3}])"
                                       : model;
    return R"({"name": "synthetic", "model": )" + layers + R"(,
      "dataset": {"train_images": ")" + dir + R"(/train-images", "train_labels": ")" + dir +
           R"(/train-labels", "test_images": ")" + dir + R"(/test-images", "test_labels": ")" +
           dir + R"(/test-labels", "mean": 0.3, "std": 0.3},
      "seed": 3)" + extra + "}";
  }
  std::string dir;
};

std::string problems_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const JobSpecError& e) {
    return e.what();
  }
  return "";
}

TEST_F(JobTest, UnknownFieldsAndWrongTypesAreNamed) {
  std::string e = problems_of([&] { parse_job_json(job_json(R"(, "epochs": 1, "epoks": 2)"), "j.json"); });
  EXPECT_NE(e.find("epoks"), std::string::npos) << e;
  EXPECT_NE(e.find("j.json"), std::string::npos) << e;
  e = problems_of([&] { parse_job_json(job_json(R"(, "epochs": "two")"), "j.json"); });
  EXPECT_FALSE(e.empty());
  e = problems_of([&] { parse_job_json("{ not json", "j.json"); });
  EXPECT_FALSE(e.empty());
  e = problems_of([&] {
    parse_job_json(job_json(R"(, "epochs": 1)", R"([{"type": "Linearr"}])"), "j.json");
  });
  EXPECT_NE(e.find("Linearr"), std::string::npos) << e;
}

TEST_F(JobTest, ValidationNamesEveryBadField) {
  auto buf = parse_job_json(job_json(R"(, "epochs": 0, "batch_size": -4, "memory_budget": "lots",
                                         "optimizer": {"lr": -1}, "device": "tpu")"),
                            "j.json");
  std::string e = problems_of([&] { validate_job(*verify_job(buf), {}); });
  for (const char* field : {"batch_size", "epochs or steps", "memory_budget", "optimizer.lr",
                            "device"}) {
    EXPECT_NE(e.find(field), std::string::npos) << field << " missing from: " << e;
  }
  auto chain = parse_job_json(
      job_json(R"(, "epochs": 1)", R"([{"type": "Flatten"}, {"type": "Linear", "in": 60, "out": 3}])"),
      "j.json");
  e = problems_of([&] { validate_job(*verify_job(chain), {}); });
  EXPECT_NE(e.find("model[1] (Linear): in is 60 but the previous layer produces 64"),
            std::string::npos)
      << e;
  auto no_flatten = parse_job_json(
      job_json(R"(, "epochs": 1)", R"([{"type": "Linear", "in": 64, "out": 3}])"), "j.json");
  e = problems_of([&] { validate_job(*verify_job(no_flatten), {}); });
  EXPECT_NE(e.find("Flatten"), std::string::npos) << e;
  auto big = parse_job_json(job_json(R"(, "epochs": 1, "memory_budget": "8GiB")"), "j.json");
  e = problems_of([&] { validate_job(*verify_job(big), {true, 1ull << 30}); });
  EXPECT_NE(e.find("does not fit the pool"), std::string::npos) << e;
  fs::remove(dir + "/test-labels");
  auto missing = parse_job_json(job_json(R"(, "epochs": 1)"), "j.json");
  e = problems_of([&] { validate_job(*verify_job(missing), {}); });
  EXPECT_NE(e.find("dataset.test_labels"), std::string::npos) << e;
}

TEST_F(JobTest, ExampleJobsAreValid) {
  for (const char* name : {"fashion-mnist-mlp.json", "fashion-mnist-lenet.json"}) {
    std::ifstream in(std::string(LEASEHOLD_SOURCE_DIR) + "/deploy/jobs/" + name);
    std::stringstream text;
    text << in.rdbuf();
    auto buf = parse_job_json(text.str(), name);
    const auto* job = verify_job(buf);
    EXPECT_EQ(job->epochs(), 10);
    EXPECT_EQ(job->batch_size(), 128);
    // The dataset files come from Debian's dataset-fashion-mnist package.
    bool have_data = fs::exists(dataset_files(*job).train_images);
    EXPECT_NO_THROW(validate_job(*job, {have_data, 0})) << name;
  }
}

TEST_F(JobTest, TrainsReportsCheckpointsAndResumes) {
  std::string ck = dir + "/ck";
  auto buf = parse_job_json(
      job_json(kTrain + std::string(R"(, "epochs": 3, "checkpoint": {"directory": ")") + ck +
               R"(", "every_epochs": 1})"),
      "j.json");
  JobRunOptions o;
  o.device = engine::Device::cpu();
  int progress_calls = 0, epoch_calls = 0;
  o.on_progress = [&](const JobProgress& p) {
    ++progress_calls;
    EXPECT_GT(p.total_steps, 0);
    EXPECT_TRUE(std::isfinite(p.loss));
  };
  o.on_epoch = [&](const EpochReport&) { ++epoch_calls; };
  JobResult r = run_job(*verify_job(buf), o);
  EXPECT_EQ(epoch_calls, 3);
  EXPECT_GE(progress_calls, 3) << "at least one report per epoch";
  EXPECT_LE(progress_calls, 3 * 19 + 3) << "not one per step (19 steps per epoch)";
  EXPECT_GE(r.test_accuracy, 0.9);
  EXPECT_EQ(r.steps, 3 * 19);
  EXPECT_TRUE(fs::exists(ck + "/synthetic.ckpt"));

  // Asking for 5 epochs resumes after epoch 3 from the checkpoint.
  auto more = parse_job_json(
      job_json(kTrain + std::string(R"(, "epochs": 5, "checkpoint": {"directory": ")") + ck +
               R"(", "every_epochs": 1})"),
      "j.json");
  JobRunOptions plain;
  plain.device = engine::Device::cpu();
  JobResult r2 = run_job(*verify_job(more), plain);
  EXPECT_EQ(r2.resumed_from_epoch, 3);
  EXPECT_EQ(r2.epochs.size(), 2u);
  EXPECT_EQ(r2.epochs.front().epoch, 4);
}

TEST_F(JobTest, CancelStopsBetweenSteps) {
  auto buf = parse_job_json(job_json(kTrain + std::string(R"(, "epochs": 50)")), "j.json");
  std::atomic<bool> cancel{false};
  JobRunOptions o;
  o.device = engine::Device::cpu();
  o.cancel = &cancel;
  o.on_epoch = [&](const EpochReport&) { cancel = true; };
  EXPECT_THROW(run_job(*verify_job(buf), o), JobCancelled);
}

}  // namespace
}  // namespace leasehold
