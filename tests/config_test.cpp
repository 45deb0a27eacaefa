#include <gtest/gtest.h>

#include <functional>

#include "coordinator/options.h"
#include "shared/endpoint.h"
#include "shared/units.h"

namespace leasehold {
namespace {

// What `f` threw as std::invalid_argument; "" when it threw nothing.
std::string refusal(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(Units, ParsesBytes) {
  EXPECT_EQ(parse_bytes("123"), 123u);
  EXPECT_EQ(parse_bytes("4GiB"), 4ull << 30);
  EXPECT_EQ(parse_bytes("64 kib"), 64u << 10);
  EXPECT_EQ(parse_bytes("1.5GB"), 1500000000u);
  EXPECT_EQ(parse_bytes("2MiB"), 2u << 20);
  EXPECT_THROW(parse_bytes("12 parsecs"), std::invalid_argument);
  EXPECT_THROW(parse_bytes("-1"), std::invalid_argument);
  EXPECT_THROW(parse_bytes(""), std::invalid_argument);
  EXPECT_THROW(parse_bytes("99999999TiB"), std::out_of_range);
}

TEST(Units, ParsesSizeSpecs) {
  auto p = parse_size_spec("90%");
  EXPECT_DOUBLE_EQ(p.percent, 90.0);
  EXPECT_EQ(p.resolve(1000), 900u);
  EXPECT_EQ(parse_size_spec("1GiB").resolve(5), 1ull << 30);
  EXPECT_THROW(parse_size_spec("0%"), std::invalid_argument);
  EXPECT_THROW(parse_size_spec("150%"), std::invalid_argument);
}

TEST(Units, ParsesFractions) {
  EXPECT_DOUBLE_EQ(parse_fraction("80%"), 0.8);
  EXPECT_DOUBLE_EQ(parse_fraction("0.95"), 0.95);
  EXPECT_DOUBLE_EQ(parse_fraction("1"), 1.0);
  for (const char* bad : {"0", "0%", "120%", "1.5", "high", "80%%", ""}) {
    EXPECT_THROW(parse_fraction(bad), std::invalid_argument) << bad;
  }
}

TEST(Config, WatermarksAndPolicyFromToml) {
  CoordinatorOptions o;
  apply_toml(o,
             "policy = \"fifo\"\nlow_watermark = \"70%\"\nhigh_watermark = 0.9\n"
             "shrink_timeout = \"2s\"\n",
             "lh.toml");
  EXPECT_EQ(o.policy, "fifo");
  EXPECT_DOUBLE_EQ(o.low_watermark, 0.7);
  EXPECT_DOUBLE_EQ(o.high_watermark, 0.9);
  EXPECT_EQ(o.shrink_timeout, std::chrono::seconds(2));
  EXPECT_THROW(apply_toml(o, "low_watermark = \"lots\"\n", "lh.toml"), std::invalid_argument);
}

TEST(Units, ParsesDurations) {
  EXPECT_EQ(parse_duration("250ms").count(), 250);
  EXPECT_EQ(parse_duration("2s").count(), 2000);
  EXPECT_EQ(parse_duration("1.5").count(), 1500);
  EXPECT_EQ(parse_duration("3m").count(), 180000);
  EXPECT_THROW(parse_duration("3 fortnights"), std::invalid_argument);
}

TEST(Units, FormatsBytes) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(3ull << 30), "3.00 GiB");
}

TEST(Config, TomlOverridesDefaults) {
  CoordinatorOptions o;
  apply_toml(o,
             "endpoint = \"ipc:///tmp/x.sock\"\nbackend = \"host\"\npool_size = \"50%\"\n"
             "alignment = \"64KiB\"\nheartbeat_interval = \"250ms\"\ndevice = 1\n",
             "test.toml");
  EXPECT_EQ(o.endpoint, "ipc:///tmp/x.sock");
  EXPECT_EQ(o.backend, "host");
  ASSERT_EQ(o.pool_size.size(), 1u);
  EXPECT_DOUBLE_EQ(o.pool_size[0].percent, 50.0);
  EXPECT_EQ(o.alignment, 64u << 10);
  EXPECT_EQ(o.heartbeat_interval.count(), 250);
  EXPECT_EQ(o.devices, std::vector<int>{1}) << "device = N is devices = [N]";
}

TEST(Config, DevicesAndPerDevicePoolSizes) {
  CoordinatorOptions o;
  EXPECT_TRUE(o.devices.empty()) << "all devices by default";
  EXPECT_EQ(o.host_devices, 1);
  apply_toml(o,
             "devices = [0, 2, 3]\npool_size = [\"40GiB\", \"60%\", \"1GiB\"]\n"
             "host_devices = 3\n",
             "lh.toml");
  EXPECT_EQ(o.devices, (std::vector<int>{0, 2, 3}));
  ASSERT_EQ(o.pool_size.size(), 3u);
  EXPECT_EQ(o.pool_size[0].bytes, 40ull << 30);
  EXPECT_DOUBLE_EQ(o.pool_size[1].percent, 60.0);
  EXPECT_EQ(o.host_devices, 3);
  apply_toml(o, "devices = \"all\"\npool_size = \"2GiB\"\n", "lh.toml");
  EXPECT_TRUE(o.devices.empty());
  apply_toml(o, "devices = \"1, 0\"\n", "lh.toml");
  EXPECT_EQ(o.devices, (std::vector<int>{1, 0}));
  for (const char* bad : {"devices = [0, 0]\n", "devices = \"0,,1\"\n", "devices = -1\n",
                          "devices = \"gpu0\"\n", "devices = [[0]]\n", "host_devices = 0\n",
                          "pool_size = \"1GiB,\"\n", "pool_size = [\"lots\"]\n"}) {
    CoordinatorOptions before = o;
    EXPECT_THROW(apply_toml(o, bad, "lh.toml"), std::invalid_argument) << bad;
    EXPECT_EQ(o.devices, before.devices) << "a refused value changes nothing: " << bad;
  }
  EXPECT_THROW(apply_toml(o, "device = 1\ndevices = [0, 1]\n", "lh.toml"), std::invalid_argument)
      << "device and devices together";
  // As many sizes as devices, or one for all.
  o.endpoint = "ipc:///tmp/x.sock";
  o.events_endpoint = default_events_endpoint(o.endpoint);
  o.state_dir = "/tmp/x-state";
  o.devices = {0, 1};
  o.pool_size = {SizeSpec{1ull << 30, 0}, SizeSpec{0, 50.0}};
  EXPECT_NO_THROW(validate(o));
  o.pool_size.push_back(SizeSpec{1ull << 30, 0});
  try {
    validate(o);
    FAIL() << "three sizes for two devices accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("3 sizes for 2 devices"), std::string::npos) << e.what();
  }
}

TEST(Config, ErrorsNameTheKeyAndFile) {
  CoordinatorOptions o;
  try {
    apply_toml(o, "pool_sise = \"1GiB\"\n", "lh.toml");
    FAIL() << "unknown key accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("lh.toml"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("pool_sise"), std::string::npos);
  }
  try {
    apply_toml(o, "heartbeat_interval = \"soon\"\n", "lh.toml");
    FAIL() << "bad duration accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("heartbeat_interval"), std::string::npos);
  }
  EXPECT_THROW(apply_toml(o, "this is not toml", "lh.toml"), std::invalid_argument);
  EXPECT_THROW(apply_toml(o, "backend = [1, 2]", "lh.toml"), std::invalid_argument);
}

TEST(Config, ValidateRejectsImpossibleValues) {
  CoordinatorOptions o;
  o.endpoint = "ipc:///tmp/x.sock";
  o.events_endpoint = default_events_endpoint(o.endpoint);
  o.state_dir = "/tmp/x-state";
  EXPECT_EQ(o.events_endpoint, "ipc:///tmp/x.events");
  EXPECT_NO_THROW(validate(o));
  auto bad = o;
  bad.state_dir = "";
  EXPECT_THROW(validate(bad), std::invalid_argument);
  bad = o;
  bad.alignment = 3000;
  EXPECT_THROW(validate(bad), std::invalid_argument);
  bad = o;
  bad.silence_limit = bad.heartbeat_interval;  // less than two heartbeats
  EXPECT_THROW(validate(bad), std::invalid_argument);
  bad = o;
  bad.backend = "tpu";
  EXPECT_THROW(validate(bad), std::invalid_argument);
  bad = o;
  bad.heartbeat_interval = std::chrono::milliseconds(0);
  EXPECT_THROW(validate(bad), std::invalid_argument);
  bad = o;
  bad.policy = "lottery";
  EXPECT_THROW(validate(bad), std::invalid_argument);
  bad = o;
  bad.low_watermark = 0.99;  // above the high one
  EXPECT_THROW(validate(bad), std::invalid_argument);
  bad = o;
  bad.mps = "maybe";
  EXPECT_THROW(validate(bad), std::invalid_argument);
  bad = o;
  bad.mps = "on";
  bad.backend = "host";  // MPS is for the GPU
  EXPECT_THROW(validate(bad), std::invalid_argument);
  bad = o;
  bad.mps = "off";
  bad.mps_directory = "/run/mps";
  EXPECT_THROW(validate(bad), std::invalid_argument);
  for (const char* listen : {"9464", "localhost:", ":9464", "127.0.0.1:http", "[::1]:70000"}) {
    bad = o;
    bad.http_listen = listen;
    try {
      validate(bad);
      ADD_FAILURE() << listen << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(listen), std::string::npos) << e.what();
    }
  }
  auto good = o;
  for (const char* listen : {"off", "0.0.0.0:9464", "[::1]:9464", "localhost:0"}) {
    good.http_listen = listen;
    EXPECT_NO_THROW(validate(good)) << listen;
  }
}

