// Job specifications (JSON against the schema, validation naming fields) and
// the job runner on a small synthetic IDX dataset.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cmath>
#include <filesystem>
#include <functional>
#include <sstream>
#include <fstream>

#include "agent/job_runner.h"
#include "shared/job_spec.h"
#include "tests/support/job_problems.h"
#include "shared/printable.h"
#include "tests/support/memory_file_system.h"
#include "tests/support/synthetic_data.h"

namespace leasehold {
namespace {

namespace fs = std::filesystem;

class JobTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/leasehold-job-XXXXXX";
    ASSERT_TRUE(mkdtemp(tmpl));
    dir = tmpl;
    testing::write_synthetic_idx(dir, "train", 600, 1);
    testing::write_synthetic_idx(dir, "test", 150, 2);
  }
  void TearDown() override { fs::remove_all(dir); }

  // `extra` adds fields; the training defaults are in kTrain.
  static constexpr const char* kTrain = R"(, "batch_size": 32)";
  std::string job_json(const std::string& extra = "", const std::string& model = "") const {
    std::string json = testing::synthetic_job_json(dir, "synthetic", extra);
    if (!model.empty()) {
      // Swap in another layer list.
      size_t a = json.find("[{"), b = json.find("}],") + 2;
      json.replace(a, b - a, model);
    }
    return json;
  }
  std::string dir;
};

using testing::problems_of;

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
  // An unknown enum value: its enum's values, and the nearest when close.
  e = problems_of([&] {
    parse_job_json(job_json(R"(, "epochs": 1)", R"([{"type": "Flatten"}, {"type": "Relu"}])"),
                   "j.json");
  });
  EXPECT_NE(e.find("LayerType is one of Linear, Conv2d, ReLU, MaxPool2d, Flatten, Dropout, "
                   "Embedding, TransformerBlock, LayerNorm, GELU; did you mean ReLU?"),
            std::string::npos)
      << e;
  std::string adamx = job_json(R"(, "epochs": 1)");
  adamx.replace(adamx.find("\"Adam\""), 6, "\"Adamx\"");
  e = problems_of([&] { parse_job_json(adamx, "j.json"); });
  EXPECT_NE(e.find("OptimizerType is one of SGD, Adam, AdamW; did you mean Adam"),
            std::string::npos)
      << e;
  e = problems_of([&] {
    parse_job_json(job_json(R"(, "epochs": 1)", R"([{"type": "Sigmoid"}])"), "j.json");
  });
  EXPECT_NE(e.find("LayerType is one of"), std::string::npos) << e;
  EXPECT_EQ(e.find("did you mean"), std::string::npos) << "nothing close: " << e;
  // An explicit epochs of 0 is not a missing field.
  e = problems_of([&] { parse_job_json(job_json(R"(, "epochs": 0)"), "j.json"); });
  EXPECT_NE(e.find("epochs: must be positive (the file says 0)"), std::string::npos) << e;
}

TEST_F(JobTest, ValidationNamesEveryBadField) {
  // (No epochs or steps at all: an explicit 0 is refused when parsed.)
  std::string bad = job_json(R"(, "batch_size": -4, "memory_budget": "lots", "device": "tpu")");
  const std::string lr = "\"lr\": 0.01";
  bad.replace(bad.find(lr), lr.size(), "\"lr\": -1.0");
  auto buf = parse_job_json(bad, "j.json");
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
  // Less than one lease of the coordinator's alignment.
  auto tiny = parse_job_json(job_json(R"(, "epochs": 1, "memory_budget": "1MiB")"), "j.json");
  ValidationOptions aligned{true, 1ull << 30};
  aligned.alignment = 2ull << 20;
  e = problems_of([&] { validate_job(*verify_job(tiny), aligned); });
  EXPECT_NE(e.find("memory_budget: 1.00 MiB is less than one lease: the coordinator leases in "
                   "blocks of 2.00 MiB"),
            std::string::npos)
      << e;
  // A last layer narrower than the labels' classes (they go up to 2 here).
  auto narrow = parse_job_json(
      job_json(R"(, "epochs": 1)", R"([{"type": "Flatten"}, {"type": "Linear", "in": 64, "out": 2}])"),
      "j.json");
  e = problems_of([&] { validate_job(*verify_job(narrow), {}); });
  EXPECT_NE(e.find("model[1]: the last layer gives 2 class scores, but the labels in "
                   "dataset.train_labels go up to 2 (3 classes): make its out 3"),
            std::string::npos)
      << e;
  fs::remove(dir + "/test-labels");
  auto missing = parse_job_json(job_json(R"(, "epochs": 1)"), "j.json");
  e = problems_of([&] { validate_job(*verify_job(missing), {}); });
  EXPECT_NE(e.find("dataset.test_labels"), std::string::npos) << e;
}

