"""The OpenAI Agents SDK runs an agent with a function tool against a real ``kvtier serve``.

The server is a separate process serving the tiny random model (its chat
template knows no tools, so kvtier offers them the Hermes way). The first
turn asks for a tool with ``tool_choice="required"``: constrained decoding
makes even noise a well-formed call, the SDK runs the Python function, sends
its result back as a ``tool`` message, and the next turn (tool choice reset
to auto by the SDK) answers in text, which ends the run.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from typing import Any, Literal

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
agents = pytest.importorskip("agents", reason="openai-agents is not installed")

from cli_launch import kvtier_cli, read_banner  # noqa: E402

# Real servers in their own processes: run once, in the compiled pass (see the Makefile).
pytestmark = pytest.mark.process

MODEL = "tiny-agent"


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``kvtier serve`` on a tiny model with room for the tools' prompt; its ``/v1`` URL."""
    import torch
    from tiny_model import tiny_llama_config, tiny_tokenizer
    from transformers import LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-agent-model")
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(tok, max_position_embeddings=4096)).save_pretrained(path)
    tok.save_pretrained(path)
    proc = subprocess.Popen(
        kvtier_cli(
            "serve",
            "--model",
            str(path),
            "--served-model-name",
            MODEL,
            "--port",
            "0",
            "--num-blocks",
            "512",
            "--log-level",
            "warning",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        serving = read_banner(proc)[-1]
        yield serving.split(" at ", 1)[1].split(" ", 1)[0]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_an_agent_calls_its_tool_and_finishes(base_url: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunConfig,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.items import ToolCallItem, ToolCallOutputItem
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[dict[str, Any]] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"], days: int) -> str:
        """The weather forecast for a city.

        Args:
            city: The city.
            days: How many days ahead.
        """
        calls.append({"city": city, "days": days})
        return f"sunny in {city} for {days} days"

    async def run() -> Any:
        client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120)
        agent = Agent(
            name="forecaster",
            instructions="Answer questions about the weather, using the tool.",
            model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
            tools=[get_weather],
            model_settings=ModelSettings(
                tool_choice="required", temperature=1.0, max_tokens=200, extra_args={"seed": 5}
            ),
        )
        try:
            return await Runner.run(
                agent,
                "What is the weather in Paris tomorrow?",
                max_turns=4,
                run_config=RunConfig(tracing_disabled=True),
            )
        finally:
            await client.close()

    result = asyncio.run(run())
    assert len(calls) == 1
    assert calls[0]["city"] in ("Paris", "Rome", "Oslo") and isinstance(calls[0]["days"], int)
    kinds = [type(item) for item in result.new_items]
    assert ToolCallItem in kinds and ToolCallOutputItem in kinds
    output = next(i for i in result.new_items if isinstance(i, ToolCallOutputItem))
    assert output.output == f"sunny in {calls[0]['city']} for {calls[0]['days']} days"
    assert isinstance(result.final_output, str)  # the loop ended with a text answer
