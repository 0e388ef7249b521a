#!/usr/bin/env python3
"""Fuzz the agent server over its own OpenAPI schema: no input may produce a 5xx or a hang.

For every POST operation with a JSON body the fuzzer builds a valid baseline from the schema, then sends
(1) schema-driven mutations of every property, nested ones included (missing required, wrong types, values just
outside minimum/maximum/maxLength/maxItems, invalid enum/const values, unknown fields, huge strings),
(2) random JSON documents, and (3) raw-transport abuse (invalid JSON, wrong content types, non-UTF-8, deep
nesting, oversized and chunked bodies, unknown routes and methods). Every answer must arrive within the client
timeout, be below 500, be a status the OpenAPI document declares for its operation (unknown routes: 404/405) and,
when it is an error, carry the OpenAI error shape with a string ``code`` (never ``null``).

    python tools/fuzz_server.py                      # spawns a server on a tiny random model
    python tools/fuzz_server.py --model demo         # ... on the SmolLM2 demo model
    python tools/fuzz_server.py --url http://127.0.0.1:8000 --api-key KEY
    python tools/fuzz_server.py --schemathesis 150   # then schemathesis (pip install schemathesis) on the same server

Prints a table of the statuses seen per field (``--verbose``: per case) and exits 1 on any 5xx, hang or
malformed error body.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import socket
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

SMALL_MAX_TOKENS = 4
WRONG_TYPES: list[tuple[str, Any]] = [
    ("null", None), ("true", True), ("int", 7), ("negative", -1), ("float", 0.5), ("huge int", 2**80),
    ("string", "x"), ("empty string", ""), ("list", [1, "a"]), ("object", {"k": "v"}),
    ("long string", "é" * 20000), ("nan-ish", "NaN"),
]


@dataclass
class Case:
    """One request to send."""

    family: str
    method: str
    path: str
    json_body: Any = None
    raw: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    chunked: bool = False
    wire: bytes | None = None   # sent as-is over a socket (requests an HTTP client refuses to send)


@dataclass
class Outcome:
    case: Case
    status: int | None          # None = transport failure / hang
    seconds: float
    problem: str | None = None


# ---- schema walking -------------------------------------------------------------------------------------------


class Schema:
    """OpenAPI document with $ref resolution."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc

    def resolve(self, node: dict[str, Any]) -> dict[str, Any]:
        seen = 0
        while isinstance(node, dict) and "$ref" in node and seen < 20:
            target: Any = self.doc
            for part in node["$ref"].lstrip("#/").split("/"):
                target = target[part]
            node = target
            seen += 1
        return node

    def variants(self, node: dict[str, Any]) -> list[dict[str, Any]]:
        """The alternatives of ``node`` (nested anyOf/oneOf flattened, $refs resolved)."""
        node = self.resolve(node)
        for key in ("anyOf", "oneOf"):
            if key in node:
                return [v for sub in node[key] for v in self.variants(sub)]
        if "allOf" in node and len(node["allOf"]) == 1:
            return self.variants(node["allOf"][0])
        return [node]

    def example(self, node: dict[str, Any], depth: int = 0) -> Any:
        """A small valid value for ``node`` (first non-null variant, required properties only)."""
        options = [v for v in self.variants(node) if v.get("type") != "null"] or [{"type": "null"}]
        node = options[0]
        if "const" in node:
            return node["const"]
        if "enum" in node:
            return node["enum"][0]
        if "default" in node and node["default"] is not None:
            return node["default"]
        if node.get("examples"):
            return node["examples"][0]
        kind = node.get("type")
        if kind == "object" or "properties" in node:
            props = node.get("properties", {})
            return {name: self.example(props[name], depth + 1) for name in node.get("required", [])
                    if name in props}
        if kind == "array":
            n = max(1, node.get("minItems", 1))
            return [self.example(node.get("items", {}), depth + 1) for _ in range(n)]
        if kind == "string":
            return "hello"[: node.get("maxLength", 5)] or "h"
        if kind == "integer":
            return max(int(node.get("minimum", 1)), 1)
        if kind == "number":
            return float(node.get("minimum", 0.5))
        if kind == "boolean":
            return False
        return None

    def request_schema(self, op: dict[str, Any]) -> dict[str, Any] | None:
        body = op.get("requestBody", {}).get("content", {}).get("application/json")
        return self.resolve(body["schema"]) if body else None


