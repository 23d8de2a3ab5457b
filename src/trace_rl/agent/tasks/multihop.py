"""`multihop`: a synthetic world of entities and relations, its passage corpus, and 1-4 hop questions.

The world (people, cities, countries, companies, universities, rivers) is drawn from a seed. Every entity
has one or two passages stating its relations in plain sentences, always naming the subject in full
("Karlsson Ltd was founded by Maria Berg."), plus sentences that mention other entities ("Notable people
born in Dornburg include ..."). A question follows a chain of functional relations from a named start
entity: "In which country is the city where the founder of Karlsson Ltd was born?" is
founded_by -> born_in -> in_country, three hops, answered by searching each entity in turn.

Difficulty spreads along several axes, all recorded in `Task.meta`:
  - `hops` 1-4 (balanced; `max_hops` keeps the shorter ones);
  - `distractors`: how many entities the agent must look up have a confusable twin ("Karlsson Ltd" /
    "Karlsen Ltd", "Dornburg" / "New Dornburg"), whose passage may say "not to be confused with ...";
  - `split_passages`: how many of those entities spread their facts over two passages;
  - `answer_type`: an entity name or an attribute (year, length, currency).

Splits: one world per seed; its question pool is split train/test by a hash of the question text
(`test_fraction`, default 0.2), so the splits hold disjoint questions over the same world and corpus.

The oracle (`multihop_oracle`) solves a task through the search tool: it searches the start entity,
reads the relation's object out of the returned text with the sentence patterns below (never from the
gold chain), searches that object, and so on, then answers.
"""

from __future__ import annotations

import functools
import hashlib
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from trace_rl.agent.types import Passage, Task, TaskSet, ToolCall

# --------------------------------------------------------------------------------------------------
# Relations: how a fact is written, asked and searched for
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Relation:
    """A functional relation: every subject has at most one object (an entity or an attribute value)."""

    name: str
    subject: str
    """Entity kind of the subject."""
    object: str | None
    """Entity kind of the object; None for an attribute (year, length, currency)."""
    sentences: tuple[str, ...]
    """How a passage states the fact; {s} and {o} are the subject's and object's mentions."""
    phrase: str
    """Noun phrase for the object inside a longer question, around the subject's description {d}."""
    question: str
    """The question when this relation is the last hop."""
    keywords: str
    """Words the oracle adds to its second search for this fact."""


