// The folder of an ipc:// socket: whoever may remove or rename entries in
// it could put their own socket in the coordinator's place, so such a
// folder is refused at start-up, naming it and why.
#include "coordinator/socket_files.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

namespace leasehold {
namespace {

namespace fs = std::filesystem;

class SocketFolder : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string t = (fs::temp_directory_path() / "leasehold-socket-XXXXXX").string();
    ASSERT_NE(::mkdtemp(t.data()), nullptr);
    dir = t;
  }
  void TearDown() override { fs::remove_all(dir); }

  // The error preparing the folder `sub` of the test folder ("" if none).
  std::string prepare(const std::string& sub) {
    try {
      prepare_socket_directory("ipc://" + dir + "/" + sub + "/c.sock", socket_access(0660, ""));
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  }
  mode_t mode_of(const std::string& sub) {
    struct stat st {};
    EXPECT_EQ(::stat((dir + "/" + sub).c_str(), &st), 0);
    return st.st_mode & 07777;
  }
  std::string dir;
};

TEST_F(SocketFolder, AMissingFolderIsMadeForTheSocketsGroup) {
  EXPECT_EQ(prepare("run/leasehold"), "");
  EXPECT_EQ(mode_of("run/leasehold"), 0750u);
}

TEST_F(SocketFolder, AFolderAnyoneMayWriteIsRefusedUnlessSticky) {
  fs::create_directory(dir + "/open");
  ASSERT_EQ(::chmod((dir + "/open").c_str(), 0777), 0);
  const std::string e = prepare("open");
  EXPECT_NE(e.find(dir + "/open may be written by anyone and is not sticky"), std::string::npos)
      << e;
  ASSERT_EQ(::chmod((dir + "/open").c_str(), 01777), 0);  // like /tmp
  EXPECT_EQ(prepare("open"), "");
}

TEST_F(SocketFolder, AFolderOfAnotherUserIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a folder to another user";
  fs::create_directory(dir + "/theirs");
  ASSERT_EQ(::chown((dir + "/theirs").c_str(), 65534, 65534), 0);
  const std::string e = prepare("theirs");
  EXPECT_NE(e.find(dir + "/theirs belongs to uid 65534"), std::string::npos) << e;
}

}  // namespace
}  // namespace leasehold
