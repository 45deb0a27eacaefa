// Text jobs: a language model's job file (dataset "text", sequence layers)
// validated with every problem named, and trained by the job runner on a
// small generated corpus: validation loss reported, checkpoint and resume.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "agent/job_runner.h"
#include "shared/device.h"
#include "shared/job_spec.h"
#include "tests/support/job_problems.h"

namespace leasehold {
namespace {

namespace fs = std::filesystem;

using testing::problems_of;

class TextJobTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/leasehold-text-XXXXXX";
    ASSERT_TRUE(mkdtemp(tmpl));
    dir = tmpl;
    // Sentences from a small grammar: learnable structure, no two alike.
    std::ofstream out(dir + "/corpus.txt");
    const char* subjects[] = {"the cat", "a dog", "my friend", "the old man", "her sister"};
    const char* verbs[] = {"sat on", "looked at", "walked to", "found", "painted"};
    const char* objects[] = {"the mat", "a red door", "the garden", "his hat", "the river"};
    for (int i = 0; i < 1500; ++i) {
      out << subjects[(i * 7) % 5] << ' ' << verbs[(i * 3 + i / 5) % 5] << ' '
          << objects[(i * 11 + i / 25) % 5] << ". ";
      if (i % 6 == 5) out << '\n';
    }
  }
  void TearDown() override { fs::remove_all(dir); }

  // A one-block GPT over `dir`/corpus.txt; `extra` adds job fields,
  // `model` replaces the layers.
  std::string job_json(const std::string& extra = "", const std::string& model = "",
                       const std::string& dataset = "") const {
    const std::string layers =
        model.empty() ? R"([
      {"type": "Embedding", "in": 256, "out": 32, "context": 32},
      {"type": "TransformerBlock", "out": 32, "heads": 2, "dropout": 0.0},
      {"type": "LayerNorm", "out": 32},
      {"type": "Linear", "in": 32, "out": 256, "tied": true}])"
                      : model;
    const std::string data = dataset.empty()
                                 ? R"({"name": "text", "files": [")" + dir +
                                       R"(/corpus.txt"], "context": 32})"
                                 : dataset;
    return R"({"name": "tiny-text", "model": )" + layers + R"(, "dataset": )" + data +
           R"(, "batch_size": 32, "memory_budget": "256MiB", "device": "cpu",
           "optimizer": {"type": "AdamW", "lr": 0.003, "weight_decay": 0.1,
                         "schedule": "Cosine", "warmup_steps": 5, "min_lr": 0.0003,
                         "clip_grad_norm": 1.0})" +
           extra + "}";
  }
  std::string problems(const std::string& json) const {
    return problems_of([&] {
      auto buf = parse_job_json(json, "text.json");
      validate_job(*verify_job(buf), {true, 0});
    });
  }
  std::string dir;
};

TEST_F(TextJobTest, TheExampleJobIsValid) {
  const char* name = "text-gpt.json";
  std::ifstream in(std::string(LEASEHOLD_SOURCE_DIR) + "/deploy/jobs/" + name);
  std::stringstream text;
  text << in.rdbuf();
  auto buf = parse_job_json(text.str(), name);
  const auto* job = verify_job(buf);
  ASSERT_TRUE(is_text_dataset(*job));
  // The corpus comes from Debian's fortunes package (deploy/setup.sh).
  const bool have_data = fs::exists(job->dataset()->files()->Get(0)->str());
  EXPECT_NO_THROW(validate_job(*job, {have_data, 0}));
  EXPECT_EQ(job->dataset()->context(), 256);
  EXPECT_EQ(job->model()->size(), 10u);
  // Six blocks of width 384 (12·384² + 13·384 each), the token and position
  // tables, the final norm; the output is tied: 10.8M parameters, kept with
  // their gradients and AdamW's two moments.
  const double params = 6 * (12.0 * 384 * 384 + 13 * 384) + (256 + 256) * 384 + 2 * 384;
  EXPECT_EQ(job_resident_bytes(*job), static_cast<uint64_t>(params * 4 * 4));
}

