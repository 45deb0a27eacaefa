#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>

#include "agent/engine/checkpoint.h"
#include "agent/engine/data.h"
#include "agent/engine/ops.h"

namespace leasehold::engine {
namespace {

namespace fs = std::filesystem;

class TempDir : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/leasehold-engine-XXXXXX";
    ASSERT_TRUE(mkdtemp(tmpl));
    dir = tmpl;
  }
  void TearDown() override { fs::remove_all(dir); }
  std::string path(const std::string& name) const { return dir + "/" + name; }
  std::string dir;
};

std::string idx_bytes(std::vector<uint32_t> dims, const std::vector<uint8_t>& body) {
  std::string s = {0, 0, 8, static_cast<char>(dims.size())};
  for (uint32_t d : dims) {
    for (int shift : {24, 16, 8, 0}) s += static_cast<char>((d >> shift) & 0xff);
  }
  s.append(body.begin(), body.end());
  return s;
}

void write_file(const std::string& path, const std::string& bytes, bool gzip) {
  if (gzip) {
    gzFile f = gzopen(path.c_str(), "wb");
    gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
    gzclose(f);
  } else {
    std::ofstream(path, std::ios::binary) << bytes;
  }
}

// 5 images of 2x3 and their labels.
void write_dataset(const std::string& img, const std::string& lab, bool gzip) {
  std::vector<uint8_t> pixels(5 * 6);
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<uint8_t>(i * 8);
  write_file(img, idx_bytes({5, 2, 3}, pixels), gzip);
  write_file(lab, idx_bytes({5}, {3, 1, 4, 1, 5}), gzip);
}

TEST_F(TempDir, IdxPlainAndGzipLoadAndNormalise) {
  for (bool gz : {false, true}) {
    std::string img = path(gz ? "i.gz" : "i"), lab = path(gz ? "l.gz" : "l");
    write_dataset(img, lab, gz);
    auto d = data::load_idx_dataset(img, lab, 0.5, 0.25);
    EXPECT_EQ(d.images.sizes(), (Shape{5, 1, 2, 3}));
    EXPECT_EQ(d.labels.to_vector<int64_t>(), (std::vector<int64_t>{3, 1, 4, 1, 5}));
    auto px = d.images.to_vector<float>();
    EXPECT_FLOAT_EQ(px[0], (0 / 255.0 - 0.5) / 0.25);
    EXPECT_FLOAT_EQ(px[29], (232 / 255.0 - 0.5) / 0.25);
  }
}

TEST_F(TempDir, IdxErrorsNameTheFileAndTheProblem) {
  auto expect_error = [](const std::string& p, const std::string& fragment) {
    try {
      data::read_idx(p);
      ADD_FAILURE() << "read_idx(" << p << ") succeeded";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
  };
  expect_error(path("missing"), "cannot open");
  write_file(path("magic"), "PK\x03\x04garbage", false);
  expect_error(path("magic"), "not an IDX file");
  write_file(path("short"), idx_bytes({10, 28, 28}, std::vector<uint8_t>(100)), true);
  expect_error(path("short"), "truncated");
  std::string floats = idx_bytes({1}, {0, 0, 0, 0});
  floats[2] = 0x0D;
  write_file(path("float"), floats, false);
  expect_error(path("float"), "element type");
  write_dataset(path("i"), path("l"), false);
  write_file(path("l4"), idx_bytes({4}, {1, 2, 3, 4}), false);
  EXPECT_THROW(data::load_idx_dataset(path("i"), path("l4"), 0, 1), std::runtime_error);
}

TEST_F(TempDir, BatchesCoverEveryExampleOnceAndReshuffleReproducibly) {
  write_dataset(path("i"), path("l"), false);
  auto d = data::load_idx_dataset(path("i"), path("l"), 0, 1);
  data::BatchIterator it(d, 2, true, 7);
  EXPECT_EQ(it.batches_per_epoch(), 3);
  auto epoch_labels = [&](int64_t e) {
    it.start_epoch(e);
    std::vector<int64_t> seen;
    Tensor x, y;
    while (it.next(x, y, Device::cpu())) {
      auto v = y.to_vector<int64_t>();
      seen.insert(seen.end(), v.begin(), v.end());
      EXPECT_EQ(x.size(0), y.size(0));
    }
    return seen;
  };
  auto e0 = epoch_labels(0), e0_again = epoch_labels(0), e1 = epoch_labels(1);
  EXPECT_EQ(e0, e0_again);
  auto sorted = e0;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, (std::vector<int64_t>{1, 1, 3, 4, 5}));
  auto s1 = e1;
  std::sort(s1.begin(), s1.end());
  EXPECT_EQ(s1, sorted);
}

