"""BERT-family encoders (tools/make_tiny_bert.py's tiny random models) against transformers
(last_hidden_state of each sequence alone) and sentence-transformers (pooled, normalized
embeddings), and the reading of sentence-transformers directories."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from pyserve import _native
from pyserve.errors import ModelLoadError
from pyserve.model.loader import iterate_safetensors, pack_weights, safetensors_files
from pyserve.model.models import bert
from pyserve.model.models.bert import BertEmbeddingModel, EncoderArch
from pyserve.model.sentence_transformers import EncoderPooling, read_sentence_transformers

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Paris",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100. Tokyo is the capital of Japan. Python, C++",
]
SHORT_TEXTS = ["Hello, world!", "How are you?", "Paris is nice.", "I am fine."]
LONG_TEXT = "Sentence embeddings map a text to one vector; similar texts get nearby vectors. " * 3
# directory name -> make_tiny_bert arguments
MODELS = {
    "bert": dict(arch="bert", pooling="mean"),
    "roberta": dict(arch="roberta", pooling="cls"),
    "xlm-roberta": dict(arch="xlm-roberta", pooling="lasttoken"),
    "bert-raw": dict(arch="bert", pooling="mean", normalize=False, max_seq_length=16),
}
ARCHES = ("bert", "roberta", "xlm-roberta")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from make_tiny_bert import make_tiny_bert

    root = tmp_path_factory.mktemp("tiny-bert")
    return {name: make_tiny_bert(root / name, **kwargs) for name, kwargs in MODELS.items()}


def load_ours(path) -> BertEmbeddingModel:
    arch = EncoderArch.from_hf_config(json.loads((path / "config.json").read_text()))
    model = BertEmbeddingModel(arch, torch.float32)
    loaded = model.load_weights(iterate_safetensors(safetensors_files(path)))
    assert loaded == {name for name, _ in model.named_parameters()}
    return model.eval()


def packed(ids: list[list[int]]):
    """input_ids, positions, query_start_loc of sequences packed into one batch."""
    lens = torch.tensor([len(seq) for seq in ids])
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).int()])
    return (torch.tensor([t for seq in ids for t in seq]),
            torch.cat([torch.arange(n) for n in lens.tolist()]), query_start_loc)


@pytest.mark.parametrize("kind", ARCHES)
def test_packed_forward_matches_transformers(model_dirs, kind):
    from transformers import AutoModel, AutoTokenizer

    path = model_dirs[kind]
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    batches = [[tokenizer(t)["input_ids"] for t in texts] for texts in (TEXTS, SHORT_TEXTS)]
    with torch.no_grad():
        expected = [torch.cat([hf(input_ids=torch.tensor([seq])).last_hidden_state[0]
                               for seq in ids]) for ids in batches]
        # unpacked (BLAS), our packed panels, and bfloat16x3 GEMMs on AMX where there is AMX
        for pack in (None, "panels") + (("bf16x3",) if _native.bf16x3_supported() else ()):
            ours = load_ours(path)
            if pack is not None:
                pack_weights(ours, bf16x3=pack == "bf16x3")
                qkv = ours.layers[0].qkv_proj
                assert (qkv.packed if pack == "panels" else qkv.bf16x3_weight) is not None
            for ids, reference in zip(batches, expected):
                out = ours(*packed(ids))
                assert out.shape == reference.shape
                torch.testing.assert_close(out, reference, atol=1e-4, rtol=0)


def pool(hidden: torch.Tensor, lens: list[int], pooling: EncoderPooling) -> torch.Tensor:
    pick = {"MEAN": lambda s: s.mean(0), "CLS": lambda s: s[0], "LAST": lambda s: s[-1]}
    out = torch.stack([pick[pooling.pooling_type](s) for s in hidden.split(lens)])
    return F.normalize(out, dim=-1) if pooling.normalize else out


@pytest.mark.parametrize("name", list(MODELS))
def test_embeddings_match_sentence_transformers(model_dirs, name):
    from sentence_transformers import SentenceTransformer

    from pyserve.tokenizer.tokenizer import load_tokenizer

    path = model_dirs[name]
    pooling = read_sentence_transformers(path)
    st = SentenceTransformer(str(path), device="cpu")
    texts = TEXTS + [LONG_TEXT]
    ours_tokenizer = load_tokenizer(path)
    for text in texts:
        assert ours_tokenizer.encode(text) == st.tokenizer(text)["input_ids"]
    # sentence-transformers truncates to max_seq_length, keeping the special tokens
    ids = [st.tokenizer(t, truncation=True, max_length=pooling.max_seq_length)["input_ids"]
           for t in texts]
    longest = len(ours_tokenizer.encode(LONG_TEXT))
    assert max(len(seq) for seq in ids) == min(pooling.max_seq_length, longest)
    model = load_ours(path)
    pack_weights(model)
    with torch.no_grad():
        ours = pool(model(*packed(ids)), [len(seq) for seq in ids], pooling)
    expected = st.encode(texts, convert_to_tensor=True, batch_size=len(texts))
    assert F.cosine_similarity(ours, expected).min().item() > 1 - 1e-4
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("lens,calls", [
    ([9], 1), ([5, 7, 6, 5], 1), ([3, 12, 9, 10], 1),  # padded: one call
    ([40, 3], 2), ([20, 2, 2, 2], 4), ([1, 1, 30], 3),  # too long, or too uneven: one per sequence
])
def test_packed_attention_paths(monkeypatch, lens, calls):
    """Both SDPA ways (where our kernel is not taken) against attention of each sequence alone."""
    monkeypatch.setattr(_native, "encoder_attention_supported", lambda head_size: False)
    sdpa, made = F.scaled_dot_product_attention, []
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: made.append(1) or sdpa(*a, **k))
    torch.manual_seed(0)
    qkv = torch.randn(sum(lens), 3, 4, 8)
    out = bert.packed_attention(qkv, packed([[0] * n for n in lens])[2])
    assert len(made) == calls
    _assert_each_sequence_alone(qkv, lens, out)


def _assert_each_sequence_alone(qkv, lens, out):
    for seq, got in zip(qkv.split(lens), out.split(lens)):
        q, k, v = seq.double().unbind(1)  # [L, H, D]
        weights = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1]), dim=-1)
        expected = torch.einsum("hqk,khd->qhd", weights, v)
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("head_size", [16, 32, 64, 128])
@pytest.mark.parametrize("lens", [[1], [5, 17, 1, 33], [300, 2], [64] * 9])
def test_native_encoder_attention(head_size, lens):
    """Our kernel (every head size a multiple of the build's vector width) against each
    sequence alone: lengths off and on whole vectors, rows in and out of its row groups, and
    a sequence longer than packed_attention gives it (called directly)."""
    if not _native.encoder_attention_supported(head_size):
        pytest.skip(f"this build has no vector path for head size {head_size}")
    torch.manual_seed(head_size)
    qkv = torch.randn(sum(lens), 3, 3, head_size)
    out = torch.empty(sum(lens), 3, head_size)
    _native.encoder_attention(out, qkv, packed([[0] * n for n in lens])[2], head_size ** -0.5)
    _assert_each_sequence_alone(qkv, lens, out)


@pytest.mark.parametrize("lens,native", [([5, 128, 40], True), ([5, 129, 40], False)])
def test_packed_attention_takes_our_kernel_up_to_its_length(monkeypatch, lens, native):
    if not _native.encoder_attention_supported(32):
        pytest.skip("this build has no vector path")
    calls = []
    kernel = _native.encoder_attention
    monkeypatch.setattr(_native, "encoder_attention", lambda *a: calls.append(1) or kernel(*a))
    qkv = torch.randn(sum(lens), 3, 2, 32)
    out = bert.packed_attention(qkv, packed([[0] * n for n in lens])[2])
    assert bool(calls) == native
    _assert_each_sequence_alone(qkv, lens, out)


def test_native_encoder_attention_refuses_bad_input():
    if not _native.encoder_attention_supported(32):
        pytest.skip("this build has no vector path")
    qkv, out = torch.randn(6, 3, 2, 32), torch.empty(6, 2, 32)
    with pytest.raises(RuntimeError, match="from 0 to T"):
        _native.encoder_attention(out, qkv, torch.tensor([0, 4]), 1.0)
    with pytest.raises(RuntimeError, match="contiguously"):
        _native.encoder_attention(out, torch.randn(6, 3, 2, 64)[..., :32], torch.tensor([0, 6]), 1.0)


def test_read_sentence_transformers(model_dirs, tmp_path):
    assert read_sentence_transformers(model_dirs["bert"]) == EncoderPooling("MEAN", True, 128)
    assert read_sentence_transformers(model_dirs["roberta"]) == EncoderPooling("CLS", True, 128)
    assert read_sentence_transformers(model_dirs["xlm-roberta"]) == EncoderPooling("LAST", True, 128)
    assert read_sentence_transformers(model_dirs["bert-raw"]) == EncoderPooling("MEAN", False, 16)
    assert read_sentence_transformers(tmp_path) is None  # no modules.json: a plain model


def write_st_dir(path, pooling_config: dict, extra_modules=(), sbert_config=None):
    """A sentence-transformers directory in the spelling of versions before 6."""
    modules = [{"idx": i, "name": str(i), "path": folder, "type": f"sentence_transformers.models.{kind}"}
               for i, (folder, kind) in enumerate([("", "Transformer"), ("1_Pooling", "Pooling"),
                                                   ("2_Normalize", "Normalize")])]
    (path / "modules.json").write_text(json.dumps([*modules, *extra_modules]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    (path / "sentence_bert_config.json").write_text(json.dumps(sbert_config or {}))
    return path


def legacy_pooling(**modes) -> dict:
    flags = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
             "weightedmean_tokens", "lasttoken")
    return {"word_embedding_dimension": 64,
            **{f"pooling_mode_{flag}": modes.get(flag, False) for flag in flags}}


def test_read_legacy_sentence_transformers(tmp_path):
    path = write_st_dir(tmp_path, legacy_pooling(cls_token=True),
                        sbert_config={"max_seq_length": 256, "do_lower_case": False})
    assert read_sentence_transformers(path) == EncoderPooling("CLS", True, 256)
    (path / "sentence_bert_config.json").unlink()
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": 514}))
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))
    assert read_sentence_transformers(path).max_seq_length == 512


@pytest.mark.parametrize("pooling_config,names", [
    ({"embedding_dimension": 64, "pooling_mode": "max"}, "max"),
    ({"embedding_dimension": 64, "pooling_mode": ["mean", "cls"]}, "mean, cls"),
    (legacy_pooling(weightedmean_tokens=True), "weightedmean"),
    (legacy_pooling(mean_tokens=True, max_tokens=True), "max, mean"),
])
def test_unsupported_pooling_is_refused(tmp_path, pooling_config, names):
    with pytest.raises(ModelLoadError, match=names):
        read_sentence_transformers(write_st_dir(tmp_path, pooling_config))


def test_unsupported_module_is_refused(tmp_path):
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    with pytest.raises(ModelLoadError, match="Dense"):
        read_sentence_transformers(write_st_dir(tmp_path, legacy_pooling(), [dense]))


def test_encoder_arch_from_config(model_dirs):
    cfg = json.loads((model_dirs["roberta"] / "config.json").read_text())
    arch = EncoderArch.from_hf_config(cfg)
    assert (arch.architecture, arch.position_offset, arch.max_model_len) == ("RobertaModel", 2, 128)
    assert arch.eos_token_ids == (2,)
    bert_cfg = json.loads((model_dirs["bert"] / "config.json").read_text())
    masked_lm = EncoderArch.from_hf_config({**bert_cfg, "architectures": ["BertForMaskedLM"]})
    assert (masked_lm.architecture, masked_lm.position_offset) == ("BertModel", 0)
    for bad, message in [({"architectures": ["GPT2Model"]}, "GPT2Model"),
                         ({"hidden_size": None}, "hidden_size"),
                         ({"hidden_act": "swish"}, "swish"),
                         ({"position_embedding_type": "relative_key"}, "relative_key")]:
        with pytest.raises(ModelLoadError, match=message):
            EncoderArch.from_hf_config({**bert_cfg, **bad})
    missing = dict(bert_cfg)
    del missing["num_hidden_layers"]
    with pytest.raises(ModelLoadError, match="num_hidden_layers"):
        EncoderArch.from_hf_config(missing)


def test_load_weights_takes_prefixed_names_and_skips_heads(model_dirs):
    path = model_dirs["bert"]
    model = BertEmbeddingModel(load_ours(path).arch, torch.float32)
    reference = dict(load_ours(path).named_parameters())
    weights = [(f"bert.{name}", tensor[...])
               for name, tensor in iterate_safetensors(safetensors_files(path))]
    weights += [("cls.predictions.bias", torch.zeros(3)),
                ("bert.embeddings.position_ids", torch.arange(3))]
    assert model.load_weights(weights) == set(reference)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, reference[name], atol=0, rtol=0)


def test_encoder_matmul_precision_chooses_the_gemms(model_dirs, tiny_model_factory):
    """high (the default): an encoder's linear layers run as bfloat16x3 GEMMs where the CPU has
    AMX, embedding within 1e-6 cosine of highest's float32 ones; decoders never do."""
    from pyserve import LLM
    from pyserve.config import Config
    from pyserve.executor.plan import resolve
    from pyserve.model.layers.linear import ColumnParallelLinear

    path = str(model_dirs["bert"])
    amx = _native.bf16x3_supported()
    assert resolve(Config.from_flat(model=path, device="cpu")).shard.bf16x3 == amx
    assert not resolve(Config.from_flat(model=path, device="cpu",
                                        encoder_matmul_precision="highest")).shard.bf16x3
    assert not resolve(Config.from_flat(model=str(tiny_model_factory("llama")), device="cpu")).shard.bf16x3
    texts = TEXTS + [LONG_TEXT]
    runs = {}
    for precision in ("high", "highest"):
        llm = LLM(path, device="cpu", encoder_matmul_precision=precision)
        linears = [m for m in llm.engine.executor.runner.model.modules()
                   if isinstance(m, ColumnParallelLinear)]
        assert linears and all((m.bf16x3_weight is not None) == (amx and precision == "high")
                               for m in linears)
        runs[precision] = torch.tensor([o.outputs.embedding for o in llm.embed(texts)])
        llm.shutdown()
    assert F.cosine_similarity(runs["high"], runs["highest"]).min().item() > 1 - 1e-6