TEST_F(TextJobTest, ProblemsAreNamed) {
  EXPECT_EQ(problems(job_json(R"(, "steps": 10)")), "");
  EXPECT_NE(problems(job_json(R"(, "steps": 10)", "",
                              R"({"name": "text", "files": ["/nonexistent/x.txt"], "context": 32})"))
                .find("dataset.files[0]: '/nonexistent/x.txt' does not exist"),
            std::string::npos);
  EXPECT_NE(problems(job_json(R"(, "steps": 10)", "",
                              R"({"name": "text", "files": [")" + dir + R"("], "context": 32})"))
                .find("is not a regular file"),
            std::string::npos);
  EXPECT_NE(problems(job_json(R"(, "steps": 10)", "", R"({"name": "text", "context": 32})"))
                .find("dataset.files: a text dataset needs at least one file"),
            std::string::npos);
  std::string e = problems(job_json(
      R"(, "steps": 10)", "",
      R"({"name": "text", "files": [")" + dir + R"(/corpus.txt"], "context": 0,
          "validation_fraction": 1.5, "train_images": "x"})"));
  EXPECT_NE(e.find("dataset.context: 0 is not in [1, 8192]"), std::string::npos) << e;
  EXPECT_NE(e.find("dataset.validation_fraction: must be in (0, 1)"), std::string::npos) << e;
  EXPECT_NE(e.find("not directory or IDX images"), std::string::npos) << e;
  // A corpus too short for a sample on each side.
  {
    std::ofstream(dir + "/short.txt") << "just a few words";
    e = problems(job_json(R"(, "steps": 10)", "",
                          R"({"name": "text", "files": [")" + dir +
                              R"(/short.txt"], "context": 32})"));
    EXPECT_NE(e.find("too few for a training and a validation sample"), std::string::npos) << e;
  }
  // Layers that do not chain, each named.
  auto layers = [](const std::string& middle, const std::string& last =
                                                  R"({"type": "Linear", "in": 32, "out": 256})") {
    return R"([{"type": "Embedding", "in": 256, "out": 32, "context": 32}, )" + middle +
           (middle.empty() ? "" : ", ") + last + "]";
  };
  e = problems(job_json(R"(, "steps": 10)",
                        layers(R"({"type": "TransformerBlock", "out": 32, "heads": 5})")));
  EXPECT_NE(e.find("model[1] (TransformerBlock): out (32) must be a positive multiple of heads (5)"),
            std::string::npos)
      << e;
  e = problems(job_json(R"(, "steps": 10)",
                        layers(R"({"type": "TransformerBlock", "out": 64, "heads": 2})")));
  EXPECT_NE(e.find("needs [tokens, 64] but gets [32, 32]"), std::string::npos) << e;
  e = problems(job_json(R"(, "steps": 10)", layers(R"({"type": "LayerNorm", "out": 16})")));
  EXPECT_NE(e.find("model[1] (LayerNorm): out is 16"), std::string::npos) << e;
  e = problems(job_json(R"(, "steps": 10)",
                        layers("", R"({"type": "Linear", "in": 32, "out": 128, "tied": true})")));
  EXPECT_NE(e.find("tied: the Embedding's table is [256, 32]"), std::string::npos) << e;
  e = problems(job_json(R"(, "steps": 10)", layers("", R"({"type": "Linear", "in": 32, "out": 10})")));
  EXPECT_NE(e.find("next-token scores [tokens, 256]"), std::string::npos) << e;
  e = problems(job_json(R"(, "steps": 10)",
                        R"([{"type": "Embedding", "in": 256, "out": 32, "context": 16},
                            {"type": "Linear", "in": 32, "out": 256}])"));
  EXPECT_NE(e.find("context 16 is shorter than the 32 tokens of a sample"), std::string::npos) << e;
  e = problems(job_json(R"(, "steps": 10)",
                        R"([{"type": "Linear", "in": 32, "out": 32},
                            {"type": "Embedding", "in": 256, "out": 32}])"));
  EXPECT_NE(e.find("model[1] (Embedding): must be the first layer"), std::string::npos) << e;
  // Optimiser settings of the schedule.
  std::string high_floor = job_json(R"(, "steps": 10)");
  high_floor.replace(high_floor.find(R"("min_lr": 0.0003)"), 16, R"("min_lr": 0.5)");
  e = problems(high_floor);
  EXPECT_NE(e.find("optimizer.min_lr: must be in [0, lr]"), std::string::npos) << e;
  // A misspelt layer field is refused by the parser, named.
  e = problems_of([&] {
    parse_job_json(job_json(R"(, "steps": 10)", R"([{"type": "TransformerBlock", "head": 2}])"),
                   "t.json");
  });
  EXPECT_NE(e.find("head"), std::string::npos) << e;
}

