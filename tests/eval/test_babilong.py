"""BABILong's QA1-QA5: stories checked against a reference solver, prompts, lengths, and BABILong's scoring."""

import collections
import re

import pytest

from linearize.eval import api, babilong, evaluate
from linearize.eval import longcontext as lc
from linearize.eval.haystack import Sample, count_tokens
from linearize.eval.texts import essay_sentences

TASKS = babilong.BABILONG_TASKS
NUMBERS = (1, 2, 3, 4, 5)


@pytest.fixture(scope="module")
def essay(essay_file):
    return essay_sentences(essay_file)


# --- a reference solver, written apart from the generator: it reads the facts' sentences and nothing else

MOVE = re.compile(r"(\w+) (?:moved|went|journeyed|travelled|went back) to the (\w+)\.")
TAKE = re.compile(r"(\w+) (?:picked up|got|grabbed|took) the (\w+) there\.")
DROP = re.compile(r"(\w+) (?:dropped|discarded|put down|left) the (\w+)\.")
GIVE = re.compile(r"(\w+) (?:gave|handed|passed) the (\w+) to (\w+)\.")
NEXT_TO = re.compile(r"The (\w+) is (north|south|east|west) of the (\w+)\.")
OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}


def solve(facts, question: str) -> str | None:
    """The answer the facts give to the question, or None where they give none (or more than one)."""
    room, holder, trail, gifts, relations = {}, {}, collections.defaultdict(list), [], []

    def put(obj, where):
        if where is not None and (not trail[obj] or trail[obj][-1] != where):
            trail[obj].append(where)

    for fact in facts:
        if m := GIVE.fullmatch(fact):
            gifts.append(m.groups())
            holder[m[2]] = m[3]
        elif m := MOVE.fullmatch(fact):
            room[m[1]] = m[2]
            for obj in [o for o, p in holder.items() if p == m[1]]:
                put(obj, m[2])
        elif m := TAKE.fullmatch(fact):
            holder[m[2]] = m[1]
            put(m[2], room.get(m[1]))
        elif m := DROP.fullmatch(fact):
            holder.pop(m[2], None)
            put(m[2], room.get(m[1]))
        elif m := NEXT_TO.fullmatch(fact):
            relations.append(m.groups())

    def unique(answers):
        return answers.pop() if len(answers := set(answers)) == 1 else None

    if m := re.fullmatch(r"Where is the (\w+)\?", question):
        return trail[m[1]][-1] if trail[m[1]] else None
    if m := re.fullmatch(r"Where is (\w+)\?", question):
        return room.get(m[1])
    if m := re.fullmatch(r"Where was the (\w+) before the (\w+)\?", question):
        rooms = trail[m[1]]
        last = len(rooms) - 1 - rooms[::-1].index(m[2]) if m[2] in rooms else 0
        return rooms[last - 1] if last > 0 else None
    if m := re.fullmatch(r"What is (\w+) of the (\w+)\?", question):
        return unique([a for a, d, b in relations if (d, b) == m.groups()]
                      + [b for a, d, b in relations if (OPPOSITE[d], a) == m.groups()])
    if m := re.fullmatch(r"What is the (\w+) (\w+) of\?", question):
        return unique([b for a, d, b in relations if (a, d) == m.groups()]
                      + [a for a, d, b in relations if (b, OPPOSITE[d]) == m.groups()])
    for pattern, asked, answer in ((r"What did (\w+) give to (\w+)\?", (0, 2), 1), (r"Who gave the (\w+) to (\w+)\?", (1, 2), 0),
                                   (r"Who did (\w+) give the (\w+) to\?", (0, 1), 2), (r"Who gave the (\w+)\?", (1,), 0),
                                   (r"Who received the (\w+)\?", (1,), 2)):
        if m := re.fullmatch(pattern, question):
            return unique([g[answer] for g in gifts if tuple(g[i] for i in asked) == m.groups()])
    raise AssertionError(f"unknown question {question!r}")


def context_facts(prompt: str) -> list[str]:
    """Every sentence of the prompt's context (background text included) that reads as a fact."""
    context = prompt.split("<context>\n", 1)[1].split("\n</context>", 1)[0]
    return [s for s in re.split(r"(?<=[.!?])\s+", context)
            if any(p.fullmatch(s) for p in (MOVE, TAKE, DROP, GIVE, NEXT_TO))]


# --- the stories