TEST_F(JobTest, ABudgetThatCannotHoldTheParametersIsRefusedWithTheNumbers) {
  // 64·20000 + 20000·3 parameters, with gradients and Adam's two moments:
  // 21.8 MB that cannot spill, against a budget of 16 MiB.
  auto buf = parse_job_json(
      job_json(R"(, "epochs": 1, "memory_budget": "16MiB")",
               R"([{"type": "Flatten"}, {"type": "Linear", "in": 64, "out": 20000},
                   {"type": "Linear", "in": 20000, "out": 3}])"),
      "j.json");
  EXPECT_EQ(job_resident_bytes(*verify_job(buf)), (64ull * 20000 + 20000 + 20000 * 3 + 3) * 16);
  std::string e = problems_of([&] { validate_job(*verify_job(buf), {}); });
  EXPECT_NE(e.find("memory_budget: 16.00 MiB cannot hold the model's parameters, gradients and "
                   "optimizer state (20.75 MiB)"),
            std::string::npos)
      << e;
  auto spill = parse_job_json(
      job_json(R"(, "epochs": 1, "spill": {"host_bytes": "lots", "directory": ""})"), "j.json");
  e = problems_of([&] { validate_job(*verify_job(spill), {}); });
  EXPECT_NE(e.find("spill.host_bytes"), std::string::npos) << e;
  EXPECT_NE(e.find("spill.directory"), std::string::npos) << e;
  std::string unknown =
      problems_of([&] { parse_job_json(job_json(R"(, "epochs": 1, "spill": {"tier": 2})"), "j"); });
  EXPECT_NE(unknown.find("tier"), std::string::npos) << unknown;
}

TEST_F(JobTest, TheSpillExampleJobIsValid) {
  const char* name = "fashion-mnist-cnn-spill.json";
  std::ifstream in(std::string(LEASEHOLD_SOURCE_DIR) + "/deploy/jobs/" + name);
  std::stringstream text;
  text << in.rdbuf();
  auto buf = parse_job_json(text.str(), name);
  const auto* job = verify_job(buf);
  bool have_data = fs::exists(dataset_files(*job).train_images);
  EXPECT_NO_THROW(validate_job(*job, {have_data, 0})) << name;
  EXPECT_TRUE(job->spill() && job->spill()->enabled());
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
  fs::create_directory(ck);  // a folder the job file names must exist
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
  std::vector<int64_t> reported;
  plain.on_epoch = [&](const EpochReport& e) { reported.push_back(e.epoch); };
  JobResult r2 = run_job(*verify_job(more), plain);
  EXPECT_EQ(r2.resumed_from_epoch, 3);
  EXPECT_EQ(r2.epochs.size(), 2u);
  EXPECT_EQ(r2.epochs.front().epoch, 4);
  EXPECT_EQ(reported, (std::vector<int64_t>{3, 4, 5}))
      << "the checkpointed epoch is reported again on resume";
}

