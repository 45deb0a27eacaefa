// The MPS control daemon the agents run their GPU work under. Without MPS
// the contexts of several processes take turns on the GPU in time slices,
// and every wait for the device costs a slice; under MPS their kernels run
// at once (measured: eight MLP jobs 2.6x faster together). The coordinator
// starts one (mps = auto | on) with its pipe and log folders in its runtime
// directory, or uses a running one (mps_directory), and tells agents where
// it is when they register, so they join it.
//
// The coordinator itself stays out of MPS: a fatal fault in one MPS client
// ends the context of every client on the GPU, and the pool lives in the
// coordinator's context, which must survive it (measured on an H100: MPS
// clients map and use memory of a process outside MPS through CUDA IPC;
// after a client faulted, that memory and its contents were intact). The
// GPU must be in the Default compute mode for that (Exclusive-process
// would let only the MPS server create a context).
//
// Thread safety: none; the coordinator's loop uses it.
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
  // Whether the control daemon accepts connections on its pipe (a connect
  // to its socket; no process is started).
  bool alive() const;
  // A daemon this coordinator started (not one of mps_directory) is started
  // again when it is gone: agents then wait for it and join it afresh.
  // Returns false when it is not ours or could not be started (logged).
  bool restart();

 private:
  MpsDaemon(std::string pipe_dir, std::string control, std::string dir)
      : pipe_dir_(std::move(pipe_dir)), control_(std::move(control)), dir_(std::move(dir)) {}
  std::string pipe_dir_;
  std::string control_, dir_;  // empty: not started here
};

// nvidia-cuda-mps-control on the PATH, if there is one.
std::optional<std::string> find_mps_control();

}  // namespace leasehold