@pytest.mark.parametrize("number", NUMBERS)
def test_the_facts_give_the_answer_and_the_distractor_facts_do_not_change_it(number):
    for seed in range(300):
        story = babilong.story(number, seed)
        assert solve(story.facts, story.question) == story.answer, (seed, story)
        # bAbI's supporting facts alone give the same answer: the other facts are distractors.
        assert solve([story.facts[i] for i in story.supporting], story.question) == story.answer, (seed, story)


def test_each_task_needs_its_number_of_supporting_facts():
    needed = {1: 1, 2: 2, 3: 3, 4: 1, 5: 1}  # QA2: two supporting facts, QA3: three; the relations: one
    for number, count in needed.items():
        assert {len(babilong.story(number, seed).supporting) for seed in range(100)} == {count}


def test_the_stories_have_distractors_and_vary():
    for number in NUMBERS:
        stories = [babilong.story(number, seed) for seed in range(50)]
        assert len({s.question for s in stories}) >= 3 and len({s.answer for s in stories}) >= 3
        if number != 4:  # QA4: two facts, one of them asked about
            assert all(len(s.facts) > len(s.supporting) for s in stories)
    names = "|".join((*babilong.PEOPLE_QA5, *babilong.OBJECTS))
    questions = {re.sub(rf"\b({names})\b", "X", babilong.story(5, s).question) for s in range(300)}
    assert questions == {"What did X give to X?", "Who gave the X to X?", "Who did X give the X to?", "Who gave the X?",
                         "Who received the X?"}


def test_stories_use_babis_names():
    for number in NUMBERS:
        for seed in range(30):
            story = babilong.story(number, seed)
            assert story.answer in babilong.LABELS[number]
            words = set(re.findall(r"\b[A-Z][a-z]+\b", " ".join(story.facts))) - {"The"}
            assert words <= set(babilong.PEOPLE_QA5 if number == 5 else babilong.PEOPLE)


# --- prompts


def build(task, tokenizer, length, seed, essay, depth=50):
    return lc.build_sample(task, tokenizer, length, depth, seed, essay=essay)


@pytest.mark.parametrize("task", TASKS)
def test_generator_is_deterministic_by_seed(task, tokenizer, essay):
    a, b, c = (build(task, tokenizer, 2048, seed, essay) for seed in (7, 7, 8))
    assert a == b
    assert c.prompt != a.prompt


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [2048, 3000, 4096])
def test_prompt_hits_target_length(task, length, tokenizer, essay):
    sample = build(task, tokenizer, length, 3, essay)
    assert sample.tokens == count_tokens(tokenizer, sample.prompt)
    assert length - 100 <= sample.tokens <= length
    assert sample.max_new_tokens == babilong.MAX_NEW_TOKENS


@pytest.mark.parametrize("number", NUMBERS)
def test_the_facts_lie_in_order_in_the_text_and_the_prompt_gives_the_answer(number, tokenizer, essay):
    for seed in range(20):
        sample = build(f"babilong_qa{number}", tokenizer, 3000, seed, essay)
        story = babilong.story(number, seed)
        spot = sample.prompt.index("<context>")
        for fact in story.facts:  # each after the one before (a fact may repeat)
            spot = sample.prompt.index(fact, spot + 1)
        assert sample.answers == (story.answer,)
        question = re.search(r"\nQuestion: (.*)\nAnswer:$", sample.prompt)[1]
        assert question == story.question
        # The whole context, background text and all, gives the same answer as the facts.
        assert context_facts(sample.prompt) == list(story.facts)
        assert solve(context_facts(sample.prompt), question) == story.answer


def test_prompts_follow_babilongs_layout(tokenizer, essay):
    sample = build("babilong_qa1", tokenizer, 2048, 1, essay)
    parts = re.fullmatch(r"(.+)\n\n<example>\n(.+)\n</example>\n\n(.+)\n\n<context>\n(.+)\n</context>\n\n"
                         r"Question: (.+)\nAnswer:", sample.prompt, re.DOTALL)
    assert parts and parts[1] == babilong.INSTRUCTIONS[1] and parts[3] == babilong.FORMS[1]


@pytest.mark.parametrize("length", [0, 100])
def test_length_zero_or_too_short_gives_the_facts_alone(length, tokenizer, essay):
    for number in NUMBERS:
        sample = build(f"babilong_qa{number}", tokenizer, length, 4, essay)
        context = sample.prompt.split("<context>\n", 1)[1].split("\n</context>", 1)[0]
        assert context == " ".join(babilong.story(number, 4).facts)
        assert sample.tokens == count_tokens(tokenizer, sample.prompt) > length