RELATIONS: dict[str, Relation] = {
    r.name: r
    for r in [
        Relation("born_in", "person", "city",
                 ("{s} was born in {o}.", "{s} is a native of {o}."),
                 "the city where {d} was born", "What is the birthplace of {d}?", "born native"),
        Relation("birth_year", "person", None,
                 ("{s} was born in the year {o}.", "The birth year of {s} is {o}."),
                 "", "What is the birth year of {d}?", "born year birth"),
        Relation("studied_at", "person", "university",
                 ("{s} studied at {o}.", "{s} is a graduate of {o}."),
                 "the university {d} attended", "Which university did {d} attend?", "studied graduate"),
        Relation("works_for", "person", "company",
                 ("{s} works for {o}.", "{s} is employed by {o}."),
                 "the company {d} works for", "Which company does {d} work for?", "works employed"),
        Relation("mentor", "person", "person",
                 ("{s} was mentored by {o}.", "{s} trained under {o}."),
                 "the mentor of {d}", "Who was the mentor of {d}?", "mentored trained"),
        Relation("founded_by", "company", "person",
                 ("{s} was founded by {o}.", "{o} founded {s}."),
                 "the founder of {d}", "Who founded {d}?", "founded founder"),
        Relation("headquartered_in", "company", "city",
                 ("{s} is headquartered in {o}.", "The headquarters of {s} are in {o}."),
                 "the city where {d} is headquartered", "In which city is {d} headquartered?",
                 "headquartered headquarters"),
        Relation("founded_year", "company", None,
                 ("{s} was founded in the year {o}.", "{s} has existed since {o}."),
                 "", "In what year was {d} founded?", "founded year existed"),
        Relation("located_in", "university", "city",
                 ("{s} is located in {o}.", "{s} has its campus in {o}."),
                 "the city where {d} is located", "In which city is {d} located?", "located campus"),
        Relation("established_year", "university", None,
                 ("{s} was established in {o}.",),
                 "", "In what year was {d} established?", "established"),
        Relation("in_country", "city", "country",
                 ("{s} is a city in {o}.", "{s} lies in {o}."),
                 "the country containing {d}", "In which country is {d}?", "city lies"),
        Relation("on_river", "city", "river",
                 ("{s} lies on {o}.", "{o} flows through {s}."),
                 "the river that flows through {d}", "Which river flows through {d}?", "river flows lies"),
        Relation("mayor", "city", "person",
                 ("The mayor of {s} is {o}.", "{o} serves as mayor of {s}."),
                 "the mayor of {d}", "Who is the mayor of {d}?", "mayor"),
        Relation("capital", "country", "city",
                 ("The capital of {s} is {o}.", "{o} is the capital of {s}."),
                 "the capital of {d}", "What is the capital of {d}?", "capital"),
        Relation("leader", "country", "person",
                 ("{s} is led by {o}.", "The head of state of {s} is {o}."),
                 "the leader of {d}", "Who leads {d}?", "led head state"),
        Relation("currency", "country", None,
                 ("The currency of {s} is the {o}.",),
                 "", "What is the currency of {d}?", "currency"),
        Relation("rises_in", "river", "country",
                 ("{s} rises in {o}.", "The source of {s} is in {o}."),
                 "the country where {d} rises", "In which country does {d} rise?", "rises source"),
        Relation("length_km", "river", None,
                 ("{s} is {o} kilometres long.",),
                 "", "How long is {d}, in kilometres?", "kilometres long"),
    ]
}

# --------------------------------------------------------------------------------------------------
# Reading facts back out of text (the oracle's only source of intermediate entities)
# --------------------------------------------------------------------------------------------------

# A subject or object written first in its sentence must start the sentence: right after the start of
# the text, a sentence end, or the closing bracket/quote/colon/bar of whatever header the search tool
# renders. That keeps "Ana Berg was born in" from matching inside "Lana Berg was born in" and list
# sentences ("... include Ana Berg, Nils Karlsen and ...") from reading as facts.
_START = r'(?:^|(?<=[.!?)\]:|"\n\t])|(?<=[.!?)\]:|"\n\t] ))'
_NAME = r'(?:[Tt]he )?(?P<o>[A-Z][^.,;:()\[\]|"\n]*?)'
_VALUE = r'(?P<o>[^.,;:()\[\]|"\n]+?)'


@functools.lru_cache(maxsize=8192)
def _fact_patterns(relation: Relation, subject: str) -> tuple[re.Pattern[str], ...]:
    """Regexes that read `relation`'s object for `subject` from any sentence template (compiled once)."""
    subject_re = r"(?:[Tt]he )?" + re.escape(subject)
    object_re = _NAME if relation.object is not None else _VALUE
    patterns = []
    for template in relation.sentences:
        parts = re.split(r"(\{s\}|\{o\})", template)
        regex = ""
        for index, part in enumerate(parts):
            if part == "{s}":
                regex += (_START if index == 1 and parts[0] == "" else "") + subject_re
            elif part == "{o}":
                regex += (_START if index == 1 and parts[0] == "" else "") + object_re
            elif part:
                literal = re.escape(part)
                if not regex and part[0].isalpha():  # sentence-initial word: either case
                    literal = f"[{part[0].upper()}{part[0].lower()}]" + re.escape(part[1:])
                    regex += _START
                regex += literal
        patterns.append(re.compile(regex, re.MULTILINE))
    return tuple(patterns)


