/// \file
/// TLS between schedulers and nodes: control through CAF's OpenSSL module, tensor frames through
/// actorpipe's own TLS connections, both with the same certificates (docs/distributed.md).
/// The identity, tls_options, is vocabulary (<actorpipe/options.hpp>); this header is kept so
/// that code which included it for tls_options still builds.
#pragma once

#include <actorpipe/options.hpp>
