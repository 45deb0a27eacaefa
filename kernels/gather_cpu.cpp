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

}  // namespace leasehold::kernels::cpu
