// The stream a kernel runs on. Every kernel that has both a CPU and a CUDA
// version takes one signature on both backends with this as its first
// argument, so the engine lists the pair once in a KernelTable
// (agent/engine/kernel_table.h) instead of branching on the device. Each
// kernel header declares its signatures once, in a macro expanded in
// namespace cpu and (with CUDA) namespace cuda, and lists its explicit
// instantiations once, in a macro each backend's source file expands.
#pragma once

namespace leasehold::kernels {

// A cudaStream_t on CUDA (the device's compute stream); unused on the CPU.
using Stream = void*;

}  // namespace leasehold::kernels
