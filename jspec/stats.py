"""SpecStats: what a generation did — steps by kind, drafted/accepted tokens, timing, why it stopped."""

from __future__ import annotations

import dataclasses

STOP_REASONS = ("running", "eos", "max_new_tokens", "cache_end")


@dataclasses.dataclass
class SpecStats:
    """Statistics of one generation.

    mean_accepted: tokens committed per verify step, the bonus token included (1.0 = nothing accepted).
    acceptance_rate: accepted / drafted over verify steps. per_position_acceptance[i]: among verify steps whose
    draft had a valid token i and whose tokens 0..i-1 were accepted (per_position_reached[i] of them), the fraction
    where token i was accepted; None where no verify step reached position i.
    near_tie_rejections: rejected draft tokens within TieGuard.eps of the row max (diagnostic).
    gate_engaged: steps on which the gate allowed a verify (None without a gate).
    exact: False only when a tolerant TieGuard accepted a non-argmax token (then output may differ from greedy).
    loop: "host" (prefill, decode and verify calls timed apart), "device" (one call: only the wall is timed) or
      "batch" (a slot of `Engine.generate_batch`: the wall from its prefill to its stop).
    sampler: the Sampler's fields (None: greedy).
    """

    steps: int = 0
    decode_steps: int = 0
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    per_position_acceptance: list[float | None] = dataclasses.field(default_factory=list)
    per_position_reached: list[int] = dataclasses.field(default_factory=list)
    near_tie_rejections: int = 0
    tolerated_near_ties: int = 0
    gate_engaged: int | None = None
    would_hits: int = 0
    new_tokens: int = 0
    prompt_tokens: int = 0
    stop_reason: str = "running"
    exact: bool = True
    wall_time_s: float = 0.0
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    verify_time_s: float = 0.0
    loop: str = "host"
    sampler: dict | None = None

    @property
    def mean_accepted(self) -> float:
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(mean_accepted=self.mean_accepted, acceptance_rate=self.acceptance_rate, tokens_per_s=self.tokens_per_s)
        return d

    def summary(self) -> str:
        lines = [
            f"new tokens {self.new_tokens} in {self.wall_time_s:.3f} s ({self.tokens_per_s:.1f} tok/s), "
            f"stop: {self.stop_reason}{'' if self.exact else '  [INEXACT: tolerant TieGuard]'}",
        ]
        if self.loop in ("device", "batch"):
            how = (
                "on device: prefill and the rounds ran in one call"
                if self.loop == "device"
                else "in a batch: its steps ran with the other slots'"
            )
            lines.append(
                f"steps {self.steps}: decode {self.decode_steps}, verify {self.verify_steps} ({how}, timed only as a "
                "whole)"
            )
        else:
            lines.append(
                f"steps {self.steps}: decode {self.decode_steps} ({self.decode_time_s:.3f} s), "
                f"verify {self.verify_steps} ({self.verify_time_s:.3f} s), prefill {self.prefill_time_s:.3f} s"
            )
        if self.verify_steps:
            per_pos = " ".join("-" if a is None else f"{a:.2f}" for a in self.per_position_acceptance)
            lines.append(
                f"drafted {self.drafted}, accepted {self.accepted}, mean_accepted {self.mean_accepted:.2f}, "
                f"acceptance {self.acceptance_rate:.2f}, per position [{per_pos}]"
            )
        if self.sampler is not None:
            lines.append("sampled: " + ", ".join(f"{k}={v}" for k, v in self.sampler.items()))
        if self.gate_engaged is not None:
            lines.append(f"gate engaged on {self.gate_engaged} steps, would-hits {self.would_hits}")
        if self.near_tie_rejections or self.tolerated_near_ties:
            lines.append(f"near-tie rejections {self.near_tie_rejections}, tolerated {self.tolerated_near_ties}")
        return "\n".join(lines)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Number of leading tokens two token lists share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclasses.dataclass
class BatchStats:
    """Statistics of one `Engine.generate_batch`: sequences and slots, new tokens of all sequences, the wall time
    (prefills included; prefill_time_s: the prefills alone, each timed to completion), batch rounds run and running
    slots summed over them. slot_occupancy: the fraction of slot-rounds that held a running sequence."""

    sequences: int = 0
    batch_size: int = 0
    new_tokens: int = 0
    wall_time_s: float = 0.0
    prefill_time_s: float = 0.0
    rounds: int = 0
    slot_rounds: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def slot_occupancy(self) -> float:
        return self.slot_rounds / (self.rounds * self.batch_size) if self.rounds else 0.0

    def summary(self) -> str:
        return (
            f"{self.sequences} sequences in {self.batch_size} slots: {self.new_tokens} new tokens in "
            f"{self.wall_time_s:.3f} s ({self.tokens_per_s:.1f} tok/s), {self.rounds} rounds, slot occupancy "
            f"{100 * self.slot_occupancy:.0f}%"
        )