def test_background_never_names_the_tasks_people_rooms_or_objects():
    sentences = ("Mary had a lamb.", "The kitchen was warm.", "Billows of smoke rose.", "A bill passed.",
                 "The sea was grey.", "Apples fell.", "milk.")
    assert babilong.background(sentences) == ("Billows of smoke rose.", "The sea was grey.", "Apples fell.")
    with pytest.raises(ValueError, match="free of the BABILong tasks' names"):
        babilong.background(("Mary went home.",))


# --- scoring


def sample_for(question: str, answer: str) -> Sample:
    return Sample(f"...\nQuestion: {question}\nAnswer:", (answer,), 10, 20)


@pytest.mark.parametrize("number,question,answer,prediction,expected", [
    (1, "Where is Mary?", "kitchen", " The most recent location of Mary is kitchen.", 1.0),
    (1, "Where is Mary?", "kitchen", " Kitchen", 1.0),
    (1, "Where is Mary?", "kitchen", " kitchen. Before that, the garden.", 1.0),  # the first sentence only
    (1, "Where is Mary?", "kitchen", " The kitchen or the garden.", 0.0),  # one room, not two
    (1, "Where is Mary?", "kitchen", " The garden. Then the kitchen.", 0.0),
    (1, "Where is Mary?", "kitchen", " the kitchens", 0.0),  # whole words
    (1, "Where is Mary?", "kitchen", " kitchen\nQuestion: Where is John? Answer: garden", 1.0),
    (3, "Where was the milk before the office?", "hallway", " Before the office the milk was in the hallway.", 1.0),
    (3, "Where was the milk before the office?", "hallway", " The office.", 0.0),
    (4, "What is north of the kitchen?", "office", " office", 1.0),
    (5, "Who gave the football to Bill?", "Mary", " Mary gave the football to Bill.", 1.0),
    (5, "Who gave the football to Bill?", "Mary", " Fred", 0.0),
    (5, "What did Fred give to Bill?", "milk", " The milk and the apple.", 0.0),
])
def test_babilongs_scoring(number, question, answer, prediction, expected):
    assert babilong.score(number, prediction, sample_for(question, answer)) == expected


def answer_from(prompt: str) -> str:
    """What a perfect reader answers: the solver on the context's facts."""
    question = re.search(r"Question: (.*)\nAnswer:$", prompt)[1]
    return f" {solve(context_facts(prompt), question)}."


@pytest.mark.parametrize("task", TASKS)
def test_a_perfect_reader_scores_one_and_naming_every_label_scores_zero(task, tokenizer, essay):
    number = TASKS.index(task) + 1

    def run(answer):
        return lc.run_longcontext(task, lambda prompts, max_new: [answer(p) for p in prompts], tokenizer,
                                  lengths=[0, 2048], depths=[0, 100], samples=3, seed=1, essay=essay)

    perfect = run(answer_from)
    assert perfect["score"] == 1.0 and perfect["depth_free"] is True
    assert [b["length"] for b in perfect["by_length"]] == [0, 2048]
    assert run(lambda p: " " + " ".join(babilong.LABELS[number]))["score"] == 0.0


# --- through evaluate and the task lists


@pytest.mark.slow
def test_babilong_shorthand_and_names():
    assert api.parse_tasks("babilong") == list(TASKS)
    assert api.parse_tasks("babilong_qa3,babilong") == ["babilong_qa3", "babilong_qa1", "babilong_qa2",
                                                        "babilong_qa4", "babilong_qa5"]
    # Ours stand in for lm-eval's babilong_qa1..5 (hub data); its qa6..qa20 pass through to lm-eval.
    assert api.parse_tasks("babilong_qa6") == ["babilong_qa6"]
    with pytest.raises(ValueError, match=r"^Unknown task 'babilong_qa21'; choose from [^\n]*$"):
        api.parse_tasks("babilong,babilong_qa21")


def test_length_zero_runs_babilong_and_only_babilong(model, tokenizer, essay_file, ppl_text):
    results = evaluate(model, tokenizer, "babilong_qa1", lengths="0,2k", depths="50", samples=2, seed=1,
                       essay=str(essay_file))
    result = results["tasks"]["babilong_qa1"]
    assert [b["length"] for b in result["by_length"]] == [0, 2048] and result["lengths"] == [0, 2048]
    assert all(r["tokens"] > 0 for r in result["samples"])
    with pytest.raises(ValueError, match="Length 0 is too short for a passkey prompt"):
        evaluate(model, tokenizer, "babilong_qa1,passkey", lengths="0,1k", essay=str(essay_file))
    with pytest.raises(ValueError, match="ppl cannot score windows of length 0"):
        evaluate(model, tokenizer, "ppl,babilong_qa1", lengths="0,1k", essay=str(essay_file), text=str(ppl_text))
