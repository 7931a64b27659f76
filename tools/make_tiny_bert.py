"""Makes a tiny random BERT-family embedding model, a sentence-transformers directory.

Offline, for tests and examples: the transformers model (config.json + model.safetensors) and
a tokenizer trained on a built-in text at the root, then the Pooling (and Normalize) modules,
written by sentence-transformers itself so that `SentenceTransformer(OUT_DIR)` loads it as any
downloaded embedding model.

    python tools/make_tiny_bert.py OUT_DIR [--arch bert|roberta|xlm-roberta]
        [--pooling mean|cls|lasttoken] [--no-normalize] [--max-seq-length N]

Tokenizers, as their model families ship them: bert a lowercasing WordPiece with
[CLS] ... [SEP]; roberta a byte-level BPE with <s> ... </s>; xlm-roberta a Metaspace Unigram
with <s> ... </s>. Both RoBERTa kinds have pad id 1, so their positions start at 2.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VOCAB_SIZE = 300
MAX_SEQ_LENGTH = 128  # the position table holds this many positions (+2 for RoBERTa's offset)
_BASE = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, initializer_range=0.2, hidden_dropout_prob=0.0,
             attention_probs_dropout_prob=0.0)
# name -> (transformers config and model class names, config overrides)
ARCHES = {
    "bert": ("BertConfig", "BertModel", dict(max_position_embeddings=MAX_SEQ_LENGTH,
                                             type_vocab_size=2, pad_token_id=0)),
    "roberta": ("RobertaConfig", "RobertaModel", dict(
        max_position_embeddings=MAX_SEQ_LENGTH + 2, type_vocab_size=1, pad_token_id=1,
        bos_token_id=0, eos_token_id=2)),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel", dict(
        max_position_embeddings=MAX_SEQ_LENGTH + 2, type_vocab_size=1, pad_token_id=1,
        bos_token_id=0, eos_token_id=2)),
}
POOLING_MODES = ("mean", "cls", "lasttoken")

_CORPUS = """The quick brown fox jumps over the lazy dog. Sentence embeddings map a text to one
vector; similar texts get nearby vectors. A search engine ranks documents by cosine similarity.
Hello, world! How are you today? I am fine, thank you. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100.
Paris is the capital of France. Tokyo is the capital of Japan. Python, C++ and CUDA.
"""


def _bert_tokenizer():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import BertTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    # the class adds BERT's normalizer, pre-tokenizer and [CLS] $A [SEP] post-processor
    return BertTokenizerFast(vocab=tok.get_vocab())


_ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # ids 0..4, as RoBERTa has them


def _roberta_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import RobertaTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=_ROBERTA_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    # the class adds the byte-level pipeline and the <s> $A </s> RoBERTa post-processor
    return RobertaTokenizerFast(vocab=model["vocab"], merges=merges)


def _xlm_roberta_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import XLMRobertaTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(prepend_scheme="always")])
    trainer = trainers.UnigramTrainer(vocab_size=VOCAB_SIZE, special_tokens=_ROBERTA_SPECIALS,
                                      unk_token="<unk>")
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    vocab = [tuple(entry) for entry in json.loads(tok.to_str())["model"]["vocab"]]
    return XLMRobertaTokenizerFast(vocab=vocab)  # its Unigram model takes <unk> at id 3


_TOKENIZERS = {"bert": _bert_tokenizer, "roberta": _roberta_tokenizer,
               "xlm-roberta": _xlm_roberta_tokenizer}


def make_tiny_bert(out: str | Path, arch: str = "bert", pooling: str = "mean",
                   normalize: bool = True, max_seq_length: int | None = None,
                   seed: int = 0, overrides: dict | None = None) -> Path:
    """overrides: config values over the tiny ones (a benchmark's real-sized shapes)."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    if pooling not in POOLING_MODES:
        raise ValueError(f"pooling must be one of {', '.join(POOLING_MODES)}, not '{pooling}'")
    out = Path(out)
    extra = overrides
    config_cls, model_cls, overrides = ARCHES[arch]
    tokenizer = _TOKENIZERS[arch]()
    config = getattr(transformers, config_cls)(**{**_BASE, **overrides, **(extra or {}),
                                                  "vocab_size": len(tokenizer)})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    model.save_pretrained(str(out))
    tokenizer.model_max_length = MAX_SEQ_LENGTH
    tokenizer.save_pretrained(str(out))

    modules = [Transformer(str(out), max_seq_length=max_seq_length),
               Pooling(config.hidden_size, pooling_mode=pooling)]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(out), create_model_card=False)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", choices=sorted(ARCHES), default="bert")
    parser.add_argument("--pooling", choices=POOLING_MODES, default="mean")
    parser.add_argument("--no-normalize", action="store_true",
                        help="no Normalize module: embeddings are not L2-normalized")
    parser.add_argument("--max-seq-length", type=int, default=None,
                        help=f"truncate inputs to this many tokens (default {MAX_SEQ_LENGTH})")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_tiny_bert(args.out_dir, args.arch, args.pooling, not args.no_normalize,
                         args.max_seq_length, args.seed))


if __name__ == "__main__":
    main()
