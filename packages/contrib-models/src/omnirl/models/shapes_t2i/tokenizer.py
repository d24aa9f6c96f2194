"""A word-level tokenizer over the ShapesEval vocabulary, built offline.

Every prompt of the ShapesEval grammar ("a photo of two red circles left of ...") is a
sequence of whole words; the tokenizer maps each word to one id, wraps the sequence in
``<bos> ... <eos>`` and pads to :data:`MAX_LENGTH`. Unknown words become ``<unk>``. It is a
real ``transformers.PreTrainedTokenizerFast`` (saved with ``save_pretrained``, loaded with
``from_pretrained``), so the rollout and the pretraining tool tokenise byte-identically.
"""

from __future__ import annotations

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
# Longest ShapesEval prompt: "a photo of a yellow square left of a blue circle" (11 words)
# plus <bos> and <eos>; 16 leaves room.
MAX_LENGTH = 16


def build_tokenizer(words: list[str]):
    """A ``PreTrainedTokenizerFast``: ids 0-3 are ``<pad> <bos> <eos> <unk>``, then ``words``.

    ``words``: the vocabulary (the pretraining tool passes every word of the ShapesEval
    grammar; this package does not import the reward side). Call with
    ``padding="max_length"``, ``max_length=MAX_LENGTH``, ``truncation=True``.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for w in words:
        vocab.setdefault(w, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}",
        special_tokens=[(BOS, vocab[BOS]), (EOS, vocab[EOS])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=MAX_LENGTH,
    )
