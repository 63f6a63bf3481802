"""The reasoning parsers on their own: vLLM's split of ``<think>``…``</think>`` output, the same
result for every split of a text into streamed pieces, when a request's output begins in
reasoning, its reasoning tokens, and the ``--reasoning-parser`` flag."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from frontend_svc.config import FrontendConfig, config_from_args, config_from_json, config_to_json
from frontend_svc.reasoning import (
    REASONING_PARSER_NAMES,
    ReasoningStream,
    get_reasoning_parser,
    prompt_ends_reasoning,
)
from frontend_svc.text.chat_template import cut_after_final_message, render_chat
from frontend_svc.text.tokenizer import SpecialTokens, Tokenizer
from tests.chat_templates import QWEN3_THINKING_TEMPLATE
from tests.frontend.tiny_tokenizer import build_tiny_tokenizer

pytestmark = pytest.mark.timeout(60)

START, END = "<think>", "</think>"

# Outputs as the models write them, and the ways they go wrong: the start tag in the output or
# in the prompt, no end tag, tags inside the answer, whitespace, near-miss tags.
GENERATIONS = [
    "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
    "Let me think: 6 * 7 = 42.</think>The answer is 42.",
    "\n<think>a</think>b",
    "</think>",
    "<think></think>",
    "thinking, then cut off before the end",
    'reasoning with a <tool_call>\n{"name": "f"}\n</tool_call> in it',
    "x</think>y</think>z<think>w",
    "<thi</thin</think<think>>",
    "  \n ",
    "<think",
    "a <think> in the middle</think>ok",
    "Café ☕ </think>日本語",
]


def reference(text: str) -> tuple[str | None, str | None]:
    """The split, written plainly: an opening start tag (after whitespace) dropped; reasoning up
    to the first end tag, content after it; no end tag: all reasoning; empty parts None."""
    opened = text.lstrip()
    if opened.startswith(START):
        text = opened[len(START) :]
    reasoning, tag, content = text.partition(END)
    return (reasoning or None, content or None) if tag else (text or None, None)


def streamed(pieces: Iterable[str], in_reasoning: bool = True) -> tuple[str, str]:
    """Reasoning and content of ``pieces`` fed one at a time, the last one final."""
    stream = ReasoningStream(START, END, in_reasoning)
    reasoning, content = "", ""
    pieces = list(pieces)
    for i, piece in enumerate(pieces):
        out = stream.feed(piece, final=i == len(pieces) - 1)
        reasoning += out.reasoning
        content += out.content
    return reasoning, content


def as_strings(split: tuple[str | None, str | None]) -> tuple[str, str]:
    return split[0] or "", split[1] or ""


# -- the split ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # Qwen3: <think> written by the model.
        ("<think>\nHmm.\n</think>\n\nHi!", ("\nHmm.\n", "\n\nHi!")),
        # DeepSeek-R1 / Qwen3.5: <think> in the prompt, only </think> in the output.
        ("Hmm.</think>Hi!", ("Hmm.", "Hi!")),
        # No </think>: cut off while thinking, all reasoning (content null).
        ("Hmm, let me", ("Hmm, let me", None)),
        ("<think>Hmm", ("Hmm", None)),
        # Ended right after the reasoning: content null; nothing before </think>: reasoning null.
        ("Hmm.</think>", ("Hmm.", None)),
        ("</think>Hi!", (None, "Hi!")),
        ("", (None, None)),
        # The first </think> ends it; what follows is content, tags and all.
        ("a</think>b</think>c", ("a", "b</think>c")),
        # A tool call inside the reasoning stays reasoning.
        ("<tool_call>{}</tool_call></think>Hi", ("<tool_call>{}</tool_call>", "Hi")),
    ],
)
@pytest.mark.parametrize("name", REASONING_PARSER_NAMES)
def test_whole_output_split_as_vllm(
    name: str, text: str, expected: tuple[str | None, str | None]
) -> None:
    assert get_reasoning_parser(name).extract(text) == expected


def test_the_plain_reference_agrees_on_the_examples() -> None:
    parser = get_reasoning_parser("qwen3")
    for text in GENERATIONS:
        assert parser.extract(text) == reference(text), text


@pytest.mark.parametrize("text", GENERATIONS)
def test_every_split_in_two_or_three_pieces_gives_the_whole_result(text: str) -> None:
    expected = as_strings(reference(text))
    n = len(text)
    for i in range(n + 1):
        assert streamed([text[:i], text[i:]]) == expected, (text, i)
        for j in range(i, n + 1):
            assert streamed([text[:i], text[i:j], text[j:]]) == expected, (text, i, j)


@pytest.mark.parametrize("text", GENERATIONS)
def test_one_character_at_a_time_and_an_empty_final_piece(text: str) -> None:
    assert streamed([*text, ""]) == as_strings(reference(text))


# Texts made of the pieces that matter: tags, their beginnings and ends, whitespace, letters.
FRAGMENTS = ["<think>", "</think>", "<", "</", "<th", "think", ">", "</th", "ink>", " ", "\n", "a"]


@settings(max_examples=400, deadline=None)
@given(
    parts=st.lists(st.sampled_from(FRAGMENTS), max_size=14),
    cuts=st.lists(st.integers(min_value=0, max_value=80), max_size=8),
)
def test_any_split_of_any_text_gives_the_whole_result(parts: list[str], cuts: list[int]) -> None:
    text = "".join(parts)
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    assert streamed(pieces) == as_strings(reference(text))


def test_tags_are_held_back_only_while_they_may_still_come() -> None:
    stream = ReasoningStream(START, END, True)
    assert stream.feed(" <th").reasoning == ""  # maybe an opening <think>
    assert stream.feed("ink>I think").reasoning == "I think"
    assert stream.feed(" so</thi").reasoning == " so"  # maybe </think>
    out = stream.feed("s is not it <")
    assert (out.reasoning, out.content) == ("</this is not it ", "")
    assert not stream.reasoning_ended
    out = stream.feed("/think>Answer")
    assert (out.reasoning, out.content) == ("", "Answer")
    assert stream.reasoning_ended
    assert stream.feed(" more", final=True).content == " more"
    with pytest.raises(RuntimeError, match="already got its final text"):
        stream.feed("late")


def test_a_stream_that_does_not_begin_in_reasoning_is_all_content() -> None:
    text = "<think>not parsed</think>at all"
    assert streamed([text[:9], text[9:]], in_reasoning=False) == ("", text)


# -- when a request's output begins in reasoning ------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The tiny tokenizer with <think> and </think> as tokens of their own, not special (as in
    Qwen3's vocabulary), and Qwen3's way of thinking in its chat template."""
    directory = build_tiny_tokenizer(tmp_path_factory.mktemp("think_tokenizer"))
    hf = HFTokenizer.from_file(str(directory / "tokenizer.json"))
    hf.add_tokens([AddedToken(START, special=False), AddedToken(END, special=False)])
    return Tokenizer(hf, SpecialTokens("<|bos|>", "<|eos|>"), QWEN3_THINKING_TEMPLATE)


