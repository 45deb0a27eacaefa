#include "coordinator/curve_auth.h"

#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <filesystem>
#include <stdexcept>
#include <vector>

#include "shared/curve_keys.h"
#include "shared/printable.h"

namespace leasehold {
namespace {

// Where libzmq asks (RFC 27).
constexpr const char* kZapEndpoint = "inproc://zeromq.zap.01";
// Refusals are logged at most this often, with their count.
constexpr auto kRefusalLogInterval = std::chrono::seconds(10);

int64_t mtime_ns(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return -1;
  return int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

std::string z85(const void* raw32) {
  char text[41];
  zmq_z85_encode(text, static_cast<const uint8_t*>(raw32), 32);
  return text;
}

}  // namespace

CurveAuthenticator::CurveAuthenticator(zmq::context_t& ctx, std::string allowed_dir)
    : dir_(std::move(allowed_dir)), socket_(ctx, zmq::socket_type::rep) {
  if (!std::filesystem::is_directory(dir_)) {
    throw std::runtime_error("curve_allowed_keys " + dir_ + " is not a directory");
  }
  dir_mtime_ns_ = mtime_ns(dir_);
  keys_ = read_directory(true);
  if (keys_.empty()) {
    spdlog::warn("curve_allowed_keys {} holds no *.pub file: no client or agent can connect "
                 "over the network until one is added",
                 dir_);
  }
  socket_.set(zmq::sockopt::linger, 0);
  try {
    socket_.bind(kZapEndpoint);
  } catch (const zmq::error_t& e) {
    throw std::runtime_error(std::string("cannot bind the ZAP handler: ") + e.what());
  }
  thread_ = std::thread([this] { serve(); });
}

CurveAuthenticator::~CurveAuthenticator() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

size_t CurveAuthenticator::allowed_keys() const {
  std::lock_guard<std::mutex> lock(mu_);
  return keys_.size();
}

CurveAuthenticator::Keys CurveAuthenticator::read_directory(bool strict) const {
  Keys keys;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) {
    if (entry.path().extension() != ".pub") continue;
    const std::string name = entry.path().stem().string();
    try {
      keys.emplace(read_curve_public_key(entry.path().string()), name);
    } catch (const std::exception& e) {
      if (strict) throw std::runtime_error(std::string("curve_allowed_keys: ") + e.what());
      spdlog::warn("curve_allowed_keys: skipping {}", e.what());
    }
  }
  if (ec) {
    const std::string why = "cannot read curve_allowed_keys " + dir_ + ": " + ec.message();
    if (strict) throw std::runtime_error(why);
    spdlog::warn("{}", why);
  }
  return keys;
}

void CurveAuthenticator::reload_if_changed() {
  const int64_t m = mtime_ns(dir_);
  if (m == dir_mtime_ns_) return;
  dir_mtime_ns_ = m;
  Keys keys = read_directory(false);
  spdlog::info("curve_allowed_keys {} changed: {} keys allowed", dir_, keys.size());
  std::lock_guard<std::mutex> lock(mu_);
  keys_ = std::move(keys);
}

void CurveAuthenticator::serve() {
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
      answer(request);
    } catch (const zmq::error_t& e) {
      if (e.num() == ETERM) return;
      if (e.num() != EINTR) spdlog::error("ZAP handler: {}", e.what());
    }
  }
}

void CurveAuthenticator::answer(std::vector<zmq::message_t>& request) {
  // [version, request id, domain, address, identity, mechanism, credentials...]
  std::string status = "400", text = "malformed ZAP request", user;
  std::string address = request.size() > 3 ? request[3].to_string() : "";
  if (request.size() >= 6 && request[0].to_string() == "1.0") {
    const std::string mechanism = request[5].to_string();
    if (mechanism == "CURVE" && request.size() >= 7 && request[6].size() == 32) {
      reload_if_changed();
      const std::string key = z85(request[6].data());
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = keys_.find(key); it != keys_.end()) {
        status = "200";
        text = "OK";
        user = it->second;
      } else {
        text = "key " + key + " is not in curve_allowed_keys";
      }
    } else {
      // Only CURVE servers ask: anything else is not ours to let in.
      text = "mechanism " + mechanism + " is not accepted here";
    }
  }
  if (status != "200") {
    ++refused_;
    ++refusals_unlogged_;
    const auto t = std::chrono::steady_clock::now();
    if (t - refusal_logged_ >= kRefusalLogInterval) {
      spdlog::warn("refused {} network connection(s); latest from {}: {}", refusals_unlogged_,
                   printable(address), text);
      refusal_logged_ = t;
      refusals_unlogged_ = 0;
    }
  }
  const std::string version = "1.0";
  socket_.send(zmq::buffer(version), zmq::send_flags::sndmore);
  if (request.size() > 1) {
    socket_.send(request[1], zmq::send_flags::sndmore);
  } else {
    socket_.send(zmq::message_t(), zmq::send_flags::sndmore);
  }
  socket_.send(zmq::buffer(status), zmq::send_flags::sndmore);
  socket_.send(zmq::buffer(text), zmq::send_flags::sndmore);
  socket_.send(zmq::buffer(user), zmq::send_flags::sndmore);
  socket_.send(zmq::message_t(), zmq::send_flags::none);  // no metadata
}

}  // namespace leasehold
