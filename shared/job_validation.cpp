// Checking a job specification's values (job_spec.h: validate_job,
// validate_model): every field, the files it names and the model's shapes
// against its data, each problem named. Parsing and the specification's
// accessors are in job_spec.cpp.
#include <algorithm>
#include <filesystem>
#include <string_view>

#include "shared/checkpoint_folder.h"
#include "shared/idx_file.h"
#include "shared/job_spec.h"
#include "shared/layer_shapes.h"
#include "shared/printable.h"
#include "shared/program_spec.h"
#include "shared/region_names.h"
#include "shared/text_dataset_checks.h"
#include "shared/units.h"

namespace leasehold {
namespace {

// `classes`: how many the labels name (the largest label + 1); 0: unknown.
void check_model(const proto::JobSpec& job, const std::vector<int64_t>& input, int64_t classes,
                 const std::string& labels, std::vector<std::string>& p) {
  auto shapes = infer_layer_shapes(*job.model(), input, p);
  if (is_text_dataset(job)) {
    check_text_model(*job.model(), shapes, input, p);
  } else if (shapes.size() == job.model()->size()) {
    const auto& last = shapes.back();
    if (last.size() != 1) {
      p.push_back("model: the last layer must produce class scores [classes], not a shape of " +
                  std::to_string(last.size()) + " dimensions (add Flatten and Linear)");
    } else if (classes > last[0]) {
      // A label past the scores would fail the loss at run time.
      p.push_back("model[" + std::to_string(job.model()->size() - 1) + "]: the last layer gives " +
                  std::to_string(last[0]) + " class scores, but the labels in " + labels +
                  " go up to " + std::to_string(classes - 1) + " (" + std::to_string(classes) +
                  " classes): make its out " + std::to_string(classes));
    }
  }
}

// The classes a labels file names: its largest label + 1. Only read when
// it is a plausible size (one byte per example).
int64_t label_classes(const std::string& path) {
  IdxFile file(path);
  if (file.dims().size() != 1) {
    throw std::runtime_error(path + " is not a vector of labels [N]");
  }
  constexpr size_t kMaxLabels = 64u << 20;
  if (file.body_bytes() > kMaxLabels) return 0;
  std::vector<uint8_t> labels(file.body_bytes());
  file.read_body(labels.data());
  uint8_t top = 0;
  for (uint8_t l : labels) top = std::max(top, l);
  return labels.empty() ? 0 : int64_t{top} + 1;
}

// Whether `path`, resolved (links followed as far as it exists, `..`
// removed), is `folder` or in it; true when either cannot be resolved (an
// ancestor the coordinator may not enter), so that doubt refuses.
bool inside(const std::string& path, const std::string& folder) {
  std::error_code ec;
  const auto p = std::filesystem::weakly_canonical(path, ec);
  if (ec) return true;
  const auto f = std::filesystem::weakly_canonical(folder, ec);
  if (ec) return true;
  auto [fi, pi] = std::mismatch(f.begin(), f.end(), p.begin(), p.end());
  return fi == f.end() || (std::next(fi) == f.end() && fi->empty());  // a trailing '/'
}

// Every text field but the name (checked on its own, more strictly): none
// may carry control characters, misleading code points or bytes that are
// not UTF-8, since each reaches log lines, JSON replies and error texts.
std::vector<std::pair<std::string, const flatbuffers::String*>> text_fields(
    const proto::JobSpec& job) {
  std::vector<std::pair<std::string, const flatbuffers::String*>> f{
      {"memory_budget", job.memory_budget()},
      {"memory_min", job.memory_min()},
      {"device", job.device()},
      {"publish_parameters", job.publish_parameters()},
      {"init_from", job.init_from()}};
  if (const auto* d = job.dataset()) {
    f.insert(f.end(), {{"dataset.name", d->name()},
                       {"dataset.directory", d->directory()},
                       {"dataset.train_images", d->train_images()},
                       {"dataset.train_labels", d->train_labels()},
                       {"dataset.test_images", d->test_images()},
                       {"dataset.test_labels", d->test_labels()}});
    if (d->files()) {
      for (flatbuffers::uoffset_t i = 0; i < d->files()->size(); ++i) {
        f.emplace_back("dataset.files[" + std::to_string(i) + "]", d->files()->Get(i));
      }
    }
  }
  if (const auto* c = job.checkpoint()) f.emplace_back("checkpoint.directory", c->directory());
  if (const auto* s = job.spill()) {
    f.insert(f.end(), {{"spill.host_bytes", s->host_bytes()}, {"spill.directory", s->directory()}});
  }
  if (const auto* prog = job.program()) {
    f.emplace_back("program.directory", prog->directory());
    if (prog->command()) {
      for (flatbuffers::uoffset_t i = 0; i < prog->command()->size(); ++i) {
        f.emplace_back("program.command[" + std::to_string(i) + "]", prog->command()->Get(i));
      }
    }
    if (prog->environment()) {
      for (flatbuffers::uoffset_t i = 0; i < prog->environment()->size(); ++i) {
        const auto* v = prog->environment()->Get(i);
        if (!v) continue;
        const std::string at = "program.environment[" + std::to_string(i) + "]";
        f.emplace_back(at + ".name", v->name());
        f.emplace_back(at + ".value", v->value());
      }
    }
  }
  return f;
}

}  // namespace

void validate_job(const proto::JobSpec& job, const ValidationOptions& options) {
  std::vector<std::string> p;
  // Refused before anything else looks at them, so that no later check
  // quotes a hostile value.
  for (const auto& [field, value] : text_fields(job)) {
    if (value && !is_printable(value->string_view())) {
      p.push_back(field + ": " + in_quotes(value->str().substr(0, 256)) +
                  " has control characters or bytes that are not UTF-8, or is longer than " +
                  std::to_string(kMaxPrintableBytes) + " bytes");
    }
  }
  if (!p.empty()) throw JobSpecError(p);
  std::string name = str_or(job.name());
  if (name.empty()) p.push_back("name: required");
  if (name.size() > 128) p.push_back("name: longer than 128 characters");
  // The name becomes the checkpoint's file name, a log line's word and a
  // label in JSON and metrics: a plain word, nothing that leaves a folder,
  // starts a new log line or is not UTF-8.
  if (name == "." || name == ".." || std::any_of(name.begin(), name.end(), [](char c) {
        return !(std::isalnum(static_cast<unsigned char>(c)) &&
                 static_cast<unsigned char>(c) < 0x80) &&
               c != '.' && c != '_' && c != '-';
      })) {
    p.push_back("name: " + in_quotes(name.substr(0, 128)) +
                " is not a job name (1-128 letters, digits, '.', '_' or '-'; not . or ..)");
  }
  const bool program = job.program() != nullptr;
  if (!program && (job.batch_size() <= 0 || job.batch_size() > 65536)) {
    p.push_back("batch_size: " + std::to_string(job.batch_size()) + " is not in [1, 65536]");
  }
  if (job.epochs() < 0) p.push_back("epochs: " + std::to_string(job.epochs()) + " is negative");
  if (job.steps() < 0) p.push_back("steps: " + std::to_string(job.steps()) + " is negative");
  if (job.epochs() > options.limits.max_epochs) {
    p.push_back("epochs: " + std::to_string(job.epochs()) + " is over the limit (max_epochs " +
                std::to_string(options.limits.max_epochs) + ")");
  }
  if (job.steps() > options.limits.max_steps) {
    p.push_back("steps: " + std::to_string(job.steps()) + " is over the limit (max_steps " +
                std::to_string(options.limits.max_steps) + ")");
  }
  if (!program && job.epochs() == 0 && job.steps() == 0) {
    p.push_back("epochs or steps: one must be set");
  }
  if (job.epochs() > 0 && job.steps() > 0) p.push_back("epochs and steps: set only one");
  std::string device = str_or(job.device(), "auto");
  if (!parse_job_device(device)) {
    p.push_back("device: " + in_quotes(device) +
                " is not auto, cuda or cpu, nor cuda:N or cpu:N pinning device N");
  }
  try {
    uint64_t budget = job_memory_budget(job, options.pool_bytes);
    if (budget < (1ull << 20)) p.push_back("memory_budget: less than 1 MiB");
    if (options.alignment && budget < options.alignment) {
      p.push_back("memory_budget: " + format_bytes(budget) +
                  " is less than one lease: the coordinator leases in blocks of " +
                  format_bytes(options.alignment) + " (its alignment); give at least " +
                  format_bytes(options.alignment));
    }
    if (options.pool_bytes && budget > options.pool_bytes) {
      p.push_back("memory_budget: " + format_bytes(budget) + " does not fit the pool of " +
                  format_bytes(options.pool_bytes));
    }
    // Activations may spill; parameters, gradients and optimiser state may
    // not, and they are held in whole leases.
    uint64_t resident = program ? 0 : job_resident_bytes(job);
    if (options.alignment && resident % options.alignment &&
        resident <= UINT64_MAX - options.alignment) {
      resident += options.alignment - resident % options.alignment;
    }
    if (resident > budget) {
      p.push_back("memory_budget: " + format_bytes(budget) +
                  (job.memory_budget() ? "" : " (the default; set memory_budget)") +
                  " cannot hold the model's parameters, gradients and optimizer state (" +
                  format_bytes(resident) + "), which stay on the device");
    }
  } catch (const std::exception& e) {
    p.push_back(std::string("memory_budget: ") + e.what());
  }
  if (job.memory_min()) {
    try {
      uint64_t min = parse_bytes(job.memory_min()->str());
      uint64_t budget = job_memory_budget(job, options.pool_bytes);
      if (min < (1ull << 20)) p.push_back("memory_min: less than 1 MiB");
      if (min > budget) {
        p.push_back("memory_min: " + format_bytes(min) + " is more than memory_budget " +
                    format_bytes(budget));
      }
      if (uint64_t resident = program ? 0 : job_resident_bytes(job); resident > min) {
        p.push_back("memory_min: " + format_bytes(min) +
                    " cannot hold the model's parameters, gradients and optimizer state (" +
                    format_bytes(resident) + "), which stay on the device");
      }
    } catch (const std::exception& e) {
      p.push_back(std::string("memory_min: ") + e.what());
    }
  }
  if (const auto* o = job.optimizer()) {
    if (!(o->lr() > 0 && o->lr() < 10)) p.push_back("optimizer.lr: must be in (0, 10)");
    if (o->momentum() < 0 || o->momentum() >= 1) p.push_back("optimizer.momentum: not in [0, 1)");
    if (o->weight_decay() < 0) p.push_back("optimizer.weight_decay: must not be negative");
    if (o->beta1() < 0 || o->beta1() >= 1 || o->beta2() < 0 || o->beta2() >= 1) {
      p.push_back("optimizer.beta1/beta2: must be in [0, 1)");
    }
    if (!(o->eps() > 0)) p.push_back("optimizer.eps: must be positive");
    if (o->warmup_steps() < 0) p.push_back("optimizer.warmup_steps: must not be negative");
    if (o->min_lr() < 0 || o->min_lr() > o->lr()) {
      p.push_back("optimizer.min_lr: must be in [0, lr]");
    }
    if (o->schedule() == proto::LrSchedule::Cosine && o->min_lr() == 0) {
      p.push_back("optimizer.min_lr: a cosine schedule needs a positive floor (e.g. lr / 10)");
    }
    if (o->clip_grad_norm() < 0) p.push_back("optimizer.clip_grad_norm: must not be negative");
    if (job.steps() > 0 && o->warmup_steps() >= job.steps()) {
      p.push_back("optimizer.warmup_steps: " + std::to_string(o->warmup_steps()) +
                  " is not fewer than the job's " + std::to_string(job.steps()) + " steps");
    }
    if (o->type() == proto::OptimizerType::AdamW && o->lr() * o->weight_decay() >= 1) {
      p.push_back("optimizer.weight_decay: lr × weight_decay must be under 1 for AdamW");
    }
  }
  if (const auto* c = job.checkpoint()) {
    if (c->every_epochs() <= 0) p.push_back("checkpoint.every_epochs: must be positive");
    // A folder it names must be one (lstat-free: a link to a folder is
    // fine), and the checkpoint in it a regular file if it is there; the
    // file's name is the job's, which cannot leave the folder.
    const std::string dir = str_or(c->directory());
    if (c->enabled() && !dir.empty() && dir.front() != '/') {
      // Resolved the same by the coordinator and by an agent, whatever
      // their working folders.
      p.push_back("checkpoint.directory: " + in_quotes(dir) + " is not an absolute path");
    } else if (options.check_files && c->enabled() && !dir.empty()) {
      if (!options.reserved_dir.empty() && inside(dir, options.reserved_dir)) {
        p.push_back("checkpoint.directory: " + in_quotes(dir) +
                    " is inside the coordinator's state folder (or cannot be resolved), where "
                    "other jobs' checkpoints are; leave it out for a folder of the job's own "
                    "there");
      } else if (auto no = checkpoint_folder_refusal(dir, options.submitter_uid)) {
        p.push_back("checkpoint.directory: " + *no);
      } else {
        std::error_code ec;
        const auto file = std::filesystem::symlink_status(checkpoint_file(job), ec);
        if (std::filesystem::exists(file) && !std::filesystem::is_regular_file(file)) {
          p.push_back("checkpoint.directory: " + printable(checkpoint_file(job)) +
                      " is not a regular file");
        }
      }
    }
  }
  if (const auto* s = job.spill()) {
    try {
      job_spill_host_bytes(job);
    } catch (const std::exception& e) {
      p.push_back(std::string("spill.host_bytes: ") + e.what());
    }
    if (s->directory() && s->directory()->str().empty()) {
      p.push_back("spill.directory: empty (leave it out for the agent's spill_dir)");
    }
  }
  if (job.replicas() < 1 || job.replicas() > kMaxReplicas) {
    p.push_back("replicas: " + std::to_string(job.replicas()) + " is not in [1, " +
                std::to_string(kMaxReplicas) + "]");
  } else if (job.replicas() > 1) {
    if (auto pin = parse_job_device(device); pin && pin->ordinal) {
      p.push_back("replicas: " + std::to_string(job.replicas()) + " replicas cannot all run on " +
                  in_quotes(device) + ", one device (leave device as auto, cuda or cpu)");
    }
  }
  if (job.max_attempts() < 0 || job.max_attempts() > 100) {
    p.push_back("max_attempts: " + std::to_string(job.max_attempts()) + " is not in [0, 100]");
  }
  if (program) {
    validate_program(job, options, p);
    if (!p.empty()) throw JobSpecError(p);
    return;
  }

  std::vector<int64_t> input;
  int64_t classes = 0;  // the labels name this many (with check_files)
  std::string labels;   // the field of the file that names the most
  const auto* d = job.dataset();
  if (!d) {
    p.push_back("dataset: required");
  } else {
    if (!(d->std() > 0)) p.push_back("dataset.std: must be positive");
    if (d->train_limit() < 0 || d->test_limit() < 0) p.push_back("dataset limits: negative");
    std::string dname = str_or(d->name());
    if (!dname.empty() && dname != "fashion-mnist" && dname != "mnist" && dname != "text") {
      p.push_back("dataset.name: " + in_quotes(dname) + " is not fashion-mnist, mnist or text");
    }
  }
  if (d && is_text_dataset(job)) {
    uint64_t budget = 0;
    try {
      budget = job_memory_budget(job, options.pool_bytes);
    } catch (const std::exception&) {
      // (named under memory_budget above)
    }
    check_text_dataset(*d, options.check_files, budget, p);
    // (The model is checked against the context even without the files.)
    if (d->context() >= 1 && d->context() <= kMaxTextContext) input = {d->context()};
    classes = kTextVocabulary;
  } else if (d) {
    if (d->files() || d->context()) {
      p.push_back("dataset.files/context: only a text dataset (name \"text\") has them");
    }
    DatasetFiles f = dataset_files(job);
    const std::pair<const char*, std::string> files[] = {{"train_images", f.train_images},
                                                         {"train_labels", f.train_labels},
                                                         {"test_images", f.test_images},
                                                         {"test_labels", f.test_labels}};
    for (const auto& [field, path] : files) {
      if (path.empty()) {
        p.push_back(std::string("dataset.") + field + ": not given (set it or dataset.name)");
      } else if (options.check_files) {
        try {
          if (std::string(field).ends_with("_labels")) {
            if (int64_t n = label_classes(path); n > classes) {
              classes = n;
              labels = std::string("dataset.") + field;
            }
            continue;
          }
          auto dims = read_idx_dims(path);
          if (std::string(field) == "train_images") {
            if (dims.size() != 3) {
              p.push_back("dataset.train_images: " + in_quotes(path) + " is not [N, H, W] images");
            } else {
              input = {1, dims[1], dims[2]};
            }
          }
        } catch (const std::exception& e) {
          p.push_back(std::string("dataset.") + field + ": " + e.what());
        }
      }
    }
  }
  for (const auto& [field, value] : {std::pair{"publish_parameters", job.publish_parameters()},
                                     std::pair{"init_from", job.init_from()}}) {
    if (value &&
        !(valid_region_name(value->str()) && valid_region_name(parameters_region(value->str())))) {
      p.push_back(std::string(field) + ": " + in_quotes(value->str()) +
                  " is not a region name (1-121 letters, digits, '.', '_', '-', ':', '/')");
    }
  }
  if (!job.model() || job.model()->size() == 0) {
    p.push_back("model: at least one layer is required");
  } else if (!input.empty()) {
    check_model(job, input, classes, labels, p);
  }
  if (!p.empty()) throw JobSpecError(p);
}

void validate_model(const proto::JobSpec& job, const std::vector<int64_t>& input) {
  std::vector<std::string> p;
  if (!job.model() || job.model()->size() == 0) {
    p.push_back("model: at least one layer is required");
  } else {
    check_model(job, input, 0, "", p);
  }
  if (!p.empty()) throw JobSpecError(p);
}

void validate_job(const proto::JobSpecT& job, const ValidationOptions& options) {
  auto buffer = pack_job_spec(job);
  validate_job(*verify_job(buffer), options);
}

}  // namespace leasehold
