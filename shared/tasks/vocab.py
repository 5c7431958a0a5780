"""The zoo's fixed word inventory.

Every synthetic task is written with these words, and each word is ONE token in the zoo tokenizer
(`shared/zoo/tokenizer.py`). The number of key/value candidates is the decisive lever for whether
a small model learns in-context lookup, so keys and values are 16 each; aliases are a second
spelling of the keys that only the QA receiver learns.
"""

from __future__ import annotations

# Entities (keys of facts).
KEYS: tuple[str, ...] = (
    "anna", "bruno", "clara", "dario", "elsa", "felix", "greta", "hugo",
    "iris", "jonas", "karla", "liam", "mira", "nils", "olga", "pavel",
)
# Attributes (values of facts).
VALUES: tuple[str, ...] = (
    "amber", "basil", "cedar", "delta", "ember", "fjord", "garnet", "harbor",
    "indigo", "jasper", "kelp", "lotus", "maple", "nectar", "onyx", "prism",
)
# Nicknames: ALIASES[i] names KEYS[i]. Only the QA receiver is fine-tuned to resolve them.
ALIASES: tuple[str, ...] = (
    "annie", "bru", "clary", "dari", "elsie", "flix", "gret", "hugi",
    "irie", "jojo", "kiki", "lim", "mimi", "nilo", "olly", "pavo",
)
# Document titles (the summarization-like task lists them).
TITLES: tuple[str, ...] = (
    "north", "south", "east", "west", "river", "forest", "valley", "summit",
    "island", "desert", "meadow", "canyon", "glacier", "harbour", "prairie", "tundra",
)
# Filler words for distractor sentences: never keys, values or titles, so a lookup can only
# match at a fact.
FILLER: tuple[str, ...] = (
    "the", "a", "old", "new", "small", "large", "quiet", "busy", "road", "town", "market", "bridge",
    "tower", "garden", "station", "school", "near", "beyond", "under", "above", "was", "is", "has",
    "had", "seen", "built", "opened", "closed", "many", "few", "people", "visitors", "during", "after",
    "before", "winter", "summer", "spring", "autumn", "morning", "evening", "often", "rarely", "and",
    "with", "without", "long", "short",
)
# Structure words.
DOC = "doc"          # starts a document: `doc <title>`
SEP = "."            # ends a fact / sentence
ASK = "ask"          # plain question: `ask <key>` -> value
WHO = "who"          # alias question: `who <alias>` -> value (QA receiver's task)
RECALL = "recall"    # recall block marker in pretraining: `recall k v k v ...`
ECHO = "echo"        # echo block marker in pretraining
TITLES_Q = "titles"  # summarization question: `titles` -> the document titles in order
ANSWER = "answer"    # separates a question from its answer
PLAIN = "plain"      # context header: facts mean what they say
CODED = "coded"      # context header: every value is written in the receiver's code (see tasks.py)
END = "end"          # ends a multi-token answer
STRUCTURE: tuple[str, ...] = (DOC, SEP, ASK, WHO, RECALL, ECHO, TITLES_Q, ANSWER, PLAIN, CODED, END)

# Python keywords / common identifiers get their own tokens so stdlib code is shorter.
CODE_WORDS: tuple[str, ...] = (
    "def", "return", "self", "if", "else", "elif", "for", "in", "not", "import", "from", "class",
    "None", "True", "False", "raise", "try", "except", "as", "while", "or",
    "lambda", "yield", "pass", "assert", "name", "len", "isinstance", "str", "int", "list", "dict",
)

ALL_WORDS: tuple[str, ...] = KEYS + VALUES + ALIASES + TITLES + FILLER + STRUCTURE + CODE_WORDS
assert len(set(ALL_WORDS)) == len(ALL_WORDS), "zoo words must be unique"
