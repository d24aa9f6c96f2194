"""The ShapesEval world: vocabulary, prompt specs, and prompt generation with splits.

A prompt is a :class:`ShapeSpec`: a GenEval category, a list of object groups
``(count, colour | None, shape)`` and, for the ``position`` category, a relation
``objects[0] <relation> objects[1]``. The spec travels on the wire as
``PromptSpec.metadata`` (:meth:`ShapeSpec.to_metadata`, plain JSON types); the detector
reads the metadata, never the text.

Splits are by composition (see ``docs/shapes_eval.md``): the held-out split holds
prompts whose compositions no training prompt contains.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
PLURALS: dict[str, str] = {"circle": "circles", "square": "squares", "triangle": "triangles"}

# Six hues 60 degrees apart, darkened so that every one stands clear of the light
# background; the detector's blend model needs the lines background -> colour to be far
# apart (the closest pair, green / cyan, stays > 60 units apart at half coverage).
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "yellow": (235, 205, 20),
    "green": (30, 170, 50),
    "cyan": (20, 190, 220),
    "blue": (30, 60, 220),
    "purple": (170, 40, 210),
}
COLOURS: tuple[str, ...] = tuple(PALETTE)
BACKGROUND: tuple[int, int, int] = (240, 240, 240)

RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
NUMBER_WORDS: dict[int, str] = {1: "one", 2: "two", 3: "three", 4: "four"}
COUNTS: tuple[int, ...] = (2, 3, 4)  # the counting category; 1 is single_object

CATEGORIES: tuple[str, ...] = (
    "single_object",
    "two_object",
    "counting",
    "colors",
    "position",
    "color_attr",
)

# Held-out compositions. Each colour loses exactly one shape and each shape two colours,
# so every word still appears in training, only these bindings never do.
HELDOUT_COLOUR_SHAPE: frozenset[tuple[str, str]] = frozenset(
    {
        ("red", "triangle"),
        ("yellow", "circle"),
        ("green", "square"),
        ("cyan", "triangle"),
        ("blue", "circle"),
        ("purple", "square"),
    }
)
HELDOUT_COUNT_SHAPE: frozenset[tuple[int, str]] = frozenset(
    {(2, "triangle"), (3, "square"), (4, "circle")}
)
HELDOUT_SHAPE_PAIRS: frozenset[frozenset[str]] = frozenset({frozenset({"circle", "triangle"})})

METADATA_VERSION = 1
Split = Literal["train", "heldout"]


class ShapeSpecError(ValueError):
    """A ShapesEval spec or its metadata is malformed; the message names the problem."""


@dataclass(frozen=True, slots=True)
class ShapeObject:
    """``count`` objects of one ``shape``; ``colour`` None means any palette colour."""

    count: int
    colour: str | None
    shape: str

    def phrase(self) -> str:
        """``"a red circle"``, ``"two squares"``."""
        adjective = f"{self.colour} " if self.colour else ""
        if self.count == 1:
            return f"a {adjective}{self.shape}"
        return f"{NUMBER_WORDS[self.count]} {adjective}{PLURALS[self.shape]}"


@dataclass(frozen=True, slots=True)
class ShapeSpec:
    """One ShapesEval prompt. ``relation`` reads ``objects[0] <relation> objects[1]``."""

    category: str
    objects: tuple[ShapeObject, ...]
    relation: str | None = None

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def text(self) -> str:
        """GenEval-style prompt: ``"a photo of a yellow square left of a blue circle"``."""
        if self.relation is not None:
            first, second = self.objects
            return f"a photo of {first.phrase()} {self.relation} {second.phrase()}"
        return "a photo of " + " and ".join(o.phrase() for o in self.objects)

    def to_metadata(self) -> dict[str, Any]:
        """Plain JSON types, as carried in ``PromptSpec.metadata``."""
        return {
            "shapes_eval": METADATA_VERSION,
            "category": self.category,
            "objects": [
                {"count": o.count, "colour": o.colour, "shape": o.shape} for o in self.objects
            ],
            "relation": self.relation,
        }

    @classmethod
    def from_metadata(cls, metadata: Any) -> ShapeSpec:
        """Inverse of :meth:`to_metadata`; :class:`ShapeSpecError` on anything malformed."""
        if not isinstance(metadata, dict):
            raise ShapeSpecError(f"metadata must be a dict, got {type(metadata).__name__}")
        if metadata.get("shapes_eval") != METADATA_VERSION:
            raise ShapeSpecError(
                f"metadata field 'shapes_eval' must be {METADATA_VERSION}, "
                f"got {metadata.get('shapes_eval')!r}"
            )
        raw_objects = metadata.get("objects")
        if not isinstance(raw_objects, list) or not raw_objects:
            raise ShapeSpecError("metadata field 'objects' must be a non-empty list")
        objects = []
        for i, raw in enumerate(raw_objects):
            if not isinstance(raw, dict) or set(raw) != {"count", "colour", "shape"}:
                raise ShapeSpecError(
                    f"objects[{i}] must be a dict with keys count, colour, shape; got {raw!r}"
                )
            count = raw["count"]
            if isinstance(count, bool) or not isinstance(count, int):
                raise ShapeSpecError(f"objects[{i}].count must be an int, got {count!r}")
            objects.append(ShapeObject(count=count, colour=raw["colour"], shape=raw["shape"]))
        return cls(
            category=metadata.get("category"),  # type: ignore[arg-type]  # validated below
            objects=tuple(objects),
            relation=metadata.get("relation"),
        )

    @classmethod
    def from_text(cls, text: str) -> ShapeSpec:
        """Parse a prompt written by :attr:`text` back into its spec (the category follows
        from the grammar); for callers that only have the text. :class:`ShapeSpecError` if
        ``text`` is not a ShapesEval prompt."""
        if not isinstance(text, str) or not text.startswith(_PREFIX):
            raise ShapeSpecError(f"not a ShapesEval prompt: {text!r}")
        body = text[len(_PREFIX) :]
        relation = next((r for r in RELATIONS if f" {r} " in body), None)
        parts = body.split(f" {relation} " if relation else " and ")
        objects = tuple(_parse_phrase(p, text) for p in parts)
        coloured = [o.colour is not None for o in objects]
        if relation is not None:
            category = "position"
        elif len(objects) == 2:
            if any(coloured) and not all(coloured):
                raise ShapeSpecError(f"either both objects have a colour or neither: {text!r}")
            category = "color_attr" if all(coloured) else "two_object"
        elif objects[0].count > 1:
            category = "counting"
        else:
            category = "colors" if coloured[0] else "single_object"
        return cls(category=category, objects=objects, relation=relation)


_PREFIX = "a photo of "
_COUNT_WORDS = {"a": 1, **{word: n for n, word in NUMBER_WORDS.items() if n > 1}}
_SINGULARS = {plural: shape for shape, plural in PLURALS.items()}


def _parse_phrase(phrase: str, text: str) -> ShapeObject:
    words = phrase.split(" ")
    if len(words) not in (2, 3) or words[0] not in _COUNT_WORDS:
        raise ShapeSpecError(f"cannot read {phrase!r} in {text!r}")
    count = _COUNT_WORDS[words[0]]
    colour = words[1] if len(words) == 3 else None
    noun = words[-1]
    shape = noun if count == 1 else _SINGULARS.get(noun)
    if shape is None or (count == 1 and noun not in SHAPES):
        raise ShapeSpecError(f"cannot read the shape {noun!r} in {text!r}")
    return ShapeObject(count=count, colour=colour, shape=shape)


def _validate(spec: ShapeSpec) -> None:
    if spec.category not in CATEGORIES:
        raise ShapeSpecError(f"unknown category {spec.category!r}; known: {', '.join(CATEGORIES)}")
    for i, o in enumerate(spec.objects):
        if not isinstance(o.shape, str) or o.shape not in SHAPES:
            raise ShapeSpecError(f"objects[{i}]: unknown shape {o.shape!r}; known: {SHAPES}")
        if o.colour is not None and (not isinstance(o.colour, str) or o.colour not in PALETTE):
            raise ShapeSpecError(f"objects[{i}]: unknown colour {o.colour!r}; known: {COLOURS}")
        if o.count not in NUMBER_WORDS:
            raise ShapeSpecError(f"objects[{i}]: count must be 1-4, got {o.count!r}")
    shapes = [o.shape for o in spec.objects]
    if len(set(shapes)) != len(shapes):
        # The detector assigns detected objects to groups by shape.
        raise ShapeSpecError(f"object groups must have distinct shapes, got {shapes}")
    expected_groups = {"single_object": 1, "colors": 1, "counting": 1}.get(spec.category, 2)
    if len(spec.objects) != expected_groups:
        raise ShapeSpecError(
            f"category {spec.category} needs {expected_groups} object group(s), "
            f"got {len(spec.objects)}"
        )
    if spec.category == "position":
        if spec.relation not in RELATIONS:
            raise ShapeSpecError(f"position needs a relation in {RELATIONS}, got {spec.relation!r}")
        if any(o.count != 1 for o in spec.objects):
            raise ShapeSpecError("position objects must have count 1")
    elif spec.relation is not None:
        raise ShapeSpecError(f"category {spec.category} takes no relation, got {spec.relation!r}")


# --------------------------------------------------------------------------- enumeration


def _one(shape: str, colour: str | None = None, count: int = 1) -> ShapeObject:
    return ShapeObject(count=count, colour=colour, shape=shape)


def all_specs(category: str) -> list[ShapeSpec]:
    """Every prompt of ``category``, in a fixed order (the world is finite: 936 prompts)."""
    ordered_shape_pairs = list(itertools.permutations(SHAPES, 2))
    ordered_colour_pairs = list(itertools.permutations(COLOURS, 2))
    if category == "single_object":
        return [ShapeSpec(category, (_one(s),)) for s in SHAPES]
    if category == "two_object":
        return [ShapeSpec(category, (_one(a), _one(b))) for a, b in ordered_shape_pairs]
    if category == "counting":
        return [ShapeSpec(category, (_one(s, count=n),)) for n in COUNTS for s in SHAPES]
    if category == "colors":
        return [ShapeSpec(category, (_one(s, c),)) for c in COLOURS for s in SHAPES]
    if category in ("position", "color_attr"):
        relations: tuple[str | None, ...] = RELATIONS if category == "position" else (None,)
        return [
            ShapeSpec(category, (_one(sa, ca), _one(sb, cb)), relation)
            for sa, sb in ordered_shape_pairs
            for ca, cb in ordered_colour_pairs
            for relation in relations
        ]
    raise ShapeSpecError(f"unknown category {category!r}; known: {', '.join(CATEGORIES)}")


def split_of(spec: ShapeSpec) -> Split:
    """``"heldout"`` if the spec contains a held-out composition, else ``"train"``.

    single_object has no composition to hold out (three prompts), so it is always
    ``"train"``; :func:`specs_in_split` serves it to both splits.
    """
    for o in spec.objects:
        if o.colour is not None and (o.colour, o.shape) in HELDOUT_COLOUR_SHAPE:
            return "heldout"
        if spec.category == "counting" and (o.count, o.shape) in HELDOUT_COUNT_SHAPE:
            return "heldout"
    shapes = frozenset(o.shape for o in spec.objects)
    if spec.category == "two_object" and shapes in HELDOUT_SHAPE_PAIRS:
        return "heldout"
    return "train"


def specs_in_split(category: str, split: Split) -> list[ShapeSpec]:
    """The prompts of ``category`` in ``split`` (single_object: the same three in both)."""
    if split not in ("train", "heldout"):
        raise ShapeSpecError(f"split must be 'train' or 'heldout', got {split!r}")
    specs = all_specs(category)
    if category == "single_object":
        return specs
    return [s for s in specs if split_of(s) == split]


def generate_prompts(
    n: int,
    split: Split,
    *,
    seed: int = 0,
    categories: tuple[str, ...] = CATEGORIES,
) -> list[ShapeSpec]:
    """``n`` prompts of ``split``, balanced over ``categories``, deterministic in ``seed``.

    Category ``i`` gets ``n // len(categories)`` prompts (the first ``n % len`` one more);
    within a category, prompts are drawn uniformly with replacement; the list is shuffled.
    """
    if n < 0:
        raise ShapeSpecError(f"n must be >= 0, got {n}")
    if not categories:
        raise ShapeSpecError("categories must not be empty")
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    out: list[ShapeSpec] = []
    for i, category in enumerate(categories):
        pool = specs_in_split(category, split)
        k = n // len(categories) + (1 if i < n % len(categories) else 0)
        out.extend(pool[j] for j in rng.integers(0, len(pool), size=k))
    order = rng.permutation(len(out))
    return [out[j] for j in order]
