// Indexing operators: take_rows and take_byte_windows (the data loader's
// gathers).
#include <stdexcept>
#include <string>

#include "agent/engine/dispatch.h"
#include "agent/engine/kernel_table.h"
#include "agent/engine/ops.h"
#include "kernels/gather.h"

namespace leasehold::engine {
namespace {

const KernelTable<decltype(kernels::cpu::take_rows)> kTakeRows{
    "take_rows", {&kernels::cpu::take_rows, LEASEHOLD_CUDA_KERNEL(kernels::cuda::take_rows)}};
const KernelTable<decltype(kernels::cpu::take_byte_windows)> kTakeByteWindows{
    "take_byte_windows",
    {&kernels::cpu::take_byte_windows, LEASEHOLD_CUDA_KERNEL(kernels::cuda::take_byte_windows)}};

}  // namespace

namespace {

// The rows' shape, checking the operands for `op` (and host indices: a
// device's are the caller's, as reading them back would wait).
Shape checked_rows(const Tensor& x, const Tensor& index, const char* op) {
  detail::check_defined(x, op, "input");
  detail::check_defined(index, op, "index");
  const std::string name = op;
  if (x.requires_grad()) {
    throw std::invalid_argument(name + ": not differentiable; the input requires grad");
  }
  if (x.dim() < 1) throw std::invalid_argument(name + ": input must have at least 1 dimension");
  if (index.dtype() != DType::Int64 || index.dim() != 1) {
    throw std::invalid_argument(name + ": index must be int64 [k], got " +
                                dtype_name(index.dtype()) + " " + index.shape_str());
  }
  if (index.device() != x.device()) {
    throw std::invalid_argument(name + ": index on " + index.device().str() + ", input on " +
                                x.device().str());
  }
  if (!x.device().is_cuda()) {
    const Tensor idx = index.contiguous();
    const int64_t* p = idx.data<int64_t>();
    for (int64_t i = 0; i < idx.size(0); ++i) {
      if (p[i] < 0 || p[i] >= x.size(0)) {
        throw std::invalid_argument(name + ": index " + std::to_string(p[i]) +
                                    " out of range for " + std::to_string(x.size(0)) + " rows");
      }
    }
  }
  Shape shape = x.sizes();
  shape[0] = index.size(0);
  return shape;
}

void gather_rows(const Tensor& out, const Tensor& x, const Tensor& index) {
  const Tensor src = x.contiguous();
  const Tensor idx = index.contiguous();
  const int64_t rows = src.size(0), count = idx.size(0);
  const int64_t row_bytes =
      (rows ? src.numel() / rows : 0) * static_cast<int64_t>(dtype_size(src.dtype()));
  if (count == 0 || row_bytes == 0) return;
  kTakeRows.run(x.device(), out.raw_data(), src.raw_data(), idx.data<int64_t>(), count,
                row_bytes);
}

}  // namespace

Tensor take_rows(const Tensor& x, const Tensor& index) {
  Tensor out = empty(checked_rows(x, index, "take_rows"), x.options());
  gather_rows(out, x, index);
  return out;
}

void take_rows_into(const Tensor& out, const Tensor& x, const Tensor& index) {
  const Shape shape = checked_rows(x, index, "take_rows_into");
  detail::check_defined(out, "take_rows_into", "output");
  if (out.sizes() != shape || out.dtype() != x.dtype() || out.device() != x.device() ||
      !out.is_contiguous()) {
    throw std::invalid_argument("take_rows_into: output " + std::string(dtype_name(out.dtype())) +
                                " " + out.shape_str() + " on " + out.device().str() +
                                (out.is_contiguous() ? "" : " (not contiguous)") + " for rows " +
                                dtype_name(x.dtype()) + " " + shape_to_string(shape) + " on " +
                                x.device().str());
  }
  if (out.requires_grad()) {
    throw std::invalid_argument("take_rows_into: the output requires grad");
  }
  gather_rows(out, x, index);
}

void take_byte_windows_into(const Tensor& out, const Tensor& bytes, int64_t count,
                            const Tensor& index, int64_t stride, int64_t offset) {
  const char* op = "take_byte_windows";
  detail::check_defined(bytes, op, "bytes");
  detail::check_defined(index, op, "index");
  detail::check_defined(out, op, "output");
  if (bytes.dtype() != DType::Int64 || bytes.dim() != 1 || !bytes.is_contiguous() ||
      count < 0 || static_cast<uint64_t>(count) > static_cast<uint64_t>(bytes.numel()) * 8) {
    throw std::invalid_argument(std::string(op) + ": bytes must be a contiguous int64 [n] of " +
                                "at least " + std::to_string(count) + " bytes, got " +
                                dtype_name(bytes.dtype()) + " " + bytes.shape_str());
  }
  if (index.dtype() != DType::Int64 || index.dim() != 1 || index.device() != bytes.device()) {
    throw std::invalid_argument(std::string(op) + ": index must be int64 [k] on " +
                                bytes.device().str() + ", got " + dtype_name(index.dtype()) + " " +
                                index.shape_str() + " on " + index.device().str());
  }
  if (out.dtype() != DType::Int64 || out.dim() != 2 || out.size(0) != index.size(0) ||
      out.device() != bytes.device() || !out.is_contiguous() || out.requires_grad()) {
    throw std::invalid_argument(std::string(op) + ": output must be a contiguous int64 [" +
                                std::to_string(index.size(0)) + ", width] on " +
                                bytes.device().str() + " that needs no grad, got " +
                                dtype_name(out.dtype()) + " " + out.shape_str());
  }
  const int64_t width = out.size(1);
  if (stride < 0 || offset < 0) {
    throw std::invalid_argument(std::string(op) + ": stride and offset must not be negative");
  }
  const Tensor idx = index.contiguous();
  if (!bytes.device().is_cuda()) {
    // (A device's indices are the caller's: reading them back would wait.)
    // Window p starts at p × stride + offset and must end by `count`
    // (divided, not multiplied: no overflow for any p).
    const int64_t last_start = offset <= count && width <= count - offset
                                   ? count - offset - width
                                   : -1;
    const int64_t* p = idx.data<int64_t>();
    for (int64_t i = 0; i < idx.size(0); ++i) {
      const bool inside =
          p[i] >= 0 && last_start >= 0 && (stride == 0 || p[i] <= last_start / stride);
      if (!inside) {
        throw std::invalid_argument(std::string(op) + ": window " + std::to_string(p[i]) +
                                    " (" + std::to_string(width) + " bytes at " +
                                    std::to_string(stride) + " × it + " + std::to_string(offset) +
                                    ") is past the " + std::to_string(count) + " bytes");
      }
    }
  }
  if (idx.size(0) == 0 || width == 0) return;
  kTakeByteWindows.run(bytes.device(), out.data<int64_t>(),
                       reinterpret_cast<const uint8_t*>(bytes.raw_data()), idx.data<int64_t>(),
                       idx.size(0), width, stride, offset);
}

Tensor take_byte_windows(const Tensor& bytes, int64_t count, const Tensor& index, int64_t width,
                         int64_t stride, int64_t offset) {
  detail::check_defined(index, "take_byte_windows", "index");
  if (width < 0) throw std::invalid_argument("take_byte_windows: width must not be negative");
  Tensor out = empty({index.dim() == 1 ? index.size(0) : 0, width},
                     {DType::Int64, bytes.defined() ? bytes.device() : index.device()});
  take_byte_windows_into(out, bytes, count, index, stride, offset);
  return out;
}

}  // namespace leasehold::engine
