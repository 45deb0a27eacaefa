#include <cstring>

#include "kernels/gather.h"

namespace leasehold::kernels::cpu {

void take_rows(Stream, void* out, const void* src, const int64_t* index, int64_t count,
               int64_t row_bytes) {
  auto* o = static_cast<char*>(out);
  const auto* s = static_cast<const char*>(src);
  for (int64_t i = 0; i < count; ++i) {
    std::memcpy(o + i * row_bytes, s + index[i] * row_bytes, static_cast<size_t>(row_bytes));
  }
}

void take_byte_windows(Stream, int64_t* out, const uint8_t* bytes, const int64_t* index,
                       int64_t count, int64_t width, int64_t stride, int64_t offset) {
  for (int64_t i = 0; i < count; ++i) {
    const uint8_t* from = bytes + index[i] * stride + offset;
    for (int64_t t = 0; t < width; ++t) out[i * width + t] = from[t];
  }
}

}  // namespace leasehold::kernels::cpu
