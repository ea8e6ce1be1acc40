"""A seeded generator of tasks that genuinely need tools.

- math: exact arithmetic far past what a 135M model does in its head (big products, modular powers, digit
  sums of huge powers, prime counts); each task carries a reference python solution whose printed output is
  the answer.
- arith (optional, `n_arith`): one product of two `arith_digits`-digit numbers, answered with one python call.
  The smallest family a 135M policy can learn with its tool (copy the numbers into code, copy the output into
  the answer); kind "math", id "arith-NNNN". Used by bench/bench_learning.py.
- chain (optional, `n_chain`): two dependent tool calls. "How many years passed from the year <person> was born
  (<company> / the city of <city> was founded) to 2025?": the year exists only in the generated corpus, so the
  first call is a search for the name, and the second is python on the year that search returned
  (`print(2025 - 1957)`; a 135M model does not subtract reliably in its head). Kind "chain", id "chain-NNNN";
  the task carries the hop (query, document, fact) and the reference code. Used by bench/bench_learning.py.
- qa: two-hop questions about fictional people, cities and companies. The facts exist only in the generated
  corpus (FlashRAG JSONL, `{"id", "contents"}` with the title on the first line), so only search answers them.
  Each task carries its hops: the query to issue and the document that answers it.

Same seed, same tasks, byte for byte.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

from stages.core.config.data import SyntheticSection

_ONSETS = ["br", "k", "v", "z", "th", "m", "dr", "s", "qu", "h", "l", "gr", "t", "n", "f", "st"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "io", "ou"]
_CODAS = ["n", "r", "x", "th", "m", "l", "sk", "nd", "v", ""]
_JOBS = ["cartographer", "glassblower", "astronomer", "clockmaker", "botanist", "luthier", "archivist", "engineer"]
_COMPANY_KINDS = ["Industries", "Works", "Foundry", "Trading Company", "Instruments", "Shipyards"]


@dataclass(frozen=True)
class Hop:
    query: str
    doc_id: str
    fact: str


@dataclass(frozen=True)
class Task:
    id: str
    kind: str  # "math" | "qa" | "chain"
    question: str
    answer: str
    split: str = "train"
    solution_code: str = ""
    hops: tuple[Hop, ...] = field(default_factory=tuple)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SyntheticSet:
    tasks: list[Task]
    corpus: list[dict[str, str]]


def _name(rng: random.Random, syllables: int) -> str:
    word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)) + rng.choice(_CODAS)
    return word.capitalize()


def _unique_names(rng: random.Random, count: int, syllables: int, taken: set[str]) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        candidate = _name(rng, syllables)
        if candidate not in taken:
            taken.add(candidate)
            names.append(candidate)
    return names


def _world(rng: random.Random, n_people: int) -> tuple[list[dict], list[dict], list[dict], list[dict]]:
    taken: set[str] = set()
    n_places = max(3, n_people // 3)
    provinces = _unique_names(rng, max(2, n_places // 2), 3, taken)
    cities = [{"name": name, "province": rng.choice(provinces), "founded": rng.randint(900, 1850)}
              for name in _unique_names(rng, n_places, 2, taken)]
    companies = [{"name": f"{name} {rng.choice(_COMPANY_KINDS)}", "city": rng.choice(cities)["name"],
                  "founded": rng.randint(1700, 2015)} for name in _unique_names(rng, n_places, 2, taken)]
    people = [{"name": f"{first} {last}", "born": rng.choice(cities)["name"], "employer": rng.choice(companies)["name"],
               "job": rng.choice(_JOBS), "born_year": rng.randint(1900, 2001)}
              for first, last in zip(_unique_names(rng, n_people, 2, taken), _unique_names(rng, n_people, 2, taken))]
    corpus = []
    for person in people:
        corpus.append({"id": f"person-{len(corpus):04d}", "contents": (
            f"{person['name']}\n{person['name']} is a {person['job']} born in {person['born_year']} in the city of "
            f"{person['born']}. {person['name'].split()[0]} works for {person['employer']}.")})
    for city in cities:
        corpus.append({"id": f"city-{len(corpus):04d}", "contents": (
            f"{city['name']}\n{city['name']} is a city in the province of {city['province']}. "
            f"It was founded in {city['founded']}.")})
    for company in companies:
        corpus.append({"id": f"company-{len(corpus):04d}", "contents": (
            f"{company['name']}\n{company['name']} is a firm headquartered in {company['city']}, "
            f"founded in {company['founded']}.")})
    return people, cities, companies, corpus


def _doc_id(corpus: list[dict[str, str]], title: str) -> str:
    return next(doc["id"] for doc in corpus if doc["contents"].split("\n", 1)[0] == title)


def _qa_task(index: int, person: dict, pattern: int, cities: dict, companies: dict,
             corpus: list[dict[str, str]]) -> Task:
    if pattern == 0:
        city = cities[person["born"]]
        question = f"In which province is the city where {person['name']} was born?"
        answer = city["province"]
        hops = (Hop(f"{person['name']}", _doc_id(corpus, person["name"]), f"born in {city['name']}"),
                Hop(f"{city['name']} province", _doc_id(corpus, city["name"]), f"province of {answer}"))
    elif pattern == 1:
        company = companies[person["employer"]]
        question = f"In what year was the company that {person['name']} works for founded?"
        answer = str(company["founded"])
        hops = (Hop(f"{person['name']}", _doc_id(corpus, person["name"]), f"works for {company['name']}"),
                Hop(f"{company['name']}", _doc_id(corpus, company["name"]), f"founded in {answer}"))
    else:
        company = companies[person["employer"]]
        question = f"In which city is the employer of {person['name']} headquartered?"
        answer = company["city"]
        hops = (Hop(f"{person['name']}", _doc_id(corpus, person["name"]), f"works for {company['name']}"),
                Hop(f"{company['name']} headquarters", _doc_id(corpus, company["name"]), f"headquartered in {answer}"))
    return Task(id=f"qa-{index:04d}", kind="qa", question=question, answer=answer, hops=hops)


def _math_task(rng: random.Random, index: int) -> Task:
    pattern = rng.randrange(5)
    if pattern == 0:
        a, b, c = rng.randint(10**5, 10**6), rng.randint(10**5, 10**6), rng.randint(10**3, 10**6)
        question, code = f"What is {a} * {b} - {c}?", f"print({a} * {b} - {c})"
        answer = a * b - c
    elif pattern == 1:
        a, e, m = rng.randint(3, 99), rng.randint(100, 999), rng.choice([997, 1009, 10007, 65537])
        question, code = f"What is the remainder when {a}^{e} is divided by {m}?", f"print(pow({a}, {e}, {m}))"
        answer = pow(a, e, m)
    elif pattern == 2:
        a, e = rng.randint(2, 9), rng.randint(60, 200)
        question = f"What is the sum of the decimal digits of {a}^{e}?"
        code = f"print(sum(int(d) for d in str({a} ** {e})))"
        answer = sum(int(d) for d in str(a**e))
    elif pattern == 3:
        n = rng.randint(1000, 20000)
        question = f"How many prime numbers are less than {n}?"
        code = f"import sympy\nprint(sympy.primepi({n - 1}))"
        answer = _count_primes_below(n)
    else:
        n = rng.randint(500, 5000)
        question = f"What is the sum of the squares of the integers from 1 to {n}?"
        code = f"print(sum(i * i for i in range(1, {n + 1})))"
        answer = n * (n + 1) * (2 * n + 1) // 6
    return Task(id=f"math-{index:04d}", kind="math", question=question, answer=str(answer), solution_code=code)


def _arith_task(rng: random.Random, index: int, digits: int) -> Task:
    low, high = 10 ** (digits - 1), 10**digits - 1
    a, b = rng.randint(low, high), rng.randint(low, high)
    return Task(id=f"arith-{index:04d}", kind="math", question=f"What is {a} * {b}?", answer=str(a * b),
                solution_code=f"print({a} * {b})")


def _chain_tasks(rng: random.Random, n: int, people: list[dict], cities: list[dict], companies: list[dict],
                 corpus: list[dict[str, str]], year: int) -> list[Task]:
    entities = ([("person", p) for p in people] + [("company", c) for c in companies] +
                [("city", c) for c in cities])
    if n > len(entities):
        raise ValueError(f"data.synthetic.n_chain={n} exceeds the {len(entities)} people, companies and cities of "
                         "the generated world (one question each); raise data.synthetic.n_entities (people; cities "
                         "and companies are a third of it each) or lower n_chain")
    rng.shuffle(entities)
    return [_chain_task(i, kind, entity, corpus, year) for i, (kind, entity) in enumerate(entities[:n])]


def _chain_task(index: int, kind: str, entity: dict, corpus: list[dict[str, str]], year: int) -> Task:
    name = entity["name"]
    if kind == "person":
        value, subject, event = entity["born_year"], name, "born"
    else:
        value, subject, event = entity["founded"], name if kind == "company" else f"the city of {name}", "founded"
    return Task(id=f"chain-{index:04d}", kind="chain",
                question=f"How many years passed from the year {subject} was {event} to {year}?",
                answer=str(year - value), solution_code=f"print({year} - {value})",
                hops=(Hop(name, _doc_id(corpus, name), f"{event} in {value}"),))


def _count_primes_below(n: int) -> int:
    sieve = bytearray([1]) * n
    sieve[:2] = b"\x00\x00"[: min(2, n)]
    for i in range(2, int(n**0.5) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytearray(len(range(i * i, n, i)))
    return sum(sieve)


def generate(cfg: SyntheticSection) -> SyntheticSet:
    rng = random.Random(cfg.seed)
    people, cities, companies, corpus = _world(rng, cfg.n_entities)
    by_city = {c["name"]: c for c in cities}
    by_company = {c["name"]: c for c in companies}
    tasks = [_math_task(rng, i) for i in range(cfg.n_math)]
    combos = [(person, pattern) for person in people for pattern in range(3)]  # each question asked once
    rng.shuffle(combos)
    tasks += [_qa_task(i, person, pattern, by_city, by_company, corpus)
              for i, (person, pattern) in enumerate(combos[: cfg.n_qa])]
    # drawn after every other family, so n_arith = 0 leaves the other tasks byte for byte as before
    tasks += [_arith_task(rng, i, cfg.arith_digits) for i in range(cfg.n_arith)]
    if cfg.n_chain:  # drawn last, so n_chain = 0 leaves the other families byte for byte as before
        tasks += _chain_tasks(rng, cfg.n_chain, people, cities, companies, corpus, cfg.chain_year)
    rng.shuffle(tasks)
    tasks = _dedupe(tasks)
    n_test = round(len(tasks) * cfg.test_fraction)
    n_valid = round(len(tasks) * cfg.valid_fraction)
    splits = ["test"] * n_test + ["valid"] * n_valid + ["train"] * (len(tasks) - n_test - n_valid)
    tasks = [Task(**{**t.__dict__, "split": s}) for t, s in zip(tasks, splits)]
    return SyntheticSet(tasks=tasks, corpus=corpus)


def _dedupe(tasks: list[Task]) -> list[Task]:
    seen: set[str] = set()
    unique = []
    for task in tasks:
        if task.question not in seen:
            seen.add(task.question)
            unique.append(task)
    return unique
