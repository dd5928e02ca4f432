"""The real text a model with trained weights is judged on: a prompt set for greedy
continuations, and a long English text for perplexity.

The prompts are floorline's own, varied on purpose: questions, instructions, code, lists, numbers
and plain prose to continue; `chat` ones go through the model's chat template, the others are
encoded as they are.

The long text is the reference documentation of the Python language that every CPython ships
(the `pydoc_data.topics` module behind `help()`; the Python Software Foundation's documentation,
under the PSF License): its topics in sorted order, joined by blank lines. It differs between
Python releases, so every measurement on it records the text's SHA-256 and token count.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    text: str
    chat: bool


PROMPTS = (
    Prompt("What is the capital of France?", True),
    Prompt("Explain in two sentences why the sky is blue.", True),
    Prompt("Write a Python function that returns the factorial of n.", True),
    Prompt("List three fruits that are rich in vitamin C.", True),
    Prompt("Translate 'Good morning, how are you?' into French.", True),
    Prompt("What is 17 multiplied by 23?", True),
    Prompt("Summarise the plot of Romeo and Juliet in one paragraph.", True),
    Prompt("Give me a short packing list for a weekend hiking trip.", True),
    Prompt("What does a CPU cache do?", True),
    Prompt("Write a haiku about the sea.", True),
    Prompt("How do I reverse a list in Python?", True),
    Prompt("Name the planets of the solar system in order from the Sun.", True),
    Prompt("A robot arm must pick up a red cube. Describe the steps it should take.", True),
    Prompt("What is the difference between a virus and a bacterium?", True),
    Prompt("Once upon a time, in a small village by the mountains,", False),
    Prompt("The three primary colours are", False),
    Prompt("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
    Prompt("The Industrial Revolution began in Britain in the late eighteenth century and",
           False),
    Prompt("Ingredients for pancakes:\n1.", False),
    Prompt("In mathematics, a prime number is", False),
    Prompt("The weather forecast for tomorrow says", False),
    Prompt("import numpy as np\n\n# Compute the mean of each row of a matrix\n", False),
)


def evaluation_text() -> str:
    """The long English text perplexity is measured on (see the module docstring)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# Workloads for speculative decoding: what a robot's or an agent's model is asked to do, each a
# few prompts through the chat template. How much of a reply repeats its prompt differs by
# workload, and with it how often a drafter is right: acceptance is measured per workload.
RECORD = ('{"id": 4127, "robot": "arm-2", "task": "pick", "object": "red cube", '
          '"position": {"x": 0.42, "y": -0.17, "z": 0.05}, "gripper": "open", '
          '"status": "queued"}')
NOTE = ("The charging dock in bay three was moved on Monday. Robots that still use the old "
        "map drive to the empty wall, wait there for two minutes and then report a docking "
        "fault. The new dock is four metres further along the same wall, next to the fire "
        "door. Until every robot has the new map, operators should send them to bay four, "
        "which has not moved.")
CODE = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
        "    return total / len(values)\n")
WORKLOADS = {
    "chat": tuple(p.text for p in PROMPTS if p.chat)[:8],
    "json": (
        f"Here is a task record: {RECORD}\nReturn the same record as JSON with status set to "
        "\"running\" and the gripper \"closed\". Output only the JSON.",
        f"Here is a task record: {RECORD}\nReturn it as JSON with the object changed to "
        "\"blue cylinder\". Output only the JSON.",
        "Return a JSON list of three task records, each with the fields id, robot, task and "
        "status, for robots arm-1, arm-2 and arm-3 picking a cube. Output only the JSON.",
        f"Here is a task record: {RECORD}\nReturn it as JSON with x, y and z each rounded to "
        "one decimal place. Output only the JSON.",
    ),
    "edit": (
        f"Rewrite this note, replacing \"bay three\" with \"bay five\" and changing nothing "
        f"else:\n\n{NOTE}",
        f"Correct the spelling in this note and repeat it in full:\n\n"
        f"{NOTE.replace('charging', 'chargin').replace('robots', 'robtos')}",
        f"Add type hints to this Python function and repeat it in full:\n\n{CODE}",
        f"Rename the function below to average and repeat it in full:\n\n{CODE}",
    ),
    "summarise": (
        f"Summarise this note in one sentence:\n\n{NOTE}",
        f"What should an operator do, according to this note?\n\n{NOTE}",
        f"Explain what this function does:\n\n{CODE}",
        f"Which fields does this record have? {RECORD}",
    ),
}
