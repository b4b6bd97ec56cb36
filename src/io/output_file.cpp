// Output files through a temporary file and a rename (output_file.h). POSIX calls, because the
// C++ streams cannot fsync, and a write error that only shows at fsync or close (a full disk
// on some filesystems) must still count as a failed write.

#include "io/output_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

namespace replayssm {

namespace {

Status io_error(const std::string& what, const std::string& path, int error) {
  return {StatusCode::kIoError, what + " '" + path + "': " + std::strerror(error)};
}

// A fresh temporary file beside `path` (same directory, so the final rename stays within one
// filesystem), named ".<name>.XXXXXX" so that a crash leaves a hidden file that is easy to
// recognise. Returns its descriptor (-1 and errno on failure) and its name in *temp.
int create_temporary(const std::string& path, std::string* temp) {
  const std::filesystem::path target(path);
  const std::filesystem::path dir = target.has_parent_path() ? target.parent_path() : ".";
  std::string name = ".";  // appended, not "." + ...: GCC 12 warns (-Wrestrict) on that form
  name += target.filename().string();
  name += ".XXXXXX";
  const std::string pattern = (dir / name).string();
  std::vector<char> chars(pattern.begin(), pattern.end());
  chars.push_back('\0');
  const int fd = mkstemp(chars.data());
  if (fd < 0) return -1;
  // mkstemp creates the file 0600; an output file gets the usual 0666 less the umask.
  const mode_t mask = umask(0);
  umask(mask);
  (void)fchmod(fd, 0666 & ~mask);
  *temp = chars.data();
  return fd;
}

bool write_all(int fd, std::span<const std::uint8_t> bytes) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = EIO;
      return false;
    }
    done += static_cast<std::size_t>(n);
  }
  return true;
}

Status refuse_directory(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return {StatusCode::kIoError, "cannot write '" + path + "': it is a directory"};
  }
  return Status::ok();
}

}  // namespace

Status output_file_write(const std::string& path, std::span<const std::uint8_t> bytes) {
  REPLAYSSM_RETURN_IF_ERROR(refuse_directory(path));
  std::string temp;
  const int fd = create_temporary(path, &temp);
  if (fd < 0) return io_error("cannot create", path, errno);
  const bool written = write_all(fd, bytes) && ::fsync(fd) == 0;
  const int write_errno = errno;
  const bool closed = ::close(fd) == 0;
  const int close_errno = errno;
  if (!written || !closed) {
    std::remove(temp.c_str());
    return io_error("cannot write", path, written ? close_errno : write_errno);
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    const int rename_errno = errno;
    std::remove(temp.c_str());
    return io_error("cannot write", path, rename_errno);
  }
  return Status::ok();
}

Status output_file_check(const std::string& path) {
  REPLAYSSM_RETURN_IF_ERROR(refuse_directory(path));
  std::string temp;
  const int fd = create_temporary(path, &temp);
  if (fd < 0) return io_error("cannot create", path, errno);
  ::close(fd);
  std::remove(temp.c_str());
  return Status::ok();
}

}  // namespace replayssm
