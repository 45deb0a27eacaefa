#include "tests/support/synthetic_data.h"

#include <cstdint>
#include <fstream>
#include <vector>

namespace leasehold::testing {
namespace {

std::string idx(std::vector<uint32_t> dims, const std::vector<uint8_t>& body) {
  std::string s = {0, 0, 8, static_cast<char>(dims.size())};
  for (uint32_t d : dims) {
    for (int shift : {24, 16, 8, 0}) s += static_cast<char>((d >> shift) & 0xff);
  }
  s.append(body.begin(), body.end());
  return s;
}

}  // namespace

void write_synthetic_idx(const std::string& dir, const std::string& prefix, int n, unsigned seed) {
  std::vector<uint8_t> px(n * 64), labels(n);
  uint32_t state = seed;
  auto rnd = [&] { return (state = state * 1664525u + 1013904223u) >> 24; };
  for (int i = 0; i < n; ++i) {
    int c = i % 3;
    labels[i] = static_cast<uint8_t>(c);
    for (int y = 0; y < 8; ++y) {
      for (int x = 0; x < 8; ++x) {
        bool on = c == 0 ? x < 4 : c == 1 ? x >= 4 : y < 4;
        px[i * 64 + y * 8 + x] = static_cast<uint8_t>((on ? 150 : 20) + rnd() % 100);
      }
    }
  }
  std::ofstream(dir + "/" + prefix + "-images", std::ios::binary) << idx({uint32_t(n), 8, 8}, px);
  std::ofstream(dir + "/" + prefix + "-labels", std::ios::binary) << idx({uint32_t(n)}, labels);
}

std::string synthetic_job_json(const std::string& dir, const std::string& name,
                               const std::string& extra, int hidden) {
  std::string h = std::to_string(hidden);
  return R"({"name": ")" + name + R"(", "model": [{"type": "Flatten"},
      {"type": "Linear", "in": 64, "out": )" + h + R"(}, {"type": "ReLU"},
      {"type": "Linear", "in": )" + h + R"(, "out": 3}],
    "dataset": {"train_images": ")" + dir + R"(/train-images", "train_labels": ")" + dir +
         R"(/train-labels", "test_images": ")" + dir + R"(/test-images", "test_labels": ")" + dir +
         R"(/test-labels", "mean": 0.3, "std": 0.3},
    "optimizer": {"type": "Adam", "lr": 0.01}, "seed": 3)" + extra + "}";
}

}  // namespace leasehold::testing
