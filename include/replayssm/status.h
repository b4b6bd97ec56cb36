#pragma once
/// \file status.h
/// The error type of the public API. No function of the public API throws or aborts: a serving
/// engine must not die on bad input, so every fallible call returns a Status that the caller
/// must look at.

#include <string>
#include <utility>

namespace replayssm {

enum class StatusCode {
  kOk,
  kInvalidArgument,  ///< null pointer, bad shape, bad slot, window too wide, dtype mismatch
  kUnsupported,      ///< a valid request this build or backend does not implement
  kOutOfMemory,      ///< an allocation failed or the cache has no free slot
  kCudaError,        ///< a CUDA runtime call or launch failed
  kIoError,          ///< a file could not be read, written or parsed
  kInternal,         ///< a bug: an invariant of the library itself did not hold
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return {}; }

  [[nodiscard]] bool is_ok() const { return code_ == StatusCode::kOk; }
  [[nodiscard]] StatusCode code() const { return code_; }
  [[nodiscard]] const std::string& message() const { return message_; }
  /// "invalid argument: slot 7 is not allocated" — one line for logs and tools.
  [[nodiscard]] std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status invalid_argument(std::string message) {
  return {StatusCode::kInvalidArgument, std::move(message)};
}
inline Status unsupported(std::string message) {
  return {StatusCode::kUnsupported, std::move(message)};
}

}  // namespace replayssm

/// Returns early from the enclosing function when `expr` yields a non-ok Status.
#define REPLAYSSM_RETURN_IF_ERROR(expr)                 \
  do {                                                  \
    ::replayssm::Status replayssm_status_ = (expr);     \
    if (!replayssm_status_.is_ok()) return replayssm_status_; \
  } while (0)
