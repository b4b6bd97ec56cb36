#pragma once
/// \file output_file.h
/// Writing the tools' output files so that a failure (a full disk, a vanished directory, a
/// size limit) never leaves a truncated file behind: the bytes go to a temporary file in the
/// target's directory, which is flushed to disk, closed and then renamed over the target (a
/// rename within one directory is atomic). On any failure the temporary is removed and the
/// target is untouched: absent if it was absent, its old contents if it existed.

#include <cstdint>
#include <span>
#include <string>

#include "replayssm/status.h"

namespace replayssm {

/// Writes `bytes` to `path` as described above; kIoError (naming the path and the reason)
/// on failure.
Status output_file_write(const std::string& path, std::span<const std::uint8_t> bytes);

/// Checks before a long run that `path` can be written later: it is not a directory and its
/// directory takes a new file (a temporary one is created there and removed). Leaves nothing
/// behind; an existing file at `path` is not touched.
Status output_file_check(const std::string& path);

}  // namespace replayssm