TEST_F(TextJobTest, TrainsReportsValidationLossAndResumes) {
  const std::string ck = dir + "/ck";
  fs::create_directory(ck);
  auto make = [&](int epochs) {
    return parse_job_json(job_json(R"(, "epochs": )" + std::to_string(epochs) +
                                   R"(, "checkpoint": {"directory": ")" + ck + R"("})"),
                          "t.json");
  };
  auto buf = make(2);
  JobRunOptions o;
  o.device = engine::Device::cpu();
  std::vector<EpochReport> epochs;
  o.on_epoch = [&](const EpochReport& e) { epochs.push_back(e); };
  o.on_progress = [&](const JobProgress& p) { EXPECT_TRUE(std::isfinite(p.loss)); };
  JobResult r = run_job(*verify_job(buf), o);
  ASSERT_EQ(epochs.size(), 2u);
  // 42,550 bytes: the first 90% in 1,196 samples of 32 tokens, 38 batches
  // of 32 (the last one smaller).
  EXPECT_EQ(r.steps, 2 * 38);
  for (const auto& e : epochs) {
    EXPECT_GT(e.validation_loss, 0);
    EXPECT_TRUE(std::isfinite(e.validation_loss));
  }
  // Far below a uniform guess over 256 bytes (5.55 nats), and improving.
  EXPECT_LT(epochs[1].validation_loss, 2.5);
  EXPECT_LT(epochs[1].validation_loss, epochs[0].validation_loss);
  // (A space, the commonest byte, is about a fifth of them.)
  EXPECT_GT(epochs[1].test_accuracy, 0.25) << "next-token accuracy";
  // Samples of a text job are tokens.
  EXPECT_GT(r.samples_per_second, 0);

}

// A run stopped after its first epoch and resumed from the checkpoint ends
// exactly as the run that was never stopped: parameters, AdamW's state, the
// schedule's position and the data order all come back.
TEST_F(TextJobTest, AResumedRunEndsBitForBitAsAnUninterruptedOne) {
  auto run = [&](const std::string& ck, bool stop_after_first) {
    fs::create_directories(ck);
    auto buf = parse_job_json(
        job_json(R"(, "epochs": 2, "checkpoint": {"directory": ")" + ck + R"("})"), "t.json");
    std::vector<EpochReport> epochs;
    JobRunOptions o;
    o.device = engine::Device::cpu();
    o.on_epoch = [&](const EpochReport& e) { epochs.push_back(e); };
    o.should_stop = [&] { return stop_after_first && !epochs.empty(); };
    try {
      run_job(*verify_job(buf), o);
    } catch (const JobCancelled&) {
    }
    return epochs;
  };
  const auto straight = run(dir + "/a", false);
  ASSERT_EQ(straight.size(), 2u);
  const auto stopped = run(dir + "/b", true);
  ASSERT_EQ(stopped.size(), 1u);
  const auto resumed = run(dir + "/b", false);
  ASSERT_EQ(resumed.size(), 2u) << "the replayed first epoch, then the second";
  EXPECT_EQ(resumed[0].epoch, 1);
  EXPECT_EQ(resumed[1].epoch, 2);
  // Bit for bit: the same losses to the last digit.
  EXPECT_EQ(resumed[1].train_loss, straight[1].train_loss);
  EXPECT_EQ(resumed[1].validation_loss, straight[1].validation_loss);
  EXPECT_EQ(resumed[1].test_accuracy, straight[1].test_accuracy);
}

