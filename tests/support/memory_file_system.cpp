#include "tests/support/memory_file_system.h"

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace leasehold::testing {
namespace {

// "/a/b/" -> "/a/b"; "/" stays.
std::string strip_slashes(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

// "/a/b" -> {"/a", "b"}; "/b" -> {"/", "b"}; "b" -> {"", "b"} (no such directory).
std::pair<std::string, std::string> split(const std::string& path) {
  size_t slash = path.rfind('/');
  if (slash == std::string::npos) return {"", path};
  return {slash == 0 ? "/" : path.substr(0, slash), path.substr(slash + 1)};
}

Status missing(const std::string& context) {
  return Status::not_found(context + ": " + std::strerror(ENOENT));
}

}  // namespace

class MemoryFileSystem::File final : public WritableFile {
 public:
  File(MemoryFileSystem* fs, std::shared_ptr<Inode> inode, std::string path)
      : fs_(fs), inode_(std::move(inode)), path_(std::move(path)) {}

  Status append(std::string_view data) override {
    std::lock_guard lock(fs_->mu_);
    if (!open_) return closed("write");
    if (int err = fs_->begin(Op::Append)) return Status::io_error("cannot write " + path_, err);
    inode_->data.append(data);
    return Status::OK();
  }

  Status sync() override {
    std::lock_guard lock(fs_->mu_);
    if (!open_) return closed("fsync");
    if (int err = fs_->begin(Op::Sync)) return Status::io_error("cannot fsync " + path_, err);
    inode_->synced = inode_->data;
    return Status::OK();
  }

  Status close() override {
    std::lock_guard lock(fs_->mu_);
    if (!open_) return closed("close");
    open_ = false;
    if (int err = fs_->begin(Op::Close)) return Status::io_error("cannot close " + path_, err);
    return Status::OK();
  }

 private:
  Status closed(const char* what) const {
    return Status::invalid_argument("cannot " + std::string(what) + " " + path_ +
                                    ": file already closed");
  }

  MemoryFileSystem* fs_;
  std::shared_ptr<Inode> inode_;
  std::string path_;
  bool open_ = true;  // guarded by fs_->mu_
};

MemoryFileSystem::MemoryFileSystem() { dirs_["/"]; }

MemoryFileSystem::~MemoryFileSystem() = default;

int MemoryFileSystem::begin(Op op) {
  ++calls_[op];
  bool mutating = op != Op::Read;
  if (mutating) ++mutating_ops_;
  if (dead_) return EIO;
  if (mutating && crash_budget_ >= 0) {
    if (crash_budget_ == 0) {
      dead_ = true;
      return EIO;
    }
    --crash_budget_;
  }
  int err = 0;
  for (auto it = faults_.begin(); it != faults_.end();) {
    if (it->op == op && it->skip == 0 && err == 0) {
      err = it->err;
      it = faults_.erase(it);
      continue;
    }
    if (it->op == op && it->skip > 0) --it->skip;
    ++it;
  }
  return err;
}

MemoryFileSystem::Dir* MemoryFileSystem::find_dir(const std::string& dir) {
  auto it = dirs_.find(strip_slashes(dir));
  return it == dirs_.end() ? nullptr : &it->second;
}

const MemoryFileSystem::Dir* MemoryFileSystem::find_dir(const std::string& dir) const {
  auto it = dirs_.find(strip_slashes(dir));
  return it == dirs_.end() ? nullptr : &it->second;
}

Status MemoryFileSystem::new_writable_file(const std::string& path,
                                           std::unique_ptr<WritableFile>* out) {
  std::lock_guard lock(mu_);
  const std::string context = "cannot create " + path;
  if (int err = begin(Op::Create)) return Status::io_error(context, err);
  auto [dir_name, name] = split(path);
  Dir* dir = find_dir(dir_name);
  if (!dir) return Status::io_error(context, ENOENT);
  if (name.empty() || dirs_.count(path)) return Status::io_error(context, EISDIR);
  std::shared_ptr<Inode>& slot = dir->entries[name];
  if (slot) {
    slot->data.clear();
    slot->synced.clear();
  } else {
    slot = std::make_shared<Inode>();
    inodes_.push_back(slot);
  }
  *out = std::make_unique<File>(this, slot, path);
  return Status::OK();
}

Status MemoryFileSystem::read_file(const std::string& path, std::string* contents,
                                   size_t max_bytes) {
  std::lock_guard lock(mu_);
  if (int err = begin(Op::Read)) return Status::io_error("cannot read " + path, err);
  auto [dir_name, name] = split(path);
  const Dir* dir = find_dir(dir_name);
  auto it = dir ? dir->entries.find(name) : Entries::const_iterator();
  if (!dir || it == dir->entries.end()) return missing("cannot open " + path);
  if (it->second->data.size() > max_bytes) {
    return Status::io_error(path + " holds more than " + std::to_string(max_bytes) + " bytes",
                            EFBIG);
  }
  *contents = it->second->data;
  return Status::OK();
}

Status MemoryFileSystem::rename(const std::string& from, const std::string& to) {
  std::lock_guard lock(mu_);
  const std::string context = "cannot rename " + from + " to " + to;
  if (int err = begin(Op::Rename)) return Status::io_error(context, err);
  auto [from_dir_name, from_name] = split(from);
  auto [to_dir_name, to_name] = split(to);
  Dir* from_dir = find_dir(from_dir_name);
  Dir* to_dir = find_dir(to_dir_name);
  if (!from_dir || !to_dir || !from_dir->entries.count(from_name)) {
    return Status::io_error(context, ENOENT);
  }
  if (from == to) return Status::OK();
  std::shared_ptr<Inode> inode = from_dir->entries[from_name];
  from_dir->entries.erase(from_name);
  to_dir->entries[to_name] = std::move(inode);
  return Status::OK();
}

Status MemoryFileSystem::remove(const std::string& path) {
  std::lock_guard lock(mu_);
  if (int err = begin(Op::Remove)) return Status::io_error("cannot remove " + path, err);
  auto [dir_name, name] = split(path);
  Dir* dir = find_dir(dir_name);
  if (!dir || dir->entries.erase(name) == 0) return missing("cannot remove " + path);
  return Status::OK();
}

Status MemoryFileSystem::sync_dir(const std::string& dir_name) {
  std::lock_guard lock(mu_);
  if (int err = begin(Op::SyncDir)) {
    return Status::io_error("cannot fsync directory " + dir_name, err);
  }
  Dir* dir = find_dir(dir_name);
  if (!dir) return Status::io_error("cannot open directory " + dir_name, ENOENT);
  dir->durable = dir->entries;
  return Status::OK();
}

Status MemoryFileSystem::create_dirs(const std::string& dir_name) {
  std::lock_guard lock(mu_);
  const std::string context = "cannot create directory " + dir_name;
  if (int err = begin(Op::CreateDirs)) return Status::io_error(context, err);
  std::string dir = strip_slashes(dir_name);
  if (dir.empty() || dir[0] != '/') return Status::io_error(context, ENOENT);
  // Every prefix ending before a '/', then the whole path.
  for (size_t end = dir.find('/', 1);; end = dir.find('/', end + 1)) {
    std::string prefix = dir.substr(0, end);
    auto [parent, name] = split(prefix);
    if (find_dir(parent)->entries.count(name)) return Status::io_error(context, ENOTDIR);
    dirs_[prefix];
    if (end == std::string::npos) break;
  }
  return Status::OK();
}

bool MemoryFileSystem::exists(const std::string& path) {
  std::lock_guard lock(mu_);
  if (dead_) return false;
  if (find_dir(path)) return true;
  auto [dir_name, name] = split(path);
  const Dir* dir = find_dir(dir_name);
  return dir && dir->entries.count(name);
}

void MemoryFileSystem::fail_next(Op op, int err, int skip) {
  std::lock_guard lock(mu_);
  faults_.push_back({op, err, skip});
}

void MemoryFileSystem::crash_after(int n) {
  std::lock_guard lock(mu_);
  crash_budget_ = n;
}

void MemoryFileSystem::crash() {
  std::lock_guard lock(mu_);
  for (auto& [name, dir] : dirs_) dir.entries = dir.durable;
  std::vector<std::weak_ptr<Inode>> alive;
  for (auto& weak : inodes_) {
    if (auto inode = weak.lock()) {
      inode->data = inode->synced;
      alive.push_back(weak);
    }
  }
  inodes_ = std::move(alive);
  faults_.clear();
  crash_budget_ = -1;
  dead_ = false;
}

int MemoryFileSystem::mutating_ops() const {
  std::lock_guard lock(mu_);
  return mutating_ops_;
}

int MemoryFileSystem::calls(Op op) const {
  std::lock_guard lock(mu_);
  auto it = calls_.find(op);
  return it == calls_.end() ? 0 : it->second;
}

std::vector<std::string> MemoryFileSystem::list(const std::string& dir_name) const {
  std::lock_guard lock(mu_);
  std::vector<std::string> names;
  if (const Dir* dir = find_dir(dir_name)) {
    for (const auto& [name, inode] : dir->entries) names.push_back(name);
  }
  return names;
}

std::string MemoryFileSystem::contents(const std::string& path) const {
  std::lock_guard lock(mu_);
  auto [dir_name, name] = split(path);
  const Dir* dir = find_dir(dir_name);
  if (dir) {
    auto it = dir->entries.find(name);
    if (it != dir->entries.end()) return it->second->data;
  }
  throw std::out_of_range("no file " + path + " in the memory file system");
}

}  // namespace leasehold::testing