def read_fact(text: str, subject: str, relation: str) -> str | None:
    """The object of `relation` for `subject` as stated in `text`, or None when no sentence states it."""
    for pattern in _fact_patterns(RELATIONS[relation], subject):
        match = pattern.search(text)
        if match:
            return match.group("o").strip()
    return None


# --------------------------------------------------------------------------------------------------
# The world
# --------------------------------------------------------------------------------------------------


@dataclass
class WorldConfig:
    """How big the world is and how confusing its names are."""

    people: int = 150
    """People in the world (at least 2, as for every kind of entity)."""
    companies: int = 60
    """Companies in the world."""
    cities: int = 48
    """Cities in the world (at least `countries`)."""
    countries: int = 12
    """Countries in the world."""
    universities: int = 20
    """Universities in the world."""
    rivers: int = 16
    """Rivers in the world."""
    twin_fraction: float = 0.3
    """Share of people, companies, cities and universities that come as a pair of confusable names."""
    split_fraction: float = 0.35
    """Share of entities with four or more sentences whose facts are spread over two passages."""

    def __post_init__(self) -> None:
        for name in ("people", "companies", "cities", "countries", "universities", "rivers"):
            if getattr(self, name) < 2:
                raise ValueError(f"multihop world needs {name} >= 2, got {getattr(self, name)!r}")
        if self.cities < self.countries:
            raise ValueError(f"multihop world needs cities >= countries, got {self.cities} < {self.countries}")
        for name in ("twin_fraction", "split_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"multihop {name} must be in [0, 1], got {getattr(self, name)!r}")


@dataclass
class Entity:
    name: str
    kind: str
    facts: dict[str, str] = field(default_factory=dict)
    twin: str | None = None
    passages: int = 1

    @property
    def mention(self) -> str:
        """How text refers to the entity: rivers take the article ("the Vessa River")."""
        return f"the {self.name}" if self.kind == "river" else self.name

    @property
    def aliases(self) -> tuple[str, ...]:
        if self.kind == "river":
            return (self.name, self.name.removesuffix(" River"))
        return (self.name,)


@dataclass
class World:
    entities: dict[str, Entity]
    passages: list[Passage]

    def by_kind(self, kind: str) -> list[Entity]:
        return [e for e in self.entities.values() if e.kind == kind]


_ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "h", "k", "kr", "l", "m", "n", "p", "r", "s", "st", "t",
           "tr", "v", "w", "z", "sk", "th"]
_VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o"]
_CODAS = ["", "", "", "n", "r", "l", "s", "m", "nd", "rn", "st", "k"]
_FIRST_NAMES = ["Anna", "Maria", "Elena", "Sofia", "Clara", "Ida", "Nora", "Lena", "Mira", "Vera", "Alma",
                "Greta", "Hanna", "Iris", "Julia", "Lea", "Olga", "Rosa", "Tilda", "Yara", "Adam", "Anton",
                "Bruno", "Carl", "David", "Emil", "Felix", "Hugo", "Ivan", "Jonas", "Karl", "Leo", "Magnus",
                "Nils", "Oscar", "Paul", "Rafael", "Simon", "Tomas", "Viktor", "Erik", "Axel", "Otto",
                "Ruben", "Samuel", "Milan", "Edith", "Frida", "Helga", "Ines"]
_SURNAME_SUFFIXES = {"sson": "sen", "sen": "sson", "berg": "bergh", "strom": "strand", "ley": "leigh",
                     "wood": "ward", "ford": "forth", "ski": "sky", "ton": "tone", "mann": "man", "ez": "es",
                     "ard": "art"}
_CITY_SUFFIXES = {"burg": "berg", "ton": "town", "vik": "wick", "holm": "heim", "ford": "forth",
                  "stad": "stead", "haven": "hafen", "mouth": "mund", "field": "feld", "grad": "gorod",
                  "mere": "mar"}