TEST(TakeRows, GathersWholeRowsAndRefusesBadIndices) {
  Tensor x = from_vector<float>({0, 1, 2, 10, 11, 12, 20, 21, 22}, {3, 3});
  Tensor rows = take_rows(x, from_vector<int64_t>({2, 0, 2}, {3}));
  EXPECT_EQ(rows.sizes(), (Shape{3, 3}));
  EXPECT_EQ(rows.to_vector<float>(), (std::vector<float>{20, 21, 22, 0, 1, 2, 20, 21, 22}));
  EXPECT_EQ(take_rows(x, from_vector<int64_t>({}, {0})).sizes(), (Shape{0, 3}));
  EXPECT_THROW(take_rows(x, from_vector<int64_t>({3}, {1})), std::invalid_argument);
  EXPECT_THROW(take_rows(x, from_vector<int64_t>({-1}, {1})), std::invalid_argument);
  EXPECT_THROW(take_rows(x, from_vector<float>({0}, {1})), std::invalid_argument);
  Tensor w = x.clone().set_requires_grad(true);
  EXPECT_THROW(take_rows(w, from_vector<int64_t>({0}, {1})), std::invalid_argument);
}

TEST(TakeRows, IntoATensorOfTheRowsShapeOnly) {
  Tensor x = from_vector<float>({0, 1, 2, 10, 11, 12, 20, 21, 22}, {3, 3});
  const Tensor index = from_vector<int64_t>({2, 0}, {2});
  Tensor out = zeros({2, 3});
  const void* where = out.raw_data();
  take_rows_into(out, x, index);
  EXPECT_EQ(out.raw_data(), where);
  EXPECT_EQ(out.to_vector<float>(), (std::vector<float>{20, 21, 22, 0, 1, 2}));
  // The wrong shape, dtype or layout, and a bad index, leave it as it was.
  for (const Tensor& bad : {zeros({3, 3}), zeros({2, 2}), zeros({2, 3}, {DType::Float64}),
                            zeros({3, 2}).transpose(0, 1)}) {
    EXPECT_THROW(take_rows_into(bad, x, index), std::invalid_argument) << bad.shape_str();
  }
  EXPECT_THROW(take_rows_into(out, x, from_vector<int64_t>({0, 3}, {2})), std::invalid_argument);
  EXPECT_THROW(take_rows_into(Tensor(), x, index), std::invalid_argument);
  EXPECT_EQ(out.to_vector<float>(), (std::vector<float>{20, 21, 22, 0, 1, 2}));
}