def _bad_values(node: dict[str, Any], schema: Schema) -> Iterator[tuple[str, Any]]:
    """Values just outside what ``node`` allows, derived from its constraints, then plain wrong types."""
    for v in schema.variants(node):
        if "minimum" in v:
            yield "below minimum", v["minimum"] - 1
        if "exclusiveMinimum" in v:
            yield "at exclusiveMinimum", v["exclusiveMinimum"]
        if "maximum" in v:
            yield "above maximum", v["maximum"] + 1
            yield "far above maximum", v["maximum"] * 1000 + 10**9
        if "exclusiveMaximum" in v:
            yield "at exclusiveMaximum", v["exclusiveMaximum"]
        if "maxLength" in v:
            yield "above maxLength", "y" * (v["maxLength"] + 1)
        if "minLength" in v and v["minLength"] > 0:
            yield "below minLength", ""
        if "maxItems" in v:
            yield "above maxItems", ["a"] * (v["maxItems"] + 1)
        if "minItems" in v and v["minItems"] > 0:
            yield "below minItems", []
        if "enum" in v or "const" in v:
            yield "not in enum", "definitely-not-allowed"
    yield from WRONG_TYPES


def _paths(node: dict[str, Any], schema: Schema, base: Any, prefix: tuple = (), depth: int = 0
           ) -> Iterator[tuple[tuple, dict[str, Any], bool, Any]]:
    """(path, sub-schema, required, document) for every property reachable from ``base``.

    Every object variant of a union is explored (``response_format`` as text, json_object and json_schema):
    the document returned holds a valid value of that variant along the path, so a mutation hits one field.
    """
    if depth > 4:
        return
    for variant in schema.variants(node):
        props = variant.get("properties")
        if not props:
            continue
        required = set(variant.get("required", []))
        for name, sub in props.items():
            here = prefix + (name,)
            yield here, sub, name in required, base
            for option in schema.variants(sub):
                if option.get("type") == "array" and option.get("items"):
                    for item in schema.variants(option["items"]):
                        if "properties" not in item:
                            continue
                        current = _get(base, here)
                        ok = isinstance(current, list) and current and _fits(current[0], item, schema)
                        doc = base if ok else _set(base, here, [schema.example(item)])
                        yield from _paths(item, schema, doc, here + (0,), depth + 1)
                elif "properties" in option:
                    current = _get(base, here)
                    value = current if _fits(current, option, schema) else schema.example(option)
                    yield from _paths(option, schema, _set(base, here, value), here, depth + 1)
        break


def _get(doc: Any, path: tuple) -> Any:
    for key in path:
        try:
            doc = doc[key]
        except (KeyError, IndexError, TypeError):
            return None
    return doc


def _fits(value: Any, option: dict[str, Any], schema: Schema) -> bool:
    """Does ``value`` look like an instance of object ``option`` (its const/enum tags match)?"""
    if not isinstance(value, dict):
        return False
    for name, sub in option.get("properties", {}).items():
        sub = schema.resolve(sub)
        tag = sub.get("const", (sub.get("enum") or [None])[0] if len(sub.get("enum") or []) == 1 else None)
        if tag is not None and value.get(name) != tag:
            return False
    return True


def _set(doc: Any, path: tuple, value: Any, delete: bool = False) -> Any:
    out = copy.deepcopy(doc)
    target = out
    for key in path[:-1]:
        if isinstance(key, int):
            while len(target) <= key:
                target.append({})
            target = target[key]
        else:
            target = target.setdefault(key, {})
            if not isinstance(target, (dict, list)):
                return out
    last = path[-1]
    if delete:
        if isinstance(target, dict):
            target.pop(last, None)
    elif isinstance(target, dict):
        target[last] = value
    return out