_COUNTRY_SUFFIXES = ["ia", "land", "ova", "ania", "istan", "ria", "mark"]
_COMPANY_KINDS = ["Ltd", "Group", "Corp", "Industries", "Holdings", "Systems", "Works", "Labs"]
_CURRENCIES = ["crown", "mark", "florin", "dinar", "thaler", "lira", "shilling", "peso", "rand", "dollar"]
_OCCUPATIONS = ["engineer", "painter", "economist", "chemist", "architect", "novelist", "surgeon",
                "composer", "historian", "physicist", "banker", "botanist", "sculptor", "lawyer"]
_INDUSTRIES = ["shipping", "software", "mining", "textile", "pharmaceutical", "railway", "publishing",
               "brewing", "aerospace", "insurance", "timber", "glassmaking"]
_CITY_TRAITS = ["its old harbour", "a medieval cathedral", "its spring fair", "a busy railway junction",
                "its glassworks", "a famous botanical garden", "its stone bridges", "an annual film festival"]
# bm25s's English stopwords: a name part that is one of them ("The University") would be invisible
# to search, and "The" would clash with the article rivers take.
_STOPWORDS = frozenset("a an and are as at be but by for if in into is it no not of on or such that the "
                       "their then there these they this to was will with".split())
_SECTION = {"person": "career", "company": "history", "city": "geography", "country": "politics",
            "university": "history", "river": "course"}


