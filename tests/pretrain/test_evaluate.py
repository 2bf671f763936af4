"""Evaluation: the lm-eval adapter against direct model computations, the local MC task end to end,
launch/evaluate.py on every weight-file kind, and the delta table.

A tiny random GPT (vocabulary 400, padded to 512 by megatron: the adapter must drop the padding)
with a large init std so that its next-token distributions are far from uniform (an indexing
error then changes log-likelihoods by O(1)), and a sentencepiece tokenizer trained here on a few
stdlib modules. Direct computations use single unpadded sequences; the adapter batches
right-padded ones, so the exact ``F.linear`` GEMMs (tests/model's test double) are used where we
compare numbers.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance

from model.gpt import ModelConfig, apply_precision_plan, build_gpt, policy_linear_names
from precision import PrecisionPolicy
from pretrain.evaluation import mc_task, results
from pretrain.evaluation.lm_eval_adapter import MegatronLM
from tests.model._fakes import ReferenceLinear

SEQ = 64
CFG = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
       "num_query_groups": 2, "seq_length": SEQ, "init_method_std": 0.3}
MC_DATA = os.path.join(mc_task.CONFIG_DIR, "local_python_mc.jsonl")


def _lines(path) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


def _json(path) -> dict:
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from pretrain.data.tokenizer import train_tokenizer

    docs = [inspect.getsource(m) for m in (collections, functools)]
    docs.append("\n".join(_lines(MC_DATA)))
    return train_tokenizer(docs, str(tmp_path_factory.mktemp("tok") / "tok.model"), vocab_size=400)


@pytest.fixture(scope="module")
def gpt(request, tok):
    request.getfixturevalue("world_of_one")
    cfg = ModelConfig(vocab_size=tok.vocab_size, **CFG)
    torch.manual_seed(3)
    model = build_gpt(cfg)
    apply_precision_plan(model, PrecisionPolicy.from_args("bf16").resolve(policy_linear_names(model), cfg.num_layers))
    return model.eval(), cfg


@pytest.fixture
def exact(monkeypatch):
    import model.layers

    monkeypatch.setattr(model.layers, "policy_linear", ReferenceLinear())


def _req(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=tuple(args), idx=0)


@torch.no_grad()
def _logprobs(model, vocab: int, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] log-probabilities of the token after each position, one unpadded sequence."""
    tokens = torch.tensor([ids])
    logits = model(tokens, torch.arange(len(ids))[None], None)[0, :, :vocab]
    return F.log_softmax(logits.float(), dim=-1)


# ================================================================================================
# The three request types
# ================================================================================================


def test_loglikelihood_equals_direct_sum(gpt, tok, exact):
    model, cfg = gpt
    lm = MegatronLM(model, tok, seq_length=SEQ, batch_size=3)
    long_context = "from collections import OrderedDict\n" * 12  # > SEQ tokens: truncated from the left
    cases = [("Question: Which module provides deque?\nAnswer:", " collections"),
             ("def f(x):\n    return", " x + 1"),
             ("import ", "functools"),
             ("Answer: ", "heapq"),  # trailing space moves into the continuation
             ("", "import os"),
             ("  ", "import os"),  # whitespace only: conditioned on the prefix token, as an empty context
             (long_context, " # done")]
    got = lm.loglikelihood([_req("loglikelihood", c, x) for c, x in cases])
    for (context, cont), (ll, greedy) in zip(cases, got):
        n_spaces = len(context) - len(context.rstrip())
        if context and n_spaces:
            context, cont = context[:-n_spaces], context[-n_spaces:] + cont
        ctx_ids = tok.tokenize(context) if context else [tok.eod]
        cont_ids = tok.tokenize(context + cont)[len(ctx_ids):] if context else tok.tokenize(cont)
        ids = (ctx_ids + cont_ids)[-(SEQ + 1):]
        logp = _logprobs(model, cfg.vocab_size, ids[:-1])[-len(cont_ids):]
        target = torch.tensor(cont_ids)
        want = logp.gather(-1, target[:, None]).sum().item()
        assert ll == pytest.approx(want, rel=1e-5, abs=1e-4), (context[-30:], cont)
        assert greedy == bool((logp.argmax(-1) == target).all())
        assert ll < -0.5  # far from zero: the comparison above is not vacuous
    assert len(tok.tokenize(long_context)) > SEQ
    assert lm.loglikelihood([_req("loglikelihood", "import", "")]) == [(0.0, True)]


def test_loglikelihood_under_the_bf16_plan_is_close(gpt, tok):
    model, cfg = gpt
    lm = MegatronLM(model, tok, seq_length=SEQ, batch_size=2)
    (ll, _), = lm.loglikelihood([_req("loglikelihood", "import", " collections")])
    ids = tok.tokenize("import collections")
    n = len(tok.tokenize("import"))
    logp = _logprobs(model, cfg.vocab_size, ids[:-1])[n - 1:]
    assert ll == pytest.approx(logp.gather(-1, torch.tensor(ids[n:])[:, None]).sum().item(), rel=1e-2)