def _show(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else ("." if i else "") + p for i, p in enumerate(path))


# ---- case generation ------------------------------------------------------------------------------------------


BASELINES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": SMALL_MAX_TOKENS},
    "/v1/completions": {"prompt": "hi", "max_tokens": SMALL_MAX_TOKENS},
}


def schema_cases(doc: dict[str, Any]) -> Iterator[Case]:
    schema = Schema(doc)
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            if method.upper() != "POST":
                continue
            body_schema = schema.request_schema(op)
            if body_schema is None:
                continue
            base = schema.example(body_schema)
            base.update(BASELINES.get(path, {}))
            yield Case(f"{path} valid baseline", "POST", path, base)
            yield Case(f"{path} baseline streamed", "POST", path, dict(base, stream=True))
            yield Case(f"{path} unknown field", "POST", path, dict(base, frobnicate=1))
            seen = set()
            for field_path, sub, required, doc in _paths(body_schema, schema, base):
                name = _show(field_path)
                key = (name, json.dumps(_get(doc, field_path[:-1]), sort_keys=True, default=str))
                if key in seen:
                    continue
                seen.add(key)
                if len(field_path) > 1:
                    tag = _get(doc, field_path[:-1])
                    if isinstance(tag, dict) and isinstance(tag.get("type"), str):
                        name = f"{name} ({tag['type']})"
                if required:
                    yield Case(f"{path} missing {name}", "POST", path, _set(doc, field_path, None, delete=True))
                for label, value in _bad_values(sub, schema):
                    yield Case(f"{path} {name} = {label}", "POST", path, _set(doc, field_path, value))


NASTY_SCHEMAS: list[tuple[str, Any]] = [
    ("unknown type", {"type": "bogus"}),
    ("dangling $ref", {"$ref": "#/definitions/nowhere"}),
    ("recursive $ref", {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}),
    ("unsatisfiable (not {})", {"not": {}}),
    ("empty anyOf", {"anyOf": []}),
    ("contradiction", {"type": "integer", "minimum": 5, "maximum": 1}),
    ("bad regex", {"type": "string", "pattern": "("}),
    ("regex blow-up", {"type": "string", "pattern": "(a|aa){1000}(b|bb){1000}"}),
    ("huge repetition", {"type": "string", "pattern": "a{100000}"}),
    ("million minItems", {"type": "array", "items": {"type": "integer"}, "minItems": 1000000}),
    ("huge enum", {"enum": [f"value-{i}" for i in range(5000)]}),
    ("deep nesting", {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "object"}}}}}}}}),
    ("any JSON", {}),
    ("boolean schema", True),
    ("string only", {"type": "string", "maxLength": 5}),
    ("null only", {"type": "null"}),
    ("unknown keyword", {"type": "object", "x-whatever": 1, "propertyNames": {"pattern": "^a"}}),
]


def grammar_cases() -> Iterator[Case]:
    """JSON mode with schemas that are invalid, unsatisfiable or expensive to compile."""
    for path in BASELINES:
        for label, nasty in NASTY_SCHEMAS:
            fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": nasty}}
            yield Case(f"{path} json_schema: {label}", "POST", path, dict(BASELINES[path], response_format=fmt))
        yield Case(f"{path} json_object", "POST", path,
                   dict(BASELINES[path], response_format={"type": "json_object"}, max_tokens=32))


def random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 2**31, -(2**63), 2**70, rng.randint(-1000, 1000)])
    if kind == 3:
        return rng.choice([0.0, -0.0, 1e-300, 1e300, rng.uniform(-10, 10)])
    if kind == 4:
        return "".join(chr(rng.choice([rng.randint(32, 126), rng.randint(0x80, 0x2FFF), 0])) for _ in
                       range(rng.randint(0, 12)))
    if kind == 5:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = ["messages", "prompt", "model", "max_tokens", "temperature", "top_p", "stop", "stream", "seed",
            "response_format", "edgespec", "n", "role", "content", "type", "json_schema", "schema"]
    return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randint(0, 5))}


