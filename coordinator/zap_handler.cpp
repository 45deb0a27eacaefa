#include "coordinator/zap_handler.h"

#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "coordinator/access.h"
#include "coordinator/peer.h"
#include "coordinator/socket_files.h"
#include "shared/curve_keys.h"
#include "shared/printable.h"

namespace leasehold {
namespace {

// Where libzmq asks (RFC 27).
constexpr const char* kZapEndpoint = "inproc://zeromq.zap.01";
// Refusals are logged at most this often, with their count.
constexpr auto kRefusalLogInterval = std::chrono::seconds(10);

std::string z85(const void* raw32) {
  char text[41];
  zmq_z85_encode(text, static_cast<const uint8_t*>(raw32), 32);
  return text;
}

}  // namespace

std::string zap_metadata(const std::vector<std::pair<std::string, std::string>>& properties) {
  std::string out;
  for (const auto& [name, value] : properties) {
    out += static_cast<char>(static_cast<uint8_t>(name.size()));
    out += name;
    const uint32_t n = static_cast<uint32_t>(value.size());
    for (int shift = 24; shift >= 0; shift -= 8) out += static_cast<char>((n >> shift) & 0xff);
    out += value;
  }
  return out;
}

ZapHandler::ZapHandler(zmq::context_t& ctx, std::optional<std::string> allowed_dir)
    : dir_(std::move(allowed_dir)), socket_(ctx, zmq::socket_type::rep) {
  if (dir_) {
    if (!std::filesystem::is_directory(*dir_)) {
      throw std::runtime_error("curve_allowed_keys " + *dir_ + " is not a directory");
    }
    keys_ = read_directory(true);
    if (keys_.empty()) {
      spdlog::warn(
          "curve_allowed_keys {} holds no *.pub file: no client or agent can connect "
          "over the network until one is added",
          *dir_);
    }
  }
  socket_.set(zmq::sockopt::linger, 0);
  try {
    socket_.bind(kZapEndpoint);
  } catch (const zmq::error_t& e) {
    throw std::runtime_error(std::string("cannot bind the ZAP handler: ") + e.what());
  }
  thread_ = std::thread([this] { serve(); });
}

ZapHandler::~ZapHandler() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

size_t ZapHandler::allowed_keys(bool agents) const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& [key, k] : keys_) n += agents ? k.agent : k.client;
  return n;
}

void ZapHandler::read_folder(const std::string& folder, bool agents, bool strict, Keys& keys,
                             std::string& problems) const {
  auto problem = [&](const std::string& what) {
    if (strict) throw std::runtime_error("curve_allowed_keys: " + what);
    problems += (problems.empty() ? "" : "; ") + what;
  };
  struct stat st {};
  if (::stat(folder.c_str(), &st) != 0) {
    if (agents && errno == ENOENT) return;  // no agents/ folder: no agent keys
    return problem("cannot read " + folder + ": " + std::strerror(errno));
  }
  if ((st.st_mode & 022) != 0) {
    return problem(folder + " may be written by group or others: its keys are not trusted");
  }
  // Like ssh's StrictModes: keys count only in folders and files that this
  // coordinator's user or root owns.
  if (!owned_by_us_or_root(st)) {
    return problem(folder + " belongs to uid " + std::to_string(st.st_uid) +
                   ", neither this coordinator's user nor root: its keys are not trusted");
  }
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(folder, ec)) {
    if (entry.path().extension() != ".pub") continue;
    const std::string file = entry.path().string();
    struct stat fst {};
    if (::stat(file.c_str(), &fst) == 0 && (fst.st_mode & 022) != 0) {
      problem(file + " may be written by group or others: not trusted");
      continue;
    }
    if (!owned_by_us_or_root(fst)) {
      problem(file + " belongs to uid " + std::to_string(fst.st_uid) +
              ", neither this coordinator's user nor root: not trusted");
      continue;
    }
    try {
      AllowedKey& k = keys[read_curve_public_key(file)];
      // Clients are read first, so a key in both folders has the client's
      // name; an agent's own key is named "agents/NAME", so that it never
      // shares a name (whose jobs it may cancel) with a client's key.
      if (k.name.empty()) k.name = (agents ? "agents/" : "") + entry.path().stem().string();
      (agents ? k.agent : k.client) = true;
    } catch (const std::exception& e) {
      problem(e.what());
    }
  }
  if (ec) problem("cannot read " + folder + ": " + ec.message());
}

ZapHandler::Keys ZapHandler::read_directory(bool strict) {
  Keys keys;
  std::string problems;
  read_folder(*dir_, false, strict, keys, problems);
  read_folder(*dir_ + "/agents", true, strict, keys, problems);
  if (problems != problems_logged_) {
    if (!problems.empty()) spdlog::warn("curve_allowed_keys: skipping {}", problems);
    problems_logged_ = problems;
  }
  return keys;
}

