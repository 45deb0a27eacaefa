#include "agent/job_data.h"

#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "agent/region_tensors.h"
#include "agent/spill/transfer.h"
#include "shared/idx_file.h"
#include "shared/job_spec.h"

namespace leasehold {
namespace {

namespace E = engine;

// Bumped when the decoded layout changes, so old regions are not reused.
constexpr const char* kLayout = "float32 [N,1,H,W] images (x/255-mean)/std, int64 labels, v1";

const char* const kTensors[] = {"train.images", "train.labels", "test.images", "test.labels"};

JobData decode_private(const proto::JobSpec& job, const DatasetFiles& f) {
  const auto* ds = job.dataset();
  // Host-side input, not job memory: out of the leases even where leases
  // are host memory.
  E::AllocatorGuard host(E::cpu_allocator());
  JobData d;
  d.train = E::data::load_idx_dataset(f.train_images, f.train_labels, ds->mean(), ds->std(),
                                      ds->train_limit());
  d.test = E::data::load_idx_dataset(f.test_images, f.test_labels, ds->mean(), ds->std(),
                                     ds->test_limit());
  d.decoded = true;
  return d;
}

// The specs of the four tensors, from the files' headers and the limits.
std::vector<regions::TensorSpec> dataset_specs(const proto::JobSpec& job, const DatasetFiles& f) {
  const auto* ds = job.dataset();
  auto count = [](const std::string& images, const std::string& labels, int64_t limit) {
    auto img = read_idx_dims(images);
    auto lab = read_idx_dims(labels);
    if (img.size() != 3) throw std::runtime_error(images + ": expected [N, H, W] images");
    if (lab.size() != 1) throw std::runtime_error(labels + ": expected [N] labels");
    if (img[0] != lab[0]) {
      throw std::runtime_error(images + " holds " + std::to_string(img[0]) + " images but " +
                               labels + " holds " + std::to_string(lab[0]) + " labels");
    }
    int64_t n = limit > 0 ? std::min(img[0], limit) : img[0];
    return std::pair{E::Shape{n, 1, img[1], img[2]}, E::Shape{n}};
  };
  auto [train_x, train_y] = count(f.train_images, f.train_labels, ds->train_limit());
  auto [test_x, test_y] = count(f.test_images, f.test_labels, ds->test_limit());
  return {{kTensors[0], E::DType::Float32, train_x},
          {kTensors[1], E::DType::Int64, train_y},
          {kTensors[2], E::DType::Float32, test_x},
          {kTensors[3], E::DType::Int64, test_y}};
}

// Bytes of the files read, normalised and copied into the region per chunk.
constexpr size_t kChunk = size_t{1} << 20;

// Decodes the dataset straight into `region`: each file is read a chunk at
// a time, normalised (images) or widened (labels) into one of two pinned
// buffers, and copied to the device while the next chunk is read; on the
// host backend it goes into the region directly. No copy of the whole
// dataset is made in host memory. Throws naming a file that is unreadable,
// truncated or no longer of the size the region was made for.
void fill_region(RegionAttachment& region, const proto::JobSpec& job, const DatasetFiles& f,
                 const std::vector<regions::TensorSpec>& specs) {
  regions::write_header(region, specs);
  const auto offsets = regions::tensor_offsets(specs);
  const E::Device device = regions::region_device(region);
  const E::data::PixelTable table(job.dataset()->mean(), job.dataset()->std());
  spill::PinnedBuffer staging[2];
  if (device.is_cuda()) {
    for (auto& b : staging) b = spill::PinnedBuffer(kChunk * sizeof(int64_t), device);
  }
  // Declared after the buffers: on an error it is destroyed first, which
  // waits for the copies still reading them.
  auto transfer = spill::make_transfer(device);
  std::shared_ptr<spill::Fence> copied[2];
  std::vector<uint8_t> raw(kChunk);
  const std::string* paths[] = {&f.train_images, &f.train_labels, &f.test_images, &f.test_labels};
  int turn = 0;
  for (size_t t = 0; t < specs.size(); ++t) {
    IdxFile file(*paths[t]);
    const bool labels = specs[t].dtype == E::DType::Int64;
    const size_t elems = static_cast<size_t>(E::numel_of(specs[t].shape));
    const size_t width = labels ? sizeof(int64_t) : sizeof(float);
    const int64_t rows = specs[t].shape[0];
    if (rows <= 0 || file.dims()[0] < rows ||
        file.body_bytes() / static_cast<size_t>(file.dims()[0]) != elems / rows) {
      throw std::runtime_error(*paths[t] + " changed while the dataset was loaded");
    }
    std::byte* dst = region.data() + offsets[t];
    for (size_t done = 0; done < elems; done += kChunk, turn ^= 1) {
      const size_t n = std::min(kChunk, elems - done);
      file.read_next(raw.data(), n);
      std::byte* out = dst + done * width;
      if (device.is_cuda()) {
        if (copied[turn]) copied[turn]->wait();  // this buffer's previous copy is done
        out = reinterpret_cast<std::byte*>(staging[turn].data());
      }
      if (labels) {
        auto* o = reinterpret_cast<int64_t*>(out);
        for (size_t i = 0; i < n; ++i) o[i] = raw[i];
      } else {
        auto* o = reinterpret_cast<float*>(out);
        for (size_t i = 0; i < n; ++i) o[i] = table.value[raw[i]];
      }
      if (device.is_cuda()) {
        transfer->to_device(dst + done * width, out, n * width);
        copied[turn] = transfer->mark();
      }
    }
  }
  transfer->mark()->wait();
}

// The dataset viewed in `region` (no copies).
JobData view_region(const std::shared_ptr<RegionAttachment>& region) {
  std::map<std::string, E::Tensor> by_name;
  for (auto& [name, t] : regions::read_tensors(region)) by_name[name] = t;
  for (const char* name : kTensors) {
    if (!by_name.count(name)) {
      throw std::runtime_error("region '" + region->name() + "' holds no '" + name + "'");
    }
  }
  JobData d;
  d.train = {by_name["train.images"], by_name["train.labels"]};
  d.test = {by_name["test.images"], by_name["test.labels"]};
  for (const auto* part : {&d.train, &d.test}) {
    if (part->images.dim() != 4 || part->labels.dim() != 1 ||
        part->images.dtype() != E::DType::Float32 || part->labels.dtype() != E::DType::Int64 ||
        part->images.size(0) != part->labels.size(0)) {
      throw std::runtime_error("region '" + region->name() + "' does not hold a dataset");
    }
  }
  d.region = region->name();
  return d;
}

}  // namespace

std::string dataset_region_name(const proto::JobSpec& job) {
  const DatasetFiles f = dataset_files(job);
  const auto* ds = job.dataset();
  std::string key = std::string(kLayout) + " " + std::to_string(regions::kVersion);
  for (const std::string* path : {&f.train_images, &f.train_labels, &f.test_images,
                                  &f.test_labels}) {
    struct stat st {};
    if (::stat(path->c_str(), &st) != 0) {
      throw std::runtime_error("cannot read dataset file " + *path + ": " + std::strerror(errno));
    }
    key += "|" + *path + ":" + std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino) + ":" +
           std::to_string(st.st_size) + ":" + std::to_string(st.st_mtim.tv_sec) + "." +
           std::to_string(st.st_mtim.tv_nsec);
  }
  float mean = ds ? ds->mean() : 0, std = ds ? ds->std() : 1;
  uint32_t bits[2];
  std::memcpy(&bits[0], &mean, 4);
  std::memcpy(&bits[1], &std, 4);
  key += "|" + std::to_string(bits[0]) + ":" + std::to_string(bits[1]) + "|" +
         std::to_string(ds ? ds->train_limit() : 0) + ":" +
         std::to_string(ds ? ds->test_limit() : 0);
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx",
                static_cast<unsigned long long>(XXH3_64bits(key.data(), key.size())));
  // What it holds, for whoever reads the pool map: the training images'
  // folder and file ("dataset/mnist/train-images-idx3-ubyte/5baa…"), in
  // the characters a region name allows; the hash alone identifies it.
  auto readable = [](std::string s) {
    for (char& c : s) {
      if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) {
        c = '_';
      }
    }
    return s.substr(0, 40);
  };
  const std::filesystem::path images(f.train_images);
  std::string label = readable(images.parent_path().filename().string());
  label += (label.empty() ? "" : "/") + readable(images.filename().string());
  return "dataset/" + (label.empty() ? "" : label + "/") + hex;
}

