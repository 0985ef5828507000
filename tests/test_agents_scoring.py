"""k25jax.agents.widesearch.score_table: Item-F1, Row-F1 and success on hand-built tables."""
import pytest

from k25jax.agents.widesearch import score_table, table_rows

GOLD = [{"entity": "E1", "A2": "V3"}, {"entity": "E5", "A2": "V9"}, {"entity": "E7", "A2": "V0"}]
GOLD_2COL = [{"name": "Ada", "born": "1815", "field": "math"},
             {"name": "Alan", "born": "1912", "field": "logic"}]


def test_exact_table_in_any_row_order():
  s = score_table(GOLD[::-1], GOLD)
  assert (s.item_f1, s.row_f1, s.success) == (1.0, 1.0, True)


def test_missing_row_lowers_recall_only():
  s = score_table(GOLD[:2], GOLD)
  assert (s.item_precision, s.item_recall) == (1.0, pytest.approx(2 / 3))
  assert s.item_f1 == pytest.approx(0.8) and s.row_f1 == pytest.approx(0.8) and not s.success


def test_extra_row_lowers_precision_only():
  s = score_table(GOLD + [{"entity": "E9", "A2": "V1"}], GOLD)
  assert (s.item_precision, s.item_recall) == (0.75, 1.0) and not s.success


def test_duplicates_count_once_for_recall_and_extra_for_precision():
  s = score_table(GOLD + [GOLD[0]], GOLD)
  assert (s.item_precision, s.item_recall) == (0.75, 1.0)
  assert (s.row_precision, s.row_recall) == (0.75, 1.0) and not s.success
  conflicting = score_table(GOLD + [{"entity": "E1", "A2": "V4"}], GOLD)
  assert (conflicting.item_precision, conflicting.item_recall) == (0.75, 1.0)


def test_case_and_surrounding_whitespace_are_ignored_inner_spaces_are_not():
  s = score_table([{"entity": " e1 ", "A2": "v3"}, {"entity": "E5", "a2": "V 9"},
                   {"entity": "E7", "A2": "  V0\t"}], GOLD)
  assert s.item_precision == pytest.approx(2 / 3) and s.row_recall == pytest.approx(2 / 3)  # "V 9" != "V9"
  loose = score_table([{"name": " ADA ", "born": "1815 ", "field": "Math"}], GOLD_2COL, key=("name",))
  assert (loose.item_precision, loose.item_recall, loose.row_precision) == (1.0, 0.5, 1.0)
  spaced = score_table([{"name": "Ada  Lovelace", "born": "1815"}], [{"name": "ada lovelace", "born": "1815"}],
                       key=("name",))
  assert spaced.success


def test_multi_column_rows_need_every_cell():
  half_right = [{"name": "Ada", "born": "1815", "field": "logic"}, {"name": "alan", "born": "1912", "field": "logic"}]
  s = score_table(half_right, GOLD_2COL, key=("name",))
  assert s.item_f1 == 0.75 and s.row_f1 == 0.5 and not s.success
  missing_cell = score_table([{"name": "Ada", "born": "1815"}, GOLD_2COL[1]], GOLD_2COL, key=("name",))
  assert (missing_cell.item_precision, missing_cell.item_recall) == (1.0, 0.75)
  assert missing_cell.row_f1 == 0.5


def test_empty_tables():
  empty = score_table([], GOLD)
  assert (empty.item_precision, empty.item_recall, empty.item_f1, empty.success) == (0.0, 0.0, 0.0, False)
  both = score_table([], [])
  assert (both.item_f1, both.row_f1, both.success) == (1.0, 1.0, True)
  assert score_table(GOLD, []).item_f1 == 0.0


def test_gold_with_a_repeated_key_is_rejected():
  with pytest.raises(ValueError, match="repeats"):
    score_table(GOLD, GOLD + [GOLD[0]])


def test_table_rows_renders_index_pairs():
  assert table_rows([(1, 3), (5, 9), (7, 0)], 2) == GOLD
