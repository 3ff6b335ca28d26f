# cmake -DBUILD_DIR=... -P check_protocols.cmake: code using the typed stage and scheduler
# protocols as they are builds; each file that sends what a protocol does not take, expects a
# reply of another type, or passes a narrower handle fails to compile, for that reason.
include(${CMAKE_CURRENT_LIST_DIR}/build_checks.cmake)

expect_build(protocol_typed "code using the protocols as they are")
expect_build_failure(protocol_wrong_message "receiver does not accept given message")
expect_build_failure(protocol_wrong_reply "wrong functor signature")
expect_build_failure(protocol_peer_is_not_a_stage "Cannot assign incompatible handle")