// A checkpoint that cannot be written fails the job naming the file and the
// error; the checkpoint before it survives, and a rerun resumes from it with
// the same result as a run that never failed.
TEST_F(JobTest, AFailedCheckpointWriteFailsTheJobAndKeepsThePreviousOne) {
  const std::string ck = "/ck";
  auto buf = parse_job_json(
      job_json(kTrain + std::string(R"(, "epochs": 3, "checkpoint": {"directory": ")") + ck +
               R"("})"),
      "j.json");
  testing::MemoryFileSystem mem;
  JobRunOptions o;
  o.device = engine::Device::cpu();
  o.file_system = &mem;
  std::vector<bool> checkpointed;
  o.on_epoch = [&](const EpochReport& e) { checkpointed.push_back(e.checkpointed); };
  // The second checkpoint's first append hits a full disk.
  mem.fail_next(testing::MemoryFileSystem::Op::Append, ENOSPC, 1);
  try {
    run_job(*verify_job(buf), o);
    FAIL() << "the job went on without its checkpoint";
  } catch (const std::runtime_error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("/ck/synthetic.ckpt"), std::string::npos) << what;
    EXPECT_NE(what.find("No space left on device"), std::string::npos) << what;
  }
  EXPECT_EQ(checkpointed, std::vector<bool>{true}) << "epoch 2 was never reported";
  EXPECT_EQ(mem.list(ck), std::vector<std::string>{"synthetic.ckpt"}) << "no .tmp left behind";

  int resumed = -1;
  o.on_epoch = {};
  o.on_resume = [&](int64_t epoch) { resumed = static_cast<int>(epoch); };
  JobResult r = run_job(*verify_job(buf), o);
  EXPECT_EQ(resumed, 1);
  JobRunOptions fresh;
  fresh.device = engine::Device::cpu();
  testing::MemoryFileSystem other;
  fresh.file_system = &other;
  JobResult uninterrupted = run_job(*verify_job(buf), fresh);
  EXPECT_EQ(r.test_accuracy, uninterrupted.test_accuracy);
}

// A job's name is a plain word: it becomes a checkpoint file name, a log
// line's word and a JSON string, so nothing in it may leave the checkpoint
// folder, start a new log line or be invalid UTF-8; the refusal shows the
// bad bytes escaped.
TEST_F(JobTest, JobNamesArePlainWords) {
  // The spec as the coordinator receives it (any bytes in its strings).
  auto named = [&](const std::string& name) {
    auto buf = parse_job_json(job_json(R"(, "epochs": 1)"), "j.json");
    std::unique_ptr<proto::JobSpecT> spec(verify_job(buf)->UnPack());
    spec->name = name;
    return problems_of([&] { validate_job(*spec, {}); });
  };
  EXPECT_EQ(named("fashion-mnist_v2.1"), "");
  EXPECT_NE(named("../../etc/cron.d/x").find("is not a job name"), std::string::npos);
  EXPECT_NE(named("..").find("is not a job name"), std::string::npos);
  const std::string forged = named("ok\n[info] job 1 succeeded");
  EXPECT_NE(forged.find("'ok\\x0a[info] job 1 succeeded'"), std::string::npos) << forged;
  EXPECT_EQ(forged.find('\n'), std::string::npos) << "no raw newline in the message";
  EXPECT_NE(named("caf\xc3\xa9").find("'caf\xc3\xa9' is not a job name"), std::string::npos);
  EXPECT_NE(named("bad\xff").find("'bad\\xff'"), std::string::npos) << "not UTF-8: escaped";
  EXPECT_NE(named("with space").find("is not a job name"), std::string::npos);
  EXPECT_NE(named(std::string(129, 'a')).find("longer than 128"), std::string::npos);
}

// A checkpoint folder must be a folder, and a checkpoint in it a regular
// file (a FIFO there would hang whoever reads it).
TEST_F(JobTest, CheckpointPathsMustBeAFolderAndARegularFile) {
  auto with_folder = [&](const std::string& folder) {
    auto buf = parse_job_json(
        job_json(R"(, "epochs": 1, "checkpoint": {"directory": ")" + folder + R"("})"), "j.json");
    ValidationOptions v;
    v.submitter_uid = ::geteuid();
    return problems_of([&] { validate_job(*verify_job(buf), v); });
  };
  EXPECT_EQ(with_folder(dir), "");
  EXPECT_NE(with_folder(dir + "/not-yet").find("does not exist: create it first"),
            std::string::npos)
      << "the agent makes no folder for a user (it would be the agent's)";
  const std::string file = dir + "/train-images";
  EXPECT_NE(with_folder(file).find("checkpoint.directory: " + file + " is not a folder"),
            std::string::npos)
      << with_folder(file);
  fs::create_directory(dir + "/ck");
  ASSERT_EQ(::mkfifo((dir + "/ck/synthetic.ckpt").c_str(), 0600), 0);
  EXPECT_NE(with_folder(dir + "/ck").find("synthetic.ckpt is not a regular file"),
            std::string::npos)
      << with_folder(dir + "/ck");
}

