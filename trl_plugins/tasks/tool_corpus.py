"""The small offline corpus searched by the bundled ``search`` tool (:mod:`trl_plugins.tasks.tools`).

Every place is fictional, so a model cannot answer from memory: the facts have to be looked up. Each document
holds one place and three numeric facts (population, founding year, elevation in metres); the question generator
reads the same records, so every question's answer follows from the corpus.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Place:
    """One corpus record: a fictional town and its facts."""

    name: str
    region: str
    population: int
    founded: int
    elevation: int

    @property
    def doc_id(self) -> str:
        return self.name.lower()

    @property
    def text(self) -> str:
        """The document the search tool returns for this place."""
        return f"{self.name}: population {self.population}, founded {self.founded}, elevation {self.elevation} m."


PLACES: tuple[Place, ...] = (
    Place("Brellin", "the Oska coast", 4120, 1612, 35),
    Place("Tavok", "the Vell highlands", 2875, 1488, 910),
    Place("Quorra", "the Amber plain", 6310, 1703, 120),
    Place("Mirth", "the Oska coast", 980, 1821, 12),
    Place("Selvane", "the Vell highlands", 1544, 1566, 1240),
    Place("Drummel", "the Amber plain", 3302, 1650, 88),
    Place("Hask", "the northern fens", 705, 1902, 4),
    Place("Ilvaro", "the Sable hills", 5088, 1534, 640),
    Place("Pell", "the northern fens", 1210, 1777, 9),
    Place("Corrin", "the Sable hills", 2460, 1599, 455),
    Place("Wenlow", "the Amber plain", 3975, 1689, 140),
    Place("Yarrick", "the Vell highlands", 860, 1845, 1525),
    Place("Ostmere", "the Oska coast", 7240, 1450, 20),
    Place("Fenna", "the northern fens", 1630, 1730, 6),
    Place("Galdor", "the Sable hills", 4410, 1611, 780),
    Place("Rusk", "the Amber plain", 2095, 1798, 101),
)

#: Facts a question can ask about, with the unit word used in questions.
FACTS: dict[str, str] = {"population": "population", "founded": "founding year", "elevation": "elevation in metres"}


def place_by_name(name: str) -> Place:
    for place in PLACES:
        if place.name.lower() == name.lower():
            return place
    raise KeyError(f"no place named {name!r} in the corpus (places: {', '.join(p.name for p in PLACES)})")
