// The client's exit statuses, one table for every command (README,
// docs/operating.md "Exit codes"; tests/client_exit_codes_test.cpp holds
// each). `leasehold run` exits with its program's own status instead once
// the program ran.
#pragma once

namespace leasehold::client {

enum ExitCode : int {
  kExitOk = 0,         // done; a followed job succeeded
  kExitJobFailed = 1,  // a followed job failed
  kExitInvalid = 2,    // bad command line, unreadable or invalid job file, unknown job id,
                       // a request the coordinator refused as invalid
  kExitCancelled = 3,  // a followed job was cancelled
  kExitUnreachable = 4,  // no coordinator at the endpoint, or it failed to answer
  kExitDenied = 5,       // the coordinator refused: this user may not do that
};

}  // namespace leasehold::client