class _Names:
    """Unique, pronounceable names; a `variant` differs from its original in one search token."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()
        self.stems: set[str] = set()
        self.adjectives: dict[str, str] = {}

    def _stem(self) -> str:
        rng = self.rng
        while True:
            stem = rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(["", "", "n", "r", "l", "s"])
            if rng.random() < 0.75:
                stem += rng.choice("bdgklmnprstvz") + rng.choice(_VOWELS) + rng.choice(_CODAS)
            if 3 <= len(stem) <= 8 and stem not in self.stems and stem not in _STOPWORDS:
                self.stems.add(stem)
                return stem.capitalize()

    def _claim(self, name: str) -> bool:
        if name in self.used:
            return False
        self.used.add(name)
        return True

    def fresh(self, kind: str) -> str:
        while True:
            stem, rng = self._stem(), self.rng
            if kind == "person":
                name = f"{rng.choice(_FIRST_NAMES)} {stem}{rng.choice(list(_SURNAME_SUFFIXES))}"
            elif kind == "company":
                name = f"{stem}{rng.choice(['', *_SURNAME_SUFFIXES])} {rng.choice(_COMPANY_KINDS)}"
            elif kind == "city":
                name = stem + rng.choice(list(_CITY_SUFFIXES))
            elif kind == "country":
                name = stem + rng.choice(_COUNTRY_SUFFIXES)
                self.adjectives[name] = stem.rstrip("aeiou") + "ian"
            elif kind == "river":
                name = f"{stem} River"
            elif kind == "university":
                name = rng.choice([f"{stem} University", f"{stem} Institute of Technology", f"{stem} College"])
            else:
                raise ValueError(f"unknown entity kind {kind!r}")
            if self._claim(name):
                return name

    def variant(self, name: str, kind: str) -> str | None:
        """A confusable twin name, or None when no unused one was found."""
        words = name.split(" ")
        index = {"person": 1, "company": 0, "university": 0}.get(kind, 0)
        for _ in range(20):
            word, rng = words[index], self.rng
            swaps = _CITY_SUFFIXES if kind == "city" else _SURNAME_SUFFIXES
            endings = [end for end in swaps if word.endswith(end)]
            choice = rng.random()
            if kind == "city" and choice < 0.3:
                candidate = f"{rng.choice(['New', 'Port', 'Upper'])} {name}"
            elif endings and choice < 0.7:
                end = max(endings, key=len)
                candidate_words = list(words)
                candidate_words[index] = word[: -len(end)] + swaps[end]
                candidate = " ".join(candidate_words)
            else:  # change one vowel of the word
                spots = [i for i, ch in enumerate(word) if ch in "aeiou"]
                if not spots:
                    return None
                spot = rng.choice(spots)
                new_word = word[:spot] + rng.choice([v for v in "aeiou" if v != word[spot]]) + word[spot + 1 :]
                candidate_words = list(words)
                candidate_words[index] = new_word
                candidate = " ".join(candidate_words)
            changed = candidate.split(" ")[index].lower()
            if candidate != name and changed not in _STOPWORDS and self._claim(candidate):
                return candidate
        return None


def _make_entities(rng: random.Random, names: _Names, kind: str, count: int, twin_fraction: float) -> list[Entity]:
    entities: list[Entity] = []
    while len(entities) < count:
        entity = Entity(names.fresh(kind), kind)
        entities.append(entity)
        if len(entities) < count and rng.random() < twin_fraction / (2 - twin_fraction):
            twin_name = names.variant(entity.name, kind)
            if twin_name is not None:
                entity.twin = twin_name
                entities.append(Entity(twin_name, kind, twin=entity.name))
    return entities


def build_world(seed: int, config: WorldConfig | None = None) -> World:
    """The entities, their facts and the passage corpus, fully determined by `seed` and `config`."""
    config = config or WorldConfig()
    rng = random.Random(f"multihop-world-{seed}")
    names = _Names(rng)
    countries = _make_entities(rng, names, "country", config.countries, 0.0)
    cities = _make_entities(rng, names, "city", config.cities, config.twin_fraction)
    rivers = _make_entities(rng, names, "river", config.rivers, 0.0)
    universities = _make_entities(rng, names, "university", config.universities, config.twin_fraction)
    companies = _make_entities(rng, names, "company", config.companies, config.twin_fraction)
    people = _make_entities(rng, names, "person", config.people, config.twin_fraction)

    # Cities spread over countries (every country gets at least one), each country's capital is one of
    # its own cities.
    for index, city in enumerate(cities):
        country = countries[index % len(countries)] if index < len(countries) else rng.choice(countries)
        city.facts["in_country"] = country.name
        if rng.random() < 0.6:
            city.facts["on_river"] = rng.choice(rivers).name
        if rng.random() < 0.5:
            city.facts["mayor"] = rng.choice(people).name
    for country in countries:
        own = [c for c in cities if c.facts["in_country"] == country.name]
        country.facts["capital"] = rng.choice(own).name
        country.facts["leader"] = rng.choice(people).name
        country.facts["currency"] = f"{names.adjectives[country.name]} {rng.choice(_CURRENCIES)}"
    for river in rivers:
        river.facts["rises_in"] = rng.choice(countries).name
        river.facts["length_km"] = str(rng.randint(40, 3200))
    for university in universities:
        university.facts["located_in"] = rng.choice(cities).name
        university.facts["established_year"] = str(rng.randint(1350, 1990))
    birth_year = {p.name: rng.randint(1890, 1995) for p in people}
    for person in people:
        person.facts["born_in"] = rng.choice(cities).name
        person.facts["birth_year"] = str(birth_year[person.name])
        if rng.random() < 0.8:
            person.facts["studied_at"] = rng.choice(universities).name
        if rng.random() < 0.8:
            person.facts["works_for"] = rng.choice(companies).name
        elders = [p for p in people if birth_year[p.name] < birth_year[person.name] - 10]
        if elders and rng.random() < 0.5:
            person.facts["mentor"] = rng.choice(elders).name
    for company in companies:
        founder = rng.choice(people)
        company.facts["founded_by"] = founder.name
        company.facts["headquartered_in"] = rng.choice(cities).name
        company.facts["founded_year"] = str(min(2020, birth_year[founder.name] + rng.randint(20, 50)))

    entities = {e.name: e for group in (countries, cities, rivers, universities, companies, people) for e in group}
    passages = _write_passages(rng, entities, seed, config.split_fraction)
    return World(entities, passages)


def _sentence(template: str, subject: Entity, obj: str) -> str:
    text = template.format(s=subject.mention, o=obj)
    return text[0].upper() + text[1:]


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _write_passages(rng: random.Random, entities: dict[str, Entity], seed: int, split_fraction: float) -> list[Passage]:
    # Who mentions whom: list sentences in the object's passage ("Notable people born in X include ...").
    mentions: dict[tuple[str, str], list[str]] = {}
    for entity in entities.values():
        for relation, obj in entity.facts.items():
            if RELATIONS[relation].object is not None:
                mentions.setdefault((obj, relation), []).append(entity.mention)
    list_sentences = {
        "born_in": "Notable people born in {o} include {names}.",
        "headquartered_in": "Companies based in {o} include {names}.",
        "in_country": "Cities in {o} include {names}.",
        "works_for": "Employees of {o} include {names}.",
        "studied_at": "Alumni of {o} include {names}.",
        "located_in": "Universities in {o} include {names}.",
        "on_river": "Towns along {o} include {names}.",
    }

    passages: list[Passage] = []
    for entity in entities.values():
        intro = {
            "person": f"{entity.name} is a {rng.choice(_OCCUPATIONS)}.",
            "company": f"{entity.name} is a {rng.choice(_INDUSTRIES)} company.",
            "city": f"{entity.name} is known for {rng.choice(_CITY_TRAITS)}.",
            "country": f"{entity.name} is a sovereign state.",
            "university": f"{entity.name} is a public research university.",
            "river": f"The {entity.name} is a river.",
        }[entity.kind]
        facts = [_sentence(rng.choice(RELATIONS[r].sentences), entity, _mention(entities, r, o))
                 for r, o in entity.facts.items()]
        extra = []
        for relation, template in list_sentences.items():
            names = mentions.get((entity.name, relation), [])
            if names:
                picked = rng.sample(names, min(4, len(names)))
                extra.append(_sentence(template.replace("{o}", "{s}").replace("{names}", _join(picked)), entity, ""))
        if entity.twin is not None and rng.random() < 0.5:
            extra.append(f"{_sentence('{s}', entity, '')} is not to be confused with {entities[entity.twin].mention}.")
        body = facts + extra
        rng.shuffle(body)
        doc_base = f"mh{seed}-{len(passages):05d}"
        if len(body) >= 4 and rng.random() < split_fraction:
            cut = len(body) // 2
            entity.passages = 2
            passages.append(Passage(doc_base, entity.name, " ".join([intro, *body[:cut]])))
            passages.append(Passage(doc_base + "b", f"{entity.name} ({_SECTION[entity.kind]})", " ".join(body[cut:])))
        else:
            passages.append(Passage(doc_base, entity.name, " ".join([intro, *body])))
    return passages


def _mention(entities: dict[str, Entity], relation: str, obj: str) -> str:
    return entities[obj].mention if RELATIONS[relation].object is not None else obj


# --------------------------------------------------------------------------------------------------
# Questions
# --------------------------------------------------------------------------------------------------


def _chain(world: World, hops: int, rng: random.Random) -> tuple[list[str], list[str]] | None:
    """A random walk of `hops` relations over distinct entities: (entity names, relation names)."""
    current = rng.choice(list(world.entities.values()))
    chain, relations = [current.name], []
    for hop in range(hops):
        last = hop == hops - 1
        options = [r for r, obj in current.facts.items()
                   if (RELATIONS[r].object is None and last) or (RELATIONS[r].object is not None and obj not in chain)]
        if not options:
            return None
        relation = rng.choice(sorted(options))
        relations.append(relation)
        chain.append(current.facts[relation])
        if RELATIONS[relation].object is not None:
            current = world.entities[current.facts[relation]]
    return chain, relations


def question_text(start_mention: str, relations: Sequence[str]) -> str:
    description = start_mention
    for relation in relations[:-1]:
        description = RELATIONS[relation].phrase.format(d=description)
    return RELATIONS[relations[-1]].question.format(d=description)


def _in_test(question: str, test_fraction: float) -> bool:
    digest = hashlib.sha256(question.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < test_fraction


def generate_questions(world: World, num_questions: int, seed: int, max_hops: int = 4) -> list[Task]:
    """`num_questions` distinct questions, hops cycling 1, 2, ..., `max_hops`, in a seeded random order
    (with the default 4, the same questions as before `max_hops` existed)."""
    rng = random.Random(f"multihop-questions-{seed}")
    seen: set[str] = set()
    tasks: list[Task] = []
    attempts = 0
    while len(tasks) < num_questions:
        attempts += 1
        if attempts > 200 * num_questions:
            raise ValueError(f"multihop: could only make {len(tasks)} distinct questions of {num_questions}; "
                             "make the world bigger or ask for fewer")
        hops = len(tasks) % max_hops + 1
        walk = _chain(world, hops, rng)
        if walk is None:
            continue
        chain, relations = walk
        start = world.entities[chain[0]]
        question = question_text(start.mention, relations)
        if question in seen:
            continue
        seen.add(question)
        final = RELATIONS[relations[-1]]
        if final.object is not None:
            answers = world.entities[chain[-1]].aliases
            answer_type = final.object
        elif relations[-1] == "length_km":
            answers = (chain[-1], f"{chain[-1]} km", f"{chain[-1]} kilometres", f"{chain[-1]} kilometers")
            answer_type = "length"
        else:
            answers = (chain[-1],)
            answer_type = "currency" if relations[-1] == "currency" else "year"
        looked_up = [world.entities[name] for name in chain[:-1]]
        tasks.append(Task(
            task_id=f"multihop-s{seed}-{len(tasks):05d}",
            question=question,
            answers=answers,
            source="multihop",
            tools=("search",),
            scorer="exact_match",
            corpus=f"multihop-s{seed}",
            meta={
                "hops": hops,
                "start": start.name,
                "relations": list(relations),
                "chain": list(chain),
                "answer_type": answer_type,
                "distractors": sum(e.twin is not None for e in looked_up),
                "split_passages": sum(e.passages > 1 for e in looked_up),
            },
        ))
    return tasks


# --------------------------------------------------------------------------------------------------
# Oracle
# --------------------------------------------------------------------------------------------------

_GIVE_UP = "unknown"


def _queries(entity: str, relation: str) -> list[str]:
    keywords = RELATIONS[relation].keywords
    return [entity, f"{entity} {keywords}", f"{keywords} {entity} {entity}"]


def _progress(task: Task, history: Sequence[tuple[ToolCall, str]]) -> tuple[int, str, str, int]:
    """(hops done, current entity, the entity before it, failed searches for the next hop)."""
    relations: list[str] = task.meta["relations"]
    current = previous = task.meta["start"]
    hop, tries = 0, 0
    for call, observation in history:
        if call.name != "search" or hop == len(relations):
            continue
        found = read_fact(observation, current, relations[hop])
        if found is None:
            tries += 1
        else:
            previous, current, hop, tries = current, found, hop + 1, 0
    return hop, current, previous, tries


def multihop_oracle(task: Task, history: Sequence[tuple[ToolCall, str]]) -> ToolCall:
    """Solve a multihop task through the search tool, reading each bridge entity from the results.

    Uses only the question's parse (`meta['start']`, `meta['relations']`) and the observations: for each
    hop it searches the current entity (then again with the relation's keywords), reads the object with
    `read_fact`, and moves on; after the last hop it answers. If three searches for one hop find nothing
    it answers "unknown" (a visible failure, scored 0).
    """
    relations: list[str] = task.meta["relations"]
    hop, current, _, tries = _progress(task, history)
    if hop == len(relations):
        return ToolCall("answer", {"answer": current})
    queries = _queries(current, relations[hop])
    if tries >= len(queries):
        return ToolCall("answer", {"answer": _GIVE_UP})
    return ToolCall("search", {"query": queries[tries]})


def multihop_rationale(task: Task, history: Sequence[tuple[ToolCall, str]]) -> str:
    """The fact the oracle's next action completes, cut before its object: "Ana Berg studied at".

    Stated in the first of the relation's sentence forms, so the policy learns to name the fact it
    read and then copy its object, which is where a small model otherwise fails; "" before the first
    search (the start entity is in the question).
    """
    hop, _, previous, _ = _progress(task, history)
    if hop == 0:
        return ""
    sentence = RELATIONS[task.meta["relations"][hop - 1]].sentences[0]
    return sentence.split("{o}")[0].replace("{s}", previous).strip()


# --------------------------------------------------------------------------------------------------
# Loader
# --------------------------------------------------------------------------------------------------


def load(
    *,
    split: str = "train",
    num_tasks: int | None = None,
    seed: int = 0,
    num_questions: int = 2000,
    test_fraction: float = 0.2,
    max_hops: int = 4,
    **world_options: float,
) -> TaskSet:
    """The `multihop` task set: `split` ('train' or 'test') of a `num_questions` pool over one world.

    `world_options` are `WorldConfig` fields (people=, companies=, cities=, countries=, universities=,
    rivers=, twin_fraction=, split_fraction=). `num_tasks` takes the first tasks of the split (the pool
    is in seeded random order with hops balanced); asking for more than the split holds raises.
    `max_hops` (1-4) keeps questions of at most that many hops, balanced: 2 for a pretrained model
    the size of SmolLM2-135M, which after its warm start solved 34% of 1-hop questions, 3% of 2-hop
    ones and none longer (docs/results/smollm2_paper). The default world holds about 2,000 distinct
    questions of 1-2 hops, so ask for fewer (`num_questions: 1600`).
    """
    if split not in ("train", "test"):
        raise ValueError(f"multihop split must be 'train' or 'test', got {split!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"multihop test_fraction must be in (0, 1), got {test_fraction!r}")
    if max_hops not in (1, 2, 3, 4):
        raise ValueError(f"multihop max_hops must be 1, 2, 3 or 4, got {max_hops!r}")
    unknown = set(world_options) - set(WorldConfig.__dataclass_fields__)
    if unknown:
        raise TypeError(f"multihop: unknown options {sorted(unknown)}; known: num_questions, test_fraction, max_hops, "
                        f"{', '.join(WorldConfig.__dataclass_fields__)}")
    config = WorldConfig(**world_options)  # type: ignore[arg-type]
    world = build_world(seed, config)
    pool = generate_questions(world, num_questions, seed, max_hops)
    tasks = [t for t in pool if _in_test(t.question, test_fraction) == (split == "test")]
    if num_tasks is not None:
        if num_tasks > len(tasks):
            raise ValueError(f"multihop {split} split holds {len(tasks)} tasks, asked for {num_tasks}; "
                             f"raise num_questions (now {num_questions})")
        tasks = tasks[:num_tasks]
    kinds = {}
    for entity in world.entities.values():
        kinds[entity.kind] = kinds.get(entity.kind, 0) + 1
    return TaskSet(
        name="multihop",
        tasks=tasks,
        corpus=world.passages,
        oracle=multihop_oracle,
        rationale=multihop_rationale,
        meta={
            "split": split,
            "seed": seed,
            "entities": kinds,
            "twins": sum(e.twin is not None for e in world.entities.values()),
            "passages": len(world.passages),
            "pool_size": len(pool),
        },
    )
