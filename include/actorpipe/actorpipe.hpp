/// \file
/// Everything an embedding application needs.
#pragma once

#include <actorpipe/batch_norm.hpp>
#include <actorpipe/errors.hpp>
#include <actorpipe/layers.hpp>
#include <actorpipe/logging.hpp>
#include <actorpipe/models.hpp>
#include <actorpipe/node.hpp>
#include <actorpipe/partition.hpp>
#include <actorpipe/pipeline.hpp>
#include <actorpipe/replicas.hpp>
#include <actorpipe/schedule.hpp>
