"""lm-evaluation-harness itself against a live `convergent serve`: its `local-completions`
model runs a loglikelihood task (echo + prompt logprobs) and a generate_until task, both
defined by YAML over local JSON files (offline), and its numbers equal transformers'."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("lm_eval", reason="lm_eval is the `eval` extra")

from tests.serve.servers import start_server, stop_server  # noqa: E402

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a cat sat on the mat and the dog sat on the log",
    "hello world, hello tokens, hello evaluation harness",
] * 20
MC = [
    {"question": "the quick brown", "choices": [" fox", " dog", " cat"], "answer": 0},
    {"question": "the cat sat on the", "choices": [" mat", " log"], "answer": 0},
    {"question": "hello", "choices": [" world", " tokens", " harness"], "answer": 2},
]
GEN = [{"question": "hello world,", "answer": " hello"}, {"question": "the lazy", "answer": " dog"}]
TASKS = {
    "tiny_mc": "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\n"
    "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n",
    "tiny_gen": "output_type: generate_until\ndoc_to_target: '{{answer}}'\n"
    "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n  do_sample: false\n"
    "metric_list:\n  - metric: exact_match\n",
}


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A random Llama with its own BPE tokenizer (tokenizer.json, loadable offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=360,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    )
    d = tmp_path_factory.mktemp("eval-llama")
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
    )
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(d)
    fast.save_pretrained(d)
    return d


def _task_dir(root):
    for name, rows in (("tiny_mc", MC), ("tiny_gen", GEN)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\n"
            f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\ndoc_to_text: '{{{{question}}}}'\n{TASKS[name]}"
        )
    return root


def _samples(out_dir, task):
    path = next(out_dir.rglob(f"samples_{task}_*.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines()]


def _loglikelihood(m, tok, context, continuation):
    """lm_eval's rule (trailing spaces of the context move to the continuation; no special
    tokens) scored by transformers: the continuation's summed logprob and greediness."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    with torch.no_grad():
        lp = torch.log_softmax(m(torch.tensor([whole])).logits[0].float(), -1)
    pos = range(len(ctx), len(whole))
    ll = sum(float(lp[p - 1, whole[p]]) for p in pos)
    greedy = all(int(lp[p - 1].argmax()) == whole[p] for p in pos)
    return ll, greedy


def _greedy_text(m, tok, context, n, stop="\n"):
    ids = tok(context, add_special_tokens=False).input_ids
    g = m.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    text = tok.decode(g[0, len(ids) :], skip_special_tokens=True)
    return text.split(stop)[0]


def test_lm_eval_local_completions_loglikelihood_and_generate(bpe_dir, tmp_path):
    proc, base = start_server(bpe_dir, tmp_path, "serve.scheduler.kind=sequential")
    out = tmp_path / "out"
    (tmp_path / "tasks").mkdir()
    tasks = _task_dir(tmp_path / "tasks")
    args = (
        f"base_url={base}/v1/completions,model=convergent-llama,tokenizer_backend=huggingface,"
        f"tokenizer={bpe_dir},max_length=256,max_retries=1,timeout=120"
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf-home"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    try:
        run = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
             args, "--tasks", "tiny_mc,tiny_gen", "--include_path", str(tasks),
             "--output_path", str(out), "--log_samples"],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    finally:
        stop_server(proc)
    assert run.returncode == 0, run.stderr[-3000:]
    m = transformers.LlamaForCausalLM.from_pretrained(bpe_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(bpe_dir)
    mc = _samples(out, "tiny_mc")
    assert len(mc) == len(MC)
    for s in mc:  # arguments: (context, target delimiter + choice) per choice
        for args, resp in zip(s["arguments"].values(), s["resps"], strict=True):
            ll, greedy = resp[0]
            ref_ll, ref_greedy = _loglikelihood(m, tok, args["arg_0"], args["arg_1"])
            assert float(ll) == pytest.approx(ref_ll, abs=1e-3)
            assert greedy == str(ref_greedy)
    gen = _samples(out, "tiny_gen")
    assert len(gen) == len(GEN)
    for s in gen:
        assert s["resps"][0][0] == _greedy_text(m, tok, s["doc"]["question"], 8)