def random_cases(seed: int, count: int) -> Iterator[Case]:
    rng = random.Random(seed)
    paths = list(BASELINES)
    for i in range(count):
        path = paths[i % len(paths)]
        body = random_json(rng)
        if isinstance(body, dict) and rng.random() < 0.7:  # keep many of them close to valid
            body = dict(BASELINES[path], **body)
            if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 64:
                body["max_tokens"] = SMALL_MAX_TOKENS
        yield Case(f"{path} random JSON", "POST", path, body)


def transport_cases(max_body: int) -> Iterator[Case]:
    chat = "/v1/chat/completions"
    js = {"content-type": "application/json"}
    yield Case("invalid JSON", "POST", chat, raw=b'{"messages": [', headers=js)
    yield Case("empty body", "POST", chat, raw=b"", headers=js)
    yield Case("JSON array body", "POST", chat, raw=b"[1, 2]", headers=js)
    yield Case("non-UTF-8 body", "POST", chat, raw=b'{"messages": "\xff\xfe"}', headers=js)
    yield Case("deeply nested JSON", "POST", chat, raw=b"[" * 100000 + b"]" * 100000, headers=js)
    yield Case("text/plain body", "POST", chat, raw=b"hello", headers={"content-type": "text/plain"})
    yield Case("form body", "POST", chat, raw=b"a=b", headers={"content-type": "application/x-www-form-urlencoded"})
    yield Case("no content-type", "POST", chat, raw=json.dumps(BASELINES[chat]).encode())
    yield Case("body over limit", "POST", chat, raw=b" " * (max_body + 1), headers=js)
    yield Case("chunked body over limit", "POST", chat, raw=b" " * (max_body + 1), headers=js, chunked=True)
    yield Case("bad content-length", "POST", chat,
               wire=b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}")
    yield Case("negative content-length", "POST", chat,
               wire=b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}")
    yield Case("garbage request line", "GET", "?", wire=b"\x16\x03\x01 hello there\r\n\r\n")
    yield Case("truncated body then close", "POST", chat,
               wire=b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 500\r\n\r\n{\"messages\": [")
    yield Case("max_tokens beyond the context", "POST", chat, dict(BASELINES[chat], max_tokens=10**9))
    yield Case("max_tokens as text", "POST", chat, dict(BASELINES[chat], max_tokens="10"))
    yield Case("NaN literal", "POST", chat, raw=b'{"messages":[{"role":"user","content":"a"}],"temperature":NaN}',
               headers=js)
    yield Case("prompt of booleans", "POST", "/v1/completions", {"prompt": [False]})
    yield Case("unknown route", "GET", "/v2/everything")
    yield Case("unknown route POST", "POST", "/v1/embeddings", {"input": "x"})
    yield Case("wrong method", "DELETE", chat)
    yield Case("wrong method on health", "POST", "/health")
    yield Case("unknown model card", "GET", "/v1/models/" + "x" * 5000)
    yield Case("path traversal", "GET", "/v1/models/../../etc/passwd")


# ---- running --------------------------------------------------------------------------------------------------


def documented(doc: dict[str, Any], method: str, path: str) -> set[int]:
    """Statuses the OpenAPI document declares for ``method path`` (path templates matched); an unknown route may
    answer 404 and a known path with another method 405."""
    for template, ops in doc.get("paths", {}).items():
        head = template.split("{", 1)[0]
        if template == path or ("{" in template and path.startswith(head) and len(path) > len(head)):
            op = ops.get(method.lower())
            if op is None:
                return {405}
            return {int(code) for code in op.get("responses", {}) if code.isdigit()} | {422}
    return {404, 405}


def error_problem(status: int, body: bytes | str) -> str | None:
    """What is wrong with an error answer's body (OpenAI shape, a string code), or None."""
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return f"error body not in OpenAI shape: {str(body)[:200]}"
    if not {"message", "type", "param", "code"} <= set(err):
        return f"error body lacks fields: {str(body)[:200]}"
    if not isinstance(err["code"], str) or not err["code"]:
        return f"{status} error without a code: {str(body)[:200]}"
    return None


def send_wire(base_url: str, case: Case, timeout: float) -> Outcome:
    """Write raw bytes, half-close, read the status line (no answer at all is fine for garbage)."""
    url = httpx.URL(base_url)
    t0 = time.monotonic()
    try:
        with socket.create_connection((url.host, url.port), timeout=timeout) as sock:
            sock.sendall(case.wire or b"")
            sock.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
    except TimeoutError:
        return Outcome(case, None, time.monotonic() - t0, "hang (no answer within the timeout)")
    except OSError:
        data = b""
    dt = time.monotonic() - t0
    if not data:
        return Outcome(case, 0, dt)  # connection closed without an answer: acceptable for garbage
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else -1
    problem = f"server error {status}" if status >= 500 or status < 0 else None
    if problem is None and status >= 400:
        problem = error_problem(status, data.partition(b"\r\n\r\n")[2])
    return Outcome(case, status, dt, problem)


def send(client: httpx.Client, case: Case, timeout: float) -> Outcome:
    if case.wire is not None:
        return send_wire(str(client.base_url), case, timeout)
    t0 = time.monotonic()
    try:
        if case.raw is not None:
            content: Any = case.raw
            if case.chunked:
                data = case.raw
                content = (data[i:i + 65536] for i in range(0, len(data), 65536))
            r = client.request(case.method, case.path, content=content, headers=case.headers, timeout=timeout)
        else:
            r = client.request(case.method, case.path, json=case.json_body, headers=case.headers, timeout=timeout)
        text = r.text
    except httpx.TimeoutException:
        return Outcome(case, None, time.monotonic() - t0, "hang (no answer within the timeout)")
    except httpx.TransportError as exc:
        return Outcome(case, None, time.monotonic() - t0, f"transport error: {exc!r}")
    dt = time.monotonic() - t0
    problem = None
    if r.status_code >= 500:
        problem = f"server error {r.status_code}: {text[:200]}"
    elif r.status_code >= 400:
        problem = error_problem(r.status_code, text)
    elif r.status_code == 200 and case.json_body is not None and isinstance(case.json_body, dict) \
            and case.json_body.get("stream") is True and "data: [DONE]" not in text:
        problem = "stream did not end with [DONE]"
    return Outcome(case, r.status_code, dt, problem)


def _label(status: int | None) -> str:
    return "HANG" if status is None else "closed" if status == 0 else str(status)


def report(outcomes: list[Outcome], verbose: bool) -> int:
    """Print the table (one row per field, or per case with ``verbose``); returns the exit status."""
    rows: dict[str, Counter] = defaultdict(Counter)
    for o in outcomes:
        key = o.case.family if verbose else o.case.family.split(" = ")[0].replace("missing ", "")
        rows[key][_label(o.status)] += 1
    width = min(78, max(len(k) for k in rows))
    print(f"{'case':<{width}}  statuses")
    print("-" * (width + 20))
    for key, counts in rows.items():
        shown = ", ".join(f"{s}x{n}" if n > 1 else s for s, n in sorted(counts.items()))
        print(f"{key[:width]:<{width}}  {shown}")
    totals = Counter(_label(o.status) for o in outcomes)
    problems = [o for o in outcomes if o.problem]
    slowest = max(outcomes, key=lambda o: o.seconds)
    print("-" * (width + 20))
    print(f"requests: {len(outcomes)}   by status: " + ", ".join(f"{k}: {v}" for k, v in sorted(totals.items())))
    print(f"5xx: {sum(1 for o in outcomes if o.status and o.status >= 500)}   hangs: "
          f"{sum(1 for o in outcomes if o.status is None)}   malformed errors: "
          f"{sum(1 for o in problems if o.status and o.status < 500)}   slowest: {slowest.seconds:.2f}s "
          f"({slowest.case.family})")
    for o in problems[:20]:
        print(f"PROBLEM {o.case.method} {o.case.path} [{o.case.family}]: {o.problem}")
    return 1 if problems else 0


def run(url: str, api_key: str | None, seed: int, random_count: int, timeout: float, verbose: bool) -> int:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, headers=headers) as client:
        doc = client.get("/openapi.json").json()
        cases = (list(schema_cases(doc)) + list(grammar_cases()) + list(random_cases(seed, random_count))
                 + list(transport_cases(1 << 20)))
        outcomes = []
        for case in cases:
            o = send(client, case, timeout)
            # The connection layer answers what it cannot parse (400 invalid_http) or receive in time (408).
            allowed = documented(doc, case.method, case.path) | ({400, 408} if case.wire is not None else set())
            if o.problem is None and o.status and o.status not in allowed:
                o.problem = f"status {o.status} is not documented for {case.method} {case.path}"
            outcomes.append(o)
        health = client.get("/health")
        print(f"health after fuzzing: {health.status_code} {health.json().get('status')}")
    code = report(outcomes, verbose)
    if health.status_code != 200:
        print("PROBLEM server not healthy after fuzzing")
        code = 1
    return code