def prompt(
    tokenizer: Tokenizer,
    messages: list[dict[str, str]],
    continue_final_message: bool = False,
    **kwargs: object,
) -> list[int]:
    """The prompt's ids: the chat rendered with a generation prompt, or cut after the final
    message's content to continue it."""
    text = render_chat(
        QWEN3_THINKING_TEMPLATE,
        messages,
        add_generation_prompt=not continue_final_message,
        bos_token="",
        eos_token="",
        extra=kwargs,
    )
    if continue_final_message:
        text = cut_after_final_message(text, messages[-1]["content"])
    return tokenizer.encode(text, add_special_tokens=False)


USER = [{"role": "user", "content": "Hi"}]
EARLIER_TURN = [
    *USER,
    {"role": "assistant", "content": "Hello", "reasoning_content": "They greet me."},
    {"role": "user", "content": "And now?"},
]


@pytest.mark.parametrize("name", REASONING_PARSER_NAMES)
def test_output_begins_in_reasoning_unless_the_prompt_closed_it(
    name: str, tokenizer: Tokenizer
) -> None:
    parser = get_reasoning_parser(name)

    def active(ids: list[int], **kwargs: object) -> bool:
        return parser.for_request(tokenizer, ids, kwargs).active

    assert active(prompt(tokenizer, USER))
    # An earlier turn's </think> does not count: the last turn starts with <|im_start|>.
    assert END in tokenizer.decode(prompt(tokenizer, EARLIER_TURN), skip_special_tokens=False)
    assert active(prompt(tokenizer, EARLIER_TURN))
    # enable_thinking false: the template closes an empty think block at the prompt's end.
    assert not active(prompt(tokenizer, USER, enable_thinking=False))
    # An assistant message continued after its reasoning: the continuation is content.
    continued = [*USER, {"role": "assistant", "content": "<think>\nHmm\n</think>\n\nThe"}]
    assert not active(prompt(tokenizer, continued, continue_final_message=True))
    # ... and one continued inside its reasoning stays reasoning.
    continued = [*USER, {"role": "assistant", "content": "<think>\nHmm, let"}]
    assert active(prompt(tokenizer, continued, continue_final_message=True))


def test_enable_thinking_false_turns_qwen3_off_even_where_the_template_ignores_it(
    tokenizer: Tokenizer,
) -> None:
    ids = prompt(tokenizer, USER)  # rendered without the flag: the prompt leaves thinking open
    off = {"enable_thinking": False}
    assert not get_reasoning_parser("qwen3").for_request(tokenizer, ids, off).active
    assert get_reasoning_parser("qwen3").for_request(tokenizer, ids, {}).active
    # deepseek_r1, as vLLM's, reads no template kwargs: only the prompt says it.
    assert get_reasoning_parser("deepseek_r1").for_request(tokenizer, ids, off).active


