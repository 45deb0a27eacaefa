// Checkpoint saves under failure: injected errors and a crash at every step,
// through MemoryFileSystem; and the real file system's error paths.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "agent/engine/checkpoint.h"
#include "shared/status.h"
#include "tests/support/memory_file_system.h"

namespace leasehold::engine {
namespace {

using testing::MemoryFileSystem;
using Op = MemoryFileSystem::Op;

const std::string kDir = "/ckpt";
const std::string kPath = "/ckpt/model.ckpt";
// One temporary file per writing process.
const std::string kTmp = "/ckpt/model.ckpt.tmp." + std::to_string(::getpid());

nn::NamedTensors version_a() {
  return {{"w", from_vector<float>({1.5f, -2.25f, 3.0f, 0.125f}, {2, 2})},
          {"b", from_vector<float>({0.5f, -0.75f}, {2})}};
}

nn::NamedTensors version_b() {
  return {{"w", from_vector<float>({-7.0f, 0.0f, 1e-30f, 42.5f}, {2, 2})},
          {"b", from_vector<float>({9.0f, 8.0f}, {2})}};
}

// Larger than several write chunks, so that a save makes more than one append.
nn::NamedTensors large_version_b() {
  std::vector<float> values(700'000);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i) * 0.5f;
  return {{"w", from_vector<float>(values, {700, 1000})},
          {"b", from_vector<float>({9.0f, 8.0f}, {2})}};
}

// Same names, shapes, dtypes and bytes, in the same order.
bool identical(const nn::NamedTensors& x, const nn::NamedTensors& y) {
  if (x.size() != y.size()) return false;
  for (size_t i = 0; i < x.size(); ++i) {
    const Tensor &a = x[i].second, &b = y[i].second;
    if (x[i].first != y[i].first || a.sizes() != b.sizes() || a.dtype() != b.dtype()) {
      return false;
    }
    size_t nbytes = a.numel() * dtype_size(a.dtype());
    if (std::memcmp(a.contiguous().raw_data(), b.contiguous().raw_data(), nbytes) != 0) {
      return false;
    }
  }
  return true;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A memory file system whose directory kDir durably holds checkpoint A.
std::unique_ptr<MemoryFileSystem> store_holding_a() {
  auto fs = std::make_unique<MemoryFileSystem>();
  EXPECT_TRUE(fs->create_dirs(kDir).ok());
  checkpoint::save(kPath, version_a(), *fs);
  fs->crash();  // nothing but durable state from here on
  EXPECT_TRUE(identical(checkpoint::load(kPath, *fs), version_a()));
  return fs;
}

// Mutating operations (and appends among them) of one clean save of `b`
// over A.
std::pair<int, int> count_save_steps(const nn::NamedTensors& b) {
  auto fs = store_holding_a();
  int ops = fs->mutating_ops(), appends = fs->calls(Op::Append);
  checkpoint::save(kPath, b, *fs);
  return {fs->mutating_ops() - ops, fs->calls(Op::Append) - appends};
}

TEST(CheckpointFaults, CrashAtEveryStepLeavesTheOldOrTheNewCheckpoint) {
  for (const auto& b : {version_b(), large_version_b()}) {
    auto [steps, appends] = count_save_steps(b);
    // create, append(s), sync, close, rename, sync_dir.
    EXPECT_EQ(steps, appends + 5);
    std::cout << "a save of " << b[0].second.numel() + b[1].second.numel() << " floats takes "
              << steps << " mutating steps (" << appends << " appends)\n";
    for (int k = 0; k <= steps; ++k) {
      SCOPED_TRACE("crash after " + std::to_string(k) + " of " + std::to_string(steps) + " steps");
      auto fs = store_holding_a();
      fs->crash_after(k);
      bool returned = false;
      try {
        checkpoint::save(kPath, b, *fs);
        returned = true;
      } catch (const std::runtime_error& e) {
        EXPECT_TRUE(contains(e.what(), kPath)) << e.what();
        EXPECT_TRUE(contains(e.what(), "Input/output error")) << e.what();
      }
      fs->crash();
      nn::NamedTensors loaded;
      ASSERT_NO_THROW(loaded = checkpoint::load(kPath, *fs));
      bool is_a = identical(loaded, version_a()), is_b = identical(loaded, b);
      EXPECT_TRUE(is_a || is_b);
      EXPECT_TRUE(!returned || is_b) << "save returned but the new checkpoint was lost";
      // Before its first step nothing can have changed; after its last the
      // save has returned and must be durable.
      EXPECT_TRUE(k > 1 || is_a);
      EXPECT_TRUE(k < steps || (returned && is_b));
    }
  }
}

// Saves version B into a store holding A with one injected fault; returns
// the error message ("" if the save did not throw).
std::string save_b_failing(MemoryFileSystem& fs, const nn::NamedTensors& b, Op op, int err,
                           int skip = 0) {
  fs.fail_next(op, err, skip);
  try {
    checkpoint::save(kPath, b, fs);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  ADD_FAILURE() << "save succeeded despite the injected fault";
  return "";
}

// A failure before the rename: the message names `file` and `reason`, A is
// still there (now and after a crash), no .tmp is left, and the next save works.
void expect_failure_before_rename(Op op, int err, int skip, const nn::NamedTensors& b,
                                  const std::string& file, const std::string& reason) {
  auto fs = store_holding_a();
  std::string message = save_b_failing(*fs, b, op, err, skip);
  EXPECT_TRUE(contains(message, kPath)) << message;
  EXPECT_TRUE(contains(message, file)) << message;
  EXPECT_TRUE(contains(message, reason)) << message;
  EXPECT_TRUE(identical(checkpoint::load(kPath, *fs), version_a()));
  EXPECT_EQ(fs->list(kDir), std::vector<std::string>{"model.ckpt"});
  fs->crash();
  EXPECT_TRUE(identical(checkpoint::load(kPath, *fs), version_a()));
  checkpoint::save(kPath, b, *fs);
  EXPECT_TRUE(identical(checkpoint::load(kPath, *fs), b));
}

TEST(CheckpointFaults, CreateFailureNamesTheTemporaryFile) {
  expect_failure_before_rename(Op::Create, EACCES, 0, version_b(), "cannot create " + kTmp,
                               "Permission denied");
}

TEST(CheckpointFaults, NoSpaceOnTheFirstAppend) {
  expect_failure_before_rename(Op::Append, ENOSPC, 0, version_b(), "cannot write " + kTmp,
                               "No space left on device");
}

TEST(CheckpointFaults, NoSpaceOnTheLastOfSeveralAppends) {
  auto b = large_version_b();
  int appends = count_save_steps(b).second;
  ASSERT_GE(appends, 2);
  expect_failure_before_rename(Op::Append, ENOSPC, appends - 1, b, "cannot write " + kTmp,
                               "No space left on device");
}

TEST(CheckpointFaults, FsyncErrorFailsTheSave) {
  expect_failure_before_rename(Op::Sync, EIO, 0, version_b(), "cannot fsync " + kTmp,
                               "Input/output error");
}

TEST(CheckpointFaults, CloseErrorFailsTheSave) {
  expect_failure_before_rename(Op::Close, EIO, 0, version_b(), "cannot close " + kTmp,
                               "Input/output error");
}

TEST(CheckpointFaults, RenameErrorFailsTheSave) {
  expect_failure_before_rename(Op::Rename, EACCES, 0, version_b(),
                               "cannot rename " + kTmp + " to " + kPath, "Permission denied");
}

TEST(CheckpointFaults, DirectorySyncErrorFailsTheSave) {
  auto fs = store_holding_a();
  std::string message = save_b_failing(*fs, version_b(), Op::SyncDir, EIO);
  EXPECT_TRUE(contains(message, kPath)) << message;
  EXPECT_TRUE(contains(message, "cannot fsync directory " + kDir)) << message;
  EXPECT_TRUE(contains(message, "Input/output error")) << message;
  // The rename has happened and cannot be undone: B is visible but not
  // durable, and a crash brings back A. Either way a complete checkpoint.
  EXPECT_TRUE(identical(checkpoint::load(kPath, *fs), version_b()));
  EXPECT_EQ(fs->list(kDir), std::vector<std::string>{"model.ckpt"});
  fs->crash();
  EXPECT_TRUE(identical(checkpoint::load(kPath, *fs), version_a()));
}

TEST(CheckpointFaults, ReadErrorNamesTheFile) {
  auto fs = store_holding_a();
  fs->fail_next(Op::Read, EIO);
  try {
    checkpoint::load(kPath, *fs);
    FAIL() << "load succeeded despite the injected fault";
  } catch (const std::runtime_error& e) {
    EXPECT_TRUE(contains(e.what(), "cannot open checkpoint " + kPath)) << e.what();
    EXPECT_TRUE(contains(e.what(), "Input/output error")) << e.what();
  }
  EXPECT_TRUE(identical(checkpoint::load(kPath, *fs), version_a()));
}

// The model the tests above rely on.
TEST(MemoryFileSystem, LosesWhatWasNotSyncedOnCrash) {
  MemoryFileSystem fs;
  ASSERT_TRUE(fs.create_dirs("/d/e").ok());
  std::unique_ptr<WritableFile> f;
  ASSERT_TRUE(fs.new_writable_file("/d/e/x", &f).ok());
  ASSERT_TRUE(f->append("durable").ok());
  ASSERT_TRUE(f->sync().ok());
  ASSERT_TRUE(f->append(" lost").ok());
  ASSERT_TRUE(f->close().ok());
  EXPECT_EQ(fs.contents("/d/e/x"), "durable lost");
  fs.crash();  // the entry was never made durable
  EXPECT_FALSE(fs.exists("/d/e/x"));
  EXPECT_TRUE(fs.exists("/d/e"));

  ASSERT_TRUE(fs.new_writable_file("/d/e/x", &f).ok());
  ASSERT_TRUE(f->append("durable").ok());
  ASSERT_TRUE(f->sync().ok());
  ASSERT_TRUE(fs.sync_dir("/d/e").ok());
  ASSERT_TRUE(f->append(" lost").ok());
  ASSERT_TRUE(fs.rename("/d/e/x", "/d/e/y").ok());
  EXPECT_EQ(fs.list("/d/e"), std::vector<std::string>{"y"});
  fs.crash();
  EXPECT_EQ(fs.list("/d/e"), std::vector<std::string>{"x"});
  EXPECT_EQ(fs.contents("/d/e/x"), "durable");
  EXPECT_TRUE(f->close().ok());  // an open file survives, orphaned

  // Faults count calls from their registration; a dead machine fails all.
  fs.fail_next(Op::Remove, ENOSPC, 1);
  EXPECT_TRUE(fs.remove("/d/e/nope").is_not_found());
  Status st = fs.remove("/d/e/x");
  EXPECT_EQ(st.error_number(), ENOSPC);
  EXPECT_EQ(st.message(), "cannot remove /d/e/x: No space left on device");
  fs.crash_after(1);
  EXPECT_TRUE(fs.create_dirs("/d/f").ok());
  EXPECT_EQ(fs.create_dirs("/d/g").error_number(), EIO);
  std::string data;
  EXPECT_EQ(fs.read_file("/d/e/x", &data).error_number(), EIO);
  EXPECT_FALSE(fs.exists("/d/e/x"));
  fs.crash();
  EXPECT_TRUE(fs.read_file("/d/e/x", &data).ok());
  EXPECT_EQ(data, "durable");
}

TEST(Status, CarriesKindErrnoAndMessage) {
  Status ok;
  EXPECT_TRUE(ok.ok());
  EXPECT_EQ(ok.error_number(), 0);
  EXPECT_EQ(ok.to_string(), "OK");
  Status io = Status::io_error("cannot write /x", ENOSPC);
  EXPECT_FALSE(io.ok());
  EXPECT_TRUE(io.is_io_error());
  EXPECT_EQ(io.error_number(), ENOSPC);
  EXPECT_EQ(io.message(), "cannot write /x: No space left on device");
  EXPECT_EQ(io.to_string(), "IO error: cannot write /x: No space left on device");
  Status nf = Status::not_found("no /y");
  EXPECT_TRUE(nf.is_not_found());
  EXPECT_FALSE(nf.is_io_error());
  EXPECT_EQ(nf.error_number(), 0);
  EXPECT_TRUE(Status::corruption("bad").is_corruption());
  EXPECT_EQ(Status::invalid_argument("why").to_string(), "Invalid argument: why");
}

class PosixCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/leasehold-ckpt-XXXXXX";
    ASSERT_TRUE(mkdtemp(tmpl));
    dir = tmpl;
  }
  void TearDown() override {
    ::chmod(dir.c_str(), 0700);
    std::filesystem::remove_all(dir);
  }
  std::string dir;
};

TEST_F(PosixCheckpoint, SaveAndLoadRoundTrip) {
  std::string path = dir + "/model.ckpt";
  checkpoint::save(path, version_a());
  EXPECT_TRUE(identical(checkpoint::load(path), version_a()));
  checkpoint::save(path, large_version_b());
  EXPECT_TRUE(identical(checkpoint::load(path), large_version_b()));
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    names.push_back(e.path().filename().string());
  }
  EXPECT_EQ(names, std::vector<std::string>{"model.ckpt"}) << "no temporary file is left";
  EXPECT_TRUE(default_file_system().exists(path));
  try {
    checkpoint::load(dir + "/missing.ckpt");
    FAIL() << "loading a missing checkpoint succeeded";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()),
              "cannot open checkpoint " + dir + "/missing.ckpt: No such file or directory");
  }
}