// A text corpus: read whole, its last validation_fraction held out, both
// parts held as their bytes (small next to a GPU: a byte a token).
JobData load_text(const proto::JobSpec& job) {
  const auto* ds = job.dataset();
  std::vector<std::string> paths;
  uint64_t total_bytes = 0;
  for (const auto* f : *ds->files()) {
    paths.push_back(f->str());
    std::error_code ec;
    total_bytes += std::filesystem::file_size(paths.back(), ec);
  }
  // Checked again here: the files may have grown since the job was queued.
  const uint64_t budget = job_memory_budget(job);
  if (total_bytes > budget / (4 * kTextBytesPerToken)) {
    throw std::runtime_error("dataset.files: " + std::to_string(total_bytes) +
                             " bytes of text are too many for memory_budget " +
                             std::to_string(budget) + " (over a quarter of it)");
  }
  E::AllocatorGuard host(E::cpu_allocator());
  const std::vector<uint8_t> bytes = E::data::read_text_files(paths);
  const auto total = static_cast<int64_t>(bytes.size());
  const auto held =
      static_cast<int64_t>(static_cast<double>(total) * ds->validation_fraction());
  JobData d;
  d.train = E::data::text_windows(bytes.data(), total - held, ds->context());
  d.test = E::data::text_windows(bytes.data() + (total - held), held, ds->context());
  if (d.train.size() == 0 || d.test.size() == 0) {
    throw std::runtime_error("dataset.files: " + std::to_string(total) +
                             " bytes make no training or no validation sample of " +
                             std::to_string(ds->context()) + " tokens");
  }
  d.decoded = true;
  d.private_because = "text datasets are read by each job";
  return d;
}

