// One checking macro for CUDA runtime calls: throws CudaError naming the call,
// the file and line, and the error's name and description.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace leasehold {

class CudaError : public std::runtime_error {
 public:
  CudaError(cudaError_t err, const char* call, const char* file, int line)
      : std::runtime_error(std::string(call) + " failed at " + file + ":" + std::to_string(line) +
                           ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")"),
        error_(err) {}
  cudaError_t error() const noexcept { return error_; }

 private:
  cudaError_t error_;
};

}  // namespace leasehold

#define LEASEHOLD_CUDA_CHECK(call)                                              \
  do {                                                                          \
    cudaError_t leasehold_err_ = (call);                                        \
    if (leasehold_err_ != cudaSuccess) {                                        \
      throw ::leasehold::CudaError(leasehold_err_, #call, __FILE__, __LINE__); \
    }                                                                           \
  } while (0)
