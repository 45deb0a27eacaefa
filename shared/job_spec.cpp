#include "shared/job_spec.h"

#include <flatbuffers/idl.h>

#include <algorithm>
#include <cctype>
#include <nlohmann/json.hpp>
#include <string_view>

#include "schemas/job_schema_text.h"
#include "shared/units.h"

namespace leasehold {
namespace {

// Edits (insert, delete, replace) from `a` to `b`, letters compared
// without case.
size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      const bool same = std::tolower(static_cast<unsigned char>(a[i - 1])) ==
                        std::tolower(static_cast<unsigned char>(b[j - 1]));
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (same ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// The enum of the field in `object` (of table `def`, recursively) whose
// JSON value is the string `value`; null when none is.
const flatbuffers::EnumDef* enum_holding(const flatbuffers::StructDef& def,
                                         const nlohmann::json& object, const std::string& value) {
  if (!object.is_object()) return nullptr;
  for (const auto& [key, v] : object.items()) {
    const flatbuffers::FieldDef* field = def.fields.Lookup(key);
    if (!field) continue;
    const flatbuffers::Type& type = field->value.type;
    if (type.enum_def && v.is_string() && v.get<std::string>() == value) return type.enum_def;
    if (type.base_type == flatbuffers::BASE_TYPE_STRUCT && type.struct_def) {
      if (auto* e = enum_holding(*type.struct_def, v, value)) return e;
    }
    if (type.base_type == flatbuffers::BASE_TYPE_VECTOR && v.is_array()) {
      for (const auto& item : v) {
        if (type.enum_def && item.is_string() && item.get<std::string>() == value) {
          return type.enum_def;
        }
        if (type.struct_def) {
          if (auto* e = enum_holding(*type.struct_def, item, value)) return e;
        }
      }
    }
  }
  return nullptr;
}

// The parser names an unknown enum value but not its enum: the enum of the
// field that holds it, every value of it listed, and the nearest suggested
// when it is close.
std::string explain_enum_value(const flatbuffers::Parser& parser, const std::string& json,
                               const std::string& value) {
  const auto doc = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  const flatbuffers::EnumDef* best =
      parser.root_struct_def_ ? enum_holding(*parser.root_struct_def_, doc, value) : nullptr;
  if (!best) return "";
  std::string nearest;
  size_t best_distance = SIZE_MAX;
  for (const auto* v : best->Vals()) {
    if (const size_t d = edit_distance(value, v->name); d < best_distance) {
      best_distance = d;
      nearest = v->name;
    }
  }
  std::string valid;
  for (const auto* v : best->Vals()) valid += (valid.empty() ? "" : ", ") + v->name;
  std::string out = " (" + best->name + " is one of " + valid;
  // Close enough to be a slip: a case, a letter or two.
  if (best_distance <= std::max<size_t>(2, value.size() / 3))
    out += "; did you mean " + nearest + "?";
  return out + ")";
}

// Values FlatBuffers cannot tell from a missing field (a scalar's default
// is 0): an explicit "epochs": 0 is a number that must be positive, not a
// missing choice between epochs and steps.
void check_explicit_values(const std::string& json, std::vector<std::string>& p) {
  const auto doc = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (!doc.is_object()) return;
  for (const char* field : {"epochs", "steps"}) {
    auto it = doc.find(field);
    if (it != doc.end() && it->is_number() && it->get<double>() <= 0) {
      p.push_back(std::string(field) + ": must be positive (the file says " + it->dump() + ")");
    }
  }
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : "; ") + x;
  return s;
}


}  // namespace

JobSpecError::JobSpecError(const std::vector<std::string>& problems)
    : std::invalid_argument("invalid job: " + join(problems)), problems_(problems) {}

std::vector<uint8_t> parse_job_json(const std::string& json, const std::string& source) {
  flatbuffers::IDLOptions opts;
  opts.skip_unexpected_fields_in_json = false;  // unknown fields are errors
  flatbuffers::Parser parser(opts);
  if (!parser.Parse(kJobSchemaText)) {
    throw std::logic_error("built-in job schema does not parse: " + parser.error_);
  }
  if (!parser.Parse(json.c_str(), nullptr, source.c_str())) {
    // The parser's message already names the file, line and field.
    std::string msg = parser.error_;
    while (!msg.empty() && (msg.back() == '\n' || msg.back() == ' ')) msg.pop_back();
    constexpr std::string_view kUnknownEnum = "unknown enum value: ";
    if (auto at = msg.find(kUnknownEnum); at != std::string::npos) {
      std::string value = msg.substr(at + kUnknownEnum.size());
      value = value.substr(0, value.find_first_of(", \n"));
      msg += explain_enum_value(parser, json, value);
    }
    throw JobSpecError({msg});
  }
  std::vector<std::string> problems;
  check_explicit_values(json, problems);
  if (!problems.empty()) throw JobSpecError(problems);
  std::vector<uint8_t> out(parser.builder_.GetBufferPointer(),
                           parser.builder_.GetBufferPointer() + parser.builder_.GetSize());
  verify_job(out);
  return out;
}

const proto::JobSpec* verify_job(const std::vector<uint8_t>& buffer) {
  flatbuffers::Verifier v(buffer.data(), buffer.size());
  if (!v.VerifyBuffer<proto::JobSpec>(nullptr)) {
    throw JobSpecError({"job specification failed FlatBuffers verification"});
  }
  return flatbuffers::GetRoot<proto::JobSpec>(buffer.data());
}

std::vector<uint8_t> pack_job_spec(const proto::JobSpecT& spec) {
  flatbuffers::FlatBufferBuilder fbb;
  fbb.Finish(proto::JobSpec::Pack(fbb, &spec));
  return {fbb.GetBufferPointer(), fbb.GetBufferPointer() + fbb.GetSize()};
}

std::string checkpoint_file(const proto::JobSpec& job) {
  const auto* c = job.checkpoint();
  if (!c || !c->enabled() || !c->directory() || c->directory()->size() == 0) return "";
  return c->directory()->str() + "/" + str_or(job.name()) + ".ckpt";
}

std::string checkpoint_file(const proto::JobSpecT& job) {
  const auto* c = job.checkpoint.get();
  if (!c || !c->enabled || c->directory.empty()) return "";
  return c->directory + "/" + job.name + ".ckpt";
}

DatasetFiles dataset_files(const proto::JobSpec& job) {
  DatasetFiles f;
  const auto* d = job.dataset();
  if (!d) return f;
  std::string name = str_or(d->name()), dir = str_or(d->directory());
  if (name == "fashion-mnist" || name == "mnist") {
    std::string base = dir.empty() ? "/usr/share/datasets/" + name : dir;
    f.train_images = base + "/train-images-idx3-ubyte.gz";
    f.train_labels = base + "/train-labels-idx1-ubyte.gz";
    f.test_images = base + "/t10k-images-idx3-ubyte.gz";
    f.test_labels = base + "/t10k-labels-idx1-ubyte.gz";
  }
  if (d->train_images()) f.train_images = d->train_images()->str();
  if (d->train_labels()) f.train_labels = d->train_labels()->str();
  if (d->test_images()) f.test_images = d->test_images()->str();
  if (d->test_labels()) f.test_labels = d->test_labels()->str();
  return f;
}

bool is_text_dataset(const proto::JobSpec& job) {
  return job.dataset() && job.dataset()->name() && job.dataset()->name()->str() == "text";
}

uint64_t job_memory_budget(const proto::JobSpec& job, uint64_t pool_bytes) {
  if (job.memory_budget()) return parse_bytes(job.memory_budget()->str());
  uint64_t fallback = 1ull << 30;
  return pool_bytes ? std::min(fallback, pool_bytes) : fallback;
}

uint64_t job_memory_min(const proto::JobSpec& job, uint64_t pool_bytes) {
  if (job.memory_min()) return parse_bytes(job.memory_min()->str());
  return job_memory_budget(job, pool_bytes);
}

uint64_t job_resident_bytes(const proto::JobSpec& job) {
  long double params = 0;
  if (job.model()) {
    for (const auto* l : *job.model()) {
      // In long double: absurd sizes saturate instead of wrapping around.
      long double in = std::max(0, l->in()), out = std::max(0, l->out());
      long double k = std::max(0, l->kernel());
      if (l->type() == proto::LayerType::Linear && !l->tied()) params += in * out + out;
      if (l->type() == proto::LayerType::Conv2d) params += out * in * k * k + out;
      if (l->type() == proto::LayerType::Embedding) {
        params += (in + std::max(0, l->context())) * out;
      }
      // Attention's 3 × out² + out² and the MLP's 8 × out², their biases,
      // two layer norms.
      if (l->type() == proto::LayerType::TransformerBlock) params += 12 * out * out + 13 * out;
      if (l->type() == proto::LayerType::LayerNorm) params += 2 * out;
    }
  }
  // Parameters and gradients, plus Adam's two moments or SGD's momentum.
  int copies = 2;
  const auto* o = job.optimizer();
  if (!o || o->type() == proto::OptimizerType::Adam || o->type() == proto::OptimizerType::AdamW) {
    copies += 2;
  } else if (o->momentum() > 0) {
    copies += 1;
  }
  long double bytes = params * copies * sizeof(float);
  constexpr long double kMax = static_cast<long double>(UINT64_MAX);
  return bytes >= kMax ? UINT64_MAX : static_cast<uint64_t>(bytes);
}

std::optional<JobDevice> parse_job_device(std::string_view text) {
  if (text.empty() || text == "auto") return JobDevice{};
  const size_t colon = text.find(':');
  const std::string_view backend = text.substr(0, colon);
  if (backend != "cuda" && backend != "cpu") return std::nullopt;
  JobDevice d{std::string(backend), std::nullopt};
  if (colon == std::string_view::npos) return d;
  const std::string_view digits = text.substr(colon + 1);
  if (digits.empty() || digits.size() > 4 ||
      digits.find_first_not_of("0123456789") != std::string_view::npos) {
    return std::nullopt;
  }
  d.ordinal = std::stoi(std::string(digits));
  return d;
}

uint64_t job_spill_host_bytes(const proto::JobSpec& job) {
  const auto* s = job.spill();
  return s && s->host_bytes() ? parse_bytes(s->host_bytes()->str()) : 0;
}


}  // namespace leasehold
