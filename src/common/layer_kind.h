#pragma once
// The layer families as an exhaustive choice: visit_kind(kind, mamba2, gdn) calls the callable
// of `kind`'s family. A new family adds an argument here, and the compiler then names every
// call site that must handle it (a two-way `kind == kMamba2 ? … : …` would silently send the
// new family down the GDN arm).

#include "replayssm/types.h"

namespace replayssm {

template <typename Mamba2, typename Gdn>
decltype(auto) visit_kind(LayerKind kind, Mamba2&& mamba2, Gdn&& gdn) {
  switch (kind) {
    case LayerKind::kMamba2: return mamba2();
    case LayerKind::kGdn: return gdn();
  }
  __builtin_unreachable();  // every LayerKind is a case above
}

}  // namespace replayssm