// A job's checkpoint folder is absolute (the coordinator and the agent
// resolve it alike) and never inside the coordinator's state folder, where
// other jobs' checkpoints are, by any spelling or link.
TEST_F(JobTest, ACheckpointFolderCannotReachOtherJobsCheckpoints) {
  const std::string state = dir + "/state";
  fs::create_directories(state + "/checkpoints/7");
  fs::create_directory(dir + "/elsewhere");
  fs::create_directory_symlink(state + "/checkpoints", dir + "/link");
  auto with_folder = [&](const std::string& folder) {
    auto buf = parse_job_json(
        job_json(R"(, "epochs": 1, "checkpoint": {"directory": ")" + folder + R"("})"), "j.json");
    ValidationOptions v{true, 0, {}, state};
    v.submitter_uid = ::geteuid();
    return problems_of([&] { validate_job(*verify_job(buf), v); });
  };
  fs::create_directory(dir + "/stateful");
  for (const std::string& folder :
       {state, state + "/checkpoints/7", dir + "/elsewhere/../state/checkpoints/7",
        dir + "/link/7", dir + "/link/new"}) {
    EXPECT_NE(with_folder(folder).find("is inside the coordinator's state folder"),
              std::string::npos)
        << folder << ": " << with_folder(folder);
  }
  EXPECT_EQ(with_folder(dir + "/stateful"), "") << "a neighbour of the same prefix is fine";
  EXPECT_EQ(with_folder(dir + "/elsewhere"), "");
  auto relative = parse_job_json(
      job_json(R"(, "epochs": 1, "checkpoint": {"directory": "ck"})"), "j.json");
  EXPECT_NE(problems_of([&] { validate_job(*verify_job(relative), ValidationOptions{false}); })
                .find("checkpoint.directory: 'ck' is not an absolute path"),
            std::string::npos);
}