void ZapHandler::serve() {
  while (!stop_.load()) {
    zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
    try {
      zmq::poll(&item, 1, std::chrono::milliseconds(200));
      if (!(item.revents & ZMQ_POLLIN)) continue;
      std::vector<zmq::message_t> request;
      zmq::message_t frame;
      while (socket_.recv(frame, zmq::recv_flags::none)) {
        const bool more = frame.more();
        if (request.size() < 8) request.push_back(std::move(frame));
        if (!more) break;
      }
      Answer a;
      try {
        a = decide(request);
      } catch (const std::exception& e) {
        // Refused, never let in by accident; the handler keeps serving.
        a.text = std::string("internal error: ") + e.what();
        spdlog::error("ZAP handler: {}", a.text);
      }
      // [version, request id, status code, status text, user id, metadata]
      socket_.send(zmq::str_buffer("1.0"), zmq::send_flags::sndmore);
      if (request.size() > 1) {
        socket_.send(request[1], zmq::send_flags::sndmore);
      } else {
        socket_.send(zmq::message_t(), zmq::send_flags::sndmore);
      }
      socket_.send(zmq::buffer(a.status), zmq::send_flags::sndmore);
      socket_.send(zmq::buffer(a.text), zmq::send_flags::sndmore);
      socket_.send(zmq::buffer(a.user_id), zmq::send_flags::sndmore);
      socket_.send(zmq::buffer(a.metadata), zmq::send_flags::none);
    } catch (const zmq::error_t& e) {
      if (e.num() == ETERM) return;
      if (e.num() != EINTR) spdlog::error("ZAP handler: {}", e.what());
    }
  }
}

ZapHandler::Answer ZapHandler::decide(std::vector<zmq::message_t>& request) {
  // [version, request id, domain, address, identity, mechanism, credentials...]
  const std::string address = request.size() > 3 ? request[3].to_string() : "";
  Answer a;
  a.text = "malformed ZAP request";
  if (request.size() >= 6 && request[0].to_string() == "1.0") {
    const std::string mechanism = request[5].to_string();
    if (mechanism == "NULL") {
      a = local_peer(address);
    } else if (mechanism == "CURVE" && request.size() >= 7 && request[6].size() == 32) {
      a = curve_peer(request[6]);
    } else {
      a.text = "mechanism " + mechanism + " is not accepted here";
    }
  }
  if (a.status != "200") log_refusal(address, a.text);
  return a;
}

ZapHandler::Answer ZapHandler::local_peer(const std::string& address) const {
  Answer a;
  const Peer peer = parse_peer_address(address);
  if (!peer.known) {
    // Only ipc:// connections come without CURVE.
    a.text = "no CURVE and no kernel credentials (address " + address + ")";
    return a;
  }
  const UserInfo user = look_up_user(peer.uid);
  std::string groups;
  for (uint32_t g : user.groups) groups += (groups.empty() ? "" : ",") + std::to_string(g);
  a.status = "200";
  a.text = "OK";
  a.metadata = zap_metadata({{"X-User", user.name}, {"X-Groups", groups}});
  return a;
}

ZapHandler::Answer ZapHandler::curve_peer(const zmq::message_t& key_frame) {
  Answer a;
  if (!dir_) {
    a.text = "this coordinator allows no CURVE keys";
    return a;
  }
  // Read again at every handshake (they are rare, the files small): a
  // key added, replaced or removed counts from the next one.
  Keys keys = read_directory(false);
  const std::string key = z85(key_frame.data());
  auto it = keys.find(key);
  if (it != keys.end()) {
    const AllowedKey& k = it->second;
    a.status = "200";
    a.text = "OK";
    a.user_id = k.name;
    a.metadata = zap_metadata(
        {{"X-Roles", std::string(k.client ? "client" : "") + (k.client && k.agent ? "," : "") +
                         (k.agent ? "agent" : "")}});
  } else {
    a.text = "key " + key + " is not in curve_allowed_keys";
  }
  std::lock_guard<std::mutex> lock(mu_);
  keys_ = std::move(keys);
  return a;
}

void ZapHandler::log_refusal(const std::string& address, const std::string& why) {
  ++refusals_unlogged_;
  const auto t = std::chrono::steady_clock::now();
  if (t - refusal_logged_ < kRefusalLogInterval) return;
  spdlog::warn("refused {} connection(s); latest from {}: {}", refusals_unlogged_,
               printable(address), why);
  refusal_logged_ = t;
  refusals_unlogged_ = 0;
}

}  // namespace leasehold
