"""A LangGraph agent over ``ChatOpenAI`` runs its tool loop against a real ``kvtier serve``.

The server is a separate process serving the tiny random model (its chat
template knows no tools, so kvtier offers them the Hermes way). The graph
is the usual agent loop: a model node, a ``ToolNode`` that runs the calls,
and an edge back to the model until it answers without calls. The first
turn forces a call (``tool_choice="required"``, constrained decoding makes
even noise a well-formed call); later turns leave the choice to the model,
which answers in text and ends the run. Every request carries kvtier's
session hints, and the second turn, the first conversation plus the call
and its result, reuses the first turn's cached prompt.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("langgraph", reason="langgraph is not installed")
pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")

from serve_proc import ServeProcess

# Real servers in their own processes: run once, in the compiled pass (see the Makefile).
pytestmark = pytest.mark.process

MODEL = "tiny-graph"
SESSION = "graph-session-1"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """``kvtier serve`` on a tiny model with room for the tools' prompt."""
    import torch
    from tiny_model import tiny_llama_config, tiny_tokenizer
    from transformers import LlamaForCausalLM

    path: Path = tmp_path_factory.mktemp("tiny-graph-model")
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(tok, max_position_embeddings=4096)).save_pretrained(path)
    tok.save_pretrained(path)
    args = ["--model", str(path), "--served-model-name", MODEL, "--num-blocks", "512"]
    # The workflow policy is the one that reads session hints.
    with ServeProcess([*args, "--policy", "workflow", "--log-level", "warning"]) as proc:
        yield proc


def test_a_langgraph_agent_runs_its_tool_and_reuses_the_cached_prefix(
    server: ServeProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tiktoken
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition
    from pydantic import SecretStr

    # No tracing service and no tokenizer downloads: the test path needs neither.
    for var in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "LANGSMITH_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    asked: list[Any] = []

    def no_tiktoken(*args: Any, **kwargs: Any) -> Any:
        asked.append(args)  # seen even if a caller swallows the error
        raise AssertionError("tiktoken was asked for an encoding: that needs the network")

    monkeypatch.setattr(tiktoken, "get_encoding", no_tiktoken)
    monkeypatch.setattr(tiktoken, "encoding_for_model", no_tiktoken)

    ran: list[dict[str, Any]] = []

    @tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"], days: int) -> str:
        """The weather forecast for a city.

        Args:
            city: The city.
            days: How many days ahead.
        """
        ran.append({"city": city, "days": days})
        return f"sunny in {city} for {days} days"

    tools = [get_weather]
    llm = ChatOpenAI(
        model=MODEL,
        base_url=f"{server.base}/v1",
        api_key=SecretStr("x"),
        temperature=1.0,
        max_completion_tokens=200,
        seed=5,
        max_retries=0,
        timeout=120,
        # kvtier's session hints: keep this conversation's blocks while the tool runs.
        extra_body={"kvtier": {"session_id": SESSION, "cache_ttl_s": 60}},
    )
    # The tiny model answers in prose under "auto": the first turn must call, and
    # call once (the checks below count one call).
    first_turn = llm.bind_tools(tools, tool_choice="required", parallel_tool_calls=False)
    later_turns = llm.bind_tools(tools)

    def agent(state: MessagesState) -> dict[str, list[Any]]:
        called = any(isinstance(m, ToolMessage) for m in state["messages"])
        model = later_turns if called else first_turn
        return {"messages": [model.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    app = graph.compile()

    before = server.stats()["engine"]
    result = app.invoke(
        {"messages": [HumanMessage("What is the weather in Paris tomorrow?")]},
        {"recursion_limit": 8},
    )
    messages = result["messages"]
    assert asked == []

    # The loop: question, forced call, the tool's result, then a text answer that ends it.
    assert [type(m) for m in messages] == [HumanMessage, AIMessage, ToolMessage, AIMessage]
    _, call_msg, tool_msg, answer = messages
    (call,) = call_msg.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    assert call_msg.response_metadata["finish_reason"] == "tool_calls"
    assert len(ran) == 1 and ran[0] == call["args"]
    assert ran[0]["city"] in ("Paris", "Rome", "Oslo") and isinstance(ran[0]["days"], int)
    assert tool_msg.tool_call_id == call["id"]
    assert tool_msg.content == f"sunny in {ran[0]['city']} for {ran[0]['days']} days"
    assert not answer.tool_calls and isinstance(answer.content, str)

    # The second turn's prompt began with the first's: its blocks came from the cache.
    first_usage, second_usage = call_msg.usage_metadata, answer.usage_metadata
    assert first_usage is not None and second_usage is not None
    assert second_usage["input_tokens"] > first_usage["input_tokens"] > 500
    cached = second_usage.get("input_token_details", {}).get("cache_read", 0)
    assert cached >= first_usage["input_tokens"] // 2, second_usage
    stats = server.stats()
    after = stats["engine"]
    assert after["requests_added"] - before["requests_added"] == 2
    assert after["cached_prompt_tokens"] - before["cached_prompt_tokens"] >= cached
    # The hints arrived: the session is tracked and its blocks pinned for the TTL.
    sessions = stats["sessions"]
    assert sessions["tracked"] >= 1 and sessions["live"] >= 1 and sessions["pinned_blocks"] > 0
