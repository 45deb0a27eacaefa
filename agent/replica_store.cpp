#include "agent/replica_store.h"

#include <spdlog/spdlog.h>

#include <map>
#include <optional>

#include "agent/job_runner.h"

namespace leasehold {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPollSlice = std::chrono::milliseconds(50);
// A key not set yet is asked for again after this.
constexpr auto kRetry = std::chrono::milliseconds(5);
// Keys and values of the rendezvous are small (addresses, an id, digests).
constexpr size_t kMaxKeyBytes = 256;
constexpr size_t kMaxValueBytes = 64 << 10;
constexpr size_t kMaxKeys = 4096;

std::string endpoint_of(const Replica& r) {
  return "tcp://" + r.master_addr + ":" + std::to_string(r.master_port);
}

std::string text(const zmq::message_t& m) { return std::string(m.data<char>(), m.size()); }

}  // namespace

ReplicaStore::ReplicaStore(const Replica& replica, std::string token,
                           std::function<bool()> stopping, std::chrono::milliseconds timeout)
    : replica_(replica),
      token_(std::move(token)),
      stopping_(std::move(stopping)),
      timeout_(timeout),
      ctx_(1),
      client_(ctx_, zmq::socket_type::dealer) {
  if (replica_.master_addr.empty() || replica_.master_port == 0) {
    throw std::invalid_argument("replica " + std::to_string(replica_.rank) +
                                ": the assignment names no rendezvous address");
  }
  client_.set(zmq::sockopt::linger, 0);
  client_.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(kMaxValueBytes + 1024));
  if (replica_.rank == 0) {
    server_ = zmq::socket_t(ctx_, zmq::socket_type::router);
    server_.set(zmq::sockopt::linger, 0);
    // Anyone on this host can reach the port: a frame past this is dropped
    // with its sender's connection, before it is buffered.
    server_.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(kMaxValueBytes + 1024));
    try {
      server_.bind(endpoint_of(replica_));
    } catch (const zmq::error_t& e) {
      throw ReplicaLost("rank 0 cannot serve the replicas' rendezvous on " +
                        endpoint_of(replica_) + ": " + e.what());
    }
    server_thread_ = std::thread([this] { serve(); });
  }
  client_.connect(endpoint_of(replica_));
}

ReplicaStore::~ReplicaStore() {
  closing_.store(true);
  if (server_thread_.joinable()) server_thread_.join();
}

void ReplicaStore::serve() {
  std::map<std::string, std::string> keys;
  std::optional<Clock::time_point> last_refusal_logged;
  zmq::pollitem_t item{server_.handle(), 0, ZMQ_POLLIN, 0};
  while (!closing_.load()) {
    try {
      if (zmq::poll(&item, 1, kPollSlice) <= 0) continue;
      // identity, sequence, token, op, key, value; frames past those are
      // read and dropped, and so is a request of another shape.
      std::vector<zmq::message_t> parts;
      size_t frames = 0;
      zmq::message_t part;
      do {
        if (!server_.recv(part, zmq::recv_flags::dontwait)) break;
        if (++frames <= 6) parts.push_back(std::move(part));
        part = zmq::message_t();
      } while (server_.get(zmq::sockopt::rcvmore));
      if (frames != 6 || parts.size() != 6) continue;
      std::string status = "ok", value;
      const std::string op = text(parts[3]), key = text(parts[4]);
      if (text(parts[2]) != token_) {
        status = "denied";
        if (!last_refusal_logged || Clock::now() - *last_refusal_logged > std::chrono::seconds(10)) {
          spdlog::warn("replica rendezvous: refused a request with a wrong token (logged at most "
                       "every 10 s)");
          last_refusal_logged = Clock::now();
        }
      } else if (key.size() > kMaxKeyBytes || parts[5].size() > kMaxValueBytes) {
        status = "too large";
      } else if (op == "set") {
        if (keys.size() >= kMaxKeys && !keys.count(key)) {
          status = "full";
        } else {
          keys[key] = text(parts[5]);
        }
      } else if (op == "get") {
        auto it = keys.find(key);
        if (it == keys.end()) {
          status = "none";
        } else {
          value = it->second;
        }
      } else {
        status = "bad op";
      }
      server_.send(parts[0], zmq::send_flags::sndmore);
      server_.send(parts[1], zmq::send_flags::sndmore);
      server_.send(zmq::buffer(status), zmq::send_flags::sndmore);
      server_.send(zmq::buffer(value), zmq::send_flags::none);
    } catch (const zmq::error_t& e) {
      spdlog::error("replica rendezvous server: {}", e.what());
    }
  }
}