// Batches gathered into the caller's tensors where they fit (a CUDA
// graph's inputs), into new ones where not (the last, smaller batch).
TEST(TakeRows, BatchesGoIntoTensorsOfTheirShape) {
  std::vector<float> pixels(20 * 4);
  std::vector<int64_t> labels(20);
  for (int i = 0; i < 20; ++i) {
    std::fill_n(pixels.begin() + 4 * i, 4, float(i));
    labels[i] = i;
  }
  data::Dataset d{from_vector(pixels, {20, 1, 2, 2}), from_vector(labels, {20})};
  data::BatchIterator it(d, 8, true, 3);
  Tensor x = zeros({8, 1, 2, 2}), y = zeros({8}, {DType::Int64});
  const void* xs = x.raw_data();
  const void* ys = y.raw_data();
  int seen = 0;
  for (int batch = 0; it.next(x, y, Device::cpu(), /*into=*/true); ++batch) {
    EXPECT_EQ(x.raw_data() == xs, batch < 2) << "batch " << batch;
    EXPECT_EQ(y.raw_data() == ys, batch < 2) << "batch " << batch;
    auto xv = x.to_vector<float>();
    auto yv = y.to_vector<int64_t>();
    for (size_t i = 0; i < yv.size(); ++i) EXPECT_EQ(xv[i * 4], float(yv[i]));
    seen += static_cast<int>(yv.size());
    if (batch == 2) {
      EXPECT_EQ(yv.size(), 4u);
    }
  }
  EXPECT_EQ(seen, 20);
  // Without `into`, or into tensors that require grad, never.
  it.start_epoch(1);
  Tensor kept = zeros({8, 1, 2, 2}), kept_y = zeros({8}, {DType::Int64});
  x = kept;
  y = kept_y;
  ASSERT_TRUE(it.next(x, y, Device::cpu()));
  EXPECT_NE(x.raw_data(), kept.raw_data());
  EXPECT_EQ(kept.to_vector<float>(), std::vector<float>(32, 0.0f));
  x = zeros({8, 1, 2, 2}).set_requires_grad(true);
  y = kept_y;
  const void* grad_x = x.raw_data();
  ASSERT_TRUE(it.next(x, y, Device::cpu(), /*into=*/true));
  EXPECT_NE(x.raw_data(), grad_x);
  EXPECT_FALSE(x.requires_grad());
}

// A batch's images and labels stay paired through the gather.
TEST(TakeRows, BatchesKeepImagesAndLabelsTogether) {
  std::vector<float> pixels;
  for (int i = 0; i < 50; ++i) pixels.insert(pixels.end(), 4, float(i));
  std::vector<int64_t> labels(50);
  for (int i = 0; i < 50; ++i) labels[i] = i;
  data::Dataset d{from_vector(pixels, {50, 1, 2, 2}), from_vector(labels, {50})};
  data::BatchIterator it(d, 8, true, 3);
  Tensor x, y;
  int seen = 0;
  while (it.next(x, y, Device::cpu())) {
    auto xs = x.to_vector<float>();
    auto ys = y.to_vector<int64_t>();
    for (size_t i = 0; i < ys.size(); ++i) EXPECT_EQ(xs[i * 4], float(ys[i]));
    seen += static_cast<int>(ys.size());
  }
  EXPECT_EQ(seen, 50);
}