def test_loglikelihood_rolling(gpt, tok, exact):
    model, cfg = gpt
    lm = MegatronLM(model, tok, seq_length=SEQ, batch_size=4)
    short = "def add(a, b):\n    return a + b\n"
    long = inspect.getsource(functools.total_ordering)
    got_short, got_long = lm.loglikelihood_rolling([_req("loglikelihood_rolling", s) for s in (short, long)])
    ids = tok.tokenize(short)
    logp = _logprobs(model, cfg.vocab_size, [tok.eod] + ids[:-1])
    assert got_short == pytest.approx(logp.gather(-1, torch.tensor(ids)[:, None]).sum().item(), rel=1e-5)
    # long text: windows of SEQ tokens, each later window conditioned on the previous SEQ - k tokens
    ids = tok.tokenize(long)
    assert len(ids) > 2 * SEQ
    want, scored = 0.0, 0
    for start in range(0, len(ids), SEQ):
        end = min(start + SEQ, len(ids))
        window = ([tok.eod] + ids)[max(0, end - SEQ): end]  # inputs: the SEQ tokens before each target
        logp = _logprobs(model, cfg.vocab_size, window)[-(end - start):]
        want += logp.gather(-1, torch.tensor(ids[start:end])[:, None]).sum().item()
        scored += end - start
    assert scored == len(ids)
    assert got_long == pytest.approx(want, rel=1e-5)


@torch.no_grad()
def _greedy_direct(model, cfg, tok, context: str, n: int) -> str:
    ids, gen = tok.tokenize(context), []
    for _ in range(n):
        nxt = int(_logprobs(model, cfg.vocab_size, ids)[-1].argmax())
        if nxt == tok.eod:
            break
        ids.append(nxt)
        gen.append(nxt)
    return tok.detokenize(gen)


def test_generate_until(gpt, tok, exact):
    model, cfg = gpt
    lm = MegatronLM(model, tok, seq_length=SEQ, batch_size=4)
    contexts = ["import ", "class OrderedDict(dict):\n", "x" * 200]  # the last is truncated from the left
    free = lm.generate_until([_req("generate_until", c, {"until": [], "max_gen_toks": 12}) for c in contexts])
    for c, text in zip(contexts[:2], free):
        assert text == _greedy_direct(model, cfg, tok, c, 12)
    assert len(tok.tokenize(contexts[2])) > SEQ and isinstance(free[2], str)
    text = free[1]
    assert len(text) >= 6, text
    stop = text[3:6]
    cut = lm.generate_until([_req("generate_until", contexts[1], {"until": [stop, "never"], "max_gen_toks": 12}),
                             _req("generate_until", contexts[1], {"until": "never", "max_gen_toks": 2})])
    assert cut[0] == text[: text.index(stop)]
    assert cut[1] == _greedy_direct(model, cfg, tok, contexts[1], 2)
    with pytest.raises(ValueError, match="greedy only"):
        lm.generate_until([_req("generate_until", "a", {"do_sample": True, "temperature": 1.0})])


# ================================================================================================
# Tasks, the CLI and tables
# ================================================================================================


def test_local_mc_task_config():
    assert "local_python_mc" in mc_task.local_task_names()
    cfg = mc_task.task_config("local_python_mc")
    path = cfg["dataset_kwargs"]["data_files"]["test"]
    assert os.path.isabs(path) and os.path.isfile(path)
    docs = [json.loads(line) for line in _lines(path)]
    assert len(docs) >= 50 and all(len(d["choices"]) == 4 and 0 <= d["answer"] < 4 for d in docs)
    assert all(d["choices"].count(d["choices"][d["answer"]]) == 1 for d in docs)
    specs, builtin = mc_task.resolve_tasks(["local_python_mc", "hellaswag"])
    assert isinstance(specs[0], dict) and specs[1] == "hellaswag" and builtin
    with pytest.raises(ValueError, match="not a local task"):
        mc_task.task_config("nope")


def _plain_file(model, cfg, path) -> str:
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        state[name] = state[name][: cfg.vocab_size]
    torch.save({"model": state, "model_config": dataclasses.asdict(cfg)}, path)
    return str(path)


