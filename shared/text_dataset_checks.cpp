#include "shared/text_dataset_checks.h"

#include <cstdio>
#include <filesystem>

#include "shared/job_spec.h"
#include "shared/printable.h"
#include "shared/units.h"

namespace leasehold {

void check_text_dataset(const proto::DatasetSpec& d, bool check_files, uint64_t budget,
                        std::vector<std::string>& p) {
  if (d.train_images() || d.train_labels() || d.test_images() || d.test_labels() ||
      d.directory()) {
    p.push_back("dataset: a text dataset reads `files`, not directory or IDX images and labels");
  }
  if (d.context() < 1 || d.context() > kMaxTextContext) {
    p.push_back("dataset.context: " + std::to_string(d.context()) + " is not in [1, " +
                std::to_string(kMaxTextContext) + "] tokens");
  }
  if (!(d.validation_fraction() > 0 && d.validation_fraction() < 1)) {
    p.push_back("dataset.validation_fraction: must be in (0, 1)");
  }
  if (!d.files() || d.files()->size() == 0) {
    p.push_back("dataset.files: a text dataset needs at least one file");
    return;
  }
  if (!check_files) return;
  uint64_t total = 0;
  bool files_ok = true;
  for (flatbuffers::uoffset_t i = 0; i < d.files()->size(); ++i) {
    const std::string path = d.files()->Get(i)->str();
    const std::string field = "dataset.files[" + std::to_string(i) + "]: ";
    std::error_code ec;
    const auto status = std::filesystem::status(path, ec);
    if (ec || !std::filesystem::exists(status)) {
      p.push_back(field + in_quotes(path) + " does not exist");
      files_ok = false;
    } else if (!std::filesystem::is_regular_file(status)) {
      p.push_back(field + in_quotes(path) + " is not a regular file");
      files_ok = false;
    } else if (std::FILE* f = std::fopen(path.c_str(), "rb"); !f) {
      p.push_back(field + in_quotes(path) + " cannot be read");
      files_ok = false;
    } else {
      std::fclose(f);
      total += std::filesystem::file_size(path, ec);
    }
  }
  if (!files_ok || d.context() < 1) return;
  // The corpus is held as its bytes, on a GPU in the job's memory: it must
  // fit the budget with room to train.
  if (budget && total > budget / (4 * kTextBytesPerToken)) {
    p.push_back("dataset.files: " + format_bytes(total) + " of text take " +
                format_bytes(total * kTextBytesPerToken) + " of the job's memory, over a " +
                "quarter of memory_budget " + format_bytes(budget) +
                "; raise the budget or use less text");
  }
  // Each part needs a sample: context tokens and one more as the target.
  const uint64_t held = static_cast<uint64_t>(static_cast<double>(total) * d.validation_fraction());
  const uint64_t need = static_cast<uint64_t>(d.context()) + 1;
  if (held < need || total - held < need) {
    p.push_back("dataset.files: " + std::to_string(total) + " bytes in all, too few for a " +
                "training and a validation sample of " + std::to_string(d.context()) +
                " tokens each (validation_fraction " + std::to_string(d.validation_fraction()) +
                ")");
  }
}

void check_text_model(const flatbuffers::Vector<flatbuffers::Offset<proto::Layer>>& model,
                      const std::vector<std::vector<int64_t>>& shapes,
                      const std::vector<int64_t>& input, std::vector<std::string>& p) {
  if (model.size() > 0) {
    const proto::Layer& first = *model.Get(0);
    if (first.type() != proto::LayerType::Embedding) {
      p.push_back("model[0]: a text model starts with an Embedding of the " +
                  std::to_string(kTextVocabulary) + " byte values");
    } else if (first.in() < kTextVocabulary) {
      p.push_back("model[0] (Embedding): in is " + std::to_string(first.in()) +
                  ", but the text's tokens are bytes: make it " + std::to_string(kTextVocabulary));
    }
  }
  if (shapes.size() != model.size() || shapes.empty()) return;
  const auto& last = shapes.back();
  if (last.size() != 2 || last[0] != input[0] || last[1] < kTextVocabulary) {
    std::string got;
    for (size_t i = 0; i < last.size(); ++i) got += (i ? ", " : "") + std::to_string(last[i]);
    p.push_back("model: the last layer must produce next-token scores [tokens, " +
                std::to_string(kTextVocabulary) + "] (one per byte value), not [" + got + "]");
  }
}

}  // namespace leasehold
