"""Open descriptions of synthetic scenes, scored by a hidden rubric: the task no rule in the
policy's sight checks, so a generative reward model (`k25jax.rl.grm`) judges it.

A scene is a 56×56 image with 1–4 shapes (square | circle | triangle, in red | green |
blue | yellow), each in its own quadrant (`visual_synthetic`'s drawing: one merged token of
the vision tower a quadrant). Its description, as the task asks for it:

    "3 objects: red circle top left, blue square top right, yellow triangle bottom right"

The image's facts F: the object count, and per object its colour and its shape at its
quadrant (1 + 2n facts). A description claims a set of facts C: its count prefix, and per
clause `colour shape quadrant` the colour and the shape at that quadrant; a clause that is
not of that form claims one false fact. The hidden rubric (the truth the GRM is measured
against; the policy never sees it):

    rubric = max(0, |C ∩ F| − |C \\ F|) / |F|        (1 for the true description, 0 if unparsable)

`corrupt` makes wrong descriptions of a scene (a colour, a shape or a quadrant changed, an
object left out or made up, the count wrong, or several of these), `guess` the descriptions
of a model that sees where the objects are but not what they are, and `critique` the
judgement a judge should write of any description: the errors in short, then the verdict
`Score: k/10` with k = round(10 · rubric).
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from k25jax.data import visual_synthetic as synthetic

KIND = "describe"
MAX_OBJECTS = 4
QUESTION = "Describe {img}: how many objects, then each one's colour, shape and quadrant."
_PREFIX = re.compile(r"\s*(\d+) objects?\s*:\s*(.*)", re.DOTALL)
_CLAUSE = re.compile(r"({colours}) ({shapes}) ({quadrants})".format(
    colours="|".join(synthetic.COLOURS), shapes="|".join(synthetic.SHAPES), quadrants="|".join(synthetic.QUADRANTS)))


@dataclasses.dataclass(frozen=True)
class SceneObject:
  colour: str
  shape: str
  quadrant: str

  def clause(self) -> str:
    return f"{self.colour} {self.shape} {self.quadrant}"


def describe(objects: tuple[SceneObject, ...], count: int | None = None) -> str:
  """The description's text: `n object(s): clause, clause, ...` (`count` overrides n)."""
  n = len(objects) if count is None else count
  return f"{n} object{'' if n == 1 else 's'}: " + ", ".join(o.clause() for o in objects)


def facts_of(objects: tuple[SceneObject, ...]) -> frozenset:
  """F: the count, and each object's colour and shape at its quadrant."""
  return frozenset([("count", len(objects))] + [("colour", o.quadrant, o.colour) for o in objects]
                   + [("shape", o.quadrant, o.shape) for o in objects])


def claims(description: str | None) -> frozenset | None:
  """C of a description (module docstring), or None when it has no `n objects:` prefix."""
  if description is None:
    return None
  match = _PREFIX.fullmatch(description.strip())
  if match is None:
    return None
  out = {("count", int(match.group(1)))}
  body = match.group(2).strip().rstrip(".")
  for i, clause in enumerate(c.strip() for c in body.split(",") if c.strip()):
    found = _CLAUSE.fullmatch(" ".join(clause.split()))
    if found is None:
      out.add(("unreadable", i, clause))
      continue
    colour, shape, quadrant = found.groups()
    out |= {("colour", quadrant, colour), ("shape", quadrant, shape)}
  return frozenset(out)


def rubric(description: str | None, facts: frozenset) -> float:
  """max(0, |C ∩ F| − |C \\ F|) / |F|; 0 for a description without its count prefix."""
  claimed = claims(description)
  if claimed is None:
    return 0.0
  true = len(claimed & facts)
  return max(0, true - len(claimed - facts)) / len(facts)


@dataclasses.dataclass(frozen=True)
class DescribeTask:
  """Describe one scene. `answer` is the true description; the reward is the rubric (a run
  with a GRM replaces it with the judge's score, `k25jax.rl.grm`)."""

  image_name: str
  image: np.ndarray
  objects: tuple[SceneObject, ...]
  question: str
  kind: str = KIND
  programs: tuple = ()      # no reference tool program: the policy describes what it sees

  @property
  def answer(self) -> str:
    return describe(self.objects)

  @property
  def facts(self) -> frozenset:
    return facts_of(self.objects)

  @property
  def images(self) -> dict[str, np.ndarray]:
    return {self.image_name: self.image}

  def rubric(self, description: str | None) -> float:
    return rubric(description, self.facts)

  def grade(self, description: str | None) -> bool:
    """Every fact of the image and no false one."""
    return self.rubric(description) == 1.0

  def reward(self, description: str | None) -> float:
    return self.rubric(description)