// A text corpus is held as its bytes; its samples are context-byte
// windows at a stride of `context` and their successors, made as a batch
// is gathered, shuffled or not: every byte but the first is a target once
// an epoch, and a batch goes into the caller's tensors where they fit.
TEST(TextWindows, BatchesAreWindowsOfTheBytesAndTheirSuccessors) {
  std::vector<uint8_t> bytes(83);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 37 + 200);
  const int64_t context = 8;
  const data::Dataset d = data::text_windows(bytes.data(), 83, context);
  ASSERT_TRUE(d.is_text());
  EXPECT_EQ(d.size(), 10) << "(83 - 1) / 8 windows";
  EXPECT_EQ(d.text.numel(), 11) << "83 bytes in int64 words";
  EXPECT_EQ(data::text_windows(bytes.data(), 8, context).size(), 0) << "no byte to predict";
  for (bool shuffle : {false, true}) {
    SCOPED_TRACE(shuffle ? "shuffled" : "in order");
    data::BatchIterator it(d, 4, shuffle, 5);
    std::vector<int> seen(10, 0);
    Tensor x, y;
    int64_t batches = 0;
    while (it.next(x, y, Device::cpu())) {
      ASSERT_EQ(x.dtype(), DType::Int64);
      ASSERT_EQ(x.dim(), 2);
      ASSERT_EQ(x.size(1), context);
      ASSERT_EQ(y.sizes(), x.sizes());
      const auto xs = x.to_vector<int64_t>(), ys = y.to_vector<int64_t>();
      for (int64_t r = 0; r < x.size(0); ++r) {
        // The window whose first byte this is (each window's is its own).
        int64_t start = -1;
        for (int64_t k = 0; k < 10; ++k) {
          if (bytes[k * context] == xs[r * context]) start = k;
        }
        ASSERT_GE(start, 0);
        ++seen[start];
        for (int64_t t = 0; t < context; ++t) {
          EXPECT_EQ(xs[r * context + t], bytes[start * context + t]);
          EXPECT_EQ(ys[r * context + t], bytes[start * context + t + 1]);
        }
      }
      ++batches;
    }
    EXPECT_EQ(batches, 3);
    EXPECT_EQ(seen, std::vector<int>(10, 1)) << "every window once an epoch";
  }
  // Into the caller's tensors of the batch's shape: the same batch.
  data::BatchIterator it(d, 4, true, 5), again(d, 4, true, 5);
  Tensor x = empty({4, context}, {DType::Int64}), y = empty({4, context}, {DType::Int64});
  void* into = x.raw_data();
  ASSERT_TRUE(it.next(x, y, Device::cpu(), /*into=*/true));
  EXPECT_EQ(x.raw_data(), into);
  Tensor fresh_x, fresh_y;
  ASSERT_TRUE(again.next(fresh_x, fresh_y, Device::cpu()));
  EXPECT_EQ(x.to_vector<int64_t>(), fresh_x.to_vector<int64_t>());
  EXPECT_EQ(y.to_vector<int64_t>(), fresh_y.to_vector<int64_t>());
  const data::Dataset moved = d.to(Device::cpu());
  EXPECT_EQ(moved.text_bytes, 83);
  EXPECT_EQ(moved.context, context);
}

TEST(TextWindows, WindowsPastTheBytesAreRefused) {
  std::vector<uint8_t> bytes(17);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(240 + i);
  const data::Dataset d = data::text_windows(bytes.data(), 17, 4);
  ASSERT_EQ(d.size(), 4);
  auto expect_error = [&](const Tensor& index, int64_t offset, const std::string& want) {
    try {
      take_byte_windows(d.text, d.text_bytes, index, 4, 4, offset);
      ADD_FAILURE() << "no error; wanted: " << want;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  EXPECT_EQ(take_byte_windows(d.text, 17, from_vector<int64_t>({3}, {1}), 4, 4, 1)
                .to_vector<int64_t>(),
            (std::vector<int64_t>{253, 254, 255, 0}))
      << "the last window's successors end at the last byte, read unsigned";
  expect_error(from_vector<int64_t>({4}, {1}), 1,
               "window 4 (4 bytes at 4 × it + 1) is past the 17 bytes");
  expect_error(from_vector<int64_t>({-1}, {1}), 0, "window -1");
  expect_error(from_vector<int64_t>({INT64_MAX / 2}, {1}), 0, "past the 17 bytes");
  try {
    take_byte_windows(d.text, 17, from_vector<int64_t>({0}, {1}), 4, 4, INT64_MAX);
    ADD_FAILURE() << "an offset past every byte";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("past the 17 bytes"), std::string::npos) << e.what();
  }
  try {
    take_byte_windows(d.text, 200, from_vector<int64_t>({0}, {1}), 4, 4, 0);
    ADD_FAILURE() << "200 bytes claimed of 24";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("at least 200 bytes"), std::string::npos) << e.what();
  }
}

