"""The evaluate stage against a scripted OpenAI-compatible server on 127.0.0.1: metrics checked
against sacrebleu / rouge-score called directly, multiple-choice accuracy on known answers,
bounded concurrency, failures, the comparison table, the gate and the adapter check.

(The real LlamaFactory endpoint, base vs tuned, is exercised end to end in test_serve.py.)
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from ktflow.errors import DatasetError, EvaluationError, KtflowError
from ktflow.recipe import EvaluationConfig
from ktflow.stages.evaluate import (
    EvalReport,
    adapter_is_applied,
    compare_reports,
    evaluate_endpoint,
    generative_metrics,
    load_eval_records,
    option_letter,
    promotion_gate,
)

KEY = "test-key-0123456789abcdef"


class Stub:
    """A chat-completions server whose answers are scripted per (model, last user message)."""

    def __init__(self) -> None:
        self.answers: dict[tuple[str, str], str] = {}
        self.default = "I do not know"
        self.status: dict[str, int] = {}  # last user message -> HTTP status to answer with
        self.delay_s = 0.0
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, doc: dict[str, Any]) -> None:
                body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.headers.get("Authorization") != f"Bearer {KEY}":
                    self._send(401, {"detail": "Invalid API key."})
                    return
                with stub.lock:
                    stub.requests.append(request)
                    stub.in_flight += 1
                    stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
                try:
                    time.sleep(stub.delay_s)
                    last = request["messages"][-1]["content"]
                    if last in stub.status:
                        self._send(stub.status[last], {"detail": "scripted failure"})
                        return
                    text = stub.answers.get((request["model"], last), stub.answers.get(("*", last), stub.default))
                    self._send(200, {
                        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": request["model"],
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                     "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
                    })
                finally:
                    with stub.lock:
                        stub.in_flight -= 1

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub() -> Iterator[Stub]:
    s = Stub()
    yield s
    s.close()


def _jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _chat(q: str, a: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


GENERATIVE = [
    ("What is LoRA?", "LoRA trains small low-rank matrices beside the frozen weights.",
     "LoRA trains small low-rank matrices beside the frozen weights."),  # exact
    ("What is a shard?", "One file of a checkpoint that is split into many files.",
     "A shard is one file of a large checkpoint."),  # partial
    ("Where do experts run?", "On the CPU, while attention runs on the GPU.",
     "Experts run on the CPU and attention on the GPU."),
    ("What does the router do?", "It scores the experts and sends each token to the best few.",
     "The router sends each token to a few experts."),
    ("Why quantize?", "To halve the memory the experts need.", ""),  # empty answer
]


def test_generative_metrics_agree_with_sacrebleu_and_rouge_score(stub: Stub, tmp_path: Path) -> None:
    import sacrebleu
    from rouge_score import rouge_scorer
    from sacrebleu.metrics import BLEU

    path = _jsonl(tmp_path / "eval.jsonl", [_chat(q, ref) for q, ref, _ in GENERATIVE])
    for q, _, answer in GENERATIVE:
        stub.answers[("*", q)] = answer
    cfg = EvaluationConfig(files=[path], format="openai", max_tokens=48, concurrency=2)
    report = evaluate_endpoint(stub.url, KEY, "tiny:tuned", cfg)

    assert report.n == len(GENERATIVE) and report.model == "tiny:tuned"
    assert [p["prediction"] for p in report.predictions] == [a for _, _, a in GENERATIVE]  # in order
    assert [p["reference"] for p in report.predictions] == [r for _, r, _ in GENERATIVE]
    # What was sent: the prompt without the reference, greedy, the configured max_tokens and model.
    sent = {r["messages"][-1]["content"]: r for r in stub.requests}
    assert set(sent) == {q for q, _, _ in GENERATIVE}
    assert all(r["temperature"] == 0 and r["max_tokens"] == 48 and r["model"] == "tiny:tuned" for r in stub.requests)
    assert all(len(r["messages"]) == 1 and r["messages"][0]["role"] == "user" for r in stub.requests)

    hyps = [a for _, _, a in GENERATIVE]
    refs = [r for _, r, _ in GENERATIVE]
    assert report.metrics["bleu-4"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=1e-9)
    for n in (1, 2, 3):
        assert report.metrics[f"bleu-{n}"] == pytest.approx(BLEU(max_ngram_order=n).corpus_score(hyps, [refs]).score,
                                                            abs=1e-9)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"])
    scores = [scorer.score(ref, hyp) for hyp, ref in zip(hyps, refs)]
    for key, name in (("rouge1", "rouge-1"), ("rouge2", "rouge-2"), ("rougeL", "rouge-l")):
        expected = 100 * sum(s[key].fmeasure for s in scores) / len(scores)
        assert report.metrics[name] == pytest.approx(expected, abs=1e-9)
    # Neither trivially 0 nor 100: one exact answer, one empty, the rest partial.
    assert 10 < report.metrics["bleu-4"] < 90 and 20 < report.metrics["rouge-l"] < 90
    assert report.metrics["bleu-1"] >= report.metrics["bleu-2"] >= report.metrics["bleu-4"]
    assert set(report.latency_s) >= {"p50", "p95"}


def test_identical_and_disjoint_answers_score_100_and_0() -> None:
    refs = ["the cat sat on the mat today", "a quick brown fox jumps high"]
    same = generative_metrics(refs, refs)
    assert all(v == pytest.approx(100.0) for v in same.values()), same
    disjoint = generative_metrics(["zzz yyy xxx www vvv uuu", "qqq ppp ooo nnn mmm lll"], refs)
    assert all(v == pytest.approx(0.0, abs=1e-6) for v in disjoint.values()), disjoint


def test_alpaca_records_send_instruction_and_input(stub: Stub, tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "eval.jsonl", [
        {"instruction": "Translate to French", "input": "cat", "output": "chat", "system": "Be brief."},
        {"instruction": "Say yes", "input": "", "output": "yes"},
    ])
    stub.answers[("*", "Translate to French\ncat")] = "chat"
    stub.answers[("*", "Say yes")] = "no"
    report = evaluate_endpoint(stub.url, KEY, "m", EvaluationConfig(files=[path], format="alpaca"),
                               system="Default system.")
    by_prompt = {r["messages"][-1]["content"]: r["messages"] for r in stub.requests}
    assert by_prompt["Translate to French\ncat"][0] == {"role": "system", "content": "Be brief."}  # the record's own
    assert by_prompt["Say yes"][0] == {"role": "system", "content": "Default system."}  # the default
    assert [p["prediction"] for p in report.predictions] == ["chat", "no"]


def test_sharegpt_history_is_sent_and_the_last_answer_is_the_reference(stub: Stub, tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "eval.jsonl", [{"system": "Be terse.", "conversations": [
        {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
        {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}])
    stub.answers[("*", "2+2?")] = "4"
    report = evaluate_endpoint(stub.url, KEY, "m", EvaluationConfig(files=[path], format="sharegpt"))
    assert stub.requests[0]["messages"] == [
        {"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"}]
    assert report.predictions[0]["reference"] == "4" and report.predictions[0]["source"].endswith("eval.jsonl:1")


def test_multiple_choice_accuracy_on_known_answers(stub: Stub, tmp_path: Path) -> None:
    questions = [  # (question, reference, answer, correct?)
        ("Q1: 2+2? A) 3 B) 4 C) 5", "B", "The answer is B.", True),
        ("Q2: capital of France? A) Rome B) Oslo C) Paris", "C. Paris", "C", True),
        ("Q3: largest? A) sun B) moon C) pea D) ant", "(A)", "I think (D)", False),
        ("Q4: pick D. A) x B) y C) z D) w", "D", "D) w", True),
        ("Q5: pick E. A) 1 B) 2 C) 3 D) 4 E) 5", "E", "no idea", False),
    ]
    path = _jsonl(tmp_path / "mc.jsonl", [_chat(q, ref) for q, ref, _, _ in questions])
    for q, _, answer, _ in questions:
        stub.answers[("*", q)] = answer
    cfg = EvaluationConfig(files=[path], task="multiple_choice", gate_metric="accuracy")
    report = evaluate_endpoint(stub.url, KEY, "m", cfg)
    assert report.metrics == {"accuracy": pytest.approx(60.0)}
    assert [p["correct"] for p in report.predictions] == [c for *_, c in questions]
    assert [p["predicted_option"] for p in report.predictions] == ["B", "C", "D", "D", None]
    assert option_letter("Answer: (e)") is None and option_letter("Answer: E") == "E"
    assert option_letter("ABC") is None  # letters inside a word are not options


def test_multiple_choice_reference_without_letter_is_refused(stub: Stub, tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "mc.jsonl", [_chat("Q?", "Paris")])
    with pytest.raises(DatasetError, match="mc.jsonl:1"):
        evaluate_endpoint(stub.url, KEY, "m", EvaluationConfig(files=[path], task="multiple_choice"))
    assert stub.requests == []  # refused before any request


def test_concurrency_is_bounded(stub: Stub, tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "eval.jsonl", [_chat(f"q{i}", f"a{i}") for i in range(12)])
    stub.delay_s = 0.15
    evaluate_endpoint(stub.url, KEY, "m", EvaluationConfig(files=[path], concurrency=3))
    assert stub.max_in_flight == 3  # concurrent, and never more than asked (the server counts, not a clock)


def test_failed_requests_raise_instead_of_partial_metrics(stub: Stub, tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "eval.jsonl", [_chat(f"q{i}", f"a{i}") for i in range(4)])
    stub.status["q2"] = 400
    with pytest.raises(EvaluationError, match=r"1 of 4 requests failed"):
        evaluate_endpoint(stub.url, KEY, "m", EvaluationConfig(files=[path]))


def test_wrong_key_is_an_error(stub: Stub, tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "eval.jsonl", [_chat("q", "a")])
    with pytest.raises(EvaluationError, match="AuthenticationError"):
        evaluate_endpoint(stub.url, "wrong-key-0123456789", "m", EvaluationConfig(files=[path]))


def test_bad_records_are_listed_with_their_lines(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "eval.jsonl", [
        _chat("q", "a"),
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                      {"role": "user", "content": "no reference"}]},
    ])
    with pytest.raises(DatasetError, match=r"eval.jsonl:2: the last message must be"):
        load_eval_records(EvaluationConfig(files=[path]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "usr", "content": "q"}]}\n')
    with pytest.raises(DatasetError, match=r"bad.jsonl:1"):
        load_eval_records(EvaluationConfig(files=[bad]))


def _report(model: str, **metrics: float) -> EvalReport:
    return EvalReport(model=model, n=3, metrics=metrics, predictions=[])


def test_comparison_table_and_promotion_gate() -> None:
    base = _report("base", **{"bleu-4": 10.0, "rouge-l": 30.5})
    tuned = _report("tuned", **{"bleu-4": 12.25, "rouge-l": 29.0})
    assert compare_reports(base, tuned) == (
        "| metric | base | tuned | delta |\n"
        "|---|---:|---:|---:|\n"
        "| bleu-4 | 10.00 | 12.25 | +2.25 |\n"
        "| rouge-l | 30.50 | 29.00 | -1.50 |\n"
    )
    assert promotion_gate(base, tuned, "bleu-4") is True
    assert promotion_gate(base, tuned, "rouge-l") is False
    assert promotion_gate(base, tuned, "rouge-l", tolerance=2.0) is True
    assert promotion_gate(base, base, "bleu-4") is True  # no regression
    with pytest.raises(KtflowError, match="no metric 'accuracy'"):
        promotion_gate(base, tuned, "accuracy")


def test_adapter_check_needs_a_differing_answer(stub: Stub) -> None:
    prompts = ["p1", "p2", "p3"]
    for p in prompts:
        stub.answers[("base", p)] = f"base says {p}"
        stub.answers[("tuned", p)] = f"base says {p}"
    applied, rows = adapter_is_applied(stub.url, KEY, "base", "tuned", prompts)
    assert applied is False and [r["differs"] for r in rows] == [False, False, False]
    assert all(r["temperature"] == 0 for r in stub.requests)

    stub.answers[("tuned", "p2")] = "tuned says p2, nya~"
    applied, rows = adapter_is_applied(stub.url, KEY, "base", "tuned", prompts)
    assert applied is True and [r["differs"] for r in rows] == [False, True, False]
    assert rows[1] == {"prompt": "p2", "base": "base says p2", "tuned": "tuned says p2, nya~", "differs": True}


@pytest.mark.parametrize(("gate", "min_gain", "tuned_answers", "promoted", "fails_run"), [
    # No gate set: promotion is still judged on rouge-l, so a worse model is never "promoted".
    (None, 0.0, "worse", False, False),
    (None, 0.0, "exact", True, False),
    # The demo's gate: +20 ROUGE-L or the run fails.
    ("rouge-l", 20.0, "exact", True, False),
    ("rouge-l", 20.0, "slightly better", False, True),
    ("rouge-l", 0.0, "worse", False, True),
])
def test_promotion_is_never_granted_to_a_model_short_of_the_gate(
        stub: Stub, tmp_path: Path, gate: str | None, min_gain: float, tuned_answers: str, promoted: bool,
        fails_run: bool) -> None:
    from ktflow.recipe import load_recipe
    from ktflow.stages.evaluate import evaluate_base_vs_tuned

    references = {q: a for q, a, _ in GENERATIVE}
    data = _jsonl(tmp_path / "eval.jsonl", [_chat(q, a) for q, a in references.items()])
    for i, (q, a) in enumerate(references.items()):
        base = a.split(" ")[0] + " and more words"  # a few points of ROUGE-L
        stub.answers[("tiny-demo", q)] = base
        stub.answers[("tiny-demo:tuned", q)] = {
            "exact": a, "worse": "nothing alike", "slightly better": a.split(" ")[0] + " " + a.split(" ")[1] + " x",
        }[tuned_answers]
    train = _jsonl(tmp_path / "train.jsonl", [_chat("Something else entirely?", "Yes, nya~")])
    overrides = [f"evaluation.files={json.dumps([str(data)])}", f"evaluation.gate_min_gain={min_gain}",
                 f"dataset.files={json.dumps([str(train)])}"]
    if gate:
        overrides.append(f"evaluation.gate_metric={gate}")
    recipe = load_recipe(Path(__file__).resolve().parent.parent / "recipes/tiny-demo.yaml", overrides)
    if not gate:
        recipe = recipe.model_copy(update={"evaluation": recipe.evaluation.model_copy(update={"gate_metric": None})})
    result = evaluate_base_vs_tuned(recipe, model_dir=tmp_path, tuned_url=stub.url, tuned_model="tiny-demo:tuned",
                                    api_key=KEY, out_dir=tmp_path / "eval", base_url=stub.url, base_model="tiny-demo")
    gain = result.tuned.metrics["rouge-l"] - result.base.metrics["rouge-l"]
    assert result.adapter_applied and result.gate_metric == "rouge-l"
    assert result.promoted is promoted and promoted == (gain >= min_gain), gain
    assert result.gate_enforced is (gate is not None)
    assert result.gate_min_gain == min_gain
    failure = result.gate_failure()
    assert (failure is not None) is fails_run
    if failure:
        assert f"the promotion gate asks for at least +{min_gain:.2f}" in failure and f"{gain:+.2f} points" in failure
    report = json.loads((tmp_path / "eval/report.json").read_text())
    assert report["promoted"] is promoted and report["gate_metric"] == "rouge-l"


# --------------------------------------------------------------------------- train/eval overlap


def test_overlap_exact_normalized_and_no_false_positives() -> None:
    from ktflow.stages.contamination import find_overlaps, normalize_prompt

    train = [("t.jsonl:1", "What is a shard?"), ("t.jsonl:2", "Why quantize experts to INT8?"),
             ("t.jsonl:3", "  Où   sont les EXPERTS ?  "), ("t.jsonl:4", "What is a shard?")]
    evaluation = [
        ("e.jsonl:1", "What is a shard?"),                  # exact
        ("e.jsonl:2", "what is a SHARD"),                   # case and punctuation
        ("e.jsonl:3", "Why  quantize\texperts to INT8 ?!"),  # whitespace and punctuation
        ("e.jsonl:4", "où sont les experts"),               # Unicode case folding
        ("e.jsonl:5", "What is a shard size?"),             # one word more: another question
        ("e.jsonl:6", "What is a shared expert?"),
        ("e.jsonl:7", "Why quantize experts to INT4?"),
        ("e.jsonl:8", "What is a shard?\nAnswer briefly."),  # more text: another prompt
    ]
    found = find_overlaps(evaluation, train)
    assert [(o.eval_source, o.train_source, o.match) for o in found.overlaps] == [
        ("e.jsonl:1", "t.jsonl:1", "exact"), ("e.jsonl:2", "t.jsonl:1", "normalized"),
        ("e.jsonl:3", "t.jsonl:2", "normalized"), ("e.jsonl:4", "t.jsonl:3", "normalized")]
    assert (found.count, found.exact, found.eval_prompts, found.share) == (4, 1, 8, 50.0)
    assert found.summary() == ("train/eval overlap: 4 of 8 eval prompts (50.0 %) occur in the training data "
                               "(1 exact, 3 more after normalizing case, whitespace and punctuation)")
    assert "e.jsonl:2 = t.jsonl:1 (normalized): 'what is a SHARD'" in found.named()
    assert found.named(limit=1).endswith("; and 3 more")
    assert normalize_prompt("  Hello,   WORLD!\n") == "hello world"
    clean = find_overlaps(evaluation[4:], train)
    assert clean.clean and clean.count == 0 and clean.share == 0.0 and clean.eval_prompts == 4
    assert find_overlaps([("e:1", "?!")], [("t:1", "...")]).clean  # empty after normalizing is no match


def test_overlap_of_multiple_choice_compares_question_stems() -> None:
    from ktflow.stages.contamination import find_overlaps, question_stem

    stem = "Which stage writes BF16 weights?"
    trained = f"{stem}\nA. sft\nB. dequantize\nC. serve\nD. download"
    assert question_stem(trained) == stem
    assert question_stem("(A) first line is an option") == "(A) first line is an option"
    train = [("t:1", trained)]
    evaluation = [
        ("e:1", f"{stem}\n(A) serve\n(B) sft\n(C) dequantize\n(D) download"),  # options reordered
        ("e:2", "which stage writes bf16 weights\nA) one\nB) two"),          # normalized stem
        ("e:3", "Which stage serves the model?\nA. sft\nB. dequantize\nC. serve\nD. download"),  # same options
    ]
    found = find_overlaps(evaluation, train, multiple_choice=True)
    assert [(o.eval_source, o.match) for o in found.overlaps] == [("e:1", "exact"), ("e:2", "normalized")]
    assert found.compared == "question stem" and "eval question stems" in found.summary()
    # Compared as whole prompts, the reordered options hide the overlap.
    assert find_overlaps(evaluation, train).clean


def test_demo_evaluation_never_occurs_in_its_training_data(tmp_path: Path) -> None:
    from ktflow.demo import STYLE_MARKER, write_demo_dataset
    from ktflow.formats.dataset import user_prompts
    from ktflow.recipe import DatasetConfig
    from ktflow.stages.contamination import find_overlaps

    train, evaluation = write_demo_dataset(tmp_path)
    train_cfg = DatasetConfig(name="t", files=[train], format="openai")
    eval_records = load_eval_records(EvaluationConfig(files=[evaluation]))
    found = find_overlaps(((r.source, r.messages[-1]["content"]) for r in eval_records), user_prompts(train_cfg))
    assert found.clean and found.eval_prompts == len(eval_records) == 8
    assert all(r.reference.endswith(STYLE_MARKER) for r in eval_records)
    # An older demo's files (eval drawn from the training questions) are replaced; current ones are kept.
    evaluation.write_text(train.read_text().splitlines()[0] + "\n")
    before = train.stat().st_mtime_ns
    write_demo_dataset(tmp_path)
    assert len(evaluation.read_text().splitlines()) == 8 and train.stat().st_mtime_ns == before


def test_user_prompts_refuse_unreadable_training_data(tmp_path: Path) -> None:
    from ktflow.formats.dataset import user_prompts
    from ktflow.recipe import DatasetConfig

    cfg = DatasetConfig(name="t", files=[tmp_path / "missing.jsonl"], format="openai")
    with pytest.raises(DatasetError, match="missing.jsonl"):
        list(user_prompts(cfg))
    multi = _jsonl(tmp_path / "multi.jsonl", [{"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "first?"},
        {"role": "assistant", "content": "one"}, {"role": "user", "content": "second?"},
        {"role": "assistant", "content": "two"}]}, {"not": "a chat"}])
    assert list(user_prompts(DatasetConfig(name="t", files=[multi], format="openai"))) == [
        (f"{multi}:1", "first?"), (f"{multi}:1", "second?")]  # every user turn; the bad record skipped


# --------------------------------------------------------------------------- the style metric


def test_style_metric_marker_and_pattern(stub: Stub, tmp_path: Path) -> None:
    from ktflow.recipe import StyleMetric
    from ktflow.stages.evaluate import style_share

    marker, pattern = StyleMetric(marker="nya~"), StyleMetric(pattern=r"nya~\s*$")
    answers = ["yes, nya~", "nya~ at the start", "no", "", "yes, nya~  "]
    assert style_share(answers, marker) == 60.0
    assert style_share(answers, pattern) == 40.0  # only at the end
    assert marker.label == "style ('nya~')" and pattern.label == "style (/nya~\\s*$/)"
    data = _jsonl(tmp_path / "eval.jsonl", [_chat(f"q{i}", "a, nya~") for i in range(4)])
    for i, answer in enumerate(["a, nya~", "b", "c nya~", "d"]):
        stub.answers[("m", f"q{i}")] = answer
    report = evaluate_endpoint(stub.url, KEY, "m", EvaluationConfig(files=[data], style={"marker": "nya~"}))
    assert report.metrics["style"] == 50.0 and "rouge-l" in report.metrics
    assert [p["styled"] for p in report.predictions] == [True, False, True, False]
    base = _report("base", **{"rouge-l": 1.0, "style": 0.0})
    table = compare_reports(base, report, style=StyleMetric(pattern="a|b"))
    assert "| style (/a\\|b/) | 0.00 | 50.00 | +50.00 |" in table  # a '|' in the label is escaped


@pytest.mark.parametrize(("settings", "complaint"), [
    ({"style": {"marker": "x", "pattern": "y"}}, "exactly one of marker"),
    ({"style": {}}, "exactly one of marker"),
    ({"style": {"pattern": "(unclosed"}}, "is not a regular expression"),
    ({"gate_metric": "style"}, "'style' needs evaluation.style"),
])
def test_style_settings_are_validated(settings: dict[str, Any], complaint: str, tmp_path: Path) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=re.escape(complaint)):
        EvaluationConfig(files=[tmp_path / "e.jsonl"], **settings)


def _gated_recipe(tmp_path: Path, train: list[dict[str, Any]], evaluation: list[dict[str, Any]], *sets: str):
    from ktflow.recipe import load_recipe

    t = _jsonl(tmp_path / "train.jsonl", train)
    e = _jsonl(tmp_path / "eval.jsonl", evaluation)
    return load_recipe(Path(__file__).resolve().parent.parent / "recipes/tiny-demo.yaml", [
        f"dataset.files={json.dumps([str(t)])}", f"evaluation.files={json.dumps([str(e)])}", *sets])


@pytest.mark.parametrize("allow", [False, True])
def test_a_contaminated_evaluation_set_does_not_promote_unless_allowed(stub: Stub, tmp_path: Path,
                                                                       allow: bool) -> None:
    from ktflow.stages.evaluate import evaluate_base_vs_tuned, refuse_contaminated_gate

    questions = ["What is a shard?", "What is a token?", "What is BF16?", "What is a batch?"]
    train = [_chat(q, "x, nya~") for q in ("what is a SHARD", "What is a token?", "Unrelated?")]
    recipe = _gated_recipe(tmp_path, train, [_chat(q, "a, nya~") for q in questions],
                           f"evaluation.allow_contamination={str(allow).lower()}")
    for q in questions:
        stub.answers[("tiny-demo", q)] = "plain"
        stub.answers[("tiny-demo:tuned", q)] = "styled, nya~"
    if not allow:  # an enforced gate that could never pass is refused before any heavy work
        with pytest.raises(DatasetError) as refused:
            refuse_contaminated_gate(recipe)
        for says in ("2 of 4 eval prompts (50.0 %)", f"{tmp_path / 'eval.jsonl'}:1 = {tmp_path / 'train.jsonl'}:1",
                     "evaluation.allow_contamination: true"):
            assert says in str(refused.value), str(refused.value)
    else:
        assert refuse_contaminated_gate(recipe).count == 2  # type: ignore[union-attr]
    result = evaluate_base_vs_tuned(recipe, model_dir=tmp_path, tuned_url=stub.url, tuned_model="tiny-demo:tuned",
                                    api_key=KEY, out_dir=tmp_path / "eval", base_url=stub.url, base_model="tiny-demo")
    assert result.tuned.metrics["style"] - result.base.metrics["style"] == 100.0  # the gate itself would pass
    assert (result.contamination.count, result.contamination.exact) == (2, 1)
    assert result.promoted is allow
    failure = result.gate_failure()
    assert (failure is None) is allow
    if failure:
        assert "2 of 4 eval prompts" in failure and "What is a token?" in failure
    report = json.loads(result.report_json.read_text())
    assert report["promoted"] is allow and report["allow_contamination"] is allow
    assert [o["eval_source"].rsplit(":", 1)[1] for o in report["contamination"]["overlaps"]] == ["1", "2"]
    md = result.report_md.read_text()
    assert "NOT all held out" in md and "Train/eval overlap: 2 of 4 eval prompts (50.0 %)" in md


def test_a_clean_set_reports_no_overlap_and_the_style_gate_decides(stub: Stub, tmp_path: Path) -> None:
    from ktflow.stages.evaluate import evaluate_base_vs_tuned, refuse_contaminated_gate

    questions = ["What is BF16?", "What is a batch?", "What is an epoch?", "What is a loss curve?"]
    recipe = _gated_recipe(tmp_path, [_chat("What is a shard?", "x, nya~")],
                           [_chat(q, "a, nya~") for q in questions])
    assert recipe.evaluation.gate_metric == "style" and recipe.evaluation.gate_min_gain == 50
    assert refuse_contaminated_gate(recipe).clean  # type: ignore[union-attr]
    for i, q in enumerate(questions):  # the tuned model carries the style on 1 of 4 prompts: +25 < +50
        stub.answers[("tiny-demo", q)] = "plain"
        stub.answers[("tiny-demo:tuned", q)] = "styled, nya~" if i == 0 else "other"
    result = evaluate_base_vs_tuned(recipe, model_dir=tmp_path, tuned_url=stub.url, tuned_model="tiny-demo:tuned",
                                    api_key=KEY, out_dir=tmp_path / "eval", base_url=stub.url, base_model="tiny-demo")
    assert result.contamination.clean and result.promoted is False
    assert "style is 25.00 against the base's 0.00 (+25.00 points)" in (result.gate_failure() or "")
    md = result.report_md.read_text()
    assert "4 held-out records" in md and "Train/eval overlap: 0 of 4 eval prompts (0.0 %)" in md
    assert "| style ('nya~') | 0.00 | 25.00 | +25.00 |" in md