// The job and wait limits are options; values that could not work are
// refused by name at start-up.
TEST(Config, LimitsFromToml) {
  CoordinatorOptions o;
  o.endpoint = "ipc:///tmp/x.sock";
  o.events_endpoint = default_events_endpoint(o.endpoint);
  o.state_dir = "/tmp/x-state";
  apply_toml(o, "max_lease_wait = \"1h\"\nmax_epochs = 500\nmax_steps = 20000000000\n", "lh.toml");
  EXPECT_EQ(o.max_lease_wait, std::chrono::hours(1));
  EXPECT_EQ(o.max_epochs, 500);
  EXPECT_EQ(o.max_steps, 20000000000);
  EXPECT_NO_THROW(validate(o));
  for (const char* bad : {"max_epochs = 0\n", "max_epochs = \"many\"\n", "max_steps = -5\n"}) {
    auto c = o;
    const std::string e = refusal([&] { apply_toml(c, bad, "lh.toml"); });
    EXPECT_NE(e.find("is not a count"), std::string::npos) << bad << ": " << e;
  }
  auto shorter = o;
  shorter.max_lease_wait = std::chrono::seconds(5);  // below lease_wait_timeout (30 s)
  const std::string e = refusal([&] { validate(shorter); });
  EXPECT_NE(e.find("longer than max_lease_wait"), std::string::npos) << e;
  auto huge = o;
  huge.max_lease_wait = std::chrono::hours(24 * 30);  // past a request's 32-bit milliseconds
  EXPECT_THROW(validate(huge), std::invalid_argument);
  // A cancelled job's agent may be waiting for a lease: stop_timeout gives
  // it longer than that wait.
  auto hasty = o;
  hasty.stop_timeout = std::chrono::seconds(20);  // lease_wait_timeout is 30 s
  const std::string h = refusal([&] { validate(hasty); });
  EXPECT_NE(h.find("must be longer than lease_wait_timeout"), std::string::npos) << h;
  auto relative = o;
  relative.state_dir = "state";
  EXPECT_THROW(validate(relative), std::invalid_argument) << "agents could not find checkpoints";
}

