"""The per-load memory of settings that met the SLO (operator/tuning/known_good.py)."""

from iterserve.operator.tuning.knobs import Knobs
from iterserve.operator.tuning.known_good import MAX_LOADS, good_for_returning_load, remember_good

A, B, C = (Knobs(max_num_seqs=8, prefill_chunk_size=c) for c in (64, 128, 256))


def test_a_like_load_replaces_what_was_known_and_an_unlike_one_is_kept_beside_it():
    known = remember_good((), 30, A, 0, 1.5)
    known = remember_good(known, 40, B, 1, 1.5)  # alike (40 / 30 < 1.5): replaces
    known = remember_good(known, 400, C, 2, 1.5)
    assert [(k.mix, k.knobs) for k in known] == [(40, B), (400, C)]


def test_an_unknown_mix_is_not_remembered():
    assert remember_good((), None, A, 0, 1.5) == ()


def test_only_the_latest_loads_are_kept():
    known = ()
    for i in range(MAX_LOADS + 2):
        known = remember_good(known, 2.0 ** (2 * i), A, i, 1.5)
    assert len(known) == MAX_LOADS and known[0].mix == 2.0 ** 4


def test_the_setting_of_a_returning_load_and_none_for_the_load_in_force():
    known = remember_good(remember_good((), 30, A, 0, 1.5), 400, C, 1, 1.5)
    assert good_for_returning_load(known, 35, 1.5) == A  # the chats came back
    assert good_for_returning_load(known, 380, 1.5) is None  # still the documents: their own breach
    assert good_for_returning_load(known, 120, 1.5) is None  # a load never met
    assert good_for_returning_load(known, None, 1.5) is None
    assert good_for_returning_load((), 30, 1.5) is None
