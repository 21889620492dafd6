"""Retrieval tasks: RULER's needle-in-a-haystack variants and variable tracking, as `Draft`s for `fit`.

Wording (needle, preamble, question, answer prefix) is RULER's (scripts/data/synthetic/constants.py and
niah.py, variable_tracking.py); RULER's leading "Answer:" is left to the prompt layout, which already ends
with it.
"""

from __future__ import annotations

import random
import string
import uuid

from longctx_cli.tasks import haystack
from longctx_cli.tasks.fitting import Draft

# task: (haystack, value type, keys, values per key, keys asked) as in RULER's synthetic.yaml
# (niah_multikey is RULER's niah_multikey_1).
NIAH = {
    "niah_single_1": ("filler", "numbers", 1, 1, 1),
    "niah_single_2": ("prose", "numbers", 1, 1, 1),
    "niah_single_3": ("prose", "uuids", 1, 1, 1),
    "niah_multikey": ("prose", "numbers", 4, 1, 1),
    "niah_multivalue": ("prose", "numbers", 1, 4, 1),
    "niah_multiquery": ("prose", "numbers", 4, 1, 4),
}
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
VT_HOPS = 4
VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
# Where sampled needles may go: RULER's 40 evenly spaced depths.
DEPTH_GRID = [round(i / 39, 2) for i in range(40)]

# Keys are adjective-noun pairs, as RULER draws them from wonderwords' lists.
ADJECTIVES = """able acid angry ashy aware bent bitter black bland blue bold brave brief bright brisk broad
calm cheap chilly clean clever cloudy coarse cold cool crisp curly damp dark deep dense dizzy dry dusty eager
early empty even faint fancy fast fierce flat fluffy fresh frosty funny gentle giant glad glossy golden grand
green grumpy hairy happy harsh heavy hollow honest huge humble icy idle jolly juicy keen lazy light little
lively loud lucky mellow merry messy mild misty modern muddy narrow neat noisy odd orange pale plain plump
polite proud purple quick quiet rapid rare rough round royal rusty sandy shaggy sharp shiny silent silky
silver sleepy slim slow small smooth soft solid sour spicy steep sticky stormy strange sturdy sunny sweet
swift tall tame tender tidy tiny tough vast velvet vivid warm weary wet wide wild windy wise witty young""".split()
NOUNS = """acorn anchor anvil apple apron arrow badge bagel banjo barrel basket beacon beetle bell bench
blanket bottle bucket button cabin cactus camera candle canoe canyon carpet castle cello chimney cobbler
comet compass cookie cottage crayon cricket crown cushion dagger desk diamond dolphin donkey drum eagle easel
engine falcon feather fiddle flute forest fountain garden garlic glacier goblet guitar hammer harbor helmet
hippo island jacket jigsaw kettle kitten ladder lantern lemon lizard magnet mango marble meadow mitten
monkey needle noodle oyster paddle palace parrot pebble pencil pepper piano pillow pirate planet pocket
pony puddle pumpkin quilt rabbit radish ribbon robot rocket saddle sailor scarf shovel spider spoon
squirrel statue stove teapot tiger toaster tractor trumpet tulip turnip umbrella violin wagon walrus
whistle window wizard yacht zebra""".split()


def niah_draft(task: str, rng: random.Random, n_chars: int, depths: list[float] | None) -> Draft:
    hay_kind, kind, n_keys, n_values, n_asked = NIAH[task]
    keys = _distinct(rng, n_keys, lambda: f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}")
    drawn = _distinct(rng, n_keys * n_values, lambda: _value(rng, kind))
    values = [drawn[i * n_values : (i + 1) * n_values] for i in range(n_keys)]
    needles = [NEEDLE.format(kind=kind, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    depths = placement(rng, depths, len(needles))
    asked = rng.sample(range(n_keys), n_asked)
    query = _enumerate([keys[i] for i in asked])
    expected = [v for i in asked for v in values[i]]

    if n_asked * n_values == 1:
        preamble = (f"A special magic {kind[:-1]} is hidden within the following text. Make sure to memorize "
                    f"it. I will quiz you about the {kind[:-1]} afterwards.\n")
        question = f"What is the special magic {kind[:-1]} for {query} mentioned in the provided text?"
        prefix = f"The special magic {kind[:-1]} for {query} mentioned in the provided text is"
    else:
        preamble = (f"Some special magic {kind} are hidden within the following text. Make sure to memorize "
                    f"it. I will quiz you about the {kind} afterwards.\n")
        question = f"What are all the special magic {kind} for {query} mentioned in the provided text?"
        prefix = f"The special magic {kind} for {query} mentioned in the provided text are"

    hay = haystack.filler(n_chars) if hay_kind == "filler" else haystack.prose(rng, n_chars)
    return Draft(
        render=lambda size: preamble + hay.with_needles(size, needles, depths),
        tail=hay.continuation, max_size=hay.max_size, question=question, answer_prefix=prefix,
        expected=expected, needles=needles, depths=depths,
    )


def vt_draft(rng: random.Random, n_chars: int, depths: list[float] | None) -> Draft:
    """Variable tracking: one chain `VAR A = 12345`, `VAR B = VAR A`, ... (4 hops) in the filler; all five
    names are expected. A short solved example of the same task comes first, as in RULER."""
    value, example_value = _distinct(rng, 2, lambda: str(rng.randint(10000, 99999)))
    names = _distinct(rng, VT_HOPS + 1, lambda: "".join(rng.choices(string.ascii_uppercase, k=5)))
    chain = _chain(names, value)
    depths = placement(rng, depths, len(chain))
    question, prefix = _vt_question(value)

    example_names = _distinct(rng, VT_HOPS + 1, lambda: "".join(rng.choices(string.ascii_uppercase, k=3)))
    example_depths = sorted(rng.sample(DEPTH_GRID, VT_HOPS + 1))
    example_hay = haystack.filler(len(haystack.FILLER) * 12)
    ex_question, ex_prefix = _vt_question(example_value)
    example_text = example_hay.with_needles(
        example_hay.max_size, _chain(example_names, example_value), example_depths)
    example = (f"{VT_INTRO}{example_text}\n\nQuestion: {ex_question}\n"
               f"Answer: {ex_prefix} {' '.join(example_names)}\n\n")

    hay = haystack.filler(n_chars)
    return Draft(
        render=lambda size: example + VT_INTRO + hay.with_needles(size, chain, depths),
        tail=hay.continuation, max_size=hay.max_size, question=question, answer_prefix=prefix,
        expected=names, needles=chain, depths=depths,
    )



def placement(rng: random.Random, depths: list[float] | None, n: int) -> list[float]:
    """Depths for n needles, ascending: sampled from DEPTH_GRID, or the given ones (one value puts every
    needle there, n values one needle each)."""
    if depths is None:
        return sorted(rng.sample(DEPTH_GRID, n))
    if len(depths) == 1:
        return list(depths) * n
    if len(depths) != n:
        raise ValueError(f"expected 1 or {n} depths for this task's {n} needles, got {len(depths)}")
    return sorted(depths)


def _vt_question(value: str) -> tuple[str, str]:
    return (f"Find all variables that are assigned the value {value} in the text above.",
            f"According to the chain(s) of variable assignment in the text above, {VT_HOPS + 1} variables are "
            f"assigned the value {value}, they are:")


def _chain(names: list[str], value: str) -> list[str]:
    return [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(names, names[1:])]


def _value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _distinct(rng: random.Random, n: int, draw) -> list[str]:
    seen: list[str] = []
    while len(seen) < n:
        if (item := draw()) not in seen:
            seen.append(item)
    return seen


def _enumerate(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]
