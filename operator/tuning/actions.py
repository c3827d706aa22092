"""The tuner's actions (the `action` of a decision, in status, Events and metrics), the p99 each cure aims
at, and the knob each move turns and which way."""

HOLD = "hold"
CLAMP = "clamp_to_bounds"
RAISE_SEQS = "raise_max_num_seqs"
BACK_OFF_SEQS = "back_off_max_num_seqs"
LOWER_CHUNK = "lower_prefill_chunk_size"
RAISE_CHUNK = "raise_prefill_chunk_size"
ROLLBACK = "rollback"

# the p99 a move brings down when it is made as a cure
AIMS = {RAISE_SEQS: "ttft", RAISE_CHUNK: "ttft", LOWER_CHUNK: "itl", BACK_OFF_SEQS: "itl"}

# the knob each move turns and which way; a setting that failed blocks the settings beyond it that way
DIRECTIONS = {RAISE_SEQS: ("max_num_seqs", 1), BACK_OFF_SEQS: ("max_num_seqs", -1),
              RAISE_CHUNK: ("prefill_chunk_size", 1), LOWER_CHUNK: ("prefill_chunk_size", -1)}
