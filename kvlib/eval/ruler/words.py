"""Word lists the RULER-style tasks are built from, written here so that nothing is downloaded.

RULER draws needle keys ("adjective-noun"), common words and its essay haystack from files
(wonderwords' lists, Paul Graham's essays); kvlib builds the same kinds of text from these lists.
:func:`word_pool` adds pronounceable made-up words when a task needs more distinct words than the
lists hold (RULER falls back to a second, larger list in the same case).
"""

from __future__ import annotations

import random

NOUNS = tuple(
    sorted(
        set(
            """
    account action answer apple area argument army artist autumn baby balance ball band bank basket
    battle beach bear bell bird blanket boat body bone book border bottle box branch bread bridge
    brother bucket building butter button cabin cake camera camp candle canvas captain card carpet
    castle cat cattle chain chair chalk channel chapter cheese cherry chicken child church circle city
    clock cloud coach coast coat coffee collar colony comet copper corner cottage cotton country cousin
    crew crowd crown cup curtain cushion dance desert desk diamond dinner doctor dog dragon drawer dream
    dress drum eagle earth engine envelope factory farm feather fence field finger fire fish flag flame
    flower forest fork fountain friend frog fruit garden gate giant glass glove goat gold grain grape
    guitar hammer harbor harvest hat hill horse hospital hotel house island jacket jewel journey judge
    kettle key king kitchen kite knife ladder lake lamp lantern lawyer leaf lemon letter library lion
    machine map market meadow message metal mirror monkey moon mountain museum needle nest night ocean
    office orange orchard owl painter palace paper parcel parrot path pencil pepper piano picture pillow
    pilot planet plate poem pocket pond potato prince prison puzzle queen rabbit rail river road rocket
    roof room rope sailor salt school scissors sea seed shadow sheep shelf ship shirt shoe shop silver
    singer sister sky snake soldier song spoon spring square stage star station stone storm stove street
    student sugar summer sun sword table tailor teacher temple tent thread throne ticket tiger toast
    tower town toy tractor train treasure tree truck tunnel umbrella valley village violin voice wagon
    wall watch water wheel whistle window winter wire wolf wood wool worker yard
""".split()
        )
    )
)

ADJECTIVES = tuple(
    sorted(
        set(
            """
    able ancient angry anxious ashamed awkward bald bitter black bold brave brief bright brisk broad
    broken brown busy calm careful cheap cheerful chilly clean clever cloudy clumsy cold common cool
    crazy crisp crooked cruel curious damp dark dear deep dense dirty distant dizzy dry dull eager early
    easy elegant empty endless faint fair famous fancy fast fierce flat fluffy foolish formal fragile
    free fresh friendly frozen funny gentle giant glad golden graceful grand gray great green grumpy
    guilty happy hard harsh heavy helpful hidden hollow honest huge humble hungry icy idle important
    jolly keen kind large late lazy light little lively lonely long loud loyal lucky mad magic massive
    mellow merry mighty modern narrow nasty neat nervous new nice noble noisy odd old orange patient
    plain polite poor precious proud purple quick quiet rapid rare raw ready red rich rough round royal
    rude rusty sad safe salty scary sharp shiny short shy silent silly simple slim slow small smooth
    soft solid sour spare spicy splendid steep sticky stiff strange strict strong sturdy sudden sunny
    sweet swift tall tame tender thick thin tidy tiny tired tough ugly upset usual vast violet warm weak
    wealthy weary wet white whole wide wild wise witty wooden young
""".split()
        )
    )
)

VERBS = tuple(
    sorted(
        set(
            """
    accepted admired allowed answered arranged asked attacked avoided baked balanced borrowed bought
    boxed brought built buried called carried caught chased checked cleaned climbed collected copied
    counted covered crossed danced delivered described divided doubted dragged drew dropped earned
    emptied entered explored fetched filled fixed folded followed found gathered greeted guarded guided
    handled hid hugged hunted imagined invited joined juggled kicked kept knocked launched lifted
    loaded locked marked measured mended moved noticed opened ordered packed painted passed planted
    played polished pulled pushed questioned raised reached repaired rescued returned rolled sailed
    saved searched sent shared signed sold sorted spotted stacked stitched stored studied suggested
    supported surprised swept taught tested thanked tied touched traded trapped visited warned washed
    watched weighed welcomed wrapped wrote
""".split()
        )
    )
)

PREPOSITIONS = ("near", "behind", "under", "beside", "after", "before", "around", "across", "beyond", "inside")
OPENERS = ("Later", "Meanwhile", "In the end", "Perhaps", "Still", "Often", "At first", "By then", "In practice", "Even so")

SYLLABLES = tuple(c + v for c in "bdfghklmnprstvz" for v in "aeiou")


def key_word(rng: random.Random) -> str:
    """A RULER-style needle key: ``adjective-noun``."""
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def made_up_word(rng: random.Random) -> str:
    """A pronounceable word of three syllables that is in none of the lists."""
    return "".join(rng.choice(SYLLABLES) for _ in range(3))


def word_pool(count: int, rng: random.Random) -> list[str]:
    """``count`` distinct words in a random order: the lists' words first, made-up words past them."""
    real = sorted(set(NOUNS) | set(ADJECTIVES) | set(VERBS))
    if count <= len(real):
        return rng.sample(real, count)
    words, seen = list(real), set(real)
    while len(words) < count:
        word = made_up_word(rng)
        if word not in seen:
            seen.add(word)
            words.append(word)
    rng.shuffle(words)
    return words
