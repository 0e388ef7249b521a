"""Structured requests for self-distillation: JSON plans, tool calls and status reports across many machines.

A drafter that generalizes must have seen the target answer in the shapes robots ask for (a JSON array of steps
with the keys the request names, a list of tool calls, a JSON status object) about things it was not trained on.
:func:`task_prompts` writes such requests over sixteen domains (a forklift, a welding cell, a lawn mower, a
kitchen robot, a smart home, a calendar ...), in eight wordings per form, with key names drawn per request; the
target's own answers to them are the training data (``edgespec distill --prompts tasks:N``), so the drafter learns
the target's habits, not ours. Every prompt is labelled with its domain (``--holdout-by template`` holds out
whole domains).

Kept apart from what measures generality: no machine, task or JSON key of the session bench's robot stream
(:mod:`edgespec.bench.robot_stream`: drones, hospital carts, pipetting arms, greenhouse rovers, humanoids, dish
cells) and none of the benchmark prompts (tests check both).
"""

from __future__ import annotations

import random

# domain -> (machine, tasks with {slots}, slot words, tool functions)
_DOMAINS: dict[str, tuple[str, list[str], dict[str, list[str]], list[str]]] = {
    "forklift": ("the forklift", ["move pallet {p} from aisle {a} to loading dock {d}",
                                  "restack the pallets in aisle {a} by weight", "bring pallet {p} to the wrapper"],
                 {"p": ["P-104", "P-221", "P-377", "P-402"], "a": ["3", "9", "14", "22"], "d": ["1", "4", "6"]},
                 ["lift(height_cm)", "drive_to(aisle, bay)", "lower()", "scan_label(pallet)"]),
    "welding": ("the welding cell", ["weld seam {s} on frame {f}", "tack-weld the brackets of frame {f}",
                                     "inspect the welds on frame {f} and redo seam {s}"],
                {"s": ["A", "B", "C2", "D7"], "f": ["F-12", "F-30", "F-58"]},
                ["load_program(name)", "weld(seam, current_a)", "inspect(seam)", "unload()"]),
    "mower": ("the lawn mower robot", ["mow {z} but keep away from {o}", "trim the edges of {z}",
                                       "mow {z} and return to the charger"],
              {"z": ["the north lawn", "zone 2", "the back garden", "the football pitch"],
               "o": ["the flower beds", "the pond", "the sandpit", "a parked bike"]},
              ["set_blade_height(mm)", "mow_area(zone)", "avoid(obstacle)", "go_home()"]),
    "pool": ("the pool cleaner", ["clean the {w} of the pool", "scrub the steps, then vacuum the {w}"],
             {"w": ["floor", "walls", "shallow end", "waterline"]},
             ["vacuum(area)", "scrub(area)", "check_filter()", "surface()"]),
    "windows": ("the window cleaning robot", ["clean the windows of floor {n} on the {side} side",
                                              "wash the glass roof of the {side} atrium"],
                {"n": ["2", "5", "11", "17"], "side": ["east", "west", "south"]},
                ["attach(panel)", "spray(ml)", "wipe(passes)", "move_to_panel(id)"]),
    "patrol": ("the security robot", ["patrol {r} and report any open doors", "check the fence along {r} for gaps"],
               {"r": ["car park B", "the west wing", "the perimeter road", "the basement corridor"]},
               ["go_to(checkpoint)", "take_photo(direction)", "report(event)", "sound_alarm()"]),
    "kitchen": ("the kitchen robot", ["prepare {dish} for {n} people", "plate {dish} and clean the {tool}"],
                {"dish": ["pancakes", "a tomato soup", "fried rice", "a green salad"], "n": ["two", "four", "six"],
                 "tool": ["griddle", "wok", "chopping board"]},
                ["fetch(ingredient, grams)", "chop(ingredient)", "cook(minutes, temperature_c)", "serve(plate)"]),
    "painting": ("the painting robot", ["paint panel {p} {c} with two coats", "sand and prime door {p}"],
                 {"p": ["7", "12", "21", "33"], "c": ["matte black", "signal red", "white", "olive green"]},
                 ["select_nozzle(size_mm)", "spray_coat(panel, colour)", "dry(minutes)", "inspect_finish(panel)"]),
    "recycling": ("the sorting robot", ["sort the {m} off belt {n}", "pull {m} and {m2} off belt {n} into bins"],
                  {"m": ["aluminium cans", "PET bottles", "cardboard", "glass jars"],
                   "m2": ["batteries", "textiles", "film plastic"], "n": ["1", "2", "3"]},
                  ["detect(material)", "pick(item_id)", "drop(bin)", "count(bin)"]),
    "rov": ("the underwater ROV", ["inspect pipeline section {n} for {d}", "film the hull of the {ship}"],
            {"n": ["4", "9", "15"], "d": ["corrosion", "cracks", "marine growth"],
             "ship": ["ferry", "tanker", "research vessel"]},
            ["dive(depth_m)", "follow(structure)", "record_video(seconds)", "ascend()"]),
    "tractor": ("the autonomous tractor", ["plough field {f} in strips", "spread fertiliser on field {f}"],
                {"f": ["7", "12B", "east meadow", "the hill field"]},
                ["lower_implement()", "drive_line(start, end)", "turn(direction)", "raise_implement()"]),
    "library": ("the library robot", ["shelve the books from trolley {n} in section {s}",
                                      "find the book with code {c} and bring it to the front desk"],
                {"n": ["1", "3", "5"], "s": ["history", "science", "children's"], "c": ["QA76.9", "PR6045", "HD30"]},
                ["scan_spine(book)", "navigate(section)", "place(shelf, slot)", "pick_book(code)"]),
    "hotel": ("the room-service robot", ["deliver {item} to room {n}", "collect the trays from floor {f}"],
              {"item": ["two towels", "a pot of tea", "a phone charger"], "n": ["214", "508", "1102"],
               "f": ["3", "6", "9"]},
              ["call_elevator(floor)", "go_to_room(number)", "notify_guest(room)", "open_lid()"]),
    "smart_home": ("the home assistant", ["get the living room ready for a movie night",
                                          "set the house to {mode} mode before I leave"],
                   {"mode": ["away", "night", "eco", "vacation"]},
                   ["set_light(room, level)", "set_thermostat(temperature_c)", "lock(door)", "close_blinds(room)"]),
    "calendar": ("my calendar", ["book a meeting with {who} on {day}", "move my {day} appointments to next week"],
                 {"who": ["the design team", "Dr. Okafor", "the landlord"], "day": ["Tuesday", "Friday", "Monday"]},
                 ["find_slot(day, minutes)", "create_event(title, start, minutes)", "invite(person)", "cancel(id)"]),
    "travel": ("the trip planner", ["plan a {n}-day trip to {city} by train", "find a hotel near {city} station"],
               {"n": ["2", "3", "5"], "city": ["Lyon", "Porto", "Kyoto", "Gdansk"]},
               ["search_trains(from, to, date)", "search_hotels(city, nights)", "book(offer_id)", "add_note(text)"]),
}