std::pair<std::string, std::string> ReplicaStore::ask(const std::string& op,
                                                      const std::string& key,
                                                      const std::string& value) {
  static std::atomic<uint64_t> next{1};
  const std::string seq = std::to_string(next.fetch_add(1));
  client_.send(zmq::buffer(seq), zmq::send_flags::sndmore);
  client_.send(zmq::buffer(token_), zmq::send_flags::sndmore);
  client_.send(zmq::buffer(op), zmq::send_flags::sndmore);
  client_.send(zmq::buffer(key), zmq::send_flags::sndmore);
  client_.send(zmq::buffer(value), zmq::send_flags::none);
  const auto deadline = Clock::now() + timeout_;
  zmq::pollitem_t item{client_.handle(), 0, ZMQ_POLLIN, 0};
  while (true) {
    if (stopping_ && stopping_()) throw JobCancelled();
    if (Clock::now() >= deadline) {
      throw ReplicaLost("replica " + std::to_string(replica_.rank) +
                        ": the replicas' rendezvous at " + endpoint_of(replica_) +
                        " did not answer within " + std::to_string(timeout_.count() / 1000) +
                        " s (rank 0 gone?)");
    }
    if (zmq::poll(&item, 1, kPollSlice) <= 0) continue;
    std::vector<zmq::message_t> parts;
    zmq::message_t part;
    do {
      if (!client_.recv(part, zmq::recv_flags::none)) break;
      parts.push_back(std::move(part));
      part = zmq::message_t();
    } while (client_.get(zmq::sockopt::rcvmore));
    if (parts.size() != 3 || text(parts[0]) != seq) continue;  // a stale answer
    std::string status = text(parts[1]);
    if (status != "ok" && status != "none") {
      throw ReplicaLost("replica " + std::to_string(replica_.rank) + ": the rendezvous refused " +
                        op + " '" + key + "': " + status);
    }
    return {std::move(status), text(parts[2])};
  }
}

void ReplicaStore::set(const std::string& key, const std::vector<char>& data) {
  ask("set", key, std::string(data.begin(), data.end()));
}

std::vector<char> ReplicaStore::get(const std::string& key) { return get(key, timeout_); }

std::vector<char> ReplicaStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (true) {
    auto [status, value] = ask("get", key);
    if (status == "ok") return std::vector<char>(value.begin(), value.end());
    if (Clock::now() >= deadline) {
      throw ReplicaLost("replica " + std::to_string(replica_.rank) + ": '" + key +
                        "' was not set by another replica within " +
                        std::to_string(timeout.count() / 1000) + " s");
    }
    if (stopping_ && stopping_()) throw JobCancelled();
    std::this_thread::sleep_for(kRetry);
  }
}

void ReplicaStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void ReplicaStore::wait(const std::vector<std::string>& keys,
                        const std::chrono::milliseconds& timeout) {
  for (const auto& key : keys) get(key, timeout);
}

std::vector<std::string> ReplicaStore::all_gather(const std::string& name,
                                                  const std::string& value,
                                                  std::chrono::milliseconds timeout) {
  ask("set", name + "/" + std::to_string(replica_.rank), value);
  std::vector<std::string> all;
  for (int r = 0; r < replica_.world_size; ++r) {
    auto v = get(name + "/" + std::to_string(r), timeout.count() > 0 ? timeout : timeout_);
    all.emplace_back(v.begin(), v.end());
  }
  return all;
}

void ReplicaStore::finish() {
  if (replica_.rank != 0) {
    ask("set", "done/" + std::to_string(replica_.rank), "1");
    return;
  }
  for (int r = 1; r < replica_.world_size; ++r) get("done/" + std::to_string(r));
}

}  // namespace leasehold
