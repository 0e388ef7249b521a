"""A stream of robot requests worded unlike the distillation workload, for the session bench.

``edgespec.distill.workload`` trains the demo drafter on ten request templates; measuring on those templates says
how well the drafter learnt them, not what a new deployment gets. These requests come from other robots (a
drone, a hospital delivery cart, a lab pipetting arm, a greenhouse rover, a humanoid, a dishwashing cell),
other tasks and other phrasing (questions, imperatives, terse operator notes), with other JSON field names. A
deployment still repeats itself, as robots do: each robot's requests share a shape, which is what a drafter over
earlier outputs can learn within the session. Seeded and reproducible.
"""

from __future__ import annotations

import random

_ROBOTS: list[tuple[list[str], dict[str, list[str]]]] = [
    # (templates, word lists); every template of a robot uses only its own lists
    ([
        "Drone D-{n}: survey the {zone} and photograph any {thing}. Answer only with JSON: an array of legs, "
        "each with leg, altitude_m, heading_deg and camera.",
        "hey, can drone D-{n} fly over the {zone} and check for {thing}? i need a JSON array of legs, each with "
        "leg, altitude_m, heading_deg and camera",
        "Flight request for D-{n}. Area: the {zone}. Look for: {thing}. Reply as JSON legs (leg, altitude_m, "
        "heading_deg, camera), nothing else.",
    ], {"zone": ["north orchard", "east parking lot", "solar field", "river bank", "quarry edge", "roof of hall 3"],
        "thing": ["broken panels", "standing water", "stray animals", "smoke", "fallen branches", "open gates"]}),
    ([
        "The delivery cart in ward {w} must take {item} to {dest}. Produce a JSON route: a list of objects with "
        "segment, corridor, door_action and eta_s.",
        "Route the hospital cart from ward {w} to {dest} carrying {item}; respond with a JSON list of segment, "
        "corridor, door_action and eta_s objects.",
        "cart job: {item} -> {dest} (start ward {w}). json route please, fields segment/corridor/door_action/eta_s",
    ], {"w": ["2A", "3C", "4B", "5D", "6A"],
        "item": ["blood samples", "clean linen", "a medication tray", "lunch trolleys", "sterile kits"],
        "dest": ["the pharmacy", "the lab on level 1", "operating room 4", "the laundry", "ward 7 nurse station"]}),
    ([
        "Pipetting arm: transfer {vol} microlitres from {src} to {dst}, mixing {mix} times. Give the protocol as "
        "JSON steps with op, source_well, target_well, volume_ul and tip.",
        "Write the liquid-handling protocol (JSON steps: op, source_well, target_well, volume_ul, tip) to move "
        "{vol} ul from {src} into {dst} and mix {mix} times.",
    ], {"vol": ["5", "10", "25", "50", "120", "200"], "src": ["well A1", "well B4", "reservoir 2", "tube rack slot 3"],
        "dst": ["well H12", "plate 2 column 6", "well C3", "the waste trough"], "mix": ["two", "three", "five"]}),
    ([
        "Greenhouse rover: row {row} needs {job}. Return a JSON work order listing stops, each with stop, "
        "plant_id, action and notes.",
        "Please plan the rover's pass along row {row} to {job}. JSON only: stops with stop, plant_id, action, "
        "notes.",
    ], {"row": ["3", "7", "12", "15", "21"],
        "job": ["watering of the seedlings", "checking leaves for mildew", "harvesting ripe tomatoes",
                "measuring soil moisture", "tying up the cucumber vines"]}),
    ([
        "Humanoid H{n}, the operator says: '{say}'. Report what you will do as JSON with intent, steps (array of "
        "strings), risk and ask_operator.",
        "Operator to humanoid H{n}: {say} -- reply with a JSON object: intent, steps, risk, ask_operator.",
    ], {"say": ["hand me the drill from the top shelf", "hold this panel steady while I screw it in",
                "tidy the cables under the desk", "carry the boxes by the door to the van",
                "wipe the spill near the sink"]}),
    ([
        "Dish cell status after shift {shift}: racks washed {racks}, faults {faults}. Summarise it as a JSON "
        "report with shift, racks, faults, water_l and next_maintenance.",
        "Make a JSON shift report for the dishwashing cell: shift {shift}, {racks} racks done, faults: {faults}. "
        "Keys: shift, racks, faults, water_l, next_maintenance.",
    ], {"shift": ["morning", "late", "night", "weekend"], "racks": ["48", "63", "71", "90", "112"],
        "faults": ["none", "one jammed conveyor", "low rinse aid", "a door sensor error", "two dropped cups"]}),
]


def robot_stream(n: int, seed: int = 0) -> list[str]:
    """``n`` robot requests, each from a robot and template drawn at random (seeded); repeats allowed, as a
    real deployment repeats itself."""
    if n < 1:
        raise ValueError(f"a robot stream needs at least 1 request, not {n}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        templates, words = rng.choice(_ROBOTS)
        fill = {key: rng.choice(values) for key, values in words.items()}
        fill["n"] = str(rng.randrange(1, 9))
        out.append(rng.choice(templates).format(**fill))
    return out
