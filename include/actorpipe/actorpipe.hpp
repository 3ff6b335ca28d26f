/// \file
/// Everything an embedding application needs: every public header of actorpipe.
#pragma once

#include <actorpipe/actions.hpp>
#include <actorpipe/batch_norm.hpp>
#include <actorpipe/data.hpp>
#include <actorpipe/errors.hpp>
#include <actorpipe/images.hpp>
#include <actorpipe/layers.hpp>
#include <actorpipe/logging.hpp>
#include <actorpipe/losses.hpp>
#include <actorpipe/memory.hpp>
#include <actorpipe/models.hpp>
#include <actorpipe/node.hpp>
#include <actorpipe/optimizers.hpp>
#include <actorpipe/options.hpp>
#include <actorpipe/partition.hpp>
#include <actorpipe/pipeline.hpp>
#include <actorpipe/planner.hpp>
#include <actorpipe/profile.hpp>
#include <actorpipe/replicas.hpp>
#include <actorpipe/results.hpp>
#include <actorpipe/schedule.hpp>
#include <actorpipe/tls.hpp>
#include <actorpipe/torchscript.hpp>
#include <actorpipe/trace.hpp>
#include <actorpipe/training.hpp>