# JSON keys drawn per request (none of the robot stream's: see the module doc).
_KEYS = ["task_id", "order", "device", "command", "args", "duration_min", "priority", "zone", "position", "speed",
         "tool", "check", "result", "status", "reason", "start", "end", "distance_m", "temperature_c", "item",
         "quantity", "unit", "room", "time", "confidence", "retry", "next", "label", "sequence", "owner", "deadline",
         "location", "target", "mode", "direction", "angle_deg", "force_n", "verified", "battery_pct", "error"]

_PLAN = [
    "{Task} with {machine}. Respond with a JSON array; each element has {keys}.",
    "I need a plan for {machine}: {task}. Format: a JSON list of objects ({keys}).",
    "{task} -- give me {machine}'s steps as JSON, keys {keys}, no prose.",
    "Could {machine} {task}? Output JSON only: an array of objects with the keys {keys}.",
    "Write {machine}'s plan to {task} in JSON (fields: {keys}).",
    "job for {machine}: {task}. json array, fields {keys}",
    "Break this down for {machine} into JSON steps with {keys}: {task}.",
    "Please return a JSON plan ({keys} per step) so that {machine} can {task}.",
]
_TOOLS = [
    "You can call these functions: {functions}. {Task} with {machine}. Answer with a JSON list of calls, each "
    "with name and arguments.",
    "Tools available for {machine}: {functions}. Which calls, in order, {task}? Reply as a JSON array of "
    "{{\"name\": ..., \"arguments\": {{...}}}} objects.",
    "Functions: {functions}. Goal: {task}. Give only the JSON function calls, one object per call.",
    "Using {functions}, write the tool calls for {machine} to {task}. JSON list, nothing else.",
]
_REPORT = [
    "{machine} was asked to {task}. Write its status report as one JSON object with {keys}.",
    "Status check: {machine}, task '{task}'. Reply with a JSON object containing {keys}.",
    "Summarise in JSON ({keys}) how {machine} did when it had to {task}.",
    "After {machine} tried to {task}, what should it report? Give a JSON object with the keys {keys}.",
]
_EXPLAIN = [
    "In two sentences, how would {machine} {task}?",
    "What could go wrong when {machine} has to {task}? Answer briefly.",
]


def _join(words: list[str]) -> str:
    return ", ".join(words[:-1]) + " and " + words[-1] if len(words) > 1 else words[0]


def task_prompt(rng: random.Random, domain: str) -> str:
    """One request of ``domain``: a JSON plan (about half), a tool-call list, a JSON report or a short
    explanation, its task filled from the domain's words and its keys drawn from :data:`_KEYS`."""
    machine, tasks, words, functions = _DOMAINS[domain]
    task = rng.choice(tasks).format(**{k: rng.choice(v) for k, v in words.items()})
    keys = _join(rng.sample(_KEYS, rng.randint(3, 5)))
    form = rng.random()
    if form < 0.5:
        template = rng.choice(_PLAN)
    elif form < 0.75:
        template = rng.choice(_TOOLS)
    elif form < 0.93:
        template = rng.choice(_REPORT)
    else:
        template = rng.choice(_EXPLAIN)
    text = template.format(task=task, Task=task[0].upper() + task[1:], machine=machine, keys=keys,
                           functions=", ".join(rng.sample(functions, len(functions))))
    return text[0].upper() + text[1:]


def task_prompts(n: int, seed: int = 0) -> list[tuple[str, dict[str, str]]]:
    """``n`` distinct structured requests (see the module doc), each labelled ``{"template": domain}``; seeded.
    Benchmark prompts are never among them."""
    from edgespec.distill.workload import bench_prompt_texts

    rng = random.Random(seed)
    seen = set(bench_prompt_texts())
    out: list[tuple[str, dict[str, str]]] = []
    domains = sorted(_DOMAINS)
    for _ in range(100 * n + 1000):
        domain = rng.choice(domains)
        text = task_prompt(rng, domain)
        if text not in seen:
            seen.add(text)
            out.append((text, {"template": domain}))
            if len(out) == n:
                return out
    raise ValueError(f"cannot make {n} distinct structured requests from the domains")
