// The reductions that add a gradient to its sum so far as they write it
// (autograd.h: gradient_to_add_into): a bias's column sums, with GELU's
// backward or without, and layer norm's weight and bias gradients, under
// bfloat16 autocast. Each, asked to add, writes the bits of its sums made
// apart and then added to the sum so far in float32: a recomputed MLP's
// slices after the first give the gradients a separate addition would.
// (Without CUDA there is nothing to test.)
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "agent/engine/kernel_table.h"
#include "agent/engine/ops.h"
#include "kernels/reduce.h"
#include "kernels/transformer.h"
#include "shared/device.h"

#ifdef LEASEHOLD_HAVE_CUDA
namespace leasehold::engine::testing {
namespace {

namespace kc = kernels::cuda;

class CudaSumsInto : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible: test skipped";
  }
};

std::vector<float> host(const Tensor& t) { return t.to(Device::cpu()).to_vector<float>(); }

// so_far + sums, added in float32 on the host.
std::vector<float> added(const std::vector<float>& so_far, const std::vector<float>& sums) {
  std::vector<float> out(so_far.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = so_far[i] + sums[i];
  return out;
}

struct Shape2 {
  int64_t rows, columns;
};
// Rows past the kernels' parts and under them; columns of whole 16-byte
// words (8 bfloat16, the vector path) and not; the GPT's slice (8,192 ×
// 1,536) and its MLP's output (8,192 × 384).
const Shape2 kShapes[] = {{1, 5}, {7, 384}, {1000, 33}, {8192, 384}, {8192 + 3, 1536}};

TEST_F(CudaSumsInto, ColumnSumsAddedToASumSoFarAreThoseSumsAddedAfter) {
  const Device cuda = Device::cuda();
  const kernels::Stream s = stream_for(cuda);
  manual_seed(51);
  for (const auto& [rows, columns] : kShapes) {
    SCOPED_TRACE(std::to_string(rows) + " × " + std::to_string(columns));
    const Tensor g = randn({rows, columns}).to(cuda).to(DType::BFloat16);
    const Tensor x = randn({rows, columns}).to(cuda).to(DType::BFloat16);
    const Tensor so_far = randn({columns}).to(cuda);
    const Tensor work =
        empty({kc::column_sums_bf16_workspace(rows, columns)}, {DType::Float32, cuda});

    const Tensor sums = empty({columns}, {DType::Float32, cuda});
    kc::column_sums_bf16(s, sums.data<float>(), work.data<float>(), g.data<bfloat16>(), rows,
                         columns);
    const Tensor into = so_far.clone();
    kc::column_sums_bf16(s, into.data<float>(), work.data<float>(), g.data<bfloat16>(), rows,
                         columns, /*add=*/true);
    EXPECT_EQ(host(into), added(host(so_far), host(sums)));

    // With GELU's backward: the same sums added, the same gradient written.
    const Tensor dx = empty({rows, columns}, {DType::BFloat16, cuda});
    const Tensor dx_added = empty({rows, columns}, {DType::BFloat16, cuda});
    kc::gelu_backward_column_sums_bf16(s, dx.data<bfloat16>(), sums.data<float>(),
                                       work.data<float>(), g.data<bfloat16>(),
                                       x.data<bfloat16>(), rows, columns);
    const Tensor gelu_into = so_far.clone();
    kc::gelu_backward_column_sums_bf16(s, dx_added.data<bfloat16>(), gelu_into.data<float>(),
                                       work.data<float>(), g.data<bfloat16>(),
                                       x.data<bfloat16>(), rows, columns, /*add=*/true);
    EXPECT_EQ(host(gelu_into), added(host(so_far), host(sums)));
    EXPECT_EQ(host(dx_added.to(DType::Float32)), host(dx.to(DType::Float32)));
  }
}

TEST_F(CudaSumsInto, LayerNormsWeightAndBiasGradientsAddedToSumsSoFarAreThoseAddedAfter) {
  const Device cuda = Device::cuda();
  const kernels::Stream s = stream_for(cuda);
  manual_seed(52);
  for (const auto& [rows, columns] : kShapes) {
    SCOPED_TRACE(std::to_string(rows) + " × " + std::to_string(columns));
    const TensorOptions f32{DType::Float32, cuda};
    const Tensor x = randn({rows, columns}).to(cuda);
    const Tensor w = randn({columns}).to(cuda), b = randn({columns}).to(cuda);
    const Tensor y = empty({rows, columns}, {DType::BFloat16, cuda});
    const Tensor mean = empty({rows}, f32), rstd = empty({rows}, f32);
    kc::layer_norm_forward_bf16(s, y.data<bfloat16>(), mean.data<float>(), rstd.data<float>(),
                                x.data<float>(), w.data<float>(), b.data<float>(), rows, columns,
                                1e-5);
    const Tensor dy = randn({rows, columns}).to(cuda).to(DType::BFloat16);
    const Tensor work = empty({kernels::layer_norm_backward_workspace(rows, columns)}, f32);
    auto backward = [&](const Tensor& dw, const Tensor& db, bool add_dw, bool add_db) {
      const Tensor dx = empty({rows, columns}, f32);
      kc::layer_norm_backward_bf16(s, dx.data<float>(), nullptr, dw.data<float>(),
                                   db.data<float>(), work.data<float>(), dy.data<bfloat16>(),
                                   x.data<float>(), w.data<float>(), mean.data<float>(),
                                   rstd.data<float>(), rows, columns, add_dw, add_db);
      return host(dx);
    };
    const Tensor dw = empty({columns}, f32), db = empty({columns}, f32);
    const std::vector<float> dx = backward(dw, db, false, false);
    const Tensor dw_so_far = randn({columns}).to(cuda), db_so_far = randn({columns}).to(cuda);
    for (const bool add_dw : {false, true}) {
      for (const bool add_db : {false, true}) {
        SCOPED_TRACE(std::string("add dw ") + (add_dw ? "yes" : "no") + ", add db " +
                     (add_db ? "yes" : "no"));
        const Tensor dw_into = dw_so_far.clone(), db_into = db_so_far.clone();
        EXPECT_EQ(backward(dw_into, db_into, add_dw, add_db), dx);
        EXPECT_EQ(host(dw_into), add_dw ? added(host(dw_so_far), host(dw)) : host(dw));
        EXPECT_EQ(host(db_into), add_db ? added(host(db_so_far), host(db)) : host(db));
      }
    }
  }
}

}  // namespace
}  // namespace leasehold::engine::testing
#endif  // LEASEHOLD_HAVE_CUDA
