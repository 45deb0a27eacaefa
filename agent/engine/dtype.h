// Element types and devices of tensors. Kernels are templates instantiated
// per type. bfloat16 is a storage type: tensors of it are converted,
// copied, moved and checkpointed, and they are the inputs of mixed-
// precision GEMMs (autocast.h); other operators take float32 or float64.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/bfloat16.h"

namespace leasehold::engine {

enum class DType : uint8_t { Float32, Float64, Int64, BFloat16 };

using kernels::bfloat16;

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::Float32: return 4;
    case DType::BFloat16: return 2;
    case DType::Float64:
    case DType::Int64: return 8;
  }
  return 8;
}
const char* dtype_name(DType t);
constexpr bool is_floating(DType t) { return t != DType::Int64; }

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() { return DType::Float32; }
template <>
constexpr DType dtype_of<double>() { return DType::Float64; }
template <>
constexpr DType dtype_of<int64_t>() { return DType::Int64; }
template <>
constexpr DType dtype_of<bfloat16>() { return DType::BFloat16; }

enum class DeviceType : uint8_t { CPU, CUDA };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  static Device cpu() { return {DeviceType::CPU, 0}; }
  static Device cuda(int index = 0) { return {DeviceType::CUDA, index}; }
  bool is_cuda() const { return type == DeviceType::CUDA; }
  bool operator==(const Device&) const = default;
  std::string str() const;  // "cpu", "cuda:0"
};

}  // namespace leasehold::engine