TEST_F(TempDir, CheckpointRoundTripAndRestore) {
  manual_seed(5);
  nn::NamedTensors saved = {{"w", randn({3, 4})},
                            {"step", from_vector<int64_t>({12}, {1})},
                            {"d", randn({2}, {DType::Float64})}};
  checkpoint::save(path("ck"), saved);
  EXPECT_FALSE(fs::exists(path("ck.tmp")));
  auto loaded = checkpoint::load(path("ck"));
  ASSERT_EQ(loaded.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(loaded[i].first, saved[i].first);
    EXPECT_EQ(loaded[i].second.sizes(), saved[i].second.sizes());
    EXPECT_EQ(loaded[i].second.dtype(), saved[i].second.dtype());
  }
  EXPECT_EQ(loaded[0].second.to_vector<float>(), saved[0].second.to_vector<float>());
  Tensor target = zeros({3, 4});
  checkpoint::restore(loaded, {{"w", target}});
  EXPECT_EQ(target.to_vector<float>(), saved[0].second.to_vector<float>());
  EXPECT_THROW(checkpoint::restore(loaded, {{"w", zeros({4, 3})}}), std::invalid_argument);
  EXPECT_THROW(checkpoint::restore(loaded, {{"nope", zeros({1})}}), std::invalid_argument);
}

// bfloat16: conversions round to nearest even and keep NaN and infinities;
// views copy; checkpoints keep the bits; operators that compute refuse it
// by name.
TEST_F(TempDir, BFloat16ConvertsCopiesAndCheckpoints) {
  const float inf = std::numeric_limits<float>::infinity();
  // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: even is 1. 1 + 3·2^-8 lies
  // halfway between 1 + 2^-7 and 1 + 2^-6: even is 1 + 2^-6.
  Tensor x = from_vector<float>({1.0f, 1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -2.5f, 3.0e38f, inf,
                                 std::nanf(""), 0x1p-130f},
                                {8});
  Tensor b = x.to(DType::BFloat16);
  EXPECT_EQ(b.dtype(), DType::BFloat16);
  EXPECT_EQ(b.storage_offset(), 0);
  auto back = b.to(DType::Float32).to_vector<float>();
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[1], 1.0f);
  EXPECT_EQ(back[2], 1.0f + 0x1p-6f);
  EXPECT_EQ(back[3], -2.5f);
  EXPECT_NEAR(back[4], 3.0e38f, 3.0e38f / 128);
  EXPECT_EQ(back[5], inf);
  EXPECT_TRUE(std::isnan(back[6]));
  EXPECT_EQ(back[7], 0x1p-130f) << "subnormals stay";
  EXPECT_EQ(b.narrow(0, 3, 1).item(), -2.5);
  // float64 and int64 go through float32.
  EXPECT_EQ(from_vector<double>({0.5, 7.0}, {2}).to(DType::BFloat16).to(DType::Int64)
                .to_vector<int64_t>(),
            (std::vector<int64_t>{0, 7}));
  // A strided view copies element by element.
  Tensor m = from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3}).to(DType::BFloat16);
  EXPECT_EQ(m.transpose(0, 1).contiguous().to(DType::Float32).to_vector<float>(),
            (std::vector<float>{1, 4, 2, 5, 3, 6}));
  checkpoint::save(path("bf"), {{"b", b}});
  auto loaded = checkpoint::load(path("bf"));
  ASSERT_EQ(loaded.size(), 1u);
  EXPECT_EQ(loaded[0].second.dtype(), DType::BFloat16);
  auto again = loaded[0].second.to(DType::Float32).to_vector<float>();
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(again[i], back[i]) << i;
  try {
    add(b, b);
    ADD_FAILURE() << "bfloat16 arithmetic without autocast";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("bfloat16 is storage only"), std::string::npos)
        << e.what();
  }
}

