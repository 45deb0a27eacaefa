// The MPS control daemon the coordinator and its agents run their GPU work
// under. Without MPS the contexts of several processes take turns on the
// GPU in time slices, and every wait for the device costs a slice; under
// MPS their kernels run at once (measured: eight MLP jobs 2.6x faster
// together). The coordinator starts one (mps = auto | on) with its pipe and
// log folders in its runtime directory, or uses a running one
// (mps_directory), joins it before it allocates the pool, and tells agents
// where it is when they register, so they join it too.
//
// Thread safety: none; the coordinator's start-up and exit use it.
#pragma once

#include <memory>
#include <optional>
#include <string>

namespace leasehold {

class MpsDaemon {
 public:
  // Starts `control` (nvidia-cuda-mps-control) as a daemon with its pipe
  // and log folders DIR/mps-pipe and DIR/mps-log (created 0700), or uses
  // the one already running there (a coordinator that restarts finds the
  // daemon it started before: its agents stayed its clients). Throws
  // std::runtime_error naming the program or the folder and what failed.
  static std::unique_ptr<MpsDaemon> start(const std::string& control, const std::string& dir);
  // A daemon someone else runs, whose pipe folder is `pipe_dir`. Throws
  // std::runtime_error when it has no control pipe there.
  static std::unique_ptr<MpsDaemon> attach(const std::string& pipe_dir);

  // The daemon outlives the coordinator on purpose: agents keep their MPS
  // connection across a coordinator restart. Stop it with
  //   echo quit | CUDA_MPS_PIPE_DIRECTORY=<pipe_directory()> nvidia-cuda-mps-control
  const std::string& pipe_directory() const { return pipe_dir_; }
  // Makes this process an MPS client of the daemon: call before its first
  // CUDA call (the driver reads the pipe folder when it starts).
  void join() const;

 private:
  explicit MpsDaemon(std::string pipe_dir) : pipe_dir_(std::move(pipe_dir)) {}
  std::string pipe_dir_;
};

// nvidia-cuda-mps-control on the PATH, if there is one.
std::optional<std::string> find_mps_control();

}  // namespace leasehold
