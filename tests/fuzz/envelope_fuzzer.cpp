// libFuzzer target: the envelope decoder (shared/protocol.h), the first code
// every received message meets. Whatever the bytes, decode() returns an
// Envelope or a DecodeError; an accepted envelope's fields can all be read.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "shared/protocol.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Aligned, as the broker copies every message (AlignedBytes).
  std::vector<uint64_t> words((size + 7) / 8);
  if (size) std::memcpy(words.data(), data, size);
  auto decoded = leasehold::decode({reinterpret_cast<const uint8_t*>(words.data()), size});
  if (auto* env = std::get_if<const leasehold::proto::Envelope*>(&decoded)) {
    // Verified: reading any field must be safe. Unpacking reads them all.
    std::unique_ptr<leasehold::proto::EnvelopeT> all((*env)->UnPack());
    volatile size_t sender = all->header ? all->header->sender.size() : 0;
    (void)sender;
  }
  return 0;
}