TEST(Config, HttpListenFromToml) {
  CoordinatorOptions o;
  EXPECT_EQ(o.http_listen, "127.0.0.1:9464") << "loopback unless asked";
  apply_toml(o, "http_listen = \"off\"\n", "lh.toml");
  EXPECT_EQ(o.http_listen, "off");
}

TEST(Config, SocketModeAndCurveFromToml) {
  CoordinatorOptions o;
  EXPECT_EQ(o.socket_mode, 0660u);
  apply_toml(o, "socket_mode = \"0600\"\nsocket_group = \"leasehold\"\n", "lh.toml");
  EXPECT_EQ(o.socket_mode, 0600u);
  EXPECT_EQ(o.socket_group, "leasehold");
  apply_toml(o, "socket_mode = 0o666\n", "lh.toml");
  EXPECT_EQ(o.socket_mode, 0666u);
  for (const char* bad : {"socket_mode = \"0640x\"\n", "socket_mode = \"01777\"\n",
                          "socket_mode = \"0060\"\n", "socket_mode = 660\n"}) {
    try {
      apply_toml(o, bad, "lh.toml");
      ADD_FAILURE() << bad;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("key 'socket_mode'"), std::string::npos) << e.what();
    }
  }
  // A network endpoint without CURVE keys is refused, naming the endpoint.
  o = CoordinatorOptions{};
  o.state_dir = "/tmp";
  apply_toml(o, "endpoint = \"tcp://0.0.0.0:7000\"\nevents_endpoint = \"tcp://0.0.0.0:7001\"\n",
             "lh.toml");
  try {
    validate(o);
    ADD_FAILURE() << "tcp:// without keys validated";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("tcp://0.0.0.0:7000 is a network endpoint"),
              std::string::npos)
        << e.what();
  }
  apply_toml(o,
             "curve_key = \"/etc/leasehold/coordinator.key\"\n"
             "curve_allowed_keys = \"/etc/leasehold/allowed\"\n",
             "lh.toml");
  EXPECT_NO_THROW(validate(o));
}