// On a GPU every full batch's step runs as a CUDA graph; the run ends as
// the run with every step op by op does, bit for bit (dropout, AdamW, the
// schedule, clipping and the last, smaller batch of each epoch included).
// A Shrink drops the graph (its pool's memory can then go back) and the run
// goes on op by op, still to the same bits.
TEST_F(TextJobTest, OnAGpuStepsAsCudaGraphsEndAsStepsOpByOp) {
  if (!cuda_built() || cuda_device_count() == 0) GTEST_SKIP() << "no GPU";
  struct Run {
    std::vector<EpochReport> epochs;
    JobResult result;
  };
  auto run = [&](bool graphs, int64_t shrink_at_step) {
    std::string json = job_json(R"(, "epochs": 2)",
                                R"([{"type": "Embedding", "in": 256, "out": 32, "context": 32},
                     {"type": "TransformerBlock", "out": 32, "heads": 2, "dropout": 0.1},
                     {"type": "LayerNorm", "out": 32},
                     {"type": "Linear", "in": 32, "out": 256, "tied": true}])");
    json.replace(json.find(R"("device": "cpu")"), 15, R"("device": "cuda")");
    auto buf = parse_job_json(json, "t.json");
    Run r;
    JobRunOptions o;
    o.device = engine::Device::cuda(0);
    o.cuda_graphs = graphs;
    int64_t boundaries = 0;
    o.memory_wanted = [&] { return ++boundaries == shrink_at_step; };
    o.on_epoch = [&](const EpochReport& e) { r.epochs.push_back(e); };
    r.result = run_job(*verify_job(buf), o);
    return r;
  };
  const Run graphed = run(true, 0), op_by_op = run(false, 0), shrunk = run(true, 10);
  ASSERT_EQ(graphed.epochs.size(), 2u);
  ASSERT_EQ(op_by_op.epochs.size(), 2u);
  ASSERT_EQ(shrunk.epochs.size(), 2u);
  // 38 steps an epoch, the last smaller: the first op by op, then graph
  // launches (the second step's traced, captured and launched); the last
  // gets the graph's memory, and the next epoch's first step makes the
  // graph again.
  EXPECT_EQ(graphed.result.graph_steps, 2 * 38 - 1 - 2);
  EXPECT_EQ(op_by_op.result.graph_steps, 0);
  // The Shrink comes at the tenth step boundary with a graph held (steps
  // 3 to 12): graphs from the second step to the eleventh, none after.
  EXPECT_EQ(shrunk.result.graph_steps, 10);
  for (int e = 0; e < 2; ++e) {
    EXPECT_EQ(graphed.epochs[e].train_loss, op_by_op.epochs[e].train_loss) << e;
    EXPECT_EQ(graphed.epochs[e].validation_loss, op_by_op.epochs[e].validation_loss) << e;
    EXPECT_EQ(shrunk.epochs[e].train_loss, op_by_op.epochs[e].train_loss) << e;
    EXPECT_EQ(shrunk.epochs[e].validation_loss, op_by_op.epochs[e].validation_loss) << e;
  }
}

TEST_F(TextJobTest, TheEmbeddingCoversEveryByteAndTheCorpusFitsTheBudget) {
  std::string e = problems(job_json(
      R"(, "steps": 10)",
      R"([{"type": "Embedding", "in": 128, "out": 32, "context": 32},
          {"type": "Linear", "in": 32, "out": 256}])"));
  EXPECT_NE(e.find("model[0] (Embedding): in is 128, but the text's tokens are bytes: make it 256"),
            std::string::npos)
      << e;
  e = problems(job_json(R"(, "steps": 10)",
                        R"([{"type": "Linear", "in": 32, "out": 256}])"));
  EXPECT_NE(e.find("a text model starts with an Embedding"), std::string::npos) << e;
  // 42,550 bytes of text, a byte a token: over a quarter of 160 KiB.
  std::string small = job_json(R"(, "steps": 10)");
  small.replace(small.find(R"("256MiB")"), 8, R"("160KiB")");
  e = problems(small);
  EXPECT_NE(e.find("over a quarter of memory_budget"), std::string::npos) << e;
  std::string warm = job_json(R"(, "steps": 5)");
  e = problems(warm);
  EXPECT_NE(e.find("optimizer.warmup_steps: 5 is not fewer than the job's 5 steps"),
            std::string::npos)
      << e;
}

}  // namespace
}  // namespace leasehold
