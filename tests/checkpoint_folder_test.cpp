// Where checkpoints may be written (shared/checkpoint_folder.h): a folder of
// the submitter's, or the job's private one; reached through no link,
// checked at every open; system folders never.
#include "shared/checkpoint_folder.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <vector>

namespace leasehold {
namespace {

namespace fs = std::filesystem;

class CheckpointFolderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/leasehold-ckpt-XXXXXX";
    ASSERT_TRUE(mkdtemp(tmpl));
    dir = fs::canonical(tmpl).string();
  }
  void TearDown() override { fs::remove_all(dir); }
  static std::string read(const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  static Status write(FileSystem& f, const std::string& path, const std::string& text) {
    std::unique_ptr<WritableFile> out;
    if (Status st = f.new_writable_file(path, &out); !st.ok()) return st;
    if (Status st = out->append(text); !st.ok()) return st;
    return out->close();
  }
  // What constructing a folder threw ("" when nothing).
  static std::string refusal(const std::string& d, CheckpointOwner owner, bool create = false) {
    try {
      CheckpointFolder f(d, owner, create);
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  }
  std::string dir;
  const CheckpointOwner me = CheckpointOwner::this_user();
};

TEST_F(CheckpointFolderTest, AUsersOwnFolderIsUsedThroughItsDescriptor) {
  fs::create_directory(dir + "/mine");
  CheckpointFolder f(dir + "/mine", me, false);
  ASSERT_TRUE(write(f, dir + "/mine/a.ckpt.tmp", "weights").ok());
  ASSERT_TRUE(f.rename(dir + "/mine/a.ckpt.tmp", dir + "/mine/a.ckpt").ok());
  ASSERT_TRUE(f.sync_dir(dir + "/mine").ok());
  EXPECT_TRUE(f.exists(dir + "/mine/a.ckpt"));
  std::string text;
  ASSERT_TRUE(f.read_file(dir + "/mine/a.ckpt", &text).ok());
  EXPECT_EQ(text, "weights");
  struct stat st {};
  ASSERT_EQ(::stat((dir + "/mine/a.ckpt").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u) << "readable by its owner only";
  // Only files directly inside.
  for (const std::string& bad : std::vector<std::string>{dir + "/mine/../x", dir + "/mine/sub/x", dir + "/other/x",
                                dir + "/mine", dir + "/minex/y"}) {
    EXPECT_FALSE(write(f, bad, "x").ok()) << bad;
    EXPECT_FALSE(f.exists(bad)) << bad;
  }
  EXPECT_FALSE(fs::exists(dir + "/x"));
}

TEST_F(CheckpointFolderTest, ALinkAnywhereOnThePathOrAsTheFileIsRefused) {
  fs::create_directories(dir + "/victim");
  std::ofstream(dir + "/victim/net.ckpt") << "victim's";
  // The folder itself swapped for a link, and a link higher up.
  fs::create_directory_symlink(dir + "/victim", dir + "/attack");
  EXPECT_NE(refusal(dir + "/attack", me).find("is a symbolic link"), std::string::npos);
  fs::create_directory_symlink(dir, dir + "/up");
  EXPECT_NE(refusal(dir + "/up/victim", me).find("is a symbolic link"), std::string::npos);
  // A link planted inside a real folder, as the checkpoint file.
  fs::create_directory(dir + "/real");
  fs::create_symlink(dir + "/victim/net.ckpt", dir + "/real/net.ckpt");
  CheckpointFolder f(dir + "/real", me, false);
  std::string text;
  Status st = f.read_file(dir + "/real/net.ckpt", &text);
  EXPECT_FALSE(st.ok()) << "read through the link";
  EXPECT_NE(st.to_string().find("/real/net.ckpt"), std::string::npos) << st.to_string();
  EXPECT_FALSE(write(f, dir + "/real/net.ckpt", "overwritten").ok());
  // A checkpoint written as usual (a temporary renamed over it) replaces
  // the link, not what it points to.
  ASSERT_TRUE(write(f, dir + "/real/net.ckpt.tmp", "ours").ok());
  ASSERT_TRUE(f.rename(dir + "/real/net.ckpt.tmp", dir + "/real/net.ckpt").ok());
  EXPECT_FALSE(fs::is_symlink(dir + "/real/net.ckpt"));
  EXPECT_EQ(read(dir + "/real/net.ckpt"), "ours");
  EXPECT_EQ(read(dir + "/victim/net.ckpt"), "victim's");
}

TEST_F(CheckpointFolderTest, AFolderSwappedAfterItWasCheckedIsCaughtAtTheNextOpen) {
  fs::create_directories(dir + "/victim");
  std::ofstream(dir + "/victim/net.ckpt") << "victim's";
  fs::create_directory(dir + "/job");
  EXPECT_EQ(checkpoint_folder_refusal(dir + "/job", me.uid), std::nullopt) << "fine at submit";
  fs::rename(dir + "/job", dir + "/job.moved");
  fs::create_directory_symlink(dir + "/victim", dir + "/job");
  EXPECT_NE(refusal(dir + "/job", me).find("is a symbolic link"), std::string::npos);
  EXPECT_EQ(read(dir + "/victim/net.ckpt"), "victim's");
}

TEST_F(CheckpointFolderTest, OnlyTheSubmittersFolderTakesTheirCheckpoints) {
  fs::create_directory(dir + "/theirs");
  // The folder is ours; a job of another uid may not name it.
  const int64_t other = me.uid + 4242;
  auto no = checkpoint_folder_refusal(dir + "/theirs", other);
  ASSERT_TRUE(no);
  EXPECT_NE(no->find("not to the job's submitter (uid " + std::to_string(other) + ")"),
            std::string::npos)
      << *no;
  EXPECT_NE(refusal(dir + "/theirs", {false, other}).find("not to the job's submitter"),
            std::string::npos);
  // A network submitter's uid is not known: no folder of theirs at all.
  EXPECT_NE(refusal(dir + "/theirs", {false, -1}).find("not known"), std::string::npos);
  if (::geteuid() == 0) {
    // Given to another user after it was checked: refused at the next open
    // (a resume from a folder that changed owner).
    EXPECT_EQ(refusal(dir + "/theirs", me), "");
    ASSERT_EQ(::chown((dir + "/theirs").c_str(), 4242, 4242), 0);
    EXPECT_NE(refusal(dir + "/theirs", me).find("belongs to uid 4242"), std::string::npos);
  }
}

TEST_F(CheckpointFolderTest, SystemFoldersAndUnplainPathsAreRefusedToEveryone) {
  for (const char* d : {"/", "/etc", "/etc/cron.d", "/usr/lib", "/proc/self", "/var", "/tmp",
                        "/home", "/root", "/dev/shm", "/sys"}) {
    for (int64_t uid : {int64_t{0}, me.uid}) {
      auto no = checkpoint_folder_refusal(d, uid);
      ASSERT_TRUE(no) << d;
      EXPECT_NE(no->find("system folder"), std::string::npos) << d << ": " << *no;
      EXPECT_NE(refusal(d, {false, uid}).find("system folder"), std::string::npos) << d;
    }
  }
  fs::create_directory(dir + "/a");
  for (const std::string& d : std::vector<std::string>{dir + "/a/..", dir + "/./a", dir + "//a", dir + "/a/", "relative/a",
                              std::string()}) {
    auto no = checkpoint_folder_refusal(d, me.uid);
    ASSERT_TRUE(no) << d;
    EXPECT_TRUE(no->find("plain path") != std::string::npos ||
                no->find("absolute") != std::string::npos)
        << *no;
  }
  auto missing = checkpoint_folder_refusal(dir + "/nope", me.uid);
  ASSERT_TRUE(missing);
  EXPECT_NE(missing->find("does not exist"), std::string::npos) << *missing;
}

TEST_F(CheckpointFolderTest, APrivateFolderIsMadeReachableByItsAgentAlone) {
  const std::string d = dir + "/state/checkpoints/7";
  // Not there yet: nothing to resume from.
  try {
    CheckpointFolder f(d, {true, -1}, false);
    FAIL() << "opened a folder that does not exist";
  } catch (const std::system_error& e) {
    EXPECT_EQ(e.code().value(), ENOENT);
  }
  {
    CheckpointFolder f(d, {true, -1}, true);
    EXPECT_TRUE(write(f, d + "/j.ckpt", "w").ok());
  }
  struct stat st {};
  ASSERT_EQ(::stat(d.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_EQ(st.st_uid, ::geteuid());
  EXPECT_EQ(refusal(d, {true, -1}), "");
  ASSERT_EQ(::chmod(d.c_str(), 0755), 0);
  EXPECT_NE(refusal(d, {true, -1}).find("mode 0755"), std::string::npos);
}

}  // namespace
}  // namespace leasehold