TEST(Config, MpsFromToml) {
  CoordinatorOptions o;
  EXPECT_EQ(o.mps, "auto");
  apply_toml(o, "mps = \"on\"\nmps_directory = \"/run/mps\"\n", "lh.toml");
  EXPECT_EQ(o.mps, "on");
  EXPECT_EQ(o.mps_directory, "/run/mps");
}

TEST(Endpoint, EnvironmentSetsDefault) {
  setenv(kEndpointEnv, "ipc:///tmp/from-env.sock", 1);
  EXPECT_EQ(default_endpoint(), "ipc:///tmp/from-env.sock");
  unsetenv(kEndpointEnv);
  setenv("XDG_RUNTIME_DIR", "/run/user/7", 1);
  EXPECT_EQ(default_endpoint(), "ipc:///run/user/7/leasehold/coordinator.sock");
  EXPECT_EQ(ipc_path("ipc:///a/b.sock"), "/a/b.sock");
  EXPECT_FALSE(ipc_path("tcp://127.0.0.1:5555"));
}

// An agent's own state (its spill files) is one folder per coordinator it
// serves, unless systemd gives the unit one.
TEST(Endpoint, AgentsOfTwoCoordinatorsNeverShareAStateFolder) {
  unsetenv("STATE_DIRECTORY");
  setenv("XDG_STATE_HOME", "/tmp/xdg-state", 1);
  const std::string a = default_agent_state_dir("ipc:///run/user/7/leasehold/coordinator.sock");
  const std::string b = default_agent_state_dir("ipc:///tmp/other/coordinator.sock");
  EXPECT_EQ(a, "/tmp/xdg-state/leasehold/agents/ipc_run_user_7_leasehold_coordinator.sock");
  EXPECT_NE(a, b);
  EXPECT_EQ(default_agent_state_dir("tcp://10.0.0.2:5555"),
            "/tmp/xdg-state/leasehold/agents/tcp_10.0.0.2_5555");
  setenv("STATE_DIRECTORY", "/var/lib/leasehold", 1);
  EXPECT_EQ(default_agent_state_dir("ipc:///run/leasehold/coordinator.sock"), "/var/lib/leasehold");
  unsetenv("STATE_DIRECTORY");
  unsetenv("XDG_STATE_HOME");
}

}  // namespace
}  // namespace leasehold
