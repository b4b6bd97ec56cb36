#include "replayssm/version.h"

namespace replayssm {

const char* version() { return REPLAYSSM_VERSION; }

}  // namespace replayssm
