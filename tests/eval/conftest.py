"""Fixtures for the eval tests: a tiny byte-level BPE tokenizer trained here, so nothing downloads."""

import pytest

_TRAIN = [
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
    "Some special magic numbers are hidden within the following text. Make sure to memorize it.",
    "One of the special magic numbers for amber-falcon is: 1234567. What are all the special magic numbers?",
    "Memorize and track the chain(s) of variable assignment hidden in the following text.",
    "VAR ABCDE = 12345. VAR FGHIJ = VAR ABCDE. Question: Find all variables that are assigned the value.",
    "Answer: According to the chain(s) of variable assignment in the text above, 5 variables are assigned.",
    "It was a bright cold day in April, and the clocks were striking thirteen.",
]


def _train(out, bos: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<s>", "</s>"])
    tok.train_from_iterator(_TRAIN * 10, trainer)
    kwargs = {"eos_token": "</s>"}
    if bos:  # a Llama-like tokenizer that prepends BOS, to check lengths count it
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
        kwargs["bos_token"] = "<s>"
    PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs).save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("tok") / "bpe", bos=False)


@pytest.fixture(scope="session")
def bpe_bos_dir(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("tok") / "bpe-bos", bos=True)


@pytest.fixture(scope="session")
def bpe(bpe_dir):
    from sparse_rl.eval.niah import load_tokenizer

    return load_tokenizer(bpe_dir)
