// Test support: loopback ports and waiting on HTTP endpoints.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>

namespace leasehold::testing {

// A free loopback TCP port (bound, read, released: another process could
// take it in between, which tests accept).
int free_port();

// GETs http://127.0.0.1:PORT/PATH; nullopt when there is no answer or the
// status is not 200.
std::optional<std::string> http_get(int port, const std::string& path,
                                    std::chrono::milliseconds timeout = std::chrono::seconds(5));

// Calls `pred` every 100 ms until it holds, up to `timeout`; returns
// whether it did.
bool eventually(const std::function<bool()>& pred, std::chrono::milliseconds timeout);

}  // namespace leasehold::testing
