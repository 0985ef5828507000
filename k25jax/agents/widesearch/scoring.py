"""Scoring of a predicted table (`score_table`, WideSearch metrics): Item-F1 over cells
matched on the key column (entity), Row-F1 over whole rows, success = exact table.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Iterable, Mapping, Sequence

from k25jax.agents import dsl


def normalize(cell) -> str:
  """A cell's comparable rendering: str(), whitespace runs collapsed and stripped, casefolded."""
  return " ".join(str(cell).split()).casefold()


def table_rows(pairs: Iterable[tuple[int, int]], attribute: int) -> list[dict[str, str]]:
  """(entity, value) index pairs → rows {"entity": "E5", "A2": "V3"} for `score_table`."""
  column = dsl.ATTRIBUTE.name(attribute)
  return [{"entity": dsl.ENTITY.name(e), column: dsl.VALUE.name(v)} for e, v in pairs]


@dataclasses.dataclass(frozen=True)
class TableScore:
  """WideSearch metrics of one predicted table against its gold table."""

  item_precision: float
  item_recall: float
  item_f1: float
  row_precision: float
  row_recall: float
  row_f1: float
  success: bool


def _f1(matched: int, predicted: int, gold: int) -> tuple[float, float, float]:
  """Precision, recall, F1 of `matched` out of `predicted` and `gold` items.
  Precision of an empty prediction is 1 only against an empty gold; recall of an empty gold is 1."""
  precision = matched / predicted if predicted else float(gold == 0)
  recall = matched / gold if gold else 1.0
  f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
  return precision, recall, f1


def score_table(predicted: Iterable[Mapping[str, object]], gold: Iterable[Mapping[str, object]],
                key: Sequence[str] = ("entity",)) -> TableScore:
  """Item-F1, Row-F1 and success of a predicted table (rows: column → cell).

  Rows are aligned on the `key` columns; every other column of a row is a cell. All keys,
  column names and cells compare after `normalize` (case- and whitespace-insensitive).
  * Item: each gold cell (key, column, value) can be matched by ONE predicted cell.
    precision = matched / predicted cells, recall = matched / gold cells. A duplicated
    predicted row therefore counts once for recall and its copy counts against precision
    (so do conflicting duplicates); a missing row lowers recall, an extra row precision.
  * Row: a predicted row matches a gold row when its key and all its cells equal the gold
    row's (same columns); each gold row matches once. precision/recall as for items.
  * success: every predicted row matches and every gold row is matched (the exact table).
  Gold keys must be unique (ValueError otherwise).
  """
  key = tuple(key)

  def split(row):
    row_key = tuple(normalize(row.get(k, "")) for k in key)
    cells = frozenset((normalize(c), normalize(v)) for c, v in row.items() if c not in key)
    return row_key, cells

  predicted_rows = [split(r) for r in predicted]
  gold_rows = [split(r) for r in gold]
  if len({k for k, _ in gold_rows}) != len(gold_rows):
    raise ValueError("the gold table repeats a key")
  count = lambda items: collections.Counter(items)
  item = lambda rows: count((k, c, v) for k, cells in rows for c, v in cells)
  predicted_items, gold_items = item(predicted_rows), item(gold_rows)
  matched_items = sum((predicted_items & gold_items).values())
  matched_rows = sum((count(predicted_rows) & count(gold_rows)).values())
  item_p, item_r, item_f = _f1(matched_items, sum(predicted_items.values()), sum(gold_items.values()))
  row_p, row_r, row_f = _f1(matched_rows, len(predicted_rows), len(gold_rows))
  success = matched_rows == len(predicted_rows) == len(gold_rows)
  return TableScore(item_p, item_r, item_f, row_p, row_r, row_f, success)