def schemathesis(url: str, examples: int, seed: int, timeout: float) -> int:
    """Run schemathesis' CLI against ``url``'s OpenAPI document; its exit status."""
    import shutil
    import subprocess

    st = shutil.which("st") or shutil.which("schemathesis")
    if st is None:
        print("PROBLEM schemathesis is not installed (pip install schemathesis)")
        return 1
    checks = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
    return subprocess.call([st, "run", url + "/openapi.json", "--checks", checks, "--max-examples", str(examples),
                            "--request-timeout", str(timeout), "--seed", str(seed)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="fuzz a running server instead of spawning one")
    ap.add_argument("--api-key")
    ap.add_argument("--model", default="tiny", help="model of the spawned server: tiny (random), demo, or a folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--random", type=int, default=200, help="number of random JSON bodies")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds before a request counts as a hang")
    ap.add_argument("--verbose", action="store_true", help="one table row per case instead of per field")
    ap.add_argument("--schemathesis", type=int, metavar="N", default=0,
                    help="afterwards run schemathesis (st) with N examples per operation: no 5xx, only documented "
                         "statuses, content types and bodies as the OpenAPI document says")
    args = ap.parse_args(argv)
    if args.url:
        return run(args.url, args.api_key, args.seed, args.random, args.timeout, args.verbose)

    # The tiny chat model and the server subprocess are test helpers (tests/serving_helpers.py), not package code.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from serving_helpers import ServerProcess, write_tiny_chat_model

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model == "tiny":
            model = str(write_tiny_chat_model(Path(tmp) / "tiny"))
        server = ServerProcess(model, env={"OMP_NUM_THREADS": "1"}, log_path=Path(tmp) / "server.log",
                               drafter="ngram", max_seq_len=256, request_timeout_s=20, max_queue=4)
        with server:
            code = run(server.url, None, args.seed, args.random, args.timeout, args.verbose)
            if args.schemathesis:
                code = schemathesis(server.url, args.schemathesis, args.seed, args.timeout) or code
        log = (Path(tmp) / "server.log").read_text(errors="replace")
        tracebacks = log.count("Traceback")
        print(f"server exit status after SIGTERM: {server.returncode}; tracebacks in its log: {tracebacks}")
        if tracebacks:
            print(log[log.index("Traceback"):][:3000])
        return code or (1 if server.returncode != 0 or tracebacks else 0)


if __name__ == "__main__":
    sys.exit(main())