def test_evaluate_cli_local_mc_end_to_end(gpt, tok, tmp_path, capsys):
    from launch.evaluate import main

    model, cfg = gpt
    plain = _plain_file(model, cfg, tmp_path / "plain.pt")
    out = tmp_path / "eval"
    assert main(["--load", plain, "--tasks", "local_python_mc", "--out", str(out),
                 "--tokenizer-model", tok.path, "--limit", "6", "--label", "tiny"]) == 0
    rows = results.read_rows(str(out))
    assert {r["metric"] for r in rows} == {"acc", "acc_norm"}
    assert all(r["task"] == "local_python_mc" and 0.0 <= r["value"] <= 1.0 for r in rows)
    meta = _json(out / "results.json")
    assert meta["kind"] == "plain" and meta["n_samples"]["local_python_mc"]["effective"] == 6
    assert "| local_python_mc | acc |" in (out / "results.md").read_text()
    assert "# tiny" in capsys.readouterr().out
    samples = results.read_samples(str(out))  # per-document results for --compare's paired test
    assert len(samples) == 6 and {s["doc_id"] for s in samples} == set(range(6))
    assert all(set(s["metrics"]) == {"acc", "acc_norm"} and s["nll"] > 0 for s in samples)
    acc = next(r["value"] for r in rows if r["metric"] == "acc")
    assert sum(s["metrics"]["acc"] for s in samples) / 6 == pytest.approx(acc)


def test_evaluate_cli_training_checkpoint(gpt, tok, tmp_path):
    """A TP=1 checkpoint in pretrain/checkpointing.py's layout, config rebuilt from its saved args."""
    from launch.evaluate import main
    from pretrain.arguments import parse_args
    from pretrain.checkpointing import save_checkpoint

    model, cfg = gpt
    args = parse_args(["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
                       "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", str(SEQ),
                       "--train-iters", "1", "--tokenizer-model", tok.path, "--precision", "bf16"])
    plan = PrecisionPolicy.from_args("bf16").resolve(policy_linear_names(model), cfg.num_layers)
    save_checkpoint(str(tmp_path / "ckpt"), 3, {"model": model.state_dict(), "args": dict(vars(args)),
                                                "precision_plan": plan.to_dict()})
    out = tmp_path / "eval"
    assert main(["--load", str(tmp_path / "ckpt"), "--tasks", "local_python_mc", "--out", str(out),
                 "--limit", "2"]) == 0
    meta = _json(out / "results.json")
    assert meta["kind"] == "checkpoint" and meta["precision_plan"] == plan.to_dict()


