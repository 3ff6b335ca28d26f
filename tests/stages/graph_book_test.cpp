// The decisions of a stage's CUDA graphs (stages/graphs.hpp), device-blind: warm-up, the
// capture step, replays, the fallbacks to eager and the notes said once.
#include <doctest/doctest.h>

#include <torch/torch.h>

#include "stages/graphs.hpp"

using namespace actorpipe;
using namespace actorpipe::stages;
using use = graph_book::use;
using kind = graph_action::kind;

namespace {

std::vector<graph_action> one_f_one_b() {
  return {{kind::forward, 0}, {kind::forward, 1}, {kind::backward, 0}, {kind::backward, 1}};
}

tensor_signature of(int64_t rows) {
  bundle b(torch::zeros({rows, 3}));
  return tensor_signature::of(b);
}

} // namespace

TEST_CASE("graph book: warm-up eager, the next step captures, later steps replay") {
  graph_book book("stage 1", cuda_graph_mode::on, true, 2);
  for (int step = 0; step < 2; ++step) {
    book.begin_step(one_f_one_b());
    CHECK(book.forward(0, of(2)) == use::eager);
    CHECK(book.backward(0) == use::eager);
  }
  book.begin_step(one_f_one_b());
  CHECK(book.forward(0, of(2)) == use::capture);
  book.captured(0, of(2));
  CHECK(book.forward(1, of(2)) == use::capture);
  book.captured(1, of(2));
  CHECK(book.backward(0) == use::capture);
  book.begin_step(one_f_one_b());
  CHECK(book.forward(0, of(2)) == use::replay);
  CHECK(book.backward(0) == use::replay);
  CHECK(book.take_notes().empty());
}

TEST_CASE("graph book: another shape runs eagerly with its backward, said once a shape") {
  graph_book book("stage 0", cuda_graph_mode::on, true, 0);
  book.begin_step(one_f_one_b());
  CHECK(book.forward(0, of(2)) == use::capture);
  book.captured(0, of(2));
  CHECK(book.forward(1, of(2)) == use::capture);
  book.captured(1, of(2));
  for (int step = 0; step < 3; ++step) {
    book.begin_step(one_f_one_b());
    CHECK(book.forward(0, of(2)) == use::replay);
    CHECK(book.forward(1, of(1)) == use::eager);
    CHECK(book.backward(1) == use::eager);
    CHECK(book.backward(0) == use::replay);
  }
  auto notes = book.take_notes();
  REQUIRE(notes.size() == 1);
  CHECK(notes[0] == "stage 0: micro-batch 1 of [1, 3] Float runs eagerly: its graphs are of "
                    "[2, 3] Float");
}

TEST_CASE("graph book: a step of another program runs eagerly, then the captured one replays") {
  graph_book book("stage 0", cuda_graph_mode::on, true, 0);
  book.begin_step(one_f_one_b());
  book.forward(0, of(2));
  book.captured(0, of(2));
  book.begin_step({{kind::forward, 0}, {kind::backward, 0}});
  CHECK(book.forward(0, of(2)) == use::eager);
  CHECK(book.backward(0) == use::eager);
  book.begin_step(one_f_one_b());
  CHECK(book.forward(0, of(2)) == use::replay);
  auto notes = book.take_notes();
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].find("another program (2 actions; the graphs are of one of 4)") !=
        std::string::npos);
}

TEST_CASE("graph book: what keeps a stage eager is said once, with its reason") {
  SUBCASE("a device that captures none, asked for by name; auto is quiet") {
    graph_book on("stage 2", cuda_graph_mode::on, false);
    CHECK(on.is_off());
    auto notes = on.take_notes();
    REQUIRE(notes.size() == 1);
    CHECK(notes[0] == "stage 2 runs without CUDA graphs: its device captures none (CUDA graphs "
                      "are for stages on GPUs)");
    graph_book quiet("stage 2", cuda_graph_mode::automatic, false);
    CHECK(quiet.is_off());
    CHECK(quiet.take_notes().empty());
  }
  SUBCASE("a split backward") {
    graph_book book("stage 0", cuda_graph_mode::on, true, 0);
    book.begin_step({{kind::forward, 0}, {kind::weight, 0}, {kind::weight, 0}});
    CHECK(book.is_off());
    CHECK(book.forward(0, of(2)) == use::eager);
    CHECK(book.take_notes().at(0).find("split backward") != std::string::npos);
  }
  SUBCASE("a failed capture, then nothing more") {
    graph_book book("stage 0", cuda_graph_mode::on, true, 0);
    book.begin_step(one_f_one_b());
    CHECK(book.forward(0, of(2)) == use::capture);
    book.capture_failed(
      "micro-batch 0's forward: operation not permitted when stream is capturing");
    book.turn_off("again");
    CHECK(book.forward(1, of(2)) == use::eager);
    auto notes = book.take_notes();
    REQUIRE(notes.size() == 1);
    CHECK(notes[0].find("its capture failed: micro-batch 0's forward") != std::string::npos);
    book.begin_step(one_f_one_b());
    CHECK(book.forward(0, of(2)) == use::eager);
  }
  SUBCASE("off asks nothing and says nothing") {
    graph_book book("stage 0", cuda_graph_mode::off, true, 0);
    book.begin_step(one_f_one_b());
    CHECK(book.forward(0, of(2)) == use::eager);
    CHECK(book.take_notes().empty());
  }
}

TEST_CASE("graph book: auto captures where the warm-up's eager actions averaged under the rule's "
          "milliseconds, and says which way it chose") {
  graph_book fast("stage 0", cuda_graph_mode::automatic, true, 1);
  fast.begin_step(one_f_one_b());
  fast.observe(0.5);
  fast.observe(1.0);
  fast.begin_step(one_f_one_b());
  CHECK(fast.forward(0, of(2)) == use::capture);
  CHECK(fast.take_notes().at(0) ==
        "stage 0 captures CUDA graphs (auto: its eager actions averaged 0.75 ms on the host, "
        "under 2 ms)");
  graph_book slow("stage 1", cuda_graph_mode::automatic, true, 1);
  slow.begin_step(one_f_one_b());
  slow.observe(5);
  slow.observe(3);
  slow.begin_step(one_f_one_b());
  CHECK(slow.forward(0, of(2)) == use::eager);
  CHECK(slow.is_off());
  CHECK(slow.take_notes().at(0).find("averaged 4 ms on the host over the warm-up, not under 2") !=
        std::string::npos);
}

TEST_CASE("graph book: a capture step that fails before its end is taken again by the next step") {
  graph_book book("stage 0", cuda_graph_mode::on, true, 1);
  book.begin_step(one_f_one_b());
  CHECK_FALSE(book.abandon_capture()); // warm-up: nothing to drop
  book.begin_step(one_f_one_b());
  CHECK(book.forward(0, of(2)) == use::capture);
  book.captured(0, of(2));
  CHECK(book.abandon_capture());
  book.begin_step(one_f_one_b());
  CHECK(book.forward(0, of(2)) == use::capture);
}
