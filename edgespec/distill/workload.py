"""Prompt sets for distillation: read from a file, or a synthetic robot workload built from templates.

A robot asks the same kinds of things all day (pick-and-place plans, navigation plans, status reports), so a
drafter trained on the target's own answers to varied requests of that kind accepts far more than a general one.
:func:`robot_prompts` builds such requests from templates and word lists (seeded, reproducible). It never
returns a prompt of the benchmark set verbatim: those stay held out for measuring.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import yaml

from edgespec.errors import ConfigError

_COLOURS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple", "grey", "silver"]
_OBJECTS = ["cube", "cup", "bottle", "box", "screwdriver", "ball", "bolt", "wrench", "sponge", "book", "can",
            "tube", "bag", "plate", "phone"]
_PLACES = ["tray", "table", "shelf A", "shelf C", "bin", "drawer", "conveyor belt", "charging dock", "cart",
           "workbench", "left shelf", "basket"]
_FIELDS = [["action", "target", "destination", "safety_check"], ["step", "action", "object", "location"],
           ["action", "object", "pose", "gripper_force"], ["waypoint", "constraint", "expected_state"],
           ["id", "action", "params", "timeout_s"], ["action", "target", "speed", "check"]]
_HAZARDS = ["a wet floor marker", "a moving cart", "a person walking by", "a closed door", "a cable on the floor",
            "a narrow corridor", "a forklift", "a low ceiling beam", "a spilled liquid", "a stack of boxes"]
_ROOMS = ["the charging dock", "shelf B", "the kitchen", "the loading bay", "room 4", "the assembly line",
          "the storage room", "the front desk", "workstation 2", "the elevator"]

_TEMPLATES = [
    "Output a compact JSON action list for a robot to pick up the {c1} {o1}, place it on the {p1}, then report "
    "success. Use fields {fields}.",
    "Output a JSON action list for a robot arm to move the {c1} {o1} from the {p1} to the {p2}. Use fields {fields}.",
    "Return a JSON plan for a robot to stack the {c1} {o1} on top of the {c2} {o2}, then check that the stack is "
    "stable. Use fields {fields}.",
    "Plan robot navigation from {r1} to {r2} while avoiding {h1} and {h2}. Return concise JSON steps with {fields}.",
    "Give a JSON list of steps for a mobile robot to fetch the {c1} {o1} from {r1} and bring it to {r2}. "
    "Use fields {fields}.",
    "Write a compact JSON action sequence for a robot to sort the {c1} {o1} and the {c2} {o2} into the {p1} and the "
    "{p2}. Include {fields}.",
    "The robot sees a {c1} {o1} next to a {c2} {o2} on the {p1}. Output a JSON action list to pick up only the "
    "{c1} {o1} and drop it in the {p2}. Use fields {fields}.",
    "Output a JSON status report for a robot that just delivered the {c1} {o1} to {r2}. Use fields {fields}.",
    "Describe in JSON how a robot should open the {p1}, take out the {c1} {o1} and close it again. "
    "Use fields {fields}.",
    "Return a JSON plan for a robot to inspect the {p1} for {h1} and report what it found. Use fields {fields}.",
]
_GENERAL = [
    "Explain in a few sentences how a robot gripper decides how hard to squeeze an object.",
    "What are three safety rules for a mobile robot working near people? Answer briefly.",
    "Explain why a robot should check its battery level before starting a long task.",
    "Summarise what a waypoint is in robot navigation, in two sentences.",
    "Explain what JSON is and why robots use it to exchange plans.",
    "List the steps a robot takes to recover after dropping an object.",
    "Explain how a robot can tell that a path is blocked.",
    "Why do robot arms move slowly near humans? Answer in one paragraph.",
]


def bench_prompt_texts() -> set[str]:
    """The user texts of the packaged benchmark set (held out from every generated workload)."""
    from edgespec.bench.prompts import load_prompts

    return {p.user for p in load_prompts()}


def robot_prompts(n: int, seed: int = 0, general_share: float = 0.1) -> list[str]:
    """``n`` distinct robot-workload prompts (about ``general_share`` of them short explanations), seeded."""
    rng = random.Random(seed)
    held_out = bench_prompt_texts()
    out: list[str] = []
    seen: set[str] = set(held_out)
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise ValueError(f"cannot make {n} distinct robot prompts from the templates")
        if rng.random() < general_share:
            text = rng.choice(_GENERAL)
        else:
            c1, c2 = rng.sample(_COLOURS, 2)
            o1, o2 = rng.sample(_OBJECTS, 2)
            p1, p2 = rng.sample(_PLACES, 2)
            r1, r2 = rng.sample(_ROOMS, 2)
            h1, h2 = rng.sample(_HAZARDS, 2)
            fields = rng.choice(_FIELDS)
            text = rng.choice(_TEMPLATES).format(
                c1=c1, c2=c2, o1=o1, o2=o2, p1=p1, p2=p2, r1=r1, r2=r2, h1=h1, h2=h2,
                fields=", ".join(fields[:-1]) + ", and " + fields[-1])
        if text in seen:
            continue
        seen.add(text)
        out.append(text)
    return out


# One site's own traffic (a warehouse picking cell): its own item names, locations and JSON schema, none of which
# the generic robot workload above uses. A drafter trained on the generic workload meets it for the first time in
# the request log; `edgespec distill --from-log --init` adapts it (docs/drafters.md).
_SITE_ITEMS = ["tote 14", "tote 27", "pallet P-3", "carton of M8 nuts", "crate of valves", "box of fuses",
               "case of filters", "bag of rivets", "spool of cable", "tray of gaskets"]
_SITE_SLOTS = ["rack R2 level 3", "rack R5 level 1", "dock door 2", "dock door 6", "packing station 1",
               "packing station 4", "quarantine zone", "returns cage", "buffer lane B", "outbound lane 7"]
_SITE_TEMPLATES = [
    "Pick order {n}: move the {i1} from {s1} to {s2}. Reply with a JSON list of steps with fields sku_ref, "
    "from_slot, to_slot, qty and scan_ok.",
    "Restock: bring {q} units from the {i1} at {s1} to {s2}, then confirm. Reply with JSON steps with fields "
    "sku_ref, from_slot, to_slot, qty and scan_ok.",
    "Cycle count at {s1}: count the {i1} and the {i2} and report. Reply in JSON with fields slot, sku_ref, "
    "counted, expected and mismatch.",
    "Return order {n}: take the {i1} from {s1} to {s2} and log its condition. Reply with JSON steps with fields "
    "sku_ref, from_slot, to_slot, qty and scan_ok.",
]


def site_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct requests of one site's traffic (a warehouse picking cell; see the note above), seeded."""
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        i1, i2 = rng.sample(_SITE_ITEMS, 2)
        s1, s2 = rng.sample(_SITE_SLOTS, 2)
        text = rng.choice(_SITE_TEMPLATES).format(i1=i1, i2=i2, s1=s1, s2=s2, n=rng.randint(1000, 9999),
                                                  q=rng.randint(2, 40))
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def load_prompt_file(path: str | Path) -> list[str]:
    """User prompts from a file: ``.yaml``/``.yml`` (a list of strings or of ``{user: ...}``), ``.jsonl``
    (``{"user": ...}`` or ``{"prompt": ...}`` per line) or plain text (one prompt per non-empty line)."""
    return [text for text, _ in load_labelled_prompts(path)]


