"""`Knobs`: the three live scheduler knobs as the operator handles them, in the server's snake_case and
the CR status' camelCase."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from iterserve.common import wire

CAMEL = wire.KNOB_CAMEL


@dataclass(frozen=True, order=True)
class Knobs:
    max_num_seqs: int = wire.KNOB_DEFAULTS["max_num_seqs"]
    max_num_batched_tokens: int = wire.KNOB_DEFAULTS["max_num_batched_tokens"]
    prefill_chunk_size: int = wire.KNOB_DEFAULTS["prefill_chunk_size"]

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name}: must be an integer >= 1, got {value!r}")

    def as_dict(self) -> dict[str, int]:
        """snake_case, as PATCH /admin/scheduler takes them."""
        return dataclasses.asdict(self)

    def as_camel(self) -> dict[str, int]:
        """camelCase, as the LLMService spec and status spell them."""
        return {CAMEL[k]: v for k, v in self.as_dict().items()}

    def replace(self, **changes: int) -> Knobs:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        return (f"max_num_seqs={self.max_num_seqs}, prefill_chunk_size={self.prefill_chunk_size}, "
                f"max_num_batched_tokens={self.max_num_batched_tokens}")

    @classmethod
    def from_dict(cls, values: dict[str, int]) -> Knobs:
        """From snake_case or camelCase keys (unknown keys are an error, missing ones take the defaults)."""
        snake = {v: k for k, v in CAMEL.items()}
        out = {}
        for key, value in values.items():
            name = key if key in CAMEL else snake.get(key)
            if name is None:
                raise ValueError(f"{key}: not a scheduler knob (expected one of {', '.join(CAMEL)})")
            out[name] = value
        return cls(**out)
