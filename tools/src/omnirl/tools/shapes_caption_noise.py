"""Caption noise for ShapesEval pretraining: images that do not quite match their captions.

Web captions leave objects out, miscount, misplace and mis-colour. A text-to-image model
pretrained on them learns to draw every object well but follows its prompt unreliably,
which is the state GenEval measures and RL repairs (SD3.5-M draws clean objects yet fails
counts and positions). A model pretrained on exact captions but stopped early fails
differently: its shapes are ragged, which only more pretraining fixes.

:func:`mislabel` returns the spec an image is drawn from while its caption stays the
original ``spec.text``, so captions remain train-split texts (held-out compositions are
never named in pretraining); one kind of error per image, drawn uniformly from those that
fit the category:

==============  ==================================================================
extra           one object more than the caption says (the caption left it out)
missing         one of two named objects is not drawn
miscount        counting: one more or one fewer (within 1-4)
relation        position: the pair is placed by another relation
colour          one object in another palette colour; with two coloured objects,
                their colours swapped (a binding error)
==============  ==================================================================
"""

from __future__ import annotations

import dataclasses

import numpy as np

from omnirl.reward.shapes import ShapeSpec
from omnirl.reward.shapes.world import COLOURS, RELATIONS, SHAPES, ShapeObject

ERROR_KINDS: dict[str, tuple[str, ...]] = {
    "single_object": ("extra",),
    "two_object": ("extra", "missing"),
    "counting": ("miscount",),
    "colors": ("extra", "colour"),
    "position": ("relation", "colour", "missing"),
    "color_attr": ("extra", "colour", "missing"),
}


def _pick(rng: np.random.Generator, options) -> object:
    options = list(options)
    return options[int(rng.integers(len(options)))]


ALL_KINDS: tuple[str, ...] = ("extra", "missing", "miscount", "relation", "colour")


def check_kinds(kinds: tuple[str, ...]) -> tuple[str, ...]:
    """``kinds`` if every one is an error kind and there is at least one, else ``ValueError``."""
    unknown = sorted(set(kinds) - set(ALL_KINDS))
    if unknown or not kinds:
        raise ValueError(
            f"caption error kinds must be a non-empty subset of {list(ALL_KINDS)}, got "
            f"{list(kinds)}"
        )
    return tuple(kinds)


def mislabel(
    spec: ShapeSpec, rng: np.random.Generator, kinds: tuple[str, ...] = ALL_KINDS
) -> tuple[ShapeSpec, str]:
    """``(drawn_spec, kind)``: a spec that differs from ``spec`` by one caption error, of a
    kind in ``kinds`` that fits the category; ``(spec, "none")`` if none fits."""
    options = [k for k in ERROR_KINDS[spec.category] if k in kinds]
    if not options:
        return spec, "none"
    kind = _pick(rng, options)
    objects = spec.objects
    if kind == "miscount":
        (o,) = objects
        counts = [n for n in (o.count - 1, o.count + 1) if 1 <= n <= 4]
        drawn = dataclasses.replace(o, count=_pick(rng, counts))
        return dataclasses.replace(spec, objects=(drawn,)), kind
    if kind == "extra":
        if len(objects) == 1:  # a second object of another shape (coloured if the first is)
            o = objects[0]
            colour = _pick(rng, COLOURS) if o.colour is not None else None
            other = ShapeObject(1, colour, _pick(rng, (s for s in SHAPES if s != o.shape)))
            category = "color_attr" if o.colour is not None else "two_object"
            return ShapeSpec(category, (o, other)), kind
        g = int(rng.integers(len(objects)))  # one group drawn twice
        grown = tuple(
            dataclasses.replace(o, count=o.count + 1) if i == g else o
            for i, o in enumerate(objects)
        )
        return dataclasses.replace(spec, objects=grown), kind
    if kind == "missing":
        o = objects[int(rng.integers(len(objects)))]  # two-object categories: count 1
        category = "colors" if o.colour is not None else "single_object"
        return ShapeSpec(category, (o,)), kind
    if kind == "relation":
        relation = _pick(rng, (r for r in RELATIONS if r != spec.relation))
        return dataclasses.replace(spec, relation=relation), kind
    if kind == "colour":
        if len(objects) == 2:  # position / color_attr: the two colours always differ
            a, b = objects
            swapped = (
                dataclasses.replace(a, colour=b.colour),
                dataclasses.replace(b, colour=a.colour),
            )
            return dataclasses.replace(spec, objects=swapped), kind
        g = int(rng.integers(len(objects)))
        o = objects[g]
        recoloured = dataclasses.replace(
            o, colour=_pick(rng, (c for c in COLOURS if c != o.colour))
        )
        drawn = tuple(recoloured if i == g else x for i, x in enumerate(objects))
        return dataclasses.replace(spec, objects=drawn), kind
    raise AssertionError(kind)


def drawn_specs(
    specs: list[ShapeSpec],
    rate: float,
    rng: np.random.Generator,
    kinds: tuple[str, ...] = ALL_KINDS,
) -> list[ShapeSpec]:
    """The specs to render for captions ``specs``: each one mislabelled with probability
    ``rate`` (0: the captions exactly) by an error of one of ``kinds``."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"caption noise rate must be in [0, 1], got {rate}")
    kinds = check_kinds(kinds)
    if rate == 0.0:
        return list(specs)
    noisy = rng.random(len(specs)) < rate
    return [mislabel(s, rng, kinds)[0] if n else s for s, n in zip(specs, noisy, strict=True)]