JobData load_job_data(const proto::JobSpec& job, AgentSession* session) {
  if (is_text_dataset(job)) return load_text(job);
  const DatasetFiles files = dataset_files(job);
  if (!session) {
    JobData d = decode_private(job, files);
    d.private_because = "dataset regions are off";
    return d;
  }
  const std::string name = dataset_region_name(job);
  auto alone = [&](const std::string& why) {
    spdlog::warn("dataset region '{}': {}; decoding the files for this job alone", name, why);
    JobData d = decode_private(job, files);
    d.private_because = why;
    return d;
  };
  // Resident already (or being filled by another agent: this waits for it).
  try {
    auto region = std::make_shared<RegionAttachment>(session->attach_region(name, 0, false));
    try {
      return view_region(region);
    } catch (const std::runtime_error& e) {
      return alone(e.what());  // not a dataset this build can read
    }
  } catch (const Error& e) {
    if (e.code() == ErrorCode::UnknownSender) throw;  // the session is gone: the job stops
    if (e.code() != ErrorCode::NoSuchRegion) return alone(e.what());
  }
  // Not resident: create it; this job fills it unless another got there first.
  const auto specs = dataset_specs(job, files);
  std::shared_ptr<RegionAttachment> region;
  try {
    region = std::make_shared<RegionAttachment>(
        session->attach_region(name, regions::packed_size(specs), true));
  } catch (const Error& e) {
    if (e.code() == ErrorCode::UnknownSender) throw;  // the session is gone: the job stops
    return alone(e.what());
  }
  if (!region->must_fill()) {
    try {
      return view_region(region);
    } catch (const std::runtime_error& e) {
      return alone(e.what());
    }
  }
  fill_region(*region, job, files, specs);
  region->mark_ready();
  JobData d = view_region(region);
  d.decoded = true;
  return d;
}

}  // namespace leasehold
