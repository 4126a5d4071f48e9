"""Training prompts built from what every machine has offline: the Python standard library's own
sources and docstrings, plus chat questions composed from templates and topics.

The drafter must learn what the target writes after the kinds of requests the benchmarks send: raw
completions of a code request (the decode check's code probe), chat turns asking for code,
explanations, stories and advice (its chat probe), and prose. The probes themselves are held out:
any prompt that names a probe's subject is dropped (`HELD_OUT`), so the receipt's held-out figures
and the decode check measure requests the drafter never saw.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
from dataclasses import dataclass
from pathlib import Path

# Words of the decode probes (dflash_bench/prompts/probes.json): by default a prompt containing one is not trained on.
HELD_OUT = ("fibonacci", "graphics card")

TOPICS = (
    "photosynthesis", "the water cycle", "a refrigerator", "an electric motor", "the internet", "a compiler",
    "a database index", "public key cryptography", "the immune system", "volcanoes", "earthquakes", "tides",
    "the moon's phases", "black holes", "the speed of light", "gravity", "magnets", "batteries", "solar panels",
    "wind turbines", "a nuclear reactor", "vaccines", "antibiotics", "DNA", "evolution", "climate change",
    "the greenhouse effect", "recycling", "composting", "bees", "ants", "octopuses", "whales", "migratory birds",
    "rainforests", "deserts", "coral reefs", "glaciers", "the Roman Empire", "the printing press",
    "the industrial revolution", "ancient Egypt", "the Silk Road", "democracy", "inflation", "interest rates",
    "supply and demand", "a stock market", "budgeting", "saving money", "learning a language", "public speaking",
    "time management", "sleep", "exercise", "healthy eating", "meditation", "teamwork", "writing an essay",
    "reading more books", "a job interview", "starting a small business", "gardening", "baking bread",
    "making coffee", "cooking rice", "chess", "football", "the Olympic Games", "music theory", "the piano",
    "painting with watercolors", "photography", "a camera lens", "a microscope", "a telescope", "airplanes",
    "helicopters", "trains", "electric cars", "traffic lights", "bridges", "skyscrapers", "the pyramids",
    "a lighthouse", "maps", "GPS", "satellites", "the weather forecast", "rainbows", "thunderstorms", "snowflakes",
    "a sorting algorithm", "binary search", "recursion", "hash tables", "linked lists", "version control",
    "unit tests", "an operating system", "memory management", "a web browser", "HTTP", "email", "passwords",
    "encryption", "machine learning", "neural networks", "a search engine", "spreadsheets", "the decimal system",
    "prime numbers", "fractions", "probability", "statistics", "geometry", "the Pythagorean theorem", "calculus",
    "the periodic table", "atoms", "chemical reactions", "acids and bases", "friction", "electricity", "sound waves",
    "the human heart", "the brain", "dreams", "memory", "friendship", "kindness", "a library", "a museum",
    "a city park", "a village market", "a rainy afternoon", "an old clock", "a lost key", "a robot",
    "a dragon", "a small boat", "a mountain hike", "a winter morning", "the ocean", "a forest at night",
    # v5: a wider spread, since a drafter learns the phrases of what it was shown
    "a CPU", "computer memory", "a hard drive", "a solid state drive", "a keyboard", "a computer mouse",
    "a touch screen", "a smartphone", "a laptop battery", "Wi-Fi", "Bluetooth", "a router", "fiber optic cables",
    "cloud computing", "a data center", "virtual machines", "containers", "open source software", "cybersecurity",
    "a firewall", "computer viruses", "a programming language", "JavaScript", "SQL databases", "an API",
    "a web server", "a mobile app", "video streaming", "video compression", "digital photos", "pixels",
    "a 3D printer", "robots in factories", "self-driving cars", "drones", "artificial intelligence",
    "a chatbot", "speech recognition", "a calculator", "a barcode scanner", "QR codes", "credit cards",
    "online shopping", "social media", "a podcast", "a video game", "virtual reality", "a smartwatch",
    "a spaceship", "the International Space Station", "Mars", "Jupiter", "the Sun", "comets", "stars",
    "galaxies", "the Big Bang", "a rocket engine", "jet engines", "a car engine", "hybrid cars", "bicycles",
    "a submarine", "sailing ships", "canals", "dams", "hydroelectric power", "a power grid", "light bulbs",
    "LED lights", "a microwave oven", "a washing machine", "an air conditioner", "a thermostat", "a toaster",
    "a vacuum cleaner", "plumbing", "a water filter", "concrete", "steel", "glass", "plastic", "paper",
    "cotton", "wool", "silk", "leather", "rubber", "wood", "bricks", "clay pottery", "a sewing machine",
    "a loom", "the wheel", "the compass", "the telescope's invention", "the telephone", "the radio",
    "television", "the camera's invention", "the steam engine", "the light bulb's invention", "penicillin",
    "the human eye", "the lungs", "the stomach", "the kidneys", "the liver", "bones", "muscles", "blood",
    "the nervous system", "hormones", "viruses", "bacteria", "fungi", "cells", "proteins", "enzymes",
    "genes", "mutations", "allergies", "the common cold", "fever", "a first aid kit", "hand washing",
    "hydration", "vitamins", "sugar", "caffeine", "chocolate", "tea", "cheese", "yogurt", "pasta", "pizza",
    "soup", "salad", "spices", "a kitchen knife", "a cast iron pan", "fermentation", "a farmers market",
    "farming", "irrigation", "tractors", "wheat", "corn", "rice paddies", "apple trees", "seeds", "soil",
    "earthworms", "butterflies", "spiders", "frogs", "snakes", "turtles", "penguins", "elephants", "lions",
    "wolves", "dogs", "cats", "horses", "cows", "chickens", "owls", "eagles", "sharks", "dolphins",
    "jellyfish", "salmon", "dinosaurs", "fossils", "mountains", "rivers", "lakes", "caves", "islands",
    "hurricanes", "tornadoes", "floods", "droughts", "wildfires", "the seasons", "clouds", "fog", "wind",
    "air pollution", "plastic in the ocean", "endangered species", "national parks", "city planning",
    "public transport", "a subway system", "airports", "a post office", "a hospital", "a fire station",
    "a school", "a university", "homework", "exams", "a science fair", "a debate club", "a spelling bee",
    "a book club", "a newspaper", "journalism", "advertising", "marketing", "a brand", "customer service",
    "a restaurant", "a hotel", "tourism", "a road trip", "camping", "packing for a trip", "jet lag",
    "a passport", "foreign currency", "taxes", "banks", "loans", "credit scores", "insurance", "a pension",
    "investing", "the economy", "unemployment", "trade", "globalization", "the United Nations", "elections",
    "a constitution", "the courts", "human rights", "philosophy", "ethics", "logic", "critical thinking",
    "creativity", "curiosity", "motivation", "habits", "stress", "happiness", "gratitude", "patience",
    "leadership", "negotiation", "giving feedback", "remote work", "a resume", "a cover letter",
    "networking", "volunteering", "parenting", "grandparents", "a birthday party", "a wedding", "holidays",
    "New Year's resolutions", "a marathon", "swimming", "yoga", "tennis", "basketball", "cycling",
    "skiing", "rock climbing", "a chess opening", "card games", "board games", "puzzles", "magic tricks",
    "jazz", "classical music", "a guitar", "drums", "singing", "dance", "theater", "movies", "animation",
    "comic books", "poetry", "Shakespeare", "mythology", "fairy tales", "the Renaissance", "the Middle Ages",
    "castles", "knights", "the Vikings", "ancient Greece", "ancient China", "the Aztecs", "the Moon landing",
    "the Great Wall of China", "the French Revolution", "World War I", "the Cold War", "the printing of money",
    "algebra", "multiplication tables", "negative numbers", "percentages", "graphs", "averages", "infinity",
    "the number zero", "pi", "symmetry", "triangles", "circles", "measuring time", "the metric system",
    "temperature", "energy", "heat", "light", "mirrors", "lenses", "color", "magnetism", "static electricity",
    "circuits", "transistors", "semiconductors", "computer chips", "multitasking",
    "binary numbers", "logic gates", "algorithms", "data structures", "big O notation", "debugging",
    "code review", "software testing", "agile development", "a text editor", "the command line", "Linux",
    "file systems", "compression", "caching", "queues", "stacks", "trees", "graphs in computer science",
    "sorting", "random numbers", "simulations", "weather models", "spreadsheet formulas", "data visualization",
)

QUESTION_TEMPLATES = (
    "Explain in plain words how {t} works.", "What is {t}?", "Why is {t} important?",
    "Give me three facts about {t}.", "Describe {t} to a ten-year-old.", "What are the main parts of {t}?",
    "How would you explain {t} to a friend?", "What are common misconceptions about {t}?",
    "Summarize the history of {t} in a few sentences.", "What are the pros and cons of {t}?",
    "Give me five tips about {t}.", "Compare {t} with {u}.", "What is the difference between {t} and {u}?",
    "How are {t} and {u} related?", "Can you tell me something interesting about {t}?",
    "List the steps to learn about {t}.", "What questions should I ask about {t}?",
    "How does {t} work?", "Explain in simple terms why {t} matters.", "What happens inside {t}?",
    "Explain {t} step by step.", "Why do people care about {t}?", "How has {t} changed over time?",
    "What would happen without {t}?", "Explain the science behind {t}.", "Teach me the basics of {t}.",
)

WRITING_TEMPLATES = (
    "Write a short story about {t}.", "Write a poem about {t}.", "Write a paragraph describing {t}.",
    "Write a short essay on {t}.", "Write a letter to a friend about {t}.", "Write a blog post about {t}.",
    "Write a dialogue between two people talking about {t}.", "Write a product description for {t}.",
    "Write a haiku about {t}.", "Write the opening of a novel that involves {t}.",
)

PROSE_OPENERS = (
    "The history of {t} begins", "Most people never think about {t}, but", "Here is a simple guide to {t}.\n\n",
    "Chapter 1\n\nThe first time I saw {t},", "In this article we look at {t}.", "{T} is",
    "Once upon a time, there was {t}", "A beginner's introduction to {t}:\n\n", "Ten things to know about {t}:\n\n1.",
)

CLASSIC_TASKS = (
    "reverses a string", "checks whether a number is prime", "returns the factorial of n",
    "sorts a list with bubble sort", "returns the n-th prime number", "counts the vowels in a string",
    "checks whether a string is a palindrome", "returns the greatest common divisor of two numbers",
    "merges two sorted lists", "finds the largest element in a list", "removes duplicates from a list",
    "converts Celsius to Fahrenheit", "returns the sum of the digits of a number", "flattens a nested list",
    "counts the words in a text", "checks whether two strings are anagrams", "returns the n-th triangular number",
    "computes the power of a number without using the ** operator", "finds the median of a list of numbers",
    "returns the binary representation of an integer", "implements binary search on a sorted list",
    "reads a file and returns the number of lines", "returns the second largest number in a list",
    "computes the average of a list of numbers", "generates all permutations of a list",
    "checks whether a year is a leap year", "returns the least common multiple of two numbers",
    "capitalizes the first letter of every word", "returns the list of divisors of a number",
    "converts a Roman numeral to an integer", "computes the dot product of two vectors",
    "transposes a matrix", "multiplies two matrices", "counts how often each character occurs in a string",
    "returns the longest word in a sentence", "implements quicksort", "implements merge sort",
    "returns the sum of the squares of the first n numbers", "checks whether a list is sorted",
    "returns the intersection of two lists", "rotates a list by k positions", "computes compound interest",
)

SELF_QUESTIONS = (  # sampled (T 0.8), so one template and topic gives many different questions
    "Write one question a curious student might ask about {t}. Reply with the question only.",
    "Write a request someone might send to an AI assistant about {t}. Reply with the request only.",
    "Ask one question about {t} that needs a detailed answer. Reply with the question only.",
)

CODE_CHAT_TEMPLATES = (
    "Write a Python function that {c}.", "How do I write a function that {c} in Python?",
    "Implement a Python function `{n}` that {c}.", "Can you show me Python code that {c}?",
    "Write a Python function that {c}. Include a docstring and an example.",
    "Write a function in Python which {c}, and explain how it works.",
    "Write Python code that {c}.", "I need a Python function that {c}.", "Create a Python function that {c}.",
    "Show me how to write a Python function that {c}.", "Write a short Python function that {c}. Keep it simple.",
    "Write a Python function that {c}, with type hints.",
)

CODE_RAW_TEMPLATES = (
    "Write a Python function that {c}.\n", "Write a Python function that {c}.\n\n",
    "# Python function that {c}\n", "Write a Python program that {c}.\n", "Python function `{n}` that {c}:\n",
)


@dataclass(frozen=True)
class Prompt:
    kind: str  # code-raw, code-chat, code-continue, code-explain, chat-question, chat-write, prose-raw, self-question
    text: str
    chat: bool  # sent through the chat template (True) or as a raw completion


@dataclass(frozen=True)
class StdlibFunction:
    name: str
    summary: str  # the docstring's first sentence
    source: str  # the function's source text
    header: str  # the def line(s) and docstring: a prompt the target completes


def _third_person(verb: str) -> str:
    """'Return' -> 'returns', 'Try' -> 'tries', 'Pass' -> 'passes' (docstrings start with an imperative)."""
    v = verb.lower()
    if v.endswith(("s", "sh", "ch", "x", "z", "o")):
        return v + "es"
    if v.endswith("y") and len(v) > 1 and v[-2] not in "aeiou":
        return v[:-1] + "ies"
    return v + "s"


def clause(summary: str) -> str | None:
    """A docstring summary as the clause after 'a function that': 'Return the sum.' -> 'returns the sum'."""
    s = " ".join(summary.split()).rstrip(".")
    words = s.split(" ", 1)
    if len(words) < 2 or not words[0].isalpha() or not words[0][0].isupper() or len(s) > 120:
        return None
    if words[0].lower() in ("this", "the", "a", "an", "if", "for", "when", "internal", "helper", "deprecated"):
        return None
    return f"{_third_person(words[0])} {words[1]}"


def stdlib_functions(stdlib: Path) -> list[StdlibFunction]:
    """Documented public functions of the top-level modules in `stdlib`, sorted for reproducibility."""
    found: list[StdlibFunction] = []
    for path in sorted(stdlib.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or not node.body or node.end_lineno is None:
                continue
            summary = doc.strip().split("\n\n")[0].split(". ")[0]
            source = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            header_end = node.body[0].end_lineno or node.lineno
            header = "\n".join(lines[node.lineno - 1 : header_end]) + "\n"
            indent = len(source) - len(source.lstrip())
            found.append(StdlibFunction(node.name, summary, _dedent(source, indent), _dedent(header, indent)))
    return found


def _dedent(text: str, indent: int) -> str:
    return "\n".join(line[indent:] if line[:indent].isspace() else line for line in text.splitlines()) + (
        "\n" if text.endswith("\n") else ""
    )


def module_paragraphs(stdlib: Path) -> list[str]:
    """First paragraphs of module docstrings that read as prose (a raw-completion prompt each)."""
    out = []
    for path in sorted(stdlib.glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if not doc:
            continue
        para = " ".join(doc.strip().split("\n\n")[0].split())
        if 60 <= len(para) <= 400 and re.match(r"^[A-Z][a-z]", para):
            out.append(para)
    return out


def build_prompts(
    stdlib: Path, count: int, seed: int, mix: dict[str, float], held_out: tuple[str, ...] = HELD_OUT
) -> list[Prompt]:
    """`count` prompts drawn by kind in the proportions of `mix`, deterministic for (stdlib, seed)."""
    rng = random.Random(seed)
    funcs = [f for f in stdlib_functions(stdlib) if clause(f.summary)]
    short = [f for f in funcs if 3 <= f.source.count("\n") <= 16 and len(f.source) <= 700]
    paragraphs = module_paragraphs(stdlib)
    if not funcs or not paragraphs:
        raise ValueError(f"no documented functions or module docstrings found under {stdlib}")

    def topic() -> str:
        return rng.choice(TOPICS)

    def one(kind: str) -> Prompt:
        if kind in ("code-raw", "code-chat"):
            templates = CODE_RAW_TEMPLATES if kind == "code-raw" else CODE_CHAT_TEMPLATES
            if rng.random() < 0.4:
                task = rng.choice(CLASSIC_TASKS)
                name = "_".join(task.split()[:3]).replace("'", "")
            else:
                f = rng.choice(funcs)
                task, name = clause(f.summary), f.name
            return Prompt(kind, rng.choice(templates).format(c=task, n=name), kind == "code-chat")
        if kind == "code-continue":
            return Prompt(kind, rng.choice(funcs).header, False)
        if kind == "code-explain":
            ask = rng.choice(("Explain what this Python code does:", "What does this function do?",
                              "Review this Python code and suggest improvements:", "Add comments to this code:"))
            source = rng.choice(short or funcs).source.rstrip("\n")
            return Prompt(kind, f"{ask}\n\n```python\n{source}\n```", True)
        if kind == "chat-question":
            t, u = topic(), topic()
            return Prompt(kind, rng.choice(QUESTION_TEMPLATES).format(t=t, u=u), True)
        if kind == "chat-write":
            return Prompt(kind, rng.choice(WRITING_TEMPLATES).format(t=topic()), True)
        if kind == "prose-raw":
            if rng.random() < 0.5:
                return Prompt(kind, rng.choice(paragraphs) + "\n\n", False)
            t = topic()
            return Prompt(kind, rng.choice(PROSE_OPENERS).format(t=t, T=t[:1].upper() + t[1:]), False)
        if kind == "self-question":  # the first pass asks the target for a question; see data.py
            return Prompt(kind, rng.choice(SELF_QUESTIONS).format(t=topic()), True)
        raise ValueError(f"unknown prompt kind {kind!r}")

    kinds = sorted(mix)
    weights = [mix[k] for k in kinds]
    prompts: list[Prompt] = []
    seen: set[str] = set()
    while len(prompts) < count:
        p = one(rng.choices(kinds, weights)[0])
        if any(word in p.text.lower() for word in held_out) or (p.text in seen and p.kind != "self-question"):
            continue
        seen.add(p.text)
        prompts.append(p)
    return prompts


def prompts_sha256(prompts: list[Prompt]) -> str:
    h = hashlib.sha256()
    for p in prompts:
        h.update(f"{p.kind}\x00{int(p.chat)}\x00{p.text}\x01".encode())
    return h.hexdigest()
