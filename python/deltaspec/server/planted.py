"""Bugs the tests plant on purpose to see each of them fail once (DELTASPEC_TEST_SERVER_BUG=NAME in
the server's environment); with the variable unset (always, outside those runs) nothing changes."""

import os

BUGS = ("prompt_tail", "drop_finish", "no_cancel_on_disconnect", "no_validation", "leak_jobs",
        "unbounded_queue", "cancel_on_shutdown", "cross_talk", "spec_ignored",
        "no_holdback", "replica_zero_only", "no_affinity", "cancel_wrong_replica", "logprobs_twice",
        "bias_ignored", "choices_same_seed",
        "echo_dropped", "echo_logprobs_dropped", "first_prompt_only", "tokenize_plain", "embedding_first_row", "infill_suffix_dropped",
        "tool_result_dropped", "billing_stamp_kept", "context_not_cut", "stop_sequence_unnamed",
        "function_output_dropped", "incomplete_as_completed")


def planted(name: str) -> bool:
    assert name in BUGS, name
    return os.environ.get("DELTASPEC_TEST_SERVER_BUG") == name
