#include "comm/replica_failures.hpp"

#include <algorithm>
#include <vector>

namespace actorpipe::comm {

int64_t failure_watch::announced() const {
  if (!store_) {
    return -1;
  }
  try {
    return store_->add(key_, 0);
  } catch (const std::exception&) {
    return -1;
  }
}

void failure_watch::start() {
  seen_ = std::max<int64_t>(0, announced());
  started_ = true;
}

std::string failure_watch::last() const {
  try {
    auto bytes = store_->get(key_ + "/last");
    return std::string(bytes.begin(), bytes.end());
  } catch (const std::exception&) {
    return "its reason was not recorded";
  }
}

bool failure_watch::announce(c10d::Store& store, const std::string& key, const std::string& why) {
  if (why.find(abandoned_because) != std::string::npos) {
    return true; // a failure that repeats one announced already
  }
  try {
    // The reason first, then the count that waiting stages look at.
    store.set(key + "/last", std::vector<uint8_t>(why.begin(), why.end()));
    store.add(key, 1);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

} // namespace actorpipe::comm