def load_labelled_prompts(path: str | Path) -> list[tuple[str, dict[str, str]]]:
    """:func:`load_prompt_file` with each prompt's labels: the ``template`` and ``source`` keys of a mapping
    entry (``edgespec distill --holdout-by`` holds out whole templates or sources); {} for plain entries."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"prompt file not found: {p}")
    text = p.read_text()
    items: list[object]
    if p.suffix in (".yaml", ".yml"):
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"prompt file {p} is not valid YAML: {e}") from None
        if not isinstance(data, list):
            raise ConfigError(f"prompt file {p} must hold a list of prompts")
        items = data
    elif p.suffix == ".jsonl":
        items = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ConfigError(f"prompt file {p} line {n} is not valid JSON: {e}") from None
    else:
        items = [line.strip() for line in text.splitlines() if line.strip()]
    out = []
    for i, item in enumerate(items):
        labels: dict[str, str] = {}
        if isinstance(item, dict):
            labels = {k: str(item[k]) for k in ("template", "source") if item.get(k) is not None}
            item = item.get("user", item.get("prompt"))
        if not isinstance(item, str) or not item.strip():
            raise ConfigError(f"prompt file {p}: entry {i} is not a prompt string (or a mapping with 'user')")
        out.append((item, labels))
    if not out:
        raise ConfigError(f"prompt file {p} holds no prompts")
    return out
