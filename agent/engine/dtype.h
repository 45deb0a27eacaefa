// Element types and devices of tensors. Adding a 16-bit float type means a
// new DType, its size and name, and a case in the dispatch helpers of
// dispatch.h; kernels are templates instantiated per type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace leasehold::engine {

enum class DType : uint8_t { Float32, Float64, Int64 };

constexpr size_t dtype_size(DType t) {
  return t == DType::Float32 ? 4 : 8;
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
