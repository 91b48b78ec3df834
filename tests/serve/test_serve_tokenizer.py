"""The checkpoint's own tokenizer: a BPE tokenizer trained here with `tokenizers`, saved
beside a transformers-built Llama with a chat template; ids, chat prompt strings, served
text and stop strings compared with transformers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
openai = pytest.importorskip("openai")

from convergent.serve.tokenizer import HFTokenizer, load_tokenizer  # noqa: E402
from tests.serve.servers import start_server, stop_server  # noqa: E402

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] | trim }}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "pipeline parallel serving of a llama model with paged attention",
    "système d'équations — naïve café ünïcödé",
    "hello world, hello tokens, hello chat template",
] * 20
TEXTS = ["hello world", "the lazy fox serves tokens", "naïve café — ok?", "  spaces  and\nnewlines"]


@pytest.fixture(scope="module")
def bpe_model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=TEMPLATE,
    )
    d = tmp_path_factory.mktemp("bpe-llama")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=bos,
        eos_token_id=tok.token_to_id("</s>"),
    )
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(d)
    fast.save_pretrained(d)
    return d


def test_ids_and_chat_prompt_match_transformers(bpe_model_dir):
    ours, note = load_tokenizer(bpe_model_dir, 10_000)
    assert isinstance(ours, HFTokenizer) and "tokenizer.json" in note
    ref = transformers.AutoTokenizer.from_pretrained(bpe_model_dir)
    for t in TEXTS:
        assert ours.encode(t) == ref.encode(t)
        assert ours.decode(ours.encode(t)) == ref.decode(ref.encode(t), skip_special_tokens=True)
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello world "},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "naïve café?"},
    ]
    text, has_bos = ours.render_chat(msgs)
    assert has_bos
    assert text == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ours.encode(text, bos=False) == list(ids)


def test_server_uses_the_checkpoint_tokenizer(bpe_model_dir, tmp_path):
    ref_tok = transformers.AutoTokenizer.from_pretrained(bpe_model_dir)
    hf = transformers.LlamaForCausalLM.from_pretrained(bpe_model_dir).eval()
    proc, base = start_server(bpe_model_dir, tmp_path, "serve.scheduler.kind=sequential")
    try:
        assert "the checkpoint's tokenizer.json" in proc.log_path.read_text()
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": "hello chat template"}]
        r = c.chat.completions.create(
            model="convergent-llama", messages=msgs, max_tokens=12, extra_body={"ignore_eos": True}
        )
        ids = ref_tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        assert r.usage.prompt_tokens == len(ids)
        g = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        out = g[0, len(ids) :].tolist()
        assert r.choices[0].message.content == ref_tok.decode(out, skip_special_tokens=True)
        # stop strings: transformers' stop_strings stops on the token completing it
        text = ref_tok.decode(out, skip_special_tokens=True)
        s = text.strip()[2:5]
        if not s.strip():
            pytest.skip("reference text too short for a stop string")
        g2 = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            stop_strings=[s],
            tokenizer=ref_tok,
        )
        out2 = g2[0, len(ids) :].tolist()
        r2 = c.chat.completions.create(
            model="convergent-llama",
            messages=msgs,
            max_tokens=12,
            stop=[s],
            extra_body={"ignore_eos": True},
        )
        assert r2.choices[0].finish_reason == "stop"
        assert r2.usage.completion_tokens == len(out2)
        full = ref_tok.decode(out2, skip_special_tokens=True)
        assert r2.choices[0].message.content == full[: full.index(s)]
    finally:
        stop_server(proc)
