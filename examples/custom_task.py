"""Your own task, reward and tool, trained with TRACE: shopping arithmetic with a price-list tool.

    python examples/custom_task.py runs/shop            # the tiny policy, warm-started from the oracle below
    python examples/custom_task.py runs/shop_smollm2 model.name=smollm2-135m model.warm_start=false
    trace-rl train --config configs/smoke.yaml --out runs/shop task.name=examples/custom_task.py:shop

Nothing in the package is edited: the config names `shop` below, which returns the task set with its
reward and tool (docs: "Your own task").
"""

import random
import re
import sys

import trace_rl
from trace_rl import ToolCall

PRICES = {"apple": 3, "pear": 5, "melon": 12, "bread": 4, "cheese": 9, "milk": 2}


def row(i: int) -> dict:
    rng = random.Random(i)
    items = {item: rng.randint(1, 4) for item in rng.sample(sorted(PRICES), 2)}
    question = "How many euros do " + " and ".join(f"{n} {item}" for item, n in items.items()) + " cost?"
    return {"id": f"shop-{i}", "question": question, "items": items, "answer": sum(n * PRICES[k] for k, n in items.items())}


def price(item: str) -> str:
    """Look up the price in euros of one item of the shop (apple, pear, melon, bread, cheese, milk)."""
    return str(PRICES[item.strip().lower()]) if item.strip().lower() in PRICES else f"no item called {item!r}"


def reward(task: trace_rl.Task, answer: str) -> float:
    """1 for the exact total, 0.5 within 10% of it (partial credit), else 0."""
    found = re.search(r"-?\d+(\.\d+)?", answer)
    total = float(task.answers[0])
    if found is None:
        return 0.0
    return 1.0 if float(found.group()) == total else 0.5 if abs(float(found.group()) - total) <= 0.1 * total else 0.0


def oracle(task: trace_rl.Task, history: list) -> ToolCall:
    """Looks up each price it has not read yet, then answers the total from what the tool returned."""
    prices = {call.arguments["item"]: int(seen) for call, seen in history if call.name == "price" and seen.strip().isdigit()}
    todo = [item for item in task.meta["items"] if item not in prices]
    if todo:
        return ToolCall("price", {"item": todo[0]})
    return ToolCall("answer", {"answer": str(sum(n * prices[item] for item, n in task.meta["items"].items()))})


def shop(split: str = "train", num_tasks: int | None = None, seed: int = 0) -> trace_rl.TaskSet:
    return trace_rl.task_set([row(i) for i in range(400)], name="shop", split=split, num_tasks=num_tasks, seed=seed,
                             test_share=0.25, scorer=reward, tools=[price], oracle=oracle)


if __name__ == "__main__":  # python examples/custom_task.py OUT [key=value ...]
    trace_rl.train("configs/smoke.yaml", out=sys.argv[1], overrides=[
        f"task.name={__file__}:shop", "task.train_tasks=null", "task.test_tasks=32", "sft.demos=300", "sft.steps=300",
        "train.steps=10", "train.eval_every=10", *sys.argv[2:]])