TEST_F(TempDir, CheckpointSurvivesACrashMidWriteAndDetectsCorruption) {
  checkpoint::save(path("ck"), {{"w", ones({4})}});
  // A crash mid-write leaves a partial .tmp file; the checkpoint is intact.
  write_file(path("ck.tmp"), "LHCKPT\r\n\x01\x00", false);
  EXPECT_EQ(checkpoint::load(path("ck"))[0].second.to_vector<float>(),
            (std::vector<float>{1, 1, 1, 1}));
  // A later save replaces the stale .tmp and the file.
  checkpoint::save(path("ck"), {{"w", full({4}, 2)}});
  EXPECT_EQ(checkpoint::load(path("ck"))[0].second.to_vector<float>()[0], 2);

  std::string bytes;
  {
    std::ifstream in(path("ck"), std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  std::string flipped = bytes;
  flipped[flipped.size() / 2] ^= 0x10;
  write_file(path("bad"), flipped, false);
  EXPECT_THROW(checkpoint::load(path("bad")), std::runtime_error);
  write_file(path("cut"), bytes.substr(0, bytes.size() - 9), false);
  EXPECT_THROW(checkpoint::load(path("cut")), std::runtime_error);
  write_file(path("other"), "not a checkpoint at all", false);
  try {
    checkpoint::load(path("other"));
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("not a Leasehold checkpoint"), std::string::npos);
  }
  EXPECT_THROW(checkpoint::load(path("missing")), std::runtime_error);
}

// A file with a valid checksum but hostile sizes (the CRC is no signature):
// every size is checked against the bytes left before anything is
// allocated, and overflowing shapes are errors.
TEST_F(TempDir, CheckpointSizesAreCheckedBeforeAllocating) {
  auto forge = [&](const std::string& name, std::vector<int64_t> dims, uint64_t nbytes,
                   size_t data_bytes) {
    std::string body;
    auto put = [&](const auto& v) { body.append(reinterpret_cast<const char*>(&v), sizeof v); };
    put(uint32_t{1});  // version
    put(uint32_t{1});  // one tensor
    put(uint32_t{1});
    body += "w";
    put(uint8_t{0});  // float32
    put(static_cast<uint32_t>(dims.size()));
    for (int64_t d : dims) put(d);
    put(nbytes);
    body.append(data_bytes, '\0');
    uint32_t crc = crc32_z(0L, reinterpret_cast<const Bytef*>(body.data()), body.size());
    put(crc);
    write_file(path(name), "LHCKPT\r\n" + body, false);
    return path(name);
  };
  auto expect_load_error = [&](const std::string& file, const std::string& text) {
    try {
      checkpoint::load(file);
      ADD_FAILURE() << file << " loaded";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  // 16 TiB claimed, 16 bytes present: refused without allocating.
  expect_load_error(forge("huge", {int64_t{1} << 22, int64_t{1} << 20}, uint64_t{1} << 44, 16),
                    "claims 17592186044416 bytes, 16 are left");
  // A shape whose byte count overflows 64 bits.
  expect_load_error(forge("overflow", {int64_t{1} << 40, int64_t{1} << 40}, 0, 0),
                    "negative or overflowing dimension");
  expect_load_error(forge("negative", {-4}, 16, 16), "negative or overflowing dimension");
  expect_load_error(forge("empty-but-huge", {0, int64_t{1} << 62, int64_t{1} << 62}, 0, 0),
                    "negative or overflowing dimension");
  // A size that disagrees with its shape.
  expect_load_error(forge("mismatch", {4}, 8, 16), "does not match its shape");
  // The well-formed one of the same kind loads.
  EXPECT_EQ(checkpoint::load(forge("fine", {4}, 16, 16))[0].second.numel(), 4);
  // A file larger than its caller's bound is refused before it is read.
  const std::string fine = forge("bounded", {4}, 16, 16);
  EXPECT_EQ(checkpoint::load(fine, default_file_system(), fs::file_size(fine))[0].second.numel(), 4);
  try {
    checkpoint::load(fine, default_file_system(), fs::file_size(fine) - 1);
    ADD_FAILURE() << "a checkpoint over its bound loaded";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("holds more than"), std::string::npos) << e.what();
  }
  // A FIFO is refused without blocking.
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0600), 0);
  expect_load_error(path("fifo"), "not a regular file");
}

}  // namespace
}  // namespace leasehold::engine