@pytest.mark.usefixtures("world_of_one")
def test_evaluate_cli_converted_hf_with_its_tokenizer(tmp_path):
    """Convert a tiny HF Llama whose directory carries a tokenizer; evaluate.py finds that tokenizer."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers

    from launch.convert_hf import main as convert
    from launch.evaluate import main
    from pretrain.evaluation.hf_tokenizer import HFTokenizer

    words = sorted({w for line in _lines(MC_DATA)
                    for w in json.loads(line)["question"].replace("?", " ?").split()} | {"Question:", "Answer:"})
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>"] + words[:250])}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                                  unk_token="<unk>")
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    hf_model.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    hf_tok.save_pretrained(str(tmp_path / "hf"))
    assert convert(["--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "conv")]) == 0
    tok_dir = tmp_path / "conv" / "hf_tokenizer"
    assert (tok_dir / "tokenizer.json").is_file()
    hf_wrapped = HFTokenizer(str(tok_dir))
    assert (hf_wrapped.bos, hf_wrapped.eod) == (1, 2) and hf_wrapped.unique_identifiers["sha1"]
    assert hf_wrapped.tokenize_batch(["Which module provides"]) == [hf_wrapped.tokenize("Which module provides")]
    assert main(["--load", str(tmp_path / "conv"), "--tasks", "local_python_mc", "--out", str(tmp_path / "eval"),
                 "--limit", "3"]) == 0
    meta = _json(tmp_path / "eval" / "results.json")
    assert meta["kind"] == "hf_converted" and "HFTokenizer" in meta["tokenizer"]


def test_compare_table(tmp_path, capsys):
    from launch.evaluate import main

    a = [{"task": "local_python_mc", "metric": "acc", "value": 0.50, "stderr": 0.03},
         {"task": "hellaswag", "metric": "acc_norm", "value": 0.60, "stderr": 0.04},
         {"task": "only_a", "metric": "acc", "value": 0.1, "stderr": None}]
    b = [{"task": "local_python_mc", "metric": "acc", "value": 0.48, "stderr": 0.04},
         {"task": "hellaswag", "metric": "acc_norm", "value": 0.61, "stderr": None}]
    results.write_results(a, str(tmp_path / "bf16"), label="BF16")
    results.write_results(b, str(tmp_path / "qat"), label="QAT")
    assert main(["--compare", str(tmp_path / "bf16"), str(tmp_path / "qat"), "--labels", "BF16", "QAT",
                 "--out", str(tmp_path / "cmp")]) == 0
    rows = {r["task"]: r for r in results.compare_rows(results.read_rows(str(tmp_path / "bf16")),
                                                       results.read_rows(str(tmp_path / "qat")))}
    assert set(rows) == {"local_python_mc", "hellaswag"}
    assert rows["local_python_mc"]["delta"] == pytest.approx(-0.02)
    assert rows["local_python_mc"]["delta_stderr"] == pytest.approx(0.05)
    assert rows["hellaswag"]["delta"] == pytest.approx(0.01) and rows["hellaswag"]["delta_stderr"] is None
    md = (tmp_path / "cmp" / "compare.md").read_text()
    # no per-sample results: unpaired, proportions' deltas in percentage points, relative drop
    assert "| local_python_mc | acc | 0.5000 | 0.4800 | -2.0000 pp | 5.0000 | -4.00% |" in md
    assert "Δ (QAT − BF16)" in md and "Unpaired" in md and md in capsys.readouterr().out


def test_sample_rows_from_lm_eval_records():
    rows = results.sample_rows({"t": [
        {"doc_id": 3, "target": 1, "filtered_resps": [[-2.0, False], [-0.5, True]], "acc": 1.0, "acc_norm": 0,
         "doc": {"q": "x"}, "arguments": [], "resps": []},
        {"doc_id": 4, "target": 0, "filtered_resps": [-7.25], "word_perplexity": -7.25},  # rolling
    ]})
    assert rows == [{"task": "t", "doc_id": 3, "metrics": {"acc": 1.0, "acc_norm": 0.0}, "nll": 0.5},
                    {"task": "t", "doc_id": 4, "metrics": {"word_perplexity": -7.25}, "nll": 7.25}]


def test_paired_compare_sees_a_drop_the_unpaired_table_cannot(tmp_path, capsys):
    from scipy.stats import ttest_rel

    from launch.evaluate import main

    acc_a = [1, 1, 0, 1, 0, 1, 1, 0] * 8
    acc_b = [1, 0, 0, 1, 0, 1, 1, 0] * 8  # one document in eight flips to wrong: -12.5 pp
    nll_a = [1.0 + 0.1 * i for i in range(64)]
    nll_b = [v + 0.05 + (0.01 if i % 2 else -0.01) for i, v in enumerate(nll_a)]

    def samples(acc, nll):
        return [{"task": "mc", "doc_id": i, "metrics": {"acc": float(v)}, "nll": n}
                for i, (v, n) in enumerate(zip(acc, nll))]

    for name, acc, nll, value in (("bf16", acc_a, nll_a, 0.625), ("qat", acc_b, nll_b, 0.5)):
        se = math.sqrt(value * (1 - value) / 63)  # lm-eval's stderr of a mean of 64 Bernoulli scores
        results.write_results([{"task": "mc", "metric": "acc", "value": value, "stderr": se}],
                              str(tmp_path / name), label=name, samples=samples(acc, nll))
    assert main(["--compare", str(tmp_path / "bf16"), str(tmp_path / "qat"), "--labels", "BF16", "QAT",
                 "--out", str(tmp_path / "cmp")]) == 0
    rows = {r["metric"]: r for r in results.paired_rows(results.read_samples(str(tmp_path / "bf16")),
                                                        results.read_samples(str(tmp_path / "qat")))}
    acc = rows["acc"]
    assert acc["n"] == 64 and acc["a"] == 62.5 and acc["b"] == 50.0 and acc["delta"] == pytest.approx(-12.5)
    assert acc["relative_pct"] == pytest.approx(-20.0)
    # the paired interval is scipy's paired t-test's (an independent oracle)
    ci = ttest_rel([100.0 * v for v in acc_b], [100.0 * v for v in acc_a]).confidence_interval(0.95)
    assert (acc["lo"], acc["hi"]) == (pytest.approx(ci.low), pytest.approx(ci.high))
    assert acc["hi"] < 0 and acc["verdict"] == "worse"  # the unpaired +-8.6 pp stderr could not show it
    nll = rows["nll"]
    assert nll["delta"] == pytest.approx(0.05) and nll["unit"] == "nats" and nll["verdict"] == "worse"
    assert rows["ppl ratio"]["delta"] == pytest.approx(math.exp(0.05))
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| mc | acc | 64 | 62.5000 | 50.0000 | -12.5000 pp | -20.00% |" in md and "| worse |" in md
    assert "Paired over the documents" in md and md in capsys.readouterr().out


def test_result_rows_from_lm_eval_output():
    rows = results.result_rows({"gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.25,
                                          "exact_match_stderr,strict-match": 0.1, "acc,none": 0.5,
                                          "acc_stderr,none": "N/A"}})
    assert rows == [{"task": "gsm8k", "metric": "exact_match,strict-match", "value": 0.25, "stderr": 0.1},
                    {"task": "gsm8k", "metric": "acc", "value": 0.5, "stderr": None}]
