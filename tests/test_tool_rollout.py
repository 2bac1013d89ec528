"""Tools in the runtime: declarations rendered through a template's ``tools=`` or after the
system prompt, tool results as ``tool`` messages, their tokens masked out of the loss, and the
tool counts in episode summaries and evaluation metrics."""

from __future__ import annotations

import shutil

import numpy as np
from conftest import run

from games.calculator import CALC, SYSTEM_PROMPT
from games.evaluation import GameEval
from games.tools import format_call, tool_instructions
from learners.assembly import trajectory_to_datum
from opentinker.eval.evaluation import pairing_metrics
from opentinker.rollout.episodes import play_episode
from opentinker.rollout.render import ChatTokenizer, SeatRenderer
from protocols.messages import (
    EpisodeSpec,
    ParseOutcome,
    PolicyKind,
    PolicyRef,
    RunEpisodes,
    SampleResult,
    SamplingParams,
    StopReason,
)

# Qwen2.5's way with tools, cut down: declarations in the system turn, results as user turns.
QWEN_LIKE = """{%- if tools %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '\\n\\n# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\nCall as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\\n' }}
{%- else %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}
{%- for message in messages[1:] %}{%- if message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}
{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


def test_without_template_support_the_tools_follow_the_system_prompt_and_results_are_tool_turns(chat_tok):
    assert not chat_tok.supports_tools  # SmolLM2's template ignores tools=
    r = SeatRenderer(chat_tok, "Solve it.", [CALC.schema()])
    first = chat_tok.decode(r.observe("What is 2 * 3?"), skip_special_tokens=False)
    assert first.startswith(f"<|im_start|>system\nSolve it.\n\n{tool_instructions([CALC.schema()])}<|im_end|>")
    r.add_reply([*chat_tok.encode(format_call("calc", {"expression": "2 * 3"})), chat_tok.eos_id], stopped=True)
    delta = chat_tok.decode(r.observe("6", role="tool"), skip_special_tokens=False)
    assert delta == "\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_with_tools_renders_them_as_transformers_does(tiny_path, tmp_path):
    from transformers import AutoTokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_path}/{name}", tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(QWEN_LIKE)
    tok = ChatTokenizer(tmp_path)
    assert tok.supports_tools
    schema = {**CALC.schema()}
    schema["function"] = {**schema["function"], "description": "a <b> & 'c' é"}  # tojson must not escape HTML
    r = SeatRenderer(tok, "Solve it.", [schema])
    r.observe("What is 2 * 3?")
    r.add_reply([*tok.encode("<tool_call>x</tool_call>"), tok.eos_id], stopped=True)
    r.observe("6", role="tool")
    chat = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "What is 2 * 3?"},
            {"role": "assistant", "content": "<tool_call>x</tool_call>"}, {"role": "tool", "content": "6"}]
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    expected = hf.apply_chat_template(chat, tools=[schema], tokenize=False, add_generation_prompt=True)
    assert "a <b> & 'c' é" in expected and "<tool_response>\n6\n</tool_response>" in expected
    assert tok.decode(r.prompt(), skip_special_tokens=False) == expected


def test_a_tool_result_is_observation_tokens_with_mask_zero(chat_tok):
    main = PolicyRef(kind=PolicyKind.ADAPTER, name="main")
    spec = EpisodeSpec(episode_id=3, group_id=0, game="calculator_v0", game_kwargs={}, seed=5,
                       seats={"solver": main}, train=True)
    msg = RunEpisodes(episodes=[spec], sampling=SamplingParams(max_tokens=48), system_prompt=SYSTEM_PROMPT,
                      learners={"main": "tcp://127.0.0.1:1"})
    prompts = []

    async def sample(ref, prompt, params):  # what a model would write: the call, then the answer
        prompts.append(chat_tok.decode(prompt, skip_special_tokens=False))
        text = format_call("calc", {"expression": expression}) if len(prompts) == 1 else answer
        toks = np.asarray([*chat_tok.encode(text), chat_tok.eos_id], np.int32)
        return SampleResult(tokens=[toks], logprobs=[np.full(len(toks), -0.5, np.float32)],
                            stop_reasons=[StopReason.STOP], adapter_version=0, batch_id=0)

    import games

    probe = games.make("calculator_v0")
    probe.reset(seed=5)
    expression, value = probe.unwrapped.expression, probe.unwrapped.value
    answer = str(value)
    summary, (traj,) = run(play_episode(spec, msg, chat_tok, sample))
    assert summary.rewards == {"solver": 1.0} and summary.turns == {"solver": 2}
    assert summary.tool_calls == {"solver": 1} and summary.invalid_tool_calls == {"solver": 0}
    assert [t.parse for t in traj.turns] == [ParseOutcome.TOOL_CALL, ParseOutcome.OK]
    assert [t.reward for t in traj.turns] == [0.0, 1.0]
    result_turn = chat_tok.decode(traj.turns[1].obs_tokens, skip_special_tokens=False)
    assert result_turn == f"\n<|im_start|>tool\n{answer}<|im_end|>\n<|im_start|>assistant\n"
    assert "You may call these tools" in prompts[0] and prompts[1].endswith(result_turn)

    datum = trajectory_to_datum(traj, [1.0, 1.0])
    mask = datum.loss_inputs["mask"]
    o0, s0, o1, s1 = (len(traj.turns[0].obs_tokens), len(traj.turns[0].sampled_tokens),
                      len(traj.turns[1].obs_tokens), len(traj.turns[1].sampled_tokens))
    assert mask.tolist() == [0.0] * o0 + [1.0] * s0 + [0.0] * o1 + [1.0] * s1
    result_ids = chat_tok.encode(answer)
    start = o0 + s0
    assert datum.tokens[start:start + o1].tolist() == traj.turns[1].obs_tokens.tolist()
    # The tool's output lies inside the mask-0 span, never under a loss token.
    span = datum.tokens[start:start + o1].tolist()
    at = next(i for i in range(len(span)) if span[i:i + len(result_ids)] == result_ids)
    assert not mask[start + at:start + at + len(result_ids)].any()

    ev = GameEval(unit="success", competitive=False)
    metrics = pairing_metrics(ev, "main", [spec], [summary])
    assert metrics["success"] == 1.0 and metrics["tool_calls"] == 1.0 and metrics["invalid_tool_calls"] == 0.0


def test_a_two_seat_game_gives_only_the_seat_with_tools_its_declarations_and_results(chat_tok):
    import games
    from games.negotiation import worth

    main = PolicyRef(kind=PolicyKind.ADAPTER, name="main")
    spec = EpisodeSpec(episode_id=4, group_id=0, game="negotiation_v0", game_kwargs={"value_tool": True}, seed=0,
                       seats={"player_0": main, "player_1": main}, train=True)
    probe = games.make("negotiation_v0", value_tool=True)
    probe.reset(seed=0)  # the episode's hand
    pool, values = probe.unwrapped.pool, probe.unwrapped.values
    take = {"book": 0, "hat": pool["hat"], "ball": 0}
    msg = RunEpisodes(episodes=[spec], sampling=SamplingParams(max_tokens=48), system_prompt="You negotiate.",
                      learners={"main": "tcp://127.0.0.1:1"})
    replies = iter([format_call("value_of", {"item": "hat"}), format_call("value_of", {"item": "ball"}),
                    f"propose: books=0 hats={pool['hat']} balls=0", "accept"])
    prompts = []

    async def sample(ref, prompt, params):  # what the model writes: two calls, a proposal, an accept
        prompts.append(chat_tok.decode(prompt, skip_special_tokens=False))
        toks = np.asarray([*chat_tok.encode(next(replies)), chat_tok.eos_id], np.int32)
        return SampleResult(tokens=[toks], logprobs=[np.zeros(len(toks), np.float32)],
                            stop_reasons=[StopReason.STOP], adapter_version=0, batch_id=0)

    summary, trajectories = run(play_episode(spec, msg, chat_tok, sample))
    by_seat = {t.seat: t for t in trajectories}
    rest = {i: pool[i] - take[i] for i in pool}
    assert summary.rewards == {"player_0": worth(take, values["player_0"]), "player_1": worth(rest, values["player_1"])}
    assert summary.tool_calls == {"player_0": 2, "player_1": 0} and summary.turns == {"player_0": 3, "player_1": 1}
    assert [t.parse for t in by_seat["player_0"].turns] == [ParseOutcome.TOOL_CALL] * 2 + [ParseOutcome.OK]
    assert [chat_tok.decode(t.obs_tokens, skip_special_tokens=False) for t in by_seat["player_0"].turns[1:]] == [
        f"\n<|im_start|>tool\n{values['player_0'][i]}<|im_end|>\n<|im_start|>assistant\n" for i in ("hat", "ball")]
    # Only player_0 has the tool: its declarations, and its values only through the tool.
    assert all('"name": "value_of"' in p and "ask the value_of tool" in p for p in prompts[:3])
    assert "You may call" not in prompts[3] and "tool_call" not in prompts[3]
    assert "Your values: book {book}, hat {hat}, ball {ball}".format(**values["player_1"]) in prompts[3]


def test_the_final_table_and_the_progress_line_show_tool_calls():
    import io

    from rich.console import Console

    import games
    from opentinker.eval.report import summary_table
    from opentinker.run import _status

    ev = games.evaluation("calculator_v0")
    first = {"eval/main/vs_random/success": 0.0, "eval/main/vs_random/ci95": 0.0,
             "eval/main/vs_random/tool_calls": 0.0, "eval/main/vs_random/invalid_tool_calls": 0.0}
    last = {**first, "eval/main/vs_random/tool_calls": 1.25, "eval/main/vs_random/invalid_tool_calls": 0.5}
    out = io.StringIO()
    Console(file=out, width=200).print(summary_table(first, last, ["main"], 10, ev))
    lines = [line for line in out.getvalue().splitlines() if "tool calls" in line]
    assert len(lines) == 2 and "1.2500" in lines[0] and "0.5000" in lines[1], lines
    line = _status({"train/main/reward": 0.5, "train/main/invalid_rate": 0.0, "train/main/tool_calls": 1.5,
                    "train/main/invalid_tool_calls": 0.25}, ["main"], "train", ev)
    assert line == "reward +0.50 invalid 0% tool calls 1.50 (0.25 invalid)"
    assert "tool" not in _status({"train/main/reward": 0.5, "train/main/invalid_rate": 0.0}, ["main"], "train", ev)
