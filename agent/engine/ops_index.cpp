// Indexing operators: take_rows (row gathers for the data loader).
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

}  // namespace leasehold::engine
