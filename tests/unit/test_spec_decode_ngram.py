"""Prompt-lookup proposals (engine_svc/spec_decode/ngram.py): vLLM's rule on worked examples,
the C kernel equal to the Python reference on random batches, and the length bound."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine_svc.spec_decode.ngram import NgramConfig, NgramProposer, propose_row


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> NgramProposer:
    proposer = NgramProposer(NgramConfig(3, 1, 4), 1 << 20, tmp_path_factory.mktemp("kernels"))
    assert proposer.native, "the C kernel did not build (cc is on CI's image)"
    return proposer


@pytest.mark.parametrize(
    ("tokens", "min_n", "max_n", "k", "want"),
    [
        ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),  # "2 3" at 1
        ([1, 2, 3, 4, 1, 2, 3], 1, 4, 2, [4, 1]),  # "1 2 3" at 0 is the longest
        ([1, 2, 3, 4, 1, 2, 3], 4, 4, 2, []),  # no earlier 4-gram
        ([5, 1, 9, 5, 2, 9, 5], 1, 3, 3, [2, 9, 5]),  # "9 5" at 2 beats "5" at 0
        ([5, 1, 5, 2, 5], 1, 1, 3, [1, 5, 2]),  # "5" at 0 and 2: the earliest
        ([7, 7, 7, 7], 1, 2, 3, [7, 7]),  # "7 7" at 0; only two tokens follow it
        ([3], 1, 1, 2, []),  # too short: nothing earlier
        ([1, 2, 1, 2, 1, 2], 2, 2, 4, [1, 2, 1, 2]),  # the proposal may run into the suffix
    ],
)
def test_rule(tokens: list[int], min_n: int, max_n: int, k: int, want: list[int]) -> None:
    assert propose_row(tokens, min_n, max_n, k, 1000) == want
    proposer = NgramProposer(NgramConfig(k, min_n, max_n), 1000, None)
    arr = np.array([tokens], dtype=np.int32)
    out, counts = proposer.propose(arr, np.array([0]), np.array([len(tokens)]))
    assert out[0, : counts[0]].tolist() == want


def test_the_model_length_bounds_the_proposal() -> None:
    tokens = [1, 2, 3, 4, 1, 2]
    assert propose_row(tokens, 1, 2, 3, 8) == [3, 4]  # room for 2 more tokens
    assert propose_row(tokens, 1, 2, 3, 6) == []  # none


def test_config_is_checked() -> None:
    for bad in ((0, 1, 4), (2, 0, 4), (2, 5, 4)):
        with pytest.raises(ValueError):
            NgramConfig(*bad)


@pytest.mark.parametrize("vocab", [2, 5, 50])
def test_the_kernel_equals_the_reference(native: NgramProposer, vocab: int) -> None:
    rng = random.Random(vocab)
    rows, width = 96, 300  # >= 64 rows: the OpenMP path
    tokens = np.zeros((rows + 4, width), dtype=np.int32)
    lens = []
    for r in range(rows + 4):
        n = rng.randint(1, width)
        tokens[r, :n] = [rng.randrange(vocab) for _ in range(n)]
        lens.append(n)
    for min_n, max_n, k, max_len in ((1, 4, 3, 1 << 20), (2, 2, 5, 1 << 20), (1, 6, 4, 150)):
        proposer = NgramProposer(NgramConfig(k, min_n, max_n), max_len, None)
        proposer._lib = native._lib  # the same rule through C
        picked = np.array(sorted(rng.sample(range(rows + 4), rows)))  # not contiguous
        for select in (picked, np.arange(2, rows + 2)):  # and contiguous
            out, counts = proposer.propose(tokens, select, np.array(lens)[select])
            for i, r in enumerate(select.tolist()):
                want = propose_row(tokens[r, : lens[r]].tolist(), min_n, max_n, k, max_len)
                assert out[i, : counts[i]].tolist() == want, (r, min_n, max_n, k)


def test_the_speculative_config_is_read_as_vllm_writes_it() -> None:
    from engine_svc.spec_decode.ngram import parse_speculative_config as parse

    full = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, '
    assert parse(full + '"prompt_lookup_max": 3}') == NgramConfig(5, 2, 3)
    assert parse('{"method": "ngram", "num_speculative_tokens": 2}') == NgramConfig(2, 1, 4)
    one = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
    assert parse(one) == NgramConfig(2, 3, 3)  # the other bound takes its value
    for bad, message in [
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method 'eagle' is not supported"),
        ('{"method": "ngram"}', "needs num_speculative_tokens"),
        ('{"method": "ngram", "model": "/m/draft", "num_speculative_tokens": 3}', "unknown keys"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "at least 1"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "x": 1}', "unknown keys"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, '
            '"prompt_lookup_max": 3}',
            "1 <= min <= max",
        ),  # fmt: skip
    ]:
        with pytest.raises(ValueError, match=message):
            parse(bad)


def test_the_flag_reaches_the_config_and_bad_values_exit_with_a_message() -> None:
    from engine_svc.__main__ import main, parse_args

    args = parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert args.speculative_config is not None
    with pytest.raises(SystemExit, match="not supported"):
        main(["--speculative-config", '{"method": "medusa", "num_speculative_tokens": 3}'])
    with pytest.raises(SystemExit, match="at least 1"):  # (speculation runs under TP)
        main(
            ["-tp", "0", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
        )
