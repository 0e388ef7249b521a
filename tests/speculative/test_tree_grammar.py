"""Grammars inside draft trees: each node judged and masked in its own ancestors' grammar state (llguidance).

* the matcher's tree walk: a node's mask equals the chain mask of its own path, invalid nodes (and everything below
  them) are dropped, and the matcher ends exactly where it began;
* greedy constrained tree output == plain constrained output, for a JSON schema and a tool-call grammar, on the
  tiny Qwen3 and Qwen3.5 hybrid targets in fp32, through the eager tree verify (base hooks) and the static one
  (thor hooks), with sibling accepts and grammar-rejected nodes really happening;
* sampled constrained tree output follows plain constrained sampling (chi-square against the exact law), and never
  emits a token the grammar forbids.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from test_acceptance import _chi_square
from test_spec_lossless import _prompts
from test_tree_lossless import OracleTree

from edgespec.arch.detect import select_hooks
from edgespec.bench.shapes import write_chat_tokenizer
from edgespec.drafters.base import Proposer
from edgespec.drafters.ngram import NGramProposer
from edgespec.drafters.tree import Branch, DraftTree, tree_from_branches
from edgespec.loading.tokenizer import ChatTokenizer
from edgespec.serving.grammar import JSON_DEFAULTS, GrammarCompiler
from edgespec.serving.tools import tool_grammar
from edgespec.speculative.acceptance import RejectionSampling, StrictGreedy
from edgespec.speculative.sampling import SamplingParams, target_probs
from edgespec.speculative.session import SpecSession

CPU = torch.device("cpu")
VOCAB = 320
NOTE = {"type": "object", "properties": {"note": {"type": "string", "maxLength": 24},
                                         "speed": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["note", "speed"], "additionalProperties": False}
MOVE = {"name": "move", "parameters": {"type": "object", "properties": {
    "target": {"type": "string", "maxLength": 12}, "fast": {"type": "boolean"}}, "required": ["target", "fast"]}}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models on 2 shared cores: one intra-op thread is many times faster than two fighting other jobs (the
    conftest puts the count back after each test)."""
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    return ChatTokenizer.from_folder(write_chat_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def compiler(tokenizer: ChatTokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB)


def _grammar(compiler: GrammarCompiler, kind: str):
    if kind == "json_schema":
        return compiler.json_schema(NOTE)
    return compiler.lark(tool_grammar([MOVE], "json", JSON_DEFAULTS, False))


def test_tree_masks_are_each_paths_chain_masks_and_leave_the_matcher_where_it_was(compiler, tokenizer):
    c = compiler.json_schema(NOTE)
    c.commit(tokenizer.encode('{"note": "ab'))
    e = tokenizer.encode
    # Inside the string: 'cd",' and 'x"' hold; '"}' and '"x' share the closing quote, then '}' (no "speed" yet)
    # and 'x' (only ',' may follow the string) are rejected.
    branches = [Branch(tuple(e('cd",')), 3.0), Branch(tuple(e('x"')), 2.0), Branch(tuple(e('"}')), 1.0),
                Branch(tuple(e('"x')), 0.5)]
    tree = tree_from_branches(branches, 16)
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    before = c.row_masks([], VOCAB, CPU)
    valid = c.tree_valid(tokens, parents)
    bad = {i for i in range(tree.size) if tree.path_to(i + 1)[1:] and
           [tokens[r - 1] for r in tree.path_to(i + 1)[1:]] in (e('"}'), e('"x'))}
    assert bad and [i for i, ok in enumerate(valid) if not ok] == sorted(bad)
    kept = tree.subset(torch.tensor(valid))
    masks = c.tree_masks(kept.tokens.tolist(), kept.parents.tolist(), VOCAB, CPU)
    assert masks.shape == (kept.size + 1, VOCAB)
    for row in range(kept.size + 1):
        path = [int(kept.tokens[r - 1]) for r in kept.path_to(row)[1:]]
        assert torch.equal(masks[row], c.row_masks(path, VOCAB, CPU)[-1]), path
    # Rolled back exactly: the same masks and the same valid continuations as before the walks.
    assert torch.equal(c.row_masks([], VOCAB, CPU), before)
    assert c.valid_prefix(e('cd", "speed": 7}')) == len(e('cd", "speed": 7}'))
    with pytest.raises(ValueError, match="not valid under the grammar"):
        c.tree_masks(tokens, parents, VOCAB, CPU)
    assert torch.equal(c.row_masks([], VOCAB, CPU), before)


def test_a_finished_value_ends_every_branch(compiler, tokenizer):
    stops = set(tokenizer.stop_token_ids)
    stop = tokenizer.stop_token_ids[0]
    five, six = tokenizer.encode("5")[0], tokenizer.encode("6")[0]
    # 5, the stop token, then 6, and 6 alone. Up to 99, "5" may end or go on: the stop token is consumed (and
    # rolled back after), nothing may follow it.
    tree = tree_from_branches([Branch((five, stop, six), 2.0), Branch((six,), 1.0)], 8)
    assert tree.tokens.tolist() == [five, stop, six, six]
    c = compiler.json_schema({"type": "integer", "minimum": 0, "maximum": 99})
    valid = c.tree_valid(tree.tokens.tolist(), tree.parents.tolist())
    assert valid == [True, True, False, True]
    kept = tree.subset(torch.tensor(valid))
    masks = c.tree_masks(kept.tokens.tolist(), kept.parents.tolist(), VOCAB, CPU)
    assert stops <= set(torch.nonzero(masks[1]).flatten().tolist())          # after "5": a digit or the end
    assert set(torch.nonzero(masks[2]).flatten().tolist()) <= stops or masks[2].all()
    assert c.valid_prefix([six, six]) == 2 and not c.is_finished()          # rolled back past the stop token
    # Up to 9, "5" is a finished value: nothing below it is verified; its row allows only the end.
    c = compiler.json_schema({"type": "integer", "minimum": 0, "maximum": 9})
    assert c.tree_valid(tree.tokens.tolist(), tree.parents.tolist()) == [True, False, False, True]
    masks = c.tree_masks([five, six], [-1, -1], VOCAB, CPU)
    assert set(torch.nonzero(masks[1]).flatten().tolist()) == stops
    assert c.valid_prefix([six]) == 1


class GrammarOracle(OracleTree):
    """:class:`OracleTree` under a grammar: its wrong branch goes astray with a token the grammar allows there (a
    shadow matcher follows the committed tokens), so the right path is often a second sibling; a third branch is
    the plain continuation with a token the grammar rejects (dropped before the verify)."""

    def __init__(self, inner: Proposer, continuation: Sequence[int], shadow, stop: Sequence[int], seed: int) -> None:
        super().__init__(inner, continuation, VOCAB, seed)
        self.shadow, self.stop = shadow, set(stop)

    def propose_tree(self, last_token: int, k: int, budget: int, chain_first: bool = False) -> DraftTree | None:
        self.inner.propose_tree(last_token, k, budget, chain_first)
        future = self.continuation[self.emitted:self.emitted + k]
        if not future:
            return None
        allowed = self.shadow.row_masks(future, VOCAB, CPU)
        free = [i for i in range(len(future)) if int(allowed[i].sum()) > 1]
        at = self.rng.choice(free) if free else 0
        other = [t for t in torch.nonzero(allowed[at]).flatten().tolist() if t != future[at]] or [future[at]]
        astray = future[:at] + [self.rng.choice(other)]
        junk = future[:at] + [VOCAB - 1] + future[at + 1:]          # an id the tokenizer does not have
        cut = len(future) if self.rng.random() < 0.8 else self.rng.randrange(1, len(future) + 1)
        right = Branch(tuple(future[:cut]), 1.0)
        first = [Branch(tuple(astray), 2.0), right] if self.rng.random() < 0.7 else [right, Branch(tuple(astray))]
        return tree_from_branches(first + [Branch(tuple(junk), 0.5)], budget)

    def commit(self, tokens, accepted, verify, drafted=0) -> None:
        super().commit(tokens, accepted, verify, drafted)
        kept = []
        for t in tokens:
            if t in self.stop:
                break
            kept.append(t)
        if kept and not self.shadow.is_finished():
            self.shadow.commit(kept)


def _spy(fn, calls: list):
    """``fn`` that also appends each result to ``calls``."""
    def wrapped(*args):
        calls.append(out := fn(*args))
        return out
    return wrapped


def _plain_constrained(model, compiler, kind, prompt, n, stop) -> list[int]:
    s = SpecSession.with_defaults(model, select_hooks("base", CPU), None, max_len=256)
    return s.generate(prompt, max_tokens=n, policy=StrictGreedy(), stop_ids=stop,
                      constraint=_grammar(compiler, kind)).token_ids


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("kind", ["json_schema", "tools"])
def test_greedy_constrained_tree_equals_plain(tiny_models, compiler, tokenizer, family, kind):
    model = tiny_models[family]
    stop = tokenizer.stop_token_ids
    prompt = _prompts(VOCAB)[1]
    n = 48 if kind == "json_schema" else 96           # a tool call's first 48 bytes are all forced
    plain = _plain_constrained(model, compiler, kind, prompt, n, stop)
    assert len(plain) > 8
    for arch in ("base", "thor"):
        oracle = GrammarOracle(NGramProposer(), plain, _grammar(compiler, kind), stop, seed=len(arch) + len(kind))
        session = SpecSession.with_defaults(model, select_hooks(arch, CPU), oracle, k=6, max_len=256, draft_tree=12,
                                            kv_fp8=False)
        constraint = _grammar(compiler, kind)
        rejected: list[list[bool]] = []
        constraint.tree_valid = _spy(constraint.tree_valid, rejected)
        out = session.generate(prompt, max_tokens=n, policy=StrictGreedy(), stop_ids=stop, constraint=constraint)
        assert out.token_ids == plain, (arch, tokenizer.decode(out.token_ids), tokenizer.decode(plain))
        tel = out.telemetry
        assert tel.tree_cycles > 0 and tel.tree_sibling_accepts > 0 and tel.accepted_tokens > 0, arch
        # The junk branch (and every other node the grammar rejects) was dropped before each verify.
        assert sum(v.count(False) for v in rejected) >= len(rejected) > 0
        stats = tel.to_dict()["tree_node_stats"]
        assert sum(v["accepted"] for v in stats.values()) == tel.accepted_tokens


def test_constrained_auto_trees_stay_lossless(tiny_models, compiler, tokenizer):
    """``draft_tree: auto`` with a grammar and the real n-gram drafter: trees sized by cost, output plain's."""
    model = tiny_models["qwen3_5"]
    stop = tokenizer.stop_token_ids
    prompt = _prompts(VOCAB)[0]
    plain = _plain_constrained(model, compiler, "json_schema", prompt, 40, stop)
    session = SpecSession.with_defaults(model, select_hooks("base", CPU), NGramProposer(), k=6, max_len=256,
                                        draft_tree="auto")
    out = session.generate(prompt, max_tokens=40, policy=StrictGreedy(), stop_ids=stop,
                           constraint=_grammar(compiler, "json_schema"))
    assert out.token_ids == plain


class FixedTree(Proposer):
    """The same tree of letters every cycle (first branch heaviest)."""

    name = "fixed"

    def __init__(self, branches: list[Branch]) -> None:
        self.branches = branches

    def begin(self, prompt_ids, prefill) -> None:
        pass

    def propose(self, last_token, k):
        raise AssertionError("a tree session asks for trees")

    def propose_tree(self, last_token, k, budget, chain_first=False):
        return tree_from_branches(self.branches, budget)

    def commit(self, tokens, accepted, verify, drafted=0) -> None:
        pass


def test_sampled_constrained_tree_follows_plain_constrained_sampling(tiny_models, compiler, tokenizer):
    """Two letters of a..d under a grammar: the pairs emitted with trees (siblings, a branch the grammar cuts)
    follow the exact law of plain constrained sampling, the masked target distributions of the two steps
    (99.9% chi-square quantile at 15 dof: 37.7); no forbidden token is ever emitted."""
    model = tiny_models["qwen3"]
    stop = tokenizer.stop_token_ids
    letters = tokenizer.encode("abcd")
    grammar = "start: /[a-d][a-d]/"
    params = SamplingParams(temperature=1.6)
    prompt = _prompts(VOCAB)[1][:12]
    plain = SpecSession.with_defaults(model, select_hooks("base", CPU), None, max_len=64)
    # The exact law: p(x) from the prompt's last row masked to a..d, p(y | x) from x's row.
    mask = torch.zeros(VOCAB, dtype=torch.bool)
    mask[letters] = True
    law = torch.zeros(4, 4)
    with torch.inference_mode():
        for i, x in enumerate(letters):
            logits = model.forward(torch.tensor(prompt + [x]), model.new_cache(64), chunked=False).logits
            p = target_probs(logits[-2:].masked_fill(~mask, float("-inf")), params)
            law[i] = p[0, letters[i]] * p[1, letters]
    a, b, c, d = letters
    trees = FixedTree([Branch((a, c), 3.0), Branch((b, b), 2.0), Branch((c, VOCAB - 1), 1.5), Branch((d,), 1.0)])
    session = SpecSession.with_defaults(model, select_hooks("base", CPU), trees, k=2, max_len=64, draft_tree=8)
    gen = torch.Generator().manual_seed(3)

    def pairs(s: SpecSession, n: int) -> tuple[torch.Tensor, int]:
        counts, siblings = torch.zeros(4, 4), 0
        for _ in range(n):
            out = s.generate(prompt, max_tokens=3, policy=RejectionSampling(params, gen), stop_ids=stop,
                             constraint=compiler.lark(grammar, "test"))
            assert len(out.token_ids) == 2 and all(t in letters for t in out.token_ids), out.token_ids
            counts[letters.index(out.token_ids[0]), letters.index(out.token_ids[1])] += 1
            siblings += out.telemetry.tree_sibling_accepts
        return counts, siblings

    with_trees, siblings = pairs(session, 900)
    assert siblings > 0
    assert _chi_square(with_trees.flatten(), law.flatten()) < 37.7, (with_trees / with_trees.sum(), law)
    without, _ = pairs(plain, 300)                               # plain constrained sampling, the same check
    assert _chi_square(without.flatten(), law.flatten()) < 37.7


def test_tree_sampling_over_masked_rows_is_plain_constrained_sampling(compiler, tokenizer):
    """The accept rule alone over a tree whose rows the grammar masks, many more draws: the first token follows the
    root row masked by the grammar, the second the masked row of the first's node; a node the grammar rejects is
    never verified and a forbidden token never emitted (99.9% chi-square quantiles: 3 dof 16.3)."""
    from edgespec.speculative.tree_accept import accept_tree
    from edgespec.speculative.tree_cycle import _masked_rows

    a, b, c, d, e = tokenizer.encode("abcde")
    grammar = compiler.lark("start: /[a-d][a-d]/", "test")
    tree = tree_from_branches([Branch((a, c), 3.0), Branch((b, e), 2.0), Branch((b, d), 1.8), Branch((e, a), 1.5),
                               Branch((c,), 1.0)], 16)
    kept = tree.subset(torch.tensor(grammar.tree_valid(tree.tokens.tolist(), tree.parents.tolist())))
    assert e not in kept.tokens.tolist() and kept.size == 5          # (b, e) and (e, a) cut at the e
    torch.manual_seed(4)
    logits = torch.randn(kept.size + 1, VOCAB) * 2
    params = SamplingParams(temperature=1.2)
    p = target_probs(_masked_rows(logits, kept, grammar), params)      # [rows, V], zero off a..d
    policy = RejectionSampling(params, torch.Generator().manual_seed(5))
    letters = [a, b, c, d]
    first = torch.zeros(4)
    after_b = torch.zeros(4)
    row_b = 1 + kept.tokens.tolist().index(b)
    for _ in range(6000):
        v = accept_tree(policy, _masked_rows(logits, kept, grammar), kept)
        assert all(t in letters for t in v.tokens[:2]), v.tokens
        first[letters.index(v.tokens[0])] += 1
        if v.tokens[0] == b:
            after_b[letters.index(v.tokens[1])] += 1
    assert _chi_square(first, p[0, letters]) < 16.3, (first / first.sum(), p[0, letters])
    assert _chi_square(after_b, p[row_b, letters]) < 16.3, (after_b / after_b.sum(), p[row_b, letters])