def test_an_inactive_request_splits_nothing(tokenizer: Tokenizer) -> None:
    ids = prompt(tokenizer, USER, enable_thinking=False)
    reasoning = get_reasoning_parser("qwen3").for_request(tokenizer, ids, {})
    text = "Hmm</think>Hi"
    assert reasoning.split(text) == (None, text)
    assert reasoning.split("") == (None, "")
    assert streamed_with(reasoning.stream(), [text]) == ("", text)
    assert reasoning.count_tokens(tokenizer.encode(text, add_special_tokens=False)) == 0


def streamed_with(stream: ReasoningStream, pieces: Sequence[str]) -> tuple[str, str]:
    reasoning, content = "", ""
    for i, piece in enumerate(pieces):
        out = stream.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + out.reasoning, content + out.content
    return reasoning, content


@pytest.mark.parametrize(
    ("prompt_ids", "expected"),
    [
        ([1, 2, 10, 11, 20, 21, 5], True),  # ... <think> </think> \n
        ([1, 2, 10, 11, 5, 5], False),  # ... <think> \n \n: inside the reasoning
        ([20, 21, 3, 4], False),  # </think>, then a turn token: an earlier turn's
        ([20, 21], True),
        ([20], False),  # half a tag
        ([], False),
    ],
)
def test_prompt_ends_reasoning_reads_back_to_the_turn(
    prompt_ids: list[int], expected: bool
) -> None:
    start, end, turns = (10, 11), (20, 21), frozenset({3})
    assert prompt_ends_reasoning(prompt_ids, start, end, turns) is expected


# -- reasoning tokens ---------------------------------------------------------------------------


def test_reasoning_tokens_are_those_before_the_end_tag_less_the_tags(tokenizer: Tokenizer) -> None:
    reasoning = get_reasoning_parser("qwen3").for_request(tokenizer, [], {})
    (start,), (end,) = reasoning.start_ids, reasoning.end_ids  # one token each, as in Qwen3

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    thought, answer = ids("The quick brown fox"), ids("Hello world!")
    assert len(thought) > 2 and len(answer) > 2
    assert reasoning.count_tokens([start, *thought, end, *answer]) == len(thought)
    assert reasoning.count_tokens([*thought, end, *answer]) == len(thought)  # start in prompt
    assert reasoning.count_tokens([*thought]) == len(thought)  # cut off while thinking
    assert reasoning.count_tokens([end, *answer]) == 0
    # Only the first </think> ends it, and a <think> that does not open the output is text.
    assert reasoning.count_tokens([*thought, start, end, end, *answer]) == len(thought) + 1


def test_reasoning_tokens_with_tags_that_are_several_tokens(tmp_path: Path) -> None:
    hf = HFTokenizer.from_file(str(build_tiny_tokenizer(tmp_path) / "tokenizer.json"))
    tokenizer = Tokenizer(hf, SpecialTokens("<|bos|>", "<|eos|>"), None)
    reasoning = get_reasoning_parser("deepseek_r1").for_request(tokenizer, [], {})
    assert len(reasoning.end_ids) > 1 and len(reasoning.start_ids) > 1
    thought = [7, 8, 9]
    out = [*reasoning.start_ids, *thought, *reasoning.end_ids, 7]
    assert reasoning.count_tokens(out) == len(thought)


# -- the flag -----------------------------------------------------------------------------------


def test_reasoning_parser_flag_and_environment() -> None:
    assert config_from_args([], {}).reasoning_parser is None
    assert config_from_args(["--reasoning-parser", "qwen3"], {}).reasoning_parser == "qwen3"
    env = {"TANDEM_REASONING_PARSER": "deepseek_r1"}
    config = config_from_args([], env)
    assert config.reasoning_parser == "deepseek_r1"
    assert config_from_json(config_to_json(config)) == config  # what --workers hands down
    assert sorted(REASONING_PARSER_NAMES) == ["deepseek_r1", "qwen3"]


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--reasoning-parser", "qwen"], {}, "invalid choice: 'qwen'"),
        ([], {"TANDEM_REASONING_PARSER": "qwen"}, "is not one of deepseek_r1, qwen3"),
    ],
)
def test_an_unknown_parser_is_refused_at_start_naming_the_known_ones(
    argv: list[str], env: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        config_from_args(argv, env)
    err = capsys.readouterr().err
    assert message in err and "deepseek_r1" in err and "qwen3" in err


def test_an_unknown_parser_stops_the_gateway_process() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "frontend_svc", "--reasoning-parser", "nope"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2
    assert "--reasoning-parser: invalid choice: 'nope'" in r.stderr
    assert "deepseek_r1" in r.stderr and "qwen3" in r.stderr


def test_config_and_lookup_errors_name_the_known_parsers() -> None:
    with pytest.raises(ValueError, match="'nope' is not one of deepseek_r1, qwen3"):
        FrontendConfig(reasoning_parser="nope")
    with pytest.raises(ValueError, match="valid names: deepseek_r1, qwen3"):
        get_reasoning_parser("nope")
    assert json.loads(config_to_json(FrontendConfig()))["reasoning_parser"] is None
