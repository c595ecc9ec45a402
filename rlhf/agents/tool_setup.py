"""Checking the tool flags before any process group (``check_tool_run``) and building the tool executor on an
engine's first rank (``build_tool_executor``); the flags: rlhf.config.agent_schema (``cfg.agent``)."""
from __future__ import annotations

from rlhf.agents.tool_agent import ToolAgentExecutor, ToolLimits, tool_turn_text
from rlhf.agents.tool_parsers import check_parser_name, make_parser
from rlhf.agents.tools import load_tools
from rlhf.errors import ConfigError


def episode_tokens(a, generate_max_len: int, max_steps: int) -> int:
    """--max_episode_tokens, default --generate_max_len x --max_steps (the native agent's response budget)."""
    return a.max_episode_tokens if a.max_episode_tokens is not None else generate_max_len * max_steps


def check_tool_run(a, r, m, d, tokenizer) -> None:
    """A --tools_path run's flags, its tools file, its parser and the chat template's tool turns, refused
    (ConfigError naming the flag and a value that works) before any process group; a run without --tools_path is
    left as it is.  ``a``, ``r``, ``m``, ``d``: the agent, rollout, model and data flag groups."""
    if not a.tools_path:
        return
    if r.agent_func_path:
        raise ConfigError("tools_path", f"--tools_path {a.tools_path} with --agent_func_path {r.agent_func_path}: "
                                        f"give one; an agent file runs its own environment (call your tools from its "
                                        f"step), --tools_path alone runs tool episodes")
    if m.reward_pretrain:
        raise ConfigError("reward_pretrain", "--tools_path episodes are scored at their end by a reward function: "
                                             "use --remote_rm_url (reward_func.py or http URL) instead of "
                                             "--reward_pretrain")
    if r.partial_rollout:
        raise ConfigError("partial_rollout", "--partial_rollout with --tools_path: a tool episode runs whole in "
                                             "one weight version; leave --partial_rollout off")
    for flag, value, low in (("max_tool_calls", a.max_tool_calls, 0), ("tool_output_max_chars",
                             a.tool_output_max_chars, 1), ("max_steps", r.max_steps, 1)):
        if value < low:
            raise ConfigError(flag, f"--{flag} {value} must be at least {low} (e.g. --{flag} {max(low, 4)})")
    if not a.tool_timeout_s > 0:
        raise ConfigError("tool_timeout_s", f"--tool_timeout_s {a.tool_timeout_s} must be above 0 (e.g. "
                                            f"--tool_timeout_s 30)")
    if episode_tokens(a, d.generate_max_len, r.max_steps) < 1:
        raise ConfigError("max_episode_tokens", f"--max_episode_tokens {a.max_episode_tokens} must be at least 1 (e.g. "
                          f"--max_episode_tokens {d.generate_max_len * r.max_steps})")
    check_parser_name(a.tool_call_parser)
    tools = load_tools(a.tools_path)
    try:
        make_parser(a.tool_call_parser, tokenizer, tools.schemas)
    except Exception as e:
        raise ConfigError("tool_call_parser", f"--tool_call_parser {a.tool_call_parser} cannot read this model's "
                                              f"tool calls ({type(e).__name__}: {e}); use the parser of the model's "
                                              f"tool-call format (hermes: Qwen2.5 / Hermes / Qwen3 JSON; qwen3_xml / "
                                              f"qwen3_coder: Qwen3-Coder; llama3_json: Llama 3.x)") from e
    try:
        tool_turn_text(tokenizer, [{"role": "tool", "name": "t", "content": "x"}])
    except Exception as e:
        raise ConfigError("tools_path", f"--tools_path: the tokenizer's chat template cannot append tool messages "
                                        f"({type(e).__name__}: {e}); give the model a chat template that renders "
                                        f"role 'tool' messages") from e


def build_tool_executor(a, r, generate_max_len: int, engine, tokenizer) -> ToolAgentExecutor:
    """The tool executor of an engine's first rank (``a``, ``r``: the agent and rollout flag groups): the tools,
    vLLM's (or our) parser (over the file's schemas; a row with its own ``tools`` gets one over those), the
    limits, the reward function (--remote_rm_url, else the built-in); the chat template must render role "tool"
    messages."""
    from rlhf.rewards.reward_func import builtin_reward_source, make_reward_source

    tools = load_tools(a.tools_path)
    limits = ToolLimits(r.max_steps, a.max_tool_calls, a.tool_timeout_s, a.tool_output_max_chars,
                        episode_tokens(a, generate_max_len, r.max_steps))
    reward = make_reward_source(r.remote_rm_url, r.reward_timeout_s, print, r.remote_rm_retries) \
        or builtin_reward_source(print)
    return ToolAgentExecutor(tools, make_parser(a.tool_call_parser, tokenizer, tools.schemas), limits, engine,
                             tokenizer, reward, lambda schemas: make_parser(a.tool_call_parser, tokenizer, schemas))


def tool_schemas(tools_path):
    """The --tools_path file's OpenAI function schemas (the chat template renders them into prompts without a
    ``tools`` column of their own), or None without one."""
    return load_tools(tools_path).schemas if tools_path else None
