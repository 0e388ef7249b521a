"""Self-instructed prompts (Magpie-style): requests the target writes itself, for drafters that generalize.

A drafter trained on the target's answers to ten request templates accepts well on those templates and falls
back to n-gram level on anything worded otherwise (docs/drafters.md). The Magpie recipe (arXiv 2406.08464) gets
varied prompts from the target alone: render the chat template up to the point where the user's words begin
(``<|im_start|>user\\n`` for ChatML) and let the target sample from there. An instruct model has seen countless
user turns after that prefix, so what it writes reads like a user's request, in the user's wording, not ours;
the turn ends with the template's end-of-turn token. A topic can open the user's words (``self-robot``: "The
robot", "Task for the robot:" ...) and leave the rest to the target, so the requests stay on robots in wordings of
the target's own.

:func:`query_prefix` builds the prefix, :func:`clean_request` turns one sampled turn into a usable request (or
rejects it), :func:`self_instruct` samples ``n`` distinct requests in batches. ``edgespec distill --prompts
self:N`` / ``self-robot:N`` use them (``edgespec.distill.cli``), mixed with other sources by ``+``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence

import torch

from edgespec.distill.batched import generate_batch, supports_batched
from edgespec.errors import ConfigError
from edgespec.loading.tokenizer import ChatTokenizer
from edgespec.models.decoder import TargetModel

# Topic -> (system prompt before the user turn or None for the template's default, openers). An opener starts the
# user's words and the target writes the rest: a 135M target ignores a system prompt that asks for robot requests
# (tried: it writes about gardening and chatbots all the same), while a request that begins "The robot" stays
# about a robot. The openers name no robot, task or JSON field of edgespec.bench.robot_stream (drones, hospital
# carts, pipetting arms, greenhouse rovers, humanoids, dish cells): that stream measures requests worded unlike
# anything trained on.
TOPICS: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "self": (None, ("",)),
    "self-robot": (None, ("Robot,", "Hey robot,", "The robot", "Our robot", "Can the robot", "I need the robot to",
                          "Please tell the robot to", "Robot arm:", "The mobile robot", "Warehouse robot",
                          "Cleaning robot", "Could you make the robot", "Task for the robot:", "Write a JSON",
                          "Give me a JSON", "Plan for the robot:")),
    # Tool calls and JSON plans about anything: the target writes the request after an opener that asks for a
    # structured answer (the answers teach the drafter the target's JSON and call syntax).
    # Each opener leads into words of a request; none ends on a colon that would invite JSON itself in the user
    # turn (a turn that is mostly not letters is dropped by clean_request).
    "self-tool": (None, ("Call the function", "Use the tool", "Return a JSON object", "Give the steps as JSON",
                         "Write a function call", "As a JSON list,", "Generate the API call", "Respond in JSON with",
                         "Make a JSON plan", "Which tool should I call", "List the commands as JSON",
                         "Can you call")),
}
# Prompt sources written from templates here (not by the target): robot:N (edgespec.distill.workload), tasks:N
# (edgespec.distill.tasks).
GENERATED = ("robot", "tasks")
_SENTINEL = "\x00edgespec-user-turn\x00"
MIN_WORDS, MAX_WORDS = 4, 80


def query_prefix(tokenizer: ChatTokenizer, system: str | None = None, opener: str = ""
                 ) -> tuple[list[int], list[int]]:
    """``(prefix ids, end-of-turn ids)``: the chat template rendered up to where a user turn's words begin (and
    its first words ``opener``), and the ids that end that turn (the template's token right after the user's
    words when it is a special token, else the tokenizer's stop ids). With ``system``, a system turn comes first.

    >>> from edgespec.bench.shapes import write_chat_tokenizer   # ChatML; end of turn first, then stop ids
    >>> import tempfile; tok = ChatTokenizer.from_folder(write_chat_tokenizer(tempfile.mkdtemp()))
    >>> prefix, ends = query_prefix(tok)
    >>> tok.decode(prefix, skip_special_tokens=False), tok.decode(ends, skip_special_tokens=False)
    ('<|im_start|>user\\n', '<|im_end|><|endoftext|>')
    """
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": _SENTINEL}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    at = text.find(_SENTINEL)
    if at < 0:
        raise ConfigError("self-instructed prompts need a chat template that writes the user's content verbatim; "
                          "this template does not")
    prefix = tokenizer.encode(text[:at] + opener, add_special_tokens=False)
    after = tokenizer.encode(text[at + len(_SENTINEL):], add_special_tokens=False)
    ends = [after[0]] if after and after[0] in tokenizer.special_token_ids else []
    ends += [t for t in tokenizer.stop_token_ids if t not in ends]
    if not ends:
        raise ConfigError("self-instructed prompts need an end-of-turn token: the tokenizer has no stop ids")
    return prefix, ends


def clean_request(text: str, *, min_words: int = MIN_WORDS, max_words: int = MAX_WORDS) -> str | None:
    """One sampled user turn as a request: surrounding whitespace stripped, inner runs of spaces kept (a request
    may be a list); ``None`` when it is unusable: fewer than ``min_words`` or more than ``max_words`` words, a
    chat-template marker inside (the model ran on into another turn), or mostly not letters (noise).

    >>> clean_request("  Plan a route for the cleaning robot from the lobby to room 12.  ")
    'Plan a route for the cleaning robot from the lobby to room 12.'
    >>> clean_request("hi there") is None                       # too short to be a request
    True
    >>> clean_request("What is 2+2?<|im_start|>assistant") is None   # ran into the next turn
    True
    >>> clean_request("#### ---- 1234 5678 #### ----") is None        # not words
    True
    """
    text = text.strip()
    words = text.split()
    if not min_words <= len(words) <= max_words:
        return None
    if "<|" in text or "|>" in text or "</s>" in text:
        return None
    letters = sum(c.isalpha() for c in text)
    if letters < 0.5 * len(text.replace(" ", "")):
        return None
    return text


def normalized(text: str) -> str:
    """The duplicate key of a request: lowercase, whitespace and punctuation runs folded.

    >>> normalized("Plan  a ROUTE, please!") == normalized("plan a route please")
    True
    """
    return " ".join(re.sub(r"[^\w]+", " ", text.lower()).split())


@torch.inference_mode()
def _sample_turns(model: TargetModel, tokenizer: ChatTokenizer, prefixes: list[tuple[str, list[int]]],
                  ends: list[int], *, temperature: float, max_tokens: int, generator: torch.Generator) -> list[str]:
    """One sampled user turn per ``(opener, prefix ids)``, the opener in front; a turn that never reached an end
    id is dropped (cut off)."""
    if supports_batched(model):
        runs = generate_batch(model, [p for _, p in prefixes], max_new_tokens=max_tokens, stop_ids=ends, taps=[],
                              temperature=temperature, generator=generator)
    else:
        from edgespec.distill.data import generate_one
        runs = [generate_one(model, p, max_new_tokens=max_tokens, stop_ids=ends, taps=[],
                             temperature=temperature, generator=generator) for _, p in prefixes]
    out = []
    for (opener, _), run in zip(prefixes, runs, strict=True):
        new = run.tokens[run.prompt_len:]
        if new and new[-1] in ends:
            out.append(opener + tokenizer.decode(new[:-1], skip_special_tokens=False))
    return out


def self_instruct(model: TargetModel, tokenizer: ChatTokenizer, n: int, *, topic: str = "self", seed: int = 0,
                  temperature: float = 1.0, max_tokens: int = 64, batch: int = 64,
                  exclude: Collection[str] = (), max_rounds: int | None = None,
                  keep: Callable[[str], str | None] = clean_request) -> list[str]:
    """``n`` distinct requests the target writes after the user-turn prefix of ``topic`` (see :data:`TOPICS`),
    sampled at ``temperature`` in batches of ``batch``, seeded; ``keep`` turns a sampled turn into a request or
    rejects it (default :func:`clean_request`). Requests equal (after :func:`normalized`) to one of ``exclude``
    (benchmark prompts, a held-out set) or to an earlier one are skipped. Raises ConfigError when ``max_rounds``
    batches (default: enough for 4 tries per request) yield fewer than ``n``."""
    if topic not in TOPICS:
        raise ConfigError(f"self-instructed topic {topic!r} is not one of {', '.join(TOPICS)}")
    if n < 1 or batch < 1 or max_tokens < 1:
        raise ConfigError(f"self-instructed prompts: n={n}, batch={batch}, max_tokens={max_tokens} must all be >= 1")
    system, openers = TOPICS[topic]
    ends = query_prefix(tokenizer, system)[1]
    prefixes = [(o, query_prefix(tokenizer, system, o)[0]) for o in openers]
    gen = torch.Generator().manual_seed(seed * 1_000_003 + sum(map(ord, topic)))
    seen = {normalized(t) for t in exclude}
    out: list[str] = []
    rounds = max_rounds if max_rounds is not None else max(4, -(-4 * n // batch))
    for _ in range(rounds):
        rows = min(batch, 2 * (n - len(out)) + 8)
        picks = torch.randint(len(prefixes), (rows,), generator=gen).tolist() if len(prefixes) > 1 else [0] * rows
        for turn in _sample_turns(model, tokenizer, [prefixes[i] for i in picks], ends, temperature=temperature,
                                  max_tokens=max_tokens, generator=gen):
            text = keep(turn)
            if text is None or normalized(text) in seen:
                continue
            seen.add(normalized(text))
            out.append(text)
            if len(out) == n:
                return out
    raise ConfigError(f"self-instructed prompts ({topic}): {len(out)} usable of the {n} asked after {rounds} "
                      f"batches; ask for fewer or raise the batch")


def parse_sources(spec: str) -> list[tuple[str, str]]:
    """``--prompts`` as ``(kind, argument)`` parts joined by ``+``: a generated source (:data:`GENERATED`) or a
    self-instructed topic (:data:`TOPICS`) with a count, or ``file`` with a path.

    >>> parse_sources("robot:1000+self:500+self-robot:800")
    [('robot', '1000'), ('self', '500'), ('self-robot', '800')]
    >>> parse_sources("prompts.yaml")
    [('file', 'prompts.yaml')]
    """
    parts: list[tuple[str, str]] = []
    for part in spec.split("+"):
        part = part.strip()
        if not part:
            raise ConfigError(f"--prompts {spec!r}: an empty part between '+' signs")
        kind, _, arg = part.partition(":")
        if kind in (*GENERATED, *TOPICS):
            if not arg.isdigit() or int(arg) < 1:
                raise ConfigError(f"--prompts {part!r}: expected {kind}:N with an integer N >= 1")
            parts.append((kind, arg))
        else:
            parts.append(("file", part))
    return parts


def sources_need_target(spec: str) -> bool:
    """True when ``spec`` has a self-instructed part (those are written by the target)."""
    return any(kind in TOPICS for kind, _ in parse_sources(spec))


def mixed(parts: Sequence[tuple[str, Sequence[tuple[str, dict[str, str]]]]]) -> list[tuple[str, dict[str, str]]]:
    """Interleave labelled sources ``(name, [(prompt, labels)])`` round-robin (a short training run sees every
    source, not the first one only); a prompt without a ``source`` label gets its source's name; a prompt already
    taken from an earlier source is dropped. One source comes back in its own order.

    >>> [(t, l["source"]) for t, l in mixed([("a", [("a1", {}), ("a2", {}), ("a3", {})]), ("b", [("b1", {})])])]
    [('a1', 'a'), ('b1', 'b'), ('a2', 'a'), ('a3', 'a')]
    """
    out: list[tuple[str, dict[str, str]]] = []
    seen: set[str] = set()
    longest = max((len(p) for _, p in parts), default=0)
    for i in range(longest):
        for name, prompts in parts:
            if i < len(prompts) and prompts[i][0] not in seen:
                text, labels = prompts[i]
                seen.add(text)
                out.append((text, {"source": name, **labels}))
    return out
