"""The built-in demo corpus: templated multi-step arithmetic word problems with worked
chains and answers, generated from a seed so that every machine gets the same rows.

Rows have the generic adapter's columns (question, cot, answer, id) plus `topic`, an extra
column that the compression job passes through."""
from __future__ import annotations

import random

NAMES = ["Ava", "Ben", "Carla", "Dev", "Elena", "Farid", "Grace", "Hugo", "Iris", "Jamal",
         "Keiko", "Liam", "Mona", "Noah", "Olga", "Priya"]
ITEMS = ["apples", "pencils", "cookies", "stickers", "marbles", "oranges", "cards", "books"]
PLANTS = ["tomato plants", "rose bushes", "sunflowers", "pepper plants"]
THINGS = ["bike", "game", "jacket", "telescope"]


def _shopping(r: random.Random, name: str) -> tuple[str, str, int, str]:
    item = r.choice(ITEMS)
    n, price = r.randint(3, 9), r.randint(2, 12)
    cost = n * price
    bill = (cost // 10 + r.randint(1, 3)) * 10
    q = (f"{name} buys {n} {item} at ${price} each and pays with a ${bill} bill. "
         f"How much change does {name} get?")
    c = (f"Each of the {item} costs ${price}, so {n} of them cost {n} * {price} = ${cost}. "
         f"{name} pays with ${bill}, so the change is {bill} - {cost} = ${bill - cost}.")
    return q, c, bill - cost, "shopping"


def _eggs(r: random.Random, name: str) -> tuple[str, str, int, str]:
    laid, eat, bake, price = r.randint(12, 24), r.randint(1, 4), r.randint(2, 5), r.randint(2, 4)
    used = eat + bake
    left = laid - used
    q = (f"{name}'s hens lay {laid} eggs a day. {name} eats {eat} every morning and bakes "
         f"with {bake}. {name} sells the rest at ${price} per egg. How many dollars does "
         f"{name} make every day?")
    c = (f"The hens lay {laid} eggs. {name} uses {eat} + {bake} = {used} eggs. That leaves "
         f"{laid} - {used} = {left} eggs to sell. At ${price} each, {name} makes "
         f"{left} * {price} = ${left * price}.")
    return q, c, left * price, "eggs"


def _walking(r: random.Random, name: str) -> tuple[str, str, int, str]:
    weekday, weekend, weeks = r.randint(2, 6), r.randint(3, 9), r.randint(2, 5)
    w5, w2 = 5 * weekday, 2 * weekend
    week = w5 + w2
    q = (f"{name} walks {weekday} km on every weekday and {weekend} km on each day of the "
         f"weekend. How many km does {name} walk in {weeks} weeks?")
    c = (f"On the 5 weekdays {name} walks 5 * {weekday} = {w5} km. On the 2 weekend days "
         f"{name} walks 2 * {weekend} = {w2} km. So one week is {w5} + {w2} = {week} km. "
         f"In {weeks} weeks that is {week} * {weeks} = {week * weeks} km.")
    return q, c, week * weeks, "walking"


def _sharing(r: random.Random, name: str) -> tuple[str, str, int, str]:
    item = r.choice(ITEMS)
    friends, each = r.randint(2, 6), r.randint(3, 8)
    boxes, per_box = r.randint(1, 3), r.randint(2, 5)
    total = friends * each
    while boxes * per_box >= total:  # keep some to start with (total >= 6, so this ends)
        if boxes > 1:
            boxes -= 1
        else:
            per_box -= 1
    have = total - boxes * per_box
    q = (f"{name} has {have} {item} and buys {boxes} boxes with {per_box} {item} in each. "
         f"{name} shares all of them equally among {friends} friends. How many {item} does "
         f"each friend get?")
    c = (f"The boxes hold {boxes} * {per_box} = {boxes * per_box} {item}. Together {name} has "
         f"{have} + {boxes * per_box} = {total} {item}. Shared among {friends} friends, each "
         f"gets {total} / {friends} = {each} {item}.")
    return q, c, each, "sharing"


def _savings(r: random.Random, name: str) -> tuple[str, str, int, str]:
    weekly, weeks = r.randint(5, 20), r.randint(4, 12)
    saved = weekly * weeks
    spent = r.randint(saved // 4, saved - 1)
    thing = r.choice(THINGS)
    q = (f"{name} saves ${weekly} every week for {weeks} weeks and then spends ${spent} on a "
         f"{thing}. How much money does {name} have left?")
    c = (f"In {weeks} weeks {name} saves {weekly} * {weeks} = ${saved}. After buying the "
         f"{thing}, {name} has {saved} - {spent} = ${saved - spent} left.")
    return q, c, saved - spent, "savings"


def _garden(r: random.Random, name: str) -> tuple[str, str, int, str]:
    plant = r.choice(PLANTS)
    rows, per_row = r.randint(3, 8), r.randint(4, 10)
    total = rows * per_row
    died, planted = r.randint(1, total // 3), r.randint(2, 9)
    q = (f"{name}'s garden has {rows} rows of {per_row} {plant}. {died} of them die, and "
         f"{name} plants {planted} new ones. How many {plant} are in the garden now?")
    c = (f"At first there are {rows} * {per_row} = {total} {plant}. After {died} die there are "
         f"{total} - {died} = {total - died}. With {planted} new ones there are "
         f"{total - died} + {planted} = {total - died + planted} {plant}.")
    return q, c, total - died + planted, "garden"


TEMPLATES = [_shopping, _eggs, _walking, _sharing, _savings, _garden]


DEMO_SIZE = 24  # `make demo`'s corpus (`--input demo`): a first run that ends in about a minute


def demo_corpus(n: int = DEMO_SIZE, seed: int = 0) -> list[dict]:
    """`n` problems, the templates in turn, numbers and names drawn from `seed`."""
    if n < 1:
        raise ValueError(f"the demo corpus needs at least one problem, not {n}")
    r = random.Random(seed)
    rows = []
    for i in range(n):
        question, cot, answer, topic = TEMPLATES[i % len(TEMPLATES)](r, r.choice(NAMES))
        rows.append({"id": f"demo-{seed}-{i:04d}", "question": question, "cot": cot,
                     "answer": str(answer), "topic": topic})
    return rows
