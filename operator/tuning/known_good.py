"""The tuner's memory of what worked: per load mix (prompt tokens per request), the last setting that met
the SLO without trouble.

A load that comes back (the chats after a burst of documents, the day's traffic after the night's batch
jobs) calls for the setting that served it before. Stepping back there one knob at a time costs a
cooldown and often a confirmation per step; jumping there costs one. `last_good` in the tuner's state is
the rollback point for the load in force; this keeps one per unlike load, as `FailedSetting` keeps what
made things worse per load.
"""

from __future__ import annotations

from dataclasses import dataclass

from iterserve.operator.tuning.failures import same_mix
from iterserve.operator.tuning.knobs import Knobs

MAX_LOADS = 8  # loads remembered; the oldest is forgotten first


@dataclass(frozen=True)
class KnownGood:
    mix: float  # prompt tokens per request of the load it met the SLO under
    knobs: Knobs
    time: float  # when it last met the SLO


def remember_good(known: tuple[KnownGood, ...], mix: float | None, knobs: Knobs, now: float,
                  mix_factor: float) -> tuple[KnownGood, ...]:
    """`knobs` met the SLO under a load of `mix`: it replaces what was known for a like load."""
    if mix is None:
        return known
    kept = tuple(k for k in known if not same_mix(k.mix, mix, mix_factor))
    return (kept + (KnownGood(mix, knobs, now),))[-MAX_LOADS:]


def good_for_returning_load(known: tuple[KnownGood, ...], mix: float | None, mix_factor: float) -> Knobs | None:
    """The setting that last met the SLO under a load like `mix`, when the SLO was last met under another
    load: the load changed back. None when no like load met it, or when the load has not changed since the
    SLO was last met: then the breach is this load's own (heavier traffic), and the setting that served it
    lighter is no cure."""
    if mix is None or not known:
        return None
    if same_mix(max(known, key=lambda k: k.time).mix, mix, mix_factor):
        return None
    alike = [k for k in known if same_mix(k.mix, mix, mix_factor)]
    return min(alike, key=lambda k: abs(k.mix - mix) / max(k.mix, mix, 1.0)).knobs if alike else None
