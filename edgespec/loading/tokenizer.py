"""Tokenizer, chat template and incremental detokenisation for a Hugging Face style checkpoint folder.

A checkpoint folder carries its tokenizer as ``tokenizer.json`` (the ``tokenizers`` library's own format,
which we load as-is) plus side files that say how to use it: ``tokenizer_config.json`` (chat template,
special-token strings, added-token flags), optionally ``chat_template.jinja`` / ``chat_template.json`` (newer
exports keep the template there), ``generation_config.json`` and ``config.json`` (the ids that end a turn).

:class:`ChatTokenizer` puts those together. :class:`IncrementalDetokenizer` turns a stream of generated ids
into a stream of text without splitting multi-byte characters and with stop strings cut out;
:class:`StopStringMatcher` is the stop-string half on its own, for callers that already have text.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from edgespec.errors import CheckpointError, RequestError
from edgespec.loading import resident
from edgespec.loading.chat_markers import TurnMarkers, turn_markers

__all__ = [
    "ChatTokenizer",
    "IncrementalDetokenizer",
    "StopStringMatcher",
]

# Special-token attributes of tokenizer_config.json that chat templates may reference (``{{ bos_token }}``).
_SPECIAL_TOKEN_KEYS = (
    "bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
)

_REPLACEMENT_CHAR = "\ufffd"

# Roles whose text is data, not markup: a control token typed there reaches the model as its literal characters.
LITERAL_ROLES = ("user", "tool")
# A shielded control-token string in rendered text: private-use characters around its index in the table.
_SHIELD_OPEN, _SHIELD_CLOSE = "\ue000", "\ue001"
_SHIELD = re.compile(f"{_SHIELD_OPEN}(\\d+){_SHIELD_CLOSE}")


# ------------------------------------------------------------------------------------------------------------
# small file helpers


def _read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    """Parse a JSON object file: ``None`` when optional and missing, CheckpointError when unreadable."""
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path}: missing (the checkpoint folder needs this file)")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot be read: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object at top level, found {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a plain string or a serialised AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _int_ids(value: Any) -> list[int]:
    """``eos_token_id`` may be an int, a list of ints or null depending on the exporter."""
    if value is None or isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _no_stop_message(folder: Path) -> str:
    """The error of a checkpoint that says nowhere which token ends generation, naming where it looked (and, for
    a converted GGUF, the file's keys)."""
    from edgespec.loading.gguf_meta import MARKER  # the record of a GGUF conversion

    message = (f"{folder}: no token ends generation: generation_config.json and config.json give no "
               "eos_token_id, tokenizer_config.json no eos_token the vocabulary holds, and the chat template closes "
               "no assistant turn with a control token")
    record = _read_json(folder / MARKER, required=False) or {}
    if record.get("source"):
        message += (f" (converted from {record['source']}, which names neither tokenizer.ggml.eos_token_id nor "
                    "tokenizer.ggml.eot_token_id)")
    return message


# ------------------------------------------------------------------------------------------------------------
# chat-template environment (matches what transformers exposes to templates, so templates written for it
# render identically here)


class _GenerationTag(Extension):
    """Accept ``{% generation %}...{% endgeneration %}``: transformers uses it to mark assistant spans for
    training masks; for inference the body simply renders."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)  # the `generation` name token
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's built-in tojson HTML-escapes and sorts keys; templates are written against HF's plain
    # json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_jinja_env() -> ImmutableSandboxedEnvironment:
    # Immutable sandbox: a template comes from a downloaded file and must not mutate the caller's messages.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# ------------------------------------------------------------------------------------------------------------


class ChatTokenizer:
    """A checkpoint's tokenizer together with its chat template and stop ids.

    Build it with :meth:`from_folder`. Encoding never adds BOS/EOS unless asked: chat templates write their
    own special tokens into the rendered text, and added tokens in that text are matched whole by
    ``tokenizers``.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        eos_token_ids: Iterable[int] = (),
        extra_special_ids: Iterable[int] = (),
        source: str = "<in-memory tokenizer>",
    ) -> None:
        self._tok = tokenizer
        self._chat_template = chat_template
        self._special_tokens = dict(special_tokens or {})
        self._source = source
        self._compiled: jinja2.Template | None = None

        added = tokenizer.get_added_tokens_decoder()
        special = {i for i, tok in added.items() if tok.special}
        special.update(extra_special_ids)
        self._special_ids = special
        # Every added token's text (ChatML markers, <think>, <tool_call>...), longest first so a regex alternation
        # matches the longest one, as the tokenizer's own split does.
        controls = sorted({tok.content for tok in added.values() if tok.content}, key=len, reverse=True)
        self._control_ids = {tok.content: i for i, tok in added.items()}
        self._controls = re.compile("|".join(map(re.escape, controls))) if controls else None
        self._shielded = re.compile("|".join(map(re.escape, [*controls, _SHIELD_OPEN, _SHIELD_CLOSE])))
        self._markers = turn_markers(lambda messages: self.apply_chat_template(messages, add_generation_prompt=False),
                                     self._controls)

        # Stop ids: every configured eos id, the eos token string and the token that closes an assistant turn in
        # the chat template, resolved through the vocabulary.
        ids = list(eos_token_ids)
        for token in (self._special_tokens.get("eos_token"), self._markers.closer):
            token_id = tokenizer.token_to_id(token) if token is not None else None
            if token_id is not None:
                ids.append(token_id)
        self._stop_ids = list(dict.fromkeys(ids))

    # -- construction ----------------------------------------------------------------------------------------

    @classmethod
    def from_folder(cls, path: str | Path) -> ChatTokenizer:
        """Load ``tokenizer.json`` and its side files from a checkpoint folder."""
        folder = Path(path)
        if not folder.is_dir():
            raise CheckpointError(f"{folder}: checkpoint folder not found")
        tok_path = folder / "tokenizer.json"
        if not tok_path.is_file():
            raise CheckpointError(f"{tok_path}: missing tokenizer.json (edgespec needs the fast tokenizer)")
        try:
            text = tok_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{tok_path}: cannot be read: {exc}") from exc
        try:
            tokenizer = Tokenizer.from_str(text)
        except Exception as exc:  # tokenizers raises plain Exception subclasses from Rust
            try:
                # only now, and only to name the problem: the tokenizers error for bad JSON does not say so
                # plainly (parsing it up front kept ~7 MB of Python objects' arenas resident)
                json.loads(text)
            except json.JSONDecodeError as bad:
                raise CheckpointError(f"{tok_path}: not valid JSON ({bad})") from bad
            raise CheckpointError(
                f"{tok_path}: not a tokenizer the `tokenizers` library can load: {exc}"
            ) from exc
        del text
        resident.trim_heap()   # the parse's freed working memory (tens of MB) back to the OS

        tok_cfg_path = folder / "tokenizer_config.json"
        tok_cfg = _read_json(tok_cfg_path, required=False) or {}
        gen_cfg = _read_json(folder / "generation_config.json", required=False) or {}
        model_cfg = _read_json(folder / "config.json", required=False) or {}

        special_tokens: dict[str, str] = {}
        for key in _SPECIAL_TOKEN_KEYS:
            content = _token_content(tok_cfg.get(key))
            if content is not None:
                special_tokens[key] = content

        extra_special: list[int] = []
        decoder = tok_cfg.get("added_tokens_decoder")
        if isinstance(decoder, Mapping):
            for key, entry in decoder.items():
                if isinstance(entry, Mapping) and entry.get("special") and str(key).isdigit():
                    extra_special.append(int(key))

        eos_ids = _int_ids(gen_cfg.get("eos_token_id"))
        eos_ids += _int_ids(model_cfg.get("eos_token_id"))
        text_cfg = model_cfg.get("text_config")  # multimodal wrappers (e.g. Qwen3.5) nest the LM config
        if isinstance(text_cfg, Mapping):
            eos_ids += _int_ids(text_cfg.get("eos_token_id"))

        template = cls._find_chat_template(folder, tok_cfg, tok_cfg_path)
        chat = cls(
            tokenizer,
            chat_template=template,
            special_tokens=special_tokens,
            eos_token_ids=eos_ids,
            extra_special_ids=extra_special,
            source=str(folder),
        )
        if not chat.stop_token_ids:
            raise CheckpointError(_no_stop_message(folder))
        return chat

    @staticmethod
    def _find_chat_template(folder: Path, tok_cfg: Mapping[str, Any], tok_cfg_path: Path) -> str | None:
        # Newer transformers exports write the template to chat_template.jinja (preferred) or
        # chat_template.json and leave it out of tokenizer_config.json; older ones keep it inline. Same
        # precedence as transformers.
        jinja_path = folder / "chat_template.jinja"
        if jinja_path.is_file():
            try:
                return jinja_path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise CheckpointError(f"{jinja_path}: cannot be read: {exc}") from exc
        json_path = folder / "chat_template.json"
        side = _read_json(json_path, required=False)
        if side is not None and "chat_template" in side:
            return ChatTokenizer._pick_template(side["chat_template"], json_path)
        if "chat_template" in tok_cfg:
            return ChatTokenizer._pick_template(tok_cfg["chat_template"], tok_cfg_path)
        return None

    @staticmethod
    def _pick_template(value: Any, where: Path) -> str | None:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list):
            # Several named templates ({name, template}); "default" is the chat one, "tool_use" etc. are
            # variants.
            named = {e.get("name"): e.get("template") for e in value if isinstance(e, Mapping)}
            chosen = named.get("default")
            if chosen is None and named:
                chosen = next(iter(named.values()))
            if isinstance(chosen, str):
                return chosen
        raise CheckpointError(
            f"{where}: chat_template must be a string or a list of {{name, template}} entries"
        )

    # -- encode / decode -------------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included (may be below the model's vocab)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def stop_token_ids(self) -> list[int]:
        """Ids that end generation: generation_config + config eos ids, the eos token and the chat template's
        end of an assistant turn, first-seen order."""
        return list(self._stop_ids)

    @property
    def turn_markers(self) -> TurnMarkers:
        """The control tokens that open a chat turn and close an assistant one, as the chat template writes them."""
        return self._markers

    @property
    def turn_token_id(self) -> int | None:
        """Id of the token that opens every chat turn (None where the template has none)."""
        opener = self._markers.opener
        return self._tok.token_to_id(opener) if opener is not None else None

    @property
    def special_token_ids(self) -> set[int]:
        return set(self._special_ids)

    @property
    def think_token_ids(self) -> tuple[int, int] | None:
        """``(id of <think>, id of </think>)`` when the vocabulary has both, else ``None``."""
        start, end = self._tok.token_to_id("<think>"), self._tok.token_to_id("</think>")
        if start is None or end is None:
            return None
        return start, end

    @property
    def special_tokens(self) -> dict[str, str]:
        """bos/eos/pad/... token strings from tokenizer_config.json."""
        return dict(self._special_tokens)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    # -- chat ------------------------------------------------------------------------------------------------

    def _template(self) -> jinja2.Template:
        if self._compiled is None:
            if self._chat_template is None:
                raise CheckpointError(
                    f"{self._source}: the tokenizer has no chat_template (looked in tokenizer_config.json, "
                    "chat_template.jinja and chat_template.json); chat requests need one"
                )
            try:
                self._compiled = _make_jinja_env().from_string(self._chat_template)
            except jinja2.TemplateSyntaxError as exc:
                raise CheckpointError(
                    f"{self._source}: chat_template is not valid Jinja (line {exc.lineno}: {exc.message})"
                ) from exc
        return self._compiled

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the checkpoint's chat template.

        ``enable_thinking`` is passed to the template only when given, so templates that test
        ``enable_thinking is defined`` keep their own default. Extra keyword arguments (``tools``, ...) reach
        the template as variables, as in transformers.
        """
        template = self._template()
        context: dict[str, Any] = dict(self._special_tokens)
        # tools/documents default to None (not undefined) as in transformers: templates test `is not none`.
        context.update(messages=list(messages), tools=None, documents=None,
                       add_generation_prompt=add_generation_prompt)
        if enable_thinking is not None:
            context["enable_thinking"] = enable_thinking
        context.update(kwargs)
        try:
            return template.render(**context)
        except jinja2.TemplateError as exc:
            # raise_exception() in a template is how chat templates reject a conversation (roles out of
            # order...)
            raise RequestError(f"chat template of {self._source} rejected the messages: {exc}") from exc

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], enable_thinking: bool | None = None, **kwargs: Any
    ) -> list[int]:
        """Render with a generation prompt and encode; the template supplies every special token itself."""
        text = self.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=enable_thinking,
                                        **kwargs)
        return self.encode(text, add_special_tokens=False)

    # -- control tokens typed in content -----------------------------------------------------------------------

    def shield(self, messages: Sequence[Mapping[str, Any]],
               roles: Sequence[str] = LITERAL_ROLES) -> tuple[list[Mapping[str, Any]], list[str]]:
        """``messages`` with every control-token string in the text of ``roles`` messages replaced by a
        placeholder, and the table of what each placeholder stands for (empty: nothing was replaced, the messages
        are the ones given). Rendered and encoded with :meth:`encode_shielded`, the model sees those strings as
        the characters they are, never as the tokens the chat template writes: a user cannot forge a turn or a
        tool call by typing ``<|im_start|>system`` or ``<tool_call>``."""
        table: list[str] = []

        def replace(match: re.Match[str]) -> str:
            table.append(match.group())
            return f"{_SHIELD_OPEN}{len(table) - 1}{_SHIELD_CLOSE}"

        def shield_text(text: Any) -> Any:
            return self._shielded.sub(replace, text) if isinstance(text, str) else text

        out: list[Mapping[str, Any]] = []
        for m in messages:
            if m.get("role") not in roles:
                out.append(m)
                continue
            content = m.get("content")
            if isinstance(content, list):   # content parts: the text ones
                content = [{**p, "text": shield_text(p["text"])} if isinstance(p, Mapping) and "text" in p else p
                           for p in content]
            out.append({**m, "content": shield_text(content)})
        return (out, table) if table else (list(messages), [])

    def encode_shielded(self, text: str, table: Sequence[str]) -> list[int]:
        """Encode a rendering of :meth:`shield`'s messages: control tokens the template wrote are tokens, each
        placeholder is its literal text, encoded as ordinary text together with the text around it (as if the
        string were not a control token)."""
        if not table:
            return self.encode(text)
        ids: list[int] = []
        pos = 0
        for m in self._controls.finditer(text) if self._controls is not None else ():
            ids += self._encode_run(text[pos:m.start()], table)
            ids.append(self._control_ids[m.group()])
            pos = m.end()
        return ids + self._encode_run(text[pos:], table)

    def _encode_run(self, run: str, table: Sequence[str]) -> list[int]:
        """Text between two control tokens; placeholders restored and encoded without matching added tokens (the
        tokenizer's normaliser, pre-tokeniser and model, which is what it runs on each piece between them)."""
        if not run:
            return []
        if _SHIELD_OPEN not in run:
            return self.encode(run)
        run = _SHIELD.sub(lambda m: table[int(m.group(1))], run)
        tok = self._tok
        normalized = tok.normalizer.normalize_str(run) if tok.normalizer is not None else run
        pieces = tok.pre_tokenizer.pre_tokenize_str(normalized) if tok.pre_tokenizer is not None else [(normalized,
                                                                                                         None)]
        return [t.id for piece, _ in pieces for t in tok.model.tokenize(piece)]

    def detokenizer(self, *, stop: Sequence[str] = (), skip_special_tokens: bool = True,
                    prompt_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        """A fresh :class:`IncrementalDetokenizer` over this tokenizer."""
        return IncrementalDetokenizer(self, stop=stop, skip_special_tokens=skip_special_tokens,
                                      prompt_ids=prompt_ids)

    def __repr__(self) -> str:
        return (f"ChatTokenizer({self._source!r}, vocab_size={self.vocab_size}, "
                f"stop_token_ids={self._stop_ids})")


# ------------------------------------------------------------------------------------------------------------
# streaming text


class StopStringMatcher:
    """Cuts a text stream at the first occurrence of any stop string.

    :meth:`feed` returns the text that is safe to show: text that could still turn out to be the start of a
    stop string is held back until later text decides it. Once a stop string is found, :attr:`hit` names it,
    the text before it is returned and everything after it is dropped. :meth:`flush` releases held-back text
    at the end of generation (it was not a stop after all). Each call costs O(len(new text) + longest stop
    string) per stop.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        # Empty stop strings would match everywhere; drop them, and duplicates.
        self._stops = tuple(dict.fromkeys(s for s in stops if s))
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.hit: str | None = None

    @property
    def stops(self) -> tuple[str, ...]:
        return self._stops

    @property
    def held(self) -> str:
        """Text currently held back as a possible stop-string prefix."""
        return self._held

    def feed(self, text: str) -> str:
        if self.hit is not None:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        # Only the held tail plus the new text can contain a new match: anything earlier was already searched
        # and, had a stop started there, it would be in the held tail. The winner is the stop that is
        # *completed* first (smallest end; on a tie the longer one, which starts earlier), because that is the
        # one a token-by-token stream meets first: the result must not depend on how the text was chunked.
        first: tuple[int, int, str] | None = None
        for stop in self._stops:
            at = buf.find(stop)
            if at >= 0:
                cand = (at + len(stop), at, stop)
                if first is None or cand[:2] < first[:2]:
                    first = cand
        if first is not None:
            _, at, self.hit = first
            self._held = ""
            return buf[:at]
        keep = self._open_prefix_len(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def _open_prefix_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop string."""
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-k:]
            if any(stop.startswith(tail) for stop in self._stops):
                return k
        return 0

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.hit is not None else held


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns generated token ids into text as they arrive.

    Feed ids with :meth:`add` (one id or a list, e.g. the tokens a speculative step accepted); it returns the
    text they complete. A multi-byte character split over several byte-level tokens is held back until
    complete (decoders show an incomplete UTF-8 tail as U+FFFD). With ``stop`` strings, text is cut at the
    first stop string (see :class:`StopStringMatcher`); :attr:`stop_hit` then names it and later ids produce
    nothing. Call :meth:`finish` at the end to release anything still held back.

    Cost per call is O(new tokens): only a short window of ids is decoded, ``[prefix, read)`` (already shown,
    kept as context because some decoders, e.g. SentencePiece's, change how a token renders at the start of a
    sequence) plus the ids not yet shown. The text of the window minus the text of its shown part is the new
    text.
    """

    # Shown ids kept as context in front of the unshown ones. A handful is enough for every known decoder.
    CONTEXT_TOKENS = 4
    # A UTF-8 character is at most 4 bytes and every byte-level token carries at least one byte, so a U+FFFD
    # that survives this many unshown tokens is a genuinely invalid byte sequence: show it rather than hold
    # forever.
    MAX_HELD_TOKENS = 8

    def __init__(
        self,
        tokenizer: _Decoder,
        *,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        # Seed the context with the prompt's tail so the first generated token renders as it would mid-text.
        self._ids: list[int] = [int(i) for i in list(prompt_ids)[-self.CONTEXT_TOKENS:]]
        self._prefix = 0
        self._read = len(self._ids)
        self._matcher = StopStringMatcher(stop) if stop else None
        self._pieces: list[str] = []
        self._num_tokens = 0
        self._finished = False

    @property
    def stop_hit(self) -> str | None:
        """The stop string that ended the text, or ``None``."""
        return self._matcher.hit if self._matcher is not None else None

    @property
    def text(self) -> str:
        """All text returned so far."""
        return "".join(self._pieces)

    @property
    def num_tokens(self) -> int:
        """Number of ids fed so far (ids after a stop string included)."""
        return self._num_tokens

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip_special)

    def _advance(self, final: bool) -> str:
        """Decode the window and return the text newly completed by the unshown ids."""
        end = len(self._ids)
        if self._read == end:
            return ""
        shown = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:end])
        cut = end  # ids before `cut` become shown
        unshown = end - self._read
        forced = final
        if text.endswith(_REPLACEMENT_CHAR) and not final:
            # The last character is incomplete. Hold back only the ids that make it up (a character is at most
            # 4 bytes), so a batch of ids still shows everything before it.
            for keep in range(1, min(unshown, 5)):
                candidate = self._decode(self._ids[self._prefix:end - keep])
                if not candidate.endswith(_REPLACEMENT_CHAR):
                    text, cut = candidate, end - keep
                    break
            else:
                if unshown < self.MAX_HELD_TOKENS:
                    return ""
                forced = True  # no clean cut within a character's length: the bytes are invalid
        if text.startswith(shown):
            new = text[len(shown):]
        elif forced:
            # The shown text itself changed (only possible after an earlier forced U+FFFD got completed by
            # later bytes). What was shown cannot be taken back: show what differs after the common part.
            common = 0
            for a, b in zip(shown, text, strict=False):
                if a != b:
                    break
                common += 1
            new = text[common:]
        else:
            return ""
        # Next window: the ids just shown (at most CONTEXT_TOKENS of them) become the context.
        start = max(self._read, cut - self.CONTEXT_TOKENS)
        if forced and new.endswith(_REPLACEMENT_CHAR):
            start = cut  # do not keep a broken tail as context: it would re-decode differently later
        del self._ids[:start]
        self._prefix = 0
        self._read = cut - start
        return new

    def _emit(self, text: str) -> str:
        if self._matcher is not None:
            text = self._matcher.feed(text)
        if text:
            self._pieces.append(text)
        return text

    def add(self, token_ids: int | Sequence[int]) -> str:
        """Feed generated ids; returns the text they complete (possibly empty)."""
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.add() after finish()")
        try:  # one id: int, numpy integer or 0-d tensor
            ids = [operator.index(token_ids)]  # type: ignore[arg-type]
        except TypeError:
            ids = [int(i) for i in token_ids]  # type: ignore[union-attr]
        self._num_tokens += len(ids)
        if self.stop_hit is not None or not ids:
            return ""  # text after a stop string is excluded
        self._ids.extend(ids)
        return self._emit(self._advance(final=False))

    def finish(self) -> str:
        """End of generation: return everything still held back (an incomplete character shows as U+FFFD)."""
        if self._finished:
            return ""
        self._finished = True
        if self.stop_hit is not None:
            return ""
        out = self._emit(self._advance(final=True))
        if self._matcher is not None:
            tail = self._matcher.flush()
            if tail:
                self._pieces.append(tail)
                out += tail
        return out