def draw(rng: np.random.Generator) -> tuple[np.ndarray, tuple[SceneObject, ...]]:
  """A scene: uint8 [56, 56, 3] and its objects in quadrant order."""
  image = synthetic.background(rng, (synthetic.SIDE, synthetic.SIDE))
  n = int(rng.integers(1, MAX_OBJECTS + 1))
  objects = []
  for q in sorted(rng.choice(4, size=n, replace=False)):
    shape, colour = synthetic.draw_in_quadrant(image, q, rng)
    objects.append(SceneObject(colour, shape, synthetic.QUADRANTS[q]))
  return image, tuple(objects)


def make_tasks(n: int, seed: int, image_names: tuple[str, ...] = ("img_1", "img_2", "img_3", "img_4")
               ) -> list[DescribeTask]:
  """n scenes to describe, deterministic given seed."""
  rng = np.random.default_rng([seed, 4049])
  out = []
  for _ in range(n):
    image, objects = draw(rng)
    name = image_names[int(rng.integers(len(image_names)))]
    out.append(DescribeTask(name, image, objects, QUESTION.format(img=name)))
  return out


# ------------------------------------------------------------------ corrupted descriptions
def _other(rng: np.random.Generator, options, current: str) -> str:
  return str(rng.choice([o for o in options if o != current]))


def _corrupt_once(rng: np.random.Generator, objects: list[SceneObject], count: int) -> tuple[list, int]:
  """One error in (clauses, count): a colour, shape or quadrant changed, a clause dropped or
  made up, or another count in 1..MAX_OBJECTS + 1."""
  used = {o.quadrant for o in objects}
  free = [q for q in synthetic.QUADRANTS if q not in used]
  kinds = ["count"] + (["colour", "shape", "drop"] if objects else []) + (["add"] if free else []) + (
      ["move"] if objects and free else [])
  kind = str(rng.choice(kinds))
  objects = list(objects)
  if kind == "count":
    count = int(rng.choice([n for n in range(1, MAX_OBJECTS + 2) if n != count]))
  elif kind == "add":
    objects.append(SceneObject(str(rng.choice(list(synthetic.COLOURS))), str(rng.choice(synthetic.SHAPES)),
                               str(rng.choice(free))))
  else:
    i = int(rng.integers(len(objects)))
    o = objects[i]
    if kind == "drop":
      del objects[i]
    else:
      objects[i] = SceneObject(_other(rng, synthetic.COLOURS, o.colour) if kind == "colour" else o.colour,
                               _other(rng, synthetic.SHAPES, o.shape) if kind == "shape" else o.shape,
                               str(rng.choice(free)) if kind == "move" else o.quadrant)
  return objects, count


def corrupt(rng: np.random.Generator, objects: tuple[SceneObject, ...], errors: int) -> str:
  """A description of the scene with `errors` random errors (0: the true one), clauses in
  quadrant order, the count as written (a dropped or made-up clause keeps the old count
  unless an error changes it)."""
  clauses, count = list(objects), len(objects)
  for _ in range(errors):
    clauses, count = _corrupt_once(rng, clauses, count)
  clauses.sort(key=lambda o: synthetic.QUADRANTS.index(o.quadrant))
  return describe(tuple(clauses), count)


def guess(rng: np.random.Generator, objects: tuple[SceneObject, ...], p: float) -> str:
  """The description of a model that sees the layout but not the objects: the true count and
  quadrants, each colour and each shape redrawn (uniformly, so it may stay right) with
  probability p."""
  guessed = tuple(SceneObject(str(rng.choice(list(synthetic.COLOURS))) if rng.random() < p else o.colour,
                              str(rng.choice(synthetic.SHAPES)) if rng.random() < p else o.shape, o.quadrant)
                  for o in objects)
  return describe(guessed)


def score_of(value: float) -> int:
  """The verdict's k of a rubric value: round(10 · rubric), half up."""
  return int(np.floor(10 * value + 0.5))


def critique(description: str | None, objects: tuple[SceneObject, ...]) -> str:
  """The judgement of a description: its errors in short (`wrong: …; missed: …`, or `no
  count`, or `correct`), then `Score: k/10`."""
  facts, claimed = facts_of(objects), claims(description)
  score = score_of(rubric(description, facts))
  if claimed is None:
    return f"no count.\nScore: {score}/10"
  false = claimed - facts
  wrong = [f"count {n}" for kind, n, *_ in false if kind == "count"]
  wrong += ["unreadable clause" for c in false if c[0] == "unreadable"][:1]
  for quadrant in synthetic.QUADRANTS:     # the false words of the clauses at each quadrant
    said = {kind: value for kind, where, value in (c for c in false if c[0] in ("colour", "shape"))
            if where == quadrant}
    if said:
      wrong.append(" ".join([said[k] for k in ("colour", "shape") if k in said] + [quadrant]))
  missed = [o.quadrant for o in objects
            if ("colour", o.quadrant, o.colour) not in claimed and ("shape", o.quadrant, o.shape) not in claimed]
  parts = ([f"wrong: {', '.join(wrong)}"] if wrong else []) + ([f"missed: {', '.join(missed)}"] if missed else [])
  return f"{'; '.join(parts) or 'correct'}.\nScore: {score}/10"