TEST_F(PosixCheckpoint, SaveIntoAMissingDirectoryNamesThePath) {
  std::string path = dir + "/missing/model.ckpt";
  try {
    checkpoint::save(path, version_a());
    FAIL() << "save into a missing directory succeeded";
  } catch (const std::runtime_error& e) {
    EXPECT_TRUE(contains(e.what(), "cannot create " + path + ".tmp")) << e.what();
    EXPECT_TRUE(contains(e.what(), "No such file or directory")) << e.what();
  }
}

TEST_F(PosixCheckpoint, SaveIntoAReadOnlyDirectoryNamesThePathAndKeepsTheOld) {
  std::string path = dir + "/model.ckpt";
  checkpoint::save(path, version_a());
  ASSERT_EQ(::chmod(dir.c_str(), 0500), 0);
  if (::access(dir.c_str(), W_OK) == 0) {
    GTEST_SKIP() << "permissions do not stop this user (root?) writing to " << dir;
  }
  try {
    checkpoint::save(path, version_b());
    FAIL() << "save into a read-only directory succeeded";
  } catch (const std::runtime_error& e) {
    EXPECT_TRUE(contains(e.what(), "cannot create " + path + ".tmp")) << e.what();
    EXPECT_TRUE(contains(e.what(), "Permission denied")) << e.what();
  }
  EXPECT_TRUE(identical(checkpoint::load(path), version_a()));
}

}  // namespace
}  // namespace leasehold::engine
