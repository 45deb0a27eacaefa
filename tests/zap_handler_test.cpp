// The ZAP handler on a real ipc:// socket: every message of a connection
// arrives with the user's name and groups, looked up once when it
// connected (off the poll loop), and the loop reads them from the message.
#include <gtest/gtest.h>
#include <grp.h>
#include <pwd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "coordinator/access.h"
#include "coordinator/peer.h"
#include "coordinator/zap_handler.h"

namespace leasehold {
namespace {

TEST(ZapHandler, IpcPeersArriveWithTheirUserAndGroups) {
  char tmpl[] = "/tmp/leasehold-zap-XXXXXX";
  ASSERT_TRUE(mkdtemp(tmpl));
  const std::string endpoint = std::string("ipc://") + tmpl + "/s.sock";
  zmq::context_t ctx(1);
  {
    ZapHandler zap(ctx, std::nullopt);
    zmq::socket_t router(ctx, zmq::socket_type::router);
    router.set(zmq::sockopt::linger, 0);
    router.set(zmq::sockopt::zap_domain, ZapHandler::kDomain);
    router.bind(endpoint);
    zmq::socket_t dealer(ctx, zmq::socket_type::dealer);
    dealer.set(zmq::sockopt::linger, 0);
    dealer.connect(endpoint);
    dealer.send(zmq::str_buffer("hello"), zmq::send_flags::none);
    zmq::message_t id, body;
    zmq::pollitem_t item{router.handle(), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, std::chrono::seconds(5));
    ASSERT_TRUE(item.revents & ZMQ_POLLIN) << "the handler let the local peer in";
    ASSERT_TRUE(router.recv(id));
    ASSERT_TRUE(router.recv(body));
    const Peer peer = peer_of(body);
    EXPECT_TRUE(peer.known);
    EXPECT_EQ(peer.uid, ::getuid());
    EXPECT_EQ(peer.pid, ::getpid());
    EXPECT_EQ(peer.user, look_up_user(::getuid()).name);
    ASSERT_TRUE(peer.groups) << "groups looked up by the handler";
    EXPECT_EQ(*peer.groups, look_up_user(::getuid()).groups);
    EXPECT_NE(std::find(peer.groups->begin(), peer.groups->end(), ::getgid()),
              peer.groups->end());
    EXPECT_TRUE(peer.key.empty());
  }
  std::filesystem::remove_all(tmpl);
}

TEST(ZapHandler, MetadataIsEncodedAsZmtpProperties) {
  const std::string m = zap_metadata({{"X-User", "ab"}, {"X-Groups", ""}});
  EXPECT_EQ(m, std::string("\x06X-User\0\0\0\x02" "ab" "\x08X-Groups\0\0\0\0", 26));
}

}  // namespace
}  // namespace leasehold
