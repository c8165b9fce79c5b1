"""Tiny random-weight causal LMs and tokenizers built in-process (no download), and the greedy loops the tests
compare them with: what the unit tier runs on."""

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    pad_token_id=0,
)


def tiny_model(arch: str, seed: int = 0, **overrides):
    """A random-weight causal LM built in-process (no download); overrides: config fields other than COMMON's."""
    torch.manual_seed(seed)
    common = {**COMMON, **overrides}
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=None))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))
    elif arch == "gemma3":
        cfg = Gemma3TextConfig(
            **common,
            sliding_window=24,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
        model = Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    return model.eval()


def greedy_generate(model, ids, cache, n=6, mask=None):
    """Exactly n greedy tokens through transformers' generate with `cache`: (sequences, scores (n, B, V))."""
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        cache=cache,
        pad_token_id=0,
    )
    return out.sequences, torch.stack(out.scores)


def fork_answer(model, cfg, doc, question, n: int):
    """A document prefilled once into a PQCache, a fork of it asked `question`, then n greedy decode steps on the
    fork: (tokens (1, n), the last step's logits, the fork)."""
    from pqcache import PQCache  # the tiny models' helpers above need no engine

    with torch.no_grad():
        parent = PQCache(model, cfg)
        model(doc, cache=parent)
        parent.wait()
        fork = parent.fork("pqcache")
        logits = model(question, cache=fork).logits[:, -1:]
        tokens = []
        for _ in range(n):
            token = logits.argmax(-1)
            tokens.append(token)
            logits = model(token, cache=fork).logits
    return torch.cat(tokens, 1), logits, fork


class WordTokenizer:
    """Whitespace tokenizer over the tiny models' vocabulary (ids 1..95)."""

    eos_token_id = None

    def __call__(self, text, return_tensors=None, add_special_tokens=True):
        ids = [1 + (sum(map(ord, w)) % 95) for w in text.split()]
        out = torch.tensor([ids]) if return_tensors == "pt" else ids
        return type("Enc", (), {"input_ids": out})()

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"t{i}" for i in ids)


ARCHS = ["llama", "mistral", "qwen2", "gemma3"]


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def byte_tokenizer(chat_template: str | None = None):
    """A real (fast) tokenizer built in-process: one token per byte (ids 3..258) after <pad>, <s> (BOS, added by
    default) and </s> (EOS); decoding gives the text back exactly. chat_template: a Jinja chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(specials + sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=chat_template,
    )


# a served model's shape: big enough for a document of thousands of tokens (a load that Stop can end midway)
SERVED = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=8192,
)


def tiny_chat_model(seed: int = 0, **overrides):
    """A random-weight Llama whose tokenizer has a chat template (an 'instruct model' in miniature): (model, tok).
    overrides: config fields other than COMMON's (SERVED: the served model's shape)."""
    tok = byte_tokenizer(CHAT_TEMPLATE)
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**COMMON, "vocab_size": len(tok), **overrides}, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval(), tok
