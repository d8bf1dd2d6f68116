"""BABILong (Kuratov et al. 2024, arXiv 2406.10149): bAbI's QA1-QA5 facts scattered through long text.

The stories are generated here from the definitions of bAbI's first five tasks (Weston et al. 2015,
arXiv 1502.05698), with bAbI's people, rooms and objects:

- qa1, single supporting fact: people move between rooms. "Where is Mary?" -> her latest room.
- qa2, two supporting facts: people also pick up and put down objects. "Where is the football?" ->
  the room of whoever holds it, or the room where it was put down.
- qa3, three supporting facts: "Where was the apple before the kitchen?" -> the room the apple was
  in just before someone carried it into the kitchen (asked only where that is one room).
- qa4, two-argument relations: two facts such as "The office is north of the kitchen." "What is
  north of the kitchen?" or "What is the office north of?" -> one room.
- qa5, three-argument relations: people also give objects to one another ("Fred gave the milk to
  Bill."). "Who gave the milk to Bill?", "What did Fred give to Bill?", "Who did Fred give the milk
  to?", "Who gave the milk?", "Who received the milk?" (asked only where one answer fits every
  matching gift) -> one word.

Every story keeps, as bAbI does, the indices of the facts its answer follows from (`Story.supporting`):
the other facts are distractors. As BABILong does, the facts go in order to seeded random places among
the sentences of long text (the essay texts, from a seeded sentence on; sentences naming any of the
tasks' people, rooms or objects are left out, so the text never bears on the answer), as many
sentences as fit the target length; at length 0, or any length the facts alone exceed, the prompt
holds the facts alone. `depth` places nothing here: it only seeds.

The prompt follows BABILong's: an instruction, one solved example, the answer's form, the context in
<context> tags, the question, and "Answer:". Scoring is BABILong's: the output's first sentence
(cut at the first ".") must name the answer and no other of the task's labels (its rooms, or qa5's
people and objects) that the question does not itself name; labels count as whole words (BABILong
matches substrings).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from functools import lru_cache

from linearize.eval.haystack import Sample, count_tokens, fit_sample, insert

BABILONG_TASKS = ("babilong_qa1", "babilong_qa2", "babilong_qa3", "babilong_qa4", "babilong_qa5")
MAX_NEW_TOKENS = 20  # BABILong's generation length

PEOPLE = ("Mary", "John", "Daniel", "Sandra")
PEOPLE_QA5 = ("Bill", "Fred", "Jeff", "Mary")
ROOMS = ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office")
OBJECTS = ("apple", "football", "milk")
MOVES = ("moved to", "went to", "journeyed to", "travelled to", "went back to")
GRABS = ("picked up", "got", "grabbed", "took")
DROPS = ("dropped", "discarded", "put down", "left")
GIVES = ("gave", "handed", "passed")
DIRECTIONS = {"north": (0, 1), "south": (0, -1), "east": (1, 0), "west": (-1, 0)}
OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}
# BABILong's answer labels of each task: an output must name the answer and no other (unless asked about).
LABELS = {1: ROOMS, 2: ROOMS, 3: ROOMS, 4: ROOMS, 5: (*PEOPLE_QA5, *OBJECTS)}
ENTITIES = {word.lower() for word in (*PEOPLE, *PEOPLE_QA5, *ROOMS, *OBJECTS)}

INSTRUCTIONS = {
    1: "I will give you a context in which facts about where some people are lie hidden in unrelated text, and "
       "then a question. Answer it from those facts alone. When a person has been in several places, the "
       "person is in the latest one.",
    2: "I will give you a context in which facts about where people go and about the objects they pick up and "
       "put down lie hidden in unrelated text, and then a question. Answer it from those facts alone. An object "
       "that a person carries goes wherever the person goes; an object that was put down stays where it was left.",
    3: "I will give you a context in which facts about where people go and about the objects they pick up and "
       "put down lie hidden in unrelated text, and then a question about where an object was just before it "
       "was taken to a place. Answer it from those facts alone. An object that a person carries goes wherever "
       "the person goes; an object that was put down stays where it was left.",
    4: "I will give you a context in which facts about how places lie relative to one another are hidden in "
       "unrelated text, and then a question. Answer it from those facts alone.",
    5: "I will give you a context in which facts about people, the objects they carry and the objects they give "
       "to one another lie hidden in unrelated text, and then a question. Answer it from those facts alone.",
}
EXAMPLES = {
    1: "Alice went to the cellar. Bob journeyed to the attic. Alice travelled to the porch. Where is Alice?\n"
       "Answer: The most recent location of Alice is porch.",
    2: "Carol went to the garage. Carol picked up the hammer there. Carol moved to the porch. Where is the hammer?\n"
       "Answer: The hammer is in the porch.",
    3: "Dave went to the cellar. Dave took the lamp there. Dave journeyed to the attic. "
       "Where was the lamp before the attic?\nAnswer: Before the attic the lamp was in the cellar.",
    4: "The attic is east of the cellar. The porch is north of the cellar. What is the cellar west of?\n"
       "Answer: attic",
    5: "Eve got the hammer there. Eve handed the hammer to Alice. Alice went to the porch. "
       "Who did Eve give the hammer to?\nAnswer: Alice",
}
FORMS = {
    1: "Answer in the form: The most recent location of <person> is <location>. Write nothing after that.",
    2: "Answer in the form: The <object> is in <location>. Write nothing after that.",
    3: "Answer in the form: Before the <location 1> the <object> was in the <location 2>. Write nothing after that.",
    4: "Answer with one word, the location. Write nothing after that.",
    5: "Answer with one word. Write nothing after that.",
}
PROMPT = "{instruction}\n\n<example>\n{example}\n</example>\n\n{form}\n\n<context>\n{context}\n</context>\n\nQuestion: {question}\nAnswer:"


@dataclass(frozen=True)
class Story:
    facts: tuple[str, ...]
    question: str
    answer: str
    supporting: tuple[int, ...]  # indices of the facts the answer follows from


@dataclass
class World:
    """People moving, taking, dropping and giving objects, with where each fact left things."""

    rng: random.Random
    people: tuple[str, ...]
    facts: list[str] = field(default_factory=list)
    room: dict[str, str] = field(default_factory=dict)  # person -> room
    moves: dict[str, list[int]] = field(default_factory=dict)  # person -> indices of their moves
    holder: dict[str, str] = field(default_factory=dict)  # object -> person holding it
    lying: dict[str, str] = field(default_factory=dict)  # object -> room it was put down in
    taken: dict[str, int] = field(default_factory=dict)  # object -> index of its holder's take (or receipt)
    dropped: dict[str, tuple[int, str]] = field(default_factory=dict)  # object -> (index, person) of its last drop
    # object -> [(room, supporting indices of "it was carried here")], a new entry each time it changes rooms
    history: dict[str, list[tuple[str, tuple[int, ...]]]] = field(default_factory=dict)
    gifts: list[tuple[int, str, str, str]] = field(default_factory=list)  # (index, giver, object, receiver)

    def move(self, person: str, company: bool = False) -> bool:
        here = self.room.get(person)
        rooms = [r for r in ROOMS if r != here]
        if company:  # toward someone, so that gifts can happen
            rooms = [r for r in rooms if r in {self.room.get(p) for p in self.people if p != person}] or rooms
        room = self.rng.choice(rooms)
        index = self.add(f"{person} {self.rng.choice(MOVES)} the {room}.")
        before = self.moves.setdefault(person, [])[-1:]
        self.moves[person].append(index)
        self.room[person] = room
        for obj, holder in self.holder.items():
            if holder == person:
                self.history.setdefault(obj, []).append((room, (self.taken[obj], *before, index)))
        return True

    def take(self, person: str) -> bool:
        here = self.room[person]
        free = [o for o in OBJECTS if o not in self.holder and self.lying.get(o, here) == here]
        if not free:
            return False
        obj = self.rng.choice(free)
        index = self.add(f"{person} {self.rng.choice(GRABS)} the {obj} there.")
        self.holder[obj], self.taken[obj] = person, index
        self.lying.pop(obj, None)
        if not self.history.get(obj) or self.history[obj][-1][0] != here:
            self.history.setdefault(obj, []).append((here, (self.moves[person][-1], index)))
        return True

    def drop(self, person: str) -> bool:
        held = [o for o in OBJECTS if self.holder.get(o) == person]
        if not held:
            return False
        obj = self.rng.choice(held)
        index = self.add(f"{person} {self.rng.choice(DROPS)} the {obj}.")
        del self.holder[obj]
        self.lying[obj], self.dropped[obj] = self.room[person], (index, person)
        return True

    def give(self, person: str) -> bool:
        held = [o for o in OBJECTS if self.holder.get(o) == person]
        others = [p for p in self.people if p != person and self.room.get(p) == self.room[person]]
        if not held or not others:
            return False
        obj, receiver = self.rng.choice(held), self.rng.choice(others)
        index = self.add(f"{person} {self.rng.choice(GIVES)} the {obj} to {receiver}.")
        self.holder[obj], self.taken[obj] = receiver, index
        self.gifts.append((index, person, obj, receiver))
        return True

    def add(self, fact: str) -> int:
        self.facts.append(fact)
        return len(self.facts) - 1

    def act(self, steps: int, weights: dict[str, float]) -> None:
        """`steps` facts: a random person acts each time (moving first, so everyone's room is known)."""
        actions = list(weights)
        while len(self.facts) < steps:
            person = self.rng.choice(self.people)
            if person not in self.room:
                self.move(person)
                continue
            action = self.rng.choices(actions, [weights[a] for a in actions])[0]
            if action == "move":
                self.move(person, company="give" in weights and self.rng.random() < 0.5)
            else:
                getattr(self, action)(person)

    def last_move_before(self, person: str, index: int) -> int:
        return max(m for m in self.moves[person] if m < index)


def qa1(rng: random.Random) -> Story:
    world = World(rng, PEOPLE)
    world.act(rng.randint(4, 10), {"move": 1.0})
    person = rng.choice(sorted(world.room))
    return Story(tuple(world.facts), f"Where is {person}?", world.room[person], (world.moves[person][-1],))


def qa2(rng: random.Random) -> Story:
    while True:
        world = World(rng, PEOPLE)
        world.act(rng.randint(8, 18), {"move": 0.5, "take": 0.3, "drop": 0.2})
        if world.taken:
            break
    obj = rng.choice(sorted(world.taken))
    if obj in world.holder:
        person = world.holder[obj]
        room, supporting = world.room[person], {world.taken[obj], world.moves[person][-1]}
    else:
        index, person = world.dropped[obj]
        room, supporting = world.lying[obj], {world.last_move_before(person, index), index}
    return Story(tuple(world.facts), f"Where is the {obj}?", room, tuple(sorted(supporting)))


def qa3(rng: random.Random) -> Story:
    while True:
        world = World(rng, PEOPLE)
        world.act(rng.randint(10, 22), {"move": 0.55, "take": 0.3, "drop": 0.15})
        # Objects carried into their latest room, which they had not been in before.
        askable = sorted(o for o, h in world.history.items() if len(h) >= 2 and [r for r, _ in h].count(h[-1][0]) == 1)
        if askable:
            break
    obj = rng.choice(askable)
    (before, _), (room, supporting) = world.history[obj][-2:]
    return Story(tuple(world.facts), f"Where was the {obj} before the {room}?", before, tuple(sorted(supporting)))


def qa4(rng: random.Random) -> Story:
    """Three rooms on a grid, two of them next to the third or in a row; a fact for each neighbour pair placed."""
    rooms = rng.sample(ROOMS, 3)
    cells = {rooms[0]: (0, 0)}
    relations = []  # (a, direction, b): a is `direction` of b
    for room in rooms[1:]:
        while True:
            anchor, direction = rng.choice(sorted(cells)), rng.choice(sorted(DIRECTIONS))
            x, y = cells[anchor]
            cell = (x + DIRECTIONS[direction][0], y + DIRECTIONS[direction][1])
            if cell not in cells.values():
                break
        cells[room] = cell
        relations.append((room, direction, anchor) if rng.random() < 0.5 else (anchor, OPPOSITE[direction], room))
    rng.shuffle(relations)
    facts = tuple(f"The {a} is {d} of the {b}." for a, d, b in relations)
    asked = rng.randrange(len(relations))
    a, d, b = relations[asked]
    question, answer = (f"What is {d} of the {b}?", a) if rng.random() < 0.5 else (f"What is the {a} {d} of?", b)
    return Story(facts, question, answer, (asked,))


QA5_QUESTIONS = (  # (question, what matches a gift, what answers it), over (giver, object, receiver)
    ("What did {0} give to {2}?", (0, 2), 1),
    ("Who gave the {1} to {2}?", (1, 2), 0),
    ("Who did {0} give the {1} to?", (0, 1), 2),
    ("Who gave the {1}?", (1,), 0),
    ("Who received the {1}?", (1,), 2),
)


def qa5(rng: random.Random) -> Story:
    while True:
        world = World(rng, PEOPLE_QA5)
        world.act(rng.randint(8, 16), {"move": 0.35, "take": 0.25, "drop": 0.1, "give": 0.3})
        gifts = [(index, (giver, obj, receiver)) for index, giver, obj, receiver in world.gifts]
        candidates = []
        for index, gift in gifts:
            for template, keys, answer in QA5_QUESTIONS:
                matching = [(i, g) for i, g in gifts if all(g[k] == gift[k] for k in keys)]
                # One answer fits every gift the question matches; asked once, of the latest of them.
                if {g[answer] for _, g in matching} == {gift[answer]} and index == matching[-1][0]:
                    candidates.append((template.format(*gift), gift[answer], index))
        if candidates:
            break
    question, answer, index = rng.choice(candidates)
    return Story(tuple(world.facts), question, answer, (index,))


STORIES = {1: qa1, 2: qa2, 3: qa3, 4: qa4, 5: qa5}


def story(number: int, seed: int) -> Story:
    """The seeded story of bAbI task `number` (1-5) that the sample of that seed holds."""
    return STORIES[number](random.Random(seed))


@lru_cache(maxsize=4)
def background(sentences: tuple[str, ...]) -> tuple[str, ...]:
    """The sentences that name none of the tasks' people, rooms or objects."""
    kept = tuple(s for s in sentences if not ENTITIES & set(re.findall(r"[a-z]+", s.lower())))
    if not kept:
        raise ValueError("No essay sentence is free of the BABILong tasks' names to hide the facts among.")
    return kept


def generate(number: int, tokenizer, length: int, depth: float, seed: int, *, essay) -> Sample:
    """A BABILong prompt of task `number` with at most `length` tokens (the facts alone, if they take more)."""
    told = story(number, seed)
    rng = random.Random(f"{seed}:background")
    pool = background(tuple(essay))
    start = rng.randrange(len(pool))
    places = sorted(rng.random() for _ in told.facts)

    def render(n: int) -> str:
        units = [pool[(start + i) % len(pool)] for i in range(n)]
        context = " ".join(insert(units, list(zip(places, told.facts))))
        return PROMPT.format(instruction=INSTRUCTIONS[number], example=EXAMPLES[number], form=FORMS[number],
                             context=context, question=told.question)

    facts_alone = render(0)
    if length <= (tokens := count_tokens(tokenizer, facts_alone)):
        return Sample(facts_alone, (told.answer,), tokens, MAX_NEW_TOKENS)
    return fit_sample(tokenizer, length, render, lambda n: (told.answer,), f"babilong_qa{number}", MAX_NEW_TOKENS)


def first_sentence(output: str) -> str:
    """BABILong's reading of an output: lower case, up to the first "." and before any new question or tag."""
    text = output.lower().split(".")[0]
    for stop in ("<context>", "<example>", "question"):
        text = text.split(stop)[0]
    return text


def mentioned(text: str, labels) -> set[str]:
    return {label.lower() for label in labels if re.search(rf"\b{re.escape(label.lower())}\b", text.lower())}


def score(number: int, prediction: str, sample: Sample) -> float:
    """1 if the output's first sentence names the answer and no other label the question does not name."""
    question = sample.prompt.rsplit("Question:", 1)[-1]
    said = mentioned(first_sentence(prediction), LABELS[number]) - mentioned(question, LABELS[number])
    return float(said == {sample.answers[0].lower()})