// The checkpoint folder is checked at every write and at the resume, not
// only at submit: swapped for a link to another job's folder after the
// submission, or between epochs, it is refused, and the other job's
// checkpoint is neither read nor overwritten.
TEST_F(JobTest, ACheckpointFolderSwappedForALinkIsRefusedAtTheNextWriteOrResume) {
  const std::string victim = dir + "/victim", ck = dir + "/ck";
  fs::create_directories(victim);
  std::ofstream(victim + "/synthetic.ckpt") << "another job's checkpoint";
  fs::create_directory(ck);
  auto buf = parse_job_json(
      job_json(kTrain + std::string(R"(, "epochs": 3, "checkpoint": {"directory": ")") + ck +
               R"("})"),
      "j.json");
  auto victims = [&] {
    std::ifstream in(victim + "/synthetic.ckpt");
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  // Between epochs 1 and 2.
  JobRunOptions o;
  o.device = engine::Device::cpu();
  o.on_epoch = [&](const EpochReport& e) {
    if (e.epoch != 1) return;
    fs::rename(ck, ck + ".moved");
    fs::create_directory_symlink(victim, ck);
  };
  try {
    run_job(*verify_job(buf), o);
    FAIL() << "wrote its checkpoint through a link";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot write checkpoint " + ck + "/synthetic.ckpt: " +
                                         ck + " is a symbolic link"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(victims(), "another job's checkpoint");
  // A resume through the link: refused, not a fresh start that writes later.
  JobRunOptions again;
  again.device = engine::Device::cpu();
  try {
    run_job(*verify_job(buf), again);
    FAIL() << "resumed through a link";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot resume from " + ck + "/synthetic.ckpt: " + ck +
                                         " is a symbolic link"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(victims(), "another job's checkpoint");
}

// System folders never take a checkpoint, whoever submits the job: refused
// at submit, and at the write for a job that got past it.
TEST_F(JobTest, SystemFoldersTakeNoCheckpoint) {
  for (const char* folder : {"/", "/etc", "/usr/lib"}) {
    auto buf = parse_job_json(
        job_json(kTrain + std::string(R"(, "epochs": 1, "checkpoint": {"directory": ")") +
                 folder + R"("})"),
        "j.json");
    for (int64_t uid : {int64_t{0}, int64_t(::geteuid())}) {
      ValidationOptions v;
      v.submitter_uid = uid;
      EXPECT_NE(problems_of([&] { validate_job(*verify_job(buf), v); }).find("system folder"),
                std::string::npos)
          << folder;
    }
    JobRunOptions o;
    o.device = engine::Device::cpu();
    try {
      run_job(*verify_job(buf), o);
      FAIL() << "checkpointed into " << folder;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("system folder"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(std::string(folder) + "/synthetic.ckpt"));
  }
}

// Every text field reaches log lines, JSON and error texts: control
// characters, misleading code points and bytes that are not UTF-8 are
// refused in any of them, and the refusal shows them escaped.
TEST_F(JobTest, NoTextFieldCarriesControlCharactersOrBadUtf8) {
  // Each: the field, and the job's JSON with BAD where the value goes.
  std::vector<std::pair<std::string, std::string>> fields{
      {"checkpoint.directory", job_json(R"(, "epochs": 1, "checkpoint": {"directory": "/tmp/BAD"})")},
      {"spill.directory", job_json(R"(, "epochs": 1, "spill": {"directory": "/tmp/BAD"})")},
      {"memory_budget", job_json(R"(, "epochs": 1, "memory_budget": "BAD")")},
      {"device", job_json(R"(, "epochs": 1, "device": "BAD")")}};
  std::string dataset = job_json(R"(, "epochs": 1)");
  const std::string images = dir + "/train-images";
  dataset.replace(dataset.find(images), images.size(), "/tmp/BAD");
  fields.emplace_back("dataset.train_images", dataset);
  // A newline, a right-to-left override, a C1 control (NEL), a bell.
  for (const char* bad : {"a\\nb", "a\\u202eb", "a\\u0085b", "a\\u0007b"}) {
    for (const auto& [field, json] : fields) {
      std::string text = json;
      text.replace(text.find("BAD"), 3, bad);
      const std::string e =
          problems_of([&] { validate_job(*verify_job(parse_job_json(text, "j.json")), {}); });
      EXPECT_NE(e.find(field + ": "), std::string::npos) << field << " " << bad << ": " << e;
      EXPECT_NE(e.find("has control characters"), std::string::npos) << field << ": " << e;
      EXPECT_EQ(e.find('\n'), std::string::npos) << "escaped: " << e;
      EXPECT_EQ(e.find("\xe2\x80\xae"), std::string::npos) << "escaped: " << e;
    }
  }
  // Bytes that are not UTF-8 (which JSON cannot carry, but a raw client
  // can) and values over 4096 bytes, in every other text field.
  const std::vector<std::pair<std::string, std::function<void(proto::JobSpecT&)>>> raw{
      {"dataset.name", [](auto& s) { s.dataset->name = "mn\xffist"; }},
      {"dataset.directory", [](auto& s) { s.dataset->directory = "/d\xc0\xafx"; }},
      {"dataset.test_labels", [](auto& s) { s.dataset->test_labels = "/t\xed\xa0\x80"; }},
      {"memory_min", [](auto& s) { s.memory_min = "1\xffMiB"; }},
      {"publish_parameters", [](auto& s) { s.publish_parameters = "p\xfe"; }},
      {"init_from", [](auto& s) { s.init_from = "i\x80"; }},
      {"spill.host_bytes", [](auto& s) {
         s.spill = std::make_unique<proto::SpillSpecT>();
         s.spill->host_bytes = "2\x1bGiB";
       }},
      {"checkpoint.directory", [](auto& s) {
         s.checkpoint = std::make_unique<proto::CheckpointSpecT>();
         s.checkpoint->directory = "/" + std::string(5000, 'c');
       }}};
  const auto good = parse_job_json(job_json(R"(, "epochs": 1)"), "j.json");
  for (const auto& [field, edit] : raw) {
    proto::JobSpecT s;
    verify_job(good)->UnPackTo(&s);
    edit(s);
    const std::string e = problems_of([&] { validate_job(s, ValidationOptions{false}); });
    EXPECT_NE(e.find(field + ": "), std::string::npos) << field << ": " << e;
    EXPECT_NE(e.find("has control characters or bytes that are not UTF-8, or is longer than 4096"),
              std::string::npos)
        << field << ": " << e;
    EXPECT_TRUE(is_printable(e.substr(0, 4096))) << "the refusal itself is printable: " << e;
  }
}

// Parameter regions: names are checked; without a coordinator session a job
// naming one fails before it trains, saying why; a model that does not fit
// the data's image size is refused by run_job as by validation.
TEST_F(JobTest, ParameterRegionsAreCheckedAndNeedASession) {
  auto bad = parse_job_json(job_json(R"(, "epochs": 1, "publish_parameters": "a b",
                                        "init_from": "")"),
                            "j.json");
  std::string e = problems_of([&] { validate_job(*verify_job(bad), {}); });
  EXPECT_NE(e.find("publish_parameters: 'a b' is not a region name"), std::string::npos) << e;
  EXPECT_NE(e.find("init_from: '' is not a region name"), std::string::npos) << e;

  auto buf = parse_job_json(job_json(R"(, "epochs": 1, "publish_parameters": "base")"), "j.json");
  JobRunOptions o;
  o.device = engine::Device::cpu();
  e = problems_of([&] { run_job(*verify_job(buf), o); });
  EXPECT_NE(e.find("need an agent with a coordinator session"), std::string::npos) << e;

  auto wide = parse_job_json(
      job_json(R"(, "epochs": 1)", R"([{"type": "Flatten"}, {"type": "Linear", "in": 65, "out": 3}])"),
      "j.json");
  e = problems_of([&] { run_job(*verify_job(wide), o); });
  EXPECT_NE(e.find("model[1] (Linear): in is 65"), std::string::npos) << e;
}

TEST_F(JobTest, CancelStopsBetweenSteps) {
  auto buf = parse_job_json(job_json(kTrain + std::string(R"(, "epochs": 50)")), "j.json");
  std::atomic<bool> cancel{false};
  JobRunOptions o;
  o.device = engine::Device::cpu();
  o.should_stop = [&cancel] { return cancel.load(); };
  o.on_epoch = [&](const EpochReport&) { cancel = true; };
  EXPECT_THROW(run_job(*verify_job(buf), o), JobCancelled);
}

}  // namespace
TEST_F(JobTest, AProgramsFolderMustBeReachableByItsSubmitterAndTheDevicesAreTheAgents) {
  // A folder the submitter could read, inside one it may not search.
  const std::string outer = dir + "/closed", inner = outer + "/open";
  std::filesystem::create_directories(inner);
  ::chmod(dir.c_str(), 0711);  // (a private temporary folder)
  ::chmod(outer.c_str(), 0700);
  ::chmod(inner.c_str(), 0755);
  proto::JobSpecT spec;
  spec.name = "prog";
  spec.program = std::make_unique<proto::ProgramSpecT>();
  spec.program->command = {"true"};
  spec.program->directory = inner;
  ValidationOptions someone_else;
  someone_else.submitter_uid = ::getuid() + 12345;
  someone_else.submitter_gid = ::getgid() + 12345;
  std::string e = problems_of([&] { validate_job(spec, someone_else); });
  EXPECT_NE(e.find("is not readable by its submitter"), std::string::npos) << e;
  EXPECT_NE(e.find("'" + outer + "' may not be searched"), std::string::npos) << e;
  ValidationOptions owner;
  owner.submitter_uid = ::getuid();
  owner.submitter_gid = ::getgid();
  EXPECT_EQ(problems_of([&] { validate_job(spec, owner); }), "");
  ::chmod(outer.c_str(), 0711);  // searchable by all: the inner folder's own mode decides
  EXPECT_EQ(problems_of([&] { validate_job(spec, someone_else); }), "");
  ::chmod(inner.c_str(), 0711);
  e = problems_of([&] { validate_job(spec, someone_else); });
  EXPECT_NE(e.find("it may not read the folder"), std::string::npos) << e;
  // Which GPUs the program sees is the agent's to say.
  ::chmod(inner.c_str(), 0755);
  for (const char* name : {"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NVIDIA_VISIBLE_DEVICES"}) {
    auto var = std::make_unique<proto::EnvVarT>();
    var->name = name;
    var->value = "1";
    spec.program->environment.clear();
    spec.program->environment.push_back(std::move(var));
    e = problems_of([&] { validate_job(spec, owner); });
    EXPECT_NE(e.find(std::string(name) + " is the agent's to set"), std::string::npos) << e;
  }
}

}  // namespace leasehold
